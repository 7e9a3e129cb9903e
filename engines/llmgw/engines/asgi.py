"""Small ASGI helpers shared by llmgw's own ASGI apps (the sim engine, the
gateway, the metrics listener)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["answer_lifespan"]

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[Any], Awaitable[None]]  # apps type their messages as dict or Mapping


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI ``lifespan`` scope: startup, then shutdown, then return.

    hypercorn 0.18 crashes at start (``ClosedResourceError``) when an app
    just returns on this scope instead.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

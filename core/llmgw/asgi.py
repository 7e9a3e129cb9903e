"""The ASGI types and small helpers shared by llmgw's own ASGI apps (the sim
engine, the gateway, the admin API, the metrics listener)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import trio

__all__ = [
    "WATCH_DISCONNECT",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "answer_lifespan",
    "cancel_on_disconnect",
    "while_connected",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
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


async def cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client disconnects (``http.disconnect``).

    Run it beside a handler that has read the whole request body: any later
    message on ``receive`` is the disconnect.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


#: A server's disconnect watch, under this key of the scope's
#: ``extensions`` where the server has one (llmgw's client port,
#: ``llmgw.gateway.server``): a callable taking a :class:`trio.CancelScope`
#: to cancel when the client goes away, and ``None`` to stop watching. It
#: does what :func:`cancel_on_disconnect` does, for an app that has read the
#: whole request body, without a task. Absent: use :func:`cancel_on_disconnect`.
WATCH_DISCONNECT: Final = "llmgw.watch_disconnect"


async def while_connected(
    scope: Scope, receive: Receive, work: Callable[[], Awaitable[None]]
) -> bool:
    """Run ``work`` (a handler that has read the whole request body),
    cancelled if the client goes away meanwhile: through the server's
    :data:`WATCH_DISCONNECT` where it offers one, else beside a
    :func:`cancel_on_disconnect` task.

    Returns:
        True when the client went away (``work`` was cancelled for it).

    Raises:
        Exception: what ``work`` raised, as it was (never in a group).
    """
    watch_disconnect = scope.get("extensions", _NO_EXTENSIONS).get(WATCH_DISCONNECT)
    error: Exception | None = None
    with trio.CancelScope() as watch:
        if watch_disconnect is not None:
            watch_disconnect(watch)
            try:
                await work()
            finally:
                watch_disconnect(None)
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_disconnect, receive, watch)
                try:
                    await work()
                except Exception as exc:
                    error = exc  # raised out here, not in a group
                nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return watch.cancelled_caught


_NO_EXTENSIONS: Final[dict[str, Any]] = {}

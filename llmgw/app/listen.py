"""Listeners: ``host:port`` addresses, and an ASGI app served with hypercorn.

The gateway has its own HTTP/1.1 server (``llmgw.gateway.server``); the
admin API and the metrics page are served here.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from llmgw.asgi import Receive, Scope, Send, answer_lifespan

__all__ = ["serve_asgi", "split_address", "with_lifespan"]


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``; ``[::1]:80`` gives ``("::1", 80)``
    and an empty host is ``127.0.0.1``.

    Raises:
        ValueError: the port is not a number.
    """
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve_asgi(
    app: Any,
    bind: str,
    stop: trio.Event,
    grace_s: float,
    *,
    task_status: trio.TaskStatus[str],
) -> None:
    """Serve ``app`` with hypercorn on ``bind`` (``host:port``, port 0 = any
    free one) until ``stop``; started with the bound ``host:port``. Returns
    once in-flight requests are done or ``grace_s`` seconds ran out."""
    config = HypercornConfig()
    config.bind = [bind]
    config.graceful_timeout = grace_s
    config.accesslog = None
    config.errorlog = logging.getLogger("llmgw.http")
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, app, config, shutdown_trigger=stop.wait)
        )
        task_status.started(binds[0].split("://", 1)[-1])


def with_lifespan(app: Any) -> Any:
    """``app`` plus answers to the ASGI ``lifespan`` scope, which hypercorn
    sends first (prometheus-client's app does not answer it)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await app(scope, receive, send)

    return wrapped

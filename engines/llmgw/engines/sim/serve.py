"""Serving a sim engine with hypercorn's trio worker (:func:`serve`), and
the process's entry point (:func:`main`; ``python -m llmgw.engines.sim``
and ``llmgw engine sim`` run it)."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from llmgw.engines.sim.app import SimEngine
from llmgw.engines.sim.config import KEY_ENV, SimConfig, parse_args

__all__ = ["main", "serve"]

#: hypercorn shutdown grace after SIGTERM, in seconds (open streams are cut).
_GRACEFUL_TIMEOUT = 0.5

#: Keep-alive of idle client connections, in seconds; longer than clients'
#: pool expiry (httpx: 5 s) so the server is not the one racing to close.
_KEEP_ALIVE_TIMEOUT = 75.0


def _bind(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def serve(
    config: SimConfig,
    *,
    api_key: str = "",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a sim engine until SIGTERM or SIGINT, then return.

    Prints ``sim engine listening on H:P model NAME`` (flushed) once the port
    listens, and reports the port (the kernel's choice when ``config.port``
    is 0) through ``task_status``. Open streams get
    ``_GRACEFUL_TIMEOUT`` (0.5 s) after the signal before being cut.

    Raises:
        OSError: the address cannot be bound.
    """
    app = SimEngine(config, api_key=api_key)
    hyper = HypercornConfig()
    hyper.bind = [_bind(config.host, config.port)]
    hyper.graceful_timeout = _GRACEFUL_TIMEOUT
    hyper.keep_alive_timeout = _KEEP_ALIVE_TIMEOUT
    hyper.backlog = 4096
    hyper.accesslog = None
    hyper.loglevel = "WARNING"  # errors only; the listening line is ours
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

        async def stop_signal() -> None:
            async for _ in signals:
                return

        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(
                partial(
                    hypercorn_serve,
                    cast(Any, app),  # llmgw.asgi types are mappings; hypercorn wants TypedDicts
                    hyper,
                    shutdown_trigger=stop_signal,
                    mode="asgi",
                )
            )
            port = int(binds[0].rsplit(":", 1)[1])
            print(f"sim engine listening on {config.host}:{port} model {config.model}", flush=True)
            task_status.started(port)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sim engine (flags as :func:`~llmgw.engines.sim.config.parse_args`
    reads them, the key from ``LLAMA_API_KEY``) until SIGTERM or SIGINT;
    returns the exit code (0). Exits with 2 on a bad flag."""
    config = parse_args(argv)
    api_key = os.environ.get(KEY_ENV, "")
    try:
        trio.run(partial(serve, config, api_key=api_key))
    except KeyboardInterrupt:  # SIGINT before the signal receiver was open
        pass
    return 0

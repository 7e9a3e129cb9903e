"""``llmgw bench engine``: the sim engine on the gateway's own HTTP server.

``python -m llmgw.engines.sim`` serves through hypercorn, whose layers cost
the sim about as much CPU per streamed request as the whole gateway
(``docs/performance.md``), so at high concurrency a benchmark would show the
engine's limit, not the gateway's. This runs the same
:class:`~llmgw.engines.sim.app.SimEngine` (same flags, same answers, key from
``LLAMA_API_KEY``) on :func:`llmgw.gateway.server.serve_http1` instead. It
prints ``sim engine listening on HOST:PORT model NAME`` (as the sim does)
and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import trio

from llmgw.engines.sim.app import SimEngine
from llmgw.engines.sim.config import KEY_ENV, parse_args
from llmgw.gateway.server import serve_http1

__all__ = ["run_bench_engine"]

#: Open streams' grace after the signal, in seconds.
GRACE_S = 0.5


async def run_bench_engine(argv: Sequence[str]) -> None:
    """Serve the sim engine configured by ``argv`` (the sim's own flags).

    Raises:
        SystemExit: 2 on a bad flag (argparse).
        OSError: the address cannot be bound.
    """
    config = parse_args(list(argv))
    app = SimEngine(config, api_key=os.environ.get(KEY_ENV, ""))
    host = f"[{config.host}]" if ":" in config.host else config.host
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_http1, app, f"{host}:{config.port}", stop, GRACE_S)
            port = int(bound.rsplit(":", 1)[1])
            print(f"sim engine listening on {config.host}:{port} model {config.model}", flush=True)
            async for _ in signals:
                stop.set()
                break

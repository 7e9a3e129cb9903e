"""Past saturation: llmgw degrades cleanly and leaks nothing.

Run: ``uv run python tests/bench/overload.py [--duration-s 60] [--concurrency 1024]``

Starts the sim engine and ``llmgw bench gateway`` (accounted mode) pinned to
their own cores, reads the gateway's open file descriptors and RSS (from
/proc) before, drives it far past saturation with
a closed loop of ``--concurrency`` streams for ``--duration-s``, twice,
letting it settle and reading them again after each round and prints a JSON report: requests, errors (with
samples), fds and RSS before/after. Not a pytest test (no ``test_`` prefix);
loopback only; every step bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

import trio

from llmgw.bench.load import LoadConfig, run_load
from llmgw.bench.overhead import MODEL, _cores, start_bench_gateway, start_sim_engine
from llmgw.engines.testing import stop_process


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def overload(duration_s: float, concurrency: int) -> dict[str, Any]:
    gateway_cores, engine_cores = _cores(True)
    if engine_cores is not None:
        os.sched_setaffinity(0, engine_cores)
    engine_key = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
    with tempfile.TemporaryDirectory(prefix="llmgw-overload-") as scratch:
        engine, engine_url = await start_sim_engine(engine_key, engine_cores, env)
        try:
            gateway, info = await start_bench_gateway(
                engine_url, engine_key, "accounted", Path(scratch), gateway_cores, env
            )
            try:
                url = f"http://{info['listen']}"
                # One light run first, so pools and caches exist before "before".
                await run_load(
                    LoadConfig(
                        url=url,
                        api_key=info["key"],
                        model=MODEL,
                        concurrency=16,
                        duration_s=2,
                        warmup_s=0.5,
                    )
                )
                await trio.sleep(1)
                before = {"fds": _fds(gateway.pid), "rss_mib": _rss_mib(gateway.pid)}
                rounds = []
                # Two rounds: the first fills the upstream pool (up to 512 idle
                # connections, kept on purpose); a leak shows as growth in the
                # second.
                for _ in range(2):
                    result = await run_load(
                        LoadConfig(
                            url=url,
                            api_key=info["key"],
                            model=MODEL,
                            concurrency=concurrency,
                            duration_s=duration_s,
                            warmup_s=1.0,
                            request_timeout_s=60,
                        )
                    )
                    await trio.sleep(5)  # in-flight requests end; idle ones stay pooled
                    rounds.append(
                        {
                            "result": result.to_json(),
                            "fds": _fds(gateway.pid),
                            "rss_mib": _rss_mib(gateway.pid),
                        }
                    )
                alive = gateway.returncode is None
                check = await run_load(
                    LoadConfig(
                        url=url,
                        api_key=info["key"],
                        model=MODEL,
                        concurrency=16,
                        duration_s=2,
                        warmup_s=0.5,
                    )
                )
            finally:
                await stop_process(gateway)
        finally:
            await stop_process(engine)
    return {
        "concurrency": concurrency,
        "duration_s": duration_s,
        "rounds": rounds,
        "gateway_alive_after": alive,
        "answers_after": {"requests": check.requests, "errors": check.errors},
        "before": before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=1024)
    args = parser.parse_args()
    report = trio.run(overload, args.duration_s, args.concurrency)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""``llmgw bench gateway --mode accounted`` with its store (keys, usage rows)
on SQLite and on PostgreSQL, in the same run, alternating.

Run: ``uv run python tests/bench/store_compare.py --postgres ADDRESS
[--rounds 3] [--concurrency 128] [--duration-s 10] [--json PATH]``

``ADDRESS`` is a PostgreSQL database the bench may write (a throwaway
one: each round adds a project and a key, and the usage rows). Starts the
sim engine once (64-token answers at 500 tokens/s, as ``llmgw bench
overhead``), then per round one bench gateway on SQLite (in a fresh
temporary folder) and one on PostgreSQL, in alternating order (round 1
SQLite first, round 2 PostgreSQL first, …), each measured with ``llmgw
bench load``'s closed loop (``--concurrency`` streams, 2 s warm-up). Prints
requests/s per run, the ratio PostgreSQL/SQLite per round (each round's
pair back to back) and the ratio of the medians, and the load average
before and after. Not a pytest test (no ``test_`` prefix); nothing pinned
to cores; every process stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from llmgw.bench.load import LoadConfig, run_load
from llmgw.bench.overhead import MODEL, start_bench_gateway, start_sim_engine
from llmgw.engines.testing import stop_process


async def _one(
    engine_url: str, engine_key: str, store: str | None, args: argparse.Namespace
) -> dict[str, Any]:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="llmgw-store-compare-") as folder:
        gateway, info = await start_bench_gateway(
            engine_url, engine_key, "accounted", Path(folder), None, env, store_address=store
        )
        try:
            result = await run_load(
                LoadConfig(
                    url=f"http://{info['listen']}",
                    api_key=info["key"],
                    model=MODEL,
                    concurrency=args.concurrency,
                    duration_s=args.duration_s,
                    warmup_s=2.0,
                )
            )
        finally:
            await stop_process(gateway)
    return {
        "store": "postgresql" if store else "sqlite",
        "requests_per_s": round(result.requests_per_s, 1),
        "errors": result.errors,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    engine_key = "store-compare"
    load_before = os.getloadavg()
    engine, engine_url = await start_sim_engine(engine_key, None, dict(os.environ))
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            order = [None, args.postgres] if round_ % 2 == 0 else [args.postgres, None]
            for store in order:
                run = await _one(engine_url, engine_key, store, args)
                run["round"] = round_ + 1
                runs.append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
    finally:
        await stop_process(engine)
    ratios = []
    for round_ in range(1, args.rounds + 1):
        pair = {r["store"]: r["requests_per_s"] for r in runs if r["round"] == round_}
        ratios.append(round(pair["postgresql"] / pair["sqlite"], 3))
    medians = {
        store: statistics.median(r["requests_per_s"] for r in runs if r["store"] == store)
        for store in ("sqlite", "postgresql")
    }
    return {
        "concurrency": args.concurrency,
        "duration_s": args.duration_s,
        "runs": runs,
        "ratio_per_round": ratios,
        "median_requests_per_s": medians,
        "ratio_of_medians": round(medians["postgresql"] / medians["sqlite"], 3),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres", required=True, help="A PostgreSQL address.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None)
    parsed = parser.parse_args()
    report = trio.run(main, parsed)
    text = json.dumps(report, indent=2)
    print(text)
    if parsed.json is not None:
        parsed.json.write_text(text + "\n")

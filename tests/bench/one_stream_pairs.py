"""One stream, request by request: the engine alone and gateways, alternated.

Run (from a checkout, in its environment), in front of an engine already
running (for example the llama.cpp engine ``llmgw up`` starts)::

    uv run python tests/bench/one_stream_pairs.py --systems before=../llmgw-before,after=. \\
        --engine-url http://127.0.0.1:PORT --engine-key KEY --engine-pid PID \\
        --model NAME --max-tokens 256 --extra-body '{"ignore_eos": true}' --cycles 40

A real model's speed drifts by several per cent from one 20 s run to the
next on a small machine, more than a gateway costs, so alternating whole
runs (``ab_gateways.py --direct``) cannot tell 0.96 from 0.99. This
alternates single requests instead. Each system's gateway (``llmgw bench
gateway --mode MODE`` from that checkout's ``.venv``, ``NAME=PATH@MODE``
for a mode of its own) is started once, pinned to core 0, and primed with
one request. Then each cycle sends one streamed request to the engine
alone, then one through each gateway (their order turned by one every
cycle), from this process (pinned to core 1), one at a time, each on a
new connection. A request's time runs from its send to its last byte.

Each request through a gateway is compared with the engine alone's
requests just before and just after it (the mean of the two, so a steady
drift cancels): its share is that time over its own, 1.0 being the
engine's speed. Printed: one JSON line per request, then per system the
median share with its interquartile range, the shares' mean, and the
gateway's CPU (``/proc``, user + system, threads and children) per
streamed content event. Not a pytest test (no ``test_`` prefix); loopback
only; every request has a deadline. Figures in ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from llmgw.bench.overhead import cpu_s

#: Seconds a request, or a gateway's start, may take.
STEP_TIMEOUT_S = 120.0


def _one(client: httpx.Client, url: str, key: str, body: dict[str, Any]) -> tuple[float, int]:
    """One streamed chat request: (seconds from send to the last byte,
    content events seen).

    Raises:
        RuntimeError: the answer was not a 200.
    """
    events = 0
    started = time.perf_counter()
    headers = {"authorization": f"Bearer {key}"}
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as got:
        if got.status_code != 200:
            raise RuntimeError(f"HTTP {got.status_code}: {got.read()[:200]!r}")
        for line in got.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                events += 1
    return time.perf_counter() - started, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--systems", default="before=../llmgw-before,after=.")
    parser.add_argument("--mode", default="accounted")
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--engine-key", default="")
    parser.add_argument("--engine-pid", type=int, default=0, help="its pid, for its CPU")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--extra-body", default="{}", help="more JSON fields of each request")
    args = parser.parse_args()
    systems = [
        (name, Path(root.partition("@")[0]).resolve(), root.partition("@")[2] or args.mode)
        for name, root in (s.split("=") for s in args.systems.split(","))
    ]
    if len(os.sched_getaffinity(0)) > 1 and shutil.which("taskset"):
        os.sched_setaffinity(0, {1})
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": args.max_tokens,
        "stream": True,
        **json.loads(args.extra_body),
    }
    gateways: dict[str, tuple[subprocess.Popen[str], str, str]] = {}
    data_dirs: list[str] = []
    try:
        for name, root, mode in systems:
            data_dir = tempfile.mkdtemp(prefix="pairs-gateway-")
            data_dirs.append(data_dir)
            argv = [str(root / ".venv" / "bin" / "llmgw"), "bench", "gateway"]
            argv += ["--engine-url", args.engine_url, "--engine-key", args.engine_key]
            argv += ["--model", args.model, "--mode", mode, "--data-dir", data_dir]
            if shutil.which("taskset"):
                argv = ["taskset", "-c", "0", *argv]
            gateway = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            assert gateway.stdout is not None
            info = json.loads(gateway.stdout.readline())
            gateways[name] = (gateway, "http://" + info["listen"], info["key"])
        print(json.dumps({"engine": args.engine_url, "load": os.getloadavg()}), flush=True)
        rows = _cycles(args, body, systems, gateways)
    finally:
        for gateway, _, _ in gateways.values():
            gateway.terminate()
            gateway.wait(timeout=STEP_TIMEOUT_S)
        for data_dir in data_dirs:
            shutil.rmtree(data_dir, ignore_errors=True)
    print(json.dumps(_summary(rows, [name for name, _, _ in systems])), flush=True)


def _cycles(
    args: argparse.Namespace,
    body: dict[str, Any],
    systems: list[tuple[str, Path, str]],
    gateways: dict[str, tuple[subprocess.Popen[str], str, str]],
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    # A new connection for every request, to every system alike: reusing
    # one the engine had just closed failed a run's first request
    # ("Server disconnected without sending a response").
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=STEP_TIMEOUT_S, limits=no_reuse) as client:
        for _, url, key in gateways.values():
            _one(client, url, key, body)  # primed, not counted
        _one(client, args.engine_url, args.engine_key, body)
        names = [name for name, _, _ in systems]
        for cycle in range(args.cycles + 1):
            turn = cycle % len(names)
            # The last cycle is the engine alone only: the after-reference
            # of the one before it.
            order = [] if cycle == args.cycles else names[turn:] + names[:turn]
            for name in ["engine alone", *order]:
                if name == "engine alone":
                    url, key, pid = args.engine_url, args.engine_key, 0
                else:
                    gateway, url, key = gateways[name]
                    pid = gateway.pid
                cpu_before = cpu_s(pid, tree=True) if pid else 0.0
                seconds, events = _one(client, url, key, body)
                row = {
                    "cycle": cycle,
                    "system": name,
                    "seconds": round(seconds, 4),
                    "events": events,
                    "gateway_cpu_s": round(cpu_s(pid, tree=True) - cpu_before, 4) if pid else None,
                    "load_average": os.getloadavg()[0],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _summary(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per system: each request's share of the engine's speed (the mean of
    the engine alone's times in its cycle and the next over its own time),
    their median, quartiles and mean; the gateway's CPU per content event."""
    alone = {r["cycle"]: r["seconds"] for r in rows if r["system"] == "engine alone"}
    out: dict[str, Any] = {}
    for name in names:
        mine = [r for r in rows if r["system"] == name and r["cycle"] + 1 in alone]
        shares = [
            (alone[r["cycle"]] + alone[r["cycle"] + 1]) / 2 / r["seconds"]
            for r in mine
            if r["seconds"] > 0
        ]
        if not shares:
            continue
        quartiles = statistics.quantiles(shares, n=4) if len(shares) > 1 else [shares[0]] * 3
        events = sum(r["events"] for r in mine)
        spent_s = sum(r["gateway_cpu_s"] or 0.0 for r in mine)
        out[name] = {
            "requests": len(shares),
            "share_median": round(statistics.median(shares), 4),
            "share_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
            "share_mean": round(statistics.fmean(shares), 4),
            "gateway_ms_per_event": round(spent_s / events * 1000, 4) if events else None,
        }
    return {"share of the engine alone's speed, request by request": out}


if __name__ == "__main__":
    main()

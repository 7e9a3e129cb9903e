"""Before and after: gateways of two checkouts, alternated, in front of one engine.

Run (from a checkout, in its environment)::

    git worktree add ../llmgw-before 5b91db6 && (cd ../llmgw-before && uv sync)
    uv run python tests/bench/ab_gateways.py \\
        --systems before=../llmgw-before,after=. --rounds 4 --rate 60 --mode accounted

Starts one engine (``--engine bench``: ``llmgw bench engine``, the sim on
the gateway's own server; ``sim``: ``python -m llmgw.engines.sim``) pinned
to core 1 with 64-token answers at 500 tokens/s; then, ``--rounds`` times,
each system in turn (the order reversed every other round): its ``llmgw
bench gateway --mode MODE`` (from that checkout's ``.venv``) pinned to core
0, primed for 1 s, then ``llmgw bench load`` (pinned to core 1) at
``--rate`` requests/s (open loop) or ``--concurrency`` streams for
``--duration-s``; the gateway's CPU (``/proc/PID/stat``, user + system, its
threads and children) over the whole load run is divided by its requests.
``--direct`` also runs the engine alone each round, in the alternation
(first in one round, last in the next), and prints each system's share of
the engine's speed: the engine alone's mean whole-answer time over the
system's, per round, and their median. Prints one JSON line per
run and a summary (``after / before`` of the summed CPU per request, per
pair). ``--engine-url URL --engine-key KEY --model NAME`` put the gateways
in front of an engine already running instead (a real one, e.g. the
llama.cpp engine of ``llmgw up``; ``--engine-pid`` adds its CPU), and
A system given as ``NAME=PATH@MODE`` runs in that mode instead of
``--mode`` (``off=.@unguarded,on=.@observe``: two modes of one checkout).
``--max-tokens`` sets each request's ``max_tokens`` (``--extra-body
'{"ignore_eos": true}'`` makes llama.cpp write all of them); every row also has
streamed tokens/s and the gateway's CPU per streamed token. ``--profile NAME`` records that system with py-spy (``py-spy`` on
``PATH``) into ``--out``. Not a pytest test (no ``test_`` prefix); loopback
only; every step bounded in time. Figures in ``docs/performance.md``.
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

from llmgw.bench.overhead import cpu_s

ENGINE_KEY = "sk-bench-engine"
MODEL = "bench-model"
#: Seconds any one step (a start, a load run) may take.
STEP_TIMEOUT_S = 120.0


def _engine_cpu_s(pid: int) -> float:
    """The engine's CPU seconds; 0 when its pid is not known (an outside engine)."""
    return cpu_s(pid, tree=True) if pid else 0.0


def _pinned(core: int, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *argv] if shutil.which("taskset") else argv


def _load(llmgw: str, url: str, key: str, args: argparse.Namespace, seconds: float) -> Any:
    shape = ["--rate", str(args.rate)] if args.rate else ["--concurrency", str(args.concurrency)]
    argv = [llmgw, "bench", "load", "--url", url, "--key", key, "--model", args.model, *shape]
    argv += ["--max-tokens", str(args.max_tokens), "--extra-body", args.extra_body]
    argv += ["--duration-s", str(seconds), "--warmup-s", "1" if seconds > 1 else "0", "--json"]
    out = subprocess.run(
        _pinned(1, argv), capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--systems", default="before=../llmgw-before,after=.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--mode", default="accounted")
    parser.add_argument("--engine", choices=["bench", "sim"], default="bench")
    parser.add_argument("--direct", action="store_true")
    parser.add_argument("--profile", default="")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--engine-url", default="", help="an engine already running")
    parser.add_argument("--engine-key", default=ENGINE_KEY)
    parser.add_argument("--engine-pid", type=int, default=0, help="its pid, for its CPU")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--extra-body", default="{}", help="more JSON fields of each request")
    args = parser.parse_args()
    # NAME=PATH, or NAME=PATH@MODE for a mode of its own (two modes of one checkout).
    systems = [
        (name, Path(root.partition("@")[0]).resolve(), root.partition("@")[2] or args.mode)
        for name, root in (s.split("=") for s in args.systems.split(","))
    ]
    here = Path.cwd() / ".venv" / "bin"
    llmgw = str(here / "llmgw")
    engine_argv = [str(here / "python"), "-m", "llmgw.engines.sim"]
    if args.engine == "bench":
        engine_argv = [llmgw, "bench", "engine"]
    engine_argv += ["--host", "127.0.0.1", "--port", "0", "--model", MODEL]
    engine_argv += ["--tokens", "64", "--tokens-per-second", "500"]
    engine: subprocess.Popen[str] | None = None
    engine_pid = args.engine_pid
    if not args.engine_url:
        engine = subprocess.Popen(
            _pinned(1, engine_argv),
            env={**os.environ, "LLAMA_API_KEY": ENGINE_KEY},
            stdout=subprocess.PIPE,
            text=True,
        )
        engine_pid = engine.pid
    rows: list[dict[str, Any]] = []
    try:
        if engine is not None:
            assert engine.stdout is not None
            line = engine.stdout.readline()
            engine_url = "http://" + line.split(" listening on ", 1)[1].split()[0]
        else:
            engine_url = args.engine_url
        print(json.dumps({"engine": engine_url, "load": os.getloadavg()}), flush=True)
        for round_ in range(args.rounds):
            # The engine alone takes its turn in the alternation too, so a
            # drift of the machine within a round favours no system.
            runs: list[tuple[str, Path | None, str]] = [
                *([("engine alone", None, "")] if args.direct else []),
                *systems,
            ]
            order = runs if round_ % 2 == 0 else runs[::-1]
            for name, root, mode in order:
                rows.append(_run(name, root, mode, round_, engine_pid, engine_url, llmgw, args))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if engine is not None:
            engine.terminate()
            engine.wait(timeout=STEP_TIMEOUT_S)
    sums: dict[str, list[float]] = {}
    for row in rows:
        if row.get("gateway_ms_per_request") is not None:
            sums.setdefault(row["system"], []).append(row["gateway_ms_per_request"])
    if len(systems) == 2 and all(name in sums for name, _, _ in systems):
        (first, _, _), (second, _, _) = systems
        pairs = [round(b / a, 3) for a, b in zip(sums[first], sums[second], strict=False)]
        ratio = sum(sums[second]) / sum(sums[first])
        print(json.dumps({f"{second} / {first}": round(ratio, 3), "pairs": pairs}))
    if args.direct:
        print(json.dumps(_through_direct(rows)))


def _through_direct(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system, each round's mean whole-answer time of the engine alone
    over its own (the share of the engine's speed it keeps: 1.0 is the
    engine's), and their median."""
    direct = {r["round"]: r["total_ms"]["mean"] for r in rows if r["system"] == "engine alone"}
    shares: dict[str, list[float]] = {}
    for row in rows:
        if row["system"] != "engine alone" and row["round"] in direct and row["total_ms"]["mean"]:
            share = direct[row["round"]] / row["total_ms"]["mean"]
            shares.setdefault(row["system"], []).append(round(share, 3))
    return {
        "through / direct (whole-answer time)": {
            name: {"median": statistics.median(values), "rounds": values}
            for name, values in shares.items()
        }
    }


def _run(
    name: str,
    root: Path | None,
    mode: str,
    round_: int,
    engine_pid: int,
    engine_url: str,
    llmgw: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    if root is None:
        engine_before, started = _engine_cpu_s(engine_pid), time.time()
        result = _load(llmgw, engine_url, args.engine_key, args, args.duration_s)
        wall = time.time() - started
        gateway_cpu = None
    else:
        data_dir = tempfile.mkdtemp(prefix="ab-gateway-")
        argv = [str(root / ".venv" / "bin" / "llmgw"), "bench", "gateway"]
        argv += ["--engine-url", engine_url, "--engine-key", args.engine_key]
        argv += ["--model", args.model]
        argv += ["--mode", mode, "--data-dir", data_dir]
        gateway = subprocess.Popen(_pinned(0, argv), stdout=subprocess.PIPE, text=True)
        try:
            assert gateway.stdout is not None
            info = json.loads(gateway.stdout.readline())
            url = "http://" + info["listen"]
            _load(llmgw, url, info["key"], args, 1.0)  # primed, not counted
            profiler = None
            if name == args.profile:
                output = args.out / f"profile-{name}-{round_}.txt"
                spy = ["py-spy", "record", "-p", str(gateway.pid), "-r", "200", "--idle"]
                spy += ["-d", str(int(args.duration_s) + 1), "-f", "raw", "-o", str(output)]
                profiler = subprocess.Popen(
                    spy,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            before, engine_before, started = (
                cpu_s(gateway.pid, tree=True),
                _engine_cpu_s(engine_pid),
                time.time(),
            )
            result = _load(llmgw, url, info["key"], args, args.duration_s)
            wall = time.time() - started
            gateway_cpu = cpu_s(gateway.pid, tree=True) - before
            if profiler is not None:
                profiler.wait(timeout=STEP_TIMEOUT_S)
        finally:
            gateway.terminate()
            gateway.wait(timeout=STEP_TIMEOUT_S)
            shutil.rmtree(data_dir, ignore_errors=True)
    engine_cpu = _engine_cpu_s(engine_pid) - engine_before
    rate = result["requests_per_s"] or 1.0
    tokens = result.get("tokens_per_s") or 1.0
    return {
        "round": round_,
        "system": name,
        "mode": mode,
        "requests_per_s": result["requests_per_s"],
        "errors": result["errors"],
        "ttft_ms": result["ttft_ms"],
        "total_ms": result["total_ms"],
        "gateway_cores": None if gateway_cpu is None else round(gateway_cpu / wall, 3),
        "gateway_ms_per_request": None
        if gateway_cpu is None
        else round(gateway_cpu / wall / rate * 1000, 3),
        "tokens_per_s": result.get("tokens_per_s"),
        "gateway_ms_per_token": None
        if gateway_cpu is None
        else round(gateway_cpu / wall / tokens * 1000, 4),
        "engine_ms_per_request": round(engine_cpu / wall / rate * 1000, 3) if engine_pid else None,
        "load_average": os.getloadavg()[0],
    }


if __name__ == "__main__":
    main()

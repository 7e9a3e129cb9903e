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
``--direct`` also runs the engine alone each round. Prints one JSON line per
run and a summary (``after / before`` of the summed CPU per request, per
pair). ``--profile NAME`` records that system with py-spy (``py-spy`` on
``PATH``) into ``--out``. Not a pytest test (no ``test_`` prefix); loopback
only; every step bounded in time. Figures in ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ENGINE_KEY = "sk-bench-engine"
MODEL = "bench-model"
#: Seconds any one step (a start, a load run) may take.
STEP_TIMEOUT_S = 120.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children, recursively."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            try:
                total += _cpu_s(int(child))
            except FileNotFoundError:
                pass
    return total


def _pinned(core: int, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *argv] if shutil.which("taskset") else argv


def _load(llmgw: str, url: str, key: str, args: argparse.Namespace, seconds: float) -> Any:
    shape = ["--rate", str(args.rate)] if args.rate else ["--concurrency", str(args.concurrency)]
    argv = [llmgw, "bench", "load", "--url", url, "--key", key, "--model", MODEL, *shape]
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
    args = parser.parse_args()
    systems = [
        (name, Path(root).resolve())
        for name, root in (s.split("=") for s in args.systems.split(","))
    ]
    here = Path.cwd() / ".venv" / "bin"
    llmgw = str(here / "llmgw")
    engine_argv = [str(here / "python"), "-m", "llmgw.engines.sim"]
    if args.engine == "bench":
        engine_argv = [llmgw, "bench", "engine"]
    engine_argv += ["--host", "127.0.0.1", "--port", "0", "--model", MODEL]
    engine_argv += ["--tokens", "64", "--tokens-per-second", "500"]
    engine = subprocess.Popen(
        _pinned(1, engine_argv),
        env={**os.environ, "LLAMA_API_KEY": ENGINE_KEY},
        stdout=subprocess.PIPE,
        text=True,
    )
    rows: list[dict[str, Any]] = []
    try:
        assert engine.stdout is not None
        engine_url = "http://" + engine.stdout.readline().split(" listening on ", 1)[1].split()[0]
        print(json.dumps({"engine": engine_url, "load": os.getloadavg()}), flush=True)
        for round_ in range(args.rounds):
            order = systems if round_ % 2 == 0 else systems[::-1]
            runs: list[tuple[str, Path | None]] = [("engine alone", None)] if args.direct else []
            for name, root in [*runs, *order]:
                rows.append(_run(name, root, round_, engine, engine_url, llmgw, args))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        engine.terminate()
        engine.wait(timeout=STEP_TIMEOUT_S)
    sums: dict[str, list[float]] = {}
    for row in rows:
        if row.get("gateway_ms_per_request") is not None:
            sums.setdefault(row["system"], []).append(row["gateway_ms_per_request"])
    if len(systems) == 2 and all(name in sums for name, _ in systems):
        (first, _), (second, _) = systems
        pairs = [round(b / a, 3) for a, b in zip(sums[first], sums[second], strict=False)]
        ratio = sum(sums[second]) / sum(sums[first])
        print(json.dumps({f"{second} / {first}": round(ratio, 3), "pairs": pairs}))


def _run(
    name: str,
    root: Path | None,
    round_: int,
    engine: subprocess.Popen[str],
    engine_url: str,
    llmgw: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    if root is None:
        engine_before, started = _cpu_s(engine.pid), time.time()
        result = _load(llmgw, engine_url, ENGINE_KEY, args, args.duration_s)
        wall = time.time() - started
        gateway_cpu = None
    else:
        data_dir = tempfile.mkdtemp(prefix="ab-gateway-")
        argv = [str(root / ".venv" / "bin" / "llmgw"), "bench", "gateway"]
        argv += ["--engine-url", engine_url, "--engine-key", ENGINE_KEY, "--model", MODEL]
        argv += ["--mode", args.mode, "--data-dir", data_dir]
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
            before, engine_before, started = _cpu_s(gateway.pid), _cpu_s(engine.pid), time.time()
            result = _load(llmgw, url, info["key"], args, args.duration_s)
            wall = time.time() - started
            gateway_cpu = _cpu_s(gateway.pid) - before
            if profiler is not None:
                profiler.wait(timeout=STEP_TIMEOUT_S)
        finally:
            gateway.terminate()
            gateway.wait(timeout=STEP_TIMEOUT_S)
            shutil.rmtree(data_dir, ignore_errors=True)
    engine_cpu = _cpu_s(engine.pid) - engine_before
    rate = result["requests_per_s"] or 1.0
    return {
        "round": round_,
        "system": name,
        "requests_per_s": result["requests_per_s"],
        "errors": result["errors"],
        "ttft_ms": result["ttft_ms"],
        "total_ms": result["total_ms"],
        "gateway_cores": None if gateway_cpu is None else round(gateway_cpu / wall, 3),
        "gateway_ms_per_request": None
        if gateway_cpu is None
        else round(gateway_cpu / wall / rate * 1000, 3),
        "engine_ms_per_request": round(engine_cpu / wall / rate * 1000, 3),
        "load_average": os.getloadavg()[0],
    }


if __name__ == "__main__":
    main()

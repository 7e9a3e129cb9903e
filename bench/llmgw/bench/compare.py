"""``llmgw bench compare``: the engine alone, llmgw and (optionally) an
outside gateway side by side, systems alternated.

Per concurrency and round, each system in turn (the order rotated every
round, so none always runs first): a closed loop of N streamed chat
requests (:func:`~llmgw.bench.load.run_load`) for ``duration_s`` after
``warmup_s``. llmgw is a fresh ``llmgw bench gateway --mode MODE`` per
run, primed for :data:`PRIME_S` (pinned to the first core with two or
more; the engine and this process, the load generator, to the second),
and its CPU (user + system, ``/proc/PID/stat``) over the run is divided by
its requests. The engine is
``llmgw bench engine`` (the sim on the gateway's own server, 64-token
answers at 500 tokens/s), ``python -m llmgw.engines.sim``, or a running
engine at ``engine_url``; the outside gateway (LiteLLM's proxy, say) is
given by its URL, key and model name and must already be in front of the
same engine. Figures in ``docs/performance.md``.
"""

from __future__ import annotations

import os
import secrets
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio

from llmgw.engines.testing import stop_process

from .load import LoadConfig, run_load
from .overhead import (
    ENGINE_TOKENS,
    ENGINE_TOKENS_PER_S,
    MODEL,
    _argv,
    _cores,
    _start,
    cpu_s,
    start_sim_engine,
)
from .results import LoadResult

__all__ = [
    "ENGINE_ALONE",
    "LLMGW",
    "OUTSIDE",
    "CompareRow",
    "Outside",
    "format_summary",
    "run_compare",
    "summarize",
]

ENGINE_ALONE: Final = "engine alone"
LLMGW: Final = "llmgw"
OUTSIDE: Final = "outside gateway"
#: Seconds of unmeasured load on each fresh llmgw before its run.
PRIME_S: Final = 1.0


@attrs.frozen
class CompareRow:
    """One run: ``system`` at ``concurrency`` in ``round``; ``cpu_ms_per_request``
    only for llmgw (CPU ms of the gateway process per completed request)."""

    concurrency: int
    round: int
    system: str
    result: LoadResult
    cpu_ms_per_request: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "round": self.round,
            "system": self.system,
            "cpu_ms_per_request": self.cpu_ms_per_request,
            **self.result.to_json(),
        }


@attrs.frozen
class Outside:
    """An outside gateway in front of the same engine."""

    url: str
    key: str
    model: str


async def run_compare(
    *,
    concurrency: Sequence[int],
    rounds: int = 3,
    duration_s: float = 10.0,
    warmup_s: float = 1.0,
    mode: str = "accounted",
    engine: str = "bench",
    engine_url: str | None = None,
    engine_key: str = "",
    model: str = MODEL,
    outside: Outside | None = None,
    pin: bool = True,
    on_row: Callable[[CompareRow], object] | None = None,
) -> list[CompareRow]:
    """Run every system ``rounds`` times at each concurrency; return the runs.

    Raises:
        trio.TooSlowError: a process did not start in time.
        ValueError: a bad load setting (:class:`~llmgw.bench.load.LoadConfig`).
    """
    gateway_cores, engine_cores = _cores(pin)
    if engine_cores is not None:
        os.sched_setaffinity(0, engine_cores)  # the load generator shares the engine's core
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
    rows: list[CompareRow] = []
    process: trio.Process | None = None
    try:
        if engine_url is None:
            engine_key = secrets.token_hex(32)
            process, engine_url = await _start_engine(engine, engine_key, engine_cores, env)
        systems = [ENGINE_ALONE, LLMGW] + ([OUTSIDE] if outside is not None else [])
        for clients in concurrency:
            for round_ in range(rounds):
                shift = round_ % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    load = LoadConfig(
                        url=engine_url,
                        api_key=engine_key,
                        model=model,
                        concurrency=clients,
                        duration_s=duration_s,
                        warmup_s=warmup_s,
                    )
                    cpu_ms: float | None = None
                    if system == OUTSIDE:
                        assert outside is not None
                        load = attrs.evolve(load, url=outside.url, api_key=outside.key)
                        load = attrs.evolve(load, model=outside.model)
                        result = await run_load(load)
                    elif system == LLMGW:
                        result, cpu_ms = await _through_llmgw(
                            load, engine_url, engine_key, model, mode, gateway_cores, env
                        )
                    else:
                        result = await run_load(load)
                    row = CompareRow(clients, round_, system, result, cpu_ms)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
    finally:
        if process is not None:
            await stop_process(process)
    return rows


async def _start_engine(
    kind: str, key: str, cores: set[int] | None, env: dict[str, str]
) -> tuple[trio.Process, str]:
    if kind == "sim":
        return await start_sim_engine(key, cores, env)
    argv = [sys.executable, "-m", "llmgw.cli", "bench", "engine", "--host", "127.0.0.1"]
    argv += ["--port", "0", "--model", MODEL, "--tokens", str(ENGINE_TOKENS)]
    argv += ["--tokens-per-second", str(ENGINE_TOKENS_PER_S)]
    process, line = await _start(_argv(argv, cores), {**env, "LLAMA_API_KEY": key})
    return process, "http://" + line.split(" listening on ", 1)[1].split()[0]


async def _through_llmgw(
    load: LoadConfig,
    engine_url: str,
    engine_key: str,
    model: str,
    mode: str,
    cores: set[int] | None,
    env: dict[str, str],
) -> tuple[LoadResult, float | None]:
    """One run through a fresh ``llmgw bench gateway``; its CPU ms per request."""
    with tempfile.TemporaryDirectory(prefix="llmgw-compare-") as data_dir:
        argv = [sys.executable, "-m", "llmgw.cli", "bench", "gateway", "--engine-url", engine_url]
        argv += ["--engine-key", engine_key, "--model", model, "--mode", mode]
        argv += ["--listen", "127.0.0.1:0", "--data-dir", str(Path(data_dir))]
        process, first = await _start(_argv(argv, cores), env)
        try:
            info: dict[str, Any] = orjson.loads(first)
            load = attrs.evolve(load, url="http://" + info["listen"], api_key=info["key"])
            # Primed first (not counted): a fresh process's first requests
            # pay for its lazy set-up (the guard's patterns, the store).
            await run_load(attrs.evolve(load, duration_s=PRIME_S, warmup_s=0.0))
            before = cpu_s(process.pid)
            result = await run_load(load)
            spent = cpu_s(process.pid) - before
        finally:
            await stop_process(process)
    # The CPU of the whole load run (warm-up and tail too) against the
    # requests of the measured window's rate over the same wall time.
    if not result.requests or not result.wall_s:
        return result, None
    return result, spent / (result.requests_per_s * result.wall_s) * 1000


def summarize(rows: Sequence[CompareRow]) -> list[dict[str, Any]]:
    """Per concurrency and system: medians over the rounds of requests/s,
    TTFT p50 and p99 (ms) and llmgw's CPU ms per request, the errors summed,
    and the share of the engine alone's median requests/s."""
    out: list[dict[str, Any]] = []
    keys = sorted({(row.concurrency, row.system) for row in rows}, key=_order)
    for clients, system in keys:
        runs = [r for r in rows if (r.concurrency, r.system) == (clients, system)]
        alone = [
            r.result.requests_per_s
            for r in rows
            if (r.concurrency, r.system) == (clients, ENGINE_ALONE)
        ]
        rate = statistics.median(r.result.requests_per_s for r in runs)
        cpu = [r.cpu_ms_per_request for r in runs if r.cpu_ms_per_request is not None]
        out.append(
            {
                "concurrency": clients,
                "system": system,
                "rounds": len(runs),
                "requests_per_s": rate,
                "share": rate / statistics.median(alone)
                if alone and statistics.median(alone)
                else None,
                "ttft_p50_ms": statistics.median(r.result.ttft_ms.p50 for r in runs),
                "ttft_p99_ms": statistics.median(r.result.ttft_ms.p99 for r in runs),
                "total_p99_ms": statistics.median(r.result.total_ms.p99 for r in runs),
                "errors": sum(r.result.errors for r in runs),
                "cpu_ms_per_request": statistics.median(cpu) if cpu else None,
            }
        )
    return out


def served_nothing(rows: Sequence[CompareRow]) -> list[str]:
    """The systems that answered no request in any of their runs (every
    request failed, connection failures included), in table order."""
    systems = sorted({row.system for row in rows}, key=lambda s: _order((0, s)))
    return [s for s in systems if not any(r.result.requests for r in rows if r.system == s)]


def _order(key: tuple[int, str]) -> tuple[int, int]:
    return key[0], [ENGINE_ALONE, LLMGW, OUTSIDE].index(key[1])


def format_summary(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    lines = [
        "| streams | system | req/s | share | TTFT p50 ms | TTFT p99 ms | total p99 ms | errors | llmgw CPU ms/request |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        share = "-" if row["share"] is None else f"{row['share']:.0%}"
        cpu = "-" if row["cpu_ms_per_request"] is None else f"{row['cpu_ms_per_request']:.2f}"
        lines.append(
            f"| {row['concurrency']} | {row['system']} | {row['requests_per_s']:.1f} | {share} "
            f"| {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} | {row['total_p99_ms']:.0f} "
            f"| {row['errors']} | {cpu} |"
        )
    return "\n".join(lines)

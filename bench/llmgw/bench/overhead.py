"""``llmgw bench overhead``: what the gateway adds, measured side by side.

It starts the sim engine and one gateway per mode (``llmgw bench gateway``)
as separate processes, then for each rate sends the same open-loop load
(uniform arrivals, 64-token streams) straight to the engine and through each
gateway, and reports per rate and mode:

- the added latency, time to first token and whole request, at p50 and p99
  (the gateway's percentile minus the engine's);
- the requests/s reached and the errors;
- the gateway process's CPU seconds per 1,000 requests (``/proc``).

Rates rise until a gateway saturates (it reaches under 90 % of the offered
rate, or errors appear); the next rates are then skipped for that mode.

With two or more cores the gateways are pinned to core 0 and the engine and
this process (the load generator) to core 1, so the system under test has a
core of its own. Speed goals live here, never in test assertions.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio

from llmgw.engines.testing import read_line, sim_argv, stop_process

from .load import LoadConfig, run_load
from .results import LoadResult

__all__ = [
    "DEFAULT_RATES",
    "OverheadRow",
    "run_overhead",
    "start_bench_gateway",
    "start_sim_engine",
]

DEFAULT_RATES: Final = (50.0, 100.0, 200.0, 300.0, 400.0, 600.0, 800.0, 1000.0)
#: The engine streams this many tokens at this rate (the issue's setup).
ENGINE_TOKENS: Final = 64
ENGINE_TOKENS_PER_S: Final = 500
#: A gateway reaching less than this share of the offered rate is saturated.
SATURATED_BELOW: Final = 0.9
START_TIMEOUT_S: Final = 30.0
MODEL: Final = "bench-model"


@attrs.frozen(kw_only=True)
class OverheadRow:
    """One rate through one gateway mode, against the engine alone."""

    mode: str
    rate_per_s: float
    direct: LoadResult
    through: LoadResult
    gateway_cpu_s: float

    #: Seconds of the run whose requests are not counted (its warm-up).
    warmup_s: float = 0.0

    @property
    def cpu_s_per_1000(self) -> float:
        """Gateway CPU seconds per 1,000 requests answered.

        The CPU is read over the whole run, warm-up included, while only the
        measured window's requests are counted; at a steady open-loop rate
        the warm-up's share of the CPU is taken out in proportion.
        """
        if not self.through.requests:
            return 0.0
        duration_s = self.through.duration_s
        measured_share = duration_s / (duration_s + self.warmup_s) if duration_s > 0 else 1.0
        return 1000 * self.gateway_cpu_s * measured_share / self.through.requests

    @property
    def saturated(self) -> bool:
        return (
            self.through.errors > 0
            or self.through.requests_per_s < SATURATED_BELOW * self.direct.requests_per_s
        )

    def added_ms(self) -> dict[str, float]:
        """Added latency in ms: ``ttft_p50``, ``ttft_p99``, ``total_p50``, ``total_p99``."""
        d, t = self.direct, self.through
        return {
            "ttft_p50": t.ttft_ms.p50 - d.ttft_ms.p50,
            "ttft_p99": t.ttft_ms.p99 - d.ttft_ms.p99,
            "total_p50": t.total_ms.p50 - d.total_ms.p50,
            "total_p99": t.total_ms.p99 - d.total_ms.p99,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "rate_per_s": self.rate_per_s,
            "added_ms": self.added_ms(),
            "gateway_cpu_s_per_1000": self.cpu_s_per_1000,
            "saturated": self.saturated,
            "direct": self.direct.to_json(),
            "through": self.through.to_json(),
        }


def _cores(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(gateway cores, engine and load-generator cores), or Nones when not pinning."""
    available = sorted(os.sched_getaffinity(0))
    if not pin or len(available) < 2:
        return None, None
    return {available[0]}, {available[1]}


def _argv(argv: list[str], cores: set[int] | None) -> list[str]:
    if cores is None or shutil.which("taskset") is None:
        return argv
    return ["taskset", "-c", ",".join(map(str, sorted(cores))), *argv]


async def _start(argv: list[str], env: dict[str, str]) -> tuple[trio.Process, str]:
    """Start a process and return it with its first stdout line."""
    process = await trio.lowlevel.open_process(argv, stdout=-1, env=env)
    assert process.stdout is not None
    try:
        with trio.fail_after(START_TIMEOUT_S):
            line = await read_line(process.stdout, bytearray())
    except BaseException:
        await stop_process(process)
        raise
    return process, line


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


async def start_sim_engine(
    engine_key: str, cores: set[int] | None, env: dict[str, str]
) -> tuple[trio.Process, str]:
    """Start the sim engine (64-token answers at 500 tokens/s) with ``engine_key``,
    pinned to ``cores``; return the process and its base URL."""
    process, line = await _start(
        _argv(
            sim_argv(
                MODEL,
                "--tokens",
                str(ENGINE_TOKENS),
                "--tokens-per-second",
                str(ENGINE_TOKENS_PER_S),
            ),
            cores,
        ),
        {**env, "LLAMA_API_KEY": engine_key},
    )
    return process, "http://" + line.split(" listening on ", 1)[1].split()[0]


async def start_bench_gateway(
    engine_url: str,
    engine_key: str,
    mode: str,
    data_dir: Path,
    cores: set[int] | None,
    env: dict[str, str],
) -> tuple[trio.Process, dict[str, Any]]:
    """Start ``llmgw bench gateway`` in front of the engine, pinned to
    ``cores``; return the process and its first line (``listen``, ``key``, ``pid``)."""
    process, first = await _start(
        _argv(
            [
                sys.executable,
                "-m",
                "llmgw.cli",
                "bench",
                "gateway",
                "--engine-url",
                engine_url,
                "--engine-key",
                engine_key,
                "--model",
                MODEL,
                "--mode",
                mode,
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                str(data_dir),
            ],
            cores,
        ),
        env,
    )
    info: dict[str, Any] = orjson.loads(first)
    return process, info


async def run_overhead(
    *,
    rates: Sequence[float] = DEFAULT_RATES,
    modes: Sequence[str] = ("bare", "accounted"),
    duration_s: float = 5.0,
    warmup_s: float = 1.0,
    pin: bool = True,
    on_row: Any = None,
) -> list[OverheadRow]:
    """Run the benchmark; see the module docstring.

    Args:
        rates: offered request rates (requests/s), rising.
        modes: gateway modes to measure (``bare``, ``accounted``).
        duration_s: measured seconds per run (one run direct, one per mode).
        warmup_s: seconds per run not counted.
        pin: pin the gateways and the engine to separate cores when possible.
        on_row: called with each :class:`OverheadRow` as it is measured.

    Returns:
        The rows, in the order measured.
    """
    gateway_cores, engine_cores = _cores(pin)
    if engine_cores is not None:
        os.sched_setaffinity(0, engine_cores)  # the load generator shares the engine's core
    engine_key = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
    rows: list[OverheadRow] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as scratch:
        engine, engine_url = await start_sim_engine(engine_key, engine_cores, env)
        gateways: dict[str, tuple[trio.Process, dict[str, Any]]] = {}
        try:
            for mode in modes:
                gateways[mode] = await start_bench_gateway(
                    engine_url, engine_key, mode, Path(scratch) / mode, gateway_cores, env
                )
            saturated: set[str] = set()
            for rate in rates:
                if len(saturated) == len(modes):
                    break
                direct = await run_load(
                    LoadConfig(
                        url=engine_url,
                        api_key=engine_key,
                        model=MODEL,
                        rate_per_s=rate,
                        duration_s=duration_s,
                        warmup_s=warmup_s,
                        max_tokens=ENGINE_TOKENS,
                    )
                )
                for mode in modes:
                    if mode in saturated:
                        continue
                    process, info = gateways[mode]
                    before = _cpu_s(process.pid)
                    through = await run_load(
                        LoadConfig(
                            url=f"http://{info['listen']}",
                            api_key=info["key"],
                            model=MODEL,
                            rate_per_s=rate,
                            duration_s=duration_s,
                            warmup_s=warmup_s,
                            max_tokens=ENGINE_TOKENS,
                        )
                    )
                    row = OverheadRow(
                        mode=mode,
                        rate_per_s=rate,
                        direct=direct,
                        through=through,
                        gateway_cpu_s=_cpu_s(process.pid) - before,
                        warmup_s=warmup_s,
                    )
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                    if row.saturated:
                        saturated.add(mode)
        finally:
            for process, _ in gateways.values():
                await stop_process(process)
            await stop_process(engine)
    return rows


def format_rows(rows: Sequence[OverheadRow]) -> str:
    """A plain-text table of the rows."""
    lines = [
        f"{'mode':10} {'rate/s':>7} {'got/s':>7} {'err':>5} "
        f"{'+TTFT p50':>10} {'+TTFT p99':>10} {'+total p50':>11} {'+total p99':>11} {'CPU s/1k':>9}"
    ]
    for row in rows:
        added = row.added_ms()
        mark = " saturated" if row.saturated else ""
        lines.append(
            f"{row.mode:10} {row.rate_per_s:7.0f} {row.through.requests_per_s:7.1f} "
            f"{row.through.errors:5d} {added['ttft_p50']:9.2f}ms {added['ttft_p99']:9.2f}ms "
            f"{added['total_p50']:10.2f}ms {added['total_p99']:10.2f}ms {row.cpu_s_per_1000:9.3f}{mark}"
        )
    return "\n".join(lines)

"""``llmgw bench overhead``: what the gateway adds, measured side by side.

It starts the sim engine and one gateway per mode (``llmgw bench gateway``)
as separate processes, then for each rate sends the same open-loop load
(uniform arrivals, 64-token streams) straight to the engine, through each
gateway, and straight to the engine again, and reports per rate and mode:

- the added latency, time to first token and whole request, at p50 and p99
  (the gateway's percentile minus the engine's, both engine runs'
  samples taken together), with its noise (:meth:`OverheadRow.noise_ms`:
  the 95 % intervals of both percentiles and the drift between the two
  engine runs). A difference within its noise is shown as ``~0 (±x)``,
  never as a negative latency;
- the requests/s reached and the errors;
- the gateway process's CPU seconds per 1,000 requests (``/proc``).

Rates rise until a gateway saturates (errors, under 90 % of the offered
rate reached, or a median request over :data:`SLOWER_FACTOR` times the
engine's own); the next rates are then skipped for that mode. When the
engine alone saturates (errors, or its median request over
:data:`SLOWER_FACTOR` times its median at the first rate: the engine and
the load generator share one core), the run stops there, since nothing
above that rate can be compared. Each request has a
:data:`REQUEST_TIMEOUT_S` deadline, so a saturated run ends soon after its
window. With the defaults (:data:`DEFAULT_RATES`, 2 s measured after
0.5 s of warm-up per run) the whole benchmark takes about a minute.

The processes it starts run in their own sessions: a Ctrl-C at the terminal
reaches only the benchmark, which stops them and keeps the rows measured so
far (see ``llmgw bench overhead``).

With two or more cores the gateways are pinned to core 0 and the engine and
this process (the load generator) to core 1, so the system under test has a
core of its own. Speed goals live here, never in test assertions.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio

from llmgw.engines.testing import read_line, sim_argv, stop_process

from .load import LoadConfig, run_load
from .results import LoadResult, Percentiles, percentile, percentile_halfwidth

__all__ = [
    "DEFAULT_DURATION_S",
    "DEFAULT_RATES",
    "DEFAULT_WARMUP_S",
    "SATURATION_CONCURRENCY",
    "OverheadRow",
    "cpu_s",
    "run_overhead",
    "start_bench_gateway",
    "start_sim_engine",
]

DEFAULT_RATES: Final = (50.0, 100.0, 200.0, 400.0, 800.0)
DEFAULT_DURATION_S: Final = 2.0
DEFAULT_WARMUP_S: Final = 0.5
#: Each request's deadline, in seconds: a saturated run ends this soon after its window.
REQUEST_TIMEOUT_S: Final = 5.0
#: A median request this many times slower than the reference is saturated.
SLOWER_FACTOR: Final = 2.0
#: The engine streams this many tokens at this rate (the issue's setup).
ENGINE_TOKENS: Final = 64
ENGINE_TOKENS_PER_S: Final = 500
#: Closed-loop streams of the run that finds the engine's saturation.
SATURATION_CONCURRENCY: Final = 128
#: A gateway reaching less than this share of the offered rate is saturated.
SATURATED_BELOW: Final = 0.9
START_TIMEOUT_S: Final = 30.0
MODEL: Final = "bench-model"


#: The figures of a row: (name, kind of sample, quantile).
FIGURES: Final = (
    ("ttft_p50", "ttft", 0.50),
    ("ttft_p99", "ttft", 0.99),
    ("total_p50", "total", 0.50),
    ("total_p99", "total", 0.99),
)


def _samples(result: LoadResult, kind: str) -> tuple[float, ...]:
    return result.ttfts_ms if kind == "ttft" else result.totals_ms


@attrs.frozen(kw_only=True)
class OverheadRow:
    """One rate through one gateway mode, against the engine alone.

    ``direct`` is the engine alone before the gateways' runs at this rate,
    ``direct_after`` the same run after them (None when not measured): the
    reference is both runs' samples together, and the change between them
    (the machine's load drifting) counts into the noise.
    """

    mode: str
    rate_per_s: float
    direct: LoadResult
    through: LoadResult
    gateway_cpu_s: float
    direct_after: LoadResult | None = None

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

    def _reference(self, kind: str) -> tuple[float, ...]:
        after = _samples(self.direct_after, kind) if self.direct_after is not None else ()
        return _samples(self.direct, kind) + after

    @property
    def saturated(self) -> bool:
        """Errors, under 90 % of the engine's rate, or a median request over
        :data:`SLOWER_FACTOR` times the engine's."""
        reference_ms = Percentiles.of(self._reference("total")).p50
        return (
            self.through.errors > 0
            or self.through.requests_per_s < SATURATED_BELOW * self.direct.requests_per_s
            or self.through.total_ms.p50 > SLOWER_FACTOR * reference_ms
        )

    def added_ms(self) -> dict[str, float]:
        """Added latency in ms: ``ttft_p50``, ``ttft_p99``, ``total_p50``,
        ``total_p99``, the gateway's percentile minus the reference's (may be
        below zero: see :meth:`within_noise`)."""
        return {
            name: percentile(_samples(self.through, kind), q) - percentile(self._reference(kind), q)
            for name, kind, q in FIGURES
        }

    def noise_ms(self) -> dict[str, float]:
        """Half-width of the 95 % interval of each :meth:`added_ms` figure, in
        ms: the reference's and the gateway run's percentile half-widths
        (:func:`~llmgw.bench.results.percentile_halfwidth`) and half the
        change between the two engine runs, added in quadrature."""
        noise = {}
        for name, kind, q in FIGURES:
            drift = 0.0
            if self.direct_after is not None:
                drift = percentile(_samples(self.direct_after, kind), q) - percentile(
                    _samples(self.direct, kind), q
                )
            noise[name] = math.sqrt(
                percentile_halfwidth(self._reference(kind), q) ** 2
                + percentile_halfwidth(_samples(self.through, kind), q) ** 2
                + (drift / 2) ** 2
            )
        return noise

    def within_noise(self) -> dict[str, bool]:
        """Per :meth:`added_ms` figure: its size is no more than its noise."""
        noise = self.noise_ms()
        return {name: abs(value) <= noise[name] for name, value in self.added_ms().items()}

    def to_json(self) -> dict[str, Any]:
        doc = {
            "mode": self.mode,
            "rate_per_s": self.rate_per_s,
            "added_ms": self.added_ms(),
            "noise_ms": self.noise_ms(),
            "within_noise": self.within_noise(),
            "gateway_cpu_s_per_1000": self.cpu_s_per_1000,
            "saturated": self.saturated,
            "direct": self.direct.to_json(),
            "through": self.through.to_json(),
        }
        if self.direct_after is not None:
            doc["direct_after"] = self.direct_after.to_json()
        return doc


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
    # Its own session: a Ctrl-C at the terminal reaches only the benchmark,
    # which stops its processes itself.
    process = await trio.lowlevel.open_process(argv, stdout=-1, env=env, start_new_session=True)
    assert process.stdout is not None
    try:
        with trio.fail_after(START_TIMEOUT_S):
            line = await read_line(process.stdout, bytearray())
    except BaseException:
        await stop_process(process)
        raise
    return process, line


def cpu_s(pid: int, *, tree: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc``, all its
    threads); with ``tree``, of the processes under it too (a child gone
    meanwhile counts 0).

    Raises:
        FileNotFoundError: no process ``pid``.
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if tree and children.exists():
        for child in children.read_text().split():
            try:
                total += cpu_s(int(child), tree=True)
            except FileNotFoundError:
                pass
    return total


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
    store_address: str | None = None,
) -> tuple[trio.Process, dict[str, Any]]:
    """Start ``llmgw bench gateway`` in front of the engine, pinned to
    ``cores``, its store at ``store_address`` (``None``: SQLite in
    ``data_dir``); return the process and its first line (``listen``,
    ``key``, ``pid``)."""
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
                *(["--store", store_address] if store_address else []),
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
    duration_s: float = DEFAULT_DURATION_S,
    warmup_s: float = DEFAULT_WARMUP_S,
    pin: bool = True,
    on_row: Callable[[OverheadRow], object] | None = None,
    on_note: Callable[[str], object] | None = None,
    half_saturation: bool = False,
    saturation_concurrency: int = SATURATION_CONCURRENCY,
) -> list[OverheadRow]:
    """Run the benchmark; see the module docstring.

    Args:
        rates: offered request rates (requests/s), rising.
        modes: gateway modes to measure (``bare``, ``accounted``,
            ``unguarded``, ``observe``: ``llmgw.bench.gateway``).
        duration_s: measured seconds per run (per rate: the engine alone,
            each mode, the engine alone again).
        warmup_s: seconds per run not counted.
        pin: pin the gateways and the engine to separate cores when possible.
        on_row: called with each :class:`OverheadRow` as it is measured.
        on_note: called with a line saying why the rates stopped early,
            and with the saturation found for ``half_saturation``.
        half_saturation: instead of ``rates``, one rate: half the requests/s
            the engine alone serves closed-loop to ``saturation_concurrency``
            streams (measured first, ``duration_s`` after ``warmup_s``, the
            load generator on the engine's core as for the rates): the added
            TTFT at half saturation (``docs/performance.md``).
        saturation_concurrency: the streams of that closed-loop run.

    Returns:
        The rows, in the order measured. Cancelled (a Ctrl-C), it stops its
        processes and the cancellation goes on; ``on_row`` has had every row
        measured until then.
    """
    gateway_cores, engine_cores = _cores(pin)
    if engine_cores is not None:
        os.sched_setaffinity(0, engine_cores)  # the load generator shares the engine's core
    engine_key = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
    rows: list[OverheadRow] = []

    def load(url: str, key: str, rate: float) -> LoadConfig:
        return LoadConfig(
            url=url,
            api_key=key,
            model=MODEL,
            rate_per_s=rate,
            duration_s=duration_s,
            warmup_s=warmup_s,
            max_tokens=ENGINE_TOKENS,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )

    reference_ms = 0.0  # the engine's median request at the first rate

    def engine_saturated(result: LoadResult, rate: float) -> bool:
        """Errors, or a median request over SLOWER_FACTOR times the reference (noted)."""
        if not result.errors and result.total_ms.p50 <= SLOWER_FACTOR * reference_ms:
            return False
        if on_note is not None:
            on_note(
                f"the engine alone saturates at {rate:g} requests/s on this machine "
                f"(median request {result.total_ms.p50:.0f} ms against {reference_ms:.0f} ms "
                f"at {rates[0]:g}/s, {result.errors} errors): this rate and higher ones "
                "cannot be compared, stopping"
            )
        return True

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-") as scratch:
        engine, engine_url = await start_sim_engine(engine_key, engine_cores, env)
        gateways: dict[str, tuple[trio.Process, dict[str, Any]]] = {}
        try:
            if half_saturation:
                served = await _saturation(load, engine_url, engine_key, saturation_concurrency)
                rates = [float(max(1, round(served / 2)))]
                if on_note is not None:
                    on_note(
                        f"the engine alone serves {served:.1f} requests/s to "
                        f"{saturation_concurrency} streams: measuring at half, {rates[0]:g}/s"
                    )
            for mode in modes:
                gateways[mode] = await start_bench_gateway(
                    engine_url, engine_key, mode, Path(scratch) / mode, gateway_cores, env
                )
            saturated: set[str] = set()
            for rate in rates:
                if len(saturated) == len(modes):
                    break
                direct = await run_load(load(engine_url, engine_key, rate))
                reference_ms = reference_ms or direct.total_ms.p50
                if engine_saturated(direct, rate):
                    break
                measured: list[tuple[str, LoadResult, float]] = []
                for mode in modes:
                    if mode in saturated:
                        continue
                    process, info = gateways[mode]
                    before = cpu_s(process.pid)
                    through = await run_load(load(f"http://{info['listen']}", info["key"], rate))
                    measured.append((mode, through, cpu_s(process.pid) - before))
                direct_after = await run_load(load(engine_url, engine_key, rate))
                if engine_saturated(direct_after, rate):
                    break  # this rate's rows would compare against a saturated engine
                for mode, through, spent_s in measured:
                    row = OverheadRow(
                        mode=mode,
                        rate_per_s=rate,
                        direct=direct,
                        through=through,
                        gateway_cpu_s=spent_s,
                        direct_after=direct_after,
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


async def _saturation(
    load: Callable[[str, str, float], LoadConfig], url: str, key: str, concurrency: int
) -> float:
    """The requests/s the engine at ``url`` serves closed-loop to
    ``concurrency`` streams (the run otherwise shaped as ``load``'s).

    Raises:
        RuntimeError: the engine answered nothing.
    """
    shape = attrs.evolve(load(url, key, 1.0), rate_per_s=None, concurrency=concurrency)
    result = await run_load(shape)
    if not result.requests:
        raise RuntimeError(f"the engine at {url} answered nothing to {concurrency} streams")
    return result.requests_per_s


#: Each added-latency column: its heading and its key in :meth:`OverheadRow.added_ms`.
_COLUMNS: Final = (
    ("+TTFT p50", "ttft_p50"),
    ("+TTFT p99", "ttft_p99"),
    ("+total p50", "total_p50"),
    ("+total p99", "total_p99"),
)
_CELL: Final = 17
#: The table's last line: what its cells mean.
LEGEND: Final = (
    "added ms = through the gateway minus the engine alone, ± the 95 % noise of that "
    "difference; ~0 = within the noise"
)


def format_added(value_ms: float, noise_ms: float) -> str:
    """One added-latency cell: ``+1.23 ±0.40`` or, when ``|value_ms|`` is no
    more than ``noise_ms``, ``~0 (±0.40)``; ``noise_ms`` is shown with two
    figures after the point below 10 ms, none above."""
    digits = 2 if noise_ms < 10 else 0
    if abs(value_ms) <= noise_ms:
        return f"~0 (±{noise_ms:.{digits}f})"
    return f"{value_ms:+.{digits}f} ±{noise_ms:.{digits}f}"


def format_rows(rows: Sequence[OverheadRow]) -> str:
    """A plain-text table of the rows: a heading line, then one line per row."""
    heading = "".join(f" {title:>{_CELL}}" for title, _ in _COLUMNS)
    lines = [f"{'mode':10} {'rate/s':>7} {'got/s':>7} {'err':>5}{heading} {'CPU s/1k':>9}"]
    for row in rows:
        added, noise = row.added_ms(), row.noise_ms()
        cells = "".join(f" {format_added(added[key], noise[key]):>{_CELL}}" for _, key in _COLUMNS)
        mark = " saturated" if row.saturated else ""
        lines.append(
            f"{row.mode:10} {row.rate_per_s:7.0f} {row.through.requests_per_s:7.1f} "
            f"{row.through.errors:5d}{cells} {row.cpu_s_per_1000:9.3f}{mark}"
        )
    return "\n".join(lines)

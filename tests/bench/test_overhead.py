"""`llmgw bench overhead`: a one-second run gives numbers with their noise;
differences within the noise never read as negative latencies; a Ctrl-C
ends it cleanly with what it measured (no bound on speed is asserted: speed
goals live in the benchmark, not in the test suite)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from llmgw.bench.overhead import OverheadRow, format_added, format_rows
from llmgw.bench.results import LoadResult, Percentiles, percentile_halfwidth

BENCH = [sys.executable, "-m", "llmgw.cli", "bench", "overhead"]


def _result(ttfts_ms: list[float], totals_ms: list[float]) -> LoadResult:
    return LoadResult(
        requests=len(totals_ms),
        errors=0,
        error_samples=(),
        duration_s=1.0,
        requests_per_s=float(len(totals_ms)),
        tokens_per_s=0.0,
        ttft_ms=Percentiles.of(ttfts_ms),
        total_ms=Percentiles.of(totals_ms),
        itl_ms=Percentiles.of([]),
        concurrency=None,
        rate_per_s=float(len(totals_ms)),
        ttfts_ms=tuple(ttfts_ms),
        totals_ms=tuple(totals_ms),
    )


def _noisy(rng: random.Random, centre_ms: float, n: int = 200) -> list[float]:
    return [rng.gauss(centre_ms, 5.0) for _ in range(n)]


def _row(direct: LoadResult, through: LoadResult, after: LoadResult | None = None) -> OverheadRow:
    return OverheadRow(
        mode="bare",
        rate_per_s=100.0,
        direct=direct,
        through=through,
        gateway_cpu_s=0.1,
        direct_after=after,
    )


def test_the_halfwidth_of_a_percentile_shrinks_with_more_samples_and_is_zero_for_one() -> None:
    rng = random.Random(1)
    few = percentile_halfwidth(_noisy(rng, 100.0, 50), 0.5)
    many = percentile_halfwidth(_noisy(rng, 100.0, 5000), 0.5)
    assert 0 < many < few
    assert percentile_halfwidth([3.0], 0.5) == 0.0


def test_a_gateway_as_fast_as_the_engine_is_within_noise_and_shown_as_about_zero() -> None:
    rng = random.Random(2)
    # The gateway's run is a little faster by chance: the difference is negative.
    direct = _result(_noisy(rng, 20.0), _noisy(rng, 150.0))
    through = _result(_noisy(rng, 19.5), _noisy(rng, 149.5))
    row = _row(direct, through)
    added, noise, within = row.added_ms(), row.noise_ms(), row.within_noise()
    assert within["ttft_p50"]
    assert within["total_p50"]
    assert abs(added["ttft_p50"]) <= noise["ttft_p50"]
    line = format_rows([row]).splitlines()[1]
    assert "~0 (±" in line
    assert "-" not in line.split("bare", 1)[1]  # no negative latency anywhere in the row


def test_a_gateway_that_adds_time_shows_it_with_its_noise() -> None:
    rng = random.Random(3)
    direct = _result(_noisy(rng, 20.0), _noisy(rng, 150.0))
    through = _result(_noisy(rng, 60.0), _noisy(rng, 190.0))
    row = _row(direct, through)
    assert not row.within_noise()["ttft_p50"]
    assert 35.0 < row.added_ms()["ttft_p50"] < 45.0
    assert format_added(40.0, 1.5) == "+40.00 ±1.50"
    assert format_added(-0.5, 1.5) == "~0 (±1.50)"
    assert format_added(400.0, 25.0) == "+400 ±25"


def test_a_drift_between_the_two_engine_runs_counts_into_the_noise() -> None:
    rng = random.Random(4)
    before = _result(_noisy(rng, 20.0), _noisy(rng, 150.0))
    after = _result(_noisy(rng, 60.0), _noisy(rng, 190.0))
    through = _result(_noisy(rng, 40.0), _noisy(rng, 170.0))
    steady = _row(before, through).noise_ms()["ttft_p50"]
    drifting = _row(before, through, after).noise_ms()["ttft_p50"]
    assert drifting > steady + 15.0
    assert _row(before, through, after).within_noise()["ttft_p50"]


def test_a_one_second_overhead_run_reports_both_modes_with_numbers_and_noise() -> None:
    result = subprocess.run(
        [*BENCH, "--rates", "20", "--duration-s", "1", "--warmup-s", "0.5", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = doc["rows"]
    assert [row["mode"] for row in rows] == ["bare", "accounted"]
    figures = {"ttft_p50", "ttft_p99", "total_p50", "total_p99"}
    for row in rows:
        assert row["through"]["requests"] > 0
        assert row["direct"]["requests"] > 0
        assert row["direct_after"]["requests"] > 0
        assert set(row["added_ms"]) == figures
        assert set(row["noise_ms"]) == figures
        assert all(noise >= 0 for noise in row["noise_ms"].values())
        assert row["gateway_cpu_s_per_1000"] >= 0
    assert "interrupted" not in doc


def _marked_pids(mark: str) -> set[int]:
    """Processes whose environment holds ``mark``."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark.encode() in (proc / "environ").read_bytes():
                pids.add(int(proc.name))
        except OSError:
            pass
    return pids


def _wait_for(condition: object, what: str, deadline_s: float = 60.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_ctrl_c_ends_the_benchmark_cleanly_with_what_it_measured() -> None:
    name, value = "LLMGW_TEST_MARK", uuid.uuid4().hex
    mark = f"{name}={value}"
    # A terminal's Ctrl-C signals the whole foreground group: so does this test.
    bench = subprocess.Popen(
        [*BENCH, "--rates", "20,20,20,20", "--duration-s", "1", "--warmup-s", "0.2"],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, name: value},
        start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert bench.stderr is not None
        lines.extend(bench.stderr)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        _wait_for(lambda: any(line.startswith("accounted") for line in lines), "a rate's rows")
        # The engine and both gateways run (the benchmark itself is marked too).
        assert len(_marked_pids(mark) - {bench.pid}) == 3
        os.killpg(bench.pid, signal.SIGINT)
        bench.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        reader.join(timeout=10)
        assert bench.stderr is not None
        bench.stderr.close()
    stderr = "".join(lines)
    assert bench.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "interrupted: " in stderr
    assert stderr.count("\nbare ") >= 1  # the rows measured before the Ctrl-C
    _wait_for(lambda: not _marked_pids(mark), "the processes to be gone", 15.0)

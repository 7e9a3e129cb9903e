"""A one-second run of `llmgw bench overhead`: numbers come out (no bound is
asserted: speed goals live in the benchmark, not in the test suite)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_one_second_overhead_run_reports_both_modes_with_numbers() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw.cli",
            "bench",
            "overhead",
            "--rates",
            "20",
            "--duration-s",
            "1",
            "--warmup-s",
            "0.5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [row["mode"] for row in rows] == ["bare", "accounted"]
    for row in rows:
        assert row["through"]["requests"] > 0
        assert row["direct"]["requests"] > 0
        assert set(row["added_ms"]) == {"ttft_p50", "ttft_p99", "total_p50", "total_p99"}
        assert row["gateway_cpu_s_per_1000"] >= 0

"""``llmgw bench overhead --half-saturation``: one rate, half what the engine
alone serves closed-loop, found first and named (``docs/performance.md``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

BENCH = [sys.executable, "-m", "llmgw.cli", "bench", "overhead"]


def test_half_saturation_measures_one_rate_half_the_engines_closed_loop_rate() -> None:
    result = subprocess.run(
        [
            *BENCH,
            "--half-saturation",
            "--saturation-concurrency",
            "8",
            "--modes",
            "accounted",
            "--duration-s",
            "1",
            "--warmup-s",
            "0.5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    (note,) = doc["notes"]
    found = re.fullmatch(
        r"the engine alone serves ([0-9.]+) requests/s to 8 streams: measuring at half, ([0-9.]+)/s",
        note,
    )
    assert found is not None, note
    served, half = float(found[1]), float(found[2])
    assert half == max(1, round(served / 2))
    (row,) = doc["rows"]
    assert row["mode"] == "accounted"
    assert row["rate_per_s"] == half == doc["half_saturation_per_s"]
    assert row["through"]["requests"] > 0
    assert {"ttft_p50", "ttft_p99"} <= set(row["added_ms"])


def test_half_saturation_needs_a_positive_stream_count() -> None:
    result = subprocess.run(
        [*BENCH, "--half-saturation", "--saturation-concurrency", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--saturation-concurrency" in result.stderr

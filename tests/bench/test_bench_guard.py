"""``llmgw bench guard`` runs and reports every figure."""

from __future__ import annotations

from llmgw.bench.guard import run_bench_guard


def test_the_guard_bench_reports_each_policy_and_the_re_loop() -> None:
    rows = run_bench_guard(seconds=0.01)
    assert {(row["what"], row["policy"]) for row in rows} >= {
        ("prompt scan, prose", "baseline"),
        ("prompt scan, numbers", "observe"),
        ("64-token answer streamed", "baseline"),
        ("64-event stream relayed, leading spaces", "observe"),
        ("64-event stream relayed, trailing spaces", "off"),
    }
    assert all(row["us"] > 0 for row in rows)

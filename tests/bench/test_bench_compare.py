"""``llmgw bench compare``: every system measured in turn, llmgw's CPU per
request, shares of the engine alone; an outside gateway by URL."""

from __future__ import annotations

import pytest
import trio

from llmgw.bench.compare import (
    ENGINE_ALONE,
    LLMGW,
    OUTSIDE,
    Outside,
    format_summary,
    run_compare,
    summarize,
)
from llmgw.engines.testing import open_sim

KEY = "k" * 64


@pytest.mark.slow
async def test_compare_alternates_the_systems_and_measures_llmgw() -> None:
    with trio.fail_after(240):
        async with open_sim("--tokens", "8", "--tokens-per-second", "0", api_key=KEY) as sim:
            url = f"http://127.0.0.1:{sim.port}"
            # The sim itself stands in for an outside gateway in front of it.
            rows = await run_compare(
                concurrency=[2],
                rounds=2,
                duration_s=2.0,
                warmup_s=0.3,
                engine_url=url,
                engine_key=KEY,
                model="sim-model",
                outside=Outside(url, KEY, "sim-model"),
                pin=False,
            )
    assert [row.system for row in rows] == [
        ENGINE_ALONE,
        LLMGW,
        OUTSIDE,
        LLMGW,
        OUTSIDE,
        ENGINE_ALONE,
    ]
    for row in rows:
        assert row.result.requests > 0, row
        assert row.result.errors == 0, row.result.error_samples
        assert (row.cpu_ms_per_request is not None) == (row.system == LLMGW)
    summary = summarize(rows)
    assert [s["system"] for s in summary] == [ENGINE_ALONE, LLMGW, OUTSIDE]
    assert summary[0]["share"] == 1.0
    assert summary[1]["cpu_ms_per_request"] > 0
    assert all(s["rounds"] == 2 and s["errors"] == 0 for s in summary)
    table = format_summary(summary)
    assert "| 2 | llmgw |" in table

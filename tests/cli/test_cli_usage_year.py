"""``llmgw ctl usage --by … --since 365d`` answers from the roll-ups: a year
of sums after the raw rows past the retention were pruned."""

from __future__ import annotations

import time

from llmgw.accounting.retention import prune_usage_past
from llmgw.store import UsageRow
from tests.cli.test_cli_ctl import Running, running  # noqa: F401 (the fixture)

DAY = 86_400.0


def row(n: int, at: float, key: str, *, status: int = 200) -> UsageRow:
    return UsageRow(
        request_id=f"req_{n:03d}",
        created_at=at,
        key_id=key,
        model="gemma",
        served_model="gemma-small" if n % 2 else "",
        status=status,
        prompt_tokens=1000 * (n + 1),
        cached_tokens=n,
        completion_tokens=10 * (n + 1),
        cost_micros=100_000 * (n + 1),
        project_id="proj_1",
        team_id="team_1",
        org_id="org_1",
    )


async def test_a_year_of_sums_is_read_from_the_roll_ups_after_pruning(
    running: Running,  # noqa: F811
) -> None:
    now = time.time()
    days_back = [364.5, 300, 200, 120, 91, 60, 1, 0.001]
    rows = [
        row(n, now - d * DAY, ("key_a", "key_b")[n % 2], status=502 if n == 2 else 200)
        for n, d in enumerate(days_back)
    ]
    await running.store.insert_usage([*rows, row(99, now - 400 * DAY, "key_a")])
    assert await prune_usage_past(running.store, 90, now) == 6
    kept = await running.store.export_usage(0.0, None)
    assert [r.request_id for r in kept] == ["req_005", "req_006", "req_007"]

    doc = await running.json("ctl", "usage", "--by", "key", "--since", "365d")
    assert [(g["name"], g["requests"], g["errors"]) for g in doc["data"]] == [
        ("key_b", 4, 0),
        ("key_a", 4, 1),
    ]
    for group in doc["data"]:
        mine = [r for r in rows if r.key_id == group["name"]]
        assert group["cost_micros"] == sum(r.cost_micros for r in mine)
        assert group["prompt_tokens"] == sum(r.prompt_tokens for r in mine)
        assert group["completion_tokens"] == sum(r.completion_tokens for r in mine)
        assert group["cached_tokens"] == sum(r.cached_tokens for r in mine)

    by_model = await running.json("ctl", "usage", "--by", "model", "--since", "365d")
    assert {g["name"]: g["requests"] for g in by_model["data"]} == {"gemma": 4, "gemma-small": 4}
    by_org = await running.json("ctl", "usage", "--by", "org", "--since", "100d")
    assert [(g["name"], g["requests"]) for g in by_org["data"]] == [("org_1", 4)]

    table = await running.ok("ctl", "usage", "--by", "team", "--since", "365d")
    header, line = table.splitlines()
    assert header.split() == [
        "team", "requests", "errors", "prompt", "cached", "completion", "cost",
    ]  # fmt: skip
    assert line.split()[:3] == ["team_1", "8", "1"]


async def test_the_retention_is_set_live_and_refused_below_a_day(
    running: Running,  # noqa: F811
) -> None:
    assert (await running.ok("ctl", "config", "get", "auth.usage_retain_days")).strip() == "90"
    out = await running.ok("ctl", "config", "set", "auth.usage_retain_days", "400")
    assert out.strip().startswith("auth.usage_retain_days = 400 (settings version 2)")
    assert running.cluster.settings.auth.usage_retain_days == 400  # what the pruner reads
    result = await running.run("ctl", "config", "set", "auth.usage_retain_days", "0")
    assert result.exit_code == 1
    assert "usage_retain_days" in result.output
    assert running.cluster.settings.auth.usage_retain_days == 400

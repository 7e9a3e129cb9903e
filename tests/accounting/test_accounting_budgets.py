"""Budget periods and spend counters."""

from __future__ import annotations

import datetime as dt
import logging

import pytest

from llmgw.accounting.budgets import Budgets, period_end, period_start


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return dt.datetime(year, month, day, hour, minute, second, tzinfo=dt.UTC).timestamp()


TEAM = "team:t_1"


def test_period_start_is_the_utc_day_and_month() -> None:
    now = utc(2026, 1, 31, 23, 59, 30)
    assert period_start("day", now) == utc(2026, 1, 31)
    assert period_start("month", now) == utc(2026, 1, 1)
    assert period_end("day", now) == utc(2026, 2, 1)
    assert period_end("month", now) == utc(2026, 2, 1)
    assert period_end("month", utc(2026, 12, 15)) == utc(2027, 1, 1)


def test_an_unknown_period_is_refused() -> None:
    with pytest.raises(ValueError, match="week"):
        period_start("week", 0.0)  # type: ignore[arg-type]


def test_spend_rolls_over_from_2026_01_31_23_59_utc_into_february() -> None:
    budgets = Budgets()
    jan = utc(2026, 1, 31, 23, 59)
    budgets.add(TEAM, "month", 700, utc(2026, 1, 2))
    budgets.add(TEAM, "month", 300, jan)
    budgets.add(TEAM, "day", 300, jan)
    assert budgets.spent(TEAM, "month", jan) == 1000
    assert budgets.spent(TEAM, "day", jan) == 300

    feb = utc(2026, 2, 1, 0, 0, 1)
    assert budgets.spent(TEAM, "month", feb) == 0
    assert budgets.spent(TEAM, "day", feb) == 0
    budgets.add(TEAM, "month", 5, feb)
    assert budgets.spent(TEAM, "month", feb) == 5


def test_the_day_counter_starts_again_at_the_end_of_a_day_but_the_month_goes_on() -> None:
    budgets = Budgets()
    budgets.add(TEAM, "day", 40, utc(2026, 3, 10, 23, 59, 59))
    budgets.add(TEAM, "month", 40, utc(2026, 3, 10, 23, 59, 59))
    next_day = utc(2026, 3, 11)
    assert budgets.spent(TEAM, "day", next_day) == 0
    assert budgets.spent(TEAM, "month", next_day) == 40


def test_restore_sets_the_counters_from_the_store_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budgets = Budgets()
    now = utc(2026, 5, 20, 12)
    budgets.add(TEAM, "day", 999, now)
    with caplog.at_level(logging.INFO, logger="llmgw.accounting"):
        budgets.restore(
            {(TEAM, "day"): 400, ("key:a", "day"): 150, ("key:a", "month"): 9_000}, "day", now
        )
    assert budgets.spent(TEAM, "day", now) == 400
    assert budgets.spent("key:a", "day", now) == 150
    assert budgets.spent("key:a", "month", now) == 0  # the other period's figure
    [record] = caplog.records
    assert "restored budgets from the store" in record.getMessage()
    assert "2 counters (1 keys)" in record.getMessage()
    assert "2026-05-20T00:00:00+00:00" in record.getMessage()


def test_catch_up_raises_counters_to_the_store_and_never_lowers_one() -> None:
    budgets = Budgets()
    now = utc(2026, 5, 20, 12)
    budgets.add("key:own", "day", 900, now)
    budgets.add("team:shared", "day", 100, now)
    budgets.catch_up(
        {("key:own", "day"): 400, ("team:shared", "day"): 700, ("key:unseen", "day"): 50},
        "day",
        now,
    )
    assert budgets.spent("key:own", "day", now) == 900
    assert budgets.spent("team:shared", "day", now) == 700
    assert budgets.spent("key:unseen", "day", now) == 50


def test_counters_of_ended_periods_are_pruned() -> None:
    budgets = Budgets()
    budgets.add(TEAM, "day", 1, utc(2026, 5, 20))
    budgets.add(TEAM, "month", 1, utc(2026, 5, 20))
    assert budgets.prune(utc(2026, 5, 21)) == 1
    assert len(budgets) == 1

"""Spend counters per scope and period.

Periods are the UTC **day** and **month**; a counter starts again at 0 at each
boundary. Amounts are integer micro-units (``_micros``); times are UTC epoch
seconds passed in as ``now``. A team's counter is one counter that every key
below the team feeds: the accountant adds each request's cost to every scope
on its path.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping
from typing import Literal, get_args

import attrs

__all__ = ["PERIODS", "Budgets", "Period", "period_end", "period_start"]

log = logging.getLogger("llmgw.accounting")

Period = Literal["day", "month"]
PERIODS: tuple[Period, ...] = get_args(Period)


def _utc(now: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(now, dt.UTC)


def period_start(period: Period, now: float) -> float:
    """Start of ``now``'s UTC day or month (epoch seconds)."""
    when = _utc(now)
    if period == "day":
        start = when.replace(hour=0, minute=0, second=0, microsecond=0)
    elif period == "month":
        start = when.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    else:
        raise ValueError(f"unknown budget period {period!r}: day or month")
    return start.timestamp()


def period_end(period: Period, now: float) -> float:
    """Start of the UTC day or month after ``now``'s (epoch seconds)."""
    start = _utc(period_start(period, now))
    if period == "day":
        return (start + dt.timedelta(days=1)).timestamp()
    if start.month == 12:
        return start.replace(year=start.year + 1, month=1).timestamp()
    return start.replace(month=start.month + 1).timestamp()


@attrs.define(slots=True)
class _Spend:
    start: float
    micros: int = 0


class Budgets:
    """One spend counter per (scope, period), rolling over at period boundaries."""

    def __init__(self) -> None:
        self._spend: dict[tuple[str, Period], _Spend] = {}
        # period → (start, end) of the last period computed; saves date maths.
        self._bounds: dict[Period, tuple[float, float]] = {}

    def _start(self, period: Period, now: float) -> float:
        bounds = self._bounds.get(period)
        if bounds is None or not bounds[0] <= now < bounds[1]:
            bounds = (period_start(period, now), period_end(period, now))
            self._bounds[period] = bounds
        return bounds[0]

    def _counter(self, scope: str, period: Period, now: float) -> _Spend:
        start = self._start(period, now)
        spend = self._spend.get((scope, period))
        if spend is None:
            spend = self._spend[(scope, period)] = _Spend(start)
        elif spend.start < start:
            spend.start, spend.micros = start, 0
        return spend

    def spent(self, scope: str, period: Period, now: float) -> int:
        """Micro-units ``scope`` spent in ``now``'s period."""
        spend = self._spend.get((scope, period))
        if spend is None or spend.start < self._start(period, now):
            return 0
        return spend.micros

    def add(self, scope: str, period: Period, micros: int, now: float) -> None:
        """Add ``micros`` to ``scope``'s counter for ``now``'s period (a new
        period starts from 0)."""
        self._counter(scope, period, now).micros += micros

    def restore(
        self, spend_by_scope: Mapping[tuple[str, str], int], period: Period, now: float
    ) -> None:
        """Set the counters of ``period`` to the store's figures (start-up).

        ``spend_by_scope`` maps (scope, period) → micro-units spent since
        ``period_start(period, now)``; entries for the other period are skipped.
        """
        since = self._start(period, now)
        counters = 0
        keys = 0
        for (scope, entry_period), micros in spend_by_scope.items():
            if entry_period != period:
                continue
            self._counter(scope, period, now).micros = micros
            counters += 1
            keys += scope.startswith("key:")
        log.info(
            "restored budgets from the store: %d counters (%d keys) for the %s since %s",
            counters,
            keys,
            period,
            _utc(since).isoformat(),
        )

    def catch_up(
        self, store_figures: Mapping[tuple[str, str], int], period: Period, now: float
    ) -> None:
        """Raise each counter of ``period`` to the store's figure, never lower
        one: this router's own spend not yet written puts it ahead of the store."""
        for (scope, entry_period), micros in store_figures.items():
            if entry_period != period:
                continue
            spend = self._counter(scope, period, now)
            spend.micros = max(spend.micros, micros)

    def forget(self, scope: str) -> None:
        """Drop ``scope``'s counters (both periods)."""
        for period in PERIODS:
            self._spend.pop((scope, period), None)

    def prune(self, now: float) -> int:
        """Drop counters of periods that have ended; returns how many."""
        old = [
            entry
            for entry, spend in self._spend.items()
            if spend.start < self._start(entry[1], now)
        ]
        for entry in old:
            del self._spend[entry]
        return len(old)

    def __len__(self) -> int:
        return len(self._spend)

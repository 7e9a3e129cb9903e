"""Sliding-window rate limiter.

One :class:`Limiter` counts requests, another tokens. A *counter* names a key
or a tree scope (``"key:key_abc"``, ``"project:p_1"``). Each counter has a
:class:`Window` of one minute: this minute's count, the previous minute's,
and the same two figures received from other control planes ("others").
The rate weighs the previous minute by how much of it still lies inside the
trailing minute::

    rate = (previous + others_previous) * (1 - elapsed_s / 60) + current + others_current

Times are UTC epoch seconds passed in as ``now`` (``_s`` = seconds); nothing
here reads a clock, sleeps or does I/O.

Across routers (active-active) each router sends its own :meth:`Limiter.counts`
and feeds the sum of the others' to :meth:`Limiter.set_others`, which
*replaces* what it had from them, so the same figures received twice count once
and a router's own counts never come back to it as "others".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Final

import attrs

__all__ = ["WINDOW_S", "Counts", "Limiter", "Window", "minute_of"]

#: The window, one minute, in seconds.
WINDOW_S: Final = 60.0
#: Slack for float rounding when comparing a rate with a limit.
_EPSILON: Final = 1e-9


def minute_of(now: float) -> float:
    """``now`` truncated to its minute (epoch seconds)."""
    return float(math.floor(now / WINDOW_S) * WINDOW_S)


@attrs.define(slots=True)
class Window:
    """One counter's minute.

    Attributes:
        start: the minute ``current`` counts (epoch seconds, a multiple of 60).
        current: this router's count in ``start``'s minute.
        previous: this router's count in the minute before.
        others_current: the other routers' count in ``start``'s minute.
        others_previous: the other routers' count in the minute before.
    """

    start: float
    current: int = 0
    previous: int = 0
    others_current: int = 0
    others_previous: int = 0

    def roll(self, now: float) -> None:
        """Move the window to ``now``'s minute: one minute on, ``current``
        becomes ``previous``; two or more, everything is 0. A clock that went
        back leaves the window as it is."""
        if now < self.start + WINDOW_S:
            return  # still ``start``'s minute (or a clock that went back)
        minute = minute_of(now)
        if minute <= self.start:
            return
        if minute - self.start == WINDOW_S:
            self.previous, self.current = self.current, 0
            self.others_previous, self.others_current = self.others_current, 0
        else:
            self.current = self.previous = self.others_current = self.others_previous = 0
        self.start = minute

    def rate(self, now: float) -> float:
        """The count over the trailing minute ending at ``now`` (after :meth:`roll`)."""
        cur = self.current + self.others_current
        prev = self.previous + self.others_previous
        elapsed_s = max(now - self.start, 0.0)
        if elapsed_s >= WINDOW_S:
            return float(cur)
        return prev * (1.0 - elapsed_s / WINDOW_S) + cur

    def idle(self) -> bool:
        """True when nothing is counted in either minute, here or elsewhere."""
        return not (self.current or self.previous or self.others_current or self.others_previous)

    def seconds_to_reset(self, now: float) -> float:
        """Seconds from ``now`` until the window resets (after :meth:`roll`):
        the end of this minute, when the previous minute's count has left
        the rate and this minute's begins to weigh less; 0 when nothing is
        counted. Never more than :data:`WINDOW_S` (a clock that went back
        reads as the minute's start). How long until a given cost fits is
        :meth:`seconds_until_fits`; until the rate is back to 0,
        :meth:`seconds_to_empty` (up to two minutes)."""
        if self.idle():
            return 0.0
        return min(max(self.start + WINDOW_S - now, 0.0), WINDOW_S)

    def seconds_to_empty(self, now: float) -> float:
        """Seconds from ``now`` until the rate is back to 0 with nothing new
        counted: a count in this minute weighs until the end of the next one."""
        if self.current or self.others_current:
            return max(self.start + 2 * WINDOW_S - now, 0.0)
        if self.previous or self.others_previous:
            return max(self.start + WINDOW_S - now, 0.0)
        return 0.0

    def seconds_until_fits(self, limit: int, cost: int, now: float) -> float:
        """Seconds from ``now`` until ``rate + cost <= limit`` if nothing new is
        counted meanwhile (0 when it fits now). A cost above the limit never
        fits: then the time until the window is empty."""
        cur = self.current + self.others_current
        prev = self.previous + self.others_previous
        elapsed_s = max(now - self.start, 0.0)
        if cost > limit:
            return self.seconds_to_empty(now)
        if cur + cost <= limit:
            # Within this minute, once the previous minute's share is small enough.
            if prev <= 0:
                return 0.0
            room = limit - cur - cost
            needed_s = WINDOW_S * (1.0 - room / prev)
            return max(needed_s - elapsed_s, 0.0)
        # Only in the next minute, where this minute's count becomes "previous".
        needed_s = WINDOW_S * (1.0 - (limit - cost) / cur)
        return max(WINDOW_S - elapsed_s, 0.0) + max(needed_s, 0.0)


@attrs.frozen
class Counts:
    """A router's absolute counts per counter, as exchanged between routers.

    Attributes:
        minute: the minute ``current`` counts (epoch seconds, a multiple of 60).
        current: counter → count in ``minute``.
        previous: counter → count in the minute before.
    """

    minute: float
    current: dict[str, int] = attrs.field(factory=dict)
    previous: dict[str, int] = attrs.field(factory=dict)

    def add(self, other: Counts) -> Counts:
        """The sum of both, aligned on the newer minute (a new :class:`Counts`;
        neither is changed). Same minute: both maps add. One minute apart: the
        older one's ``current`` adds to the newer one's ``previous`` (its own
        ``previous`` is out of the window). Two or more apart: the older is
        ignored, which absorbs clock skew at minute edges."""
        if other.minute > self.minute:
            return other.add(self)
        if other.minute == self.minute:
            return Counts(
                self.minute,
                _sum(self.current, other.current),
                _sum(self.previous, other.previous),
            )
        if self.minute - other.minute == WINDOW_S:
            return Counts(self.minute, dict(self.current), _sum(self.previous, other.current))
        return Counts(self.minute, dict(self.current), dict(self.previous))

    def aligned(self, minute: float) -> tuple[dict[str, int], dict[str, int]]:
        """(current, previous) as seen from ``minute``: shifted by one when
        these counts are a minute older, empty when older still. Counts from
        a later minute (the sender's clock ahead) are taken as ``minute``'s."""
        if self.minute >= minute:
            return dict(self.current), dict(self.previous)
        if minute - self.minute == WINDOW_S:
            return {}, dict(self.current)
        return {}, {}


def _sum(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for counter, n in b.items():
        out[counter] = out.get(counter, 0) + n
    return out


class Limiter:
    """Sliding-window counters, one :class:`Window` per counter name.

    Limits are per minute; a limit of ``None`` or ``0`` means unlimited.
    """

    def __init__(self) -> None:
        self._windows: dict[str, Window] = {}

    def _window(self, counter: str, now: float) -> Window:
        window = self._windows.get(counter)
        if window is None:
            window = self._windows[counter] = Window(start=minute_of(now))
        else:
            window.roll(now)
        return window

    def fits(self, counter: str, limit: int | None, cost: int, now: float) -> bool:
        """Whether ``cost`` more would be admitted now (counts nothing)."""
        if not limit or limit <= 0:
            return True
        return self.rate(counter, now) + cost <= limit + _EPSILON

    def allow(self, counter: str, limit: int | None, cost: int, now: float) -> bool:
        """Admit ``cost`` if ``rate + cost <= limit`` and count it; else refuse
        and count nothing. ``None`` or ``0`` limit: always admitted (and counted)."""
        if not self.fits(counter, limit, cost, now):
            return False
        self.charge(counter, cost, now)
        return True

    def charge(self, counter: str, cost: int, now: float, charged_at: float | None = None) -> None:
        """Count ``cost`` without checking a limit (settling an estimate).

        A positive cost adds to this minute. A negative cost (an estimate
        larger than the actual usage) takes back from the minute the estimate
        was counted in — ``charged_at``'s, or this minute when not given —
        never below 0; an estimate counted two or more minutes ago has left
        the window and nothing is taken back.
        """
        if cost == 0:
            return
        window = self._window(counter, now)
        if cost > 0:
            window.current += cost
            return
        minute = minute_of(now if charged_at is None else charged_at)
        if minute >= window.start:
            window.current = max(window.current + cost, 0)
        elif window.start - minute == WINDOW_S:
            window.previous = max(window.previous + cost, 0)

    def rate(self, counter: str, now: float) -> float:
        """The counter's count over the trailing minute (here and elsewhere)."""
        window = self._windows.get(counter)
        if window is None:
            return 0.0
        window.roll(now)
        return window.rate(now)

    def remaining(self, counter: str, limit: int, now: float) -> int:
        """Whole units still admitted under ``limit`` now (``x-ratelimit-remaining-*``)."""
        return max(math.floor(limit - self.rate(counter, now) + _EPSILON), 0)

    def seconds_to_reset(self, counter: str, now: float) -> float:
        """Seconds until the counter's window resets, at most
        :data:`WINDOW_S` (``x-ratelimit-reset-*``; :meth:`Window.seconds_to_reset`)."""
        window = self._windows.get(counter)
        if window is None:
            return 0.0
        window.roll(now)
        return window.seconds_to_reset(now)

    def retry_after_s(self, counter: str, limit: int, cost: int, now: float) -> int:
        """Whole seconds, at least 1, until ``cost`` would fit under ``limit``
        if nothing new is counted (``Retry-After`` of a refusal). A cost above
        the limit can never fit: the time until the window is empty."""
        window = self._windows.get(counter)
        if window is None:
            return 1
        window.roll(now)
        wait_s = window.seconds_until_fits(limit, cost, now)
        return max(math.ceil(wait_s - _EPSILON), 1)

    def forget(self, counter: str) -> None:
        """Drop the counter (a revoked key)."""
        self._windows.pop(counter, None)

    def prune(self, now: float) -> int:
        """Drop counters with nothing in the trailing two minutes (idle for
        2+ minutes); returns how many were dropped."""
        idle = []
        for counter, window in self._windows.items():
            window.roll(now)
            if window.idle():
                idle.append(counter)
        for counter in idle:
            del self._windows[counter]
        return len(idle)

    def counts(self, now: float) -> Counts:
        """This router's own figures (never the others'), as of ``now``'s minute."""
        current: dict[str, int] = {}
        previous: dict[str, int] = {}
        for counter, window in self._windows.items():
            window.roll(now)
            if window.current:
                current[counter] = window.current
            if window.previous:
                previous[counter] = window.previous
        return Counts(minute_of(now), current, previous)

    def set_others(self, counts: Counts, now: float) -> None:
        """Replace the other routers' figures with ``counts`` (their sum).

        Counts a minute old move to ``previous``; older ones count nothing.
        A counter seen only elsewhere gets a window here, so it is limited
        from its first local request.
        """
        current, previous = counts.aligned(minute_of(now))
        for window in self._windows.values():
            window.roll(now)
            window.others_current = window.others_previous = 0
        for counter in current.keys() | previous.keys():
            cur, prev = current.get(counter, 0), previous.get(counter, 0)
            if cur or prev:
                window = self._window(counter, now)
                window.others_current, window.others_previous = cur, prev

    def __len__(self) -> int:
        return len(self._windows)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._windows))

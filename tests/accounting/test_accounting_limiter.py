"""The sliding-window limiter."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llmgw.accounting.limiter import Counts, Limiter, Window, minute_of


def at(hour: int, minute: int, second: float = 0.0) -> float:
    """2026-03-01 at the given UTC time, as epoch seconds."""
    base = dt.datetime(2026, 3, 1, hour, minute, tzinfo=dt.UTC).timestamp()
    return base + second


K = "key:k"


def test_two_control_planes_each_admit_6_of_10_and_refuse_after_exchanging_counts() -> None:
    now = at(12, 0, 20)
    a, b = Limiter(), Limiter()
    assert all(a.allow(K, 10, 1, now) for _ in range(6))
    assert all(b.allow(K, 10, 1, now) for _ in range(6))

    a_counts, b_counts = a.counts(now), b.counts(now)
    a.set_others(b_counts, now)
    b.set_others(a_counts, now)

    assert not a.allow(K, 10, 1, now)
    assert not b.allow(K, 10, 1, now)
    assert a.rate(K, now) == 12
    assert b.rate(K, now) == 12


def test_receiving_the_same_counts_twice_leaves_the_rate_at_12() -> None:
    now = at(12, 0, 20)
    a, b = Limiter(), Limiter()
    for _ in range(6):
        a.allow(K, 10, 1, now)
        b.allow(K, 10, 1, now)
    a.set_others(b.counts(now), now)
    a.set_others(b.counts(now), now)
    assert a.rate(K, now) == 12


def test_a_control_planes_own_6_are_never_double_counted_as_others() -> None:
    now = at(12, 0, 20)
    a, b = Limiter(), Limiter()
    for _ in range(6):
        a.allow(K, 10, 1, now)
        b.allow(K, 10, 1, now)
    b.set_others(a.counts(now), now)
    a.set_others(b.counts(now), now)
    # Its own counts carry only its own 6, never what it heard from b.
    assert a.counts(now).current == {K: 6}
    assert b.counts(now).current == {K: 6}
    b.set_others(a.counts(now), now)
    assert a.rate(K, now) == 12
    assert b.rate(K, now) == 12


def test_10_spent_elsewhere_at_12_00_50_weigh_8_33_at_12_01_10() -> None:
    other = Limiter()
    assert other.allow(K, 100, 10, at(12, 0, 50))
    mine = Limiter()
    mine.set_others(other.counts(at(12, 0, 50)), at(12, 0, 50))
    assert mine.rate(K, at(12, 1, 10)) == pytest.approx(10 * 5 / 6)


def test_late_counts_for_the_previous_minute_go_to_previous_3_weigh_2_5() -> None:
    late = Counts(minute=minute_of(at(12, 0)), current={K: 3})
    mine = Limiter()
    mine.set_others(late, at(12, 1, 10))
    assert mine.rate(K, at(12, 1, 10)) == pytest.approx(2.5)
    # A counter seen only elsewhere is limited from its first local request.
    assert mine.allow(K, 4, 1, at(12, 1, 10))  # 2.5 + 1 <= 4
    assert not mine.allow(K, 4, 1, at(12, 1, 10))  # 3.5 + 1 > 4


def test_counts_two_minutes_old_count_nothing_here() -> None:
    mine = Limiter()
    mine.set_others(Counts(minute=minute_of(at(12, 0)), current={K: 50}), at(12, 2, 0))
    assert mine.rate(K, at(12, 2, 0)) == 0


def test_counts_add_current_2_previous_1_plus_5_is_6_and_two_minute_old_counts_are_discarded() -> (
    None
):
    now = Counts(minute=minute_of(at(12, 2)), current={K: 2}, previous={K: 1})
    one_older = Counts(minute=minute_of(at(12, 1)), current={K: 5}, previous={K: 40})
    two_older = Counts(minute=minute_of(at(12, 0)), current={K: 70}, previous={K: 80})

    total = now.add(one_older).add(two_older)

    assert total.minute == minute_of(at(12, 2))
    assert total.current == {K: 2}
    assert total.previous == {K: 6}
    # Aligning does not depend on which side is older.
    assert two_older.add(one_older.add(now)) == total


def test_counts_of_the_same_minute_add_counter_by_counter() -> None:
    m = minute_of(at(12, 0))
    a = Counts(m, {K: 1, "key:x": 2}, {K: 3})
    b = Counts(m, {K: 4}, {"key:y": 5})
    assert a.add(b) == Counts(m, {K: 5, "key:x": 2}, {K: 3, "key:y": 5})


def test_one_minute_on_current_becomes_previous_and_two_minutes_on_everything_resets() -> None:
    window = Window(start=minute_of(at(12, 0)), current=4, previous=9, others_current=2)
    window.roll(at(12, 1, 30))
    assert (window.current, window.previous, window.others_current, window.others_previous) == (
        0,
        4,
        0,
        2,
    )
    window.current = 7
    window.roll(at(12, 3, 0))
    assert window.idle()
    assert window.start == minute_of(at(12, 3))


def test_the_rate_weighs_the_previous_minute_by_what_is_left_of_it() -> None:
    limiter = Limiter()
    limiter.allow(K, 0, 60, at(12, 0, 59))
    assert limiter.rate(K, at(12, 1, 0)) == 60
    assert limiter.rate(K, at(12, 1, 15)) == pytest.approx(45)
    assert limiter.rate(K, at(12, 1, 59.999)) == pytest.approx(0.001, abs=1e-6)
    assert limiter.rate(K, at(12, 2, 0)) == 0


def test_a_missing_or_zero_limit_is_unlimited() -> None:
    limiter = Limiter()
    assert all(limiter.allow(K, None, 1_000, at(12, 0)) for _ in range(10))
    assert all(limiter.allow(K, 0, 1_000, at(12, 0)) for _ in range(10))


def test_a_refused_cost_counts_nothing() -> None:
    limiter = Limiter()
    assert limiter.allow(K, 10, 8, at(12, 0))
    assert not limiter.allow(K, 10, 3, at(12, 0))
    assert limiter.rate(K, at(12, 0)) == 8
    assert limiter.allow(K, 10, 2, at(12, 0))


def test_a_negative_charge_lowers_current_but_never_below_zero() -> None:
    limiter = Limiter()
    limiter.charge(K, 5, at(12, 0))
    limiter.charge(K, -3, at(12, 0, 10))
    assert limiter.rate(K, at(12, 0, 10)) == 2
    limiter.charge(K, -30, at(12, 0, 20))
    assert limiter.rate(K, at(12, 0, 20)) == 0


def test_a_negative_charge_takes_back_from_the_minute_the_estimate_was_counted_in() -> None:
    limiter = Limiter()
    limiter.charge(K, 100, at(12, 0, 50))
    limiter.charge(K, 5, at(12, 1, 0))
    limiter.charge(K, -80, at(12, 1, 0), charged_at=at(12, 0, 50))
    assert limiter.counts(at(12, 1, 0)) == Counts(minute_of(at(12, 1)), {K: 5}, {K: 20})
    # Two minutes on the estimate has left the window: nothing to take back.
    limiter.charge(K, -5, at(12, 2, 0), charged_at=at(12, 0, 50))
    assert limiter.counts(at(12, 2, 0)) == Counts(minute_of(at(12, 2)), {}, {K: 5})


@pytest.mark.parametrize(
    ("counted", "when", "limit", "cost"),
    [
        ([(at(12, 0, 10), 10)], at(12, 0, 30), 10, 1),
        ([(at(12, 0, 10), 6)], at(12, 0, 30), 10, 5),
        ([(at(11, 59, 30), 9), (at(12, 0, 5), 1)], at(12, 0, 20), 10, 4),
        ([(at(11, 59, 30), 9)], at(12, 0, 1), 10, 3),
        ([(at(12, 0, 59), 4)], at(12, 0, 59.5), 10, 7),
        ([(at(12, 0, 0), 3)], at(12, 0, 1), 2, 3),
    ],
)
def test_retry_after_is_a_whole_second_when_the_cost_fits_and_not_much_earlier(
    counted: list[tuple[float, int]], when: float, limit: int, cost: int
) -> None:
    limiter = Limiter()
    for t, n in counted:
        limiter.charge(K, n, t)
    assert not limiter.fits(K, limit, cost, when)
    wait_s = limiter.retry_after_s(K, limit, cost, when)
    assert wait_s >= 1
    if cost <= limit:
        assert limiter.fits(K, limit, cost, when + wait_s)
        assert wait_s == 1 or not limiter.fits(K, limit, cost, when + wait_s - 1)
    else:
        assert limiter.rate(K, when + wait_s) == 0


def test_seconds_to_reset_is_the_end_of_the_window_and_zero_once_nothing_is_counted() -> None:
    limiter = Limiter()
    assert limiter.seconds_to_reset(K, at(12, 0)) == 0
    limiter.charge(K, 3, at(12, 0, 10))
    assert limiter.seconds_to_reset(K, at(12, 0, 10)) == 50
    # The count is now the previous minute's: it weighs until this one ends.
    assert limiter.seconds_to_reset(K, at(12, 1, 10)) == 50
    assert limiter.rate(K, at(12, 1, 10)) > 0
    assert limiter.seconds_to_reset(K, at(12, 2, 0)) == 0
    assert limiter.rate(K, at(12, 2, 0)) == 0
    # The time until the rate is back to 0 is another figure (up to two minutes).
    window = Window(start=minute_of(at(12, 0)), current=3)
    assert window.seconds_to_empty(at(12, 0, 10)) == 110


#: One step of a counter's life: (seconds on from the last step, which may
#: be negative for a clock that went back; the cost charged then).
_steps = st.lists(
    st.tuples(
        st.floats(min_value=-90, max_value=200, allow_nan=False),
        st.integers(min_value=-50, max_value=500),
    ),
    max_size=30,
)


@settings(max_examples=500)
@given(
    start=st.floats(min_value=0, max_value=10**10, allow_nan=False),
    steps=_steps,
    others=st.tuples(st.integers(0, 1000), st.integers(0, 1000)),
    probe_s=st.floats(min_value=-120, max_value=300, allow_nan=False),
)
def test_seconds_to_reset_never_exceeds_the_window_and_is_zero_only_when_the_rate_is(
    start: float, steps: list[tuple[float, int]], others: tuple[int, int], probe_s: float
) -> None:
    limiter = Limiter()
    now = start
    for i, (step_s, cost) in enumerate(steps):
        now += step_s
        if i == len(steps) // 2:
            cur, prev = others
            limiter.set_others(Counts(minute_of(now), {K: cur}, {K: prev}), now)
        limiter.charge(K, cost, now, charged_at=now - abs(step_s))
        reset_s = limiter.seconds_to_reset(K, now)
        assert 0 <= reset_s <= 60
    when = now + probe_s
    reset_s = limiter.seconds_to_reset(K, when)
    assert 0 <= reset_s <= 60
    if reset_s == 0:
        assert limiter.rate(K, when) == 0
    if limiter.rate(K, when) > 0:
        assert reset_s > 0


def test_forget_drops_a_counter() -> None:
    limiter = Limiter()
    limiter.allow(K, 1, 1, at(12, 0))
    limiter.forget(K)
    assert limiter.rate(K, at(12, 0)) == 0
    assert limiter.allow(K, 1, 1, at(12, 0))


def test_counters_idle_for_two_minutes_are_pruned() -> None:
    limiter = Limiter()
    limiter.charge("key:old", 1, at(12, 0, 30))
    limiter.charge("key:new", 1, at(12, 1, 30))
    assert limiter.prune(at(12, 2, 0)) == 1
    assert list(limiter) == ["key:new"]
    assert limiter.prune(at(12, 3, 0)) == 1
    assert len(limiter) == 0


@given(
    earlier=st.integers(0, 50),
    earlier_at_s=st.floats(0, 59.99),
    recent=st.integers(0, 50),
    recent_at_s=st.floats(0, 59.99),
    elapsed_s=st.floats(0, 59.99),
    limit=st.integers(1, 60),
    cost=st.integers(1, 60),
)
def test_a_refused_cost_always_fits_once_its_retry_after_has_passed(
    earlier: int,
    earlier_at_s: float,
    recent: int,
    recent_at_s: float,
    elapsed_s: float,
    limit: int,
    cost: int,
) -> None:
    limiter = Limiter()
    limiter.charge(K, earlier, at(11, 59, earlier_at_s))
    recent_at = at(12, 0, min(recent_at_s, elapsed_s))
    limiter.charge(K, recent, recent_at)
    when = at(12, 0, elapsed_s)
    assume(not limiter.fits(K, limit, cost, when))
    wait_s = limiter.retry_after_s(K, limit, cost, when)
    assert 1 <= wait_s <= 120
    if cost <= limit:
        assert limiter.fits(K, limit, cost, when + wait_s)
    else:
        assert limiter.rate(K, when + wait_s) == 0

"""The per-endpoint breaker: closed → open → half-open → closed/open."""

from __future__ import annotations

import attrs
import pytest

from llmgw.router.breaker import (
    FAILURES_TO_OPEN,
    OPEN_FOR_S,
    RETRY_AFTER_MAX_S,
    Breaker,
    BreakerState,
    counts_as_failure,
    earliest_recovery,
    parse_retry_after_s,
)


def state(breaker: Breaker) -> BreakerState:
    """Read afresh (mypy would keep a narrowed ``breaker.state``)."""
    return breaker.state


def test_five_consecutive_failures_open_it_and_a_success_in_between_resets_the_count() -> None:
    breaker = Breaker()
    for _ in range(FAILURES_TO_OPEN - 1):
        breaker.failure(0.0)
    breaker.success()
    for _ in range(FAILURES_TO_OPEN - 1):
        breaker.failure(0.0, status=502)
    assert state(breaker) is BreakerState.CLOSED
    assert breaker.allow(1.0)
    breaker.failure(1.0, status=503)
    assert state(breaker) is BreakerState.OPEN
    assert breaker.open_until == 1.0 + OPEN_FOR_S
    assert not breaker.allow(1.0 + OPEN_FOR_S - 0.001)


def test_a_single_429_opens_it_for_the_providers_retry_after_within_bounds() -> None:
    breaker = Breaker()
    breaker.failure(10.0, status=429, retry_after_s=7.0)
    assert breaker.open_until == 17.0
    other = Breaker()
    other.failure(10.0, status=429, retry_after_s=10_000.0)
    assert other.open_until == 10.0 + RETRY_AFTER_MAX_S
    tiny = Breaker()
    tiny.failure(10.0, status=429, retry_after_s=0.0)
    assert tiny.open_until == 11.0


def test_half_open_lets_exactly_one_probe_through_and_its_success_closes() -> None:
    breaker = Breaker()
    breaker.failure(0.0, status=429)
    assert breaker.available(OPEN_FOR_S)
    assert breaker.allow(OPEN_FOR_S)
    assert state(breaker) is BreakerState.HALF_OPEN
    assert not breaker.available(OPEN_FOR_S + 1)
    assert not breaker.allow(OPEN_FOR_S + 1)
    breaker.success()
    assert state(breaker) is BreakerState.CLOSED
    assert breaker.allow(OPEN_FOR_S + 2)
    assert breaker.consecutive_failures == 0


def test_a_failed_probe_opens_it_again_and_an_abandoned_one_frees_the_next_probe() -> None:
    breaker = Breaker()
    breaker.failure(0.0, status=500, retry_after_s=None)
    breaker.failure(0.0, status=429)
    assert breaker.allow(100.0)
    breaker.failure(100.0)  # one failure is enough in half-open
    assert state(breaker) is BreakerState.OPEN
    assert breaker.open_until == 100.0 + OPEN_FOR_S
    assert breaker.allow(200.0)
    breaker.abandon()
    assert breaker.allow(200.0)


def test_available_does_not_take_the_probe() -> None:
    breaker = Breaker()
    breaker.failure(0.0, status=429)
    for _ in range(3):
        assert breaker.available(50.0)
    assert breaker.allow(50.0)


def test_failures_reported_while_open_only_extend_it() -> None:
    breaker = Breaker()
    breaker.failure(0.0, status=429, retry_after_s=100.0)
    breaker.failure(1.0, status=500)  # a request sent before it opened
    assert breaker.open_until == 100.0
    breaker.failure(90.0, status=429, retry_after_s=60.0)
    assert breaker.open_until == 150.0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="failures_to_open"):
        Breaker(failures_to_open=0)
    with pytest.raises(ValueError, match="open_for_s"):
        Breaker(open_for_s=0)


def test_counts_as_failure() -> None:
    assert counts_as_failure(429)
    assert counts_as_failure(502)
    assert counts_as_failure(503)
    assert not counts_as_failure(200)
    assert not counts_as_failure(400)
    assert not counts_as_failure(401)


@attrs.define
class _Holder:
    breaker: Breaker = attrs.field(factory=Breaker)


def test_earliest_recovery_is_the_first_open_breaker_to_turn_half_open() -> None:
    assert earliest_recovery([]) is None
    a, b, c = _Holder(), _Holder(), _Holder()
    assert earliest_recovery([a, b, c]) is None
    a.breaker.failure(0.0, status=429, retry_after_s=50.0)
    b.breaker.failure(0.0, status=429, retry_after_s=20.0)
    assert earliest_recovery([a, b, c]) == 20.0
    assert earliest_recovery([a]) == 50.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (b"", None),
        (b"30", 30.0),
        ("  2.5 ", 2.5),
        (b"soon", None),
        (b"Thu, 01 Jan 1970 00:01:40 GMT", 60.0),
        (b"Thu, 01 Jan 1970 00:00:10 GMT", 0.0),
    ],
)
def test_parse_retry_after(value: bytes | str | None, expected: float | None) -> None:
    assert parse_retry_after_s(value, now_wall=40.0) == expected


def test_an_engine_failing_one_request_is_the_requests_fault_not_the_replicas() -> None:
    # llama.cpp: 500 "tools param requires --jinja flag", 501 no embeddings.
    assert not counts_as_failure(500)
    assert not counts_as_failure(501)
    assert counts_as_failure(504)
    assert counts_as_failure(429)

"""The accountant along a key's path (a level only narrows, the strictest limit wins, every
limited level is charged)."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from llmgw.accounting.accountant import (
    Accountant,
    BudgetSpent,
    ModelNotAllowed,
    RateLimited,
    Reservation,
    ScopeLimits,
    catch_up_budgets,
    format_reset,
)
from llmgw.accounting.budgets import period_start
from llmgw.accounting.prices import PriceBook
from llmgw.settings import Price

NOW = dt.datetime(2026, 3, 1, 12, 0, 10, tzinfo=dt.UTC).timestamp()
GPT = Price(prompt_per_1k=1000, completion_per_1k=3000)
PRICES = PriceBook({"gpt": GPT, "free": Price(), "cheap": Price(prompt_per_1k=1)}, default=GPT)


def path(
    key: ScopeLimits | None = None,
    project: ScopeLimits | None = None,
    team: ScopeLimits | None = None,
    org: ScopeLimits | None = None,
    key_id: str = "k1",
) -> list[ScopeLimits]:
    return [
        key or ScopeLimits(f"key:{key_id}"),
        project or ScopeLimits("project:p_1"),
        team or ScopeLimits("team:t_1"),
        org or ScopeLimits("org:o_1"),
    ]


def unmetered() -> Accountant:
    return Accountant(PRICES, default_rpm=None, default_tpm=None)


# -- models allowlist -------------------------------------------------------


def test_a_project_list_narrows_the_org_list_and_a_level_without_a_list_inherits() -> None:
    acc = unmetered()
    levels = path(
        project=ScopeLimits("project:p_1", models=("gpt",)),
        org=ScopeLimits("org:o_1", models=("gpt", "free")),
    )
    acc.check(levels, "gpt", 10, NOW)
    with pytest.raises(ModelNotAllowed) as refused:
        acc.check(levels, "free", 10, NOW)
    assert refused.value.status == 403
    assert refused.value.code == "model_not_allowed"
    assert refused.value.scope == "project:p_1"
    assert "project:p_1" in refused.value.message
    assert acc.allowed(levels, "gpt")
    assert not acc.allowed(levels, "free")


def test_a_model_no_level_lists_is_refused_naming_the_broadest_level() -> None:
    acc = unmetered()
    levels = path(
        project=ScopeLimits("project:p_1", models=("gpt",)),
        org=ScopeLimits("org:o_1", models=("gpt",)),
    )
    with pytest.raises(ModelNotAllowed) as refused:
        acc.check(levels, "other", 10, NOW)
    assert refused.value.scope == "org:o_1"


def test_with_no_list_anywhere_every_model_is_allowed() -> None:
    acc = unmetered()
    acc.check(path(), "anything", 10, NOW)


def test_an_empty_models_list_allows_nothing() -> None:
    with pytest.raises(ModelNotAllowed):
        unmetered().check(path(team=ScopeLimits("team:t_1", models=[])), "gpt", 1, NOW)


def test_models_given_as_a_bare_string_are_refused() -> None:
    with pytest.raises(TypeError):
        ScopeLimits("key:k", models="gpt")


# -- rate limits -------------------------------------------------------------


def test_the_strictest_rpm_along_the_path_wins_and_every_level_is_charged() -> None:
    acc = Accountant(PRICES)
    levels = path(
        key=ScopeLimits("key:k1", rpm=5),
        project=ScopeLimits("project:p_1", rpm=3),
        team=ScopeLimits("team:t_1", rpm=10),
    )
    for _ in range(3):
        acc.check(levels, "gpt", 0, NOW)
    with pytest.raises(RateLimited) as refused:
        acc.check(levels, "gpt", 0, NOW)
    assert refused.value.scope == "project:p_1"
    assert refused.value.kind == "requests"
    assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
    assert "project:p_1" in refused.value.message
    assert "requests" in refused.value.message
    assert refused.value.retry_after_s is not None
    assert refused.value.retry_after_s >= 1
    for scope in ("key:k1", "project:p_1", "team:t_1"):
        assert acc.requests.rate(scope, NOW) == 3
    assert acc.requests.rate("org:o_1", NOW) == 0  # not limited: not counted


def test_a_team_rpm_counts_the_requests_of_every_key_below_it() -> None:
    acc = Accountant(PRICES)
    team = ScopeLimits("team:t_1", rpm=4)
    for key_id in ("a", "b", "a", "b"):
        acc.check(path(team=team, key_id=key_id), "gpt", 0, NOW)
    with pytest.raises(RateLimited, match="team:t_1"):
        acc.check(path(team=team, key_id="c"), "gpt", 0, NOW)


def test_a_refusal_charges_nothing() -> None:
    acc = Accountant(PRICES)
    levels = path(
        key=ScopeLimits("key:k1", rpm=100, tpm=1_000),
        project=ScopeLimits("project:p_1", rpm=100, tpm=300),
        team=ScopeLimits("team:t_1", budget_day_micros=10_000_000),
    )
    acc.check(levels, "gpt", 200, NOW)
    with pytest.raises(RateLimited) as refused:
        acc.check(levels, "gpt", 200, NOW)
    assert refused.value.kind == "tokens"
    assert refused.value.scope == "project:p_1"
    assert "tokens" in refused.value.message
    assert acc.requests.rate("key:k1", NOW) == 1
    assert acc.requests.rate("project:p_1", NOW) == 1
    assert acc.tokens.rate("key:k1", NOW) == 200
    assert acc.tokens.rate("project:p_1", NOW) == 200
    assert acc.held("team:t_1", "day") == GPT.max_cost(200)


def test_the_default_rpm_and_tpm_apply_to_the_key_when_no_level_sets_them() -> None:
    acc = Accountant(PRICES, default_rpm=2, default_tpm=1_000)
    acc.check(path(), "gpt", 10, NOW)
    acc.check(path(), "gpt", 10, NOW)
    with pytest.raises(RateLimited) as refused:
        acc.check(path(), "gpt", 10, NOW)
    assert refused.value.scope == "key:k1"
    assert acc.tokens.rate("key:k1", NOW) == 20
    with pytest.raises(RateLimited, match="tokens"):
        acc.check(path(key_id="k2"), "gpt", 1_001, NOW)


def test_a_level_that_sets_a_limit_replaces_the_default() -> None:
    acc = Accountant(PRICES, default_rpm=1, default_tpm=None)
    levels = path(org=ScopeLimits("org:o_1", rpm=3))
    for _ in range(3):
        acc.check(levels, "gpt", 0, NOW)
    assert acc.requests.rate("key:k1", NOW) == 0
    assert acc.requests.rate("org:o_1", NOW) == 3


def test_a_zero_rpm_on_the_key_means_unlimited_and_no_default() -> None:
    acc = Accountant(PRICES, default_rpm=1)
    levels = path(key=ScopeLimits("key:k1", rpm=0))
    for _ in range(20):
        acc.check(levels, "gpt", 0, NOW)


def test_the_retry_after_of_a_refusal_is_when_the_request_fits_again() -> None:
    acc = Accountant(PRICES, default_rpm=None, default_tpm=None)
    levels = path(key=ScopeLimits("key:k1", rpm=2))
    acc.check(levels, "gpt", 0, NOW)
    acc.check(levels, "gpt", 0, NOW)
    with pytest.raises(RateLimited) as refused:
        acc.check(levels, "gpt", 0, NOW)
    wait_s = refused.value.retry_after_s
    assert wait_s is not None
    acc.check(levels, "gpt", 0, NOW + wait_s)


def test_settle_replaces_the_token_estimate_with_the_actual_usage() -> None:
    acc = Accountant(PRICES, default_tpm=1_000)
    reservation = acc.check(path(), "gpt", 900, NOW)
    assert acc.tokens.rate("key:k1", NOW) == 900
    cost = acc.settle(reservation, prompt=100, cached=0, completion=50, now=NOW + 5)
    assert cost == GPT.cost(100, 0, 50) == 250
    assert acc.tokens.rate("key:k1", NOW + 5) == 150
    # An answer longer than estimated adds the difference.
    reservation = acc.check(path(), "gpt", 10, NOW + 6)
    acc.settle(reservation, prompt=10, cached=0, completion=40, now=NOW + 7)
    assert acc.tokens.rate("key:k1", NOW + 7) == 200


def test_settling_after_the_minute_turned_takes_the_estimate_back_from_the_minute_it_was_in() -> (
    None
):
    acc = Accountant(PRICES, default_tpm=1_000)
    reservation = acc.check(path(), "gpt", 600, NOW + 45)  # 12:00:55
    acc.check(path(), "gpt", 300, NOW + 55)  # 12:01:05
    acc.settle(reservation, prompt=60, cached=0, completion=0, now=NOW + 60)
    counts = acc.tokens.counts(NOW + 60)
    assert counts.current == {"key:k1": 300}  # this minute's request is untouched
    assert counts.previous == {"key:k1": 60}


def test_release_refunds_the_estimate_but_the_request_still_counts() -> None:
    acc = Accountant(PRICES, default_rpm=10, default_tpm=1_000)
    levels = path(team=ScopeLimits("team:t_1", budget_day_micros=1_000_000))
    reservation = acc.check(levels, "gpt", 500, NOW)
    acc.release(reservation, NOW + 1)
    assert acc.tokens.rate("key:k1", NOW + 1) == 0
    assert acc.requests.rate("key:k1", NOW + 1) == 1
    assert acc.held("team:t_1", "day") == 0
    assert acc.spent("team:t_1", "day", NOW + 1) == 0
    # Released or settled once: a second call changes nothing.
    acc.release(reservation, NOW + 2)
    assert acc.settle(reservation, 100, 0, 100, NOW + 2) == 400
    assert acc.spent("team:t_1", "day", NOW + 2) == 0


def test_forget_key_clears_its_counters() -> None:
    acc = Accountant(PRICES, default_rpm=1)
    acc.check(path(), "gpt", 5, NOW)
    with pytest.raises(RateLimited):
        acc.check(path(), "gpt", 5, NOW)
    acc.forget_key("k1")
    assert acc.requests.rate("key:k1", NOW) == 0
    assert acc.tokens.rate("key:k1", NOW) == 0
    acc.check(path(), "gpt", 5, NOW)
    acc.forget_key("key:k1")
    assert acc.requests.rate("key:k1", NOW) == 0


def test_counts_from_other_routers_limit_here_too() -> None:
    here, there = Accountant(PRICES, default_rpm=3), Accountant(PRICES, default_rpm=3)
    there.check(path(), "gpt", 0, NOW)
    there.check(path(), "gpt", 0, NOW)
    here.set_other_rates(there.rates(NOW), NOW)
    here.check(path(), "gpt", 0, NOW)
    with pytest.raises(RateLimited):
        here.check(path(), "gpt", 0, NOW)
    assert here.rates(NOW).requests.current == {"key:k1": 1}


# -- response headers ----------------------------------------------------------


def test_headers_show_the_tightest_limited_counter_like_openai() -> None:
    acc = Accountant(PRICES, default_rpm=None, default_tpm=None)
    levels = path(
        key=ScopeLimits("key:k1", rpm=10, tpm=10_000),
        project=ScopeLimits("project:p_1", rpm=4, tpm=50_000),
    )
    acc.check(levels, "gpt", 1_000, NOW)
    reservation = acc.check(levels, "gpt", 2_000, NOW + 2)
    headers = dict(reservation.headers())
    assert headers == {
        b"x-ratelimit-limit-requests": b"4",
        b"x-ratelimit-remaining-requests": b"2",
        b"x-ratelimit-reset-requests": b"48s",
        b"x-ratelimit-limit-tokens": b"10000",
        b"x-ratelimit-remaining-tokens": b"7000",
        b"x-ratelimit-reset-tokens": b"48s",
    }


def _duration_s(text: str) -> float:
    """A reset header's duration (``"1m21.333s"``, ``"200ms"``) in seconds."""
    if text.endswith("ms"):
        return float(text[:-2]) / 1000
    minutes, _, seconds = text[:-1].rpartition("m")
    return 60 * float(minutes or 0) + float(seconds)


def test_a_60_rpm_keys_reset_headers_never_exceed_the_minute_answered_or_refused() -> None:
    acc = Accountant(PRICES, default_rpm=60, default_tpm=6_000)
    seen = []
    for step in range(400):
        now = NOW + step * 0.77
        try:
            headers = dict(acc.check(path(), "free", 40, now).headers())
        except RateLimited:
            headers = dict(acc.rate_headers(path(), now))
        for kind in (b"requests", b"tokens"):
            reset_s = _duration_s(headers[b"x-ratelimit-reset-" + kind].decode())
            assert 0 < reset_s <= 60, (step, headers)
            seen.append(reset_s)
    assert max(seen) > 50  # the early seconds of a minute were seen


def test_no_ratelimit_headers_when_nothing_on_the_path_is_limited() -> None:
    assert unmetered().check(path(), "gpt", 10, NOW).headers() == []


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.2, "200ms"),
        (1, "1s"),
        (12, "12s"),
        (6.5, "6.5s"),
        (60, "1m0s"),
        (90.25, "1m30.25s"),
        (3600, "1h0m0s"),
    ],
)
def test_reset_durations_read_like_openais(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


# -- budgets -------------------------------------------------------------------


def test_a_team_budget_spent_by_two_keys_together_refuses_the_next_request() -> None:
    acc = unmetered()
    team = ScopeLimits("team:t_1", budget_day_micros=10_000)
    for key_id in ("a", "b"):
        reservation = acc.check(path(team=team, key_id=key_id), "gpt", 1_000, NOW)
        assert acc.settle(reservation, 1_000, 0, 1_000, NOW + 1) == 4_000
    assert acc.spent("team:t_1", "day", NOW + 1) == 8_000
    assert acc.spent("key:a", "day", NOW + 1) == 4_000
    with pytest.raises(BudgetSpent) as refused:
        acc.check(path(team=team, key_id="a"), "gpt", 1_000, NOW + 2)  # may cost 3,000
    assert (refused.value.status, refused.value.code) == (429, "insufficient_quota")
    assert refused.value.scope == "team:t_1"
    assert refused.value.period == "day"
    assert "team:t_1" in refused.value.message
    assert "daily" in refused.value.message
    assert refused.value.retry_after_s == 12 * 3600 - 12
    # A request that fits what is left still goes through.
    acc.check(path(team=team, key_id="b"), "gpt", 600, NOW + 3)


def test_a_zero_priced_model_is_still_allowed_when_a_budget_is_spent() -> None:
    acc = unmetered()
    levels = path(project=ScopeLimits("project:p_1", budget_month_micros=100))
    acc.settle(acc.check(levels, "gpt", 10, NOW), 100, 0, 0, NOW)
    with pytest.raises(BudgetSpent, match="monthly"):
        acc.check(levels, "gpt", 10, NOW)
    reservation = acc.check(levels, "free", 10_000, NOW)
    assert reservation.reserved == ()
    assert acc.settle(reservation, 5_000, 0, 5_000, NOW) == 0


def test_a_spent_budget_refuses_a_priced_request_even_with_no_token_estimate() -> None:
    acc = unmetered()
    levels = path(key=ScopeLimits("key:k1", budget_day_micros=0))
    with pytest.raises(BudgetSpent):
        acc.check(levels, "cheap", 0, NOW)
    acc.check(levels, "free", 0, NOW)


def test_a_request_that_spends_nothing_meets_the_allowlist_and_the_rpm_but_no_budget() -> None:
    acc = Accountant(PRICES, default_rpm=None, default_tpm=None)
    levels = path(
        key=ScopeLimits("key:k1", rpm=2, tpm=10, budget_day_micros=0),
        project=ScopeLimits("project:p_1", models=("gpt",)),
    )
    with pytest.raises(ModelNotAllowed) as refused:
        acc.check_request(levels, "free", NOW)
    assert refused.value.scope == "project:p_1"
    first = acc.check_request(levels, "gpt", NOW)  # a spent budget does not refuse it
    assert first.settled
    assert first.estimate_tokens == 0
    assert dict(first.headers())[b"x-ratelimit-remaining-requests"] == b"1"
    assert dict(first.headers())[b"x-ratelimit-remaining-tokens"] == b"10"
    acc.check_request(levels, "gpt", NOW)
    with pytest.raises(RateLimited) as limited:
        acc.check_request(levels, "gpt", NOW)
    assert (limited.value.retry_after_s or 0) >= 1
    assert acc.requests.rate("key:k1", NOW) == 2
    assert acc.tokens.rate("key:k1", NOW) == 0
    assert acc.held("key:k1", "day") == 0
    # A message still meets its budget (checked before the rates).
    with pytest.raises(BudgetSpent):
        acc.check(levels, "gpt", 1, NOW)


def test_settle_charges_the_served_models_price_when_a_fallback_answered() -> None:
    acc = unmetered()
    levels = path(team=ScopeLimits("team:t_1", budget_day_micros=1_000_000))
    reservation = acc.check(levels, "gpt", 100, NOW)
    cost = acc.settle(reservation, 1_000, 0, 0, NOW, served_model="cheap")
    assert cost == 1
    assert acc.spent("team:t_1", "day", NOW) == 1
    assert acc.spent("team:t_1", "month", NOW) == 1


def test_a_burst_of_1000_checks_cannot_overshoot_a_budget_by_more_than_one_estimate() -> None:
    acc = unmetered()
    budget = 1_000_000
    levels = path(org=ScopeLimits("org:o_1", budget_day_micros=budget))
    estimate_tokens = 2_000
    estimate_micros = GPT.max_cost(estimate_tokens)  # 6,000
    admitted: list[Reservation] = []
    waits: list[int | None] = []
    for i in range(1_000):
        try:
            admitted.append(acc.check(levels, "gpt", estimate_tokens, NOW + i / 1000))
        except BudgetSpent as exc:
            waits.append(exc.retry_after_s)
    assert len(admitted) == budget // estimate_micros
    assert len(waits) == 1_000 - len(admitted)
    assert set(waits) == {1}  # requests in flight hold the rest: retry soon
    for reservation in admitted:  # every answer as long as it may be
        acc.settle(reservation, 0, 0, estimate_tokens, NOW + 2)
    spent = acc.spent("org:o_1", "day", NOW + 2)
    assert budget - estimate_micros < spent <= budget + estimate_micros
    assert acc.held("org:o_1", "day") == 0


def test_budgets_roll_over_from_january_31_23_59_utc_into_february() -> None:
    acc = unmetered()
    jan = dt.datetime(2026, 1, 31, 23, 59, tzinfo=dt.UTC).timestamp()
    levels = path(
        project=ScopeLimits("project:p_1", budget_day_micros=5_000, budget_month_micros=5_000)
    )
    acc.settle(acc.check(levels, "gpt", 1_000, jan), 1_000, 0, 1_000, jan)
    with pytest.raises(BudgetSpent):
        acc.check(levels, "gpt", 1_000, jan + 30)
    feb = jan + 60
    acc.check(levels, "gpt", 1_000, feb)
    assert acc.spent("project:p_1", "month", feb) == 0


def test_a_new_accountant_restored_from_the_stores_figures_refuses_when_spent() -> None:
    levels = path(team=ScopeLimits("team:t_1", budget_day_micros=5_000))
    before = unmetered()
    before.settle(before.check(levels, "gpt", 1_000, NOW), 1_000, 0, 1_000, NOW)
    figures = {
        (scope, period): before.spent(scope, period, NOW)
        for scope in ("key:k1", "project:p_1", "team:t_1", "org:o_1")
        for period in ("day", "month")
    }

    after = unmetered()  # a restart
    after.restore(figures, NOW + 10)
    assert after.spent("team:t_1", "day", NOW + 10) == 4_000
    with pytest.raises(BudgetSpent, match="team:t_1"):
        after.check(levels, "gpt", 1_000, NOW + 10)


def test_catch_up_raises_only_own_900_vs_400_shared_100_vs_700_unseen_0_vs_50() -> None:
    acc = unmetered()
    acc.budgets.add("key:own", "day", 900, NOW)
    acc.budgets.add("team:shared", "day", 100, NOW)
    acc.catch_up(
        {("key:own", "day"): 400, ("team:shared", "day"): 700, ("key:unseen", "day"): 50}, NOW
    )
    assert acc.spent("key:own", "day", NOW) == 900
    assert acc.spent("team:shared", "day", NOW) == 700
    assert acc.spent("key:unseen", "day", NOW) == 50


def test_a_reservation_never_settled_stops_holding_budget_after_its_ttl() -> None:
    acc = Accountant(PRICES, default_rpm=None, default_tpm=None, reservation_ttl_s=600)
    levels = path(team=ScopeLimits("team:t_1", budget_day_micros=3_000))
    lost = acc.check(levels, "gpt", 1_000, NOW)
    with pytest.raises(BudgetSpent):
        acc.check(levels, "gpt", 1_000, NOW + 1)
    acc.check(levels, "gpt", 1_000, NOW + 601).headers()
    assert acc.held("team:t_1", "day") == 3_000  # the new one only
    # Settling the lost one later still records its cost, and frees nothing twice.
    acc.settle(lost, 10, 0, 0, NOW + 700)
    assert acc.held("team:t_1", "day") == 3_000
    assert acc.spent("team:t_1", "day", NOW + 700) == 10


def test_an_empty_path_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="path"):
        unmetered().check([], "gpt", 1, NOW)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_scope_limits_must_be_whole_numbers_at_least_zero(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        ScopeLimits("key:k", rpm=bad)  # type: ignore[arg-type]


def test_a_request_larger_than_the_limit_says_retrying_will_not_help() -> None:
    """A prompt alone over the tokens limit (a 30 MB body) can never pass:
    the message says so and names both causes, not only max_tokens."""
    refused = RateLimited("key:k1", "tokens", 200_000, 0, 15_728_649, 60)
    assert refused.status == 429
    assert "Limit 200000, Requested 15728649" in str(refused)
    assert "Retrying will not help" in str(refused)
    assert "shorter prompt" in str(refused)
    within = RateLimited("key:k1", "tokens", 200_000, 199_000, 5_000, 12)
    assert "Please try again in 12s." in str(within)


class _SpendStore:
    """The store's spend by scope since a period's start: ``day`` or ``month`` figures."""

    def __init__(self, day: dict[str, int], month: dict[str, int]) -> None:
        self.day, self.month = day, month

    async def spend_since_by_scope(self, since: float) -> dict[str, int]:
        return self.day if since == period_start("day", time.time()) else self.month


async def test_a_new_leader_catches_its_budgets_up_with_the_stores_spend() -> None:
    acc = unmetered()
    now = time.time()
    acc.budgets.add("key:own", "day", 900, now)  # served here, not written yet
    store = _SpendStore(
        day={"key:own": 400, "team:t_1": 700}, month={"key:own": 400, "team:t_1": 2_000}
    )
    await catch_up_budgets(store, acc)  # type: ignore[arg-type]
    assert acc.spent("key:own", "day", now) == 900
    assert acc.spent("team:t_1", "day", now) == 700
    assert acc.spent("team:t_1", "month", now) == 2_000

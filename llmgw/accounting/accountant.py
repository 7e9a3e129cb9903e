"""The accountant: what the gateway asks before and after each request.

``check`` runs before a request goes to an engine: the models allowlist, the
budgets and the rate limits of every level on the key's path (key → project →
team → org; a level only narrows, the
strictest limit wins and every limited level is charged). It either raises a
:class:`Refused` or returns a :class:`Reservation` holding what it charged:
one request and the estimated tokens on each limited counter, and the
estimate's most possible cost reserved against each budget, so a burst of
requests cannot overshoot a budget many times over. ``settle`` then replaces
the estimate with the actual usage; ``release`` refunds a request that never
reached an engine.

Plain synchronous code, no I/O: the gateway calls it on its event loop and
passes the time in (``now``: UTC epoch seconds). Money is in integer
micro-units (``_micros``), durations in seconds (``_s``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from llmgw import errors
from llmgw.accounting.budgets import PERIODS, Budgets, Period, period_end, period_start
from llmgw.accounting.limiter import Counts, Limiter
from llmgw.accounting.prices import PriceBook
from llmgw.store import Store

__all__ = [
    "RESERVATION_TTL_S",
    "Accountant",
    "BudgetSpent",
    "ModelNotAllowed",
    "RateFigures",
    "RateLimited",
    "Rates",
    "Refused",
    "Reservation",
    "ScopeLimits",
    "catch_up_budgets",
    "restore_budgets",
]

log = logging.getLogger("llmgw.accounting")

#: A reservation neither settled nor released after this long is given up:
#: its budget hold is freed (a request path that lost it must not shrink a
#: budget forever).
RESERVATION_TTL_S: Final = 3600.0
#: How often ``check`` drops idle counters and stale reservations.
PRUNE_EVERY_S: Final = 60.0


def _limit(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be a whole number or None, got {value!r}")
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


def _models(value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"models must be a list of model names, got the string {value!r}")
    return tuple(value)


@attrs.frozen
class ScopeLimits:
    """One level's limits on a request's path.

    Attributes:
        scope: the counter name, ``"key:ID"``, ``"project:ID"``, ``"team:ID"``
            or ``"org:ID"``.
        rpm: requests per minute; ``None`` not set, ``0`` unlimited.
        tpm: tokens per minute; ``None`` not set, ``0`` unlimited.
        budget_day_micros: money per UTC day; ``None`` no budget, ``0`` only
            zero-priced models.
        budget_month_micros: money per UTC month, likewise.
        models: the models this level allows; ``None`` inherits (no list).
    """

    scope: str
    rpm: int | None = attrs.field(default=None, validator=_limit)
    tpm: int | None = attrs.field(default=None, validator=_limit)
    budget_day_micros: int | None = attrs.field(default=None, validator=_limit)
    budget_month_micros: int | None = attrs.field(default=None, validator=_limit)
    models: tuple[str, ...] | None = attrs.field(default=None, converter=_models)

    def budget_micros(self, period: Period) -> int | None:
        """This level's budget for ``period``, or ``None``."""
        return self.budget_day_micros if period == "day" else self.budget_month_micros


class Refused(errors.Refused):
    """A request the accountant will not let through.

    Attributes:
        status: the HTTP status to answer with.
        code: OpenAI's error ``code``.
        type: OpenAI's error ``type``.
        message: what to tell the client.
        retry_after_s: whole seconds for ``Retry-After``, or ``None``.
        scope: the counter name of the level that refused.
    """

    def __init__(
        self, status: int, code: str, message: str, retry_after_s: int | None, scope: str
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.type = "invalid_request_error"
        self.message = message
        self.retry_after_s = retry_after_s
        self.scope = scope


class ModelNotAllowed(Refused):
    """403: a level on the path lists models and ``model`` is not among them."""

    def __init__(self, model: str, scope: str) -> None:
        super().__init__(
            403,
            "model_not_allowed",
            f"The model {model!r} is not allowed for {scope}.",
            None,
            scope,
        )
        self.model = model


class RateLimited(Refused):
    """429: a requests or tokens per minute limit on the path is reached."""

    def __init__(
        self,
        scope: str,
        kind: Literal["requests", "tokens"],
        limit: int,
        used: int,
        requested: int,
        retry_after_s: int,
    ) -> None:
        unit = "RPM" if kind == "requests" else "TPM"
        message = (
            f"Rate limit reached for {scope} on {kind} per min ({unit}): "
            f"Limit {limit}, Used {used}, Requested {requested}. "
            f"Please try again in {retry_after_s}s."
        )
        if requested > limit:
            message = (
                f"Request too large for {scope} on {kind} per min ({unit}): "
                f"Limit {limit}, Requested {requested}. Retrying will not help: "
                "send a shorter prompt or ask for fewer tokens (max_tokens)."
            )
        super().__init__(429, "rate_limit_exceeded", message, retry_after_s, scope)
        self.type = kind  # OpenAI's error type is "requests" or "tokens"
        self.kind = kind
        self.limit = limit


class BudgetSpent(Refused):
    """429: the request's most possible cost does not fit in a budget on the path."""

    def __init__(
        self,
        scope: str,
        period: Period,
        budget_micros: int,
        spent_micros: int,
        reserved_micros: int,
        needed_micros: int,
        retry_after_s: int,
    ) -> None:
        adjective = "daily" if period == "day" else "monthly"
        held = f", {reserved_micros} held by requests in flight" if reserved_micros else ""
        left_micros = max(budget_micros - spent_micros - reserved_micros, 0)
        state = "is spent" if left_micros == 0 else "has too little left for this request"
        message = (
            f"The {adjective} budget of {scope} {state}: {spent_micros} of "
            f"{budget_micros} micro-units used{held}; this request may cost up to "
            f"{needed_micros} (a lower max_tokens asks for less). It renews at the start "
            f"of the next UTC {period}."
        )
        super().__init__(429, "insufficient_quota", message, retry_after_s, scope)
        self.type = "insufficient_quota"
        self.period = period


@attrs.frozen
class RateFigures:
    """The tightest limited counter of one limiter, for response headers.

    Attributes:
        scope: its counter name.
        limit: its per-minute limit.
        remaining: whole units still admitted this minute.
        reset_s: seconds until its one-minute window resets, 0 … 60
            (:meth:`llmgw.accounting.limiter.Window.seconds_to_reset`).
    """

    scope: str
    limit: int
    remaining: int
    reset_s: float


def format_reset(seconds: float) -> str:
    """A duration like OpenAI's ``x-ratelimit-reset-*``: ``"200ms"``,
    ``"12s"``, ``"6.5s"``, ``"1m0s"``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(round(seconds * 1000), 1)}ms"
    millis = math.ceil(seconds * 1000 - 1e-6)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs = f"{millis / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


@attrs.define(eq=False)
class Reservation:
    """What ``check`` charged for one request, to settle or release later.

    Attributes:
        model: the requested model.
        scopes: every scope on the path, key first; each one's spend counters
            get the actual cost.
        request_counters: the counters charged one request.
        token_counters: the counters charged ``estimate_tokens``.
        estimate_tokens: the tokens charged before the request ran.
        reserved: (scope, period, micros) held against each budget on the path.
        at: when ``check`` charged it (epoch seconds).
        requests: the tightest requests counter after the charge, or ``None``.
        tokens: the tightest tokens counter after the charge, or ``None``.
        settled: set once settled or released; a second call changes nothing.
    """

    model: str
    scopes: tuple[str, ...]
    request_counters: tuple[str, ...]
    token_counters: tuple[str, ...]
    estimate_tokens: int
    reserved: tuple[tuple[str, Period, int], ...]
    at: float
    requests: RateFigures | None = None
    tokens: RateFigures | None = None
    settled: bool = False
    #: Whether the budget hold is still counted (it lapses after RESERVATION_TTL_S).
    holding: bool = True
    seq: int = 0

    @property
    def reserved_micros(self) -> int:
        """The estimate's cost held against each budget (0 when none or free)."""
        return max((micros for _, _, micros in self.reserved), default=0)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for the tightest limited
        counters (none for a limiter that limits nothing on the path)."""
        out: list[tuple[bytes, bytes]] = []
        for (limit, remaining, reset), figures in (
            (_REQUESTS_HEADERS, self.requests),
            (_TOKENS_HEADERS, self.tokens),
        ):
            if figures is None:
                continue
            out += [
                (limit, str(figures.limit).encode()),
                (remaining, str(figures.remaining).encode()),
                (reset, format_reset(figures.reset_s).encode()),
            ]
        return out


#: The names of the ``x-ratelimit-*`` headers, (limit, remaining, reset), per kind.
_REQUESTS_HEADERS: Final = (
    b"x-ratelimit-limit-requests",
    b"x-ratelimit-remaining-requests",
    b"x-ratelimit-reset-requests",
)
_TOKENS_HEADERS: Final = (
    b"x-ratelimit-limit-tokens",
    b"x-ratelimit-remaining-tokens",
    b"x-ratelimit-reset-tokens",
)


@attrs.frozen
class Rates:
    """This router's counts of both limiters, exchanged between routers."""

    requests: Counts
    tokens: Counts


class Accountant:
    """Allowlists, rate limits and budgets along a key's path.

    Args:
        prices: model prices (``auth.pricing`` and ``auth.default_price``).
        default_rpm: requests a minute on the key's counter when no level on
            the path sets ``rpm`` (``auth.default_rpm``); ``None``/``0`` unmetered.
        default_tpm: tokens a minute likewise (``auth.default_tpm``).
        reservation_ttl_s: a reservation still open after this long stops
            holding budget.
    """

    def __init__(
        self,
        prices: PriceBook,
        default_rpm: int | None = 60,
        default_tpm: int | None = 200_000,
        *,
        reservation_ttl_s: float = RESERVATION_TTL_S,
    ) -> None:
        self.prices = prices
        self.default_rpm = default_rpm
        self.default_tpm = default_tpm
        self.reservation_ttl_s = reservation_ttl_s
        self.requests = Limiter()
        self.tokens = Limiter()
        self.budgets = Budgets()
        # (scope, period) → micro-units held by requests in flight.
        self._reserved: dict[tuple[str, Period], int] = {}
        # Open reservations holding budget, oldest first.
        self._open: dict[int, Reservation] = {}
        self._seq = 0
        self._next_prune_s = -math.inf
        #: id(path) → what ``check`` derives from that path tuple (the
        #: resolver hands out the same tuple for a key while it is cached).
        self._plans: dict[int, _Plan] = {}

    # -- the request path ------------------------------------------------

    def allowed(self, path: Sequence[ScopeLimits], model: str) -> bool:
        """Whether every level that lists models lists ``model``."""
        return all(level.models is None or model in level.models for level in path)

    def rate_headers(self, path: Sequence[ScopeLimits], now: float) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for ``path`` as things stand,
        charging nothing: what a refused request's answer carries."""
        figures = Reservation(
            model="",
            scopes=(),
            request_counters=(),
            token_counters=(),
            estimate_tokens=0,
            reserved=(),
            at=now,
            requests=_tightest(self.requests, self._limits(path, "rpm", self.default_rpm), now),
            tokens=_tightest(self.tokens, self._limits(path, "tpm", self.default_tpm), now),
            holding=False,
        )
        return figures.headers()

    def check(
        self,
        path: Sequence[ScopeLimits],
        model: str,
        estimate_tokens: int,
        now: float,
        *,
        images: int = 0,
        meshes: int = 0,
    ) -> Reservation:
        """Admit a request for ``model`` along ``path`` (key, project, team,
        org) and charge it, or refuse it and charge nothing.

        Checked in this order: the models allowlist (broadest refusing level
        named), the budgets, then requests and tokens per minute (every
        limited level; when no level sets ``rpm``/``tpm``, the default applies
        to the key's counter). When all pass, each limited counter is charged
        1 request and ``estimate_tokens`` tokens, and the estimate's most
        possible cost (:meth:`Price.max_cost`) is held against each budget.

        Args:
            estimate_tokens: prompt-token estimate plus ``max_tokens`` (or the
                model's ``max_output``); settled to actual usage later.
            images, meshes: how many the request asks for, priced into the hold.

        Raises:
            ModelNotAllowed: 403, a level's models list leaves ``model`` out.
            BudgetSpent: 429, ``spent + held + estimate cost > budget`` at a
                level (never for a zero-priced model).
            RateLimited: 429, a requests or tokens limit is reached; the one
                whose room comes back last is named.
            ValueError: an empty path.
        """
        if not path:
            raise ValueError("a request's path needs at least the key's level")
        if now >= self._next_prune_s:
            self.prune(now)
        _check_models(path, model)
        estimate_tokens = max(estimate_tokens, 0)

        reserved = self._check_budgets(path, model, estimate_tokens, images, meshes, now)
        plan = self._plan(path)
        request_limits, token_limits = plan.request_limits, plan.token_limits
        self._check_rates(request_limits, token_limits, estimate_tokens, now)

        # Every check passed: charge everything.
        for scope, _ in request_limits:
            self.requests.charge(scope, 1, now)
        for scope, _ in token_limits:
            self.tokens.charge(scope, estimate_tokens, now)
        for scope, period, micros in reserved:
            self._reserved[(scope, period)] = self._reserved.get((scope, period), 0) + micros
        self._seq += 1
        reservation = Reservation(
            model=model,
            scopes=plan.scopes,
            request_counters=plan.request_counters,
            token_counters=plan.token_counters,
            estimate_tokens=estimate_tokens,
            reserved=reserved,
            at=now,
            requests=_tightest(self.requests, request_limits, now),
            tokens=_tightest(self.tokens, token_limits, now),
            holding=bool(reserved),
            seq=self._seq,
        )
        if reserved:
            self._open[reservation.seq] = reservation
        return reservation

    def check_request(self, path: Sequence[ScopeLimits], model: str, now: float) -> Reservation:
        """Admit a request for ``model`` along ``path`` that spends no tokens
        and costs nothing (Anthropic's ``count_tokens``), or refuse it: the
        models allowlist, then the requests per minute of every limited
        level (the key's default when none sets ``rpm``). When both pass,
        each limited requests counter is charged 1; no tokens, no budget.

        Returns:
            A settled :class:`Reservation` (nothing to settle or release),
            carrying the tightest counters for the rate headers.

        Raises:
            ModelNotAllowed: 403, a level's models list leaves ``model`` out.
            RateLimited: 429, a requests limit is reached.
            ValueError: an empty path.
        """
        if not path:
            raise ValueError("a request's path needs at least the key's level")
        if now >= self._next_prune_s:
            self.prune(now)
        _check_models(path, model)
        request_limits = self._limits(path, "rpm", self.default_rpm)
        self._check_rates(request_limits, [], 0, now)
        for scope, _ in request_limits:
            self.requests.charge(scope, 1, now)
        return Reservation(
            model=model,
            scopes=tuple(level.scope for level in path),
            request_counters=tuple(scope for scope, _ in request_limits),
            token_counters=(),
            estimate_tokens=0,
            reserved=(),
            at=now,
            requests=_tightest(self.requests, request_limits, now),
            tokens=_tightest(self.tokens, self._limits(path, "tpm", self.default_tpm), now),
            settled=True,
            holding=False,
        )

    def settle(
        self,
        reservation: Reservation,
        prompt: int,
        cached: int,
        completion: int,
        now: float,
        served_model: str | None = None,
        images: int = 0,
        meshes: int = 0,
    ) -> int:
        """Record a request's actual usage; returns its ``cost_micros``.

        The cost is at the price of ``served_model`` (the model that answered,
        when a fallback did) or else the requested model. Each tokens counter
        gets ``prompt + completion - estimate`` (the estimate replaced by the
        actual total), the budget hold is released and the cost is added to
        the day and month spend of every scope on the path. Settling twice
        charges nothing the second time.
        """
        model = served_model if served_model is not None else reservation.model
        cost_micros = self.prices.price_for(model).cost(prompt, cached, completion, images, meshes)
        if reservation.settled:
            log.warning("request for %s settled twice; the second time counts nothing", model)
            return cost_micros
        reservation.settled = True
        actual_tokens = max(prompt, 0) + max(completion, 0)
        difference = actual_tokens - reservation.estimate_tokens
        for counter in reservation.token_counters:
            self.tokens.charge(counter, difference, now, charged_at=reservation.at)
        self._unhold(reservation)
        if cost_micros > 0:
            for scope in reservation.scopes:
                for period in PERIODS:
                    self.budgets.add(scope, period, cost_micros, now)
        return cost_micros

    def release(self, reservation: Reservation, now: float) -> None:
        """A request that never reached an engine: refund its estimated tokens
        and budget hold. It still counts as a request."""
        if reservation.settled:
            return
        reservation.settled = True
        for counter in reservation.token_counters:
            self.tokens.charge(
                counter, -reservation.estimate_tokens, now, charged_at=reservation.at
            )
        self._unhold(reservation)

    def forget_key(self, key_id: str) -> None:
        """A revoked key: clear its limiter counters (``key_id`` with or
        without the ``key:`` prefix)."""
        counter = key_id if key_id.startswith("key:") else f"key:{key_id}"
        self.requests.forget(counter)
        self.tokens.forget(counter)

    # -- budgets from the store ------------------------------------------

    def restore(self, spend: Mapping[tuple[str, str], int], now: float) -> None:
        """Start-up: set the spend counters from the store's figures,
        (scope, period) → micro-units spent since that period's start."""
        for period in PERIODS:
            self.budgets.restore(spend, period, now)

    def catch_up(self, store_figures: Mapping[tuple[str, str], int], now: float) -> None:
        """Raise each spend counter to the store's figure, never lower one."""
        for period in PERIODS:
            self.budgets.catch_up(store_figures, period, now)

    def spent(self, scope: str, period: Period, now: float) -> int:
        """Micro-units ``scope`` spent in ``now``'s period (settled requests)."""
        return self.budgets.spent(scope, period, now)

    def held(self, scope: str, period: Period) -> int:
        """Micro-units held against ``scope``'s budget by requests in flight."""
        return self._reserved.get((scope, period), 0)

    # -- across routers ----------------------------------------------------

    def rates(self, now: float) -> Rates:
        """This router's own counts of both limiters."""
        return Rates(self.requests.counts(now), self.tokens.counts(now))

    def set_other_rates(self, rates: Rates, now: float) -> None:
        """Replace the other routers' counts (their sum)."""
        self.requests.set_others(rates.requests, now)
        self.tokens.set_others(rates.tokens, now)

    # -- housekeeping --------------------------------------------------------

    def prune(self, now: float) -> None:
        """Drop idle limiter counters and ended budget periods, and stop the
        budget hold of reservations open longer than ``reservation_ttl_s``.
        ``check`` calls this once a minute."""
        self._next_prune_s = now + PRUNE_EVERY_S
        self.requests.prune(now)
        self.tokens.prune(now)
        self.budgets.prune(now)
        stale = [r for r in self._open.values() if now - r.at > self.reservation_ttl_s]
        for reservation in stale:
            log.warning(
                "a request for %s checked %.0fs ago was never settled; its budget hold is freed",
                reservation.model,
                now - reservation.at,
            )
            self._unhold(reservation)

    # -- internals -------------------------------------------------------

    def _unhold(self, reservation: Reservation) -> None:
        if not reservation.holding:
            return
        reservation.holding = False
        self._open.pop(reservation.seq, None)
        for scope, period, micros in reservation.reserved:
            left = self._reserved.get((scope, period), 0) - micros
            if left > 0:
                self._reserved[(scope, period)] = left
            else:
                self._reserved.pop((scope, period), None)

    def _check_budgets(
        self,
        path: Sequence[ScopeLimits],
        model: str,
        estimate_tokens: int,
        images: int,
        meshes: int,
        now: float,
    ) -> tuple[tuple[str, Period, int], ...]:
        price = self.prices.price_for(model)
        if price.is_zero():
            return ()
        # A priced request may always cost something: at least 1 micro-unit,
        # so a spent budget refuses even a request estimated at 0 tokens.
        needed = max(price.max_cost(estimate_tokens, images, meshes), 1)
        reserved: list[tuple[str, Period, int]] = []
        for level in path:
            for period in PERIODS:
                budget = level.budget_micros(period)
                if budget is None:
                    continue
                spent = self.budgets.spent(level.scope, period, now)
                held = self._reserved.get((level.scope, period), 0)
                if spent + held + needed > budget:
                    # Only requests in flight hold the rest: worth a retry soon.
                    wait_s = 1.0 if spent + needed <= budget else period_end(period, now) - now
                    raise BudgetSpent(
                        level.scope,
                        period,
                        budget,
                        spent,
                        held,
                        needed,
                        max(math.ceil(wait_s), 1),
                    )
                reserved.append((level.scope, period, needed))
        return tuple(reserved)

    def _plan(self, path: Sequence[ScopeLimits]) -> _Plan:
        """What ``check`` derives from ``path`` and the defaults, computed
        once per path tuple (a tuple of frozen levels cannot change; any
        other sequence is worked out each time)."""
        defaults = (self.default_rpm, self.default_tpm)
        if type(path) is tuple:
            plan = self._plans.get(id(path))
            if plan is not None and plan.path is path and plan.defaults == defaults:
                return plan
        request_limits = self._limits(path, "rpm", self.default_rpm)
        token_limits = self._limits(path, "tpm", self.default_tpm)
        plan = _Plan(
            path=path,
            defaults=defaults,
            scopes=tuple(level.scope for level in path),
            request_limits=tuple(request_limits),
            token_limits=tuple(token_limits),
            request_counters=tuple(scope for scope, _ in request_limits),
            token_counters=tuple(scope for scope, _ in token_limits),
        )
        if type(path) is tuple:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            # The plan holds the path, so its id is not reused while cached.
            self._plans[id(path)] = plan
        return plan

    @staticmethod
    def _limits(
        path: Sequence[ScopeLimits], field: Literal["rpm", "tpm"], default: int | None
    ) -> list[tuple[str, int]]:
        limits = [(level.scope, getattr(level, field)) for level in path]
        if all(limit is None for _, limit in limits):
            return [(path[0].scope, default)] if default else []
        return [(scope, limit) for scope, limit in limits if limit]

    def _check_rates(
        self,
        request_limits: Sequence[tuple[str, int]],
        token_limits: Sequence[tuple[str, int]],
        estimate_tokens: int,
        now: float,
    ) -> None:
        refusals: list[RateLimited] = []
        checks: list[
            tuple[Literal["requests", "tokens"], Limiter, Sequence[tuple[str, int]], int]
        ] = [
            ("requests", self.requests, request_limits, 1),
            ("tokens", self.tokens, token_limits, estimate_tokens),
        ]
        for kind, limiter, limits, cost in checks:
            for scope, limit in limits:
                if not limiter.fits(scope, limit, cost, now):
                    refusals.append(
                        RateLimited(
                            scope,
                            kind,
                            limit,
                            math.ceil(limiter.rate(scope, now)),
                            cost,
                            # A request larger than the limit never fits:
                            # no Retry-After to wait for.
                            0 if cost > limit else limiter.retry_after_s(scope, limit, cost, now),
                        )
                    )
        if refusals:
            # The refusal whose room comes back last decides when to retry.
            raise max(refusals, key=lambda r: r.retry_after_s or 0)


#: Most path plans the accountant keeps (cleared when it grows past this).
_MAX_PLANS: Final = 10_000


@attrs.frozen
class _Plan:
    """What :meth:`Accountant.check` derives from one path: its scopes, the
    limited counters with their limits (defaults applied), their names."""

    path: Sequence[ScopeLimits]
    defaults: tuple[int | None, int | None]
    scopes: tuple[str, ...]
    request_limits: tuple[tuple[str, int], ...]
    token_limits: tuple[tuple[str, int], ...]
    request_counters: tuple[str, ...]
    token_counters: tuple[str, ...]


def _check_models(path: Sequence[ScopeLimits], model: str) -> None:
    """Raise :class:`ModelNotAllowed` naming the broadest level whose models
    list leaves ``model`` out."""
    for level in reversed(path):
        if level.models is not None and model not in level.models:
            raise ModelNotAllowed(model, level.scope)


def _tightest(
    limiter: Limiter, limits: Sequence[tuple[str, int]], now: float
) -> RateFigures | None:
    best: tuple[str, int, int] | None = None  # (scope, limit, remaining)
    for scope, limit in limits:
        remaining = limiter.remaining(scope, limit, now)
        if best is None or remaining < best[2]:
            best = (scope, limit, remaining)
    if best is None:
        return None
    scope, limit, remaining = best
    return RateFigures(scope, limit, remaining, limiter.seconds_to_reset(scope, now))


async def restore_budgets(store: Store, accountant: Accountant) -> None:
    """Rebuild ``accountant``'s budget counters from the store's usage of this day and month,
    so a restart does not hand every key a fresh budget.

    Raises:
        StoreError: the store cannot be read.
    """
    now = time.time()
    accountant.restore(await _stored_spend(store, now), now)


async def catch_up_budgets(store: Store, accountant: Accountant) -> None:
    """Raise ``accountant``'s budget counters to the store's usage of this
    day and month, never lowering one: what a control plane does when it
    comes to lead (``docs/ha.md``), so the spend served by the leader
    before it counts; its own spend not yet written stays counted.

    Raises:
        StoreError: the store cannot be read.
    """
    now = time.time()
    accountant.catch_up(await _stored_spend(store, now), now)


async def _stored_spend(store: Store, now: float) -> dict[tuple[str, str], int]:
    """The store's spend of this day and month, in micro-units, by
    ``(scope, "day" | "month")``."""
    spend: dict[tuple[str, str], int] = {}
    for period in ("day", "month"):
        since = period_start(period, now)
        for scope, micros in (await store.spend_since_by_scope(since)).items():
            spend[(scope, period)] = micros
    return spend

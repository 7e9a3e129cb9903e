"""A circuit breaker per endpoint (``docs/api.md``, Which replica answers;
Outside providers).

Our choice of the spec's open thresholds:

- **closed** → **open** after :data:`FAILURES_TO_OPEN` (5) consecutive
  failures (connect error, 5xx, timeout) or after a single 429;
- open for :data:`OPEN_FOR_S` (30 s), or for the provider's ``Retry-After``
  when one came, bounded to :data:`RETRY_AFTER_MIN_S` … :data:`RETRY_AFTER_MAX_S`
  (1 … 300 s);
- then **half-open**: exactly one probe request is let through; its success
  closes the breaker, its failure opens it again.

Pure and synchronous: the caller passes the time in (``now``: monotonic
seconds, the same clock for every call on one breaker; the gateway uses
:func:`time.monotonic`). Which answers count as failures is the caller's
call; :func:`counts_as_failure` gives the rule above for an HTTP status.
"""

from __future__ import annotations

import email.utils
import enum
import math
from collections.abc import Iterable
from typing import Final, Protocol

__all__ = [
    "FAILURES_TO_OPEN",
    "OPEN_FOR_S",
    "PROBE_TIMEOUT_S",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "Breaker",
    "BreakerState",
    "counts_as_failure",
    "earliest_recovery",
    "parse_retry_after_s",
]

#: Consecutive failures (connect error, 5xx, timeout) that open a breaker.
FAILURES_TO_OPEN: Final = 5
#: How long an open breaker stays open without a ``Retry-After``, in seconds.
OPEN_FOR_S: Final = 30.0
#: Bounds on a provider's ``Retry-After``, in seconds.
RETRY_AFTER_MIN_S: Final = 1.0
RETRY_AFTER_MAX_S: Final = 300.0
#: A half-open probe with no outcome reported after this long (a request
#: path that lost track of it) no longer blocks the next probe, in seconds.
#: The generation deadline (10 min), so a slow but live probe is not doubled.
PROBE_TIMEOUT_S: Final = 600.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


def counts_as_failure(status: int) -> bool:
    """Whether an HTTP answer with ``status`` counts against the breaker:
    429 and the 5xx that say the endpoint cannot serve (502, 503, 504, and
    any other but 500 and 501). A 500 or 501 is an engine that answered,
    failing this request (llama.cpp answers 500 to "tools without --jinja",
    501 to embeddings it does not serve): the request's fault, not the
    replica's, so no client can trip a breaker by repeating it. Connect
    errors and timeouts count too; they have no status."""
    return status == 429 or (status >= 500 and status not in (500, 501))


class Breaker:
    """The breaker of one endpoint. See the module docstring for the rule.

    Args:
        failures_to_open: consecutive failures that open it (≥ 1).
        open_for_s: how long it stays open when no ``Retry-After`` is given.
    """

    __slots__ = (
        "_failures",
        "_open_for_s",
        "_open_until",
        "_probe_at",
        "_state",
        "failures_to_open",
    )

    def __init__(
        self, *, failures_to_open: int = FAILURES_TO_OPEN, open_for_s: float = OPEN_FOR_S
    ) -> None:
        if failures_to_open < 1:
            raise ValueError("failures_to_open must be at least 1")
        if open_for_s <= 0:
            raise ValueError("open_for_s must be positive")
        self.failures_to_open = failures_to_open
        self._open_for_s = open_for_s
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._open_until = 0.0
        #: When the half-open probe was handed out; ``None`` while none is out.
        self._probe_at: float | None = None

    def __repr__(self) -> str:
        return f"<Breaker {self._state.value} failures={self._failures}>"

    @property
    def state(self) -> BreakerState:
        """The state as last updated; an open breaker whose time is up reads
        ``OPEN`` until :meth:`allow` or :meth:`available` is asked."""
        return self._state

    @property
    def open_until(self) -> float | None:
        """While open: when it turns half-open (monotonic seconds); else ``None``."""
        return self._open_until if self._state is BreakerState.OPEN else None

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def available(self, now: float) -> bool:
        """Whether :meth:`allow` would let a request through at ``now``,
        without taking the half-open probe. For scoring many endpoints and
        then calling :meth:`allow` on the one chosen."""
        state = self._state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return now >= self._open_until
        return self._probe_at is None or now - self._probe_at >= PROBE_TIMEOUT_S

    def allow(self, now: float) -> bool:
        """Whether a request may go to this endpoint at ``now``.

        Closed: always. Open: no, until ``open_until``; then the breaker turns
        half-open. Half-open: ``True`` once — that request is the probe, and
        the caller must report its outcome with :meth:`success`,
        :meth:`failure` or :meth:`abandon` — then ``False`` until it is in.
        """
        state = self._state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            if now < self._open_until:
                return False
            self._state = BreakerState.HALF_OPEN
            self._probe_at = None
        if self._probe_at is not None and now - self._probe_at < PROBE_TIMEOUT_S:
            return False
        self._probe_at = now
        return True

    def success(self) -> None:
        """A request answered well: the breaker closes and the failure count
        starts again."""
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._probe_at = None

    def failure(
        self, now: float, *, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        """A request failed at ``now``: a connect error or timeout
        (``status=None``), or an answer with ``status`` (429 or 5xx; see
        :func:`counts_as_failure`).

        A 429, a failed probe, or the :attr:`failures_to_open`-th consecutive
        failure opens the breaker for ``retry_after_s`` (bounded to 1 … 300 s)
        or :data:`OPEN_FOR_S`. A failure reported while already open (a
        request sent before it opened) only ever extends the open time.
        """
        self._failures += 1
        if not (
            status == 429
            or self._state is not BreakerState.CLOSED
            or self._failures >= self.failures_to_open
        ):
            return
        if retry_after_s is None or math.isnan(retry_after_s):
            open_for_s = self._open_for_s
        else:
            open_for_s = min(max(retry_after_s, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
        until = now + open_for_s
        if self._state is BreakerState.OPEN:
            self._open_until = max(self._open_until, until)
        else:
            self._state = BreakerState.OPEN
            self._open_until = until
        self._probe_at = None

    def abandon(self) -> None:
        """The half-open probe ended with no verdict (the client left before
        the endpoint answered): the next request may probe. No effect in
        other states."""
        if self._state is BreakerState.HALF_OPEN:
            self._probe_at = None


class _HasBreaker(Protocol):
    @property
    def breaker(self) -> Breaker: ...


def earliest_recovery(endpoints: Iterable[_HasBreaker]) -> float | None:
    """When the first open breaker among ``endpoints`` turns half-open
    (monotonic seconds), or ``None`` when none is open.

    For the spec's "when every endpoint is cooling down, wait for the first
    to recover instead of failing at once": after scoring found nothing,
    sleep until this time (bounded by the request's own deadline) and score
    again. ``None`` means there is nothing to wait for by time alone (no
    endpoints, or only half-open ones whose probe is out)."""
    best: float | None = None
    for endpoint in endpoints:
        until = endpoint.breaker.open_until
        if until is not None and (best is None or until < best):
            best = until
    return best


def parse_retry_after_s(value: bytes | str | None, now_wall: float) -> float | None:
    """Seconds from a ``Retry-After`` header: delta-seconds (``"30"``) or an
    HTTP date, read against ``now_wall`` (UTC epoch seconds). ``None`` when
    absent or unreadable; never negative."""
    if value is None:
        return None
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not text:
        return None
    try:
        return max(0.0, float(text)) if text[0].isdigit() else _date_delta(text, now_wall)
    except (TypeError, ValueError, OverflowError):
        return None


def _date_delta(text: str, now_wall: float) -> float | None:
    when = email.utils.parsedate_to_datetime(text)
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now_wall)

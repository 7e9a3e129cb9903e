"""What a load run measured: the outcomes tallied as requests end, the
:class:`LoadResult` made of them, and its plain-text table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import attrs

from .response import StreamScanner

__all__ = [
    "MAX_ERROR_SAMPLES",
    "Z_95",
    "LoadResult",
    "Percentiles",
    "Tally",
    "format_result",
    "percentile",
    "percentile_halfwidth",
]

#: Distinct error strings kept in :attr:`LoadResult.error_samples`.
MAX_ERROR_SAMPLES: Final = 5


@attrs.frozen
class Percentiles:
    """Percentiles and mean of some durations, in milliseconds (all 0.0 when
    there were none)."""

    p50: float
    p95: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        """Percentiles of ``values`` (linear interpolation between ranks)."""
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0)
        ordered = sorted(values)
        return cls(
            _percentile(ordered, 0.50),
            _percentile(ordered, 0.95),
            _percentile(ordered, 0.99),
            math.fsum(ordered) / len(ordered),
        )

    def to_json(self) -> dict[str, float]:
        """``{"p50": …, "p95": …, "p99": …, "mean": …}`` in ms."""
        return {"p50": self.p50, "p95": self.p95, "p99": self.p99, "mean": self.mean}


#: The normal quantile of a two-sided 95 % interval.
Z_95: Final = 1.96


def percentile_halfwidth(values: Sequence[float], q: float, z: float = Z_95) -> float:
    """Half the width of the distribution-free interval (95 % by default) of
    the ``q``-quantile of ``values``, in their unit: the order statistics at
    ranks ``n*q -/+ z*sqrt(n*q*(1-q))``, clamped to the smallest and largest
    value. 0.0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    ordered = sorted(values)
    n = len(ordered)
    spread = z * math.sqrt(n * q * (1 - q))
    low = max(0, math.floor(n * q - spread))
    high = min(n - 1, math.ceil(n * q + spread))
    return (ordered[high] - ordered[low]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` (linear interpolation between ranks;
    0.0 when empty), as in :class:`Percentiles`."""
    return _percentile(sorted(values), q) if values else 0.0


def _percentile(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@attrs.frozen(kw_only=True)
class LoadResult:
    """What a load run measured. Durations are in milliseconds unless named ``_s``.

    Attributes:
        requests: requests started in the measured window that ended well.
        errors: requests started in the window that failed (and open-loop
            starts skipped as ``overloaded``).
        error_samples: up to :data:`MAX_ERROR_SAMPLES` distinct short error
            strings, e.g. ``HTTP 429``, ``timeout``, ``connection refused``.
        duration_s: the measured window, in seconds.
        requests_per_s: ``requests / duration_s``.
        tokens_per_s: streamed tokens of those requests per second: the
            ``usage.completion_tokens`` when sent, else one per content chunk.
        ttft_ms: time to the first content chunk.
        total_ms: time to the end of the answer.
        itl_ms: per request ``(last token time - first token time) / (tokens - 1)``
            (requests with two tokens or more), then percentiles over requests.
        concurrency: the closed loop's clients, or None.
        rate_per_s: the open loop's offered rate, or None.
        tokens: streamed tokens counted (see ``tokens_per_s``).
        cpu_s: CPU seconds this process used during the whole run (warm-up
            and tail included).
        wall_s: wall-clock seconds of the whole run.
        ttfts_ms, totals_ms, itls_ms: the per-request values behind the
            percentiles, in the order the requests ended.
    """

    requests: int
    errors: int
    error_samples: tuple[str, ...]
    duration_s: float
    requests_per_s: float
    tokens_per_s: float
    ttft_ms: Percentiles
    total_ms: Percentiles
    itl_ms: Percentiles
    concurrency: int | None
    rate_per_s: float | None
    tokens: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    ttfts_ms: tuple[float, ...] = ()
    totals_ms: tuple[float, ...] = ()
    itls_ms: tuple[float, ...] = ()

    @property
    def cpu_share(self) -> float:
        """``cpu_s / wall_s``: the fraction of one core this process used."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self, *, samples: bool = False) -> dict[str, Any]:
        """A plain JSON-able dict of the fields (the per-request lists only
        with ``samples=True``)."""
        doc: dict[str, Any] = {
            "requests": self.requests,
            "errors": self.errors,
            "error_samples": list(self.error_samples),
            "duration_s": self.duration_s,
            "requests_per_s": self.requests_per_s,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "ttft_ms": self.ttft_ms.to_json(),
            "total_ms": self.total_ms.to_json(),
            "itl_ms": self.itl_ms.to_json(),
            "concurrency": self.concurrency,
            "rate_per_s": self.rate_per_s,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "cpu_share": self.cpu_share,
        }
        if samples:
            doc["ttfts_ms"] = list(self.ttfts_ms)
            doc["totals_ms"] = list(self.totals_ms)
            doc["itls_ms"] = list(self.itls_ms)
        return doc


class Tally:
    """Collects the outcomes of a load run's requests: only those started in
    ``[start, end)`` (seconds on trio's clock) count.

    Attributes:
        start, end: the measured window.
        requests, errors: requests that ended well, and that failed.
        samples: up to :data:`MAX_ERROR_SAMPLES` distinct error strings.
        tokens: streamed tokens of the requests that ended well.
        ttfts, totals, itls: per-request times in ms, as in :class:`LoadResult`.
    """

    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.end = end
        self.requests = 0
        self.errors = 0
        self.samples: list[str] = []
        self.tokens = 0
        self.ttfts: list[float] = []
        self.totals: list[float] = []
        self.itls: list[float] = []

    def ok(self, started: float, ended: float, scanner: StreamScanner) -> None:
        """A request started at ``started`` ended well at ``ended``; its
        tokens and their times are in ``scanner``."""
        if not self.start <= started < self.end:
            return
        self.requests += 1
        tokens = scanner.tokens
        self.tokens += tokens
        self.totals.append((ended - started) * 1000.0)
        if scanner.chunks:
            self.ttfts.append((scanner.first_at - started) * 1000.0)
            if tokens > 1:
                self.itls.append((scanner.last_at - scanner.first_at) * 1000.0 / (tokens - 1))

    def error(self, started: float, what: str) -> None:
        """A request started at ``started`` failed; ``what`` is a short error string."""
        if not self.start <= started < self.end:
            return
        self.errors += 1
        if len(self.samples) < MAX_ERROR_SAMPLES and what not in self.samples:
            self.samples.append(what)


def _figure(value: float) -> str:
    """Whole from 100 up, else three significant digits (1234, 56.7, 0.05):
    a closed loop against a tight limit still shows its small rate."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def format_result(result: LoadResult) -> str:
    """A short plain-text table of ``result``."""
    shape = (
        f"{result.concurrency} clients (closed loop)"
        if result.concurrency is not None
        else f"{result.rate_per_s:g} requests/s offered (open loop)"
    )
    lines = [
        f"load       {shape}, {result.duration_s:g} s measured",
        f"requests   {result.requests} ok, {result.errors} errors"
        + (f" ({', '.join(result.error_samples)})" if result.error_samples else ""),
        f"rate       {_figure(result.requests_per_s)} requests/s, "
        f"{_figure(result.tokens_per_s)} tokens/s",
        f"{'':10} {'p50':>9} {'p95':>9} {'p99':>9} {'mean':>9}",
    ]
    for name, p in (("TTFT", result.ttft_ms), ("total", result.total_ms), ("ITL", result.itl_ms)):
        lines.append(f"{name + ' ms':10} {p.p50:9.2f} {p.p95:9.2f} {p.p99:9.2f} {p.mean:9.2f}")
    lines.append(f"client CPU {100 * result.cpu_share:.0f} % of one core")
    return "\n".join(lines)

"""After a request: its metrics, the accountant settled, its usage row
queued. Synchronous: nothing here awaits; with the usage journal the caller
awaits the returned event before it sends the end of the answer."""

from __future__ import annotations

import time
from collections.abc import Container

import trio

from llmgw import metrics
from llmgw.accounting.accountant import Accountant
from llmgw.accounting.usage import UsageWriter
from llmgw.store import UsageRow

from .request import Outcome, Request
from .sse import Usage

__all__ = ["Recorder"]


class Recorder:
    """Records finished requests.

    Args:
        usage: where usage rows go (queued, never awaited).
        accountant: settles each request's reservation; ``None``: no limits.
        accounting: write usage rows; off only for ``llmgw bench gateway``'s
            ``bare`` mode.
    """

    def __init__(
        self, *, usage: UsageWriter, accountant: Accountant | None, accounting: bool
    ) -> None:
        self._usage = usage
        self._accountant = accountant
        self._accounting = accounting

    def record(
        self, request: Request, outcome: Outcome, catalog: Container[str]
    ) -> trio.Event | None:
        """Count ``request`` in the metrics (by its model when ``catalog``
        has it, else unlabelled) with ``outcome.status``; with a key, settle
        its reservation with ``outcome.usage`` (released when ``None``) and
        queue its usage row with the cost.

        Returns:
            The event set once the row is durable (the usage journal), or
            ``None`` when there is nothing to wait for.
        """
        status = outcome.status
        usage = outcome.usage
        duration_s = time.perf_counter() - request.started
        label = request.model if request.model in catalog else ""
        served = outcome.served or label
        ttft_s = outcome.ttft_s
        metrics.REQUESTS.labels(label, str(status)).inc()
        metrics.REQUEST_DURATION.labels(label).observe(duration_s)
        if ttft_s is not None:
            metrics.TTFT.labels(label).observe(ttft_s)
        if usage is not None:
            metrics.TOKENS.labels(label, "prompt").inc(usage.prompt_tokens)
            metrics.TOKENS.labels(label, "cached").inc(usage.cached_tokens)
            metrics.TOKENS.labels(label, "completion").inc(usage.completion_tokens)
        verdict = outcome.verdict
        if verdict is not None:
            metrics.GUARD_DURATION.observe(verdict.seconds)
            for rule, action in verdict.actions.items():
                metrics.GUARD_VERDICTS.labels(rule, action).inc()
        key = request.key
        if key is None or not self._accounting:
            return None
        cost_micros = 0
        reservation = request.reservation
        if reservation is not None and self._accountant is not None:
            now = time.time()
            if usage is not None:
                cost_micros = self._accountant.settle(
                    reservation,
                    prompt=usage.prompt_tokens,
                    cached=usage.cached_tokens,
                    completion=usage.completion_tokens,
                    now=now,
                    served_model=served or None,
                )
            else:
                self._accountant.release(reservation, now)
        return self._usage.record(
            _row(request, outcome, catalog, status=status, usage=usage, cost_micros=cost_micros)
        )

    def begin(self, request: Request, outcome: Outcome, catalog: Container[str]) -> None:
        """A stream with a key starts: the usage journal keeps the row it
        would get if a crash cut it (status 503, the tokens seen so far, no
        cost) until its own row is recorded."""
        if request.key is None or not self._accounting:
            return

        def snapshot() -> UsageRow:
            progress = outcome.progress
            usage = outcome.usage or (progress() if progress is not None else None)
            return _row(request, outcome, catalog, status=503, usage=usage, cost_micros=0)

        self._usage.begin(request.request_id, snapshot)


def _row(
    request: Request,
    outcome: Outcome,
    catalog: Container[str],
    *,
    status: int,
    usage: Usage | None,
    cost_micros: int,
) -> UsageRow:
    key = request.key
    assert key is not None
    label = request.model if request.model in catalog else ""
    served = outcome.served or label
    ttft_s = outcome.ttft_s
    duration_s = time.perf_counter() - request.started
    project_id, team_id, org_id = request.scope_ids
    verdict = outcome.verdict
    return UsageRow(
        request_id=request.request_id,
        created_at=time.time(),
        key_id=key.id,
        model=label or request.model[:200],
        served_model=served if served != label else "",
        status=status,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        cached_tokens=usage.cached_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        cost_micros=cost_micros,
        duration_ms=round(duration_s * 1000, 3),
        ttft_ms=None if ttft_s is None else round(ttft_s * 1000, 3),
        replica_id=outcome.replica,
        stream=request.stream,
        endpoint=request.kind,
        project_id=project_id,
        team_id=team_id,
        org_id=org_id,
        cache_hit=outcome.cache_hit,
        guard_rules=",".join(verdict.rules) if verdict is not None else "",
        guard_action=verdict.action if verdict is not None else "",
        guard_ms=round(verdict.seconds * 1000, 3) if verdict is not None else 0.0,
        guard_events=tuple((d, r, a) for (d, r), a in verdict.events.items())
        if verdict is not None
        else (),
    )

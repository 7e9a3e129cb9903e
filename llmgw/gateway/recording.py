"""After a request: its metrics, the accountant settled, its usage row
queued. Synchronous: nothing here awaits; with the usage journal the caller
awaits the returned event before it sends the end of the answer."""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Final

import trio
from prometheus_client import Counter

from llmgw import metrics
from llmgw.accounting.accountant import Accountant
from llmgw.accounting.usage import UsageWriter
from llmgw.store import UsageRow

from .request import Outcome, Request
from .sse import Usage

__all__ = ["Recorder"]

#: Most model labels whose metric children are kept bound (catalog names and "").
_MAX_LABELS: Final = 10_000


class _Children:
    """One model label's metric children, bound once (``labels()`` validates
    and locks on every call)."""

    __slots__ = ("cached", "completion", "duration", "label", "prompt", "statuses", "ttft")

    def __init__(self, label: str) -> None:
        self.label = label
        self.duration = metrics.REQUEST_DURATION.labels(label)
        self.ttft = metrics.TTFT.labels(label)
        self.prompt = metrics.TOKENS.labels(label, "prompt")
        self.cached = metrics.TOKENS.labels(label, "cached")
        self.completion = metrics.TOKENS.labels(label, "completion")
        #: HTTP status → its ``llmgw_requests`` child.
        self.statuses: dict[int, Counter] = {}

    def requests(self, status: int) -> Counter:
        child = self.statuses.get(status)
        if child is None:
            child = self.statuses[status] = metrics.REQUESTS.labels(self.label, str(status))
        return child


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
        #: Model label → its metric children (labels are catalog names or "").
        self._children: dict[str, _Children] = {}

    def _metrics(self, label: str) -> _Children:
        children = self._children.get(label)
        if children is None:
            if len(self._children) >= _MAX_LABELS:
                self._children.clear()
            children = self._children[label] = _Children(label)
        return children

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
        ttft_s = outcome.ttft_s
        children = self._metrics(label)
        children.requests(status).inc()
        children.duration.observe(duration_s)
        if ttft_s is not None:
            children.ttft.observe(ttft_s)
        if usage is not None:
            # inc(0) changes nothing but takes the child's lock.
            if usage.prompt_tokens:
                children.prompt.inc(usage.prompt_tokens)
            if usage.cached_tokens:
                children.cached.inc(usage.cached_tokens)
            if usage.completion_tokens:
                children.completion.inc(usage.completion_tokens)
        verdict = outcome.verdict
        if verdict is not None:
            metrics.GUARD_DURATION.observe(verdict.seconds)
            for rule, action in verdict.actions.items():
                metrics.GUARD_VERDICTS.labels(rule, action).inc()
        key = request.key
        if key is None or not self._accounting:
            return None
        cost_micros = 0
        now = time.time()
        reservation = request.reservation
        if reservation is not None and self._accountant is not None:
            if usage is not None:
                cost_micros = self._accountant.settle(
                    reservation,
                    prompt=usage.prompt_tokens,
                    cached=usage.cached_tokens,
                    completion=usage.completion_tokens,
                    now=now,
                    served_model=outcome.served or label or None,
                )
            else:
                self._accountant.release(reservation, now)
        return self._usage.record(
            _row(
                request,
                outcome,
                label,
                status=status,
                usage=usage,
                cost_micros=cost_micros,
                created_at=now,
                duration_s=duration_s,
            )
        )

    def begin(self, request: Request, outcome: Outcome, catalog: Container[str]) -> None:
        """A stream with a key starts: the usage journal keeps the row it
        would get if a crash cut it (status 503, the tokens seen so far, no
        cost) until its own row is recorded."""
        if request.key is None or not self._accounting:
            return

        def snapshot() -> UsageRow:
            label = request.model if request.model in catalog else ""
            progress = outcome.progress
            usage = outcome.usage or (progress() if progress is not None else None)
            return _row(
                request,
                outcome,
                label,
                status=503,
                usage=usage,
                cost_micros=0,
                created_at=time.time(),
                duration_s=time.perf_counter() - request.started,
            )

        self._usage.begin(request.request_id, snapshot)


def _row(
    request: Request,
    outcome: Outcome,
    label: str,
    *,
    status: int,
    usage: Usage | None,
    cost_micros: int,
    created_at: float,
    duration_s: float,
) -> UsageRow:
    """``request``'s usage row; ``label``: its model when the catalog has
    it, else ``""``; ``created_at`` in epoch seconds."""
    key = request.key
    assert key is not None
    served = outcome.served or label
    ttft_s = outcome.ttft_s
    project_id, team_id, org_id = request.scope_ids
    verdict = outcome.verdict
    if usage is not None:
        prompt, cached, completion = (
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
        )
    else:
        prompt = cached = completion = 0
    return UsageRow(
        request_id=request.request_id,
        created_at=created_at,
        key_id=key.id,
        model=label or request.model[:200],
        served_model=served if served != label else "",
        status=status,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
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

"""Usage retention: raw usage rows older than ``auth.usage_retain_days`` are
deleted by the leader, a short batch at a time; the hourly, daily
and monthly roll-ups keep their sums for good (``docs/up.md``, Usage kept).

:func:`serve_usage_retention` runs while this control plane leads. Every
:data:`PRUNE_EVERY_S` (and once at once) it deletes the rows older than the
retention, floored to the hour, in batches of :data:`PRUNE_BATCH` rows, each
batch its own short write transaction, with a pause of :data:`PRUNE_PAUSE_S`
between batches so the usage writer and every other writer get the lock in
between: never one large delete holding the write lock. The retention is
read at each pass, so a changed setting applies at the next pass. Each batch
carries the leader lease as its fence, so the store refuses the deletes of a
control plane that was deposed meanwhile (:class:`llmgw.store.Fenced`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final, NoReturn

import trio

from llmgw.store import Lease, Store, StoreError

__all__ = [
    "PRUNE_BATCH",
    "PRUNE_EVERY_S",
    "PRUNE_PAUSE_S",
    "prune_usage_past",
    "serve_usage_retention",
]

log = logging.getLogger("llmgw.accounting.retention")

#: Raw rows deleted per write transaction.
PRUNE_BATCH: Final = 2000
#: Pause between two batches, in seconds: other writers take the lock here.
PRUNE_PAUSE_S: Final = 0.05
#: Time between two passes, in seconds.
PRUNE_EVERY_S: Final = 600.0
DAY_S: Final = 86_400.0


async def prune_usage_past(
    store: Store,
    retain_days: int,
    now: float,
    *,
    batch: int = PRUNE_BATCH,
    pause_s: float = PRUNE_PAUSE_S,
    fence: Lease | None = None,
) -> int:
    """Delete the raw rows older than ``retain_days`` before ``now`` (UTC epoch
    s; the cut is floored to its hour), ``batch`` rows per transaction with
    ``pause_s`` between transactions, until none is left. With ``fence`` (the
    leader lease), each batch is refused once that lease moved on.

    Returns:
        How many rows were deleted.

    Raises:
        StoreError: the store failed, or refused a batch under a stale
            ``fence`` (:class:`llmgw.store.Fenced`); the rows deleted so far
            stay deleted (their sums are in the roll-ups), the rest wait for
            the next pass.
        ValueError: ``retain_days`` or ``batch`` is less than 1.
    """
    if retain_days < 1:
        raise ValueError(f"retain_days must be 1 or more, not {retain_days}")
    before = now - retain_days * DAY_S
    deleted = 0
    while True:
        count = await store.prune_usage(before, limit=batch, fence=fence)
        deleted += count
        if count < batch:
            return deleted
        await trio.sleep(pause_s)


async def serve_usage_retention(
    store: Store,
    retain_days: Callable[[], int],
    *,
    every_s: float = PRUNE_EVERY_S,
    batch: int = PRUNE_BATCH,
    pause_s: float = PRUNE_PAUSE_S,
    fence: Lease | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Prune raw usage rows past ``retain_days()`` now and every ``every_s``
    seconds until cancelled (see the module docstring), each batch fenced by
    ``fence`` (the leader lease this control plane holds).

    A pass that fails (the store is locked or down) is logged and tried
    again at the next one.

    Returns:
        Never returns unless cancelled.
    """
    task_status.started()
    while True:
        days = retain_days()
        try:
            deleted = await prune_usage_past(
                store, days, time.time(), batch=batch, pause_s=pause_s, fence=fence
            )
        except StoreError as exc:
            log.warning("usage rows older than %d days not pruned yet (%s)", days, exc)
        else:
            if deleted:
                log.info(
                    "pruned %d usage rows older than %d days (their sums stay in the roll-ups)",
                    deleted,
                    days,
                )
        await trio.sleep(every_s)

"""The usage writer: one row per request, written in batches off the request path.

Handlers call :meth:`UsageWriter.record` (never blocks, never awaits the
store). :func:`serve_usage_writer` drains the bounded buffer and writes a
batch every ``flush_interval_s`` or as soon as ``batch_size`` rows wait.
When the store fails, the batch is kept and written again later
(``insert_usage`` skips request ids already stored, so a retry never counts
twice); rows are dropped only when the buffer is full, and counted in
``llmgw_usage_dropped_total``. At shutdown the buffer is flushed.

With a :class:`~llmgw.accounting.journal.UsageJournal` the rows do not wait
in memory: :meth:`UsageWriter.record` appends each to the journal and returns
the event set once it is on disk, and the writer writes the rows of the
journal's closed segments into the store, deleting each once its rows are
stored (rows of a crashed process included, read back from its files, and a
cut row for each of its streams left unfinished). While the store fails the
rows wait in the journal, bounded by the disk.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

import trio

from llmgw import metrics
from llmgw.errors import describe
from llmgw.store import Store, StoreError, UsageRow

from .journal import UsageJournal, read_records, read_segment

__all__ = ["UsageWriter", "serve_usage_writer"]

log = logging.getLogger("llmgw.accounting.usage")

FLUSH_INTERVAL_S: Final = 1.0
BATCH_SIZE: Final = 500
BUFFER_SIZE: Final = 100_000
#: Longest wait between retries while the store is failing.
RETRY_MAX_S: Final = 30.0
#: The final flush at shutdown gets this long.
SHUTDOWN_FLUSH_S: Final = 10.0
#: The same with a journal: rows not written by then stay in the journal for
#: the next start, so the stop is not held up by a store that is locked.
JOURNAL_SHUTDOWN_FLUSH_S: Final = 2.0
#: While the store is behind, the journal's active segment is closed at this size.
SEGMENT_BYTES: Final = 4 << 20


class UsageWriter:
    """A bounded buffer of usage rows waiting for the store."""

    def __init__(
        self,
        *,
        buffer_size: int = BUFFER_SIZE,
        batch_size: int = BATCH_SIZE,
        journal: UsageJournal | None = None,
    ) -> None:
        self._rows: deque[UsageRow] = deque()
        self.journal = journal
        self._buffer_size = buffer_size
        self._wake = trio.Event()
        self.batch_size = batch_size

    def record(self, row: UsageRow) -> trio.Event | None:
        """Queue ``row``. With a journal: the event set once the row is on
        disk. Without: ``None`` (and a dropped-row count when the buffer is
        full)."""
        if self.journal is not None:
            return self.journal.append(row)
        if len(self._rows) >= self._buffer_size:
            metrics.USAGE_DROPPED.inc()
            log.error(
                "usage buffer full (%d rows): row %s dropped", self._buffer_size, row.request_id
            )
            return None
        self._rows.append(row)
        metrics.USAGE_QUEUE_DEPTH.set(len(self._rows))
        if len(self._rows) >= self.batch_size:
            self._wake.set()
        return None

    def begin(self, request_id: str, snapshot: Callable[[], UsageRow]) -> None:
        """A stream under way (:meth:`UsageJournal.begin`); nothing without a journal."""
        if self.journal is not None:
            self.journal.begin(request_id, snapshot)

    def __len__(self) -> int:
        return len(self._rows)

    async def flush(self, store: Store) -> None:
        """Write everything queued now, batch by batch.

        Raises:
            StoreError: the store failed; the failed batch stays queued (with
                a journal: its segment stays).
            OSError: a journal segment could not be read or deleted.
        """
        journal = self.journal
        if journal is not None:
            if not journal.closed_segments() or journal.active_bytes >= SEGMENT_BYTES:
                # Caught up (or the active segment is large): close the
                # active segment so its rows can be written.
                await journal.rotate()
            crashed = journal.crashed_segments()
            if crashed:
                rows = await trio.to_thread.run_sync(_replay, crashed)
                for start in range(0, len(rows), self.batch_size):
                    await _write_batch(store, rows[start : start + self.batch_size])
                for segment in crashed:
                    journal.delete(segment)
            for segment in journal.closed_segments():
                held = journal.held_rows(segment)
                if held is None:
                    held = await trio.to_thread.run_sync(read_segment, segment)
                for start in range(0, len(held), self.batch_size):
                    await _write_batch(store, held[start : start + self.batch_size])
                journal.delete(segment)
            return
        while self._rows:
            batch = [self._rows[i] for i in range(min(self.batch_size, len(self._rows)))]
            await _write_batch(store, batch)
            for _ in batch:
                self._rows.popleft()
            metrics.USAGE_QUEUE_DEPTH.set(len(self._rows))

    async def wait_for_work(self, timeout_s: float) -> None:
        with trio.move_on_after(timeout_s):
            await self._wake.wait()
        self._wake = trio.Event()


def _replay(segments: list[Path]) -> list[UsageRow]:
    """The rows of an earlier process's segments, and a row for each stream
    it started and never finished (its last "started" record)."""
    rows: list[UsageRow] = []
    starts: dict[str, UsageRow] = {}
    for segment in segments:
        found, started = read_records(segment)
        rows += found
        for row in started:
            starts[row.request_id] = row
    for row in rows:
        starts.pop(row.request_id, None)
    if starts:
        log.warning("%d streams cut by a crash recorded as cut (503)", len(starts))
    return rows + list(starts.values())


async def _write_batch(store: Store, batch: Sequence[UsageRow]) -> None:
    """Insert ``batch`` and record each key's newest use in it (one
    :meth:`~llmgw.store.Store.mark_keys_used` call per batch, so a key's last
    use outlives usage retention).

    Raises:
        StoreError: the store failed.
    """
    await store.insert_usage(batch)
    used: dict[str, float] = {}
    for row in batch:
        if row.key_id and row.created_at > used.get(row.key_id, 0.0):
            used[row.key_id] = row.created_at
    if used:
        await store.mark_keys_used(used)


async def serve_usage_writer(
    writer: UsageWriter,
    store: Store,
    *,
    flush_interval_s: float = FLUSH_INTERVAL_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Flush ``writer`` into ``store`` until cancelled, then flush once more.

    Returns:
        Never returns unless cancelled. On cancellation the remaining rows
        are written (shielded, at most :data:`SHUTDOWN_FLUSH_S`, or
        :data:`JOURNAL_SHUTDOWN_FLUSH_S` with a journal: what is not written
        by then stays in the journal for the next start).
    """
    task_status.started()
    retry_s = flush_interval_s
    failing = False
    try:
        while True:
            await writer.wait_for_work(retry_s if failing else flush_interval_s)
            try:
                await writer.flush(store)
            except (StoreError, OSError) as exc:
                retry_s = min(retry_s * 2, RETRY_MAX_S) if failing else flush_interval_s
                if not failing and writer.journal is not None:
                    log.error(
                        "usage rows not written (%s); %d bytes kept in the journal, retrying",
                        describe(exc),
                        writer.journal.pending_bytes,
                    )
                elif not failing:
                    log.error(
                        "usage rows not written (%s); %d kept, retrying", describe(exc), len(writer)
                    )
                failing = True
                metrics.USAGE_WRITE_FAILURES.inc()
            else:
                if failing:
                    log.warning("usage rows written again after the store came back")
                failing = False
    finally:
        bound_s = SHUTDOWN_FLUSH_S if writer.journal is None else JOURNAL_SHUTDOWN_FLUSH_S
        reason = f"the store did not take them within {bound_s:g} s"
        with trio.CancelScope(shield=True):
            with trio.move_on_after(bound_s):
                try:
                    await writer.flush(store)
                    reason = ""
                except (StoreError, OSError) as exc:
                    reason = describe(exc)
            if reason and writer.journal is not None:
                log.error("usage rows left in the journal at shutdown (%s)", reason)
            elif reason:
                log.error("usage rows lost at shutdown: %d (%s)", len(writer), reason)

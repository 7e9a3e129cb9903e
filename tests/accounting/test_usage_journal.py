"""The usage journal: append, group commit, a torn tail, replay into the store
(idempotent by request id), trimming, and rows waiting while the store fails."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio

from llmgw import metrics
from llmgw.accounting.journal import (
    BEHIND_WARN_S,
    WARN_BYTES,
    UsageJournal,
    encode_row,
    read_records,
    read_segment,
    serve_journal_committer,
)
from llmgw.accounting.usage import UsageWriter, serve_usage_writer
from llmgw.errors import StoreError
from llmgw.store import KeyRecord, Store, UsageRow, open_sqlite_store


def row(n: int) -> UsageRow:
    return UsageRow(
        request_id=f"req_{n:04d}",
        created_at=1_700_000_000.0 + n,
        key_id="k1",
        model="m",
        status=200,
        prompt_tokens=n,
        completion_tokens=2 * n,
        ttft_ms=None if n % 2 else 1.5,
    )


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_sqlite_store(tmp_path / "llmgw.db") as opened:
        yield opened


@pytest.fixture(params=[0.0, 0.05], ids=["group-commit", "write-at-once"])
def sync_s(request: pytest.FixtureRequest) -> float:
    """Each test runs under both policies (``sync_interval_s``)."""
    value: float = request.param
    return value


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


async def stored_ids(store: Store) -> set[str]:
    return {r.request_id for r in await store.list_usage(last=10_000)}


async def test_a_group_is_one_write_and_one_sync_for_every_row_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[int] = []
    real_sync = os.fdatasync

    def counting_sync(fd: int) -> None:
        syncs.append(fd)
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", counting_sync)
    journal = UsageJournal(tmp_path / "j", sync_interval_s=0)
    events = [journal.append(row(n)) for n in range(50)]
    assert len({id(e) for e in events}) == 1
    first = events[0]
    assert first is not None
    assert not first.is_set()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_journal_committer, journal)
        with trio.fail_after(10):
            await first.wait()
        later = journal.append(row(50))
        assert later is not None
        assert later is not first
        with trio.fail_after(10):
            await later.wait()
        nursery.cancel_scope.cancel()
    assert len(syncs) == 2
    journal.close()
    (segment,) = segments(tmp_path / "j")
    assert read_segment(segment) == [row(n) for n in range(51)]


async def test_a_torn_last_record_is_skipped(tmp_path: Path, sync_s: float) -> None:
    journal = UsageJournal(tmp_path / "j", sync_interval_s=sync_s)
    for n in range(3):
        journal.append(row(n))
    await journal.commit()
    journal.close()
    (segment,) = segments(tmp_path / "j")
    whole = encode_row(row(3))
    with segment.open("ab") as f:
        f.write(whole[: len(whole) - 5])
    assert read_segment(segment) == [row(0), row(1), row(2)]
    # A corrupt payload (checksum fails) ends the segment the same way.
    data = bytearray(segment.read_bytes())
    data[-(len(whole) - 5) - 10] ^= 0xFF
    segment.write_bytes(bytes(data))
    assert read_segment(segment) == [row(0), row(1)]


async def test_replay_writes_a_crashed_process_rows_once_and_trims(
    tmp_path: Path, sync_s: float, store: Store
) -> None:
    directory = tmp_path / "j"
    crashed = UsageJournal(directory, sync_interval_s=sync_s)
    for n in range(10):
        crashed.append(row(n))
    await crashed.commit()
    crashed.close()  # as a SIGKILL leaves it: the segment stays
    # Some rows reached the store before the crash.
    await store.insert_usage([row(0), row(1), row(2)])
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    assert len(journal.closed_segments()) == 1
    writer = UsageWriter(journal=journal, batch_size=4)
    await writer.flush(store)
    assert await stored_ids(store) == {row(n).request_id for n in range(10)}
    (active,) = segments(directory)  # only the new, empty active segment
    assert active.stat().st_size == 0
    assert journal.pending_bytes == 0
    assert metrics.USAGE_JOURNAL_BYTES._value.get() == 0
    # The same segment replayed again (a crash after the store had it) adds nothing.
    again = UsageJournal(tmp_path / "again", sync_interval_s=sync_s)
    for n in range(10):
        again.append(row(n))
    await again.commit()
    await UsageWriter(journal=again).flush(store)
    summary = await store.list_usage(last=100)
    assert len(summary) == 10
    journal.close()
    again.close()


class FailingStore:
    """A store whose writes fail until ``up`` is set."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.up = False
        self.attempts = 0
        self.stored = trio.Event()

    async def insert_usage(self, rows: Sequence[UsageRow]) -> None:
        self.attempts += 1
        if not self.up:
            raise StoreError("the store is down")
        await self.inner.insert_usage(rows)
        self.stored.set()

    async def mark_keys_used(self, used: Mapping[str, float]) -> None:
        await self.inner.mark_keys_used(used)


async def test_rows_wait_in_the_journal_while_the_store_fails(
    tmp_path: Path, sync_s: float, store: Store
) -> None:
    directory = tmp_path / "j"
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    writer = UsageWriter(journal=journal, batch_size=7)
    failing = FailingStore(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_journal_committer, journal)
        for n in range(20):
            done = writer.record(row(n))
            assert (done is None) == (sync_s > 0)
            if done is not None:
                with trio.fail_after(10):
                    await done.wait()
        nursery.cancel_scope.cancel()
    with pytest.raises(StoreError):
        await writer.flush(failing)  # type: ignore[arg-type]
    assert journal.pending_bytes > 0
    assert len(writer) == 0  # nothing waits in memory
    assert sum(len(read_segment(p)) for p in journal.closed_segments()) == 20
    failing.up = True
    await writer.flush(failing)  # type: ignore[arg-type]
    assert journal.pending_bytes == 0
    journal.close()
    assert await stored_ids(store) == {row(n).request_id for n in range(20)}
    assert all(p.stat().st_size == 0 for p in segments(directory))


async def test_the_writer_task_writes_the_journal_and_retries_a_failing_store(
    tmp_path: Path, sync_s: float, store: Store
) -> None:
    journal = UsageJournal(tmp_path / "j", sync_interval_s=sync_s)
    writer = UsageWriter(journal=journal)
    failing = FailingStore(store)
    failing.up = True
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_journal_committer, journal)
        await nursery.start(
            partial(serve_usage_writer, writer, failing, flush_interval_s=0.01)  # type: ignore[arg-type]
        )
        for n in range(5):
            writer.record(row(n))
        with trio.fail_after(30):
            await failing.stored.wait()
        nursery.cancel_scope.cancel()
    journal.close()
    assert await stored_ids(store) == {row(n).request_id for n in range(5)}


async def test_a_quiet_writer_leaves_only_an_empty_active_segment(
    tmp_path: Path, sync_s: float, store: Store
) -> None:
    directory = tmp_path / "j"
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    writer = UsageWriter(journal=journal)
    for n in range(5):
        writer.record(row(n))
    await journal.commit()
    await writer.flush(store)
    (active,) = segments(directory)
    assert active.stat().st_size == 0
    assert journal.pending_bytes == 0
    journal.close()
    assert len(await stored_ids(store)) == 5


async def test_a_stream_cut_by_a_crash_gets_its_last_started_record_as_its_row(
    tmp_path: Path, sync_s: float, store: Store
) -> None:
    directory = tmp_path / "j"
    crashed = UsageJournal(directory, sync_interval_s=sync_s)
    tokens = [0]

    def snapshot(n: int) -> UsageRow:
        return attrs.evolve(row(n), status=503, completion_tokens=tokens[0])

    crashed.begin(row(1).request_id, lambda: snapshot(1))  # finishes
    crashed.begin(row(2).request_id, lambda: snapshot(2))  # cut by the crash
    await crashed.commit()
    crashed.append(row(1))
    await crashed.commit()
    tokens[0] = 7
    await crashed.rotate()  # stream 2 starts again in the new segment, 7 tokens seen
    for segment in crashed.closed_segments():
        crashed.delete(segment)  # as the writer does once the store has its rows
    crashed.close()
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    assert len(journal.crashed_segments()) == 1
    await UsageWriter(journal=journal).flush(store)
    journal.close()
    stored = {r.request_id: r for r in await store.list_usage(last=100)}
    assert set(stored) == {row(2).request_id}  # row 1 went with the deleted segment
    cut = stored[row(2).request_id]
    assert (cut.status, cut.completion_tokens) == (503, 7)


async def test_a_finished_stream_gets_no_cut_row(
    tmp_path: Path, sync_s: float, store: Store
) -> None:
    directory = tmp_path / "j"
    crashed = UsageJournal(directory, sync_interval_s=sync_s)
    crashed.begin(row(1).request_id, lambda: attrs.evolve(row(1), status=503))
    crashed.append(row(1))
    await crashed.commit()
    crashed.close()
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    await UsageWriter(journal=journal).flush(store)
    journal.close()
    (stored,) = await store.list_usage(last=100)
    assert stored.status == 200


async def test_the_committer_writes_the_tokens_of_streams_under_way(
    tmp_path: Path, sync_s: float, store: Store
) -> None:
    directory = tmp_path / "j"
    crashed = UsageJournal(directory, sync_interval_s=sync_s)
    tokens = [0]
    crashed.begin(
        row(3).request_id, lambda: attrs.evolve(row(3), status=503, completion_tokens=tokens[0])
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_journal_committer, crashed)
        for seen in (5, 9):
            tokens[0] = seen
            # The committer wakes by itself every PROGRESS_S while a stream is under way.
            with trio.fail_after(10):
                while _most_tokens(directory) < seen:  # noqa: ASYNC110 -- the file is watched
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    crashed.close()
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    await UsageWriter(journal=journal).flush(store)
    journal.close()
    (cut,) = await store.list_usage(last=100)
    assert (cut.status, cut.completion_tokens) == (503, 9)


def _most_tokens(directory: Path) -> int:
    starts = [s for p in segments(directory) for s in read_records(p)[1]]
    return max((s.completion_tokens for s in starts), default=-1)


async def test_write_at_once_puts_each_row_in_the_file_before_append_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[float] = []
    real_sync = os.fdatasync

    def counting_sync(fd: int) -> None:
        syncs.append(time.monotonic())
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", counting_sync)
    journal = UsageJournal(tmp_path / "j", sync_interval_s=0.2)
    # Nothing to wait for, and the row is already in the file: a kill of
    # the process now (no committer has run) loses nothing.
    assert all(journal.append(row(n)) is None for n in range(50))
    (segment,) = segments(tmp_path / "j")
    assert read_segment(segment) == [row(n) for n in range(50)]
    assert syncs == []
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_journal_committer, journal)
        with trio.fail_after(10):
            while not syncs:  # noqa: ASYNC110 -- the committer is watched
                await trio.sleep(0.01)
        # Rows written just after a sync wait for the interval: syncs are
        # at least sync_interval_s apart, however many rows come.
        began = time.monotonic()
        for n in range(50, 100):
            journal.append(row(n))
            await trio.sleep(0.005)
        elapsed_s = time.monotonic() - began
        with trio.fail_after(10):
            while len(syncs) < 2:  # noqa: ASYNC110 -- the committer is watched
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    # One sync per row would be 50 more; at most one per 0.2 s is allowed
    # (plus the first, the one in progress and the final one).
    assert len(syncs) <= elapsed_s / 0.2 + 3 < 50
    journal.close()
    assert read_segment(segment) == [row(n) for n in range(100)]


def test_a_negative_sync_interval_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sync_interval_s"):
        UsageJournal(tmp_path / "j", sync_interval_s=-1)


async def test_a_flush_records_each_keys_newest_use_in_the_key(store: Store) -> None:
    """Regression: the writer never called ``mark_keys_used``, so a key's
    stored last use stayed empty (and read "never" once retention pruned)."""
    made = "key_1"
    await store.insert_key(
        KeyRecord(id=made, name="k", key_hash="ab" * 32, prefix="sk-", created_at=1.0)
    )
    writer = UsageWriter(batch_size=2)
    for n in (3, 5, 4):
        assert writer.record(attrs.evolve(row(n), key_id=made)) is None
    await writer.flush(store)
    [stored] = [k for k in await store.list_keys() if k.id == made]
    assert stored.last_used_at == row(5).created_at


async def test_bytes_pending_are_warned_of_only_once_the_oldest_has_waited(
    tmp_path: Path, sync_s: float, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # Past WARN_BYTES but younger than BEHIND_WARN_S (a busy writer between
    # two flushes): no warning. The store failing until the oldest row has
    # waited BEHIND_WARN_S: a warning naming the bytes and the wait.
    now = [100.0]
    journal = UsageJournal(tmp_path / "j", sync_interval_s=sync_s, clock=lambda: now[0])
    writer = UsageWriter(journal=journal)
    failing = FailingStore(store)
    wide = attrs.evolve(row(0), served_model="x" * 2000)
    n = 0
    while journal.pending_bytes < WARN_BYTES:
        writer.record(attrs.evolve(wide, request_id=f"req_{n:06d}"))
        await journal.commit()
        n += 1
    now[0] += BEHIND_WARN_S - 1
    await journal.commit()
    assert journal.oldest_s() == BEHIND_WARN_S - 1
    assert "not yet in the store" not in caplog.text
    with pytest.raises(StoreError):
        await writer.flush(failing)  # type: ignore[arg-type]
    now[0] += 1
    writer.record(attrs.evolve(wide, request_id="req_last"))
    await journal.commit()
    assert journal.oldest_s() == BEHIND_WARN_S
    assert f"the oldest for {BEHIND_WARN_S:.0f} s" in caplog.text
    # Written at last: nothing waits, nothing is old.
    failing.up = True
    await journal.commit()
    await writer.flush(failing)  # type: ignore[arg-type]
    assert journal.oldest_s() == 0.0  # the last row's segment is the active one
    await writer.flush(failing)  # type: ignore[arg-type]
    assert journal.pending_bytes == 0
    assert journal.oldest_s() == 0.0
    journal.close()


async def test_the_writer_takes_this_process_rows_from_memory_not_from_the_file(
    tmp_path: Path, sync_s: float, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decoding a segment in a worker thread holds the interpreter's lock, and
    # the event loop with it, for milliseconds a flush: the rows this process
    # wrote are kept as appended, the same rows the file holds.
    directory = tmp_path / "j"
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    writer = UsageWriter(journal=journal)
    for n in range(30):
        writer.record(row(n))
        if n % 10 == 9:
            journal.begin(f"stream_{n}", partial(row, 1000 + n))
            await journal.commit()
            await journal.rotate()
    await journal.commit()
    closed = journal.closed_segments()
    assert len(closed) == 3
    for segment in closed:
        assert journal.held_rows(segment) == read_segment(segment)
    assert sum(len(journal.held_rows(s) or ()) for s in closed) == 30

    def no_reading(path: Path) -> list[UsageRow]:
        raise AssertionError(f"{path.name} read back")

    monkeypatch.setattr("llmgw.accounting.usage.read_segment", no_reading)
    await writer.flush(store)
    journal.close()
    assert await stored_ids(store) == {row(n).request_id for n in range(30)}


async def test_past_the_held_rows_a_segment_is_read_back_from_its_file(
    tmp_path: Path, sync_s: float, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("llmgw.accounting.journal.HELD_ROWS", 5)
    directory = tmp_path / "j"
    earlier = UsageJournal(directory, sync_interval_s=sync_s)
    earlier.append(row(100))
    await earlier.commit()
    earlier.close()
    journal = UsageJournal(directory, sync_interval_s=sync_s)
    writer = UsageWriter(journal=journal)
    for n in range(4):
        writer.record(row(n))
    await journal.commit()
    await journal.rotate()
    for n in range(4, 8):  # 4 + 4 > 5: none of this segment's rows are kept
        writer.record(row(n))
    await journal.commit()
    await journal.rotate()
    old, first, second = journal.closed_segments()
    assert journal.held_rows(old) is None  # an earlier process's
    assert journal.held_rows(first) == [row(n) for n in range(4)]
    assert journal.held_rows(second) is None
    assert read_segment(second) == [row(n) for n in range(4, 8)]
    await writer.flush(store)
    assert journal.closed_segments() == []
    # Deleted segments give their place back.
    for n in range(8, 13):
        writer.record(row(n))
    await journal.commit()
    await journal.rotate()
    (third,) = journal.closed_segments()
    assert journal.held_rows(third) == [row(n) for n in range(8, 13)]
    await writer.flush(store)
    journal.close()
    assert await stored_ids(store) == {row(n).request_id for n in [*range(13), 100]}

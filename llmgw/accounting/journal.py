"""The usage journal: usage rows made durable on local disk before a client
gets the end of its answer (``docs/up.md``, "Usage that survives a crash").

Files: ``<data dir>/usage-journal/<n>.seg``, ``n`` rising. Each segment is
append-only; a record is ``>II`` (payload length in bytes, CRC-32 of the
payload) then the payload, one usage row as JSON. A torn or corrupt last
record (a crash mid-write) fails its length or checksum and is skipped with
everything after it in that segment.

Two policies, by ``sync_interval_s`` (the setting ``auth.usage_sync_interval``):

- ``> 0`` (the default, 0.2 s): :meth:`UsageJournal.append` writes the row
  to the segment at once (one ``write`` into the kernel's page cache, a few
  microseconds, in the event loop) and returns ``None``: the end of the
  answer is not held back at all. :func:`serve_journal_committer` calls
  ``os.fdatasync`` in a worker thread at most every ``sync_interval_s``
  while there are unsynced writes. A kill of the process (SIGKILL, the OOM
  killer) loses nothing written, since the kernel has it; a power loss
  loses at most the rows of the last ``sync_interval_s``.
- ``0``: group commit. :meth:`UsageJournal.append` encodes a row into the
  group being gathered and returns that group's :class:`trio.Event`; the
  committer writes each group with one ``write`` and one ``os.fdatasync``
  in a worker thread, then sets the event: every answer waiting on it is
  released at once. Rows appended while a group is being synced form the
  next group. A row whose event was set is on the disk, so neither a kill
  nor a power loss (on a disk that honours flushes) loses it; rows whose
  event was not yet set were never acknowledged to their clients (the end
  of their answer was held back) and may be lost by either.

The usage writer (:mod:`llmgw.accounting.usage`) writes the rows of closed
segments into the store (idempotent by ``request_id``) and then deletes
them; :meth:`UsageJournal.rotate` closes the active segment. The rows this
process wrote are kept in memory as written (up to :data:`HELD_ROWS`,
:meth:`UsageJournal.held_rows`); only an earlier process's segments, or
segments past that many rows while the store is behind, are read back.
Segments left by a crashed process are closed segments to the next one.

Streams under way: :meth:`UsageJournal.begin` adds a "started" record (the
row the stream would get if cut now: status 503, the tokens seen so far),
written again at the head of each new segment until the stream's row is
appended. Replaying an earlier process's segments, a started stream with no
row gets its last "started" record as its row (cut by the crash, status
503, no cost). The committer adds a fresh "started" record of each stream
under way every :data:`PROGRESS_S`, so a cut row has the tokens seen at
most that long before the crash.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

import attrs
import orjson
import trio

from llmgw import metrics
from llmgw.store import UsageRow

__all__ = ["UsageJournal", "read_records", "read_segment", "serve_journal_committer"]

log = logging.getLogger("llmgw.accounting.journal")

_HEADER: Final = struct.Struct(">II")
#: A record longer than this is taken for garbage (a row is ~400 bytes).
_MAX_RECORD_BYTES: Final = 1 << 20
_SUFFIX: Final = ".seg"
#: How often the streams under way have their tokens so far written, in seconds.
PROGRESS_S: Final = 0.25
#: The default longest time between a row's write and its ``fdatasync``, in
#: seconds (``auth.usage_sync_interval``; 0 = group commit, module docstring).
SYNC_INTERVAL_S: Final = 0.2
#: Rows of this process's closed segments kept in memory for the usage writer,
#: at most (a row is ~1 KiB there): past this, a segment's rows are read back
#: from its file instead (:meth:`UsageJournal.held_rows`).
HELD_ROWS: Final = 20_000
#: The pending-bytes figure that first gets a warning; then each doubling.
WARN_BYTES: Final = 1 << 20
#: ... and only once the oldest of those bytes has waited this long, in
#: seconds: at a few hundred requests a second one flush interval's rows
#: alone pass :data:`WARN_BYTES` without the writer being behind.
BEHIND_WARN_S: Final = 10.0


#: A row's field names, in their declared order (the payload's key order).
_ROW_FIELDS: Final = tuple(field.name for field in attrs.fields(UsageRow))
#: All of a row's values at once, in ``_ROW_FIELDS``' order.
_row_values: Final = operator.attrgetter(*_ROW_FIELDS)
_pack_header: Final = _HEADER.pack


def row_doc(row: UsageRow) -> dict[str, object]:
    """``row`` as the JSON object its record holds: the same keys, order and
    values as ``attrs.asdict(row)`` (``guard_events``' tuples are written as
    JSON arrays either way), without its generic recursion."""
    return dict(zip(_ROW_FIELDS, _row_values(row), strict=True))


def encode_row(row: UsageRow) -> bytes:
    """One record: header and payload (module docstring)."""
    payload = orjson.dumps(row_doc(row))
    return _pack_header(len(payload), zlib.crc32(payload)) + payload


def encode_start(row: UsageRow) -> bytes:
    """A "started" record: the row a stream cut now would get."""
    payload = orjson.dumps({"started": row_doc(row)})
    return _pack_header(len(payload), zlib.crc32(payload)) + payload


#: How a "started" record's payload begins (orjson writes no spaces).
_STARTED_PREFIX: Final = b'{"started":'


def read_segment(path: Path) -> list[UsageRow]:
    """The rows of one segment, in order (:func:`read_records`' rows; its
    "started" records are checked but not decoded)."""
    return read_records(path, starts=False)[0]


def read_records(path: Path, *, starts: bool = True) -> tuple[list[UsageRow], list[UsageRow]]:
    """The rows and the "started" records of one segment, each in order; a
    torn or corrupt record ends it (logged, the rest of that file skipped).
    ``starts=False``: the "started" records are skipped undecoded (after
    their checksum) and the second list is empty.

    Raises:
        OSError: the file cannot be read.
    """
    data = path.read_bytes()
    rows: list[UsageRow] = []
    started: list[UsageRow] = []
    offset = 0
    end = len(data)
    while offset < end:
        if end - offset < _HEADER.size:
            log.warning("%s: torn record at byte %d skipped", path.name, offset)
            break
        length, crc = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        payload = data[start : start + length]
        if length > _MAX_RECORD_BYTES or len(payload) < length or zlib.crc32(payload) != crc:
            log.warning("%s: torn or corrupt record at byte %d skipped", path.name, offset)
            break
        offset_next = start + length
        if not starts and payload.startswith(_STARTED_PREFIX):
            offset = offset_next
            continue
        try:
            doc = orjson.loads(payload)
            if "started" in doc:
                started.append(UsageRow(**doc["started"]))
            else:
                rows.append(UsageRow(**doc))
        except (orjson.JSONDecodeError, TypeError) as exc:
            log.warning("%s: unreadable row at byte %d skipped (%s)", path.name, offset, exc)
        offset = offset_next
    return rows, started


class UsageJournal:
    """The journal's files and the group being gathered (module docstring).

    Args:
        directory: where the segments live; made when missing.
        sync_interval_s: the policy (module docstring): ``> 0`` writes each
            row at once and syncs at most this often; ``0`` holds each row's
            answer until its group is synced.

    Raises:
        OSError: the directory cannot be made or the first segment opened.
    """

    def __init__(
        self,
        directory: Path,
        *,
        sync_interval_s: float = SYNC_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if sync_interval_s < 0:
            raise ValueError(f"sync_interval_s must be 0 or more, not {sync_interval_s}")
        self.directory = directory
        self.sync_interval_s = sync_interval_s
        #: Written but not yet synced (the write-at-once policy).
        self._unsynced = False
        self._synced_at = -math.inf
        directory.mkdir(parents=True, exist_ok=True)
        self._number = 0  # none active yet: every segment found is closed
        existing = self.closed_segments()
        self._closed_bytes = sum(p.stat().st_size for p in existing)
        self._clock = clock
        #: Closed segments not yet deleted → when their first byte was
        #: written (an earlier process's: when this one started), clock seconds.
        self._since = dict.fromkeys((p.name for p in existing), clock())
        #: When the active segment's first byte was written (while it has any).
        self._active_since = 0.0
        self._number = max((int(p.stem) for p in existing), default=0) + 1
        self._file = self._open(self._number)
        #: The number of the segment ``_file`` is (``_number`` runs ahead of
        #: it while :meth:`rotate` opens the next one).
        self._file_number = self._number
        #: Segments numbered below this were left by an earlier process.
        self.first_live = self._number
        #: Streams under way: request id → the row a cut now would get.
        self._in_flight: dict[str, Callable[[], UsageRow]] = {}
        self._progress_at = 0.0
        self._active_bytes = 0
        self._group: list[bytes] = []
        self._group_rows: list[UsageRow] = []
        self._group_done = trio.Event()
        #: Segment number → the rows written to it, in order, while they are
        #: kept (:meth:`held_rows`); segments whose rows are not all kept.
        self._held: dict[int, list[UsageRow]] = {}
        self._held_count = 0
        self._unheld: set[int] = set()
        self._wake = trio.Event()
        #: Serialises the committer's writes with :meth:`rotate`.
        self._lock = trio.Lock()
        self._warn_at = WARN_BYTES
        self._update_gauge()

    def _open(self, number: int) -> int:
        fd = os.open(
            self.directory / f"{number:012d}{_SUFFIX}",
            os.O_WRONLY | os.O_CREAT | os.O_APPEND,
            0o600,
        )
        _sync_directory(self.directory)
        return fd

    def closed_segments(self) -> list[Path]:
        """The segments no longer appended to, oldest first."""
        return sorted(
            p
            for p in self.directory.glob(f"*{_SUFFIX}")
            if p.stem.isdigit() and int(p.stem) != self._number
        )

    @property
    def pending_bytes(self) -> int:
        """Bytes in segments not yet deleted (rows not known to be stored)."""
        return self._closed_bytes + self._active_bytes

    @property
    def active_bytes(self) -> int:
        return self._active_bytes

    def begin(self, request_id: str, snapshot: Callable[[], UsageRow]) -> None:
        """Note a stream under way: a "started" record of ``snapshot()`` in
        the next group (not waited for, no sync of its own), again in each new segment with the tokens seen by
        then, until its row is appended. On the next start, a stream of a
        crashed process with no row gets its last snapshot as its row."""
        self._in_flight[request_id] = snapshot
        # It rides with the next group or sync (another row's, or the
        # progress tick at most PROGRESS_S away): no sync of its own.
        self._add(encode_start(snapshot()))

    def append(self, row: UsageRow) -> trio.Event | None:
        """Journal ``row``. Group commit: the returned event is set once its
        group is on the disk (or could not be written). Write at once: the
        row is written now and ``None`` is returned. A row that could not be
        written is logged and counted in ``llmgw_usage_dropped_total``."""
        self._in_flight.pop(row.request_id, None)
        self._add(encode_row(row), row)
        if self.sync_interval_s > 0:
            return None
        self._wake.set()
        return self._group_done

    def _add(self, record: bytes, row: UsageRow | None = None) -> None:
        """Write ``record`` (or gather it into the group): ``row``'s, or a
        "started" record when ``row`` is ``None``."""
        if self.sync_interval_s == 0:
            self._group.append(record)
            if row is not None:
                self._group_rows.append(row)
            return
        try:
            _write_all(self._file, record)
        except OSError as exc:
            rows = 0 if row is None else 1
            if rows:
                metrics.USAGE_DROPPED.inc(rows)
            log.error("usage journal write failed: %d rows lost (%s)", rows, exc)
            return
        # The gauge follows at the next commit (a lock per write otherwise).
        if not self._active_bytes:
            self._active_since = self._clock()
        self._active_bytes += len(record)
        if row is not None:
            self._hold(self._file_number, (row,))
        if not self._unsynced:
            self._unsynced = True
            self._wake.set()

    def _hold(self, number: int, rows: Sequence[UsageRow]) -> None:
        """Keep ``rows``, just written to segment ``number``, for
        :meth:`held_rows`, unless that would pass :data:`HELD_ROWS` (then
        none of that segment's rows are kept)."""
        if number in self._unheld:
            return
        held = self._held.setdefault(number, [])
        if self._held_count + len(rows) > HELD_ROWS:
            self._unheld.add(number)
            self._held_count -= len(held)
            del self._held[number]
            return
        held.extend(rows)
        self._held_count += len(rows)

    def held_rows(self, segment: Path) -> list[UsageRow] | None:
        """The rows of ``segment``, a closed segment this process wrote, as
        they were appended (what :func:`read_segment` reads back from a
        whole file), without reading the file: decoding it would hold the
        interpreter's lock in a worker thread for milliseconds, and the
        event loop with it. ``None`` when they were not kept: a segment an
        earlier process left, or one past :data:`HELD_ROWS` rows held."""
        number = int(segment.stem)
        if number < self.first_live or number in self._unheld:
            return None
        return self._held.get(number, [])

    def crashed_segments(self) -> list[Path]:
        """The closed segments an earlier process left, oldest first."""
        return [p for p in self.closed_segments() if int(p.stem) < self.first_live]

    async def commit(self) -> None:
        """Group commit: write and sync the group gathered now (nothing when
        empty), then set its event. Write at once: sync what was written
        (nothing when all is synced).
        """
        if self.sync_interval_s > 0:
            self._update_gauge()
            await self._sync()
            return
        async with self._lock:
            group, done, rows = self._group, self._group_done, self._group_rows
            if not group:
                return
            self._group, self._group_done, self._group_rows = [], trio.Event(), []
            data = b"".join(group)
            fd = self._file
            try:
                await trio.to_thread.run_sync(_write_and_sync, fd, data)
            except OSError as exc:
                metrics.USAGE_DROPPED.inc(len(group))
                log.error("usage journal write failed: %d rows lost (%s)", len(group), exc)
            else:
                if not self._active_bytes:
                    self._active_since = self._clock()
                self._active_bytes += len(data)
                self._hold(self._file_number, rows)
                self._update_gauge()
            finally:
                done.set()

    async def _sync(self) -> None:
        async with self._lock:
            if not self._unsynced:
                return
            self._unsynced = False
            self._synced_at = trio.current_time()
            try:
                await trio.to_thread.run_sync(os.fdatasync, self._file)
            except OSError as exc:
                log.error("usage journal sync failed (%s)", exc)

    async def wait_for_work(self) -> None:
        """Until rows wait, or (with streams under way) their progress is
        due; with write at once, then until ``sync_interval_s`` after the
        last sync."""
        with trio.move_on_at(self._progress_at if self._in_flight else math.inf):
            await self._wake.wait()
        self._wake = trio.Event()
        if self.sync_interval_s > 0:
            await trio.sleep_until(self._synced_at + self.sync_interval_s)

    def note_progress(self) -> None:
        """Every :data:`PROGRESS_S`, a "started" record of each stream under
        way, with its tokens so far (into the group being gathered, or
        written at once)."""
        now = trio.current_time()
        if now < self._progress_at:
            return
        self._progress_at = now + PROGRESS_S
        for snapshot in self._in_flight.values():
            self._add(encode_start(snapshot()))

    async def rotate(self) -> None:
        """Close the active segment (when it holds anything) and start a new one.

        Raises:
            OSError: the new segment cannot be made.
        """
        async with self._lock:
            if self._active_bytes == 0:
                return
            old = self._file
            self._number += 1
            self._file = await trio.to_thread.run_sync(self._open, self._number)
            self._file_number = self._number
            if self._unsynced:
                # Its rows go to the store next; on the disk first.
                await trio.to_thread.run_sync(os.fdatasync, old)
            os.close(old)
            self._since[f"{self._number - 1:012d}{_SUFFIX}"] = self._active_since
            self._closed_bytes += self._active_bytes
            self._active_bytes = 0
            # The streams under way start again in the new segment (with
            # their tokens so far), on disk before the old one may go.
            starts = b"".join(encode_start(snapshot()) for snapshot in self._in_flight.values())
            if starts:
                await trio.to_thread.run_sync(_write_and_sync, self._file, starts)
                self._active_since = self._clock()
                self._active_bytes += len(starts)
                self._update_gauge()

    def delete(self, segment: Path) -> None:
        """Delete a closed segment whose rows are in the store."""
        size = segment.stat().st_size
        segment.unlink()
        number = int(segment.stem)
        self._held_count -= len(self._held.pop(number, ()))
        self._unheld.discard(number)
        self._since.pop(segment.name, None)
        self._closed_bytes -= size
        self._update_gauge()

    def close(self) -> None:
        """Close the active segment's file (it stays, for the next start)."""
        os.close(self._file)

    def oldest_s(self) -> float:
        """How long the oldest byte not yet deleted has waited, in seconds
        (0 when none waits)."""
        since = list(self._since.values())
        if self._active_bytes:
            since.append(self._active_since)
        return self._clock() - min(since) if since else 0.0

    def _update_gauge(self) -> None:
        """Set the gauge; warn at :data:`WARN_BYTES` pending and each
        doubling, once the oldest has waited :data:`BEHIND_WARN_S`."""
        pending = self.pending_bytes
        metrics.USAGE_JOURNAL_BYTES.set(pending)
        if pending >= self._warn_at:
            waited_s = self.oldest_s()
            if waited_s < BEHIND_WARN_S:
                return
            log.warning(
                "usage journal holds %d bytes not yet in the store, the oldest for %.0f s (%s)",
                pending,
                waited_s,
                self.directory,
            )
            self._warn_at *= 2
        elif pending < WARN_BYTES // 2:
            self._warn_at = WARN_BYTES


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_and_sync(fd: int, data: bytes) -> None:
    _write_all(fd, data)
    os.fdatasync(fd)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def serve_journal_committer(
    journal: UsageJournal, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> NoReturn:
    """Commit ``journal``'s groups until cancelled; on cancellation the last
    group is committed (shielded) and the file closed."""
    task_status.started()
    try:
        while True:
            await journal.wait_for_work()
            journal.note_progress()
            await journal.commit()
    finally:
        with trio.CancelScope(shield=True):
            await journal.commit()

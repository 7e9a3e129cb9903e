"""An engine's output: the log file it writes, followed into a ring buffer.

An engine's stdout and stderr go to a log file in the agent's state
directory (:func:`create_log`), never a pipe to the agent, which may die
first. :class:`EngineOutput` follows that file: every :meth:`~EngineOutput.read`
takes what was appended since the last (at most :data:`MAX_READ_BYTES`),
splits it into lines (a line longer than :data:`MAX_LINE_BYTES` is cut),
keeps the last lines in a ring buffer, feeds each line to the shard's
:class:`~llmgw.agent.compute.ComputeReport`, and notes the latest line worth
showing as start-up progress (:func:`~llmgw.agent.compute.progress_text`). A
file grown past :data:`MAX_LOG_FILE_BYTES` is emptied once read (the engine
appends, so it goes on at the new end).

Lines are decoded as UTF-8 (bad bytes replaced), without ``\\r``.
"""

from __future__ import annotations

import collections
import logging
import os
from pathlib import Path
from typing import Final

import trio

from llmgw.agent.compute import ComputeReport, progress_text

__all__ = [
    "ADOPT_HEAD_BYTES",
    "ADOPT_TAIL_BYTES",
    "MAX_LINE_BYTES",
    "MAX_LOG_FILE_BYTES",
    "MAX_READ_BYTES",
    "TAIL_INTERVAL_S",
    "EngineOutput",
    "create_log",
]

log = logging.getLogger(__name__)

#: The longest output line kept, in bytes; longer runs are split.
MAX_LINE_BYTES: Final = 64 * 1024
#: How often an engine's log file is read, in seconds.
TAIL_INTERVAL_S: Final = 0.2
#: An engine log file longer than this is emptied once read (the engine
#: appends, so it goes on at the new end), in bytes.
MAX_LOG_FILE_BYTES: Final = 64 * 1024 * 1024
#: The most of a log file read in one go, in bytes (the rest waits a tick).
MAX_READ_BYTES: Final = 4 * 1024 * 1024
#: How much of an adopted engine's log is read back into the ring buffer, in bytes.
ADOPT_TAIL_BYTES: Final = 256 * 1024
#: How much of an adopted engine's log is read for its compute report when
#: the shard file has none, in bytes.
ADOPT_HEAD_BYTES: Final = 1024 * 1024


def create_log(path: Path) -> int:
    """Create (or empty) the engine log at ``path``, mode 0600, and return a
    write-only, append-mode descriptor for the engine's stdout and stderr.
    The caller closes it once the engine has it.

    Raises:
        OSError: the file cannot be created or opened.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\r")


class EngineOutput:
    """The read side of one engine's log file.

    Args:
        name: who the output is of, for log lines (``"shard s1"``).
        max_lines: lines kept in :attr:`lines` (at least 1).
        report: fed every line read.

    Attributes:
        lines: the last ``max_lines`` lines, oldest first.
        report: the compute report the lines feed.
        last_output_at: when output last came, trio clock (the creation
            time until then).
        last_text: the latest progress text (:func:`progress_text`) seen.
        new_text: whether :attr:`last_text` changed since it was last taken
            (:meth:`take_text`).

    Nothing is read until :meth:`follow` or :meth:`follow_existing` opened
    the file; after :meth:`close` (or a read error) reads do nothing. Made
    and used inside ``trio.run`` (it reads the trio clock).
    """

    def __init__(self, *, name: str, max_lines: int, report: ComputeReport) -> None:
        self.name = name
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self.report = report
        self.last_output_at = trio.current_time()
        self.last_text = ""
        self.new_text = False
        self._path: Path | None = None
        self._fd = -1
        self._offset = 0
        self._pending = b""

    def follow(self, path: Path) -> None:
        """Follow the log at ``path`` from its start (a new engine's).

        Raises:
            OSError: the file cannot be opened for reading.
        """
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._path = path

    def follow_existing(self, path: Path, *, read_head: bool) -> None:
        """Follow an adopted engine's log at ``path``: its head (at most
        :data:`ADOPT_HEAD_BYTES`) feeds the compute report when ``read_head``,
        its tail (the last :data:`ADOPT_TAIL_BYTES`, from a line start) the
        ring buffer; what comes later is read as usual. A missing or
        unreadable file is logged, not raised. Leaves :attr:`new_text` false.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("%s: no engine log (%s)", self.name, exc)
            return
        self._fd, self._path = fd, path
        try:
            size = os.fstat(fd).st_size
            if read_head:
                for line in os.pread(fd, ADOPT_HEAD_BYTES, 0).split(b"\n"):
                    self.report.feed(_decode(line))
            self._offset = max(0, size - ADOPT_TAIL_BYTES)
            if self._offset:  # skip to the start of a line
                head = os.pread(fd, MAX_LINE_BYTES, self._offset)
                cut = head.find(b"\n")
                self._offset += cut + 1 if cut >= 0 else 0
        except OSError as exc:
            log.warning("%s: cannot read its engine log: %s", self.name, exc)
        self.read()
        self.new_text = False

    def read(self) -> None:
        """Read what the engine wrote since the last call into the ring
        buffer and the compute report (at most :data:`MAX_READ_BYTES`). A read
        error is logged and closes the file."""
        fd = self._fd
        if fd < 0:
            return
        try:
            if os.fstat(fd).st_size < self._offset:
                self._offset = 0  # emptied (by us, or by hand)
            budget = MAX_READ_BYTES
            while budget > 0:
                data = os.pread(fd, min(MAX_LINE_BYTES, budget), self._offset)
                if not data:
                    break
                self._offset += len(data)
                budget -= len(data)
                self._take(data)
            if self._offset >= MAX_LOG_FILE_BYTES and self._path is not None:
                os.truncate(self._path, 0)
                self._offset = 0
        except OSError as exc:
            log.warning("%s: cannot read its engine log: %s", self.name, exc)
            self.close()

    def _take(self, data: bytes) -> None:
        self.last_output_at = trio.current_time()
        *complete, self._pending = (self._pending + data).split(b"\n")
        if len(self._pending) >= MAX_LINE_BYTES:
            complete.append(self._pending)
            self._pending = b""
        for raw in complete:
            line = _decode(raw)
            self.lines.append(line)
            self.report.feed(line)
            text = progress_text(line)
            if text:
                self.last_text = text
                self.new_text = True

    def take_text(self) -> str | None:
        """The latest progress text if it is new since the last call, else ``None``."""
        if not self.new_text:
            return None
        self.new_text = False
        return self.last_text

    def last_lines(self, count: int) -> tuple[str, ...]:
        """The last ``count`` lines kept (fewer when fewer came), oldest
        first; ``()`` for ``count <= 0``."""
        if count <= 0:
            return ()
        return tuple(self.lines)[-count:]

    def close(self) -> None:
        """Stop following the file; an unfinished last line is kept as a line."""
        if self._fd >= 0:
            if self._pending:
                self.lines.append(_decode(self._pending))
                self._pending = b""
            os.close(self._fd)
            self._fd = -1

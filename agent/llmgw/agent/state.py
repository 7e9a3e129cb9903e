"""The agent's state directory: what it needs to adopt engines after a restart.

Engines outlive a standalone agent and are adopted by the next one
(``docs/catalog.md``). What the
next agent process needs to find them again lives here::

    <state_dir>/agent.lock          flock held while an agent uses the directory
    <state_dir>/shards/<id>.json    one file per running shard (ShardRecord)
    <state_dir>/logs/<id>.log       the engine's stdout and stderr

A shard file is written atomically (temporary file, fsync, rename) when the
shard's processes have started and again when its compute report is known;
it is removed when the shard stops or fails. It holds the ``StartShard``
fields **without** the engine key (the health paths of llama.cpp and the sim
engine are open, so an adopted engine is probed without it), the processes
(pid, process group, start time) and the compute report. The boot id tells a
file left from before a reboot, whose pids mean nothing any more.

Log files of stopped shards are removed; those of failed shards are kept for
a post-mortem and pruned after :data:`LOG_KEEP_S`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import attrs
import cattrs
from cattrs.preconf.json import make_converter

from llmgw import errors
from llmgw.agent.protocol import StartShard

__all__ = [
    "LOG_KEEP_S",
    "RECORD_VERSION",
    "ProcRecord",
    "ShardRecord",
    "StateDir",
    "StateDirBusy",
    "boot_id",
    "default_state_dir",
]

log = logging.getLogger(__name__)

#: The shape of a shard file; a file of another version is ignored (logged).
RECORD_VERSION: Final = 1
#: How long the log file of a shard that is no longer running is kept, in seconds.
LOG_KEEP_S: Final = 7 * 24 * 3600.0
_LOCK_FILE: Final = "agent.lock"
_SAFE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_BOOT_ID: Final = Path("/proc/sys/kernel/random/boot_id")


class StateDirBusy(errors.AgentError, RuntimeError):
    """Another agent process holds the state directory's lock."""


@attrs.frozen(kw_only=True)
class ProcRecord:
    """One process of a shard.

    Attributes:
        name: the adapter's command name (``llama-server``, ``sim``).
        pid: its process id.
        pgid: its process group (= its pid: each command starts a session).
        start_time: ``/proc/<pid>/stat`` field 22, clock ticks after boot;
            tells it apart from a later process given the same pid.
    """

    name: str
    pid: int
    pgid: int
    start_time: int


@attrs.frozen(kw_only=True)
class ShardRecord:
    """What is kept on disk about one running shard.

    Attributes:
        start: the ``StartShard`` that started it, with ``api_key`` emptied.
        procs: its processes, in start order (the first is the engine).
        health_path: the adapter's readiness path (``/health``).
        compute: the engine's compute report once READY ("CPU", "CUDA0 …"),
            or "" while not known.
        boot_id: the kernel's boot id when the processes started.
        started_at: wall-clock start time, seconds since the epoch.
        version: :data:`RECORD_VERSION`.
    """

    start: StartShard
    procs: tuple[ProcRecord, ...]
    health_path: str = "/health"
    compute: str = ""
    boot_id: str = ""
    started_at: float = 0.0
    version: int = RECORD_VERSION

    @property
    def shard_id(self) -> str:
        return self.start.shard_id


_converter = make_converter(forbid_extra_keys=False)


def boot_id() -> str:
    """The running kernel's boot id; "" where there is none (not Linux)."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def default_state_dir(node_id: str) -> Path:
    """``$XDG_STATE_HOME/llmgw/agent/<node_id>`` (``~/.local/state`` by default)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "llmgw" / "agent" / _file_stem(node_id or "node")


def _file_stem(shard_id: str) -> str:
    """A file name for ``shard_id``: itself when it is a plain name, else a
    digest (ids come from the control plane: never trust them as paths)."""
    if _SAFE_NAME.fullmatch(shard_id) and shard_id not in (".", ".."):
        return shard_id
    return "x-" + hashlib.sha256(shard_id.encode()).hexdigest()[:40]


class StateDir:
    """One agent's state directory (see the module docstring).

    Args:
        root: the directory; created (mode 0700) with its subdirectories by
            :meth:`lock`.

    Every method does blocking file I/O: async callers run the slow ones
    (:meth:`write`, :meth:`load_all`) in a thread.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.shards_dir = root / "shards"
        self.logs_dir = root / "logs"

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's lock for the ``with`` block.

        The lock is an ``flock``: the kernel drops it when the agent dies,
        even by SIGKILL. Engines never inherit it (the file is close-on-exec).

        Raises:
            StateDirBusy: another agent process holds it.
            OSError: the directory cannot be created.
        """
        for path in (self.root, self.shards_dir, self.logs_dir):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.root / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StateDirBusy(
                    f"another llmgw agent is using the state directory {self.root}"
                ) from None
            yield
        finally:
            os.close(fd)

    def busy(self) -> bool:
        """Whether an agent holds the directory's lock now (``False`` when
        there is no lock file); makes nothing.

        Raises:
            OSError: the lock file exists but cannot be opened.
        """
        try:
            fd = os.open(self.root / _LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # drops the lock too when it was taken
        return False

    def shard_path(self, shard_id: str) -> Path:
        return self.shards_dir / f"{_file_stem(shard_id)}.json"

    def log_path(self, shard_id: str) -> Path:
        """Where ``shard_id``'s engine output goes."""
        return self.logs_dir / f"{_file_stem(shard_id)}.log"

    def write(self, record: ShardRecord) -> None:
        """Write ``record`` atomically (mode 0600); ``api_key`` is never written.

        Raises:
            OSError: the file cannot be written.
        """
        doc = _converter.unstructure(
            attrs.evolve(record, start=attrs.evolve(record.start, api_key=""))
        )
        data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        path = self.shard_path(record.shard_id)
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _fsync_dir(self.shards_dir)

    def remove(self, shard_id: str, *, keep_log: bool = False) -> None:
        """Forget ``shard_id``: remove its file (and its log unless ``keep_log``).
        Missing files are fine; other errors are logged, not raised."""
        paths = [self.shard_path(shard_id)]
        if not keep_log:
            paths.append(self.log_path(shard_id))
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove %s: %s", path, exc)

    def load_all(self) -> list[ShardRecord]:
        """Every readable shard file. A file that cannot be read or parsed, or
        is of another :data:`RECORD_VERSION`, is logged and renamed to
        ``*.bad`` so it is not read again."""
        records: list[ShardRecord] = []
        try:
            paths = sorted(self.shards_dir.glob("*.json"))
        except OSError as exc:
            log.warning("cannot list %s: %s", self.shards_dir, exc)
            return records
        for path in paths:
            try:
                record = _parse(path.read_bytes())
            except (OSError, ValueError, cattrs.BaseValidationError, TypeError, KeyError) as exc:
                log.warning("shard file %s is unreadable (%s); set aside as .bad", path, exc)
                with contextlib.suppress(OSError):
                    path.rename(path.with_suffix(".bad"))
                continue
            records.append(record)
        return records

    def prune_logs(self, keep: set[str], *, older_than_s: float = LOG_KEEP_S) -> None:
        """Remove log files not named in ``keep`` (shard ids) and not written to
        for ``older_than_s`` seconds."""
        kept = {self.log_path(shard_id).name for shard_id in keep}
        cutoff = time.time() - older_than_s
        try:
            paths = list(self.logs_dir.glob("*.log"))
        except OSError:
            return
        for path in paths:
            if path.name in kept:
                continue
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()


def _parse(data: bytes) -> ShardRecord:
    doc: Any = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if doc.get("version") != RECORD_VERSION:
        raise ValueError(f"version {doc.get('version')!r}, expected {RECORD_VERSION}")
    record: ShardRecord = _converter.structure(doc, ShardRecord)
    return record


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""Engine supervision: start, watch, adopt and stop the engine processes of one agent.

One :class:`Supervisor` owns every shard an agent runs (``shared/spec/agent.md``,
Engine supervision; ``reconciler-and-lifecycle.md``, Adoption and Compute check):

- each command of a shard runs in its own process group (a new session), with
  the engine key in its environment only; stdout and stderr go to a log file
  in the state directory (never a pipe to the agent, which may die first),
  tailed into a ring buffer of the last lines;
- a shard with ``model_sha256`` has its weights file checked first (a
  digest cache keyed by the file's identity avoids hashing it again);
- the shard is STARTING until ``GET <health path>`` with the key answers 200
  with a body that :func:`~llmgw.engines.base.body_says_ready`; then READY,
  with the compute report read from the engine's start-up output
  (:mod:`llmgw.agent.compute`); while STARTING, output (or the weights
  check) is reported as ``ShardStatus.progress`` at most every
  ``progress_interval_s`` so the control plane resets its start deadline;
  for the first :data:`COMPUTE_WATCH_S` after READY a changed compute
  report is sent again;
- a process that exits without having been asked to stop, or an engine that
  makes no progress (no output) and is not ready within the startup timeout,
  turns the shard FAILED with a one-line reason and its last output lines;
- a stop finds strays (descendants that left the group), SIGTERMs the group and
  the strays, waits up to 5 s polling every 100 ms, then SIGKILLs them, and
  reaps its children;
- every running shard has a file in the state directory
  (:mod:`llmgw.agent.state`). When :meth:`Supervisor.serve` starts, the
  shards found there whose processes still run are **adopted**: probed once
  (READY if healthy, else STARTING and probed on), watched (exit noticed
  through a pidfd, since a process that is not our child cannot be waited
  for), stopped by process group, their logs served from the file.

Every state change is sent as a :class:`~llmgw.agent.protocol.ShardStatus` on
the ``events`` channel given to the constructor. The channel is bounded: a slow
reader slows the supervisor's reports down, never the engines.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final, NoReturn

import attrs
import httpx
import trio

from llmgw.agent import protocol
from llmgw.agent.compute import ComputeReport, progress_text
from llmgw.agent.protocol import ShardState, ShardStatus
from llmgw.agent.state import ProcRecord, ShardRecord, StateDir, boot_id
from llmgw.engines.base import (
    MAX_HEALTH_BODY_BYTES,
    EngineAdapter,
    ShardLaunch,
    body_says_ready,
)

__all__ = [
    "COMPUTE_WATCH_S",
    "FAILED_LAST_LINES",
    "PROBE_TIMEOUT_S",
    "PROGRESS_INTERVAL_S",
    "STOP_ALL_DEADLINE_S",
    "STOP_GRACE_S",
    "Supervisor",
]

log = logging.getLogger(__name__)

#: How long one readiness probe may take, in seconds.
PROBE_TIMEOUT_S: Final = 2.0
#: How long a stopped engine gets between SIGTERM and SIGKILL, in seconds.
STOP_GRACE_S: Final = 5.0
#: How often a stopping engine is checked for exit, in seconds.
STOP_POLL_S: Final = 0.1
#: The most time :meth:`Supervisor.stop_all` takes, in seconds.
STOP_ALL_DEADLINE_S: Final = 8.0
#: How many output lines a FAILED status carries.
FAILED_LAST_LINES: Final = 50
#: How deep the search for strays goes below a shard's processes.
STRAY_MAX_DEPTH: Final = 32
#: The longest output line kept, in bytes; longer runs are split.
MAX_LINE_BYTES: Final = 64 * 1024
#: How long a stop waits for the shard's watcher to finish, in seconds.
OUTPUT_DRAIN_S: Final = 1.0
#: How long reaping after SIGKILL may take, in seconds.
REAP_DEADLINE_S: Final = 2.0
#: The least time between two progress reports of a STARTING shard, in seconds.
PROGRESS_INTERVAL_S: Final = 5.0
#: How long after start a changed compute report is sent again (agent.md:
#: re-read every 5 s for the first 5 minutes), in seconds.
COMPUTE_WATCH_S: Final = 300.0
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
#: How often a process that is not our child is checked for exit when the
#: kernel has no pidfds, in seconds.
PID_POLL_S: Final = 0.5
#: Bytes hashed between two progress updates of a weights check.
HASH_BLOCK_BYTES: Final = 4 * 1024 * 1024

_ACTIVE: Final = frozenset({ShardState.STARTING, ShardState.READY})

#: Engines a supervisor left running for the next agent to adopt. Their
#: process objects are kept for the life of this process, so that dropping
#: one does not warn that the engine "is still running" (it is meant to).
_LEFT_RUNNING: Final[list[trio.Process]] = []


@attrs.define(eq=False)
class _Proc:
    """One running command of a shard.

    ``process`` is None for an adopted process: it is not our child, so it
    is watched through a pidfd and never waited for.
    """

    name: str
    pid: int
    pgid: int
    start_time: int
    process: trio.Process | None = None


@attrs.define(eq=False)
class _Shard:
    """One incarnation of a shard: a start (or an adoption) and everything
    until it ended."""

    start: protocol.StartShard  # api_key emptied
    health_url: str
    api_key: str
    lines: collections.deque[str]
    report: ComputeReport
    #: When output last came (or the start), trio clock.
    last_progress: float
    #: When the shard started, trio clock and wall clock.
    started_at: float
    wall_started: float
    health_path: str = "/health"
    boot_id: str = ""
    adopted: bool = False
    state: ShardState = ShardState.STARTING
    compute: str = ""
    procs: list[_Proc] = attrs.field(factory=list)
    # The engine's output: read side of the log file.
    log_path: Path | None = None
    log_fd: int = -1
    log_offset: int = 0
    pending: bytes = b""
    # Progress and compute reports.
    progress_at: float = 0.0
    compute_at: float = 0.0
    new_output: bool = False
    last_text: str = ""
    #: Cancels a weights check in progress (set while one runs).
    checking: trio.CancelScope | None = None
    #: Process exits are expected from now on (a stop or a failure is under way).
    ending: bool = False
    terminating: bool = False
    terminated: trio.Event = attrs.field(factory=trio.Event)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: Set when the watcher task has finished (or never ran).
    done: trio.Event = attrs.field(factory=trio.Event)

    @property
    def shard_id(self) -> str:
        return self.start.shard_id

    @property
    def replica_id(self) -> str:
        return self.start.replica_id

    @property
    def port(self) -> int:
        return self.start.port


@attrs.frozen
class _Pid:
    """A process, told apart from a later one with the same id by its start time."""

    pid: int
    start_time: int


@attrs.frozen
class _Stat:
    ppid: int
    pgrp: int
    state: str
    start_time: int


@attrs.frozen
class _FileId:
    """A weights file's identity: a change to any part means hash it again."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int


@attrs.define
class _HashProgress:
    """Shared between a hashing thread and the task reporting its progress."""

    total: int
    done: int = 0
    cancelled: bool = False


class Supervisor:
    """Owns the engine processes of one agent.

    Args:
        adapter_for: the :class:`~llmgw.engines.base.EngineAdapter` for an
            engine name (``EngineProfile.engine``); may raise ``LookupError``
            or ``ValueError`` for an unknown engine, which fails the shard.
        events: where every :class:`~llmgw.agent.protocol.ShardStatus` goes.
            A closed or broken channel drops reports (logged).
        state_dir: the agent's state directory (:mod:`llmgw.agent.state`):
            shard files for adoption and engine logs. One agent at a time.
        probe_interval_s: seconds between readiness probes.
        max_log_lines: output lines kept per shard (at least 1).
        startup_timeout_s: seconds an engine may go without output and without
            becoming ready before it is failed and stopped.
        owns_engines: stop every engine when :meth:`serve` ends (``llmgw up``);
            when false engines outlive the supervisor, for adoption.
        stop_grace_s: seconds between SIGTERM and SIGKILL (the spec says 5).
        progress_interval_s: least seconds between two progress reports of
            a STARTING shard, and between two compute reports of a READY one.

    Raises:
        ValueError: ``max_log_lines`` is less than 1.

    Resource handling: nothing runs until :meth:`serve` is running; the shard
    watchers live in its nursery.
    """

    def __init__(
        self,
        *,
        adapter_for: Callable[[str], EngineAdapter],
        events: trio.MemorySendChannel[ShardStatus],
        state_dir: Path,
        probe_interval_s: float = 0.5,
        max_log_lines: int = 500,
        startup_timeout_s: float = 600.0,
        owns_engines: bool = False,
        stop_grace_s: float = STOP_GRACE_S,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
    ) -> None:
        if max_log_lines < 1:
            raise ValueError("max_log_lines must be at least 1")
        self._adapter_for = adapter_for
        self._events = events
        self._state = StateDir(state_dir)
        self._probe_interval_s = probe_interval_s
        self._max_log_lines = max_log_lines
        self._startup_timeout_s = startup_timeout_s
        self._owns_engines = owns_engines
        self._stop_grace_s = stop_grace_s
        self._progress_interval_s = progress_interval_s
        self._shards: dict[str, _Shard] = {}
        self._locks: collections.defaultdict[str, trio.Lock] = collections.defaultdict(trio.Lock)
        self._nursery: trio.Nursery | None = None
        #: Digests of weights files already hashed, by file identity.
        self._digests: dict[_FileId, str] = {}

    @property
    def state_dir(self) -> Path:
        return self._state.root

    # --- the daemon -------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Adopt the engines left running, then run the shard watchers until
        cancelled.

        Holds the state directory's lock while it runs. Calls
        ``task_status.started()`` once the shards found in the state
        directory are adopted (each probed once, at most
        :data:`PROBE_TIMEOUT_S`) and new ones can be started. Never returns
        unless cancelled. When cancelled with ``owns_engines`` set, every
        engine is stopped first (shielded, at most
        :data:`STOP_ALL_DEADLINE_S` seconds); otherwise engines keep running.

        Raises:
            RuntimeError: ``serve`` is already running.
            StateDirBusy: another agent holds the state directory.
            OSError: the state directory cannot be created.
        """
        if self._nursery is not None:
            raise RuntimeError("Supervisor.serve() is already running")
        with self._state.lock():
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await self._adopt_all(nursery)
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                self._nursery = None
                if self._owns_engines:
                    with trio.CancelScope(shield=True), trio.move_on_after(STOP_ALL_DEADLINE_S):
                        await self._stop_shards(list(self._shards.values()), wait_to_report=False)
                else:
                    _LEFT_RUNNING.extend(
                        proc.process
                        for shard in self._shards.values()
                        for proc in shard.procs
                        if proc.process is not None and proc.process.returncode is None
                    )
        raise AssertionError("unreachable")

    # --- commands ---------------------------------------------------------------

    async def start_shard(self, cmd: protocol.StartShard) -> None:
        """Start the shard ``cmd`` describes, unless it is already running.

        A shard STARTING or READY (adopted ones too) is left alone; a FAILED,
        STOPPED or unknown one is started: its weights are checked when
        ``profile.model_sha256`` is set (STARTING with progress while that
        runs), then STARTING is reported once its processes run, READY or
        FAILED later. A launch that cannot even start (unknown engine, bad
        profile, missing binary or weights, digest mismatch) is reported
        FAILED at once.

        Raises:
            RuntimeError: :meth:`serve` is not running.
        """
        nursery = self._nursery
        if nursery is None:
            raise RuntimeError("Supervisor.serve() is not running")
        async with self._locks[cmd.shard_id]:
            existing = self._shards.get(cmd.shard_id)
            if existing is not None:
                if existing.state in _ACTIVE and not existing.ending:
                    if not existing.api_key:
                        existing.api_key = cmd.api_key  # adopted: the key is not kept on disk
                    return
                # A failure or stop is still being handled: let it finish and
                # report before the next incarnation starts.
                await existing.done.wait()
            shard = self._new_shard(cmd)
            self._shards[cmd.shard_id] = shard
            profile = cmd.profile
            if profile.model_sha256 and profile.model_path:
                try:
                    reason = await self._check_weights(shard, cmd)
                except BaseException:
                    # Cancelled (the link went away): forget this start, so
                    # that the next StartShard starts afresh.
                    if self._shards.get(cmd.shard_id) is shard:
                        del self._shards[cmd.shard_id]
                    shard.state = ShardState.STOPPED
                    shard.done.set()
                    raise
                if shard.ending:  # stopped while checking; the stop reports it
                    shard.done.set()
                    return
                if reason:
                    await self._fail_to_start(shard, reason, cmd.correlation_id)
                    return
            with trio.CancelScope(shield=True):  # never lose a started process
                reason = await self._spawn(shard, cmd)
                if not reason:
                    await self._save(shard)
            if reason:
                await self._fail_to_start(shard, reason, cmd.correlation_id)
                return
            # Watch first, so a cancelled report cannot leave an unwatched
            # engine. STARTING still goes out first: the watcher has not run
            # yet, and senders blocked on a full channel are served in order.
            nursery.start_soon(self._watch, shard, name=f"shard {cmd.shard_id}")
            await self._emit(self._status(shard, correlation_id=cmd.correlation_id))

    async def stop_shard(self, shard_id: str, *, correlation_id: str = "") -> None:
        """Stop a shard's processes and report STOPPED; an unknown id is a no-op.

        A weights check in progress is abandoned. Strays are found first,
        then the process groups (an adopted shard's too) and strays get
        SIGTERM, :data:`STOP_GRACE_S` seconds of grace polled every 100 ms,
        then SIGKILL; children are reaped. The shard's file and log are
        removed. Shielded from cancellation and bounded by
        :data:`STOP_ALL_DEADLINE_S` seconds. A shard already FAILED or
        STOPPED is reported STOPPED again.
        """
        shard = self._shards.get(shard_id)
        if shard is None:
            return
        if shard.checking is not None:
            shard.ending = True
            shard.checking.cancel()
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_ALL_DEADLINE_S):
            await self._stop_locked(shard_id, correlation_id, wait_to_report=True)

    async def stop_all(self) -> None:
        """Stop every shard, even when the caller is being cancelled.

        Shielded, and bounded by :data:`STOP_ALL_DEADLINE_S` seconds; shards
        stop concurrently. Used when ``llmgw up`` shuts down.
        """
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_ALL_DEADLINE_S):
            await self._stop_shards(list(self._shards.values()), wait_to_report=True)

    # --- queries ----------------------------------------------------------------

    def logs(self, shard_id: str, lines: int) -> list[str]:
        """The last ``lines`` output lines of a shard's current (or last) run,
        oldest first; ``[]`` for an unknown shard or ``lines <= 0``."""
        shard = self._shards.get(shard_id)
        if shard is None or lines <= 0:
            return []
        self._read_output(shard)
        kept = list(shard.lines)
        return kept[-lines:]

    def running(self) -> list[protocol.RunningShard]:
        """The shards STARTING or READY (adopted ones too), as ``Register``
        reports them."""
        return [
            protocol.RunningShard(
                shard_id=shard.shard_id,
                replica_id=shard.replica_id,
                model=shard.start.profile.name,
                state=shard.state,
                port=shard.port,
                pid=shard.procs[0].pid if shard.procs else 0,
                fingerprint=shard.start.fingerprint,
                gpu_indices=shard.start.gpu_indices,
                compute=shard.compute,
            )
            for shard in self._shards.values()
            if shard.state in _ACTIVE and not shard.ending
        ]

    def state(self, shard_id: str) -> ShardState | None:
        """A shard's state, or ``None`` for a shard this supervisor never ran."""
        shard = self._shards.get(shard_id)
        return None if shard is None else shard.state

    # --- starting ---------------------------------------------------------------

    def _new_shard(self, cmd: protocol.StartShard, *, health_path: str = "") -> _Shard:
        host = cmd.bind_addr or "127.0.0.1"
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        now = trio.current_time()
        return _Shard(
            start=attrs.evolve(cmd, api_key=""),
            health_url=f"http://{host}:{cmd.port}",
            health_path=health_path,
            api_key=cmd.api_key,
            lines=collections.deque(maxlen=self._max_log_lines),
            report=ComputeReport(cmd.profile.engine, cmd.gpu_indices),
            last_progress=now,
            started_at=now,
            wall_started=time.time(),
            progress_at=now,
            boot_id=boot_id(),
        )

    async def _fail_to_start(self, shard: _Shard, reason: str, correlation_id: str) -> None:
        shard.ending = True
        await self._terminate(shard)
        self._close_log(shard)
        self._state.remove(shard.shard_id, keep_log=True)
        shard.state = ShardState.FAILED
        shard.done.set()
        log.warning("shard %s: %s", shard.shard_id, reason)
        last = tuple(shard.lines)[-FAILED_LAST_LINES:]
        await self._emit(
            self._status(shard, reason=reason, last_lines=last, correlation_id=correlation_id)
        )

    async def _spawn(self, shard: _Shard, cmd: protocol.StartShard) -> str:
        """Start ``shard``'s processes; the reason it could not, or ``""``."""
        profile = cmd.profile
        launch = ShardLaunch(
            replica_id=cmd.replica_id,
            http_port=cmd.port,
            bind_addr=cmd.bind_addr,
            model_path=profile.model_path,
            served_model_name=profile.served_model_name,
            api_key=cmd.api_key,
            gpu_indices=cmd.gpu_indices,
            context_tokens=profile.context_tokens,
            slots=profile.slots,
            cpu_cores=profile.cpu_cores,
            args=profile.args,
            env=profile.env,
        )
        try:
            adapter = self._adapter_for(profile.engine)
            commands = adapter.commands(launch)
            health_path = adapter.health_path()
        except (LookupError, ValueError) as exc:
            return f"cannot launch engine {profile.engine!r}: {exc}"
        if not commands:
            return f"engine {profile.engine!r} gave no command to run"
        if not _port_free(launch.bind_addr, launch.http_port):
            # Never start (nor probe) an engine on a port something else
            # holds: the probe would reach that process, and so would the
            # router, with the engine key.
            return f"port {launch.http_port} is in use by another process"
        shard.health_path = health_path if health_path.startswith("/") else f"/{health_path}"
        shard.health_url += shard.health_path
        log_path = self._state.log_path(shard.shard_id)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        try:
            out = os.open(log_path, flags, 0o600)
        except OSError as exc:
            return f"cannot open the engine log {log_path}: {exc}"
        try:
            shard.log_fd = os.open(log_path, os.O_RDONLY | os.O_CLOEXEC)
            shard.log_path = log_path
            for command in commands:
                try:
                    process = await trio.lowlevel.open_process(
                        command.argv,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=out,
                        start_new_session=True,
                        env={**_inherited_env(), **command.env},
                    )
                except OSError as exc:
                    return f"cannot start {command.path}: {exc}"
                stat = _read_stat(process.pid)
                log.info(
                    "shard %s: started %s as pid %d", shard.shard_id, command.name, process.pid
                )
                shard.procs.append(
                    _Proc(
                        name=command.name,
                        pid=process.pid,
                        pgid=process.pid,
                        start_time=stat.start_time if stat is not None else 0,
                        process=process,
                    )
                )
        except OSError as exc:
            return f"cannot read the engine log {log_path}: {exc}"
        finally:
            os.close(out)
        return ""

    async def _check_weights(self, shard: _Shard, cmd: protocol.StartShard) -> str:
        """Check the shard's weights file against ``model_sha256``; the reason
        it does not match (or cannot be read), or ``""``. Reports STARTING
        with progress while hashing. Returns ``""`` when a stop cancelled it
        (``shard.ending`` is then set)."""
        path = Path(cmd.profile.model_path)
        expected = cmd.profile.model_sha256.strip().lower()
        progress = _HashProgress(total=0)
        outcome: list[str] = []  # the digest, or "!" + why it could not be had
        try:
            with trio.CancelScope() as scope:
                shard.checking = scope  # from here on a stop cancels the check
                outcome.append(await self._digest(shard, cmd, path, progress))
        finally:
            shard.checking = None
            progress.cancelled = True
        if not outcome:
            return ""  # cancelled by a stop
        actual = outcome[0]
        if actual.startswith("!"):
            return actual[1:]
        if actual != expected:
            return f"weights file {path}: sha256 {actual} does not match the expected {expected}"
        return ""

    async def _digest(
        self, shard: _Shard, cmd: protocol.StartShard, path: Path, progress: _HashProgress
    ) -> str:
        """``path``'s sha256 (from the cache when the file is unchanged), or
        ``"!"`` and the reason it cannot be read."""
        try:
            st = await trio.to_thread.run_sync(os.stat, path)
        except OSError as exc:
            return f"!weights file {path}: {exc.strerror or exc}"
        file_id = _FileId(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        cached = self._digests.get(file_id)
        if cached is not None:
            return cached
        progress.total = st.st_size
        await self._emit(
            self._status(
                shard, progress=f"checking weights {path.name}", correlation_id=cmd.correlation_id
            )
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_hashing, shard, progress, path.name)
            try:
                digest = await trio.to_thread.run_sync(
                    _sha256_with_progress, path, progress, abandon_on_cancel=True
                )
            except OSError as exc:
                return f"!cannot read the weights file {path}: {exc.strerror or exc}"
            finally:
                nursery.cancel_scope.cancel()
        self._digests[file_id] = digest
        return digest

    async def _report_hashing(self, shard: _Shard, progress: _HashProgress, name: str) -> None:
        while True:
            await trio.sleep(self._progress_interval_s)
            await self._emit(
                self._status(
                    shard,
                    progress=f"checking weights {name}: {progress.done / 1e9:.1f} of "
                    f"{progress.total / 1e9:.1f} GB",
                )
            )

    async def _save(self, shard: _Shard) -> None:
        """Write the shard's file; a failure is logged (the engine runs on,
        but a later agent cannot adopt it)."""
        record = ShardRecord(
            start=shard.start,
            procs=tuple(
                ProcRecord(name=p.name, pid=p.pid, pgid=p.pgid, start_time=p.start_time)
                for p in shard.procs
            ),
            health_path=shard.health_path,
            compute=shard.compute,
            boot_id=shard.boot_id,
            started_at=shard.wall_started,
        )
        try:
            await trio.to_thread.run_sync(self._state.write, record)
        except OSError as exc:
            log.warning(
                "shard %s: cannot write its state file (%s); a later agent cannot adopt it",
                shard.shard_id,
                exc,
            )

    # --- adopting ---------------------------------------------------------------

    async def _adopt_all(self, nursery: trio.Nursery) -> None:
        """Adopt the shards whose files are in the state directory and whose
        processes still run; forget (and clean up after) the others."""
        records = await trio.to_thread.run_sync(self._state.load_all)
        this_boot = boot_id()
        adopted: list[_Shard] = []
        for record in records:
            if record.shard_id in self._shards:
                continue
            shard = self._new_shard(record.start, health_path=record.health_path)
            shard.health_url += record.health_path
            shard.adopted = True
            shard.compute = record.compute
            shard.started_at -= max(0.0, time.time() - record.started_at)
            shard.boot_id = record.boot_id
            shard.wall_started = record.started_at
            shard.procs = [
                _Proc(name=p.name, pid=p.pid, pgid=p.pgid, start_time=p.start_time)
                for p in record.procs
            ]
            self._shards[record.shard_id] = shard
            self._open_adopted_log(shard)
            same_boot = not record.boot_id or record.boot_id == this_boot
            live = [p for p in shard.procs if same_boot and _same_process(p)]
            if shard.procs and len(live) == len(shard.procs):
                adopted.append(shard)
                continue
            # Some process is gone: the shard is dead. Whatever is left of it
            # is stopped (it may hold the port); it is not reported, so the
            # control plane counts it as stopped.
            log.warning(
                "shard %s: its engine exited while no agent watched it; not adopted",
                shard.shard_id,
            )
            shard.procs = live
            shard.ending = True
            shard.state = ShardState.FAILED
            self._close_log(shard)
            self._state.remove(shard.shard_id, keep_log=True)
            shard.done.set()
            if live:
                nursery.start_soon(self._terminate, shard)
        async with trio.open_nursery() as probes:
            for shard in adopted:
                probes.start_soon(self._adopt_probe, shard)
        for shard in adopted:
            log.info(
                "shard %s: adopted %s pid %d on port %d (%s)",
                shard.shard_id,
                shard.procs[0].name,
                shard.procs[0].pid,
                shard.port,
                shard.state,
            )
            nursery.start_soon(self._watch, shard, name=f"shard {shard.shard_id}")
        await trio.to_thread.run_sync(self._state.prune_logs, set(self._shards))

    async def _adopt_probe(self, shard: _Shard) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=PROBE_TIMEOUT_S) as client:
            if await self._probe(client, shard.health_url, {}):
                self._become_ready(shard)

    def _open_adopted_log(self, shard: _Shard) -> None:
        """Open an adopted shard's log: its head feeds the compute report when
        the file had none, its tail the ring buffer; then it is followed."""
        path = self._state.log_path(shard.shard_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("shard %s: no engine log (%s)", shard.shard_id, exc)
            return
        shard.log_fd, shard.log_path = fd, path
        try:
            size = os.fstat(fd).st_size
            if not shard.compute:
                for line in os.pread(fd, ADOPT_HEAD_BYTES, 0).split(b"\n"):
                    shard.report.feed(_decode(line))
            shard.log_offset = max(0, size - ADOPT_TAIL_BYTES)
            if shard.log_offset:  # skip to the start of a line
                head = os.pread(fd, MAX_LINE_BYTES, shard.log_offset)
                cut = head.find(b"\n")
                shard.log_offset += cut + 1 if cut >= 0 else 0
        except OSError as exc:
            log.warning("shard %s: cannot read its engine log: %s", shard.shard_id, exc)
        self._read_output(shard)
        shard.new_output = False

    # --- watching ---------------------------------------------------------------

    async def _watch(self, shard: _Shard) -> None:
        try:
            with shard.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._tail, shard)
                    for proc in shard.procs:
                        nursery.start_soon(self._wait_exit, shard, proc)
                    if shard.state is ShardState.STARTING:
                        nursery.start_soon(self._probe_until_ready, shard)
        finally:
            self._read_output(shard)
            self._close_log(shard)
            shard.done.set()

    async def _tail(self, shard: _Shard) -> None:
        while True:
            self._read_output(shard)
            await self._report_output(shard)
            await trio.sleep(TAIL_INTERVAL_S)

    def _read_output(self, shard: _Shard) -> None:
        """Read what the engine wrote since the last call into the ring
        buffer and the compute report (at most :data:`MAX_READ_BYTES`)."""
        fd = shard.log_fd
        if fd < 0:
            return
        try:
            if os.fstat(fd).st_size < shard.log_offset:
                shard.log_offset = 0  # emptied (by us, or by hand)
            budget = MAX_READ_BYTES
            while budget > 0:
                data = os.pread(fd, min(MAX_LINE_BYTES, budget), shard.log_offset)
                if not data:
                    break
                shard.log_offset += len(data)
                budget -= len(data)
                self._take_output(shard, data)
            if shard.log_offset >= MAX_LOG_FILE_BYTES and shard.log_path is not None:
                os.truncate(shard.log_path, 0)
                shard.log_offset = 0
        except OSError as exc:
            log.warning("shard %s: cannot read its engine log: %s", shard.shard_id, exc)
            self._close_log(shard)

    def _take_output(self, shard: _Shard, data: bytes) -> None:
        shard.last_progress = trio.current_time()
        *complete, shard.pending = (shard.pending + data).split(b"\n")
        if len(shard.pending) >= MAX_LINE_BYTES:
            complete.append(shard.pending)
            shard.pending = b""
        for raw in complete:
            line = _decode(raw)
            shard.lines.append(line)
            shard.report.feed(line)
            text = progress_text(line)
            if text:
                shard.last_text = text
                shard.new_output = True

    def _close_log(self, shard: _Shard) -> None:
        if shard.log_fd >= 0:
            if shard.pending:
                shard.lines.append(_decode(shard.pending))
                shard.pending = b""
            os.close(shard.log_fd)
            shard.log_fd = -1

    async def _report_output(self, shard: _Shard) -> None:
        """Progress while STARTING; a changed compute report soon after READY."""
        if shard.ending:
            return
        now = trio.current_time()
        if now - shard.progress_at < self._progress_interval_s:
            return
        if shard.state is ShardState.STARTING and shard.new_output:
            shard.progress_at = now
            shard.new_output = False
            await self._emit(self._status(shard, progress=shard.last_text))
        elif shard.state is ShardState.READY and now - shard.started_at < COMPUTE_WATCH_S:
            text = shard.report.text
            if text and text != shard.compute:
                shard.progress_at = now
                shard.compute = text
                log.info("shard %s: compute now %s", shard.shard_id, text)
                await self._save(shard)
                await self._emit(self._status(shard))

    async def _wait_exit(self, shard: _Shard, proc: _Proc) -> None:
        if proc.process is not None:
            code = await proc.process.wait()
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = "unknown"
                how = f"killed by signal {-code} ({name})"
            else:
                how = f"exited with code {code}"
        else:
            await _wait_not_child(proc)
            how = "exited (adopted from an earlier agent: exit code unknown)"
        if shard.ending:
            return
        what = "engine" if len(shard.procs) == 1 else f"engine process {proc.name!r}"
        self._read_output(shard)  # its last words
        await self._fail(shard, f"{what} {how}")

    async def _probe_until_ready(self, shard: _Shard) -> None:
        headers = {"Authorization": f"Bearer {shard.api_key}"} if shard.api_key else {}
        async with httpx.AsyncClient(trust_env=False, timeout=PROBE_TIMEOUT_S) as client:
            while not shard.ending:
                if await self._probe(client, shard.health_url, headers):
                    if shard.ending:
                        return
                    self._read_output(shard)  # the start-up log so far
                    self._become_ready(shard)
                    log.info("shard %s: ready on %s", shard.shard_id, shard.compute or "?")
                    await self._save(shard)
                    await self._emit(self._status(shard))
                    return
                quiet_s = trio.current_time() - shard.last_progress
                if quiet_s > self._startup_timeout_s:
                    await self._fail(
                        shard,
                        f"engine not ready after {quiet_s:.1f} s without output "
                        f"(startup timeout {self._startup_timeout_s:g} s)",
                    )
                    return
                await trio.sleep(self._probe_interval_s)
                if shard.api_key and "Authorization" not in headers:
                    headers = {"Authorization": f"Bearer {shard.api_key}"}

    def _become_ready(self, shard: _Shard) -> None:
        shard.state = ShardState.READY
        shard.compute = shard.compute or shard.report.text
        shard.progress_at = trio.current_time()

    @staticmethod
    async def _probe(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> bool:
        with trio.move_on_after(PROBE_TIMEOUT_S):
            try:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        return False
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) >= MAX_HEALTH_BODY_BYTES:
                            break
                    return body_says_ready(bytes(body[:MAX_HEALTH_BODY_BYTES]))
            except httpx.HTTPError:
                return False
        return False

    async def _fail(self, shard: _Shard, reason: str) -> None:
        """Stop what is left of ``shard``, report it FAILED, end its watcher."""
        if shard.ending:
            return
        shard.ending = True
        shard.state = ShardState.FAILED
        log.warning("shard %s: %s", shard.shard_id, reason)
        last = tuple(shard.lines)[-FAILED_LAST_LINES:]
        # Clean up first: whoever hears FAILED may reuse the port and cards.
        await self._terminate(shard)
        self._state.remove(shard.shard_id, keep_log=True)
        await self._emit(self._status(shard, reason=reason, last_lines=last))
        shard.scope.cancel()

    # --- stopping ---------------------------------------------------------------

    async def _stop_shards(self, shards: Iterable[_Shard], *, wait_to_report: bool) -> None:
        async with trio.open_nursery() as nursery:
            for shard in shards:
                nursery.start_soon(self._stop_locked, shard.shard_id, "", wait_to_report)

    async def _stop_locked(self, shard_id: str, correlation_id: str, wait_to_report: bool) -> None:
        async with self._locks[shard_id]:
            shard = self._shards.get(shard_id)
            if shard is None:
                return
            shard.ending = True
            await self._terminate(shard)
            shard.scope.cancel()
            with trio.move_on_after(OUTPUT_DRAIN_S):
                await shard.done.wait()
            self._close_log(shard)
            if shard.state is not ShardState.STOPPED:
                self._state.remove(shard_id, keep_log=shard.state is ShardState.FAILED)
            shard.state = ShardState.STOPPED
            log.info("shard %s: stopped", shard_id)
            status = self._status(shard, correlation_id=correlation_id)
            if wait_to_report:
                await self._emit(status)
            else:
                self._emit_nowait(status)

    async def _terminate(self, shard: _Shard) -> None:
        """Kill every process of ``shard`` (once; later callers wait for it)."""
        if shard.terminating:
            await shard.terminated.wait()
            return
        shard.terminating = True
        try:
            with trio.CancelScope(shield=True):
                await self._kill(shard)
        finally:
            shard.terminated.set()

    async def _kill(self, shard: _Shard) -> None:
        groups = frozenset(proc.pgid for proc in shard.procs)
        if not groups:
            return
        strays = await trio.to_thread.run_sync(_find_strays, groups)
        _signal(groups, strays, signal.SIGTERM)
        if not await self._wait_gone(shard, groups, strays, self._stop_grace_s):
            strays |= await trio.to_thread.run_sync(_find_strays, groups)
            log.warning("shard %s: still running after SIGTERM; SIGKILL", shard.shard_id)
            _signal(groups, strays, signal.SIGKILL)
            await self._wait_gone(shard, groups, strays, REAP_DEADLINE_S)
        with trio.move_on_after(REAP_DEADLINE_S):
            for proc in shard.procs:
                if proc.process is not None:
                    await proc.process.wait()

    @staticmethod
    async def _wait_gone(
        shard: _Shard, groups: frozenset[int], strays: set[_Pid], deadline_s: float
    ) -> bool:
        with trio.move_on_after(deadline_s):
            while True:
                for proc in shard.procs:
                    if proc.process is not None:
                        proc.process.poll()  # reaps our own children
                if not await trio.to_thread.run_sync(_any_alive, groups, strays):
                    return True
                await trio.sleep(STOP_POLL_S)
        return False

    # --- reporting --------------------------------------------------------------

    @staticmethod
    def _status(
        shard: _Shard,
        *,
        reason: str = "",
        last_lines: tuple[str, ...] = (),
        correlation_id: str = "",
        progress: str = "",
    ) -> ShardStatus:
        return ShardStatus(
            shard_id=shard.shard_id,
            replica_id=shard.replica_id,
            state=shard.state,
            port=shard.port,
            reason=reason,
            last_lines=last_lines,
            correlation_id=correlation_id,
            compute=shard.compute,
            progress=progress,
        )

    async def _emit(self, status: ShardStatus) -> None:
        try:
            await self._events.send(status)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.warning(
                "shard %s: %s not reported: events channel closed", status.shard_id, status.state
            )

    def _emit_nowait(self, status: ShardStatus) -> None:
        try:
            self._events.send_nowait(status)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            log.warning(
                "shard %s: %s not reported: events channel full or closed",
                status.shard_id,
                status.state,
            )


def _sha256_with_progress(path: Path, progress: _HashProgress) -> str:
    """The sha256 of ``path`` (hex), counting bytes in ``progress.done``;
    stops early (returning "") once ``progress.cancelled`` is set.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while not progress.cancelled:
            block = f.read(HASH_BLOCK_BYTES)
            if not block:
                return digest.hexdigest()
            digest.update(block)
            progress.done += len(block)
    return ""


async def _wait_not_child(proc: _Proc) -> None:
    """Return once ``proc`` (not a child of ours) has exited: through a pidfd
    when the kernel has them, else by polling ``/proc`` every
    :data:`PID_POLL_S`."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):
        while True:
            if not _same_process(proc):
                return
            await trio.sleep(PID_POLL_S)
    try:
        if not _same_process(proc):
            return  # gone (its pid reused) before the pidfd was opened
        await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)


# --- /proc ------------------------------------------------------------------------


#: Engine key variables never passed down from the agent's own environment:
#: a keyless shard must not inherit some other key.
_KEY_VARIABLES = frozenset({"LLAMA_API_KEY", "VLLM_API_KEY", "FREETOKEN_API_KEY", "STRATA_API_KEY"})


def _inherited_env() -> dict[str, str]:
    """The agent's environment less engine keys, with ``PYTHONUNBUFFERED=1``
    (Python engines otherwise hold their output back in a file's buffer)."""
    env = {k: v for k, v in os.environ.items() if k not in _KEY_VARIABLES}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (SO_REUSEADDR, as servers set
    it: a port in TIME_WAIT counts as free, one with a listener does not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True


def _decode(line: bytes) -> str:
    return line.decode("utf-8", errors="replace").rstrip("\r")


def _read_stat(pid: int) -> _Stat | None:
    """``/proc/<pid>/stat``'s parent, group, state and start time; ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may hold anything, ")" included.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return _Stat(
            state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2]), start_time=int(fields[19])
        )
    except (IndexError, ValueError):
        return None


def _same_process(proc: _Proc) -> bool:
    """Whether ``proc`` still runs (not a zombie) and is the process that
    was started (same start time: its pid was not given to another)."""
    stat = _read_stat(proc.pid)
    return (
        stat is not None
        and stat.state not in ("Z", "X")
        and (proc.start_time == 0 or stat.start_time == proc.start_time)
    )


def _process_table() -> dict[int, _Stat]:
    table: dict[int, _Stat] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read_stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def _find_strays(groups: frozenset[int]) -> set[_Pid]:
    """Live descendants (≤ :data:`STRAY_MAX_DEPTH` levels) of the members of
    ``groups`` that are in none of them."""
    table = _process_table()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, stat in table.items():
        children[stat.ppid].append(pid)
    level = [pid for pid, stat in table.items() if stat.pgrp in groups]
    strays: set[_Pid] = set()
    seen = set(level)
    for _ in range(STRAY_MAX_DEPTH):
        below = [child for pid in level for child in children.get(pid, ()) if child not in seen]
        if not below:
            break
        seen.update(below)
        for pid in below:
            stat = table[pid]
            if stat.pgrp not in groups and stat.state != "Z":
                strays.add(_Pid(pid, stat.start_time))
        level = below
    return strays


def _stray_alive(stray: _Pid) -> bool:
    stat = _read_stat(stray.pid)
    return stat is not None and stat.start_time == stray.start_time and stat.state != "Z"


def _any_alive(groups: frozenset[int], strays: set[_Pid]) -> bool:
    """Whether a non-zombie member of ``groups`` or a stray still runs."""
    if any(_stray_alive(stray) for stray in strays):
        return True
    for pgid in groups:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        # Something is in the group; zombies don't count.
        if any(stat.pgrp in groups and stat.state != "Z" for stat in _process_table().values()):
            return True
        break
    return False


def _signal(groups: frozenset[int], strays: set[_Pid], sig: signal.Signals) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("not allowed to signal process group %d", pgid)
    for stray in strays:
        if not _stray_alive(stray):
            continue
        try:
            os.kill(stray.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("not allowed to signal stray process %d", stray.pid)

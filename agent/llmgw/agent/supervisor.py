"""Engine supervision: start, watch, adopt and stop the engine replicas' shards of one agent.

One :class:`Supervisor` owns every shard an agent runs (see
``docs/architecture.md``, the agent): it starts a shard's engine processes,
watches them until they are ready and while they run, restarts a shard
(a new incarnation) on the next ``StartShard`` after it failed or stopped,
stops it, and adopts the engines an earlier agent left running. The
mechanisms live beside it: :mod:`llmgw.agent.processes` (process groups,
``/proc``, stopping with strays), :mod:`llmgw.agent.output` (the engine's
log file and its last lines), :mod:`llmgw.agent.probes` (readiness probes),
:mod:`llmgw.agent.weights` (the weights digest), :mod:`llmgw.agent.state`
(the shard files).

- each command of a shard runs in its own process group (a new session), with
  the engine key in its environment only; stdout and stderr go to a log file
  in the state directory (never a pipe to the agent, which may die first),
  tailed into a ring buffer of the last lines;
- a shard with ``model_sha256`` has its weights file checked first (a
  digest cache keyed by the file's identity avoids hashing it again);
- the shard is STARTING until its health endpoint answers ready
  (:func:`~llmgw.agent.probes.is_ready`) and, for an adapter that asks
  (vLLM), its ``/v1/models`` lists the served name
  (:func:`~llmgw.agent.probes.lists_served_model`); then READY, with the compute report
  read from the engine's start-up output (:mod:`llmgw.agent.compute`); while
  STARTING, output (or the weights check) is reported as
  ``ShardStatus.progress`` at most every ``progress_interval_s`` so the
  control plane resets its start deadline; for the first
  :data:`COMPUTE_WATCH_S` after READY a changed compute report is sent again;
- a READY engine is probed every :data:`LIVENESS_INTERVAL_S` (each probe at
  most :data:`~llmgw.agent.probes.LIVENESS_TIMEOUT_S`). One that has not
  answered ready for :data:`SILENT_AFTER_S` is reported STARTING with the
  reason "not answering its health check for N s" (the control plane takes
  it out of routing); it is READY again as soon as it answers, and FAILED
  (stopped; the control plane's crash back-off restarts it) once silent for
  :data:`SILENT_RESTART_S`;
- a process that exits without having been asked to stop, or an engine that
  makes no progress (no output) and is not ready within the startup timeout,
  turns the shard FAILED with a one-line reason and its last output lines;
  the reason starts with the engine's own error line, picked from its output
  by its adapter (:meth:`~llmgw.engines.base.EngineAdapter.failure_cause`),
  else ends with its last output line (``docs/up.md``, Failures);
- a stop finds strays (descendants that left the group), SIGTERMs the group and
  the strays, waits up to 5 s polling every 100 ms, then SIGKILLs them, and
  reaps its children (:func:`~llmgw.agent.processes.stop_groups`);
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
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Final, NoReturn

import attrs
import trio

from llmgw import errors
from llmgw.agent import probes, processes, protocol
from llmgw.agent.compute import ComputeReport
from llmgw.agent.fetch import WeightsFetcher, held_weights, remove_weights
from llmgw.agent.output import TAIL_INTERVAL_S, EngineOutput, create_log
from llmgw.agent.processes import STOP_GRACE_S
from llmgw.agent.protocol import ShardState, ShardStatus
from llmgw.agent.state import ProcRecord, ShardRecord, StateDir, boot_id
from llmgw.agent.weights import DigestCache, HashProgress
from llmgw.engines.base import EngineAdapter, ReadyByModelList, ShardLaunch, error_line

__all__ = [
    "COMPUTE_WATCH_S",
    "FAILED_LAST_LINES",
    "LIVENESS_INTERVAL_S",
    "PROGRESS_INTERVAL_S",
    "SILENT_AFTER_S",
    "SILENT_RESTART_S",
    "STOP_ALL_DEADLINE_S",
    "Supervisor",
]

log = logging.getLogger(__name__)

#: The most time :meth:`Supervisor.stop_all` takes, in seconds.
STOP_ALL_DEADLINE_S: Final = 8.0
#: How many output lines a FAILED status carries.
FAILED_LAST_LINES: Final = 50
#: How long a stop waits for the shard's watcher to finish, in seconds.
OUTPUT_DRAIN_S: Final = 1.0
#: The least time between two progress reports of a STARTING shard, in seconds.
PROGRESS_INTERVAL_S: Final = 5.0
#: How long after start a changed compute report is sent again (re-read
#: every 5 s for the first 5 minutes), in seconds.
COMPUTE_WATCH_S: Final = 300.0
#: Seconds between two liveness probes of a READY engine (from one probe's
#: start to the next one's).
LIVENESS_INTERVAL_S: Final = 2.0
#: How long a READY engine may go without answering its health check ready
#: before it is reported not ready (STARTING with a reason), in seconds.
#: With the probe's deadline and the report's way to the control plane, it
#: leaves routing within about 10 s.
SILENT_AFTER_S: Final = 6.0
#: How long an engine may stay silent before it is failed and stopped (the
#: control plane's crash back-off restarts it), in seconds.
SILENT_RESTART_S: Final = 60.0

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
    #: The engine's output: its log file, last lines and compute report.
    output: EngineOutput
    #: When the shard started, trio clock and wall clock.
    started_at: float
    wall_started: float
    health_path: str = "/health"
    boot_id: str = ""
    adopted: bool = False
    state: ShardState = ShardState.STARTING
    compute: str = ""
    procs: list[_Proc] = attrs.field(factory=list)
    # Progress and compute reports.
    progress_at: float = 0.0
    #: Why a shard that was READY is STARTING again (its engine stopped
    #: answering its health check); "" otherwise.
    silent: str = ""
    #: Cancels a weights check in progress (set while one runs).
    checking: trio.CancelScope | None = None
    #: Process exits are expected from now on (a stop or a failure is under way).
    ending: bool = False
    terminating: bool = False
    terminated: trio.Event = attrs.field(factory=trio.Event)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: Set when the watcher task has finished (or never ran).
    done: trio.Event = attrs.field(factory=trio.Event)
    #: Readiness also needs this URL (``/v1/models``) to list the served
    #: name (vLLM: :class:`~llmgw.engines.base.ReadyByModelList`); "" = no.
    models_url: str = ""

    @property
    def shard_id(self) -> str:
        return self.start.shard_id

    @property
    def replica_id(self) -> str:
        return self.start.replica_id

    @property
    def port(self) -> int:
        return self.start.port


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
        probe_interval_s: seconds between readiness probes (0.1: a ready
            engine is seen within a tenth of a second; a probe is one local GET).
        max_log_lines: output lines kept per shard (at least 1).
        startup_timeout_s: seconds an engine may go without output and without
            becoming ready before it is failed and stopped.
        owns_engines: stop every engine when :meth:`serve` ends (``llmgw up``);
            when false engines outlive the supervisor, for adoption.
        stop_grace_s: seconds between SIGTERM and SIGKILL (5 by default).
        progress_interval_s: least seconds between two progress reports of
            a STARTING shard, and between two compute reports of a READY one.
        weights_dir, fetcher: where ``StartShard.weights`` are fetched to
            (``state_dir/weights`` by default), or the fetcher itself.
        liveness_interval_s, silent_after_s, silent_restart_s: the liveness
            probes of READY engines (:data:`LIVENESS_INTERVAL_S`,
            :data:`SILENT_AFTER_S`, :data:`SILENT_RESTART_S` by default).

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
        probe_interval_s: float = 0.1,
        max_log_lines: int = 500,
        startup_timeout_s: float = 600.0,
        owns_engines: bool = False,
        stop_grace_s: float = STOP_GRACE_S,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
        liveness_interval_s: float = LIVENESS_INTERVAL_S,
        silent_after_s: float = SILENT_AFTER_S,
        silent_restart_s: float = SILENT_RESTART_S,
        weights_dir: Path | None = None,
        fetcher: WeightsFetcher | None = None,
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
        self._liveness_interval_s = liveness_interval_s
        self._silent_after_s = silent_after_s
        self._silent_restart_s = silent_restart_s
        self._shards: dict[str, _Shard] = {}
        self._locks: collections.defaultdict[str, trio.Lock] = collections.defaultdict(trio.Lock)
        self._nursery: trio.Nursery | None = None
        #: Digests of weights files already hashed, by file identity.
        self._digests = DigestCache()
        #: Versions (``ORG/REPO@commit``) to remove once no shard runs on them.
        self._purge_pending: set[str] = set()
        #: Fetches pinned model versions (``StartShard.weights``).
        self.fetcher = fetcher or WeightsFetcher(weights_dir or state_dir / "weights")

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
        :data:`~llmgw.agent.probes.PROBE_TIMEOUT_S`) and new ones can be
        started. Never returns unless cancelled. When cancelled with ``owns_engines`` set, every
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
            if cmd.weights is not None:
                fetch = partial(self._fetch_weights, shard, cmd, nursery)
                fetched = await self._before_spawn(shard, cmd, fetch)
                if fetched is None:
                    return
                cmd = fetched
            profile = cmd.profile
            if profile.model_sha256 and profile.model_path:
                checked = cmd

                async def check() -> tuple[str, protocol.StartShard]:
                    return await self._check_weights(shard, checked), checked

                if await self._before_spawn(shard, cmd, check) is None:
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
        SIGTERM, ``stop_grace_s`` seconds of grace polled every 100 ms,
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
        shard.output.read()
        return list(shard.output.last_lines(lines))

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

    async def weights(self, ask: protocol.WeightsRequest) -> protocol.WeightsReply:
        """Remove the versions ``ask.remove`` names that no active shard runs
        on (only files llmgw fetched), then list what the weights directory
        holds (:func:`~llmgw.agent.fetch.held_weights`)."""
        in_use = {
            f"{shard.start.weights.repo}@{shard.start.weights.revision}"
            for shard in self._shards.values()
            if shard.start.weights is not None and shard.state in _ACTIVE and not shard.ending
        }
        removed: list[str] = []
        kept: list[str] = []
        root = self.fetcher.weights_dir
        for version in ask.remove:
            repo, _, revision = version.partition("@")
            if version in in_use:
                self._purge_pending.add(version)
                kept.append(f"{version}: a shard of this node runs on it; removed once it stops")
                continue
            try:
                removed += await trio.to_thread.run_sync(remove_weights, root, repo, revision)
            except (errors.LlmgwError, OSError) as exc:
                kept.append(f"{version}: {exc}")
        held = await trio.to_thread.run_sync(held_weights, root)
        return protocol.WeightsReply(
            correlation_id=ask.correlation_id,
            held=tuple(
                protocol.WeightsHeld(
                    repo=h.repo,
                    revision=h.revision,
                    path=h.path,
                    files=len(h.files),
                    size_bytes=h.size_bytes,
                    in_use=f"{h.repo}@{h.revision}" in in_use,
                )
                for h in held
            ),
            removed=tuple(removed),
            kept=tuple(kept),
        )

    async def _purge_unused(self) -> None:
        """Remove the versions a ``WeightsRequest`` asked to remove while a
        shard ran on them, once none does (only files llmgw fetched)."""
        if not self._purge_pending:
            return
        in_use = {
            f"{shard.start.weights.repo}@{shard.start.weights.revision}"
            for shard in self._shards.values()
            if shard.start.weights is not None and shard.state in _ACTIVE and not shard.ending
        }
        for version in sorted(self._purge_pending - in_use):
            self._purge_pending.discard(version)
            repo, _, revision = version.partition("@")
            try:
                removed = await trio.to_thread.run_sync(
                    remove_weights, self.fetcher.weights_dir, repo, revision
                )
            except (errors.LlmgwError, OSError) as exc:
                log.warning("weights %s: cannot remove them: %s", version, exc)
                continue
            log.info("weights %s: removed %d files (purged)", version, len(removed))

    def state(self, shard_id: str) -> ShardState | None:
        """A shard's state, or ``None`` for a shard this supervisor never ran."""
        shard = self._shards.get(shard_id)
        return None if shard is None else shard.state

    # --- starting ---------------------------------------------------------------

    def _new_shard(self, cmd: protocol.StartShard, *, health_path: str = "") -> _Shard:
        now = trio.current_time()
        return _Shard(
            start=attrs.evolve(cmd, api_key=""),
            health_url=probes.base_url(cmd.bind_addr, cmd.port),
            health_path=health_path,
            api_key=cmd.api_key,
            output=EngineOutput(
                name=f"shard {cmd.shard_id}",
                max_lines=self._max_log_lines,
                report=ComputeReport(cmd.profile.engine, cmd.gpu_indices),
            ),
            started_at=now,
            wall_started=time.time(),
            progress_at=now,
            boot_id=boot_id(),
        )

    async def _before_spawn(
        self,
        shard: _Shard,
        cmd: protocol.StartShard,
        step: Callable[[], Awaitable[tuple[str, protocol.StartShard]]],
    ) -> protocol.StartShard | None:
        """Run one step before the engine starts (fetching or checking the
        weights): ``step`` gives the reason it failed (or ``""``) and the
        command to go on with. Returns that command, or ``None`` when the
        start ends here: stopped meanwhile (the stop reports it) or failed
        (reported here). Cancelled (the link went away): the start is
        forgotten, so that the next ``StartShard`` starts afresh."""
        try:
            reason, cmd = await step()
        except BaseException:
            if self._shards.get(cmd.shard_id) is shard:
                del self._shards[cmd.shard_id]
            shard.state = ShardState.STOPPED
            shard.done.set()
            raise
        if shard.ending:
            shard.done.set()
            return None
        if reason:
            await self._fail_to_start(shard, reason, cmd.correlation_id)
            return None
        return cmd

    async def _fail_to_start(self, shard: _Shard, reason: str, correlation_id: str) -> None:
        shard.ending = True
        await self._terminate(shard)
        shard.output.close()
        self._state.remove(shard.shard_id, keep_log=True)
        shard.state = ShardState.FAILED
        shard.done.set()
        reason = self._with_cause(shard, reason)
        log.warning("shard %s: %s", shard.shard_id, reason)
        last = shard.output.last_lines(FAILED_LAST_LINES)
        await self._emit(
            self._status(shard, reason=reason, last_lines=last, correlation_id=correlation_id)
        )

    def _with_cause(self, shard: _Shard, what: str) -> str:
        """A FAILED reason: the engine's cause from its output (its adapter's
        ``failure_cause``) then ``(what)``; without one, ``what; last output:
        LINE`` (the last line with a letter or digit), or ``what`` alone."""
        lines = tuple(shard.output.lines)
        try:
            cause = self._adapter_for(shard.start.profile.engine).failure_cause(lines)
        except (LookupError, ValueError):
            cause = error_line(lines)
        if cause:
            return f"{cause} ({what})"
        last = next(
            (line.strip() for line in reversed(lines) if any(c.isalnum() for c in line)), ""
        )
        return f"{what}; last output: {last}" if last else what

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
        if not probes.port_free(launch.bind_addr, launch.http_port):
            # Never start (nor probe) an engine on a port something else
            # holds: the probe would reach that process, and so would the
            # router, with the engine key.
            return f"port {launch.http_port} is in use by another process"
        shard.health_path = health_path if health_path.startswith("/") else f"/{health_path}"
        if isinstance(adapter, ReadyByModelList):
            shard.models_url = shard.health_url + adapter.models_path()
        shard.health_url += shard.health_path
        log_path = self._state.log_path(shard.shard_id)
        try:
            out = create_log(log_path)
        except OSError as exc:
            return f"cannot open the engine log {log_path}: {exc}"
        try:
            shard.output.follow(log_path)
            for command in commands:
                try:
                    process = await processes.start_in_new_group(
                        command.argv, env=command.env, output_fd=out
                    )
                except OSError as exc:
                    return f"cannot start {command.path}: {exc}"
                stat = processes.read_stat(process.pid)
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

    async def _fetch_weights(
        self, shard: _Shard, cmd: protocol.StartShard, nursery: trio.Nursery
    ) -> tuple[str, protocol.StartShard]:
        """Fetch ``cmd.weights`` (:class:`~llmgw.agent.fetch.WeightsFetcher`,
        once per node per version); the reason it could not (or ``""``) and
        ``cmd`` with ``profile.model_path`` set to what was fetched. Reports
        STARTING with :class:`~llmgw.agent.protocol.DownloadProgress` each
        ``progress_interval_s`` in which bytes moved. ``("", cmd)`` when a
        stop cancelled it (``shard.ending`` is then set)."""
        spec = cmd.weights
        assert spec is not None
        outcome: list[str | Path] = []
        try:
            with trio.CancelScope() as scope:
                shard.checking = scope
                await self._emit(
                    self._status(
                        shard,
                        progress=f"fetching {spec.repo}@{spec.revision[:12]}",
                        correlation_id=cmd.correlation_id,
                    )
                )
                async with trio.open_nursery() as reporting:
                    reporting.start_soon(self._report_fetch, shard, spec.repo, spec.revision)
                    try:
                        outcome.append(await self.fetcher.fetch(spec, nursery))
                    except errors.LlmgwError as exc:
                        outcome.append(str(exc))
                    finally:
                        reporting.cancel_scope.cancel()
        finally:
            shard.checking = None
        if not outcome:
            return "", cmd
        got = outcome[0]
        if isinstance(got, str):
            return got, cmd
        profile = attrs.evolve(cmd.profile, model_path=str(got), model_sha256="")
        fetched = attrs.evolve(cmd, profile=profile)
        shard.start = attrs.evolve(fetched, api_key="")
        return "", fetched

    async def _report_fetch(self, shard: _Shard, repo: str, revision: str) -> None:
        """STARTING with the fetch's progress whenever bytes moved since the
        last report, at most every ``progress_interval_s``."""
        seen = -1
        while True:
            await trio.sleep(min(self._progress_interval_s, 1.0))
            now = self.fetcher.job_progress(repo, revision)
            if now is None:
                continue
            download, ticks = now
            if ticks == seen or trio.current_time() - shard.progress_at < min(
                self._progress_interval_s, 1.0
            ):
                continue
            seen = ticks
            shard.progress_at = trio.current_time()
            mb = 1e6
            await self._emit(
                attrs.evolve(
                    self._status(
                        shard,
                        progress=f"{download.phase} {repo}: {download.done_bytes / mb:.1f} of "
                        f"{download.total_bytes / mb:.1f} MB at "
                        f"{download.rate_bytes_per_s / mb:.1f} MB/s",
                    ),
                    download=download,
                )
            )

    async def _check_weights(self, shard: _Shard, cmd: protocol.StartShard) -> str:
        """Check the shard's weights file against ``model_sha256``; the reason
        it does not match (or cannot be read), or ``""``. Reports STARTING
        with progress while hashing. Returns ``""`` when a stop cancelled it
        (``shard.ending`` is then set)."""
        path = Path(cmd.profile.model_path)
        expected = cmd.profile.model_sha256.strip().lower()
        progress = HashProgress(total=0)
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
        self, shard: _Shard, cmd: protocol.StartShard, path: Path, progress: HashProgress
    ) -> str:
        """``path``'s sha256 (from the cache when the file is unchanged), or
        ``"!"`` and the reason it cannot be read."""
        try:
            file_id = await self._digests.identify(path)
        except OSError as exc:
            return f"!weights file {path}: {exc.strerror or exc}"
        cached = self._digests.known(file_id)
        if cached is not None:
            return cached
        progress.total = file_id.size
        await self._emit(
            self._status(
                shard, progress=f"checking weights {path.name}", correlation_id=cmd.correlation_id
            )
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._report_hashing, shard, progress, path.name)
            try:
                digest = await self._digests.digest(file_id, progress)
            except OSError as exc:
                return f"!cannot read the weights file {path}: {exc.strerror or exc}"
            finally:
                nursery.cancel_scope.cancel()
        return digest

    async def _report_hashing(self, shard: _Shard, progress: HashProgress, name: str) -> None:
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
            shard.output.follow_existing(
                self._state.log_path(shard.shard_id), read_head=not shard.compute
            )
            same_boot = not record.boot_id or record.boot_id == this_boot
            live = [
                p for p in shard.procs if same_boot and processes.same_process(p.pid, p.start_time)
            ]
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
            shard.output.close()
            self._state.remove(shard.shard_id, keep_log=True)
            shard.done.set()
            if live:
                nursery.start_soon(self._terminate, shard)
        async with trio.open_nursery() as probing:
            for shard in adopted:
                probing.start_soon(self._adopt_probe, shard)
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
        async with probes.probe_client() as client:
            if await probes.is_ready(client, shard.health_url, {}):
                self._become_ready(shard)

    # --- watching ---------------------------------------------------------------

    async def _watch(self, shard: _Shard) -> None:
        try:
            with shard.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._tail, shard)
                    for proc in shard.procs:
                        nursery.start_soon(self._wait_exit, shard, proc)
                    if shard.state is ShardState.STARTING:
                        await self._probe_until_ready(shard)
                    if shard.state is ShardState.READY:
                        await self._probe_while_ready(shard)
        finally:
            shard.output.read()
            shard.output.close()
            shard.done.set()

    async def _tail(self, shard: _Shard) -> None:
        while True:
            shard.output.read()
            await self._report_output(shard)
            await trio.sleep(TAIL_INTERVAL_S)

    async def _report_output(self, shard: _Shard) -> None:
        """Progress while STARTING; a changed compute report soon after READY."""
        if shard.ending:
            return
        now = trio.current_time()
        if now - shard.progress_at < self._progress_interval_s:
            return
        if shard.state is ShardState.STARTING and (text := shard.output.take_text()) is not None:
            shard.progress_at = now
            await self._emit(self._status(shard, progress=text))
        elif shard.state is ShardState.READY and now - shard.started_at < COMPUTE_WATCH_S:
            text = shard.output.report.text
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
            await processes.wait_not_child(proc.pid, proc.start_time)
            how = "exited (adopted from an earlier agent: exit code unknown)"
        if shard.ending:
            return
        what = "engine" if len(shard.procs) == 1 else f"engine process {proc.name!r}"
        shard.output.read()  # its last words
        await self._fail(shard, f"{what} {how}")

    async def _probe_until_ready(self, shard: _Shard) -> None:
        headers = probes.auth_headers(shard.api_key)
        async with probes.probe_client() as client:
            while not shard.ending:
                if await probes.is_ready(client, shard.health_url, headers) and (
                    not shard.models_url
                    or await probes.lists_served_model(
                        client,
                        shard.models_url,
                        headers,
                        shard.start.profile.served_model_name,
                    )
                ):
                    if shard.ending:
                        return
                    shard.output.read()  # the start-up log so far
                    self._become_ready(shard)
                    log.info("shard %s: ready on %s", shard.shard_id, shard.compute or "?")
                    await self._save(shard)
                    await self._emit(self._status(shard))
                    return
                quiet_s = trio.current_time() - shard.output.last_output_at
                if quiet_s > self._startup_timeout_s:
                    await self._fail(
                        shard,
                        f"engine not ready after {quiet_s:.1f} s without output "
                        f"(startup timeout {self._startup_timeout_s:g} s)",
                    )
                    return
                await trio.sleep(self._probe_interval_s)
                if shard.api_key and "Authorization" not in headers:
                    headers = probes.auth_headers(shard.api_key)

    async def _probe_while_ready(self, shard: _Shard) -> None:
        """Probe a READY engine every ``liveness_interval_s`` until it ends
        (module docstring): report it STARTING with a reason after
        ``silent_after_s`` without a ready answer, READY again when it
        answers, fail it after ``silent_restart_s``."""
        headers = probes.auth_headers(shard.api_key)
        answered_at = trio.current_time()
        async with probes.probe_client() as client:
            while not shard.ending:
                probe_at = trio.current_time()
                ready = await probes.is_ready(
                    client,
                    shard.health_url,
                    headers,
                    timeout_s=min(probes.LIVENESS_TIMEOUT_S, self._silent_after_s),
                )
                if shard.ending:
                    return
                now = trio.current_time()
                if ready:
                    answered_at = now
                    if shard.silent:
                        shard.silent = ""
                        shard.state = ShardState.READY
                        log.info("shard %s: answering its health check again", shard.shard_id)
                        await self._emit(self._status(shard))
                else:
                    silent_s = now - answered_at
                    if silent_s >= self._silent_restart_s:
                        shard.silent = ""
                        await self._fail(
                            shard,
                            f"not answering its health check for {silent_s:.0f} s "
                            f"(restarted after {self._silent_restart_s:g} s)",
                        )
                        return
                    if silent_s >= self._silent_after_s and not shard.silent:
                        shard.silent = f"not answering its health check for {silent_s:.0f} s"
                        shard.state = ShardState.STARTING
                        log.warning("shard %s: %s", shard.shard_id, shard.silent)
                        await self._emit(self._status(shard))
                await trio.sleep(
                    max(0.0, probe_at + self._liveness_interval_s - trio.current_time())
                )
                if shard.api_key and "Authorization" not in headers:
                    headers = probes.auth_headers(shard.api_key)

    def _become_ready(self, shard: _Shard) -> None:
        shard.state = ShardState.READY
        shard.compute = shard.compute or shard.output.report.text
        shard.progress_at = trio.current_time()

    async def _fail(self, shard: _Shard, reason: str) -> None:
        """Stop what is left of ``shard``, report it FAILED, end its watcher."""
        if shard.ending:
            return
        shard.ending = True
        shard.state = ShardState.FAILED
        reason = self._with_cause(shard, reason)
        log.warning("shard %s: %s", shard.shard_id, reason)
        last = shard.output.last_lines(FAILED_LAST_LINES)
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
            shard.output.close()
            if shard.state is not ShardState.STOPPED:
                self._state.remove(shard_id, keep_log=shard.state is ShardState.FAILED)
            shard.state = ShardState.STOPPED
            log.info("shard %s: stopped", shard_id)
            await self._purge_unused()
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
        await processes.stop_groups(
            frozenset(proc.pgid for proc in shard.procs),
            [proc.process for proc in shard.procs if proc.process is not None],
            grace_s=self._stop_grace_s,
            label=f"shard {shard.shard_id}",
        )

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
            reason=reason or (shard.silent if shard.state is ShardState.STARTING else ""),
            last_lines=last_lines,
            correlation_id=correlation_id,
            compute=shard.compute,
            progress=progress,
            pid=shard.procs[0].pid if shard.procs and shard.state in _ACTIVE else 0,
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

"""Engine supervision: start, watch and stop the engine processes of one agent.

One :class:`Supervisor` owns every shard an agent runs (``shared/spec/agent.md``,
Engine supervision):

- each command of a shard runs in its own process group (a new session), with
  the engine key in its environment only, and stdout and stderr merged into a
  ring buffer of the last lines;
- the shard is STARTING until ``GET <health path>`` with the key answers 200
  with a body that :func:`~llmgw.engines.base.body_says_ready`; then READY;
- a process that exits without having been asked to stop, or an engine that
  makes no progress (no output) and is not ready within the startup timeout,
  turns the shard FAILED with a one-line reason and its last output lines;
- a stop finds strays (descendants that left the group), SIGTERMs the group and
  the strays, waits up to 5 s polling every 100 ms, then SIGKILLs them, and
  reaps its children.

Every state change is sent as a :class:`~llmgw.agent.protocol.ShardStatus` on
the ``events`` channel given to the constructor. The channel is bounded: a slow
reader slows the supervisor's reports down, never the engines.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterable
from typing import Final, NoReturn

import attrs
import httpx
import trio

from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState, ShardStatus
from llmgw.engines.base import (
    MAX_HEALTH_BODY_BYTES,
    Command,
    EngineAdapter,
    ShardLaunch,
    body_says_ready,
)

__all__ = [
    "FAILED_LAST_LINES",
    "PROBE_TIMEOUT_S",
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
#: How long a FAILED report waits for the rest of a dead engine's output, in seconds.
OUTPUT_DRAIN_S: Final = 1.0
#: How long reaping after SIGKILL may take, in seconds.
REAP_DEADLINE_S: Final = 2.0

_ACTIVE: Final = frozenset({ShardState.STARTING, ShardState.READY})


@attrs.define(eq=False)
class _Proc:
    """One running command of a shard."""

    command: Command
    process: trio.Process
    eof: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class _Shard:
    """One incarnation of a shard: a start and everything until it ended."""

    shard_id: str
    replica_id: str
    model: str
    port: int
    fingerprint: str
    gpu_indices: tuple[int, ...]
    health_url: str
    api_key: str
    lines: collections.deque[str]
    last_progress: float
    state: ShardState = ShardState.STARTING
    procs: list[_Proc] = attrs.field(factory=list)
    #: Process exits are expected from now on (a stop or a failure is under way).
    ending: bool = False
    terminating: bool = False
    terminated: trio.Event = attrs.field(factory=trio.Event)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: Set when the watcher task has finished (or never ran).
    done: trio.Event = attrs.field(factory=trio.Event)


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


class Supervisor:
    """Owns the engine processes of one agent.

    Args:
        adapter_for: the :class:`~llmgw.engines.base.EngineAdapter` for an
            engine name (``EngineProfile.engine``); may raise ``LookupError``
            or ``ValueError`` for an unknown engine, which fails the shard.
        events: where every :class:`~llmgw.agent.protocol.ShardStatus` goes.
            A closed or broken channel drops reports (logged).
        probe_interval_s: seconds between readiness probes.
        max_log_lines: output lines kept per shard (at least 1).
        startup_timeout_s: seconds an engine may go without output and without
            becoming ready before it is failed and stopped.
        owns_engines: stop every engine when :meth:`serve` ends (``llmgw up``);
            when false engines outlive the supervisor, for adoption.
        stop_grace_s: seconds between SIGTERM and SIGKILL (the spec says 5).

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
        probe_interval_s: float = 0.5,
        max_log_lines: int = 500,
        startup_timeout_s: float = 600.0,
        owns_engines: bool = False,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        if max_log_lines < 1:
            raise ValueError("max_log_lines must be at least 1")
        self._adapter_for = adapter_for
        self._events = events
        self._probe_interval_s = probe_interval_s
        self._max_log_lines = max_log_lines
        self._startup_timeout_s = startup_timeout_s
        self._owns_engines = owns_engines
        self._stop_grace_s = stop_grace_s
        self._shards: dict[str, _Shard] = {}
        self._locks: collections.defaultdict[str, trio.Lock] = collections.defaultdict(trio.Lock)
        self._nursery: trio.Nursery | None = None

    # --- the daemon -------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Run the shard watchers until cancelled.

        Calls ``task_status.started()`` once shards can be started. Never
        returns unless cancelled. When cancelled with ``owns_engines`` set,
        every engine is stopped first (shielded, at most
        :data:`STOP_ALL_DEADLINE_S` seconds); otherwise engines keep running.

        Raises:
            RuntimeError: ``serve`` is already running.
        """
        if self._nursery is not None:
            raise RuntimeError("Supervisor.serve() is already running")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            if self._owns_engines:
                with trio.CancelScope(shield=True), trio.move_on_after(STOP_ALL_DEADLINE_S):
                    await self._stop_shards(list(self._shards.values()), wait_to_report=False)

    # --- commands ---------------------------------------------------------------

    async def start_shard(self, cmd: protocol.StartShard) -> None:
        """Start the shard ``cmd`` describes, unless it is already running.

        A shard STARTING or READY is left alone; a FAILED, STOPPED or unknown
        one is started: STARTING is reported once its processes run, READY or
        FAILED later. A launch that cannot even start (unknown engine, bad
        profile, missing binary) is reported FAILED at once.

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
                    return
                # A failure or stop is still being handled: let it finish and
                # report before the next incarnation starts.
                await existing.done.wait()
            shard = self._new_shard(cmd)
            self._shards[cmd.shard_id] = shard
            with trio.CancelScope(shield=True):  # never lose a started process
                reason = await self._spawn(shard, cmd)
            if reason:
                shard.ending = True
                await self._terminate(shard)
                shard.state = ShardState.FAILED
                shard.done.set()
                await self._emit(
                    self._status(shard, reason=reason, correlation_id=cmd.correlation_id)
                )
                return
            # Watch first, so a cancelled report cannot leave an unwatched
            # engine. STARTING still goes out first: the watcher has not run
            # yet, and senders blocked on a full channel are served in order.
            nursery.start_soon(self._watch, shard, name=f"shard {cmd.shard_id}")
            await self._emit(self._status(shard, correlation_id=cmd.correlation_id))

    async def stop_shard(self, shard_id: str, *, correlation_id: str = "") -> None:
        """Stop a shard's processes and report STOPPED; an unknown id is a no-op.

        Strays are found first, then the process groups and strays get
        SIGTERM, :data:`STOP_GRACE_S` seconds of grace polled every 100 ms,
        then SIGKILL; children are reaped. Shielded from cancellation and
        bounded by :data:`STOP_ALL_DEADLINE_S` seconds. A shard already
        FAILED or STOPPED is reported STOPPED again.
        """
        if shard_id not in self._shards:
            return
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
        kept = list(shard.lines)
        return kept[-lines:]

    def running(self) -> list[protocol.RunningShard]:
        """The shards STARTING or READY, as ``Register`` reports them."""
        return [
            protocol.RunningShard(
                shard_id=shard.shard_id,
                replica_id=shard.replica_id,
                model=shard.model,
                state=shard.state,
                port=shard.port,
                pid=shard.procs[0].process.pid if shard.procs else 0,
                fingerprint=shard.fingerprint,
                gpu_indices=shard.gpu_indices,
            )
            for shard in self._shards.values()
            if shard.state in _ACTIVE
        ]

    def state(self, shard_id: str) -> ShardState | None:
        """A shard's state, or ``None`` for a shard this supervisor never ran."""
        shard = self._shards.get(shard_id)
        return None if shard is None else shard.state

    # --- starting ---------------------------------------------------------------

    def _new_shard(self, cmd: protocol.StartShard) -> _Shard:
        host = cmd.bind_addr or "127.0.0.1"
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return _Shard(
            shard_id=cmd.shard_id,
            replica_id=cmd.replica_id,
            model=cmd.profile.name,
            port=cmd.port,
            fingerprint=cmd.fingerprint,
            gpu_indices=cmd.gpu_indices,
            health_url=f"http://{host}:{cmd.port}",
            api_key=cmd.api_key,
            lines=collections.deque(maxlen=self._max_log_lines),
            last_progress=trio.current_time(),
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
        shard.health_url += health_path if health_path.startswith("/") else f"/{health_path}"
        for command in commands:
            try:
                process = await trio.lowlevel.open_process(
                    command.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**_inherited_env(), **command.env},
                )
            except OSError as exc:
                return f"cannot start {command.path}: {exc}"
            log.info("shard %s: started %s as pid %d", shard.shard_id, command.name, process.pid)
            shard.procs.append(_Proc(command=command, process=process))
        return ""

    # --- watching ---------------------------------------------------------------

    async def _watch(self, shard: _Shard) -> None:
        try:
            with shard.scope:
                async with trio.open_nursery() as nursery:
                    for proc in shard.procs:
                        nursery.start_soon(self._pump_output, shard, proc)
                        nursery.start_soon(self._wait_exit, shard, proc)
                    nursery.start_soon(self._probe_until_ready, shard)
        finally:
            shard.done.set()

    async def _pump_output(self, shard: _Shard, proc: _Proc) -> None:
        stream = proc.process.stdout
        assert stream is not None
        pending = b""
        try:
            async with stream:
                while True:
                    data = await stream.receive_some(MAX_LINE_BYTES)
                    if not data:
                        break
                    shard.last_progress = trio.current_time()
                    *complete, pending = (pending + data).split(b"\n")
                    if len(pending) >= MAX_LINE_BYTES:
                        complete.append(pending)
                        pending = b""
                    shard.lines.extend(_decode(line) for line in complete)
        finally:
            if pending:
                shard.lines.append(_decode(pending))
            proc.eof.set()

    async def _wait_exit(self, shard: _Shard, proc: _Proc) -> None:
        code = await proc.process.wait()
        if shard.ending:
            return
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown"
            how = f"killed by signal {-code} ({name})"
        else:
            how = f"exited with code {code}"
        what = "engine" if len(shard.procs) == 1 else f"engine process {proc.command.name!r}"
        # Let the reader catch the last words (a stray may hold the pipe open).
        with trio.move_on_after(OUTPUT_DRAIN_S):
            await proc.eof.wait()
        await self._fail(shard, f"{what} {how}")

    async def _probe_until_ready(self, shard: _Shard) -> None:
        headers = {"Authorization": f"Bearer {shard.api_key}"} if shard.api_key else {}
        async with httpx.AsyncClient(trust_env=False, timeout=PROBE_TIMEOUT_S) as client:
            while not shard.ending:
                if await self._probe(client, shard.health_url, headers):
                    if shard.ending:
                        return
                    shard.state = ShardState.READY
                    log.info("shard %s: ready", shard.shard_id)
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
        groups = frozenset(proc.process.pid for proc in shard.procs)
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
                await proc.process.wait()

    @staticmethod
    async def _wait_gone(
        shard: _Shard, groups: frozenset[int], strays: set[_Pid], deadline_s: float
    ) -> bool:
        with trio.move_on_after(deadline_s):
            while True:
                for proc in shard.procs:
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
    ) -> ShardStatus:
        return ShardStatus(
            shard_id=shard.shard_id,
            replica_id=shard.replica_id,
            state=shard.state,
            port=shard.port,
            reason=reason,
            last_lines=last_lines,
            correlation_id=correlation_id,
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


# --- /proc ------------------------------------------------------------------------


#: Engine key variables never passed down from the agent's own environment:
#: a keyless shard must not inherit some other key.
_KEY_VARIABLES = frozenset({"LLAMA_API_KEY", "VLLM_API_KEY", "FREETOKEN_API_KEY", "STRATA_API_KEY"})


def _inherited_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _KEY_VARIABLES}


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

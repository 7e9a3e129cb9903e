"""The supervisor against a tiny stand-in engine (stdlib ``http.server``)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

from llmgw.agent import probes, supervisor
from llmgw.agent.protocol import EngineProfile, ShardState, ShardStatus, StartShard
from llmgw.agent.supervisor import Supervisor
from llmgw.engines.base import Command, EngineAdapter, ShardLaunch, error_line

KEY = "sekrit-engine-key-4711"
DEADLINE_S = 20

ENGINE = r"""
import argparse, http.server, json, os, signal, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("--loading-seconds", type=float, default=0.0)
p.add_argument("--loading-code", type=int, default=503)
p.add_argument("--lines", type=int, default=3)
p.add_argument("--exit-after", type=float, default=-1.0)
p.add_argument("--exit-code", type=int, default=1)
p.add_argument("--stray", action="store_true")
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--quiet-health", action="store_true")
p.add_argument("--say", action="append", default=[])
p.add_argument("--chatter", action="store_true")
args = p.parse_args()
key = os.environ.get("LLAMA_API_KEY", "")
started = time.monotonic()


def say(text):
    print(text, flush=True)


if args.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

if args.stray and os.fork() == 0:
    os.setsid()
    say(f"stray pid {os.getpid()}")
    while True:
        time.sleep(1)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/health":
            code, doc = 404, {"error": "not found"}
        elif key and self.headers.get("Authorization") != f"Bearer {key}":
            code, doc = 401, {"error": "bad key"}
        elif time.monotonic() - started < args.loading_seconds:
            code, doc = args.loading_code, {"status": "loading"}
        else:
            code, doc = 200, {"status": "ok"}
        if not args.quiet_health:
            say(f"health {code} {doc.get('status', '')}")
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
for i in range(args.lines):
    say(f"line {i}")
for text in args.say:
    say(text)
if args.chatter:
    def chatter():
        step = 0
        while time.monotonic() - started < args.loading_seconds:
            say(f"loading step {step}")
            step += 1
            time.sleep(0.05)
    threading.Thread(target=chatter, daemon=True).start()
say(f"listening on {args.host}:{args.port}")
if args.exit_after >= 0:
    def die():
        time.sleep(args.exit_after)
        say("fatal: giving up")
        os._exit(args.exit_code)
    threading.Thread(target=die, daemon=True).start()
server.serve_forever()
"""


@attrs.frozen
class StandIn:
    """A test-only :class:`EngineAdapter` running the stand-in script."""

    script: Path
    python: str = sys.executable

    @property
    def name(self) -> str:
        return "standin"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str:
        return "/metrics"

    def failure_cause(self, lines: Sequence[str]) -> str:
        return error_line(lines)

    def commands(self, shard: ShardLaunch) -> list[Command]:
        args = (str(self.script), "--host", shard.bind_addr, "--port", str(shard.http_port))
        return [
            Command(
                name="standin",
                path=self.python,
                args=(*args, *shard.args),
                env={"LLAMA_API_KEY": shard.api_key, **shard.env},
            )
        ]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "engine.py"
    path.write_text(ENGINE)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` (as engines do, with
    SO_REUSEADDR, so the probes' TIME_WAIT connections don't count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
        return True


def start_msg(
    *args: str, shard_id: str = "s1", engine: str = "standin", port: int = 0
) -> StartShard:
    return StartShard(
        correlation_id=f"start-{shard_id}",
        shard_id=shard_id,
        replica_id=f"r-{shard_id}",
        profile=EngineProfile(name="tiny", engine=engine, served_model_name="tiny", args=args),
        port=port or free_port(),
        api_key=KEY,
    )


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, pgrp)`` of a process, ``None`` when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[2])


def proc_file(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[1] == pgid and stat[0] != "Z":
                members.append(int(name))
    return members


Events = trio.MemoryReceiveChannel[ShardStatus]


@asynccontextmanager
async def open_supervisor(script: Path, **kwargs: Any) -> AsyncIterator[tuple[Supervisor, Events]]:
    adapters: dict[str, EngineAdapter] = {
        "standin": StandIn(script),
        "missing": StandIn(script, python="/nonexistent/python3"),
    }

    def adapter_for(name: str) -> EngineAdapter:
        return adapters[name]

    send, receive = trio.open_memory_channel[ShardStatus](100)
    kwargs.setdefault("probe_interval_s", 0.05)
    kwargs.setdefault("state_dir", script.parent / "state")
    supervisor = Supervisor(adapter_for=adapter_for, events=send, **kwargs)
    async with send, receive, trio.open_nursery() as nursery:
        await nursery.start(supervisor.serve)
        try:
            yield supervisor, receive
        finally:
            await supervisor.stop_all()
            nursery.cancel_scope.cancel()


async def expect(events: Events, *states: ShardState) -> list[ShardStatus]:
    """The next statuses, which must be ``states`` in order."""
    got = [await events.receive() for _ in states]
    assert [status.state for status in got] == list(states), got
    return got


def pid_of(supervisor: Supervisor) -> int:
    (shard,) = supervisor.running()
    return shard.pid


@pytest.mark.parametrize("loading_code", [503, 200])
async def test_ready_only_after_loading(script: Path, loading_code: int) -> None:
    """STARTING at once; READY only once the health body stops saying
    "loading" (with 503, and with 200 as some engines answer while loading)."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            began = trio.current_time()
            await sup.start_shard(
                start_msg("--loading-seconds", "1", "--loading-code", str(loading_code))
            )
            (starting,) = await expect(events, ShardState.STARTING)
            assert starting.correlation_id == "start-s1"
            assert starting.replica_id == "r-s1"
            assert sup.state("s1") is ShardState.STARTING
            (ready,) = await expect(events, ShardState.READY)
            assert trio.current_time() - began >= 1.0
            assert ready.port == sup.running()[0].port
            assert sup.state("s1") is ShardState.READY
            logs = sup.logs("s1", 500)
            assert f"health {loading_code} loading" in logs
            assert logs.index(f"health {loading_code} loading") < logs.index("health 200 ok")
            assert not any(line.startswith("health 401") for line in logs)


async def test_key_in_environment_not_argv(script: Path) -> None:
    """The engine key reaches the engine through its environment only."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            await sup.start_shard(start_msg())
            await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            assert KEY.encode() not in proc_file(pid, "cmdline")
            environ = proc_file(pid, "environ").split(b"\0")
            assert f"LLAMA_API_KEY={KEY}".encode() in environ
            assert os.getpgid(pid) == pid  # its own process group


async def test_start_twice_is_one_process(script: Path) -> None:
    """StartShard is idempotent by shard id while STARTING or READY."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            msg = start_msg("--loading-seconds", "0.5")
            await sup.start_shard(msg)
            await sup.start_shard(msg)
            await expect(events, ShardState.STARTING, ShardState.READY)
            await sup.start_shard(msg)
            pid = pid_of(sup)
            assert group_members(pid) == [pid]
            with pytest.raises(trio.WouldBlock):
                events.receive_nowait()


async def test_killed_engine_fails_then_starts_again(script: Path) -> None:
    """An engine killed after READY is reported FAILED with the reason and
    its last 50 lines; starting the shard again runs a new process."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            msg = start_msg("--lines", "80")
            await sup.start_shard(msg)
            _, ready = await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            assert ready.pid == pid  # the status carries the engine's pid
            os.kill(pid, signal.SIGKILL)
            (failed,) = await expect(events, ShardState.FAILED)
            assert failed.pid == 0
            assert "killed by signal 9" in failed.reason
            assert len(failed.last_lines) == 50
            assert f"listening on 127.0.0.1:{msg.port}" in failed.last_lines
            assert "line 79" in failed.last_lines
            assert "line 0" not in failed.last_lines
            assert sup.state("s1") is ShardState.FAILED
            assert sup.running() == []

            await sup.start_shard(msg)
            await expect(events, ShardState.STARTING, ShardState.READY)
            assert pid_of(sup) != pid


async def test_exit_before_ready_fails_with_code(script: Path) -> None:
    """An engine that exits while loading is FAILED with its exit code and
    last words."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            await sup.start_shard(
                start_msg("--loading-seconds", "30", "--exit-after", "0.3", "--exit-code", "3")
            )
            await expect(events, ShardState.STARTING)
            (failed,) = await expect(events, ShardState.FAILED)
            # The engine's own error line comes first (its adapter picks it).
            assert failed.reason == "fatal: giving up (engine exited with code 3)"
            assert failed.last_lines[-1] == "fatal: giving up"


async def test_stop_leaves_no_process_and_frees_port(script: Path) -> None:
    """A stop empties the process group, frees the port and reports STOPPED;
    stopping again reports again; an unknown shard is a no-op."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            msg = start_msg()
            await sup.start_shard(msg)
            await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            assert not port_is_free(msg.port)
            await sup.stop_shard("s1", correlation_id="stop-1")
            (stopped,) = await expect(events, ShardState.STOPPED)
            assert stopped.correlation_id == "stop-1"
            assert group_members(pid) == []
            assert _stat(pid) is None  # reaped, not a zombie
            assert port_is_free(msg.port)
            assert sup.state("s1") is ShardState.STOPPED
            assert sup.running() == []
            await sup.stop_shard("s1")
            await expect(events, ShardState.STOPPED)
            await sup.stop_shard("nope")
            with pytest.raises(trio.WouldBlock):
                events.receive_nowait()


async def test_stray_in_its_own_session_is_killed(script: Path) -> None:
    """A child that left the engine's process group (setsid) is found and
    killed by a stop."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            await sup.start_shard(start_msg("--stray"))
            await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            for _ in range(100):
                said = [line for line in sup.logs("s1", 500) if line.startswith("stray pid ")]
                if said:
                    break
                await trio.sleep(0.05)
            (line,) = said
            stray = int(line.split()[-1])
            assert alive(stray)
            assert os.getpgid(stray) != pid
            await sup.stop_shard("s1")
            await expect(events, ShardState.STOPPED)
            assert not alive(stray)
            assert group_members(pid) == []


async def test_engine_ignoring_sigterm_gets_sigkill(script: Path) -> None:
    """An engine that ignores SIGTERM is killed after the grace period."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script, stop_grace_s=0.5) as (sup, events):
            await sup.start_shard(start_msg("--ignore-term"))
            await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            began = trio.current_time()
            await sup.stop_shard("s1")
            assert trio.current_time() - began >= 0.5
            await expect(events, ShardState.STOPPED)
            assert group_members(pid) == []


async def test_startup_timeout_fails_and_stops(script: Path) -> None:
    """An engine silent and not ready for the startup timeout is FAILED and stopped."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script, startup_timeout_s=0.5) as (sup, events):
            await sup.start_shard(start_msg("--loading-seconds", "60", "--quiet-health"))
            await expect(events, ShardState.STARTING)
            pid = pid_of(sup)
            (failed,) = await expect(events, ShardState.FAILED)
            assert "startup timeout" in failed.reason
            assert group_members(pid) == []


async def test_launch_errors_fail_at_once(script: Path) -> None:
    """An unknown engine or a missing binary is FAILED without STARTING."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            await sup.start_shard(start_msg(engine="nope"))
            (failed,) = await expect(events, ShardState.FAILED)
            assert "'nope'" in failed.reason
            assert failed.correlation_id == "start-s1"
            await sup.start_shard(start_msg(engine="missing", shard_id="s2"))
            (failed,) = await expect(events, ShardState.FAILED)
            assert "/nonexistent/python3" in failed.reason
            assert sup.running() == []


async def test_stop_all_when_cancelled(script: Path) -> None:
    """stop_all stops every engine even from a cancelled scope."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, _):
            await sup.start_shard(start_msg(shard_id="a"))
            await sup.start_shard(start_msg(shard_id="b"))
            pids = [shard.pid for shard in sup.running()]
            with trio.CancelScope() as scope:
                try:
                    scope.cancel()
                    await trio.sleep_forever()
                finally:
                    await sup.stop_all()
            assert all(group_members(pid) == [] for pid in pids)
            assert {sup.state("a"), sup.state("b")} == {ShardState.STOPPED}


@pytest.mark.parametrize("owns_engines", [True, False])
async def test_serve_cancelled(script: Path, owns_engines: bool) -> None:
    """When serve() is cancelled, engines are stopped only if the supervisor
    owns them; otherwise they keep running (for adoption)."""
    with trio.fail_after(DEADLINE_S):
        send, events = trio.open_memory_channel[ShardStatus](100)
        sup = Supervisor(
            adapter_for=lambda name: StandIn(script),
            events=send,
            state_dir=script.parent / "state",
            probe_interval_s=0.05,
            owns_engines=owns_engines,
        )
        async with send, events:
            async with trio.open_nursery() as nursery:
                await nursery.start(sup.serve)
                await sup.start_shard(start_msg())
                await expect(events, ShardState.STARTING, ShardState.READY)
                pid = pid_of(sup)
                nursery.cancel_scope.cancel()
            try:
                if owns_engines:
                    assert group_members(pid) == []
                    assert sup.state("s1") is ShardState.STOPPED
                else:
                    assert alive(pid)
                    assert sup.state("s1") is ShardState.READY
            finally:
                await sup.stop_all()  # works without serve(), too
            assert group_members(pid) == []


async def test_logs_ring_buffer(script: Path) -> None:
    """Only the last ``max_log_lines`` lines are kept."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script, max_log_lines=10) as (sup, events):
            await sup.start_shard(start_msg("--lines", "40"))
            await expect(events, ShardState.STARTING, ShardState.READY)
            await sup.stop_shard("s1")
            kept = sup.logs("s1", 100)
            assert len(kept) == 10
            assert "line 39" in kept
            assert "line 29" not in kept
            assert sup.logs("s1", 3) == kept[-3:]
            assert sup.logs("s1", 0) == []
            assert sup.logs("unknown", 10) == []


def test_bad_max_log_lines() -> None:
    """A ring buffer needs room for a line."""
    send, _ = trio.open_memory_channel[ShardStatus](1)
    with pytest.raises(ValueError, match="max_log_lines"):
        Supervisor(
            adapter_for=lambda name: StandIn(Path("x")),
            events=send,
            state_dir=Path("unused"),
            max_log_lines=0,
        )


async def test_output_goes_to_a_log_file_in_the_state_dir(script: Path) -> None:
    """The engine writes to a log file in the state directory (not a pipe the
    agent holds); the shard file names its process, without the key."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            await sup.start_shard(start_msg("--say", "hello from the engine"))
            await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            log_file = sup.state_dir / "logs" / "s1.log"
            assert os.readlink(f"/proc/{pid}/fd/1") == str(log_file)
            assert os.readlink(f"/proc/{pid}/fd/2") == str(log_file)
            assert "hello from the engine" in log_file.read_text()
            assert "hello from the engine" in sup.logs("s1", 500)
            record = (sup.state_dir / "shards" / "s1.json").read_text()
            assert f'"pid": {pid}' in record
            assert KEY not in record
            await sup.stop_shard("s1")
            await expect(events, ShardState.STOPPED)
            assert not (sup.state_dir / "shards" / "s1.json").exists()
            assert not log_file.exists()


async def test_progress_while_starting(script: Path) -> None:
    """While an engine loads and prints, STARTING goes out again with its
    last line as progress, no more often than the progress interval."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script, progress_interval_s=0.3) as (sup, events):
            await sup.start_shard(start_msg("--loading-seconds", "1.5", "--chatter"))
            (first,) = await expect(events, ShardState.STARTING)
            assert first.progress == ""
            progress: list[ShardStatus] = []
            while (status := await events.receive()).state is ShardState.STARTING:
                progress.append(status)
            assert status.state is ShardState.READY
            assert 2 <= len(progress) <= 6, progress
            assert all(p.progress.startswith(("loading step", "health")) for p in progress)


async def test_compute_report_when_ready(script: Path) -> None:
    """READY carries the compute the engine's start-up log shows; without
    any, a shard given no cards runs on "CPU"; RunningShard has it too."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            await sup.start_shard(
                start_msg(
                    "--say",
                    "0.00.1 I llama_model_load_from_file_impl: using device CUDA0 "
                    "(NVIDIA L4) (0000:3b:00.0) - 22000 MiB free",
                    "--say",
                    "load_tensors: offloaded 19/19 layers to GPU",
                )
            )
            _, ready = await expect(events, ShardState.STARTING, ShardState.READY)
            assert ready.compute == "CUDA0 (NVIDIA L4): 19/19 layers"
            assert sup.running()[0].compute == ready.compute
            await sup.start_shard(start_msg(shard_id="s2"))
            _, ready = await expect(events, ShardState.STARTING, ShardState.READY)
            assert ready.compute == "CPU"


async def test_weights_checked_before_start(script: Path, tmp_path: Path) -> None:
    """With model_sha256, the weights file is hashed first (STARTING with
    progress), then the engine starts; a mismatch or a missing file fails
    the shard without starting anything."""
    import hashlib

    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"weights" * 1000)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()

    def with_weights(msg: StartShard, path: Path, sha: str) -> StartShard:
        profile = attrs.evolve(msg.profile, model_path=str(path), model_sha256=sha)
        return attrs.evolve(msg, profile=profile)

    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            await sup.start_shard(with_weights(start_msg(), weights, digest.upper()))
            checking, _, _ = await expect(
                events, ShardState.STARTING, ShardState.STARTING, ShardState.READY
            )
            assert checking.progress == "checking weights model.gguf"
            await sup.start_shard(with_weights(start_msg(shard_id="s2"), weights, "ab" * 32))
            (failed,) = await expect(events, ShardState.FAILED)
            assert "does not match the expected" in failed.reason
            assert sup.state("s2") is ShardState.FAILED
            missing = tmp_path / "nope.gguf"
            await sup.start_shard(with_weights(start_msg(shard_id="s3"), missing, digest))
            (failed,) = await expect(events, ShardState.FAILED)
            assert str(missing) in failed.reason
            assert [shard.shard_id for shard in sup.running()] == ["s1"]
            assert weights.exists()  # a local file is never deleted here


async def test_second_supervisor_on_a_busy_state_dir(script: Path) -> None:
    """Two agents never share a state directory."""
    from llmgw.agent.state import StateDirBusy

    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script):
            send, _ = trio.open_memory_channel[ShardStatus](1)
            other = Supervisor(
                adapter_for=lambda name: StandIn(script),
                events=send,
                state_dir=script.parent / "state",
            )
            with pytest.raises(StateDirBusy):
                await other.serve()


async def test_a_weights_check_gives_way_to_a_stop_or_a_cancel(
    script: Path, tmp_path: Path
) -> None:
    """A stop during the weights check abandons it (STOPPED, nothing
    started); a start cancelled during the check leaves nothing behind, so
    the next StartShard starts afresh."""
    weights = tmp_path / "big.gguf"
    with weights.open("wb") as f:
        f.truncate(8 * 1024**3)  # sparse: hashing it takes seconds

    msg = start_msg()
    profile = attrs.evolve(msg.profile, model_path=str(weights), model_sha256="00" * 32)
    msg = attrs.evolve(msg, profile=profile)
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(script) as (sup, events):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sup.start_shard, msg)
                (checking,) = await expect(events, ShardState.STARTING)
                assert checking.progress.startswith("checking weights")
                await sup.stop_shard("s1")
                await expect(events, ShardState.STOPPED)
            assert sup.running() == []

            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sup.start_shard, attrs.evolve(msg, shard_id="s2"))
                    await expect(events, ShardState.STARTING)
                    scope.cancel()
            assert sup.state("s2") is None
            assert sup.running() == []


# --- liveness of READY engines (docs/catalog.md, Replica states) ------------------


async def change(events: trio.MemoryReceiveChannel[ShardStatus], state: ShardState) -> ShardStatus:
    """The next status that is not a progress report; it must be ``state``.
    (A silent engine is STARTING: its output goes out as progress, with the
    reason.)"""
    while True:
        status = await events.receive()
        if not status.progress:
            assert status.state is state, status
            return status
        assert status.reason.startswith("not answering its health check"), status


async def test_a_stopped_engine_is_not_ready_then_ready_again(script: Path) -> None:
    """SIGSTOP: STARTING with "not answering its health check"; SIGCONT:
    READY again, the same process, no reason."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(
            script, liveness_interval_s=0.1, silent_after_s=0.5, silent_restart_s=60
        ) as (sup, events):
            await sup.start_shard(start_msg())
            await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            os.kill(pid, signal.SIGSTOP)
            try:
                (silent,) = await expect(events, ShardState.STARTING)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert silent.reason.startswith("not answering its health check for ")
            assert sup.state("s1") is ShardState.STARTING
            back = await change(events, ShardState.READY)
            assert back.reason == ""
            assert pid_of(sup) == pid


async def test_an_engine_silent_too_long_is_failed_and_stopped(script: Path) -> None:
    """Silent past ``silent_restart_s``: FAILED with the reason, the process
    stopped (SIGKILL after the grace: a stopped process ignores SIGTERM)."""
    with trio.fail_after(DEADLINE_S):
        async with open_supervisor(
            script,
            liveness_interval_s=0.1,
            silent_after_s=0.3,
            silent_restart_s=1.0,
            stop_grace_s=0.5,
        ) as (sup, events):
            await sup.start_shard(start_msg())
            await expect(events, ShardState.STARTING, ShardState.READY)
            pid = pid_of(sup)
            os.kill(pid, signal.SIGSTOP)
            await expect(events, ShardState.STARTING)
            failed = await change(events, ShardState.FAILED)
            assert "not answering its health check" in failed.reason
            assert "restarted after 1 s" in failed.reason
            assert not alive(pid)  # stopped before FAILED was reported


async def test_default_thresholds_on_a_fake_clock(
    script: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default constants: not ready after SILENT_AFTER_S of
    silence (and not before), READY on the next answer, FAILED after
    SILENT_RESTART_S. The health answers are faked; the clock jumps."""
    answering = True
    seen: list[tuple[float, bool]] = []

    async def fake_is_ready(
        client: httpx.AsyncClient,
        url: str,
        headers: dict[str, str],
        *,
        timeout_s: float = probes.PROBE_TIMEOUT_S,
    ) -> bool:
        if answering:
            await trio.sleep(0.01)
        else:
            await trio.sleep(timeout_s)  # a hung engine: the probe's deadline passes
        seen.append((trio.current_time(), answering))
        return answering

    monkeypatch.setattr(probes, "is_ready", fake_is_ready)
    async with open_supervisor(script, stop_grace_s=1.0) as (sup, events):
        await sup.start_shard(start_msg())
        await expect(events, ShardState.STARTING, ShardState.READY)
        await trio.sleep(10)  # READY and answering: nothing to say
        with pytest.raises(trio.WouldBlock):
            events.receive_nowait()
        answering = False
        went_silent = trio.current_time()
        (silent,) = await expect(events, ShardState.STARTING)
        waited_s = trio.current_time() - went_silent
        # The fake clock's times are floats: 6.0 may come out 5.999999999999998.
        assert waited_s >= supervisor.SILENT_AFTER_S - 1e-6
        assert waited_s <= supervisor.SILENT_AFTER_S + supervisor.LIVENESS_INTERVAL_S + 2 * (
            probes.LIVENESS_TIMEOUT_S
        )
        assert silent.reason.startswith("not answering its health check for ")
        answering = True
        back = await change(events, ShardState.READY)
        assert back.reason == ""
        answering = False
        went_silent = trio.current_time()
        await expect(events, ShardState.STARTING)
        failed = await change(events, ShardState.FAILED)
        assert trio.current_time() - went_silent >= supervisor.SILENT_RESTART_S - 1e-6
        assert f"restarted after {supervisor.SILENT_RESTART_S:g} s" in failed.reason

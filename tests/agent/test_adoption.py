"""Adoption: engines outlive their agent and the next one takes them over.

Real sim engines, started through the supervisor (and through the whole
agent against a stand-in control plane); the first supervisor or agent is
dropped without stopping them, a second one on the same state directory
finds them. Engines left over by a failing test are killed by the
``engines`` fixture.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio_websocket

from llmgw.agent import link, main, protocol
from llmgw.agent.main import AgentConfig, serve_agent
from llmgw.agent.protocol import (
    EngineProfile,
    RunningShard,
    ShardState,
    ShardStatus,
    StartShard,
)
from llmgw.agent.supervisor import Supervisor
from llmgw.engines.base import EngineAdapter
from llmgw.engines.registry import get_adapter

KEY = "adoption-test-engine-key"
DEADLINE_S = 30
TOKEN = "agent-token-for-tests"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sim_start(shard_id: str = "shard-a", port: int = 0) -> StartShard:
    return StartShard(
        correlation_id=f"start-{shard_id}",
        shard_id=shard_id,
        replica_id=f"rep-{shard_id}",
        profile=EngineProfile(name="m", engine="sim", served_model_name="m"),
        port=port or free_port(),
        api_key=KEY,
        fingerprint="fp-123",
    )


def alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def group_alive(pgid: int) -> bool:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@pytest.fixture
def engines() -> Iterator[list[int]]:
    """Process groups of engines a test started; killed (and reaped, when
    they are children of this process) at the end, whatever happened."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pgid, 0)
        except ChildProcessError:
            pass


def sim_adapter(name: str) -> EngineAdapter:
    return get_adapter(name)


Events = trio.MemoryReceiveChannel[ShardStatus]


@asynccontextmanager
async def supervisor(state_dir: Path) -> AsyncIterator[tuple[Supervisor, Events]]:
    """A supervisor that leaves its engines running when it goes (as a
    standalone agent does)."""
    send, receive = trio.open_memory_channel[ShardStatus](100)
    sup = Supervisor(
        adapter_for=sim_adapter, events=send, state_dir=state_dir, probe_interval_s=0.1
    )
    async with send, receive, trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        yield sup, receive
        nursery.cancel_scope.cancel()


async def expect(events: Events, *states: ShardState) -> list[ShardStatus]:
    got = [await events.receive() for _ in states]
    assert [status.state for status in got] == list(states), got
    return got


async def start_and_leave(state_dir: Path, engines: list[int], msg: StartShard) -> int:
    """Start ``msg`` in a first supervisor, wait for READY, drop the
    supervisor; the engine's pid."""
    async with supervisor(state_dir) as (sup, events):
        await sup.start_shard(msg)
        (shard,) = sup.running()
        engines.append(shard.pid)
        _, ready = await expect(events, ShardState.STARTING, ShardState.READY)
        assert ready.compute == "CPU (sim)"
    assert alive(shard.pid)
    return shard.pid


async def test_a_second_supervisor_adopts_the_running_engine(
    tmp_path: Path, engines: list[int]
) -> None:
    """The next supervisor on the state directory reports the engine READY
    with the same pid, fingerprint and compute, without starting another;
    serves its logs; a StartShard for it changes nothing; StopShard stops
    it by process group and forgets it."""
    state_dir = tmp_path / "state"
    msg = sim_start()
    with trio.fail_after(DEADLINE_S):
        pid = await start_and_leave(state_dir, engines, msg)
        async with supervisor(state_dir) as (sup, events):
            assert sup.running() == [
                RunningShard(
                    shard_id="shard-a",
                    replica_id="rep-shard-a",
                    model="m",
                    state=ShardState.READY,
                    port=msg.port,
                    pid=pid,
                    fingerprint="fp-123",
                    gpu_indices=(),
                    compute="CPU (sim)",
                )
            ]
            assert any("sim engine listening" in line for line in sup.logs("shard-a", 100))
            async with httpx.AsyncClient(trust_env=False) as client:
                models = await client.get(
                    f"http://127.0.0.1:{msg.port}/v1/models",
                    headers={"Authorization": f"Bearer {KEY}"},
                )
            assert models.status_code == 200
            await sup.start_shard(msg)
            assert [shard.pid for shard in sup.running()] == [pid]
            with pytest.raises(trio.WouldBlock):
                events.receive_nowait()
            await sup.stop_shard("shard-a", correlation_id="stop-1")
            (stopped,) = await expect(events, ShardState.STOPPED)
            assert stopped.correlation_id == "stop-1"
            assert not group_alive(pid)
            assert sup.running() == []
            assert list((state_dir / "shards").iterdir()) == []


async def test_an_adopted_engine_that_dies_is_reported_failed(
    tmp_path: Path, engines: list[int]
) -> None:
    """The exit of an adopted engine (not a child: no exit code) is noticed
    and reported FAILED with its last lines; its shard file goes."""
    state_dir = tmp_path / "state"
    with trio.fail_after(DEADLINE_S):
        pid = await start_and_leave(state_dir, engines, sim_start())
        async with supervisor(state_dir) as (sup, events):
            assert sup.state("shard-a") is ShardState.READY
            os.kill(pid, signal.SIGKILL)
            (failed,) = await expect(events, ShardState.FAILED)
            assert "adopted" in failed.reason
            assert "exit code unknown" in failed.reason
            assert any("sim engine listening" in line for line in failed.last_lines)
            assert sup.running() == []
            assert list((state_dir / "shards").iterdir()) == []


async def test_an_engine_that_died_while_no_agent_watched_is_not_adopted(
    tmp_path: Path, engines: list[int]
) -> None:
    """A shard whose engine is gone when the next supervisor starts is not
    reported running (the control plane counts it stopped) and its file goes."""
    state_dir = tmp_path / "state"
    with trio.fail_after(DEADLINE_S):
        pid = await start_and_leave(state_dir, engines, sim_start())
        os.kill(pid, signal.SIGKILL)
        await trio.to_thread.run_sync(os.waitpid, pid, 0)
        async with supervisor(state_dir) as (sup, events):
            assert sup.running() == []
            assert sup.state("shard-a") is ShardState.FAILED
            assert list((state_dir / "shards").iterdir()) == []
            with pytest.raises(trio.WouldBlock):
                events.receive_nowait()


# --- the whole agent, against a stand-in control plane ------------------------------


@attrs.define
class FakeHub:
    """A control plane's agent hub that records what agents send."""

    frames: trio.MemorySendChannel[protocol.Message]
    received: trio.MemoryReceiveChannel[protocol.Message]
    ws: trio_websocket.WebSocketConnection | None = None

    async def handle(self, request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        self.ws = ws
        try:
            while True:
                message = protocol.decode(await ws.get_message())
                if isinstance(message, protocol.Register):
                    await ws.send_message(
                        protocol.encode(protocol.Registered(node_id=message.node_id))
                    )
                await self.frames.send(message)
        except trio_websocket.ConnectionClosed:
            pass

    async def send(self, message: protocol.Message) -> None:
        assert self.ws is not None
        await self.ws.send_message(protocol.encode(message))

    async def next(self, kind: type[Any], *, where: Any = lambda m: True) -> Any:
        """The next message of type ``kind`` that satisfies ``where``."""
        async for message in self.received:
            if isinstance(message, kind) and where(message):
                return message
        raise AssertionError("hub closed")


@attrs.frozen
class FakeBandwidth:
    core_gbps: float
    machine_gbps: float


async def test_the_agent_registers_adopted_shards_and_reports_bandwidth(
    tmp_path: Path, engines: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second agent process registers the engine the first one started as
    running (READY, same pid, compute) and stops it on StopShard; measured
    bandwidth goes in every heartbeat and the next Register."""
    monkeypatch.setattr(link, "HEARTBEAT_INTERVAL_S", 0.2)
    monkeypatch.setattr(
        main,
        "_bandwidth_measurer",
        lambda: (
            lambda **_: FakeBandwidth(core_gbps=9.5, machine_gbps=21.25),
            RuntimeError,
            KeyError,
        ),
    )
    send, receive = trio.open_memory_channel[protocol.Message](1000)
    hub = FakeHub(send, receive)
    msg = sim_start()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as outer:
            server = await outer.start(
                trio_websocket.serve_websocket, hub.handle, "127.0.0.1", 0, None
            )
            config = AgentConfig(
                server_url=f"ws://127.0.0.1:{server.port}/agent",
                token=TOKEN,
                node_id="node-x",
                state_dir=tmp_path / "state",
                bandwidth_first_delay_s=(0.0, 0.0),
                # Whatever else runs on this machine, the node counts as idle.
                bandwidth_busy_cpus=1e6,
            )

            async with trio.open_nursery() as first:
                sup = await first.start(serve_agent, config)
                register = await hub.next(protocol.Register)
                assert register.running_shards == ()
                await hub.send(msg)
                await hub.next(ShardStatus, where=lambda s: s.state is ShardState.STARTING)
                engines.append(sup.running()[0].pid)
                ready = await hub.next(ShardStatus, where=lambda s: s.state is ShardState.READY)
                assert ready.compute == "CPU (sim)"
                beat = await hub.next(protocol.Heartbeat, where=lambda b: b.core_bandwidth_gbps)
                assert (beat.memory_bandwidth_gbps, beat.core_bandwidth_gbps) == (21.25, 9.5)
                assert beat.gpus == ()
                first.cancel_scope.cancel()

            async with trio.open_nursery() as second:
                await second.start(serve_agent, config)
                register = await hub.next(protocol.Register)
                (running,) = register.running_shards
                assert running.state is ShardState.READY
                assert running.pid == engines[0]
                assert alive(running.pid)
                assert (running.port, running.fingerprint, running.compute) == (
                    msg.port,
                    "fp-123",
                    "CPU (sim)",
                )
                await hub.next(protocol.Heartbeat, where=lambda b: b.core_bandwidth_gbps)
                assert hub.ws is not None
                await hub.ws.aclose()  # the link drops; the agent registers again
                register = await hub.next(protocol.Register)
                assert register.hardware.memory_bandwidth_gbps == 21.25
                assert register.hardware.core_bandwidth_gbps == 9.5
                assert [s.pid for s in register.running_shards] == [running.pid]
                await hub.send(protocol.StopShard(correlation_id="stop", shard_id="shard-a"))
                await hub.next(ShardStatus, where=lambda s: s.state is ShardState.STOPPED)
                assert not group_alive(running.pid)
                second.cancel_scope.cancel()
            outer.cancel_scope.cancel()

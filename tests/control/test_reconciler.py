"""The reconciler loop under trio's mock clock, against fake nodes that
record what they are sent and answer with ``ShardStatus``."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing

from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState
from llmgw.control.cluster import Cluster, replica_fingerprint
from llmgw.control.placement import explain
from llmgw.control.planning import replica_cores
from llmgw.control.reconciler import restart_delay_s, serve_reconciler, slot_profiles
from llmgw.settings import (
    NodesSettings,
    OnDemandSettings,
    ServerSettings,
    ServingSettings,
)
from llmgw.store import ModelRecord, Profile

PORTS = (20000, 20009)
MODEL = "m"


class FakeStore:
    """The catalog, as the reconciler reads it."""

    def __init__(self, *models: ModelRecord) -> None:
        self.models = {m.name: m for m in models}

    async def list_models(self) -> list[ModelRecord]:
        return list(self.models.values())

    def put(self, cluster: Cluster, model: ModelRecord) -> None:
        self.models[model.name] = model
        cluster.poke()


@attrs.define
class Event:
    at: float
    kind: str  # "start" or "stop"
    shard_id: str
    port: int = 0


class FakeNode:
    """An agent: records commands; by default a started shard reports
    STARTING at once and READY ``ready_after_s`` later, a stopped one
    STOPPED 0.1 s later."""

    def __init__(
        self,
        cluster: Cluster,
        nursery: trio.Nursery,
        node_id: str,
        *,
        ready_after_s: float | None = 2.0,
        cpus: int = 8,
        memory_mb: int = 65536,
        gpus: tuple[protocol.Gpu, ...] = (),
        compute: str = "",
    ) -> None:
        self.cluster = cluster
        self.nursery = nursery
        self.node_id = node_id
        self.ready_after_s = ready_after_s
        self.hardware = protocol.Hardware(cpu_count=cpus, memory_total_mb=memory_mb, gpus=gpus)
        self.compute = compute
        self.sent: list[protocol.Message] = []
        self.events: list[Event] = []
        self.running: dict[str, protocol.StartShard] = {}
        #: Answer each StartShard with FAILED and these last lines instead.
        self.fail_with: tuple[str, ...] | None = None
        #: Ports another process holds: a start there fails.
        self.busy: set[int] = set()

    def register(self, running: Iterable[protocol.RunningShard] = ()) -> None:
        self.cluster.node_registered(
            protocol.Register(
                node_id=self.node_id,
                address="10.0.0.1",
                agent_version="test",
                hardware=self.hardware,
                engines=("llamacpp", "vllm"),
                running_shards=tuple(running),
            ),
            self.send,
        )

    async def send(self, message: protocol.Message) -> None:
        self.sent.append(message)
        now = trio.current_time()
        if isinstance(message, protocol.StartShard):
            self.events.append(Event(now, "start", message.shard_id, message.port))
            self.nursery.start_soon(self._run, message)
        elif isinstance(message, protocol.StopShard):
            self.events.append(Event(now, "stop", message.shard_id))
            self.running.pop(message.shard_id, None)
            self.nursery.start_soon(self._stopped, message.shard_id)

    def report(self, shard_id: str, state: ShardState, **fields: object) -> None:
        self.cluster.shard_status(
            protocol.ShardStatus(shard_id=shard_id, replica_id=shard_id, state=state, **fields),  # type: ignore[arg-type]
            self.node_id,
        )

    async def _run(self, start: protocol.StartShard) -> None:
        await trio.lowlevel.checkpoint()
        if start.port in self.busy:
            self.report(
                start.shard_id,
                ShardState.FAILED,
                reason=f"port {start.port} is in use by another process",
            )
            return
        if self.fail_with is not None:
            self.report(
                start.shard_id,
                ShardState.FAILED,
                reason="error: out of memory (exited with code 1)",  # as an agent words it
                last_lines=self.fail_with,
            )
            return
        self.running[start.shard_id] = start
        self.report(start.shard_id, ShardState.STARTING)
        if self.ready_after_s is None:
            return
        await trio.sleep(self.ready_after_s)
        if self.running.get(start.shard_id) is start:
            self.report(start.shard_id, ShardState.READY, compute=self.compute)

    async def _stopped(self, shard_id: str) -> None:
        await trio.sleep(0.1)
        self.report(shard_id, ShardState.STOPPED)

    def starts(self) -> list[str]:
        return [e.shard_id for e in self.events if e.kind == "start"]

    def stops(self) -> list[str]:
        return [e.shard_id for e in self.events if e.kind == "stop"]


async def _until(predicate: Callable[[], bool], within_s: float = 60.0) -> float:
    """Poll until ``predicate()``; the (mock) time it became true."""
    with trio.fail_after(within_s):
        # Polled: the fakes' records change without waking anyone.
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.05)
    return trio.current_time()


def _ready(cluster: Cluster, model: str = MODEL) -> list[str]:
    return sorted(ep.replica_id for ep in cluster.ready_endpoints(model))


def _model(replicas: int = 1, **fields: Any) -> ModelRecord:
    return ModelRecord.simple(MODEL, "sim", replicas=replicas, **fields)


def _cluster(**settings: object) -> Cluster:
    cluster = Cluster(clock=trio.current_time)
    cluster.apply_settings(ServerSettings(**settings))  # type: ignore[arg-type]
    return cluster


@attrs.define
class Rig:
    """A cluster, its catalog and a nursery for the fake nodes and the reconciler."""

    cluster: Cluster
    store: FakeStore
    nursery: trio.Nursery

    def node(
        self, node_id: str = "a", running: Iterable[protocol.RunningShard] = (), **options: Any
    ) -> FakeNode:
        """A :class:`FakeNode` (``options`` its keywords), registered with ``running``."""
        node = FakeNode(self.cluster, self.nursery, node_id, **options)
        node.register(running)
        return node

    def put(self, model: ModelRecord) -> None:
        """Change the catalog (and wake the reconciler)."""
        self.store.put(self.cluster, model)

    async def start(self) -> None:
        """Start the reconciler."""
        await self.nursery.start(serve_reconciler, self.store, self.cluster, PORTS)


@asynccontextmanager
async def _rig(cluster: Cluster, *models: ModelRecord) -> AsyncIterator[Rig]:
    """A :class:`Rig` over ``cluster`` and a catalog of ``models``; all it
    runs is cancelled when the block ends."""
    async with trio.open_nursery() as nursery:
        yield Rig(cluster, FakeStore(*models), nursery)
        nursery.cancel_scope.cancel()


async def test_scaling_1_3_1_leaves_what_was_asked_and_frees_the_ports(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    async with _rig(cluster, _model(1)) as rig:
        node = rig.node("a")
        await rig.start()
        await _until(lambda: _ready(cluster) == ["m-0"])
        rig.put(_model(3))
        await _until(lambda: _ready(cluster) == ["m-0", "m-1", "m-2"])
        ports = {s.port for s in cluster.shards.values()}
        assert ports == {20000, 20001, 20002}
        rig.put(_model(1))
        await _until(lambda: list(cluster.shards) == ["m-0"])
        assert _ready(cluster) == ["m-0"]
        assert node.stops() == ["m-2", "m-1"]  # the highest first
        assert set(node.running) == {"m-0"}
        # The freed ports are offered again.
        rig.put(_model(3))
        await _until(lambda: len(_ready(cluster)) == 3)
        assert {s.port for s in cluster.shards.values()} == ports
        assert node.starts() == ["m-0", "m-1", "m-2", "m-1", "m-2"]


async def test_a_changed_profile_rolls_one_replica_at_a_time_successor_ready_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    fewest_ready: list[int] = []

    async def watch() -> None:
        while True:
            changed = cluster.changed
            fewest_ready.append(len(cluster.ready_endpoints(MODEL)))
            await changed.wait()

    async with _rig(cluster, _model(2)) as rig:
        node = rig.node("a", ready_after_s=5.0)
        await rig.start()
        await _until(lambda: _ready(cluster) == ["m-0", "m-1"])
        rig.nursery.start_soon(watch)
        changed = _model(2, args=("--tokens-per-second", "50"))
        rig.put(changed)
        await _until(lambda: _ready(cluster) == ["m-0.g2", "m-1.g2"] and len(cluster.shards) == 2)
        assert min(fewest_ready) == 2
        at = {(e.kind, e.shard_id): e.at for e in node.events}
        # Each successor is READY (5 s after its start) before its predecessor stops …
        assert at[("stop", "m-0")] >= at[("start", "m-0.g2")] + 5.0
        assert at[("stop", "m-1")] >= at[("start", "m-1.g2")] + 5.0
        # … and the second roll starts only once the first successor is READY.
        assert at[("start", "m-1.g2")] >= at[("start", "m-0.g2")] + 5.0
        fingerprint = replica_fingerprint(changed, changed.profiles[0])
        assert {s.fingerprint for s in cluster.shards.values()} == {fingerprint}
        starts = [m for m in node.sent if isinstance(m, protocol.StartShard)]
        assert starts[-1].fingerprint == fingerprint
        assert starts[-1].profile.args == ("--tokens-per-second", "50")
        # Engines listen on the address the node is reached by, not on every interface.
        assert {m.bind_addr for m in starts} == {"10.0.0.1"}


async def test_after_a_control_plane_restart_running_replicas_are_adopted_not_restarted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = _model(2)
    fingerprint = replica_fingerprint(model, model.profiles[0])
    running = [
        protocol.RunningShard(
            shard_id=f"m-{i}",
            replica_id=f"m-{i}",
            model=MODEL,
            state=ShardState.READY,
            port=20005 + i,
            fingerprint=fingerprint,
            compute="CPU",
        )
        for i in range(2)
    ]
    cluster = _cluster()  # a fresh control plane
    async with _rig(cluster, model) as rig:
        await rig.start()
        await trio.sleep(3)  # the catalog is read; no node yet
        node = rig.node("a", running)
        await trio.sleep(30)
        assert node.sent == []
        assert _ready(cluster) == ["m-0", "m-1"]
        shard = cluster.shards["m-1"]
        assert (shard.port, shard.compute, shard.adopted, shard.stale) == (
            20006,
            "CPU",
            True,
            False,
        )
        assert shard.profile == "default"
        # A port an adopted replica holds is not given to a new one.
        rig.put(_model(3))
        await _until(lambda: len(_ready(cluster)) == 3)
        assert cluster.shards["m-2"].port == 20000


async def test_an_adopted_replica_with_another_fingerprint_is_stale_and_rolled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = _model(1)
    cluster = _cluster()
    cluster.replace_catalog({MODEL: model})
    async with _rig(cluster, model) as rig:
        node = rig.node(
            "a",
            [
                protocol.RunningShard(
                    shard_id="m-0",
                    replica_id="m-0",
                    model=MODEL,
                    state=ShardState.READY,
                    port=20000,
                    fingerprint="0123456789abcdef",
                )
            ],
        )
        assert cluster.shards["m-0"].stale
        await rig.start()
        await _until(lambda: list(cluster.shards) == ["m-0.g2"])
        assert node.starts() == ["m-0.g2"]
        assert node.stops() == ["m-0"]
        assert _ready(cluster) == ["m-0.g2"]


async def test_an_on_demand_model_loads_when_asked_and_is_evicted_when_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster(on_demand=OnDemandSettings(evict_after_idle=120, min_lifetime=30))
    async with _rig(cluster, _model(1, on_demand=True)) as rig:
        node = rig.node("a", ready_after_s=10.0)
        await rig.start()
        await trio.sleep(60)
        assert node.sent == []
        asked = trio.current_time()
        with trio.fail_after(cluster.settings.on_demand.load_wait):
            await cluster.wait_ready(MODEL)
        assert trio.current_time() - asked == pytest.approx(10.0, abs=0.5)
        ready_at = cluster.shards["m-0"].ready_at
        assert ready_at is not None
        # In use for a while: kept.
        for _ in range(5):
            await trio.sleep(60)
            cluster.touch(MODEL)
        last_use = trio.current_time()
        assert node.stops() == []
        stopped = await _until(lambda: node.stops() == ["m-0"], within_s=400)
        assert stopped - last_use == pytest.approx(120.0, abs=1.5)
        await _until(lambda: not cluster.shards)
        assert _ready(cluster) == []
        # Asked again: loaded again.
        with trio.fail_after(30):
            await cluster.wait_ready(MODEL)
        assert node.starts() == ["m-0", "m-0"]


async def test_a_fresh_on_demand_replica_lives_at_least_min_lifetime(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster(on_demand=OnDemandSettings(evict_after_idle=10, min_lifetime=300))
    async with _rig(cluster, _model(1, on_demand=True)) as rig:
        node = rig.node("a")
        await rig.start()
        with trio.fail_after(30):
            await cluster.wait_ready(MODEL)
        ready_at = cluster.shards["m-0"].ready_at
        assert ready_at is not None
        stopped = await _until(lambda: node.stops() == ["m-0"], within_s=400)
        assert stopped - ready_at == pytest.approx(300.0, abs=1.5)


async def test_a_start_without_progress_for_the_timeout_is_stopped_and_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = ModelRecord(name=MODEL, profiles=(Profile(engine="sim", startup_timeout_s=30.0),))
    cluster = _cluster()
    async with _rig(cluster, model) as rig:
        node = rig.node("a", ready_after_s=None)
        await rig.start()
        started = await _until(lambda: node.starts() == ["m-0"])
        await trio.sleep(20)
        node.report("m-0", ShardState.STARTING, progress="downloading 10 of 20 GB")
        assert cluster.shards["m-0"].progress == "downloading 10 of 20 GB"
        failed = await _until(lambda: cluster.shards["m-0"].state is ShardState.FAILED)
        assert failed - (started + 20) == pytest.approx(30.0, abs=1.5)
        assert cluster.shards["m-0"].reason == "no progress for 30 s"
        assert node.stops() == ["m-0"]
        # The STOPPED that follows keeps it FAILED until the restart is sent.
        await trio.sleep(0.5)
        assert cluster.shards["m-0"].state is ShardState.FAILED
        restarted = await _until(lambda: node.starts() == ["m-0", "m-0"])
        assert restarted - failed == pytest.approx(1.0, abs=0.2)
        assert cluster.shards["m-0"].restarts == 1


async def test_a_crash_loop_backs_off_1_2_4_8_s_and_never_shows_starting_between(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    states: list[ShardState] = []

    async def watch() -> None:
        # Samples off the whole seconds the restarts fall on: a restart
        # shows STARTING for as long as the attempt runs, here no time.
        await trio.sleep(0.05)
        while True:
            shard = cluster.shards.get("m-0")
            if shard is not None:
                states.append(shard.state)
            await trio.sleep(0.1)

    async with _rig(cluster, _model(1)) as rig:
        node = rig.node("a")
        node.fail_with = ("loading model", "error: out of memory", "")
        rig.nursery.start_soon(watch)
        await rig.start()
        await _until(lambda: len(node.starts()) == 6, within_s=120)
        times = [e.at for e in node.events if e.kind == "start"]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert gaps == pytest.approx([1.0, 2.0, 4.0, 8.0, 16.0], abs=0.05)
        shard = cluster.shards["m-0"]
        assert shard.restarts == 5
        assert shard.state is ShardState.FAILED
        assert shard.reason == "error: out of memory (exited with code 1)"
        # Sampled every 0.1 s through the back-off: always FAILED.
        assert len(states) > 100
        assert set(states) == {ShardState.FAILED}
        assert [restart_delay_s(n) for n in (1, 2, 7, 8)] == [1.0, 2.0, 60.0, 60.0]


async def test_a_draining_node_has_its_replica_moved_successor_ready_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    async with _rig(cluster, _model(1)) as rig:
        a = rig.node("a")
        await rig.start()
        await _until(lambda: _ready(cluster) == ["m-0"])
        b = rig.node("b")
        cluster.apply_settings(ServerSettings(nodes=NodesSettings(draining=("a",))))
        cluster.poke()
        await _until(lambda: list(cluster.shards) == ["m-0.g2"])
        assert b.starts() == ["m-0.g2"]
        assert a.stops() == ["m-0"]
        assert a.events[-1].at >= b.events[0].at + 2.0  # b's replica READY first
        assert cluster.shards["m-0.g2"].node_id == "b"
        assert _ready(cluster) == ["m-0.g2"]


async def test_a_draining_replica_with_nowhere_to_go_serves_until_the_grace_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    async with _rig(cluster, _model(1)) as rig:
        a = rig.node("a")
        await rig.start()
        await _until(lambda: _ready(cluster) == ["m-0"])
        cluster.apply_settings(ServerSettings(nodes=NodesSettings(draining=("a",), drain_grace=60)))
        cluster.poke()
        began = trio.current_time()
        await trio.sleep(30)
        assert _ready(cluster) == ["m-0"]
        assert "fits on no node" in cluster.waiting["m-0.g2"]
        assert "a: draining" in cluster.waiting["m-0.g2"]
        stopped = await _until(lambda: a.stops() == ["m-0"])
        assert stopped - began == pytest.approx(60.0, abs=1.5)
        assert a.starts() == ["m-0"]


async def test_a_cordoned_node_gets_no_new_replicas(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster(nodes=NodesSettings(cordoned=("a",)))
    async with _rig(cluster, _model(2)) as rig:
        a = rig.node("a")
        rig.node("b")
        await rig.start()
        await _until(lambda: len(_ready(cluster)) == 2)
        assert a.sent == []
        assert {s.node_id for s in cluster.shards.values()} == {"b"}


async def test_serving_stopped_takes_everything_to_zero_and_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    other = ModelRecord.simple("other", "sim", replicas=1)
    async with _rig(cluster, _model(2), other) as rig:
        node = rig.node("a")
        await rig.start()
        await _until(lambda: len(_ready(cluster)) == 2 and _ready(cluster, "other") == ["other-0"])
        cluster.apply_settings(ServerSettings(serving=ServingSettings(stopped=True)))
        cluster.poke()
        await _until(lambda: not cluster.shards)
        assert not cluster.any_ready()
        assert node.running == {}
        cluster.apply_settings(ServerSettings())
        cluster.poke()
        await _until(lambda: len(_ready(cluster)) == 2 and _ready(cluster, "other") == ["other-0"])


async def test_a_stopped_or_external_model_has_no_replicas(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    async with _rig(cluster, _model(2, stopped=True)) as rig:
        node = rig.node("a")
        await rig.start()
        await trio.sleep(10)
        assert node.sent == []
        rig.put(_model(2))
        await _until(lambda: len(_ready(cluster)) == 2)
        rig.put(_model(2, stopped=True))
        await _until(lambda: not cluster.shards)


async def test_a_replica_placed_on_a_gpu_whose_engine_runs_on_cpu_is_stopped_and_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = ModelRecord(name=MODEL, profiles=(Profile(engine="vllm", gpu_class="h100-80g"),))
    gpu = protocol.Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_mb=81559)
    cluster = _cluster()
    async with _rig(cluster, model) as rig:
        node = rig.node("a", gpus=(gpu,), compute="CPU")
        await rig.start()
        await _until(lambda: node.stops() == ["m-0"])
        start = node.sent[0]
        assert isinstance(start, protocol.StartShard)
        assert start.gpu_indices == (0,)
        shard = cluster.shards["m-0"]
        assert shard.state is ShardState.FAILED
        assert shard.reason == (
            "engine found no usable GPU although placed on GPU(s) 0 (engine reports: CPU)"
        )
        assert _ready(cluster) == []


async def test_an_engine_port_held_by_another_process_is_left_for_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    async with _rig(cluster, _model(1)) as rig:
        node = rig.node("a")
        node.busy.add(20000)
        await rig.start()
        await _until(lambda: _ready(cluster) == ["m-0"])
        assert [e.port for e in node.events] == [20000, 20001]
        assert cluster.nodes["a"].busy_ports == {20000}
        # Another replica does not get the busy port either.
        rig.put(_model(2))
        await _until(lambda: len(_ready(cluster)) == 2)
        assert cluster.shards["m-1"].port == 20002


async def test_the_replicas_of_a_lost_node_are_placed_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    async with _rig(cluster, _model(1)) as rig:
        rig.node("a")
        await rig.start()
        await _until(lambda: _ready(cluster) == ["m-0"])
        b = rig.node("b")
        cluster.node_disconnected("a")
        await trio.sleep(20)
        assert b.sent == []  # a link blip is not a loss
        await _until(lambda: _ready(cluster) == ["m-0"] and cluster.shards["m-0"].node_id == "b")


def test_slots_go_to_profiles_by_priority() -> None:
    model = ModelRecord(
        name=MODEL,
        profiles=(
            Profile(name="cpu", engine="llamacpp", replicas=2),
            Profile(name="gpu", engine="vllm", replicas=3, priority=10),
            Profile(name="off", engine="vllm", replicas=0, priority=20),
        ),
    )
    assert [p.name for p in slot_profiles(model)] == ["gpu", "gpu", "gpu", "cpu", "cpu"]


async def test_gpu_and_cpu_profiles_of_one_model_are_placed_by_their_needs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = ModelRecord(
        name=MODEL,
        profiles=(
            Profile(name="cpu", engine="llamacpp", replicas=1, cpu_cores=4),
            Profile(name="gpu", engine="vllm", gpu_class="h100-80g", replicas=2, priority=10),
        ),
    )
    card = "NVIDIA H100 80GB HBM3"
    gpus = tuple(protocol.Gpu(index=i, name=card, memory_total_mb=81559) for i in range(2))
    cluster = _cluster()
    async with _rig(cluster, model) as rig:
        gpu_node = rig.node("gpu", gpus=gpus, cpus=2, compute="CUDA0 H100")
        cpu_node = rig.node("cpu", cpus=8)
        await rig.start()
        await _until(lambda: len(_ready(cluster)) == 3)
        placed = {
            s.replica_id: (s.node_id, s.profile, s.gpu_indices) for s in cluster.shards.values()
        }
        assert placed == {
            "m-0": ("gpu", "gpu", (0,)),
            "m-1": ("gpu", "gpu", (1,)),
            "m-2": ("cpu", "cpu", ()),
        }
        starts = {
            m.shard_id: m
            for m in cpu_node.sent + gpu_node.sent
            if isinstance(m, protocol.StartShard)
        }
        assert starts["m-0"].profile.engine == "vllm"
        assert starts["m-2"].profile.cpu_cores == 4
        assert starts["m-2"].fingerprint == replica_fingerprint(model, model.profiles[0])


async def test_a_retiring_replica_finishes_its_requests_before_it_is_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = _cluster()
    async with _rig(cluster, _model(2)) as rig:
        node = rig.node("a")
        await rig.start()
        await _until(lambda: len(_ready(cluster)) == 2)
        [endpoint] = [e for e in cluster.ready_endpoints(MODEL) if e.replica_id == "m-1"]
        endpoint.in_flight = 1
        rig.put(_model(1))
        await _until(lambda: cluster.shards["m-1"].retiring)
        assert _ready(cluster) == ["m-0"]  # no new requests for it
        await trio.sleep(10)
        assert node.stops() == []  # its request is still being answered
        endpoint.in_flight = 0
        await _until(lambda: node.stops() == ["m-1"], within_s=2)


async def test_a_llamacpp_replica_reserves_its_nodes_cores_and_a_roll_may_reuse_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A llama.cpp replica with no ``cpu_cores`` runs a thread per core: it
    reserves all of its node's cores, and placement counts them (it said
    "2 of 2 cores left after 1 replica"). Its successor in a rolling restart
    may still use them while it loads."""
    cluster = _cluster()
    model = ModelRecord.simple(MODEL, "llamacpp", source="/w.gguf", min_memory_gb=1.0)
    async with _rig(cluster, model) as rig:
        rig.node("a", cpus=2)
        await rig.start()
        await _until(lambda: _ready(cluster) == ["m-0"])
        assert cluster.shards["m-0"].cpu_cores == 2
        [verdict] = explain(model, cluster)
        assert not verdict.fits
        assert verdict.reason == "needs 2 CPU cores; 0 of 2 free after 1 replica"
        assert (verdict.figures["cores_need"], verdict.figures["cores_free"]) == (2, 0)
        # A rolling restart on the same full node still goes through.
        changed = ModelRecord.simple(
            MODEL, "llamacpp", source="/w.gguf", min_memory_gb=1.0, args=("--flash-attn", "on")
        )
        rig.put(changed)
        await _until(lambda: _ready(cluster) == ["m-0.g2"] and len(cluster.shards) == 1)
        assert cluster.shards["m-0.g2"].cpu_cores == 2


def test_the_cores_a_replica_reserves_are_the_cores_its_threads_use() -> None:
    def cores(**fields: Any) -> int:
        return replica_cores(Profile(**fields), 8, on_cards=False)

    assert cores(engine="llamacpp") == 8  # llama.cpp's default: a thread per core
    assert cores(engine="llamacpp", cpu_cores=3) == 3  # sent as --threads 3
    assert cores(engine="llamacpp", args=("--threads", "4")) == 4
    assert cores(engine="llamacpp", args=("-t", "2", "--flash-attn", "on")) == 2
    assert cores(engine="llamacpp", args=("--threads=5",)) == 5
    assert cores(engine="sim") == 0
    assert replica_cores(Profile(engine="llamacpp"), 8, on_cards=True) == 0

"""The cluster's bookkeeping: adoption, reports, retiring, demand."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState
from llmgw.control.cluster import (
    Cluster,
    ShardInfo,
    compute_lacks_gpu,
    parse_replica_id,
    replica_fingerprint,
    replica_id_for,
)
from llmgw.settings import OnDemandSettings, ServerSettings
from llmgw.store import ModelRecord, Profile

HARDWARE = protocol.Hardware(cpu_count=4, memory_total_mb=16384)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[protocol.Message] = []

    async def __call__(self, message: protocol.Message) -> None:
        self.sent.append(message)


def _register(
    cluster: Cluster, node_id: str, *running: protocol.RunningShard, **fields: object
) -> Recorder:
    send = Recorder()
    cluster.node_registered(
        protocol.Register(
            node_id=node_id,
            address="10.0.0.1",
            agent_version="test",
            hardware=HARDWARE,
            running_shards=running,
            **fields,  # type: ignore[arg-type]
        ),
        send,
    )
    return send


def _running(
    replica_id: str, *, model: str = "gemma-3-270m", fingerprint: str = "", port: int = 20000
) -> protocol.RunningShard:
    return protocol.RunningShard(
        shard_id=replica_id,
        replica_id=replica_id,
        model=model,
        state=ShardState.READY,
        port=port,
        fingerprint=fingerprint,
        compute="CUDA0 NVIDIA H100",
        gpu_indices=(1,),
    )


def _status(shard_id: str, state: ShardState, **fields: object) -> protocol.ShardStatus:
    return protocol.ShardStatus(shard_id=shard_id, replica_id=shard_id, state=state, **fields)  # type: ignore[arg-type]


def _shard(replica_id: str, node_id: str = "a", **fields: object) -> ShardInfo:
    fields = {"model": "m", "port": 20000, **fields}
    return ShardInfo(
        shard_id=replica_id,
        replica_id=replica_id,
        node_id=node_id,
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("compute", "lacks"),
    [
        ("CPU", True),
        ("cpu (AVX2, 8 threads)", True),
        ("no GPU found", True),
        ("CUDA0 NVIDIA H100 80GB HBM3; offloaded 0/33 layers to GPU", True),
        ("CUDA0 NVIDIA H100 80GB HBM3; offloaded 33/33 layers to GPU", False),
        ("CUDA0 NVIDIA H100 (+CPU)", False),
        ("", False),
    ],
)
def test_the_no_gpu_rule(compute: str, lacks: bool) -> None:
    assert compute_lacks_gpu(compute) is lacks


def test_replica_ids_carry_slot_and_generation() -> None:
    assert replica_id_for("gemma-3-270m", 0) == "gemma-3-270m-0"
    assert replica_id_for("gemma-3-270m", 2, 3) == "gemma-3-270m-2.g3"
    assert parse_replica_id("gemma-3-270m", "gemma-3-270m-0") == (0, 1)
    assert parse_replica_id("gemma-3-270m", "gemma-3-270m-2.g3") == (2, 3)
    assert parse_replica_id("gemma-3-270m", "other-0") == (-1, 1)
    assert parse_replica_id("gemma-3-270m", "gemma-3-270m-x") == (-1, 1)


def test_the_fingerprint_ignores_scaling_but_not_engine_settings() -> None:
    model = ModelRecord.simple("m", "sim", replicas=1)
    profile = model.profiles[0]
    fingerprint = replica_fingerprint(model, profile)
    assert replica_fingerprint(model, attrs.evolve(profile, replicas=5, priority=3)) == fingerprint
    assert replica_fingerprint(model, attrs.evolve(profile, args=("--x",))) != fingerprint
    assert replica_fingerprint(attrs.evolve(model, sha256="ab"), profile) != fingerprint


def test_unknown_running_shards_are_adopted_without_a_restart() -> None:
    model = ModelRecord(
        name="gemma-3-270m",
        profiles=(Profile(engine="vllm", gpu_class="h100-80g", min_memory_gb=8.0, cpu_cores=2),),
    )
    cluster = Cluster()
    cluster.replace_catalog({model.name: model})
    current = replica_fingerprint(model, model.profiles[0])
    send = _register(
        cluster,
        "a",
        _running("gemma-3-270m-0", fingerprint=current, port=20000),
        _running("gemma-3-270m-1.g2", fingerprint="0123456789abcdef", port=20001),
        _running("gemma-3-270m-2", fingerprint="", port=20002),
        _running("gone-0", model="gone", port=20003),
    )
    assert send.sent == []
    fresh = cluster.shards["gemma-3-270m-0"]
    assert (fresh.slot, fresh.generation, fresh.profile, fresh.stale) == (0, 1, "default", False)
    assert (fresh.memory_gb, fresh.cpu_cores, fresh.gpu_indices) == (8.0, 2, (1,))
    assert fresh.compute == "CUDA0 NVIDIA H100"
    assert fresh.adopted
    assert fresh.state is ShardState.READY
    old = cluster.shards["gemma-3-270m-1.g2"]
    assert (old.slot, old.generation, old.stale) == (1, 2, True)
    assert not cluster.shards["gemma-3-270m-2"].stale  # unknown fingerprint: not judged
    assert "gone-0" in cluster.shards  # the reconciler retires it
    assert sorted(e.replica_id for e in cluster.ready_endpoints("gemma-3-270m")) == [
        "gemma-3-270m-0",
        "gemma-3-270m-1.g2",
        "gemma-3-270m-2",
    ]


def test_a_reconnecting_agent_keeps_known_shards_and_stops_the_missing_ones() -> None:
    cluster = Cluster()
    cluster.add_shard(_shard("m-0", state=ShardState.READY, restarts=3, ready_at=1.0))
    cluster.add_shard(_shard("m-1", state=ShardState.READY))
    cluster.add_shard(_shard("m-2", state=ShardState.READY, retiring=True))
    _register(cluster, "a", _running("m-0", model="m"))
    kept = cluster.shards["m-0"]
    assert (kept.state, kept.restarts, kept.ready_at, kept.adopted) == (
        ShardState.READY,
        3,
        1.0,
        False,
    )
    assert cluster.shards["m-1"].state is ShardState.STOPPED
    assert cluster.shards["m-1"].reason == "not running after agent reconnect"
    assert "m-2" not in cluster.shards


def test_a_shard_id_running_on_two_nodes_keeps_the_ready_one() -> None:
    cluster = Cluster()
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0", "a", state=ShardState.READY))
    _register(cluster, "b", _running("m-0", model="m"))
    assert cluster.shards["m-0"].node_id == "a"
    assert cluster.orphans == [("b", "m-0")]
    # A status about b's copy is not taken for a's.
    cluster.shard_status(_status("m-0", ShardState.STOPPED), "b")
    assert cluster.shards["m-0"].state is ShardState.READY
    # The other way round: a's copy is still starting, b's runs.
    cluster.take_orphans()
    cluster.shard_status(_status("m-0", ShardState.STARTING), "a")
    _register(cluster, "b", _running("m-0", model="m"))
    assert cluster.shards["m-0"].node_id == "b"
    assert cluster.orphans == [("a", "m-0")]


def test_a_retiring_replica_leaves_the_endpoints_at_once_and_goes_when_stopped() -> None:
    cluster = Cluster()
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0", state=ShardState.READY))
    [endpoint] = cluster.ready_endpoints("m")
    endpoint.in_flight = 2
    cluster.retire(cluster.shards["m-0"], "scaled down")
    assert cluster.ready_endpoints("m") == []
    assert cluster.in_flight("m-0") == 2
    assert cluster.shards["m-0"].retire_reason == "scaled down"
    cluster.shard_status(_status("m-0", ShardState.STOPPED), "a")
    assert "m-0" not in cluster.shards
    assert cluster.in_flight("m-0") == 0


def test_failed_stays_failed_when_the_stop_is_reported() -> None:
    cluster = Cluster()
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0"))
    cluster.shard_status(
        _status(
            "m-0", ShardState.FAILED, reason="oom (exited with code 1)", last_lines=("x", "oom", "")
        ),
        "a",
    )
    cluster.shard_status(_status("m-0", ShardState.STOPPED), "a")
    shard = cluster.shards["m-0"]
    assert shard.state is ShardState.FAILED
    assert shard.reason == "oom (exited with code 1)"  # the agent's, as it wrote it


def test_progress_and_compute_are_kept_from_reports() -> None:
    clock = iter(range(100, 200))
    cluster = Cluster(clock=lambda: float(next(clock)))
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0"))
    cluster.shard_status(_status("m-0", ShardState.STARTING, progress="downloading 1 of 4 GB"))
    shard = cluster.shards["m-0"]
    assert shard.progress == "downloading 1 of 4 GB"
    assert shard.progress_at > 100
    cluster.shard_status(_status("m-0", ShardState.READY, compute="CPU"))
    assert shard.compute == "CPU"
    assert shard.state is ShardState.READY  # not placed on cards: CPU is right


def test_heartbeats_keep_the_cards_current() -> None:
    cluster = Cluster()
    card = protocol.Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_mb=81559)
    _register(cluster, "a")
    beat = protocol.Heartbeat(
        node_id="a",
        memory_total_mb=16384,
        memory_available_mb=8000,
        cpu_count=4,
        gpus=(attrs.evolve(card, foreign_memory_mb=4096),),
    )
    cluster.heartbeat(beat)
    assert cluster.nodes["a"].gpus[0].foreign_memory_mb == 4096
    cluster.heartbeat(attrs.evolve(beat, gpus=()))
    assert cluster.nodes["a"].gpus[0].foreign_memory_mb == 4096


def test_registration_keeps_engines_labels_and_busy_ports() -> None:
    cluster = Cluster()
    _register(cluster, "a", engines=("llamacpp",), labels={"llmgw.role": "judge"})
    cluster.mark_port_busy("a", 20000)
    cluster.node_disconnected("a")
    assert cluster.nodes["a"].disconnected_at is not None
    _register(cluster, "a", engines=("llamacpp",), labels={"llmgw.role": "judge"})
    node = cluster.nodes["a"]
    assert (node.engines, node.labels, node.busy_ports, node.connected) == (
        ("llamacpp",),
        {"llmgw.role": "judge"},
        {20000},
        True,
    )


async def test_demand_lasts_evict_after_idle_and_while_someone_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(clock=trio.current_time)
    cluster.apply_settings(ServerSettings(on_demand=OnDemandSettings(evict_after_idle=60)))
    cluster.replace_catalog({"m": ModelRecord.simple("m", "sim", on_demand=True)})
    _register(cluster, "a")
    assert not cluster.is_demanded("m")
    cluster.touch("m")
    assert cluster.is_demanded("m")
    await trio.sleep(61)
    assert not cluster.is_demanded("m")
    with pytest.raises(LookupError):
        await cluster.wait_ready("nosuch")
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def wait() -> None:
            await cluster.wait_ready("m")
            done.set()

        nursery.start_soon(wait)
        await trio.sleep(120)
        assert cluster.is_demanded("m")  # the waiter holds it
        assert not done.is_set()
        cluster.add_shard(_shard("m-0"))
        cluster.shard_status(_status("m-0", ShardState.READY))
        await done.wait()
    assert cluster.shards["m-0"].last_used_at == pytest.approx(61.0, abs=0.1)
    cluster.touch("m", at=10.0)  # an older report changes nothing
    assert cluster.last_used("m") == pytest.approx(61.0, abs=0.1)


def test_the_bandwidth_measured_after_registering_arrives_in_heartbeats_and_is_kept() -> None:
    cluster = Cluster()

    async def send(_: protocol.Message) -> None:
        return None

    cluster.node_registered(
        protocol.Register(
            node_id="n1",
            address="127.0.0.1",
            agent_version="0.1.0",
            hardware=protocol.Hardware(cpu_count=2, memory_total_mb=4096),
        ),
        send,
    )
    node = cluster.nodes["n1"]
    assert node.memory_bandwidth_gbps == 0.0

    def beat(machine: float, core: float) -> protocol.Heartbeat:
        return protocol.Heartbeat(
            node_id="n1",
            memory_total_mb=4096,
            memory_available_mb=2048,
            cpu_count=2,
            memory_bandwidth_gbps=machine,
            core_bandwidth_gbps=core,
        )

    cluster.heartbeat(beat(31.5, 20.0))
    assert (node.memory_bandwidth_gbps, node.core_bandwidth_gbps) == (31.5, 20.0)
    cluster.heartbeat(beat(0.0, 0.0))  # a beat without figures keeps the last ones
    assert (node.memory_bandwidth_gbps, node.core_bandwidth_gbps) == (31.5, 20.0)


def test_the_catalog_is_replaced_whole_and_counts_loaded_only_when_read() -> None:
    cluster = Cluster()
    first = {"m": ModelRecord.simple("m", "sim")}
    cluster.replace_catalog(first)
    held = cluster.models
    assert held == first
    assert held is not first  # a copy: the caller's dict stays its own
    assert not cluster.catalog_loaded  # an edit is not a read of the whole catalog
    cluster.load_catalog({**held, "n": ModelRecord.simple("n", "sim")})
    assert cluster.catalog_loaded
    assert sorted(cluster.models) == ["m", "n"]
    assert cluster.models is not held  # readers see the change by its identity


def test_a_start_takes_a_replica_out_of_the_endpoints_until_it_is_ready_again() -> None:
    clock = iter(range(100, 200))
    cluster = Cluster(clock=lambda: float(next(clock)))
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0"))
    cluster.shard_status(_status("m-0", ShardState.STARTING, progress="loading"), "a")
    cluster.shard_status(_status("m-0", ShardState.READY), "a")
    shard = cluster.shards["m-0"]
    cluster.schedule_restart(shard, 500.0)
    assert [e.replica_id for e in cluster.ready_endpoints("m")] == ["m-0"]
    cluster.mark_starting(shard)
    assert cluster.ready_endpoints("m") == []
    assert (shard.state, shard.restart_at, shard.progress, shard.ready_at) == (
        ShardState.STARTING,
        0.0,
        "",
        None,
    )
    assert shard.started_at == shard.progress_at


def test_failures_count_up_and_start_over_after_a_stable_run() -> None:
    cluster = Cluster()
    cluster.add_shard(_shard("m-0"))
    shard = cluster.shards["m-0"]
    cluster.count_failure(shard, afresh=False)
    cluster.count_failure(shard, afresh=False)
    assert shard.failures == 2
    cluster.count_failure(shard, afresh=True)
    assert shard.failures == 1


def test_orphans_are_handed_over_once_and_drains_are_tracked_by_node() -> None:
    cluster = Cluster()
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0", "a", state=ShardState.READY))
    _register(cluster, "b", _running("m-0", model="m"))
    assert cluster.take_orphans() == [("b", "m-0")]
    assert cluster.take_orphans() == []
    assert cluster.orphans == []
    cluster.drain_began("a", 10.0)
    assert cluster.drain_started == {"a": 10.0}
    cluster.drain_ended("a")
    assert cluster.drain_started == {}


def test_a_busy_port_is_remembered_on_its_node_and_the_replica_moves() -> None:
    cluster = Cluster()
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0", "a"))
    cluster.mark_port_busy("a", 20000)
    cluster.mark_port_busy("gone", 20000)  # a node not known: nothing to remember
    cluster.move_port(cluster.shards["m-0"], 20001)
    assert cluster.nodes["a"].busy_ports == {20000}
    assert cluster.shards["m-0"].port == 20001


def test_a_ready_replica_not_answering_leaves_the_endpoints_with_its_reason_and_comes_back() -> (
    None
):
    """The agent reports a READY replica STARTING with a reason (its engine
    stopped answering its health check): out of the endpoints at once, the
    old endpoint lost (its first-byte waits go elsewhere), the reason kept,
    the start deadline counted from then; READY again: a new endpoint, no
    reason."""
    now = [100.0]
    cluster = Cluster(clock=lambda: now[0])
    _register(cluster, "a")
    cluster.add_shard(_shard("m-0"))
    cluster.add_shard(attrs.evolve(_shard("m-1"), port=20001))
    cluster.shard_status(_status("m-0", ShardState.STARTING, progress="loading"), "a")
    cluster.shard_status(_status("m-0", ShardState.READY), "a")
    cluster.shard_status(_status("m-1", ShardState.READY), "a")
    before = {e.replica_id: e for e in cluster.ready_endpoints("m")}
    assert sorted(before) == ["m-0", "m-1"]
    now[0] = 900.0
    reason = "not answering its health check for 8 s"
    cluster.shard_status(_status("m-0", ShardState.STARTING, reason=reason), "a")
    shard = cluster.shards["m-0"]
    assert [e.replica_id for e in cluster.ready_endpoints("m")] == ["m-1"]
    assert (shard.state, shard.reason, shard.progress_at, shard.progress) == (
        ShardState.STARTING,
        reason,
        900.0,
        "",  # not the last start's progress
    )
    assert before["m-0"].lost
    assert not before["m-1"].lost
    # Its output while silent comes as progress, with the reason.
    cluster.shard_status(
        _status("m-0", ShardState.STARTING, reason=reason, progress="still here"), "a"
    )
    assert shard.reason == reason
    cluster.shard_status(_status("m-0", ShardState.READY), "a")
    after = {e.replica_id: e for e in cluster.ready_endpoints("m")}
    assert sorted(after) == ["m-0", "m-1"]
    assert after["m-0"] is not before["m-0"]
    assert not after["m-0"].lost
    assert after["m-1"] is before["m-1"]
    assert shard.reason == ""


def test_a_node_whose_link_is_down_is_routed_to_only_when_no_connected_node_has_the_model() -> None:
    cluster = Cluster()
    _register(cluster, "a")
    _register(cluster, "b")
    cluster.add_shard(_shard("m-0", "a", state=ShardState.READY))
    cluster.add_shard(_shard("m-1", "b", state=ShardState.READY))
    cluster.add_shard(_shard("n-0", "b", model="n", state=ShardState.READY))
    [on_b] = [e for e in cluster.ready_endpoints("m") if e.replica_id == "m-1"]
    on_b.in_flight = 1
    cluster.node_disconnected("b")
    # m has a replica on a connected node: only that one takes requests.
    assert [e.replica_id for e in cluster.ready_endpoints("m")] == ["m-0"]
    # n has none: its replica on the cut-off node is still tried (an agent
    # restarting leaves its engines serving).
    assert [e.replica_id for e in cluster.ready_endpoints("n")] == ["n-0"]
    # The requests in flight there are not lost, and the replica is kept.
    assert cluster.in_flight("m-1") == 1
    assert cluster.shards["m-1"].state is ShardState.READY
    _register(cluster, "b", _running("m-1", model="m"), _running("n-0", model="n"))
    assert sorted(e.replica_id for e in cluster.ready_endpoints("m")) == ["m-0", "m-1"]

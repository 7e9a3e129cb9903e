"""Placement on made-up inventories: classes of cards, full nodes, cordons,
foreign processes on cards, labels, spread."""

from __future__ import annotations

import json
from collections.abc import Iterable

import attrs
import pytest

from llmgw.agent import protocol
from llmgw.control.cluster import Cluster, NodeInfo, ShardInfo
from llmgw.control.placement import (
    MIB_PER_GB,
    PlacementChoice,
    explain,
    gpu_class_of,
    gpus_wanted,
    place,
)
from llmgw.settings import NodesSettings, ServerSettings
from llmgw.store import ModelRecord, Profile

H100 = "NVIDIA H100 80GB HBM3"
H100_MB = 81559
L40S = "NVIDIA L40S"
L40S_MB = 46068


async def _send(message: protocol.Message) -> None:
    pass


def _gpus(name: str, memory_mb: int, count: int) -> tuple[protocol.Gpu, ...]:
    return tuple(protocol.Gpu(index=i, name=name, memory_total_mb=memory_mb) for i in range(count))


def _node(
    cluster: Cluster,
    node_id: str,
    *,
    cpus: int = 16,
    memory_gb: float = 64.0,
    gpus: Iterable[protocol.Gpu] = (),
    engines: tuple[str, ...] = ("llamacpp",),
    labels: dict[str, str] | None = None,
) -> NodeInfo:
    cluster.node_registered(
        protocol.Register(
            node_id=node_id,
            address="10.0.0.1",
            hardware=protocol.Hardware(
                cpu_count=cpus, memory_total_mb=round(memory_gb * MIB_PER_GB), gpus=tuple(gpus)
            ),
            agent_version="test",
            engines=engines,
            labels=dict(labels or {}),
        ),
        _send,
    )
    return cluster.nodes[node_id]


def _hold(
    cluster: Cluster,
    node_id: str,
    replica_id: str,
    *,
    memory_gb: float = 0.0,
    cores: int = 0,
    cards: tuple[int, ...] = (),
    card_mb: float = 0.0,
    model: str = "other",
) -> None:
    cluster.add_shard(
        ShardInfo(
            shard_id=replica_id,
            replica_id=replica_id,
            model=model,
            node_id=node_id,
            port=20000 + len(cluster.shards),
            memory_gb=memory_gb,
            cpu_cores=cores,
            gpu_indices=cards,
            gpu_memory_mb=card_mb,
        )
    )


def _model(**profile: object) -> ModelRecord:
    fields: dict[str, object] = {"engine": "llamacpp", **profile}
    return ModelRecord(name="m", profiles=(Profile(**fields),))  # type: ignore[arg-type]


def _profile(model: ModelRecord) -> Profile:
    return model.profiles[0]


@pytest.mark.parametrize(
    ("name", "memory_mb", "expected"),
    [
        (H100, H100_MB, "h100-80g"),
        ("NVIDIA H100 PCIe", 81559, "h100-80g"),
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-40g"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, "rtx-pro-6000-96g"),
        ("NVIDIA GeForce RTX 4090", 24564, "rtx-4090-24g"),
        ("Tesla T4", 15360, "t4-15g"),
        (L40S, L40S_MB, "l40s-45g"),
        ("NVIDIA RTX A6000", 49140, "rtx-a6000-48g"),
        ("NVIDIA GH200 480GB", 97871, "gh200-96g"),  # the name counts the CPU's memory too
        ("", 8192, "gpu-8g"),
    ],
)
def test_the_class_of_a_card_is_its_model_and_memory(
    name: str, memory_mb: int, expected: str
) -> None:
    assert gpu_class_of(protocol.Gpu(index=0, name=name, memory_total_mb=memory_mb)) == expected


def test_cards_wanted_are_gpus_or_tp_when_a_class_is_set() -> None:
    assert gpus_wanted(Profile(engine="vllm", gpu_class="h100-80g", gpus=2)) == 2
    assert gpus_wanted(Profile(engine="vllm", gpu_class="h100-80g", tp=4)) == 4
    assert gpus_wanted(Profile(engine="vllm", gpu_class="h100-80g")) == 1
    assert gpus_wanted(Profile(engine="llamacpp")) == 0


def test_host_memory_refusal_quotes_need_free_total_and_replicas() -> None:
    cluster = Cluster()
    _node(cluster, "a", memory_gb=16.0)
    _hold(cluster, "a", "x-0", memory_gb=4.25)
    _hold(cluster, "a", "x-1", memory_gb=4.25)
    model = _model(min_memory_gb=12.0)
    assert place(model, _profile(model), cluster) is None
    [verdict] = explain(model, cluster)
    assert not verdict.fits
    assert verdict.reason == "needs 12.0 GB host memory; 7.5 GB of 16.0 GB free after 2 replicas"
    assert verdict.figures["memory_free_gb"] == pytest.approx(7.5, abs=0.01)
    assert verdict.figures["replicas"] == 2
    smaller = _model(min_memory_gb=7.0)
    chosen = place(smaller, _profile(smaller), cluster)
    assert chosen is not None
    assert chosen.node_id == "a"


def test_cores_are_reserved_per_replica() -> None:
    cluster = Cluster()
    _node(cluster, "a", cpus=16)
    _hold(cluster, "a", "x-0", cores=14)
    model = _model(cpu_cores=8)
    [verdict] = explain(model, cluster)
    assert verdict.reason == "needs 8 CPU cores; 2 of 16 free after 1 replica"
    model = _model(cpu_cores=2)
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="a", cpu_cores=2)


def test_cordoned_draining_disconnected_unlabelled_and_engineless_nodes_are_refused() -> None:
    cluster = Cluster()
    cluster.apply_settings(
        ServerSettings(nodes=NodesSettings(cordoned=("cordoned",), draining=("draining",)))
    )
    _node(cluster, "cordoned", labels={"llmgw.role": "judge"})
    _node(cluster, "draining", labels={"llmgw.role": "judge"})
    _node(cluster, "down", labels={"llmgw.role": "judge"})
    cluster.node_disconnected("down")
    _node(cluster, "worker", labels={"llmgw.role": "worker"})
    _node(cluster, "novllm", labels={"llmgw.role": "judge"}, engines=("llamacpp",))
    _node(cluster, "good", labels={"llmgw.role": "judge", "zone": "b"}, engines=("vllm",))
    model = _model(engine="vllm", selector={"llmgw.role": "judge"})
    reasons = {v.node_id: v.reason for v in explain(model, cluster)}
    assert reasons["cordoned"].startswith("cordoned")
    assert reasons["draining"].startswith("draining")
    assert reasons["down"] == "not connected"
    assert reasons["worker"] == (
        "labels do not match the selector: needs llmgw.role=judge; has llmgw.role=worker"
    )
    assert reasons["novllm"] == "engine vllm is not installed (installed: llamacpp)"
    assert reasons["good"].startswith("fits")
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="good")
    assert place(model, _profile(model), cluster, exclude_nodes=frozenset({"good"})) is None


def test_the_sim_engine_counts_as_installed_everywhere() -> None:
    cluster = Cluster()
    _node(cluster, "a", engines=())
    model = _model(engine="sim")
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="a")


def test_a_gpu_profile_goes_to_a_node_with_enough_cards_of_its_class() -> None:
    cluster = Cluster()
    _node(cluster, "l40s", gpus=_gpus(L40S, L40S_MB, 2), engines=("vllm",))
    _node(cluster, "one-h100", gpus=_gpus(H100, H100_MB, 1), engines=("vllm",))
    _node(cluster, "h100", gpus=_gpus(H100, H100_MB, 4), engines=("vllm",))
    _node(cluster, "cpu", engines=("vllm",))
    model = _model(engine="vllm", gpu_class="h100-80g", gpus=2)
    assert place(model, _profile(model), cluster) == PlacementChoice(
        node_id="h100", gpu_indices=(0, 1)
    )
    reasons = {v.node_id: v.reason for v in explain(model, cluster)}
    assert reasons["l40s"] == "needs 2x h100-80g; has 2x l40s-45g"
    assert reasons["one-h100"] == "needs 2x h100-80g; has 1x h100-80g"
    assert reasons["cpu"] == "needs 2x h100-80g; has no GPUs"
    assert reasons["h100"].startswith("fits: card(s) 0, 1;")


def test_without_a_plan_a_replica_takes_its_cards_whole() -> None:
    cluster = Cluster()
    _node(cluster, "a", gpus=_gpus(H100, H100_MB, 2), engines=("vllm",))
    model = _model(engine="vllm", gpu_class="h100-80g")
    first = place(model, _profile(model), cluster)
    assert first == PlacementChoice(node_id="a", gpu_indices=(0,))
    _hold(cluster, "a", "m-0", cards=(0,), model="m")
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="a", gpu_indices=(1,))
    _hold(cluster, "a", "m-1", cards=(1,), model="m")
    assert place(model, _profile(model), cluster) is None
    [verdict] = explain(model, cluster)
    assert "needs 1 whole h100-80g card(s)" in verdict.reason
    assert "card 0 held by 1 replica(s)" in verdict.reason


def test_foreign_processes_on_a_card_leave_less_room() -> None:
    """Card 0 has 50 GiB in foreign use: of its 72 GiB usable, 22 remain,
    too little for a 40 GiB plan; card 1 is free and is taken."""
    cluster = Cluster()
    cards = (
        protocol.Gpu(index=0, name=H100, memory_total_mb=81920, foreign_memory_mb=50 * 1024),
        protocol.Gpu(index=1, name=H100, memory_total_mb=81920),
    )
    _node(cluster, "a", gpus=cards, engines=("vllm",))
    model = _model(engine="vllm", gpu_class="h100-80g")
    cluster.set_gpu_plan("m", "default", 40 * 1024)
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="a", gpu_indices=(1,))
    _hold(cluster, "a", "m-0", cards=(1,), card_mb=40 * 1024, model="m")
    assert place(model, _profile(model), cluster) is None
    [verdict] = explain(model, cluster)
    assert verdict.reason == (
        "needs 40.0 GiB on each of 1x h100-80g; 0 card(s) have that free; the largest free is "
        "32.0 GiB on card 1 (72.0 usable, 0.0 foreign, 40.0 reserved)"
    )
    # The foreign process ends (a heartbeat says so): card 0 fits again.
    cluster.heartbeat(
        protocol.Heartbeat(
            node_id="a",
            memory_total_mb=cluster.nodes["a"].hardware.memory_total_mb,
            memory_available_mb=0,
            cpu_count=16,
            gpus=(attrs.evolve(cards[0], foreign_memory_mb=0), cards[1]),
        )
    )
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="a", gpu_indices=(0,))


def test_without_a_plan_a_card_busy_with_a_foreign_process_is_not_taken() -> None:
    cluster = Cluster()
    cards = (protocol.Gpu(index=0, name=H100, memory_total_mb=81920, foreign_memory_mb=30000),)
    _node(cluster, "a", gpus=cards, engines=("vllm",))
    model = _model(engine="vllm", gpu_class="h100-80g")
    assert place(model, _profile(model), cluster) is None
    [verdict] = explain(model, cluster)
    assert "card 0 has 29.3 GiB in foreign use" in verdict.reason


def test_two_plans_share_a_card_when_both_fit() -> None:
    cluster = Cluster()
    _node(cluster, "a", gpus=_gpus(H100, 81920, 1), engines=("vllm",))
    model = _model(engine="vllm", gpu_class="h100-80g")
    cluster.set_gpu_plan("m", "default", 30 * 1024)
    _hold(cluster, "a", "m-0", cards=(0,), card_mb=30 * 1024, model="m")
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="a", gpu_indices=(0,))
    _hold(cluster, "a", "m-1", cards=(0,), card_mb=30 * 1024, model="m")
    assert place(model, _profile(model), cluster) is None


def test_replicas_spread_over_nodes_and_the_roomiest_node_goes_first() -> None:
    cluster = Cluster()
    _node(cluster, "small", memory_gb=32.0)
    _node(cluster, "big", memory_gb=128.0)
    model = _model(min_memory_gb=4.0, cpu_cores=1)
    first = place(model, _profile(model), cluster)
    assert first == PlacementChoice(node_id="big", cpu_cores=1)
    _hold(cluster, "big", "m-0", memory_gb=4.0, cores=1, model="m")
    # One replica of the model on "big" already: the next goes to "small".
    assert place(model, _profile(model), cluster) == PlacementChoice(node_id="small", cpu_cores=1)


def test_explain_covers_every_node_for_every_profile_and_is_json_ready() -> None:
    cluster = Cluster()
    _node(cluster, "a", gpus=_gpus(H100, H100_MB, 1), engines=("vllm", "llamacpp"))
    _node(cluster, "b", memory_gb=8.0)
    model = ModelRecord(
        name="m",
        profiles=(
            Profile(name="gpu", engine="vllm", gpu_class="h100-80g", priority=10),
            Profile(name="cpu", engine="llamacpp", min_memory_gb=12.0, replicas=0),
        ),
    )
    verdicts = explain(model, cluster)
    assert [(v.profile, v.node_id, v.fits) for v in verdicts] == [
        ("gpu", "a", True),
        ("gpu", "b", False),
        ("cpu", "a", True),
        ("cpu", "b", False),
    ]
    docs = json.loads(json.dumps([v.to_doc() for v in verdicts]))
    assert docs[0]["gpu_indices"] == [0]
    assert docs[3]["reason"].startswith("needs 12.0 GB host memory; 8.0 GB of 8.0 GB free")
    assert set(docs[3]) == {"node_id", "profile", "fits", "reason", "figures", "gpu_indices"}

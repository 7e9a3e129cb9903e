"""Placement: which node, and which of its cards, a replica of a profile goes to.

Pure functions over what the nodes reported (``Cluster.nodes``) and what the
replicas already placed hold (``Cluster.shards``); nothing here sends
anything or awaits (``docs/catalog.md``, Placement).

**Constraints**, checked per node in this order; the first that fails is the
node's reason, quoting figures:

1. the node is connected, not cordoned (``settings.nodes.cordoned``), not
   draining (``settings.nodes.draining``), and carries every label of the
   profile's ``selector``;
2. the profile's engine is installed (``NodeInfo.engines``). ``sim`` counts
   as installed everywhere: it is plain Python and ships with the agent;
3. GPUs: enough cards of ``profile.gpu_class`` (count :func:`gpus_wanted`)
   whose free memory covers the per-card need (below);
4. host memory: ``min_memory_gb`` ≤ the node's *total* memory minus what
   replicas there reserve. Total, not available: the page cache and the
   engines already running make "available" move with load, and a
   reservation must not depend on it; views compare reserved with measured;
5. CPU cores: the replica's cores (:func:`replica_cores`) ≤ ``cpu_count``
   minus the cores reserved there.

**Cores** a replica reserves are the cores its threads use
(:func:`replica_cores`): the profile's ``cpu_cores`` when set (the
engine's ``--threads``); else, for llama.cpp, its ``--threads``/``-t``
argument; else a llama.cpp replica without cards runs one thread per core
of its node and reserves them all. Other engines (sim) and replicas on
cards reserve ``cpu_cores`` (0 when not set). A successor started to
replace a replica (a rolling restart) may use the cores of the one it
replaces, on the same node: both run only while the successor loads.

**Reservations** are what the shards in ``Cluster.shards`` on a node hold —
wanted ones, ones backing off after a crash, and retiring ones still
answering until their stop is confirmed: ``ShardInfo.memory_gb``,
``ShardInfo.cpu_cores``, and on each of ``ShardInfo.gpu_indices``
``ShardInfo.gpu_memory_mb`` (0 = the whole card).

**GPU memory per card.** A card's usable memory is
:data:`USABLE_GPU_SHARE` of its total, less what foreign processes hold
(re-read at every heartbeat) and what replicas reserve there. The per-card
need comes from the model's plan when one is known: the planner writes it
to ``Cluster.gpu_plans[(model, profile)]`` in MiB. Without a plan the need
is unknown and the replica takes its cards **whole**: a card qualifies only
when no replica holds it and foreign processes hold at most
:data:`FOREIGN_TOLERANCE_MB` of it (a desktop, not a training job).

**Units.** Card figures are MiB as the driver reports them and are shown as
GiB (MiB / 1024, the figure in a card's name: an "80GB" card); host memory
is shown in GB of 10^9 bytes, the unit of ``Profile.min_memory_gb``; the
node reports MiB.

**Choice** (spread): among the fitting nodes, the one with the fewest
replicas of this model, then the most free card memory left on the cards
chosen, then the most host memory left, then the most cores left; ties go
to the first node id. Within the node the cards with the most free memory
are taken (lowest index on ties); NVLink domains are [later].
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import attrs

from llmgw.agent.protocol import Gpu
from llmgw.store import ModelRecord, Profile

from .planning import replica_cores

if TYPE_CHECKING:
    from .cluster import Cluster, NodeInfo, ShardInfo

__all__ = [
    "ENGINES_EVERYWHERE",
    "FOREIGN_TOLERANCE_MB",
    "USABLE_GPU_SHARE",
    "NodeRoom",
    "NodeVerdict",
    "PlacementChoice",
    "check_node",
    "explain",
    "gpu_class_of",
    "gpu_need_mb",
    "gpus_wanted",
    "node_room",
    "place",
]

#: Engines every node can run without installing anything.
ENGINES_EVERYWHERE: Final = frozenset({"sim"})
#: The share of a card's memory an engine may use (vLLM's default 0.9).
USABLE_GPU_SHARE: Final = 0.9
#: Foreign use a card may carry and still be taken whole, in MiB.
FOREIGN_TOLERANCE_MB: Final = 1024
#: MiB in one GB of 10^9 bytes.
MIB_PER_GB: Final = 1e9 / 2**20

#: Words in a card's name that say nothing about its model.
_NAME_NOISE: Final = frozenset(
    {
        "nvidia",
        "geforce",
        "tesla",
        "quadro",
        "pcie",
        "sxm",
        "sxm2",
        "sxm3",
        "sxm4",
        "sxm5",
        "nvl",
        "hbm",
        "hbm2",
        "hbm2e",
        "hbm3",
        "hbm3e",
        "gddr6",
        "gddr6x",
        "gddr7",
    }
)
_MEMORY_IN_NAME: Final = re.compile(r"(\d+)\s*gb\b", re.IGNORECASE)


@attrs.frozen(kw_only=True)
class PlacementChoice:
    """Where a replica goes: the node, the card indices (``()`` on CPU), and
    the cores it reserves there (:func:`replica_cores`)."""

    node_id: str
    gpu_indices: tuple[int, ...] = ()
    cpu_cores: int = 0


@attrs.frozen(kw_only=True)
class NodeVerdict:
    """Whether one more replica of ``profile`` fits on ``node_id``, and why.

    Attributes:
        node_id: the node considered.
        profile: the profile's name.
        fits: every constraint holds.
        reason: the first failed constraint with its figures ("needs 12.0 GB
            host memory; 7.5 GB of 16.0 GB free after 2 replicas"), or, when
            it fits, what it would take.
        figures: the numbers behind ``reason`` (keys end in their unit:
            ``_gb`` host GB, ``_gib`` card GiB, ``_cores``, or a count).
        gpu_indices: the cards it would take when it fits.
    """

    node_id: str
    profile: str
    fits: bool
    reason: str
    figures: dict[str, float] = attrs.field(factory=dict)
    gpu_indices: tuple[int, ...] = ()

    def to_doc(self) -> dict[str, Any]:
        """A JSON-ready dict of every attribute (``gpu_indices`` as a list)."""
        return {
            "node_id": self.node_id,
            "profile": self.profile,
            "fits": self.fits,
            "reason": self.reason,
            "figures": dict(self.figures),
            "gpu_indices": list(self.gpu_indices),
        }


@attrs.frozen(kw_only=True)
class NodeRoom:
    """What the replicas on one node reserve.

    Attributes:
        memory_gb: host memory, GB.
        cpu_cores: cores.
        gpu_mb: reserved MiB per card index (cards taken whole not included).
        whole_cards: cards a replica took whole (its need was unknown).
        holders: replicas holding each card, by index.
        replicas: replicas holding anything here (every shard on the node).
        models: replicas per model.
    """

    memory_gb: float = 0.0
    cpu_cores: int = 0
    gpu_mb: Mapping[int, float] = attrs.field(factory=dict)
    whole_cards: frozenset[int] = frozenset()
    holders: Mapping[int, int] = attrs.field(factory=dict)
    replicas: int = 0
    models: Mapping[str, int] = attrs.field(factory=dict)


def gpu_class_of(gpu: Gpu) -> str:
    """A card's class as profiles name it: ``<model>-<memory>g``, lowercase.

    The model is the card's name without vendor and brand words (NVIDIA,
    GeForce, Tesla, Quadro), form factors and memory types (PCIe, SXM4,
    HBM3, …), up to and including the first word with a digit, joined with
    ``-``. The memory is the ``NNGB`` figure of the name when it is within
    10 % of the card's reported memory, else the reported MiB / 1024
    rounded to whole GiB. Examples: "NVIDIA H100 80GB HBM3" (81559 MiB) →
    ``h100-80g``; "NVIDIA A100-SXM4-40GB" → ``a100-40g``; "NVIDIA RTX PRO
    6000 Blackwell Server Edition" (97887 MiB) → ``rtx-pro-6000-96g``;
    "NVIDIA GeForce RTX 4090" (24564 MiB) → ``rtx-4090-24g``; "Tesla T4"
    (15360 MiB) → ``t4-15g``. A name with no model word gives ``gpu``.
    """
    reported_gib = gpu.memory_total_mb / 1024
    memory_gib = round(reported_gib)
    match = _MEMORY_IN_NAME.search(gpu.name)
    if match is not None:
        named = int(match.group(1))
        if reported_gib <= 0 or abs(named - reported_gib) <= 0.1 * named:
            memory_gib = named
    words = [
        word
        for word in re.split(r"[\s_/-]+", _MEMORY_IN_NAME.sub(" ", gpu.name.lower()))
        if word and word not in _NAME_NOISE
    ]
    model: list[str] = []
    for word in words:
        model.append(word)
        if any(c.isdigit() for c in word):
            break
    return f"{'-'.join(model) or 'gpu'}-{memory_gib}g"


def gpus_wanted(profile: Profile) -> int:
    """Cards one replica of ``profile`` takes: ``gpus``, or ``tp`` when
    ``gpus`` is 0 and a ``gpu_class`` is set; 0 on CPU."""
    if profile.gpus > 0:
        return profile.gpus
    return max(profile.tp, 1) if profile.gpu_class else 0


def gpu_need_mb(model: ModelRecord, profile: Profile, cluster: Cluster) -> float:
    """The per-card need of a replica in MiB from the model's plan
    (``cluster.gpu_plans``), or 0 when no plan is known (the cards are taken
    whole)."""
    return float(cluster.gpu_plans.get((model.name, profile.name), 0.0))


def node_room(cluster: Cluster, node_id: str) -> NodeRoom:
    """What the shards in ``cluster.shards`` on ``node_id`` reserve."""
    memory_gb = 0.0
    cores = 0
    gpu_mb: dict[int, float] = {}
    holders: Counter[int] = Counter()
    whole: set[int] = set()
    models: Counter[str] = Counter()
    replicas = 0
    for shard in cluster.shards.values():
        if shard.node_id != node_id:
            continue
        replicas += 1
        models[shard.model] += 1
        memory_gb += shard.memory_gb
        cores += shard.cpu_cores
        for index in shard.gpu_indices:
            holders[index] += 1
            if shard.gpu_memory_mb > 0:
                gpu_mb[index] = gpu_mb.get(index, 0.0) + shard.gpu_memory_mb
            else:
                whole.add(index)
    return NodeRoom(
        memory_gb=memory_gb,
        cpu_cores=cores,
        gpu_mb=gpu_mb,
        whole_cards=frozenset(whole),
        holders=dict(holders),
        replicas=replicas,
        models=dict(models),
    )


def check_node(
    model: ModelRecord,
    profile: Profile,
    node: NodeInfo,
    cluster: Cluster,
    room: NodeRoom | None = None,
) -> NodeVerdict:
    """Check the five constraints (module docstring) for one more replica of
    ``profile`` on ``node``, with the reservations ``room`` (default: what
    ``cluster.shards`` holds there). A fitting verdict's ``figures`` carry
    ``cores_need``, the cores the replica would reserve."""
    if room is None:
        room = node_room(cluster, node.node_id)

    def refuse(reason: str, **figures: float) -> NodeVerdict:
        figures["replicas"] = room.replicas
        return NodeVerdict(
            node_id=node.node_id, profile=profile.name, fits=False, reason=reason, figures=figures
        )

    after = _after(room.replicas)
    # (1) the node itself
    nodes = cluster.settings.nodes
    if not node.connected or node.send is None:
        return refuse("not connected")
    if node.node_id in nodes.cordoned:
        return refuse("cordoned: takes no new replicas")
    if node.node_id in nodes.draining:
        return refuse("draining: takes no new replicas")
    missing = {k: v for k, v in profile.selector.items() if node.labels.get(k) != v}
    if missing:
        has = ", ".join(f"{k}={v}" for k, v in sorted(node.labels.items())) or "no labels"
        want = ", ".join(f"{k}={v}" for k, v in sorted(missing.items()))
        return refuse(f"labels do not match the selector: needs {want}; has {has}")
    # (2) the engine
    if profile.engine not in ENGINES_EVERYWHERE and profile.engine not in node.engines:
        installed = ", ".join(node.engines) or "none"
        failed = [
            why
            for name, why in sorted(node.engine_failures.items())
            if name == profile.engine or name.startswith(f"{profile.engine}-")
        ]
        tail = f"; its install failed: {failed[0]}" if failed else ""
        return refuse(f"engine {profile.engine} is not installed (installed: {installed}){tail}")
    # (3) the cards
    figures: dict[str, float] = {}
    chosen: tuple[int, ...] = ()
    wanted = gpus_wanted(profile)
    if wanted:
        need_mb = gpu_need_mb(model, profile, cluster)
        label = profile.gpu_class or "any class"
        of_class = [
            g for g in node.gpus if not profile.gpu_class or gpu_class_of(g) == profile.gpu_class
        ]
        figures.update(gpus_need=wanted, gpus_of_class=len(of_class), gpu_need_gib=need_mb / 1024)
        if len(of_class) < wanted:
            return refuse(f"needs {wanted}x {label}; has {_describe_cards(node.gpus)}", **figures)
        free = {g.index: _card_free_mb(g, room) for g in of_class}
        if need_mb > 0:
            fitting = [
                g for g in of_class if g.index not in room.whole_cards and free[g.index] >= need_mb
            ]
        else:
            fitting = [
                g
                for g in of_class
                if room.holders.get(g.index, 0) == 0 and g.foreign_memory_mb <= FOREIGN_TOLERANCE_MB
            ]
        figures["gpus_fitting"] = len(fitting)
        if len(fitting) < wanted:
            if need_mb > 0:
                best = max(of_class, key=lambda g: (free[g.index], -g.index))
                figures["gpu_best_free_gib"] = max(free[best.index], 0.0) / 1024
                return refuse(
                    f"needs {need_mb / 1024:.1f} GiB on each of {wanted}x {label}; "
                    f"{len(fitting)} card(s) have that free; the largest free is "
                    f"{max(free[best.index], 0.0) / 1024:.1f} GiB on card {best.index} "
                    f"({_card_account(best, room)})",
                    **figures,
                )
            busy = "; ".join(
                f"card {g.index} "
                + (
                    f"held by {room.holders[g.index]} replica(s)"
                    if room.holders.get(g.index, 0)
                    else f"has {g.foreign_memory_mb / 1024:.1f} GiB in foreign use"
                )
                for g in of_class
                if g not in fitting
            )
            return refuse(
                f"needs {wanted} whole {label} card(s) (no plan gives its memory per card); "
                f"{len(fitting)} free: {busy}",
                **figures,
            )
        fitting.sort(key=lambda g: (-free[g.index], g.index))
        chosen = tuple(sorted(g.index for g in fitting[:wanted]))
        # Room left on the chosen cards: the spread score. A card taken
        # whole counts with what it had free, so emptier nodes still win.
        left_mb = sum(free[i] - need_mb for i in chosen)
        figures["gpu_free_after_gib"] = left_mb / 1024
    # (4) host memory
    total_gb = node.hardware.memory_total_mb / MIB_PER_GB
    free_gb = total_gb - room.memory_gb
    figures.update(
        memory_need_gb=profile.min_memory_gb, memory_free_gb=free_gb, memory_total_gb=total_gb
    )
    if profile.min_memory_gb > free_gb + 1e-9:
        return refuse(
            f"needs {profile.min_memory_gb:.1f} GB host memory; "
            f"{max(free_gb, 0.0):.1f} GB of {total_gb:.1f} GB free{after}",
            **figures,
        )
    # (5) cores
    cpu_count = node.hardware.cpu_count
    free_cores = cpu_count - room.cpu_cores
    need_cores = replica_cores(profile, cpu_count, on_cards=bool(chosen))
    figures.update(cores_need=need_cores, cores_free=free_cores, cores_total=cpu_count)
    if need_cores > free_cores:
        return refuse(
            f"needs {need_cores} CPU cores; {max(free_cores, 0)} of {cpu_count} free{after}",
            **figures,
        )
    figures["replicas"] = room.replicas
    figures["model_replicas"] = room.models.get(model.name, 0)
    cards = f"card(s) {', '.join(map(str, chosen))}; " if chosen else ""
    return NodeVerdict(
        node_id=node.node_id,
        profile=profile.name,
        fits=True,
        reason=(
            f"fits: {cards}{free_gb - profile.min_memory_gb:.1f} GB of {total_gb:.1f} GB host "
            f"memory and {free_cores - need_cores} of {cpu_count} cores left{after}"
        ),
        figures=figures,
        gpu_indices=chosen,
    )


def place(
    model: ModelRecord,
    profile: Profile,
    cluster: Cluster,
    *,
    exclude_nodes: frozenset[str] = frozenset(),
    replacing: ShardInfo | None = None,
) -> PlacementChoice | None:
    """The node (and cards) for one more replica of ``profile``, or ``None``
    when it fits nowhere; nodes in ``exclude_nodes`` are not considered.
    ``replacing``: the replica this one succeeds; its cores count as free
    on its node (module docstring, Cores).

    Picks the fitting node with the most free room (module docstring,
    Choice). :func:`explain` says why each node was turned down.
    """

    def room_of(node_id: str) -> NodeRoom:
        room = node_room(cluster, node_id)
        if replacing is not None and replacing.node_id == node_id:
            room = attrs.evolve(room, cpu_cores=room.cpu_cores - replacing.cpu_cores)
        return room

    verdicts = [
        check_node(model, profile, node, cluster, room_of(node_id))
        for node_id, node in sorted(cluster.nodes.items())
        if node_id not in exclude_nodes
    ]
    fitting = [v for v in verdicts if v.fits]
    if not fitting:
        return None
    best = min(
        fitting,
        key=lambda v: (
            v.figures.get("model_replicas", 0.0),
            -v.figures.get("gpu_free_after_gib", 0.0),
            -(v.figures.get("memory_free_gb", 0.0) - v.figures.get("memory_need_gb", 0.0)),
            -(v.figures.get("cores_free", 0.0) - v.figures.get("cores_need", 0.0)),
            v.node_id,
        ),
    )
    return PlacementChoice(
        node_id=best.node_id,
        gpu_indices=best.gpu_indices,
        cpu_cores=int(best.figures.get("cores_need", 0)),
    )


def explain(model: ModelRecord, cluster: Cluster) -> list[NodeVerdict]:
    """Every node against every profile of ``model`` (``ctl explain-placement``):
    one :class:`NodeVerdict` per (profile, node), profiles in catalog order,
    nodes by id. Each says whether one more replica would fit now, and if
    not, the first constraint that failed with its figures."""
    rooms = {node_id: node_room(cluster, node_id) for node_id in cluster.nodes}
    return [
        check_node(model, profile, node, cluster, rooms[node_id])
        for profile in model.profiles
        for node_id, node in sorted(cluster.nodes.items())
    ]


def _after(replicas: int) -> str:
    if replicas == 0:
        return ""
    return f" after {replicas} replica{'s' if replicas != 1 else ''}"


def _card_free_mb(gpu: Gpu, room: NodeRoom) -> float:
    if gpu.index in room.whole_cards:
        return 0.0
    return (
        gpu.memory_total_mb * USABLE_GPU_SHARE
        - gpu.foreign_memory_mb
        - room.gpu_mb.get(gpu.index, 0.0)
    )


def _card_account(gpu: Gpu, room: NodeRoom) -> str:
    usable = gpu.memory_total_mb * USABLE_GPU_SHARE / 1024
    if gpu.index in room.whole_cards:
        return f"{usable:.1f} usable, taken whole by a replica"
    return (
        f"{usable:.1f} usable, {gpu.foreign_memory_mb / 1024:.1f} foreign, "
        f"{room.gpu_mb.get(gpu.index, 0.0) / 1024:.1f} reserved"
    )


def _describe_cards(gpus: tuple[Gpu, ...]) -> str:
    if not gpus:
        return "no GPUs"
    counts = Counter(gpu_class_of(g) for g in gpus)
    return ", ".join(f"{n}x {cls}" for cls, n in sorted(counts.items()))

"""Layouts: where a model fits on the cluster as it is, and how fast it runs on CPU.

:func:`plan` lays a model (:class:`~llmgw.control.planning.model_files.ModelFacts`)
out on the nodes: one card, then several cards of one node (tensor parallel
for vLLM, honouring the KV-head rule :func:`tp_fits_kv_heads`; llama.cpp
splits layers), and CPU on every node, with the memory per card, the host
memory (:mod:`llmgw.control.planning.memory`) and the estimated CPU speed.
:meth:`Plan.to_doc` gives it as JSON.

**CPU speed** (:func:`cpu_tokens_per_second`): decoding one token reads
every active weight once, so ``tok/s = 1 / (bytes / (0.68 · BW) + 0.005 s)``,
with ``BW`` for a replica = its threads x the single-core rate, capped at
the whole machine's (:func:`replica_bandwidth_gbps`). Bandwidth is in GB/s
(10^9 bytes/s, ``_gbps``) as the agent measures it; speeds are tokens per
second. ``docs/catalog.md`` (Planning) and ``docs/performance.md`` (model
planning against the real speed) show it at work.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from llmgw.control.planning.memory import (
    GIB,
    CardMemory,
    card_memory,
    host_memory_gib,
    kv_bytes_per_token,
    kv_gb_per_1k_tokens,
    suggested_min_memory_gb,
    usable_host_gib,
)
from llmgw.control.planning.model_files import ModelFacts, read_model_facts
from llmgw.store import Profile

__all__ = [
    "CPU_BANDWIDTH_EFFICIENCY",
    "CPU_PER_TOKEN_S",
    "Layout",
    "Plan",
    "PlanNode",
    "cpu_tokens_per_second",
    "estimate_for_file",
    "plan",
    "replica_bandwidth_gbps",
    "replica_cores",
    "tp_fits_kv_heads",
]

#: Share of the measured bandwidth a decoding engine achieves.
CPU_BANDWIDTH_EFFICIENCY: Final = 0.68
#: Fixed cost of one decoded token on CPU, in seconds.
CPU_PER_TOKEN_S: Final = 0.005
#: A reply of the whole context taking longer than this on CPU draws a warning.
_SLOW_REPLY_S: Final = 120.0


# --- rules -----------------------------------------------------------------------


def cpu_tokens_per_second(active_bytes: int | float, bandwidth_gbps: float) -> float:
    """Estimated decode speed of one reply on CPU, tokens/s:
    ``1 / (active_bytes / (0.68 · bandwidth_gbps · 1e9) + 0.005)``.

    Calibration: 1.07 GB at 24.9 GB/s → 14.7; 8.8 GB at 41.9 GB/s → 3.2.
    0 when the bandwidth is not known (``<= 0``).
    """
    if bandwidth_gbps <= 0:
        return 0.0
    seconds = active_bytes / (CPU_BANDWIDTH_EFFICIENCY * bandwidth_gbps * 1e9) + CPU_PER_TOKEN_S
    return 1.0 / seconds


def replica_bandwidth_gbps(threads: int, core_gbps: float, machine_gbps: float) -> float:
    """The memory bandwidth a replica with ``threads`` threads gets, GB/s:
    ``threads x core_gbps`` capped at ``machine_gbps``. An unknown figure
    (0) leaves the other: no single-core figure gives the machine's, no
    machine figure gives the threads' sum."""
    if core_gbps <= 0:
        return max(machine_gbps, 0.0)
    wanted = max(threads, 1) * core_gbps
    return min(wanted, machine_gbps) if machine_gbps > 0 else wanted


def tp_fits_kv_heads(tp: int, kv_heads: int) -> bool:
    """The tensor-width rule: ``tp`` divides the KV heads or is a
    multiple of them (8 heads: 1, 2, 4, 8, 16 fit; 3, 12 do not)."""
    if tp <= 0 or kv_heads <= 0:
        return False
    return kv_heads % tp == 0 or tp % kv_heads == 0


# --- plans -----------------------------------------------------------------------


@attrs.frozen
class PlanNode:
    """One node as planning sees it (from its ``Register``/``Heartbeat``).

    Attributes:
        node_id: the node's id.
        cpu_count: usable CPUs.
        memory_total_mb: host memory, MiB.
        memory_bandwidth_gbps: measured read bandwidth of the whole machine,
            GB/s (0 = not measured yet).
        core_bandwidth_gbps: the same for one core, GB/s (0 = not measured).
        gpus: ``(gpu_class, memory_mb)`` per card, memory in MiB.
    """

    node_id: str
    cpu_count: int
    memory_total_mb: int
    memory_bandwidth_gbps: float = 0.0
    core_bandwidth_gbps: float = 0.0
    gpus: tuple[tuple[str, int], ...] = attrs.field(default=(), converter=tuple)


@attrs.frozen(kw_only=True)
class Layout:
    """One way to lay the model out.

    Attributes:
        kind: ``"gpu"`` (one or several cards of one node) or ``"cpu"``.
        engine: ``llamacpp`` or ``vllm``.
        fits: whether it fits the cluster as it is (on ``nodes``).
        nodes: the nodes it fits on (for CPU: the one node it describes).
        gpu_class: the card class (``""`` on CPU).
        cards: cards per replica (0 on CPU).
        tp: tensor-parallel width (1 for llama.cpp, which splits layers).
        per_card: the memory on each card (``None`` on CPU).
        host_memory_gib: host memory of a CPU replica, GiB (0 on GPU).
        host_usable_gib: the node's usable memory for it, GiB (0 on GPU).
        cores: threads of a CPU replica (0 on GPU).
        bandwidth_gbps: the bandwidth a CPU replica gets, GB/s (0 = unknown).
        tokens_per_second: estimated CPU decode speed of one reply (0 = unknown).
        engine_args: flags the layout needs (``--enable-expert-parallel``).
        reason: why it does not fit, with figures (empty when it fits).
    """

    kind: Literal["gpu", "cpu"]
    engine: str
    fits: bool
    nodes: tuple[str, ...] = ()
    gpu_class: str = ""
    cards: int = 0
    tp: int = 1
    per_card: CardMemory | None = None
    host_memory_gib: float = 0.0
    host_usable_gib: float = 0.0
    cores: int = 0
    bandwidth_gbps: float = 0.0
    tokens_per_second: float = 0.0
    engine_args: tuple[str, ...] = ()
    reason: str = ""

    def describe(self) -> str:
        """``"4x h100-80g, tp 4, vllm"`` or ``"CPU on node-1, 2 cores, llamacpp"``."""
        if self.kind == "cpu":
            where = self.nodes[0] if self.nodes else "?"
            return f"CPU on {where}, {self.cores} cores, {self.engine}"
        split = f"tp {self.tp}" if self.engine != "llamacpp" else "layer split"
        if self.cards == 1:
            return f"1x {self.gpu_class}, {self.engine}"
        return f"{self.cards}x {self.gpu_class}, {split}, {self.engine}"

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": self.kind,
            "engine": self.engine,
            "fits": self.fits,
            "nodes": list(self.nodes),
            "description": self.describe(),
        }
        if self.kind == "gpu":
            assert self.per_card is not None
            doc.update(
                gpu_class=self.gpu_class,
                cards=self.cards,
                tp=self.tp,
                per_card_gib={
                    "weights": round(self.per_card.weights_gib, 3),
                    "kv": round(self.per_card.kv_gib, 3),
                    "overhead": round(self.per_card.overhead_gib, 3),
                    "total": round(self.per_card.total_gib, 3),
                    "usable": round(self.per_card.usable_gib, 3),
                },
            )
        else:
            doc.update(
                host_memory_gib=round(self.host_memory_gib, 3),
                host_usable_gib=round(self.host_usable_gib, 3),
                cores=self.cores,
                bandwidth_gbps=round(self.bandwidth_gbps, 2),
                tokens_per_second=round(self.tokens_per_second, 2),
            )
        if self.engine_args:
            doc["engine_args"] = list(self.engine_args)
        if self.reason:
            doc["reason"] = self.reason
        return doc


@attrs.frozen(kw_only=True)
class Plan:
    """Where a model fits on the cluster, and at what cost.

    Attributes:
        facts: the model.
        context_tokens: the whole context planned (all slots together).
        slots: parallel sequences.
        kv_gib_per_1k_tokens: KV for 1,000 tokens, whole model, GiB.
        kv_gib: KV for ``context_tokens``, whole model, GiB.
        layouts: GPU layouts (per card class: the fewest cards of one node
            that hold it, or the closest miss) then CPU, one per node.
        best: the preferred fitting layout — fewest cards (GPU before CPU),
            then the fastest CPU node — or ``None`` when nothing fits.
        suggested_min_memory_gb: what a CPU profile should state, GB (10^9).
        warnings: context beyond the trained length, slow CPU replies, …
    """

    facts: ModelFacts
    context_tokens: int
    slots: int
    kv_gib_per_1k_tokens: float
    kv_gib: float
    layouts: tuple[Layout, ...]
    best: Layout | None
    suggested_min_memory_gb: float
    warnings: tuple[str, ...] = ()

    def to_doc(self) -> dict[str, Any]:
        """The plan as JSON types: ``{"model": facts, "context_tokens",
        "slots", "kv_gib_per_1k_tokens", "kv_gib", "layouts": [...],
        "best": layout | None, "suggested_min_memory_gb", "warnings"}``."""
        return {
            "model": self.facts.to_doc(),
            "context_tokens": self.context_tokens,
            "slots": self.slots,
            "kv_gib_per_1k_tokens": round(self.kv_gib_per_1k_tokens, 4),
            "kv_gib": round(self.kv_gib, 3),
            "layouts": [layout.to_doc() for layout in self.layouts],
            "best": self.best.to_doc() if self.best is not None else None,
            "suggested_min_memory_gb": self.suggested_min_memory_gb,
            "warnings": list(self.warnings),
        }


def _card_counts(facts: ModelFacts, engine: str, available: int) -> Iterable[int]:
    for cards in range(1, available + 1):
        if (
            engine == "llamacpp"
            or cards == 1
            or (tp_fits_kv_heads(cards, facts.kv_heads) and facts.heads % cards == 0)
        ):
            yield cards


def _gpu_layouts(
    facts: ModelFacts, engine: str, nodes: Sequence[PlanNode], kv_bytes: int
) -> list[Layout]:
    # class -> node -> card memories (MiB)
    by_class: dict[str, dict[str, list[int]]] = {}
    for node in nodes:
        for gpu_class, memory_mb in node.gpus:
            by_class.setdefault(gpu_class, {}).setdefault(node.node_id, []).append(memory_mb)
    layouts: list[Layout] = []
    for gpu_class in sorted(by_class):
        per_node = by_class[gpu_class]
        most = max(len(cards) for cards in per_node.values())
        closest: Layout | None = None
        found: Layout | None = None
        for cards in _card_counts(facts, engine, most):
            fitting: list[str] = []
            memory: CardMemory | None = None
            for node_id in sorted(per_node):
                held = sorted(per_node[node_id], reverse=True)
                if len(held) < cards:
                    continue
                smallest = held[cards - 1]  # the cards with the most memory
                candidate = card_memory(facts, engine, cards, kv_bytes, smallest)
                if memory is None or candidate.usable_gib > memory.usable_gib:
                    memory = candidate
                if candidate.total_gib <= candidate.usable_gib:
                    fitting.append(node_id)
            if memory is None:
                continue
            tp = cards if engine != "llamacpp" else 1
            args = (
                ("--enable-expert-parallel",)
                if facts.moe and cards > 1 and engine == "vllm"
                else ()
            )
            layout = Layout(
                kind="gpu",
                engine=engine,
                fits=bool(fitting),
                nodes=tuple(fitting),
                gpu_class=gpu_class,
                cards=cards,
                tp=tp,
                per_card=memory,
                engine_args=args,
            )
            if fitting:
                found = layout
                break
            closest = layout
        if found is not None:
            layouts.append(found)
        elif closest is not None and closest.per_card is not None:
            pc = closest.per_card
            reason = (
                f"needs ~{pc.total_gib:.1f} GiB per card on {closest.cards}x {gpu_class} "
                f"({pc.weights_gib:.1f} weights + {pc.kv_gib:.1f} context + "
                f"{pc.overhead_gib:.1f} engine); {pc.usable_gib:.1f} GiB usable per card"
            )
            layouts.append(attrs.evolve(closest, reason=reason))
    return layouts


def _cpu_layout(
    facts: ModelFacts, node: PlanNode, kv_bytes: int, cpu_cores: int, context_tokens: int
) -> Layout:
    host = host_memory_gib(facts, kv_bytes)
    usable = usable_host_gib(node.memory_total_mb)
    cores = min(cpu_cores, node.cpu_count) if cpu_cores > 0 else node.cpu_count
    cores = max(cores, 1)
    bandwidth = replica_bandwidth_gbps(cores, node.core_bandwidth_gbps, node.memory_bandwidth_gbps)
    speed = cpu_tokens_per_second(facts.active_weights_bytes, bandwidth)
    fits = host <= usable
    reason = ""
    if not fits:
        reason = f"needs ~{host:.1f} GiB of host memory; {node.node_id} has {usable:.1f} GiB usable"
    return Layout(
        kind="cpu",
        engine="llamacpp",
        fits=fits,
        nodes=(node.node_id,),
        host_memory_gib=host,
        host_usable_gib=usable,
        cores=cores,
        bandwidth_gbps=bandwidth,
        tokens_per_second=speed,
        reason=reason,
    )


def plan(
    facts: ModelFacts,
    nodes: Sequence[PlanNode],
    *,
    context_tokens: int,
    slots: int = 1,
    cpu_cores: int = 0,
    engine: str | None = None,
) -> Plan:
    """Lay ``facts`` out on ``nodes`` as they are (total memory, not free).

    Args:
        facts: from :func:`read_model_facts`.
        nodes: the cluster.
        context_tokens: the whole context to hold (all slots), tokens.
        slots: parallel sequences; ``context_tokens / slots`` is checked
            against the trained length (a warning here; validation refuses).
        cpu_cores: threads of a CPU replica; 0 = all of the node's CPUs.
        engine: the GPU engine; default by format (GGUF → ``llamacpp``,
            safetensors → ``vllm``). CPU layouts are always llama.cpp, and
            only offered for GGUF models.

    GPU layouts, per card class: the fewest cards of one node that hold the
    model (for vLLM only widths that fit the KV heads and divide the heads),
    or, when none do, the widest try with a ``reason``. Multi-node layouts
    are not planned yet.

    Raises:
        ValueError: ``context_tokens < 1`` or ``slots < 1``.
    """
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be at least 1, not {context_tokens}")
    if slots < 1:
        raise ValueError(f"slots must be at least 1, not {slots}")
    gpu_engine = engine or facts.engine
    kv_bytes = kv_bytes_per_token(facts) * context_tokens
    layouts = _gpu_layouts(facts, gpu_engine, nodes, kv_bytes)
    if facts.format == "gguf":
        cpu = [_cpu_layout(facts, n, kv_bytes, cpu_cores, context_tokens) for n in nodes]
        cpu.sort(key=lambda layout: (not layout.fits, -layout.tokens_per_second))
        layouts.extend(cpu)
    warnings: list[str] = []
    per_slot = context_tokens // slots
    if facts.context_length and per_slot > facts.context_length:
        warnings.append(
            f"context per slot {per_slot:,} tokens ({context_tokens:,} / {slots}) is beyond "
            f"the trained {facts.context_length:,}"
        )
    gpu_fits = sorted(
        (layout for layout in layouts if layout.kind == "gpu" and layout.fits),
        key=lambda layout: layout.cards,
    )
    cpu_fits = [layout for layout in layouts if layout.kind == "cpu" and layout.fits]
    best = gpu_fits[0] if gpu_fits else (cpu_fits[0] if cpu_fits else None)
    if cpu_fits and cpu_fits[0].tokens_per_second > 0:
        reply_s = per_slot / cpu_fits[0].tokens_per_second
        if reply_s > _SLOW_REPLY_S:
            warnings.append(
                f"on CPU one reply of {per_slot:,} tokens would take ~{reply_s / 60:.0f} min "
                f"at {cpu_fits[0].tokens_per_second:.1f} tok/s"
            )
    if best is None:
        warnings.append("nothing fits this cluster as it is")
    return Plan(
        facts=facts,
        context_tokens=context_tokens,
        slots=slots,
        kv_gib_per_1k_tokens=kv_gb_per_1k_tokens(facts),
        kv_gib=kv_bytes / GIB,
        layouts=tuple(layouts),
        best=best,
        suggested_min_memory_gb=suggested_min_memory_gb(facts, context_tokens),
        warnings=tuple(warnings),
    )


def estimate_for_file(
    path: Path | str,
    threads: int,
    *,
    core_gbps: float | None = None,
    machine_gbps: float | None = None,
) -> float:
    """Estimated CPU decode speed (tokens/s, one reply) of the model at
    ``path`` with ``threads`` threads on this machine.

    The bandwidth figures default to a fresh
    :func:`llmgw.agent.bandwidth.measure_bandwidth` (a few seconds).

    Raises:
        PlanningError: the model cannot be read.
        llmgw.agent.bandwidth.BandwidthError: the bandwidth cannot be measured.
    """
    facts = read_model_facts(path)
    if core_gbps is None or machine_gbps is None:
        from llmgw.agent.bandwidth import measure_bandwidth

        measured = measure_bandwidth()
        core_gbps = measured.core_gbps if core_gbps is None else core_gbps
        machine_gbps = measured.machine_gbps if machine_gbps is None else machine_gbps
    bandwidth = replica_bandwidth_gbps(threads, core_gbps, machine_gbps)
    return cpu_tokens_per_second(facts.active_weights_bytes, bandwidth)


def _threads_arg(args: tuple[str, ...] | list[str]) -> int | None:
    """The thread count of llama.cpp arguments (``--threads N``, ``-t N``,
    ``--threads=N``), or None."""
    for at, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in ("--threads", "-t"):
            continue
        if not eq:
            value = args[at + 1] if at + 1 < len(args) else ""
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return None


def replica_cores(profile: Profile, cpu_count: int, *, on_cards: bool) -> int:
    """The cores one replica of ``profile`` reserves on a node of
    ``cpu_count`` cores: the cores its threads use (``llmgw.control.placement``, Cores).

    Args:
        on_cards: the replica runs on GPUs (its layers there, not on the cores).
    """
    if profile.cpu_cores > 0:
        return profile.cpu_cores
    if profile.engine != "llamacpp":
        return 0
    threads = _threads_arg(tuple(profile.args))
    if threads is not None:
        return threads
    # llama.cpp's default: a thread per core, all of them busy while it answers.
    return 0 if on_cards else max(cpu_count, 0)

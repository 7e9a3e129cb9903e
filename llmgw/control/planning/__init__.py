"""Model planning: what a model needs, where it fits, how fast it runs on CPU.

``docs/catalog.md`` (Planning) describes it for users. Two steps:

1. :func:`read_model_facts` reads the shape of a model from its files — a
   ``.gguf`` file (header only, never the tensors) or a directory with a
   ``config.json`` and ``*.safetensors`` (their JSON headers only)
   (:mod:`.model_files`).
2. :func:`plan` lays it out on the cluster as it is: one card, then several
   cards of one node, and CPU on every node, with the memory per card
   (:mod:`.memory`), the host memory and the estimated CPU speed
   (:mod:`.layouts`); :meth:`Plan.to_doc` gives it as JSON. The CLI prints
   it for people (``llmgw.cli.plan_format``).

Memory figures of a plan are in GiB (``_gib``), node and card memory in MiB
(``_mb``), bandwidth in GB/s (``_gbps``), speeds in tokens per second;
:func:`suggested_min_memory_gb` answers in GB (10^9 bytes).

This package exports the names the rest of llmgw uses; the modules hold the
rest.
"""

from llmgw.control.planning.layouts import (
    CPU_BANDWIDTH_EFFICIENCY,
    CPU_PER_TOKEN_S,
    Layout,
    Plan,
    PlanNode,
    cpu_tokens_per_second,
    estimate_for_file,
    plan,
    replica_bandwidth_gbps,
    replica_cores,
    tp_fits_kv_heads,
)
from llmgw.control.planning.memory import (
    GIB,
    LLAMACPP_OVERHEAD_GIB,
    MIB,
    USABLE_CARD_FRACTION,
    USABLE_HOST_FRACTION,
    VLLM_OVERHEAD_GIB,
    CardMemory,
    engine_overhead_gib,
    kv_bytes_per_token,
    kv_gb_per_1k_tokens,
    suggested_min_memory_gb,
)
from llmgw.control.planning.model_files import ModelFacts, PlanningError, read_model_facts

__all__ = [
    "CPU_BANDWIDTH_EFFICIENCY",
    "CPU_PER_TOKEN_S",
    "GIB",
    "LLAMACPP_OVERHEAD_GIB",
    "MIB",
    "USABLE_CARD_FRACTION",
    "USABLE_HOST_FRACTION",
    "VLLM_OVERHEAD_GIB",
    "CardMemory",
    "Layout",
    "ModelFacts",
    "Plan",
    "PlanNode",
    "PlanningError",
    "cpu_tokens_per_second",
    "engine_overhead_gib",
    "estimate_for_file",
    "kv_bytes_per_token",
    "kv_gb_per_1k_tokens",
    "plan",
    "read_model_facts",
    "replica_bandwidth_gbps",
    "replica_cores",
    "suggested_min_memory_gb",
    "tp_fits_kv_heads",
]

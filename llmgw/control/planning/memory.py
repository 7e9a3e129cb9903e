"""Memory a model needs: weights, KV cache and engine overhead, per card or
on the host.

**Units.** Memory figures are in **GiB** (2^30 bytes; names end in ``_gib``):
the worked example these rules were set with (Llama-3.3-70B in bf16: "131
GB" of weights, "0.31 GB per 1,000 tokens" of KV cache) only comes out in
GiB, so its "GB" reads as GiB. Node and card memory come in MiB (``_mb``, as
the agent reports them). :func:`suggested_min_memory_gb` answers in GB (10^9
bytes) because :attr:`Profile.min_memory_gb <llmgw.store.records.Profile>`
is in GB.

**Memory per card** = ``weights / cards + kv(context) / cards + overhead``,
of :data:`USABLE_CARD_FRACTION` (90 %) of the card, where ``kv(context) =
2 · layers · kv_heads · head_dim · context · kv_dtype_bytes`` for the whole
model. The engine overhead per card is:

- vLLM: :data:`VLLM_OVERHEAD_GIB` (2 GiB) flat. The rule's text says
  "2 GB + weights/50", but its own worked example has 2.0 GB of engine
  overhead per card for a 131 GiB model on 4 cards, where "+ weights/50"
  would add 0.66 (per card) or 2.6 (whole model) GiB; the example is what
  we reproduce.
- llama.cpp (our pick): :data:`LLAMACPP_OVERHEAD_GIB` (0.5 GiB) + 1/50 of the
  weights held (compute buffers, output logits, the process itself).

A CPU replica needs ``weights + kv(context) + llama.cpp overhead`` of host
memory, of :data:`USABLE_HOST_FRACTION` (90 %) of the node's.
"""

from __future__ import annotations

import math
from typing import Final

import attrs

from llmgw.control.planning.model_files import ModelFacts

__all__ = [
    "GIB",
    "LLAMACPP_OVERHEAD_GIB",
    "MIB",
    "USABLE_CARD_FRACTION",
    "USABLE_HOST_FRACTION",
    "VLLM_OVERHEAD_GIB",
    "CardMemory",
    "card_memory",
    "engine_overhead_gib",
    "host_memory_gib",
    "kv_bytes_per_token",
    "kv_gb_per_1k_tokens",
    "suggested_min_memory_gb",
    "usable_host_gib",
]

#: Bytes in a GiB.
GIB: Final = 1024**3
#: Bytes in a MiB.
MIB: Final = 1024**2

#: Share of a card's memory an engine may use (vLLM's default utilisation).
USABLE_CARD_FRACTION: Final = 0.9
#: Share of a node's memory a CPU replica may use (the rest: OS, agent, cache).
USABLE_HOST_FRACTION: Final = 0.9
#: vLLM's memory per card besides weights and KV (CUDA context, graphs, activations).
VLLM_OVERHEAD_GIB: Final = 2.0
#: llama.cpp's fixed memory per card or CPU replica; plus 1/50 of the weights held.
LLAMACPP_OVERHEAD_GIB: Final = 0.5
_LLAMACPP_OVERHEAD_SHARE: Final = 1 / 50


def kv_bytes_per_token(facts: ModelFacts) -> int:
    """KV cache bytes one token costs in the whole model:
    ``2 · layers · kv_heads · head_dim · kv_dtype_bytes`` (keys and values,
    GQA-aware; sliding-window layers are counted as full ones)."""
    return 2 * facts.layers * facts.kv_heads * facts.head_dim * facts.kv_dtype_bytes


def kv_gb_per_1k_tokens(facts: ModelFacts) -> float:
    """KV cache for 1,000 tokens of context, whole model, in GiB
    (Llama-3.3-70B: 0.305, the worked example's "0.31 GB")."""
    return kv_bytes_per_token(facts) * 1000 / GIB


def engine_overhead_gib(engine: str, weights_held_bytes: int) -> float:
    """The engine's own memory on one card or CPU replica, in GiB, besides
    the weights it holds (``weights_held_bytes``) and the KV cache:
    vLLM (and the other GPU engines) 2 GiB; llama.cpp 0.5 GiB + 1/50 of the
    weights held."""
    if engine == "llamacpp":
        return LLAMACPP_OVERHEAD_GIB + weights_held_bytes * _LLAMACPP_OVERHEAD_SHARE / GIB
    return VLLM_OVERHEAD_GIB


def suggested_min_memory_gb(facts: ModelFacts, context_tokens: int) -> float:
    """Host memory to state for a CPU profile (``min_memory_gb``), in GB
    (10^9 bytes), rounded up to a tenth: weights + KV for ``context_tokens``
    + llama.cpp's overhead."""
    need = float(facts.weights_bytes + kv_bytes_per_token(facts) * max(context_tokens, 0))
    need += engine_overhead_gib("llamacpp", facts.weights_bytes) * GIB
    return math.ceil(need / 1e9 * 10) / 10


@attrs.frozen(kw_only=True)
class CardMemory:
    """Memory on one card, GiB: ``total = weights + kv + overhead``, of ``usable``."""

    weights_gib: float
    kv_gib: float
    overhead_gib: float
    usable_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.kv_gib + self.overhead_gib


def card_memory(
    facts: ModelFacts, engine: str, cards: int, kv_bytes: int, card_mb: int
) -> CardMemory:
    """The memory on each of ``cards`` cards of ``card_mb`` MiB when
    ``engine`` holds ``facts`` split evenly, with ``kv_bytes`` of KV cache
    (whole model) split the same way."""
    weights_held = facts.weights_bytes / cards
    return CardMemory(
        weights_gib=weights_held / GIB,
        kv_gib=kv_bytes / cards / GIB,
        overhead_gib=engine_overhead_gib(engine, round(weights_held)),
        usable_gib=card_mb * MIB * USABLE_CARD_FRACTION / GIB,
    )


def host_memory_gib(facts: ModelFacts, kv_bytes: int) -> float:
    """Host memory of a CPU (llama.cpp) replica holding ``facts`` and
    ``kv_bytes`` of KV cache, GiB: weights + KV + llama.cpp's overhead."""
    return (facts.weights_bytes + kv_bytes) / GIB + engine_overhead_gib(
        "llamacpp", facts.weights_bytes
    )


def usable_host_gib(memory_total_mb: int) -> float:
    """What a CPU replica may use of a node's ``memory_total_mb`` MiB, GiB
    (:data:`USABLE_HOST_FRACTION` of it)."""
    return memory_total_mb * MIB * USABLE_HOST_FRACTION / GIB

"""Model planning: what a model needs, where it fits, how fast it runs on CPU.

``shared/spec/catalog-and-placement.md``, "Model planning". Three steps:

1. :func:`read_model_facts` reads the shape of a model from its files — a
   ``.gguf`` file (header only, never the tensors) or a directory with a
   ``config.json`` and ``*.safetensors`` (their JSON headers only).
2. :func:`plan` lays it out on the cluster as it is: one card, then several
   cards of one node (tensor parallel for vLLM, honouring the KV-head rule;
   llama.cpp splits layers), and CPU on every node, with the memory per card,
   the host memory and the estimated CPU speed.
3. :func:`format_plan` prints it; :meth:`Plan.to_doc` gives it as JSON.

**Units.** Memory figures of a plan are in **GiB** (2^30 bytes; fields and
keys end in ``_gib``): the spec's worked example (Llama-3.3-70B: "131 GB",
"0.31 GB per 1,000 tokens", "2.5 context") only comes out in GiB, so the
printed "GB" of the spec reads as GiB. Node and card memory come in MiB
(``_mb``, as the agent reports them). Bandwidth is in GB/s (10^9 bytes/s,
``_gbps``) as the agent measures it; speeds are tokens per second.
:func:`suggested_min_memory_gb` answers in GB (10^9 bytes) because
:attr:`Profile.min_memory_gb <llmgw.store.records.Profile>` is in GB.

**Memory per card** = ``weights / cards + kv(context) / cards + overhead``,
of :data:`USABLE_CARD_FRACTION` (90 %) of the card, where ``kv(context) =
2 · layers · kv_heads · head_dim · context · kv_dtype_bytes`` for the whole
model. The engine overhead per card is:

- vLLM: :data:`VLLM_OVERHEAD_GIB` (2 GiB) flat. The spec's text says
  "2 GB + weights/50", but its own example has 2.0 GB of engine overhead
  per card for a 131 GiB model on 4 cards, where "+ weights/50" would add
  0.66 (per card) or 2.6 (whole model) GiB; the example is what we reproduce.
- llama.cpp (our pick): :data:`LLAMACPP_OVERHEAD_GIB` (0.5 GiB) + 1/50 of the
  weights held (compute buffers, output logits, the process itself).

A CPU replica needs ``weights + kv(context) + llama.cpp overhead`` of host
memory, of :data:`USABLE_HOST_FRACTION` (90 %) of the node's.

**CPU speed** (:func:`cpu_tokens_per_second`): decoding one token reads
every active weight once, so ``tok/s = 1 / (bytes / (0.68 · BW) + 0.005 s)``,
with ``BW`` for a replica = its threads x the single-core rate, capped at
the whole machine's (:func:`replica_bandwidth_gbps`).
"""

from __future__ import annotations

import json
import math
import mmap
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from llmgw import errors

__all__ = [
    "CPU_BANDWIDTH_EFFICIENCY",
    "CPU_PER_TOKEN_S",
    "LLAMACPP_OVERHEAD_GIB",
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
    "format_plan",
    "kv_bytes_per_token",
    "kv_gb_per_1k_tokens",
    "plan",
    "read_model_facts",
    "replica_bandwidth_gbps",
    "suggested_min_memory_gb",
    "tp_fits_kv_heads",
]

GIB: Final = 1024**3
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
#: Share of the measured bandwidth a decoding engine achieves (spec's reading).
CPU_BANDWIDTH_EFFICIENCY: Final = 0.68
#: Fixed cost of one decoded token on CPU, in seconds (spec's reading).
CPU_PER_TOKEN_S: Final = 0.005
#: A reply of the whole context taking longer than this on CPU draws a warning.
_SLOW_REPLY_S: Final = 120.0

Format = Literal["gguf", "safetensors"]


class PlanningError(errors.InvalidInput):
    """A model's files cannot be read as a model: missing, not GGUF, no
    ``config.json``, a header that is cut short or inconsistent. The message
    names the file and what is wrong."""


@attrs.frozen(kw_only=True)
class ModelFacts:
    """The shape of a model, as planning needs it.

    Attributes:
        path: the file or directory read.
        format: ``"gguf"`` (served by llama.cpp) or ``"safetensors"`` (vLLM).
        architecture: ``general.architecture`` (``gemma3``) or the first of
            ``config.json``'s ``architectures`` (``LlamaForCausalLM``).
        layers: transformer blocks.
        kv_heads: key/value heads per layer (GQA); equals ``heads`` without GQA.
        heads: attention (query) heads per layer.
        head_dim: size of one head (key length).
        context_length: the trained context in tokens (0 = unknown).
        weights_bytes: every tensor's bytes (the file's size when a
            safetensors header cannot be read).
        active_weights_bytes: the bytes one decoded token reads: for MoE the
            shared part plus the routed experts' share
            (``experts_used / experts``), else ``weights_bytes``.
        quantization: the GGUF file type (``Q4_K_M``) or the safetensors
            dtype (``bfloat16``), or the ``quant_method`` (``fp8``, ``awq``).
        kv_dtype_bytes: bytes per KV element (2 for f16/bf16, the engines'
            default).
        moe: a mixture-of-experts model.
        experts: routed experts per layer (0 = not MoE).
        experts_used: experts each token goes through (0 = unknown / not MoE).
    """

    path: str
    format: Format
    architecture: str
    layers: int
    kv_heads: int
    heads: int
    head_dim: int
    context_length: int
    weights_bytes: int
    active_weights_bytes: int
    quantization: str
    kv_dtype_bytes: int = 2
    moe: bool = False
    experts: int = 0
    experts_used: int = 0

    @property
    def engine(self) -> str:
        """The engine that serves this format: ``llamacpp`` or ``vllm``."""
        return "llamacpp" if self.format == "gguf" else "vllm"

    def to_doc(self) -> dict[str, Any]:
        """The facts as JSON types (the same names as the attributes)."""
        return attrs.asdict(self)


# --- reading GGUF --------------------------------------------------------------

# GGUF value types (gguf.constants.GGUFValueType) -> struct format of a scalar.
_GGUF_SCALARS: Final[dict[int, str]] = {
    0: "<B",  # UINT8
    1: "<b",  # INT8
    2: "<H",  # UINT16
    3: "<h",  # INT16
    4: "<I",  # UINT32
    5: "<i",  # INT32
    6: "<f",  # FLOAT32
    7: "<?",  # BOOL
    10: "<Q",  # UINT64
    11: "<q",  # INT64
    12: "<d",  # FLOAT64
}
_U64: Final = struct.Struct("<Q")
_GGUF_STRING: Final = 8
_GGUF_ARRAY: Final = 9
_GGUF_MAGIC: Final = b"GGUF"
_SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _GGUFHeader:
    """The key/values and tensor infos of one GGUF file, read from its header.

    ``gguf.GGUFReader`` builds numpy views of every field, so a model with a
    262k-token vocabulary (Gemma 3) takes seconds to open; this walks the
    header with :mod:`struct` over a memory map instead, keeping scalars and
    strings, skipping arrays, and never touching tensor data. Quantization
    sizes and names come from the ``gguf`` package.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values: dict[str, Any] = {}
        #: (name, element count, ggml type) per tensor.
        self.tensors: list[tuple[str, int, int]] = []
        try:
            with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                self._buf = memoryview(mm)
                try:
                    self._parse()
                finally:
                    self._buf.release()
        except (OSError, ValueError) as exc:
            if isinstance(exc, PlanningError):
                raise
            raise PlanningError(f"{path}: cannot read as GGUF: {exc}") from None

    def _read(self, fmt: str, offset: int) -> tuple[Any, int]:
        size = struct.calcsize(fmt)
        if offset + size > len(self._buf):
            raise PlanningError(f"{self.path}: GGUF header is cut short at byte {offset}")
        return struct.unpack_from(fmt, self._buf, offset)[0], offset + size

    def _string(self, offset: int) -> tuple[str, int]:
        length, offset = self._read("<Q", offset)
        if offset + length > len(self._buf):
            raise PlanningError(f"{self.path}: GGUF string runs past the end at byte {offset}")
        text = bytes(self._buf[offset : offset + length]).decode("utf-8", errors="replace")
        return text, offset + length

    def _skip_array(self, offset: int) -> int:
        item_type, offset = self._read("<I", offset)
        count, offset = self._read("<Q", offset)
        if item_type == _GGUF_STRING:
            # A vocabulary: hundreds of thousands of strings, so a tight loop.
            unpack = _U64.unpack_from
            buf = self._buf
            end = len(buf) - 8
            for _ in range(count):
                if offset > end:
                    raise PlanningError(f"{self.path}: GGUF array runs past the end")
                offset += 8 + unpack(buf, offset)[0]
        elif item_type == _GGUF_ARRAY:
            for _ in range(count):
                offset = self._skip_array(offset)
        elif item_type in _GGUF_SCALARS:
            offset += count * struct.calcsize(_GGUF_SCALARS[item_type])
        else:
            raise PlanningError(f"{self.path}: unknown GGUF array type {item_type}")
        if offset > len(self._buf):
            raise PlanningError(f"{self.path}: GGUF array runs past the end")
        return offset

    def _parse(self) -> None:
        if len(self._buf) < 24 or bytes(self._buf[:4]) != _GGUF_MAGIC:
            raise PlanningError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version, offset = self._read("<I", 4)
        if version not in (2, 3):
            raise PlanningError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        tensor_count, offset = self._read("<Q", offset)
        kv_count, offset = self._read("<Q", offset)
        for _ in range(kv_count):
            key, offset = self._string(offset)
            value_type, offset = self._read("<I", offset)
            if value_type == _GGUF_STRING:
                self.values[key], offset = self._string(offset)
            elif value_type == _GGUF_ARRAY:
                offset = self._skip_array(offset)
            elif value_type in _GGUF_SCALARS:
                self.values[key], offset = self._read(_GGUF_SCALARS[value_type], offset)
            else:
                raise PlanningError(f"{self.path}: unknown GGUF value type {value_type} of {key}")
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            n_dims, offset = self._read("<I", offset)
            if n_dims > 8:
                raise PlanningError(f"{self.path}: tensor {name} has {n_dims} dimensions")
            elements = 1
            for _ in range(n_dims):
                dim, offset = self._read("<Q", offset)
                elements *= dim
            ggml_type, offset = self._read("<I", offset)
            _, offset = self._read("<Q", offset)  # data offset
            self.tensors.append((name, elements, ggml_type))


def _tensor_bytes(path: Path, name: str, elements: int, ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise PlanningError(f"{path}: tensor {name} has unknown ggml type {ggml_type}") from None
    return elements // block_size * type_size


def _gguf_file_type(header: _GGUFHeader) -> str:
    from gguf.constants import GGMLQuantizationType, LlamaFileType

    file_type = header.values.get("general.file_type")
    if isinstance(file_type, int):
        try:
            name = LlamaFileType(file_type).name
        except ValueError:
            name = ""
        if name:
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts: dict[int, int] = {}
    for _, elements, ggml_type in header.tensors:
        counts[ggml_type] = counts.get(ggml_type, 0) + elements
    if not counts:
        return ""
    common = max(counts, key=lambda t: counts[t])
    try:
        return GGMLQuantizationType(common).name
    except ValueError:
        return str(common)


def _gguf_int(header: _GGUFHeader, key: str, default: int = 0) -> int:
    value = header.values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return int(value)


def _split_parts(path: Path, count: int) -> list[Path]:
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        raise PlanningError(
            f"{path}: says it is split in {count} files, but its name is not NAME-00001-of-"
            f"{count:05d}.gguf"
        )
    stem = match.group("stem")
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _read_gguf(path: Path) -> ModelFacts:
    header = _GGUFHeader(path)
    tensors: list[tuple[str, int, int]] = []
    parts = [path]
    split_count = _gguf_int(header, "split.count", 1)
    if split_count > 1:
        parts = _split_parts(path, split_count)
        if _gguf_int(header, "split.no", 0) != 0:
            raise PlanningError(f"{path}: is not the first part of a split GGUF; give {parts[0]}")
    for part in parts:
        if part == path:
            tensors.extend(header.tensors)
        elif not part.is_file():
            raise PlanningError(f"{part}: missing part of the split GGUF {path.name}")
        else:
            tensors.extend(_GGUFHeader(part).tensors)

    arch = header.values.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise PlanningError(f"{path}: GGUF has no general.architecture")
    layers = _gguf_int(header, f"{arch}.block_count")
    heads = _gguf_int(header, f"{arch}.attention.head_count")
    kv_heads = _gguf_int(header, f"{arch}.attention.head_count_kv", heads)
    embedding = _gguf_int(header, f"{arch}.embedding_length")
    head_dim = _gguf_int(header, f"{arch}.attention.key_length")
    if not head_dim and heads:
        head_dim = embedding // heads
    if layers <= 0 or heads <= 0 or kv_heads <= 0 or head_dim <= 0:
        raise PlanningError(
            f"{path}: GGUF lacks the attention shape ({arch}.block_count={layers}, "
            f"head_count={heads}, head_count_kv={kv_heads}, head_dim={head_dim})"
        )
    experts = _gguf_int(header, f"{arch}.expert_count")
    experts_used = _gguf_int(header, f"{arch}.expert_used_count")
    weights = 0
    expert_bytes = 0
    for name, elements, ggml_type in tensors:
        size = _tensor_bytes(path, name, elements, ggml_type)
        weights += size
        if "_exps" in name:
            expert_bytes += size
    active = _active_bytes(weights, expert_bytes, experts, experts_used, path.name)
    return ModelFacts(
        path=str(path),
        format="gguf",
        architecture=arch,
        layers=layers,
        kv_heads=kv_heads,
        heads=heads,
        head_dim=head_dim,
        context_length=_gguf_int(header, f"{arch}.context_length"),
        weights_bytes=weights,
        active_weights_bytes=active,
        quantization=_gguf_file_type(header),
        kv_dtype_bytes=2,
        moe=experts > 1,
        experts=experts,
        experts_used=experts_used,
    )


_ACTIVE_NAME = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)B-A(\d+(?:\.\d+)?)B", re.IGNORECASE)


def _active_bytes(
    weights: int, expert_bytes: int, experts: int, experts_used: int, name: str
) -> int:
    """The bytes one token reads: shared weights + the used experts' share.

    Without expert tensors or counts, a name like ``Qwen3-30B-A3B`` gives the
    share (3/30); otherwise everything is read.
    """
    if experts > 1 and experts_used > 0 and expert_bytes > 0:
        share = min(experts_used / experts, 1.0)
        return weights - expert_bytes + round(expert_bytes * share)
    match = _ACTIVE_NAME.search(name)
    if match is not None:
        total, active = float(match.group(1)), float(match.group(2))
        if 0 < active < total:
            return round(weights * active / total)
    return weights


# --- reading a safetensors directory -------------------------------------------

_MAX_SAFETENSORS_HEADER: Final = 100 * MIB
_DTYPE_BYTES: Final = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
}


def _safetensors_bytes(path: Path) -> tuple[int, int]:
    """``(tensor bytes, routed-expert tensor bytes)`` from a safetensors header;
    the file's size and 0 when the header cannot be read."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("short")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_SAFETENSORS_HEADER:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        total = 0
        experts = 0
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            begin, end = info["data_offsets"]
            size = int(end) - int(begin)
            total += size
            if ".experts." in name:
                experts += size
        return total, experts
    except FileNotFoundError:
        raise PlanningError(f"{path}: not found") from None
    except (OSError, ValueError, KeyError, TypeError):
        try:
            return path.stat().st_size, 0
        except OSError as exc:
            raise PlanningError(f"{path}: cannot read: {exc}") from None


def _config_int(config: Mapping[str, Any], *keys: str) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _read_safetensors_dir(path: Path) -> ModelFacts:
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except OSError as exc:
        raise PlanningError(f"{config_path}: cannot read: {exc}") from None
    except ValueError as exc:
        raise PlanningError(f"{config_path}: not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise PlanningError(f"{config_path}: not a JSON object")
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        # Multimodal wrappers (Gemma 3, Llama 4, Mistral 3) keep the LM here.
        config = {**config, **text}
    layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_int(config, "num_attention_heads", "n_head")
    kv_heads = _config_int(config, "num_key_value_heads", "num_kv_heads") or heads
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    head_dim = _config_int(config, "head_dim") or (hidden // heads if heads else 0)
    if layers <= 0 or heads <= 0 or head_dim <= 0:
        raise PlanningError(
            f"{config_path}: lacks the attention shape (num_hidden_layers={layers}, "
            f"num_attention_heads={heads}, head_dim={head_dim})"
        )
    experts = _config_int(config, "num_experts", "n_routed_experts", "num_local_experts")
    experts_used = _config_int(config, "num_experts_per_tok", "num_experts_per_token", "moe_topk")
    dtype = config.get("torch_dtype") or config.get("dtype") or ""
    dtype = dtype if isinstance(dtype, str) else ""
    quantization = dtype
    quant_config = config.get("quantization_config")
    if isinstance(quant_config, dict) and isinstance(quant_config.get("quant_method"), str):
        quantization = quant_config["quant_method"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PlanningError(f"{path}: has config.json but no *.safetensors files")
    weights = 0
    expert_bytes = 0
    for file in files:
        total, experts_part = _safetensors_bytes(file)
        weights += total
        expert_bytes += experts_part
    architectures = config.get("architectures")
    arch = ""
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        arch = architectures[0]
    arch = arch or str(config.get("model_type", ""))
    return ModelFacts(
        path=str(path),
        format="safetensors",
        architecture=arch,
        layers=layers,
        kv_heads=kv_heads,
        heads=heads,
        head_dim=head_dim,
        context_length=_config_int(config, "max_position_embeddings", "n_positions"),
        weights_bytes=weights,
        active_weights_bytes=_active_bytes(
            weights, expert_bytes, experts, experts_used, path.resolve().name
        ),
        quantization=quantization,
        kv_dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        moe=experts > 1,
        experts=experts,
        experts_used=experts_used,
    )


def read_model_facts(path: Path | str) -> ModelFacts:
    """The shape of the model at ``path``.

    ``path`` is a ``.gguf`` file (the first part of a split one takes its
    siblings ``NAME-0000k-of-0000n.gguf`` too), or a directory holding a
    ``config.json`` and ``*.safetensors`` files, or a directory holding
    exactly one GGUF model. Only headers are read: a 250 MB GGUF with a
    262k-token vocabulary takes well under a second.

    GGUF keys read: ``general.architecture``, ``<arch>.block_count``,
    ``.attention.head_count``, ``.attention.head_count_kv``,
    ``.attention.key_length`` (else ``embedding_length / head_count``),
    ``.context_length``, ``.expert_count``, ``.expert_used_count``,
    ``general.file_type``; weights = the sum of the tensors' bytes.
    ``config.json`` keys: ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``hidden_size``, ``head_dim``,
    ``max_position_embeddings``, ``torch_dtype``/``dtype``,
    ``quantization_config.quant_method``, ``num_experts``/``n_routed_experts``/
    ``num_local_experts``, ``num_experts_per_tok``; ``text_config`` when the
    top level has no layers; weights = the tensors' bytes from the
    safetensors headers (a file's size when its header is unreadable).

    Raises:
        PlanningError: the path is missing, not a GGUF, has no
            ``config.json``/safetensors, or lacks the attention shape.
    """
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _read_safetensors_dir(path)
        ggufs = sorted(path.glob("*.gguf"))
        firsts = [
            g for g in ggufs if (m := _SPLIT_NAME.match(g.name)) is None or m["index"] == "00001"
        ]
        if len(firsts) == 1:
            return _read_gguf(firsts[0])
        if len(firsts) > 1:
            names = ", ".join(g.name for g in firsts)
            raise PlanningError(f"{path}: holds several GGUF models ({names}); name one")
        raise PlanningError(f"{path}: has neither config.json nor a .gguf file")
    if not path.exists():
        raise PlanningError(f"{path}: not found")
    if path.name == "config.json":
        return _read_safetensors_dir(path.parent)
    return _read_gguf(path)


# --- formulas ------------------------------------------------------------------


def kv_bytes_per_token(facts: ModelFacts) -> int:
    """KV cache bytes one token costs in the whole model:
    ``2 · layers · kv_heads · head_dim · kv_dtype_bytes`` (keys and values,
    GQA-aware; sliding-window layers are counted as full ones)."""
    return 2 * facts.layers * facts.kv_heads * facts.head_dim * facts.kv_dtype_bytes


def kv_gb_per_1k_tokens(facts: ModelFacts) -> float:
    """KV cache for 1,000 tokens of context, whole model, in GiB
    (Llama-3.3-70B: 0.305, the spec's "0.31 GB")."""
    return kv_bytes_per_token(facts) * 1000 / GIB


def engine_overhead_gib(engine: str, weights_held_bytes: int) -> float:
    """The engine's own memory on one card or CPU replica, in GiB, besides
    the weights it holds (``weights_held_bytes``) and the KV cache:
    vLLM (and the other GPU engines) 2 GiB; llama.cpp 0.5 GiB + 1/50 of the
    weights held."""
    if engine == "llamacpp":
        return LLAMACPP_OVERHEAD_GIB + weights_held_bytes * _LLAMACPP_OVERHEAD_SHARE / GIB
    return VLLM_OVERHEAD_GIB


def cpu_tokens_per_second(active_bytes: int | float, bandwidth_gbps: float) -> float:
    """Estimated decode speed of one reply on CPU, tokens/s:
    ``1 / (active_bytes / (0.68 · bandwidth_gbps · 1e9) + 0.005)``.

    Calibration (spec): 1.07 GB at 24.9 GB/s → 14.7; 8.8 GB at 41.9 GB/s → 3.2.
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
    """The spec's tensor-width rule: ``tp`` divides the KV heads or is a
    multiple of them (8 heads: 1, 2, 4, 8, 16 fit; 3, 12 do not)."""
    if tp <= 0 or kv_heads <= 0:
        return False
    return kv_heads % tp == 0 or tp % kv_heads == 0


def suggested_min_memory_gb(facts: ModelFacts, context_tokens: int) -> float:
    """Host memory to state for a CPU profile (``min_memory_gb``), in GB
    (10^9 bytes), rounded up to a tenth: weights + KV for ``context_tokens``
    + llama.cpp's overhead."""
    need = float(facts.weights_bytes + kv_bytes_per_token(facts) * max(context_tokens, 0))
    need += engine_overhead_gib("llamacpp", facts.weights_bytes) * GIB
    return math.ceil(need / 1e9 * 10) / 10


# --- plans ---------------------------------------------------------------------


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
class CardMemory:
    """Memory on one card, GiB: ``total = weights + kv + overhead``, of ``usable``."""

    weights_gib: float
    kv_gib: float
    overhead_gib: float
    usable_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.kv_gib + self.overhead_gib


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


def _card_memory(
    facts: ModelFacts, engine: str, cards: int, kv_bytes: int, card_mb: int
) -> CardMemory:
    weights_held = facts.weights_bytes / cards
    return CardMemory(
        weights_gib=weights_held / GIB,
        kv_gib=kv_bytes / cards / GIB,
        overhead_gib=engine_overhead_gib(engine, round(weights_held)),
        usable_gib=card_mb * MIB * USABLE_CARD_FRACTION / GIB,
    )


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
                candidate = _card_memory(facts, engine, cards, kv_bytes, smallest)
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
    host = (facts.weights_bytes + kv_bytes) / GIB + engine_overhead_gib(
        "llamacpp", facts.weights_bytes
    )
    usable = node.memory_total_mb * MIB * USABLE_HOST_FRACTION / GIB
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


def _gib(value: float) -> str:
    return f"{value:.1f}"


def format_plan(result: Plan) -> str:
    """The plan as a readable text table (GiB, tokens/s), for the CLI."""
    facts = result.facts
    size = facts.weights_bytes / GIB
    lines = [
        f"model      {facts.path}",
        f"           {facts.format} {facts.quantization or '?'}, {facts.architecture}, "
        f"{size:.2f} GiB"
        + (
            f" ({facts.active_weights_bytes / GIB:.2f} active, {facts.experts} experts)"
            if facts.moe
            else ""
        ),
        f"           {facts.layers} layers, {facts.heads} heads, {facts.kv_heads} KV heads "
        f"x {facts.head_dim}, trained context {facts.context_length:,}",
        f"context    {result.context_tokens:,} tokens in {result.slots} slot(s): "
        f"KV {result.kv_gib:.2f} GiB, {result.kv_gib_per_1k_tokens:.3f} GiB per 1,000 tokens",
        "",
    ]
    gpu = [layout for layout in result.layouts if layout.kind == "gpu"]
    cpu = [layout for layout in result.layouts if layout.kind == "cpu"]
    if gpu:
        header = f"{'layout':<34} {'per card GiB':>13} {'= weights':>9} {'+ kv':>6} {'+ engine':>8} {'of usable':>9}  nodes"
        lines.append(header)
        for layout in gpu:
            pc = layout.per_card
            assert pc is not None
            where = ", ".join(layout.nodes) if layout.fits else f"does not fit: {layout.reason}"
            lines.append(
                f"{layout.describe():<34} {_gib(pc.total_gib):>13} {_gib(pc.weights_gib):>9} "
                f"{_gib(pc.kv_gib):>6} {_gib(pc.overhead_gib):>8} {_gib(pc.usable_gib):>9}  {where}"
            )
            if layout.engine_args:
                lines.append(f"{'':<34} engine args: {' '.join(layout.engine_args)}")
        lines.append("")
    if cpu:
        lines.append(
            f"{'CPU node':<20} {'host GiB':>9} {'of usable':>9} {'cores':>5} {'GB/s':>6} {'tok/s':>6}"
        )
        for layout in cpu:
            speed = f"{layout.tokens_per_second:.1f}" if layout.tokens_per_second else "?"
            bandwidth = f"{layout.bandwidth_gbps:.1f}" if layout.bandwidth_gbps else "?"
            note = "" if layout.fits else "  does not fit"
            lines.append(
                f"{layout.nodes[0]:<20} {_gib(layout.host_memory_gib):>9} "
                f"{_gib(layout.host_usable_gib):>9} {layout.cores:>5} {bandwidth:>6} {speed:>6}{note}"
            )
        lines.append(f"CPU profile: min_memory_gb {result.suggested_min_memory_gb}")
        lines.append("")
    lines.append(f"best       {result.best.describe() if result.best else 'nothing fits'}")
    lines.extend(f"warning    {warning}" for warning in result.warnings)
    return "\n".join(lines)


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

"""A model's files, as planning reads them: the facts about the model.

:func:`read_model_facts` reads the shape of a model (layers, attention
heads, weights' bytes, quantization, experts) from its files, headers only:

- a ``.gguf`` file: its header is walked with :mod:`struct` over a memory
  map (key/values and tensor infos, never the tensor data); a split GGUF
  (``NAME-00001-of-0000n.gguf``) takes its sibling parts' tensors too;
- a directory with a ``config.json`` and ``*.safetensors`` files: the
  config's attention shape, and each safetensors file's JSON header for the
  tensors' bytes.

Errors are :class:`PlanningError` (an :class:`~llmgw.errors.InvalidInput`),
whose message names the file and what is wrong.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from llmgw import errors

__all__ = [
    "Format",
    "ModelFacts",
    "PlanningError",
    "read_model_facts",
]

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

#: The largest safetensors JSON header read, in bytes.
_MAX_SAFETENSORS_HEADER: Final = 100 * 1024 * 1024
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

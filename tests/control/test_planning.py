"""Model planning: facts from real and made-up model files, the spec's worked
example, the CPU speed formula and its calibration points."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from llmgw.agent.weights import assemble_starter_model
from llmgw.cli.plan_format import format_plan
from llmgw.control.planning import (
    GIB,
    ModelFacts,
    PlanningError,
    PlanNode,
    cpu_tokens_per_second,
    estimate_for_file,
    kv_bytes_per_token,
    kv_gb_per_1k_tokens,
    plan,
    read_model_facts,
    replica_bandwidth_gbps,
    suggested_min_memory_gb,
    tp_fits_kv_heads,
)

#: Shared with tests/engines/conftest.py: the starter model, assembled once.
CACHE_DIR = Path("/tmp/llmgw-test-cache")

#: An H100 80 GB as NVML reports it, MiB.
H100_MB = 81559
#: Llama-3.3-70B-Instruct in bf16: 70,553,706,496 parameters.
LLAMA_70B_BYTES = 70_553_706_496 * 2


@pytest.fixture(scope="module")
def starter() -> Path:
    """The starter GGUF (Gemma 3 270M Q4_K_M), assembled once and reused."""
    return assemble_starter_model(CACHE_DIR)


def _write_safetensors(path: Path, tensors: dict[str, int], dtype: str = "BF16") -> None:
    """A safetensors file whose header declares ``tensors`` (name -> bytes);
    the data is left out: planning reads only the header."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, size in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": [size // 2],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def _llama_70b(tmp_path: Path) -> Path:
    model = tmp_path / "Llama-3.3-70B-Instruct"
    model.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "hidden_size": 8192,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    (model / "config.json").write_text(json.dumps(config))
    half = LLAMA_70B_BYTES // 2
    _write_safetensors(model / "model-00001-of-00002.safetensors", {"a": half})
    _write_safetensors(model / "model-00002-of-00002.safetensors", {"b": LLAMA_70B_BYTES - half})
    return model


def _node(node_id: str = "n1", **fields: Any) -> PlanNode:
    base: dict[str, Any] = {"cpu_count": 2, "memory_total_mb": 24 * 1024}
    base.update(fields)
    return PlanNode(node_id=node_id, **base)


def _write_gguf(path: Path, arch: str = "qwen3moe", **extra: Any) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    if extra.get("moe", True):
        writer.add_expert_count(8)
        writer.add_expert_used_count(2)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_token_list(["a", "bb", "ccc"])
    writer.add_array("test.numbers", [1, 2, 3])
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- reading ---------------------------------------------------------------------


def test_starter_gguf_facts_match_llama_cpp(starter: Path) -> None:
    # llama.cpp's load log for this file: n_layer = 18, n_head = 4,
    # n_head_kv = 1, n_embd_head_k = 256, n_ctx_train = 32768, Q4_K - Medium.
    start = time.perf_counter()
    facts = read_model_facts(starter)
    took_s = time.perf_counter() - start
    assert facts.format == "gguf"
    assert facts.architecture == "gemma3"
    assert (facts.layers, facts.heads, facts.kv_heads, facts.head_dim) == (18, 4, 1, 256)
    assert facts.context_length == 32768
    assert facts.quantization == "Q4_K_M"
    assert facts.weights_bytes == 246_587_904  # the 236 tensors; the file has the vocab too
    assert facts.weights_bytes < starter.stat().st_size
    assert facts.active_weights_bytes == facts.weights_bytes
    assert not facts.moe
    assert facts.engine == "llamacpp"
    # Header only (262k vocabulary strings skipped): GGUFReader takes seconds.
    assert took_s < 3.0
    assert kv_bytes_per_token(facts) == 2 * 18 * 1 * 256 * 2
    assert read_model_facts(starter.parent / starter.name) == facts


def test_made_up_moe_gguf_reads_active_share(tmp_path: Path) -> None:
    path = tmp_path / "tiny-moe.gguf"
    _write_gguf(path)
    facts = read_model_facts(path)
    reader = gguf.GGUFReader(str(path))
    assert facts.weights_bytes == sum(int(t.n_bytes) for t in reader.tensors) == 4096 + 32768
    # embeddings + 2 of 8 experts
    assert facts.active_weights_bytes == 4096 + 32768 // 4
    assert facts.moe
    assert facts.experts == 8
    assert facts.experts_used == 2
    assert facts.head_dim == 64 // 8  # no key_length: embedding / heads
    assert facts.quantization == "F32"
    # a directory holding one GGUF model
    assert read_model_facts(tmp_path) == facts


def test_split_gguf_needs_every_part(tmp_path: Path) -> None:
    first = tmp_path / "m-00001-of-00002.gguf"
    writer = gguf.GGUFWriter(str(first), "llama")
    writer.add_block_count(4)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_embedding_length(32)
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_tensor("a", np.zeros(100, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PlanningError, match="missing part"):
        read_model_facts(first)
    second = tmp_path / "m-00002-of-00002.gguf"
    writer = gguf.GGUFWriter(str(second), "llama")
    writer.add_tensor("b", np.zeros(50, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_model_facts(first).weights_bytes == 600
    assert read_model_facts(tmp_path).weights_bytes == 600


def test_unreadable_inputs_raise_planning_error(tmp_path: Path, starter: Path) -> None:
    with pytest.raises(PlanningError, match="not found"):
        read_model_facts(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all, not at all" * 4)
    with pytest.raises(PlanningError, match="not a GGUF"):
        read_model_facts(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(PlanningError):
        read_model_facts(empty)
    cut = tmp_path / "cut.gguf"
    with starter.open("rb") as f:
        cut.write_bytes(f.read(4096))
    with pytest.raises(PlanningError, match=r"past the end|cut short"):
        read_model_facts(cut)
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(PlanningError, match=r"neither config\.json"):
        read_model_facts(bare)
    (bare / "config.json").write_text('{"num_hidden_layers": 2}')
    with pytest.raises(PlanningError, match="attention shape"):
        read_model_facts(bare)
    (bare / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}'
    )
    with pytest.raises(PlanningError, match=r"no \*\.safetensors"):
        read_model_facts(bare)


def test_safetensors_moe_directory(tmp_path: Path) -> None:
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "text_config": {
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "hidden_size": 2048,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "num_experts": 128,
            "num_experts_per_tok": 8,
        },
        "torch_dtype": "bfloat16",
    }
    (model / "config.json").write_text(json.dumps(config))
    _write_safetensors(
        model / "model.safetensors",
        {
            "model.layers.0.self_attn.q_proj.weight": 1000,
            "model.layers.0.mlp.experts.0.up_proj.weight": 128_000,
            "model.layers.0.mlp.shared_experts.up_proj.weight": 2000,
        },
    )
    facts = read_model_facts(model / "config.json")
    assert (facts.layers, facts.kv_heads, facts.head_dim) == (48, 4, 128)
    assert facts.moe
    assert facts.experts == 128
    assert facts.experts_used == 8
    assert facts.weights_bytes == 131_000
    assert facts.active_weights_bytes == 3000 + 128_000 * 8 // 128
    assert facts.engine == "vllm"
    node = _node(gpus=[("h100-80g", H100_MB)] * 8)
    # too big for one card only if weights were large; force 2 cards via a tiny card
    tiny = _node(gpus=[("l4-24g", 23034)] * 2)
    result = plan(
        ModelFacts(**{**facts.to_doc(), "weights_bytes": 30 * GIB}),
        [node, tiny],
        context_tokens=32768,
    )
    l4 = next(layout for layout in result.layouts if layout.gpu_class == "l4-24g")
    assert l4.cards == 2
    assert l4.fits
    assert l4.engine_args == ("--enable-expert-parallel",)


def test_moe_share_from_name_without_expert_tensors(tmp_path: Path) -> None:
    model = tmp_path / "Some-30B-A3B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "hidden_size": 512,
                "num_experts": 64,
            }
        )
    )
    _write_safetensors(model / "model.safetensors", {"w": 30_000})
    facts = read_model_facts(model)
    assert facts.active_weights_bytes == 3_000
    assert facts.kv_heads == 8  # no num_key_value_heads: no GQA


# --- the spec's worked example ------------------------------------------------------


def test_llama_70b_on_four_h100_reproduces_the_spec(tmp_path: Path) -> None:
    facts = read_model_facts(_llama_70b(tmp_path))
    assert (facts.layers, facts.kv_heads, facts.head_dim) == (80, 8, 128)
    assert facts.weights_bytes == LLAMA_70B_BYTES
    assert round(facts.weights_bytes / GIB) == 131  # the spec's "131 GB" is GiB
    assert round(kv_gb_per_1k_tokens(facts), 2) == 0.31

    result = plan(facts, [_node("gpu-1", gpus=[("h100-80g", H100_MB)] * 4)], context_tokens=32768)
    best = result.best
    assert best is not None
    assert best.kind == "gpu"
    assert (best.gpu_class, best.cards, best.tp, best.engine) == ("h100-80g", 4, 4, "vllm")
    card = best.per_card
    assert card is not None
    # "37.4 GB per card = 32.9 weights + 2.5 context + 2.0 engine, of 72 usable"
    assert round(card.weights_gib, 1) == 32.9
    assert round(card.kv_gib, 1) == 2.5
    assert round(card.overhead_gib, 1) == 2.0
    assert round(card.total_gib, 1) == 37.4
    assert round(card.usable_gib) == 72
    assert round(result.kv_gib_per_1k_tokens, 2) == 0.31
    assert result.layouts == (best,)  # safetensors: no CPU layout

    text = format_plan(result)
    assert "4x h100-80g, tp 4, vllm" in text
    assert "37.4" in text
    assert "32.9" in text
    doc = json.loads(json.dumps(result.to_doc()))
    assert doc["best"]["per_card_gib"]["total"] == pytest.approx(37.35, abs=0.01)
    assert doc["kv_gib_per_1k_tokens"] == pytest.approx(0.3052, abs=1e-4)


def test_two_cards_miss_and_three_are_never_tried(tmp_path: Path) -> None:
    facts = read_model_facts(_llama_70b(tmp_path))
    three = plan(facts, [_node(gpus=[("h100-80g", H100_MB)] * 3)], context_tokens=32768)
    assert three.best is None
    (layout,) = three.layouts
    # 3 does not fit 8 KV heads, so the widest try is 2 cards, which misses
    assert layout.cards == 2
    assert not layout.fits
    assert "needs ~72.7 GiB per card on 2x h100-80g" in layout.reason
    assert "nothing fits" in " ".join(three.warnings)


def test_tp_rule() -> None:
    assert [tp for tp in range(1, 17) if tp_fits_kv_heads(tp, 8)] == [1, 2, 4, 8, 16]
    assert not tp_fits_kv_heads(3, 8)
    assert not tp_fits_kv_heads(12, 8)
    assert tp_fits_kv_heads(8, 4)  # Qwen3-235B runs 8 wide on 4 KV heads
    assert not tp_fits_kv_heads(0, 8)


# --- CPU --------------------------------------------------------------------------


def test_cpu_speed_calibration_points() -> None:
    # spec: 24.9 GB/s with qwen2.5-1.5b (~1.07 GB) -> 14.7 estimated;
    # 41.9 GB/s with qwen2.5-14b (~8.8 GB) -> 3.2 estimated.
    assert round(cpu_tokens_per_second(1.07e9, 24.9), 1) == 14.7
    assert round(cpu_tokens_per_second(8.8e9, 41.9), 1) == 3.2
    assert cpu_tokens_per_second(1e9, 0.0) == 0.0


def test_replica_bandwidth_is_threads_times_core_capped() -> None:
    assert replica_bandwidth_gbps(2, 10.0, 33.0) == 20.0
    assert replica_bandwidth_gbps(8, 10.0, 33.0) == 33.0
    assert replica_bandwidth_gbps(4, 0.0, 33.0) == 33.0  # no core figure
    assert replica_bandwidth_gbps(4, 10.0, 0.0) == 40.0  # no machine figure
    assert replica_bandwidth_gbps(0, 10.0, 33.0) == 10.0


def test_starter_on_cpu(starter: Path) -> None:
    facts = read_model_facts(starter)
    fast = _node("fast", cpu_count=8, memory_bandwidth_gbps=40.0, core_bandwidth_gbps=12.0)
    slow = _node("slow", cpu_count=2, memory_bandwidth_gbps=30.0, core_bandwidth_gbps=10.0)
    small = _node("small", memory_total_mb=512)
    result = plan(facts, [slow, small, fast], context_tokens=4096, slots=4, cpu_cores=4)
    cpu = [layout for layout in result.layouts if layout.kind == "cpu"]
    assert [layout.nodes[0] for layout in cpu] == ["fast", "slow", "small"]
    assert result.best is cpu[0]
    assert cpu[0].cores == 4
    assert cpu[0].bandwidth_gbps == 40.0
    assert cpu[1].cores == 2
    assert cpu[1].bandwidth_gbps == 20.0
    assert cpu[0].tokens_per_second == pytest.approx(
        cpu_tokens_per_second(facts.weights_bytes, 40.0)
    )
    assert not cpu[2].fits
    assert "host memory" in cpu[2].reason
    # weights 0.23 + KV 4096 x 18 KiB + 0.5 + weights/50
    expected = (facts.weights_bytes * 1.02 + 4096 * 18432) / GIB + 0.5
    assert cpu[0].host_memory_gib == pytest.approx(expected)
    assert result.suggested_min_memory_gb == suggested_min_memory_gb(facts, 4096)
    assert 0.8 <= result.suggested_min_memory_gb <= 1.0
    text = format_plan(result)
    assert "CPU node" in text
    assert "fast" in text
    assert "min_memory_gb" in text
    json.dumps(result.to_doc())


def test_plan_warns_on_context_beyond_training(starter: Path) -> None:
    facts = read_model_facts(starter)
    result = plan(facts, [_node(memory_bandwidth_gbps=0.5)], context_tokens=65536)
    joined = " ".join(result.warnings)
    assert "beyond the trained 32,768" in joined
    assert "would take" in joined  # 65,536 tokens at ~2 tok/s
    with pytest.raises(ValueError, match="context_tokens"):
        plan(facts, [], context_tokens=0)


def test_llama_cpp_gpu_layout_splits_layers(starter: Path) -> None:
    facts = read_model_facts(starter)
    result = plan(facts, [_node(gpus=[("rtx-4090-24g", 24564)])], context_tokens=8192)
    gpu = result.layouts[0]
    assert gpu.kind == "gpu"
    assert gpu.engine == "llamacpp"
    assert gpu.cards == 1
    assert gpu.fits
    assert result.best is gpu  # fewest cards before CPU


def test_estimate_for_file_with_given_bandwidth(starter: Path) -> None:
    speed = estimate_for_file(starter, 2, core_gbps=10.0, machine_gbps=15.0)
    weights = read_model_facts(starter).active_weights_bytes
    assert speed == pytest.approx(cpu_tokens_per_second(weights, 15.0))

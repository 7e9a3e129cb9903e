"""The vLLM adapter: its command line, environment, readiness and metric
names, against vLLM 0.33's documented flags and endpoints (``vllm serve
--help``; OpenAI-compatible server docs). No GPU and no vLLM needed: the
documented flags are rebuilt here as an argparse parser, as vLLM's own
``FlexibleArgumentParser`` is one."""

from __future__ import annotations

import argparse

import orjson
import pytest

from llmgw.engines.base import ReadyByModelList, ShardLaunch, lists_model
from llmgw.engines.registry import ENGINE_NAMES, check_args, check_env, get_adapter
from llmgw.engines.vllm import (
    KEY_ENV,
    KV_USAGE_METRICS,
    RUNNING_METRIC,
    VLLM_VERSION,
    WAITING_METRIC,
    VllmAdapter,
    failure_cause,
    is_hub_id,
)
from llmgw.router.engine_metrics import KV_USAGE_METRICS as ROUTER_KV_METRICS
from llmgw.router.engine_metrics import kv_free_ratio

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def documented_parser() -> argparse.ArgumentParser:
    """The part of ``vllm serve``'s documented flags (0.33) the adapter sets,
    with their documented types and choices. ``exit_on_error=False`` so an
    undocumented flag or a bad value fails the test rather than exiting."""
    p = argparse.ArgumentParser(prog="vllm", exit_on_error=False, allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", exit_on_error=False, allow_abbrev=False)
    serve.add_argument("model_tag")
    serve.add_argument("--served-model-name", nargs="+")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument(
        "--load-format",
        choices=["auto", "pt", "safetensors", "npcache", "dummy", "gguf", "bitsandbytes"],
    )
    serve.add_argument("--tensor-parallel-size", "-tp", type=int)
    serve.add_argument("--revision")
    serve.add_argument("--gpu-memory-utilization", type=float)
    serve.add_argument("--api-key")
    serve.add_argument("--trust-remote-code", action="store_true")
    return p


def launch(**kw: object) -> ShardLaunch:
    base: dict[str, object] = {
        "replica_id": "r1",
        "http_port": 8123,
        "bind_addr": "10.0.0.5",
        "model_path": "/var/lib/llmgw-weights/hf/Qwen/Qwen2.5-0.5B-Instruct/" + COMMIT,
        "served_model_name": "qwen-small",
        "api_key": "engine-key-4711",
        "gpu_indices": (2, 3),
        "context_tokens": 32768,
        "slots": 8,
        "args": ("--gpu-memory-utilization", "0.85"),
    }
    base.update(kw)
    return ShardLaunch(**base)  # type: ignore[arg-type]


def test_the_registry_builds_vllm_with_the_installed_binary() -> None:
    assert "vllm" in ENGINE_NAMES
    assert get_adapter("vllm") == VllmAdapter()
    adapter = get_adapter("vllm", vllm_bin="/data/engines/vllm-0.33.0/venv/bin/vllm")
    assert adapter.name == "vllm"
    (cmd,) = adapter.commands(launch())
    assert cmd.path == "/data/engines/vllm-0.33.0/venv/bin/vllm"
    assert VllmAdapter().commands(launch())[0].path == "vllm"
    assert VLLM_VERSION == "0.33.0"


def test_command_line_parses_with_vllms_documented_flags() -> None:
    (cmd,) = VllmAdapter(bin="/e/vllm").commands(launch())
    ns = documented_parser().parse_args(list(cmd.args))
    assert ns.command == "serve"
    assert ns.model_tag.endswith(COMMIT)
    assert ns.served_model_name == ["qwen-small"]
    assert (ns.host, ns.port) == ("10.0.0.5", 8123)
    # context per sequence, as llama.cpp's --ctx-size is shared by its slots
    assert (ns.max_model_len, ns.max_num_seqs) == (32768 // 8, 8)
    assert ns.load_format == "safetensors"
    assert ns.tensor_parallel_size == 2
    assert ns.gpu_memory_utilization == 0.85
    assert ns.revision is None  # a local directory: nothing to pin
    assert ns.trust_remote_code is False


def test_the_key_travels_in_the_environment_only() -> None:
    (cmd,) = VllmAdapter().commands(launch())
    assert cmd.env[KEY_ENV] == "engine-key-4711"
    assert not any("engine-key-4711" in arg for arg in cmd.argv)
    assert "--api-key" not in cmd.argv
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    keyless = VllmAdapter().commands(launch(api_key="", env={"VLLM_API_KEY": "x"}))[0]
    assert KEY_ENV not in keyless.env


def test_without_cards_no_tensor_parallel_and_no_card_visible() -> None:
    (cmd,) = VllmAdapter().commands(launch(gpu_indices=()))
    assert "--tensor-parallel-size" not in cmd.args
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_hub_id_is_taken_only_pinned_to_a_commit() -> None:
    with pytest.raises(ValueError, match="pinned revision"):
        VllmAdapter().commands(launch(model_path="Qwen/Qwen2.5-0.5B-Instruct"))
    with pytest.raises(ValueError, match="pinned revision"):
        VllmAdapter().commands(launch(model_path="Qwen/Qwen2.5-0.5B-Instruct", revision="main"))
    (cmd,) = VllmAdapter().commands(launch(model_path="Qwen/Qwen2.5-0.5B", revision=COMMIT))
    ns = documented_parser().parse_args(list(cmd.args))
    assert (ns.model_tag, ns.revision, ns.load_format) == (
        "Qwen/Qwen2.5-0.5B",
        COMMIT,
        "safetensors",
    )
    assert is_hub_id("org/name")
    assert not is_hub_id("/abs/org/name")
    assert not is_hub_id("org/name:Q4_K_M")
    assert not is_hub_id("./org/name")
    assert not is_hub_id("https://x/y")
    assert not is_hub_id("a/b/c")
    assert not is_hub_id("")


def test_bad_launches_are_refused() -> None:
    with pytest.raises(ValueError, match="model directory"):
        VllmAdapter().commands(launch(model_path=""))
    with pytest.raises(ValueError, match="one token per slot"):
        VllmAdapter().commands(launch(context_tokens=4, slots=8))


def test_a_profiles_own_max_model_len_comes_last_and_wins() -> None:
    check_args("vllm", ["--max-model-len", "8192"])
    (cmd,) = VllmAdapter().commands(launch(args=("--max-model-len", "8192")))
    assert documented_parser().parse_args(list(cmd.args)).max_model_len == 8192


# -- refused flags (catalog validation) ---------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--trust-remote-code"],
        ["--trust-remote"],
        ["--trust-rem"],
        ["--trust"],
        ["--trus"],
        ["--trust_remote_code"],
        ["--trust-remote-code=true"],
        ["--trust-remote=1"],
        ["--dtype", "auto", "--trust_remote"],
    ],
)
def test_trust_remote_code_and_every_prefix_is_refused(args: list[str]) -> None:
    with pytest.raises(
        ValueError, match=r"vllm argument --trus.*runs code from a model repository"
    ):
        check_args("vllm", args)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--load-format", "pt"], "loads a file"),
        (["--load-form=auto"], "loads a file"),
        (["--download-dir", "/tmp"], "downloads a model"),
        (["--tokenizer", "org/tok"], "downloads a model"),
        (["--api-key", "k"], "is a credential"),
        (["--hf-token=t"], "is a credential"),
        (["--served-model-name", "x"], "is set by the agent"),
        (["--host", "0.0.0.0"], "is set by the agent"),
        (["--port=1"], "is set by the agent"),
        (["--revision", "main"], "is set by the agent"),
        (["-tp", "8"], "is set by the agent"),
        (["--tensor-parallel-size=8"], "is set by the agent"),
        (["--code-revision", "x"], "runs code"),
        (["--config", "serve.yaml"], "loads a file"),
        (["--middleware", "evil.mw"], "imports Python code"),
        (["--tool-parser-plugin", "/x.py"], "imports Python code"),
        (["--enable-log-requests"], "logs prompts"),
        (["--speculative-config.model", "org/draft"], "downloads a model"),
        (["--kv-transfer-config={}"], "sends work to other hosts"),
        (["--allowed-local-media-path", "/"], "serves files"),
    ],
)
def test_vllm_refuses_flags_with_a_reason(args: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_args("vllm", args)


def test_vllm_allows_tuning_flags() -> None:
    check_args(
        "vllm",
        [
            "--gpu-memory-utilization=0.9",
            "--tokenizer-mode",
            "auto",
            "--enable-prefix-caching",
            "--no-trust-remote-code",
            "--dtype",
            "bfloat16",
            "--enable-expert-parallel",
            "--compilation-config.level",
            "3",
        ],
    )


def test_vllm_refuses_its_own_dangerous_variables() -> None:
    for name, reason in (
        ("VLLM_API_KEY", "is set by the agent"),
        ("VLLM_USE_MODELSCOPE", "downloads a model"),
        ("VLLM_HOST_IP", "is set by the agent"),
        ("VLLM_SERVER_DEV_MODE", "opens development endpoints"),
        ("VLLM_PLUGINS", "loads a file"),
    ):
        with pytest.raises(ValueError, match=f"{name} is refused: it {reason}"):
            check_env({name: "1"})
    check_env({"VLLM_ATTENTION_BACKEND": "FLASHINFER", "VLLM_LOGGING_LEVEL": "INFO"})


# -- readiness -------------------------------------------------------------------


def test_readiness_is_health_then_models_listing_the_served_name() -> None:
    adapter = VllmAdapter()
    assert adapter.health_path() == "/health"
    assert adapter.metrics_path() == "/metrics"
    assert isinstance(adapter, ReadyByModelList)
    assert adapter.models_path() == "/v1/models"
    # vLLM's /v1/models answer (OpenAI's list of model cards)
    body = orjson.dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": "qwen-small",
                    "object": "model",
                    "created": 1764633600,
                    "owned_by": "vllm",
                    "root": "/var/lib/llmgw-weights/hf/Qwen/Qwen2.5-0.5B-Instruct/" + COMMIT,
                    "parent": None,
                    "max_model_len": 4096,
                    "permission": [],
                }
            ],
        }
    )
    assert lists_model(body, "qwen-small")
    assert not lists_model(body, "other")
    assert not lists_model(b'{"object": "list", "data": {}}', "qwen-small")
    assert not lists_model(b"not json", "qwen-small")
    assert not lists_model(b"[]", "qwen-small")


# -- metrics ---------------------------------------------------------------------

#: What vLLM 0.33's /metrics shows for one model (V1 engine names).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen-small"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen-small"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen-small"} 0.25
"""


def test_the_router_reads_vllms_kv_cache_names() -> None:
    assert set(KV_USAGE_METRICS) <= set(ROUTER_KV_METRICS)
    assert RUNNING_METRIC in VLLM_METRICS
    assert WAITING_METRIC in VLLM_METRICS
    assert kv_free_ratio(VLLM_METRICS) == pytest.approx(0.75)
    older = VLLM_METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert kv_free_ratio(older) == pytest.approx(0.75)


# -- failures ---------------------------------------------------------------------


def test_failure_cause_names_the_root_cause_not_vllms_summary() -> None:
    lines = [
        "INFO 12-02 00:41:01 [__init__.py:216] Automatically detected platform cuda.",
        "(EngineCore_DP0 pid=4242) ERROR 12-02 00:41:07 [core.py:710] EngineCore failed to start.",
        "(EngineCore_DP0 pid=4242) ERROR 12-02 00:41:07 [core.py:710] Traceback (most recent call last):",
        '(EngineCore_DP0 pid=4242) ERROR 12-02 00:41:07 [core.py:710]   File "x.py", line 1, in f',
        "(EngineCore_DP0 pid=4242) ERROR 12-02 00:41:07 [core.py:710] torch.OutOfMemoryError: "
        "CUDA out of memory. Tried to allocate 2.00 GiB.",
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
    ]
    assert failure_cause(lines) == (
        "vllm: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    assert failure_cause(["INFO 12-02 00:41:01 [api_server.py:1] started"]) == ""
    only = ["RuntimeError: Engine core initialization failed. See root cause above."]
    assert failure_cause(only).startswith("vllm: RuntimeError: Engine core initialization")

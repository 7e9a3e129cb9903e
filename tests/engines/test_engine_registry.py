"""The engine registry and the refusal of forbidden flags and environment."""

from __future__ import annotations

import pytest

from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.registry import (
    check_args,
    check_env,
    get_adapter,
    normalise_flag,
    unsupported_request,
)
from llmgw.engines.sim.adapter import SimAdapter


def test_the_registry_builds_the_llamacpp_and_sim_adapters() -> None:
    assert get_adapter("sim") == SimAdapter()
    assert get_adapter("llamacpp") == LlamaCppAdapter()
    configured = get_adapter("llamacpp", llamacpp_bin="/bin/llama-server")
    assert configured == LlamaCppAdapter("/bin/llama-server")
    assert [get_adapter(n).name for n in ("llamacpp", "sim")] == ["llamacpp", "sim"]


def test_an_unknown_engine_name_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match="unknown engine 'sglang'; available: llamacpp, sim, vllm"):
        get_adapter("sglang")


def test_flags_are_normalised_before_matching() -> None:
    assert normalise_flag("--hf_repo=org/name") == "--hf-repo"
    assert normalise_flag("-hf") == "-hf"
    assert normalise_flag("--ctx-size") == "--ctx-size"


@pytest.mark.parametrize(
    ("args", "flag", "reason"),
    [
        (["-m", "/x.gguf"], "-m", "is set by the agent"),
        (["-hf", "org/repo"], "-hf", "downloads a model"),
        (["--hf_repo=org/repo"], "--hf-repo", "downloads a model"),
        (["--hf-token", "t"], "--hf-token", "is a credential"),
        (["-hft", "t"], "-hft", "is a credential"),
        (["--alias", "x"], "--alias", "is set by the agent"),
        (["--model-draft", "d.gguf"], "--model-draft", "loads a file"),
        (["-jf", "schema.json"], "-jf", "loads a file"),
        (["--prompt-cache", "p"], "--prompt-cache", "writes files"),
        (["--logdir", "/tmp"], "--logdir", "logs prompts"),
        (["--trust-remote-code"], "--trust-remote-code", "runs code"),
        (["--api-key", "k"], "--api-key", "is a credential"),
        (["--path", "/"], "--path", "serves files"),
        (["--slot-save-path=/"], "--slot-save-path", "writes files"),
        (["--log-file", "x"], "--log-file", "writes files"),
        (["--rpc", "1.2.3.4:5"], "--rpc", "sends work to other hosts"),
    ],
)
def test_llamacpp_refuses_forbidden_flags_with_their_reason(
    args: list[str], flag: str, reason: str
) -> None:
    with pytest.raises(ValueError, match=rf"llamacpp argument {flag}\b.*{reason}"):
        check_args("llamacpp", ["--flash-attn", "on", *args])


def test_llamacpp_takes_no_abbreviations_so_similar_flags_pass() -> None:
    check_args("llamacpp", ["--chat-template", "chatml", "--ctx-size-draft", "8192", "--jinja"])
    check_args("llamacpp", ["--hf-rep", "x", "-ngl", "-1", "--cache-ram", "0"])


@pytest.mark.parametrize("flag", ["-c", "--ctx-size", "-np", "--parallel", "-t", "--threads"])
def test_llamacpp_flags_the_profile_sets_are_refused_so_its_figures_hold(flag: str) -> None:
    with pytest.raises(ValueError, match="set by the profile"):
        check_args("llamacpp", [f"{flag}=8"])


def test_the_sim_refuses_where_it_listens_and_what_it_serves_even_abbreviated() -> None:
    for args in (["--host", "0.0.0.0"], ["--port=9999"], ["--mod", "x"]):
        with pytest.raises(ValueError, match="set by the agent"):
            check_args("sim", args)
    check_args("sim", ["--slots", "4", "--tokens-per-second", "50", "--refuse-key", "K=429"])


def test_argparse_engines_also_refuse_prefixes_of_forbidden_flags() -> None:
    with pytest.raises(ValueError, match=r"--trust-remote .*runs code"):
        check_args("vllm", ["--trust-remote"])
    with pytest.raises(ValueError, match="--download-dir"):
        check_args("vllm", ["--download_dir=/tmp"])
    check_args("vllm", ["--max-model-len", "4096", "--tokenizer-mode", "auto"])
    check_args("vllm", ["--gpu-memory-utilization=0.9"])


def test_trust_remote_code_is_refused_for_every_engine() -> None:
    for engine in ("sim", "sglang", "trtllm", "freetoken"):
        with pytest.raises(ValueError, match="--trust-remote-code"):
            check_args(engine, ["--trust_remote_code"])
    check_args("sim", ["--tokens", "8"])
    with pytest.raises(ValueError, match="unknown engine"):
        check_args("nope", [])


def test_tuning_variables_are_allowed() -> None:
    check_env(
        {
            "CUDA_LAUNCH_BLOCKING": "1",
            "OMP_NUM_THREADS": "4",
            "GGML_SCHED_MAX_COPIES": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "FREETOKEN_PIN_BUDGET_GB": "8",
            "PYTHONUNBUFFERED": "1",
            "TZ": "UTC",
        }
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("LD_PRELOAD", "is not a tuning variable"),
        ("PYTHONPATH", "loads a file"),
        ("CUDA_PATH", "loads a file"),
        ("TORCH_PLUGIN_DIR", "loads a file"),
        ("NCCL_LIBRARY", "loads a file"),
        ("LLAMA_API_KEY", "is set by the agent"),
        ("FREETOKEN_API_KEY", "is set by the agent"),
        ("FREETOKEN_HOST", "is set by the agent"),
        ("FREETOKEN_MMPROJ", "loads a file"),
        ("HF_TOKEN", "is a credential"),
        ("LLAMA_ARG_HF_REPO", "downloads a model"),
        ("LLAMA_ARG_MODEL", "is set by the agent"),
    ],
)
def test_other_variables_are_refused_with_their_reason(name: str, reason: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} is refused: it {reason}"):
        check_env({name: "x"})


def test_what_an_engine_cannot_do_of_a_request_names_the_field() -> None:
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}]}
    no_jinja = ("--chat-template", "gemma", "--no-jinja")
    refused = unsupported_request("llamacpp", no_jinja, tools)
    assert refused is not None
    assert refused[0] == "tools"
    assert unsupported_request("llamacpp", ("--jinja",), tools) is None
    assert unsupported_request("llamacpp", (), {"n": 2}) == (
        "n",
        "runs on the llamacpp engine, which answers one choice: 'n' must be 1",
    )
    assert unsupported_request("sim", (), {"n": 2, **tools}) is None
    assert unsupported_request("llamacpp", no_jinja, {"n": 1, "tools": []}) is None

"""vLLM profiles in the catalog: refused flags are caught when the entry is
validated (``ctl model add``/``serve``), before anything reaches a node."""

from __future__ import annotations

import pytest

from llmgw.control.catalog import CatalogError, parse_model, validate_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _vllm(*args: str) -> dict[str, object]:
    return {
        "name": "qwen-small",
        "source": f"hf:Qwen/Qwen2.5-0.5B-Instruct@{COMMIT}",
        "origin": {  # an hf: source is pinned (``ctl model serve``)
            "kind": "hf",
            "repo": "Qwen/Qwen2.5-0.5B-Instruct",
            "revision": COMMIT,
            "files": [{"path": "model.safetensors", "size_bytes": 1, "sha256": "ab" * 32}],
            "main_file": "",
        },
        "profiles": [
            {
                "engine": "vllm",
                "gpu_class": "h100-80g",
                "gpus": 1,
                "context_tokens": 32768,
                "slots": 8,
                "args": list(args),
            }
        ],
    }


def test_a_vllm_profile_with_tuning_flags_is_valid() -> None:
    model = parse_model(_vllm("--gpu-memory-utilization=0.9", "--enable-prefix-caching"))
    validate_model(model)
    assert model.profiles[0].engine == "vllm"


@pytest.mark.parametrize(
    "flag",
    ["--trust-remote-code", "--trust-remote", "--trust_remote", "--trust-rem=1", "--trus"],
)
def test_trust_remote_code_in_a_vllm_profile_is_refused_naming_it(flag: str) -> None:
    with pytest.raises(CatalogError) as caught:
        validate_model(parse_model(_vllm("--dtype", "auto", flag)))
    text = str(caught.value)
    assert "profiles[0].args: vllm argument --trus" in text
    assert "is refused: it runs code from a model repository" in text
    assert flag.split("=", 1)[0] in text


def test_other_refused_vllm_flags_name_their_reason() -> None:
    with pytest.raises(CatalogError, match=r"--load-format is refused: it loads a file"):
        validate_model(parse_model(_vllm("--load-format", "pt")))
    with pytest.raises(CatalogError, match=r"--api-key is refused: it is a credential"):
        validate_model(parse_model(_vllm("--api-key=k")))


def test_a_vllm_profile_on_cpu_is_refused() -> None:
    doc = _vllm()
    profile = doc["profiles"][0]  # type: ignore[index]
    del profile["gpu_class"], profile["gpus"]
    profile["min_memory_gb"] = 8
    with pytest.raises(CatalogError, match="engine vllm runs on NVIDIA cards: give gpu_class"):
        validate_model(parse_model(doc))

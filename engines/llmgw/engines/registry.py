"""The engine registry, and the checks on engine arguments and environment.

:func:`get_adapter` names the adapters llmgw can run today (``llamacpp``,
``sim``, ``vllm``). :func:`check_args` and :func:`check_env` refuse what a model profile
must not pass to an engine: flags and variables that the agent sets, that
carry credentials, that load, download, write or serve files, log prompts,
run a model repository's code or send work to other hosts (``docs/catalog.md``:
every model's arguments are vetted on entry); each refusal is a
:class:`~llmgw.errors.InvalidInput` (a ValueError) naming the flag or variable and the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmgw.engines.base import EngineAdapter
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.sim.adapter import SimAdapter
from llmgw.engines.vllm import VllmAdapter
from llmgw.errors import InvalidInput

__all__ = [
    "ALLOWED_ENV_NAMES",
    "ALLOWED_ENV_PREFIXES",
    "ENGINE_NAMES",
    "KNOWN_ENGINE_NAMES",
    "check_args",
    "check_env",
    "get_adapter",
    "unsupported_request",
]

#: Engines :func:`get_adapter` can build.
ENGINE_NAMES = ("llamacpp", "sim", "vllm")

#: Every engine name llmgw knows, in order; :func:`check_args` accepts these.
KNOWN_ENGINE_NAMES = (
    "comfyui",
    "freetoken",
    "llamacpp",
    "sglang",
    "sim",
    "strata",
    "trtllm",
    "vllm",
)

LOADS_A_FILE = "loads a file"
DOWNLOADS_A_MODEL = "downloads a model"
IS_A_CREDENTIAL = "is a credential"
SET_BY_THE_AGENT = "is set by the agent"
WRITES_FILES = "writes files"
LOGS_PROMPTS = "logs prompts"
RUNS_REMOTE_CODE = "runs code from a model repository"
SERVES_FILES = "serves files from the node"
SENDS_THE_MODEL_AWAY = "sends work to other hosts"

#: Refused everywhere.
_EVERYWHERE = {"--trust-remote-code": RUNS_REMOTE_CODE}

#: llama.cpp's refused flags, short ones as written, with their long twins.
_LLAMACPP = {
    "-m": SET_BY_THE_AGENT,
    "--model": SET_BY_THE_AGENT,
    "--host": SET_BY_THE_AGENT,
    "--port": SET_BY_THE_AGENT,
    "--alias": SET_BY_THE_AGENT,
    "-a": SET_BY_THE_AGENT,
    "--api-key": IS_A_CREDENTIAL,
    "--api-key-file": IS_A_CREDENTIAL,
    "--hf-token": IS_A_CREDENTIAL,
    "-hft": IS_A_CREDENTIAL,
    "-hf": DOWNLOADS_A_MODEL,
    "-hfr": DOWNLOADS_A_MODEL,
    "--hf-repo": DOWNLOADS_A_MODEL,
    "-hff": DOWNLOADS_A_MODEL,
    "--hf-file": DOWNLOADS_A_MODEL,
    "-mu": DOWNLOADS_A_MODEL,
    "--model-url": DOWNLOADS_A_MODEL,
    "--mmproj-url": DOWNLOADS_A_MODEL,
    "-mmu": DOWNLOADS_A_MODEL,
    "--hf-repo-draft": DOWNLOADS_A_MODEL,
    "-hfd": DOWNLOADS_A_MODEL,
    "-hfrd": DOWNLOADS_A_MODEL,
    "--hf-repo-v": DOWNLOADS_A_MODEL,
    "-hfv": DOWNLOADS_A_MODEL,
    "--hf-file-v": DOWNLOADS_A_MODEL,
    "-hffv": DOWNLOADS_A_MODEL,
    "--model-draft": LOADS_A_FILE,
    "-md": LOADS_A_FILE,
    "-mm": LOADS_A_FILE,
    "--mmproj": LOADS_A_FILE,
    "-jf": LOADS_A_FILE,
    "--json-schema-file": LOADS_A_FILE,
    "--model-vocoder": LOADS_A_FILE,
    "-mv": LOADS_A_FILE,
    "--prompt-cache": WRITES_FILES,
    "--slot-save-path": WRITES_FILES,
    "--log-file": WRITES_FILES,
    "--logdir": LOGS_PROMPTS,
    "--path": SERVES_FILES,
    "--rpc": SENDS_THE_MODEL_AWAY,
}

#: Set from the profile's own fields, so the catalog's figures (context
#: per slot, reservations) stay true.
SET_BY_THE_PROFILE = "is set by the profile (context_tokens, slots, cpu_cores)"

_LLAMACPP.update(
    {
        "-c": SET_BY_THE_PROFILE,
        "--ctx-size": SET_BY_THE_PROFILE,
        "-np": SET_BY_THE_PROFILE,
        "--parallel": SET_BY_THE_PROFILE,
        "-t": SET_BY_THE_PROFILE,
        "--threads": SET_BY_THE_PROFILE,
    }
)

#: The sim engine's: where it listens and what it answers to.
_SIM = {
    "--host": SET_BY_THE_AGENT,
    "--port": SET_BY_THE_AGENT,
    "--model": SET_BY_THE_AGENT,
}

IMPORTS_CODE = "imports Python code on the node"
RUNS_REQUEST_TEMPLATES = "runs chat templates sent in requests"

#: vLLM 0.33's refused flags (``vllm serve --help``): what the agent sets,
#: what loads files or code, downloads, logs prompts or reaches other hosts.
_VLLM = {
    "--load-format": LOADS_A_FILE,
    "--download-dir": DOWNLOADS_A_MODEL,
    "--tokenizer": DOWNLOADS_A_MODEL,
    "--model": SET_BY_THE_AGENT,
    "--served-model-name": SET_BY_THE_AGENT,
    "--host": SET_BY_THE_AGENT,
    "--port": SET_BY_THE_AGENT,
    "--uds": SET_BY_THE_AGENT,
    "--revision": SET_BY_THE_AGENT,
    "--tensor-parallel-size": SET_BY_THE_AGENT,
    "-tp": SET_BY_THE_AGENT,
    "--api-key": IS_A_CREDENTIAL,
    "--hf-token": IS_A_CREDENTIAL,
    "--code-revision": RUNS_REMOTE_CODE,
    "--tokenizer-revision": DOWNLOADS_A_MODEL,
    "--hf-config-path": DOWNLOADS_A_MODEL,
    "--speculative-config": DOWNLOADS_A_MODEL,
    "--config": LOADS_A_FILE,
    "--generation-config": LOADS_A_FILE,
    "--lora-modules": LOADS_A_FILE,
    "--log-config-file": LOADS_A_FILE,
    "--ssl-keyfile": LOADS_A_FILE,
    "--ssl-certfile": LOADS_A_FILE,
    "--ssl-ca-certs": LOADS_A_FILE,
    "--allowed-local-media-path": SERVES_FILES,
    "--middleware": IMPORTS_CODE,
    "--tool-parser-plugin": IMPORTS_CODE,
    "--reasoning-parser-plugin": IMPORTS_CODE,
    "--logits-processors": IMPORTS_CODE,
    "--worker-cls": IMPORTS_CODE,
    "--worker-extension-cls": IMPORTS_CODE,
    "--trust-request-chat-template": RUNS_REQUEST_TEMPLATES,
    "--enable-log-requests": LOGS_PROMPTS,
    "--enable-log-outputs": LOGS_PROMPTS,
    "--headless": SENDS_THE_MODEL_AWAY,
    "--data-parallel-address": SENDS_THE_MODEL_AWAY,
    "--kv-transfer-config": SENDS_THE_MODEL_AWAY,
    "--kv-events-config": SENDS_THE_MODEL_AWAY,
    "--otlp-traces-endpoint": SENDS_THE_MODEL_AWAY,
    "--tool-server": SENDS_THE_MODEL_AWAY,
}

#: Engine -> refused flags (besides :data:`_EVERYWHERE`).
_REFUSED_FLAGS: dict[str, dict[str, str]] = {"llamacpp": _LLAMACPP, "vllm": _VLLM, "sim": _SIM}

#: Engines whose flags go through argparse, which takes unambiguous prefixes.
_ARGPARSE_ENGINES = frozenset({"vllm", "sglang", "comfyui", "strata", "freetoken", "sim"})

#: The shortest flag prefix (dashes included) refused for argparse engines.
_MIN_PREFIX = 4

#: Environment name prefixes that are tuning families.
ALLOWED_ENV_PREFIXES = (
    "CUDA_",
    "NCCL_",
    "NVIDIA_",
    "NVTE_",
    "GLOO_",
    "UCX_",
    "TORCH_",
    "PYTORCH_",
    "VLLM_",
    "SGLANG_",
    "GGML_",
    "LLAMA_",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "KMP_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TRITON_",
    "FLASHINFER_",
    "TRTLLM_",
    "TLLM_",
    "FREETOKEN_",
)

#: Environment names allowed exactly.
ALLOWED_ENV_NAMES = frozenset({"PYTHONUNBUFFERED", "PYTHONHASHSEED", "TZ"})

_REFUSED_ENV = {
    "LLAMA_API_KEY": SET_BY_THE_AGENT,
    "VLLM_API_KEY": SET_BY_THE_AGENT,
    "STRATA_API_KEY": SET_BY_THE_AGENT,
    "FREETOKEN_API_KEY": SET_BY_THE_AGENT,
    "FREETOKEN_HOST": SET_BY_THE_AGENT,
    "FREETOKEN_MMPROJ": LOADS_A_FILE,
    "CUDA_VISIBLE_DEVICES": SET_BY_THE_AGENT,
}

_REFUSED_ENV.update(
    {
        # vLLM's own (vllm/envs.py, 0.33).
        "VLLM_USE_MODELSCOPE": DOWNLOADS_A_MODEL,
        "VLLM_HOST_IP": SET_BY_THE_AGENT,
        "VLLM_PORT": SET_BY_THE_AGENT,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": LOADS_A_FILE,
        "VLLM_SERVER_DEV_MODE": "opens development endpoints",
        "VLLM_DEBUG_LOG_API_SERVER_RESPONSE": LOGS_PROMPTS,
        "VLLM_CACHE_ROOT": WRITES_FILES,
        "VLLM_CONFIG_ROOT": LOADS_A_FILE,
    }
)

#: Name substrings that point an engine at files, code or the network.
_REFUSED_ENV_SUBSTRINGS = {
    "PATH": LOADS_A_FILE,
    "PLUGIN": LOADS_A_FILE,
    "LIBRARY": LOADS_A_FILE,
    "ADDR": SET_BY_THE_AGENT,
}

#: Name words (split on ``_``) that make a variable a credential.
_CREDENTIAL_WORDS = frozenset({"KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS"})

#: llama.cpp reads ``LLAMA_ARG_<FLAG>`` as ``--<flag>``.
_LLAMA_ARG_PREFIX = "LLAMA_ARG_"


def get_adapter(name: str, *, llamacpp_bin: str | None = None, vllm_bin: str = "") -> EngineAdapter:
    """The adapter for engine ``name``.

    Args:
        name: one of :data:`ENGINE_NAMES` (``llamacpp``, ``sim``, ``vllm``).
        llamacpp_bin: a ``llama-server`` binary; None runs the bundled
            launcher (``python -m llmgw.engines.llamacpp``).
        vllm_bin: the ``vllm`` executable (the agent's installed one);
            "" = ``vllm`` from ``PATH``.

    Raises:
        InvalidInput: ``name`` is not available; the message lists those that are.
    """
    if name == "llamacpp":
        return LlamaCppAdapter(llamacpp_bin)
    if name == "sim":
        return SimAdapter()
    if name == "vllm":
        return VllmAdapter(bin=vllm_bin)
    raise InvalidInput(f"unknown engine {name!r}; available: {', '.join(ENGINE_NAMES)}")


def normalise_flag(arg: str) -> str:
    """The flag part of an argument, as the checks compare it.

    ``--a_b=1`` gives ``--a-b``; short flags (``-hf``) stay as written.
    """
    flag = arg.split("=", 1)[0]
    if flag.startswith("--"):
        flag = "--" + flag[2:].replace("_", "-")
    return flag


def _refusal(engine: str, flag: str) -> str | None:
    refused = {**_EVERYWHERE, **_REFUSED_FLAGS.get(engine, {})}
    reason = refused.get(flag)
    if reason is not None:
        return reason
    if engine in _ARGPARSE_ENGINES and "." in flag and flag.startswith("--"):
        # vLLM's JSON arguments: --speculative-config.model X sets a key of
        # --speculative-config.
        return _refusal(engine, flag.split(".", 1)[0])
    if engine in _ARGPARSE_ENGINES and flag.startswith("--") and len(flag) >= _MIN_PREFIX:
        # argparse expands an unambiguous prefix, so refuse prefixes too.
        for name, why in refused.items():
            if name.startswith("--") and name.startswith(flag):
                return why
    return None


def check_args(engine: str, args: Iterable[str]) -> None:
    """Refuse engine arguments a profile must not pass.

    Every argument starting with ``-`` is taken as a flag and normalised
    (:func:`normalise_flag`). llama.cpp's flags match exactly (it takes no
    abbreviations, so ``--chat-template`` is fine); argparse engines (vLLM,
    SGLang, ComfyUI, Strata, FreeToken) also refuse any prefix of at least
    4 characters of a refused long flag (``--trust-remote``).
    ``--trust-remote-code`` is refused for every engine.

    Raises:
        InvalidInput: ``engine`` is unknown, or a flag is refused; the message
            names the flag and the reason (``"--hf-repo downloads a model"``).
    """
    if engine not in KNOWN_ENGINE_NAMES:
        raise InvalidInput(f"unknown engine {engine!r}; known: {', '.join(KNOWN_ENGINE_NAMES)}")
    for arg in args:
        if not arg.startswith("-") or arg == "-":
            continue
        flag = normalise_flag(arg)
        reason = _refusal(engine, flag)
        if reason is not None:
            given = arg.split("=", 1)[0]
            shown = flag if flag == given else f"{flag} (given as {given})"
            raise InvalidInput(f"{engine} argument {shown} is refused: it {reason}")


def _env_refusal(name: str) -> str | None:
    if not name or "=" in name or "\0" in name:
        return "is not a variable name"
    upper = name.upper()
    reason = _REFUSED_ENV.get(upper)
    if reason is not None:
        return reason
    if upper.startswith(_LLAMA_ARG_PREFIX):
        flag = "--" + upper[len(_LLAMA_ARG_PREFIX) :].lower().replace("_", "-")
        reason = _LLAMACPP.get(flag)
        if reason is not None:
            return f"{reason} (llama.cpp reads it as {flag})"
    for part in upper.split("_"):
        if part in _CREDENTIAL_WORDS:
            return IS_A_CREDENTIAL
    for substring, why in _REFUSED_ENV_SUBSTRINGS.items():
        if substring in upper:
            return why
    if name in ALLOWED_ENV_NAMES or name.startswith(ALLOWED_ENV_PREFIXES):
        return None
    return "is not a tuning variable"


def check_env(env: Mapping[str, str] | Iterable[str]) -> None:
    """Refuse environment variables a profile must not set for an engine.

    Allowed: names starting with one of :data:`ALLOWED_ENV_PREFIXES` (tuning
    families: ``CUDA_``, ``GGML_``, ``OMP_`` …) and exactly the names in
    :data:`ALLOWED_ENV_NAMES`. Refused even then: the keys and addresses the
    agent sets (``LLAMA_API_KEY``, ``FREETOKEN_HOST`` …), credentials (a
    ``KEY``/``TOKEN``/``SECRET``/``PASSWORD`` word: ``HF_TOKEN``), names
    containing ``PATH``, ``PLUGIN``, ``LIBRARY`` or ``ADDR``, and
    ``LLAMA_ARG_*`` spellings of refused llama.cpp flags (``LLAMA_ARG_HF_REPO``).
    Values are not checked.

    Raises:
        InvalidInput: a name is refused; the message names it and the reason.
    """
    for name in env:
        reason = _env_refusal(name)
        if reason is not None:
            raise InvalidInput(f"environment variable {name} is refused: it {reason}")


#: Engines that answer ``n`` choices in one request.
_ANSWER_N_CHOICES = frozenset({"sim", "vllm", "sglang"})


def unsupported_request(
    engine: str, args: Sequence[str], doc: Mapping[str, Any]
) -> tuple[str, str] | None:
    """What an engine run with ``args`` cannot do of a chat or completions
    request ``doc``: ``(field, why)`` for the first such field, else None.

    - ``n`` other than 1 on engines that answer one choice (llama.cpp);
    - ``tools`` on llama.cpp run with ``--no-jinja``: its built-in templates
      take none (it answers 500 "tools param requires --jinja flag").
    """
    if doc.get("tools") and engine == "llamacpp" and "--no-jinja" in args and "--jinja" not in args:
        return (
            "tools",
            "runs on llama.cpp without Jinja templates (--no-jinja), which cannot take "
            "tools; ask for a model whose profile runs with --jinja",
        )
    n = doc.get("n")
    if n is not None and n != 1 and engine not in _ANSWER_N_CHOICES:
        return "n", f"runs on the {engine} engine, which answers one choice: 'n' must be 1"
    return None

"""vLLM: the adapter that runs ``vllm serve`` on a node's cards.

Targets vLLM **0.33.0** (:data:`VLLM_VERSION`; installed by the agent into
its own environment, ``docs/engines.md``). One process per shard::

    vllm serve MODEL_DIR --served-model-name NAME --host B --port P
        --max-model-len N --max-num-seqs S --load-format safetensors
        [--tensor-parallel-size G] [--revision COMMIT] *profile args

- ``MODEL_DIR`` is ``ShardLaunch.model_path``: the directory the agent
  fetched and checked (``config.json``, tokenizer, ``*.safetensors``). A
  Hugging Face id (``org/name``) is taken only with a pinned ``revision``
  (a 40-hex commit), given to vLLM as ``--revision``;
- ``--load-format safetensors`` always: vLLM then loads no pickle file
  (``*.bin``, ``*.pt``) even when one lies in the directory;
- ``--max-model-len`` is the context of one sequence
  (``context_tokens // slots``, as llama.cpp's ``--ctx-size`` is shared by
  its slots), ``--max-num-seqs`` the slots; a profile's own
  ``--max-model-len`` comes later and wins (argparse keeps the last);
- ``--tensor-parallel-size`` is the number of cards the shard was given
  (``CUDA_VISIBLE_DEVICES`` names them), left out without cards;
- the key travels in ``VLLM_API_KEY`` only (vLLM checks it on ``/v1/*``,
  not on ``/health``, ``/metrics`` nor its ``/invocations`` route).

Readiness: ``GET /health`` answers 200, then ``GET /v1/models`` (with the
key) lists the served name (:meth:`VllmAdapter.models_path`,
:func:`~llmgw.engines.base.lists_model`). Metrics: Prometheus at ``/metrics`` with vLLM's names
(:data:`RUNNING_METRIC`, :data:`WAITING_METRIC`, :data:`KV_USAGE_METRICS`),
which the router reads for KV-aware routing (``docs/engines.md``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

import attrs

from llmgw.engines.base import Command, ShardLaunch, engine_env, error_line, short

__all__ = [
    "KEY_ENV",
    "KV_USAGE_METRICS",
    "RUNNING_METRIC",
    "VLLM_VERSION",
    "WAITING_METRIC",
    "VllmAdapter",
    "failure_cause",
    "is_hub_id",
]

#: The vLLM release this adapter's command line and names are written for.
VLLM_VERSION: Final = "0.33.0"
#: The environment variable vLLM reads its key from.
KEY_ENV: Final = "VLLM_API_KEY"
#: Requests generating now (a gauge, labelled ``model_name``, ``engine``).
RUNNING_METRIC: Final = "vllm:num_requests_running"
#: Requests queued, waiting for room in the KV cache.
WAITING_METRIC: Final = "vllm:num_requests_waiting"
#: The KV cache's used share (0 to 1): the V1 engine's name, then the V0 name
#: older releases export.
KV_USAGE_METRICS: Final = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

_COMMIT: Final = re.compile(r"^[0-9a-f]{40}$")
#: vLLM's log prefix, e.g. ``(EngineCore_DP0 pid=4242) ERROR 12-02 00:41:07 [core.py:710] ``.
_LOG_PREFIX: Final = re.compile(
    r"^(?:\([\w ]+pid=\d+\) )?(?:(?:INFO|WARNING|ERROR|CRITICAL|DEBUG) \d\d-\d\d [\d:]+ \[[^\]]*\] )?"
)


def is_hub_id(source: str) -> bool:
    """Whether ``source`` reads as a Hugging Face id (``org/name``) rather than
    a local path: not empty; no leading ``/`` or ``.``; no ``://``; exactly one
    ``/``; no ``:``. The file system is not
    looked at: the agent hands vLLM a directory it fetched, by absolute path."""
    return (
        bool(source)
        and not source.startswith(("/", "."))
        and "://" not in source
        and source.count("/") == 1
        and ":" not in source
    )


@attrs.frozen(kw_only=True)
class VllmAdapter:
    """The :class:`~llmgw.engines.base.EngineAdapter` for vLLM.

    Args:
        bin: the ``vllm`` executable; ``vllm`` from ``PATH`` when empty (the
            agent gives the one in the environment it installed).
    """

    bin: str = ""

    @property
    def name(self) -> str:
        return "vllm"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str:
        return "/metrics"

    def models_path(self) -> str:
        """Readiness also needs ``GET /v1/models`` to list the served name:
        vLLM answers ``/health`` before its OpenAI routes serve in some
        releases, and a wrong ``--served-model-name`` must not count as ready."""
        return "/v1/models"

    def failure_cause(self, lines: Sequence[str]) -> str:
        """See :func:`failure_cause`."""
        return failure_cause(lines)

    def commands(self, shard: ShardLaunch) -> list[Command]:
        """One process, ``[bin, serve, model_path, …]`` (module docstring);
        ``env`` holds ``VLLM_API_KEY`` (when the shard has a key) and
        ``CUDA_VISIBLE_DEVICES``.

        Raises:
            ValueError: no ``model_path``; a Hugging Face id without a pinned
                40-hex ``revision``; ``slots`` or ``context_tokens`` below 1.
        """
        model = shard.model_path
        if not model:
            raise ValueError("vllm needs a model directory (model_path is empty)")
        if shard.slots < 1 or shard.context_tokens < shard.slots:
            raise ValueError(
                f"vllm needs at least one slot and one token per slot "
                f"(slots {shard.slots}, context_tokens {shard.context_tokens})"
            )
        flags = [
            "serve",
            model,
            "--served-model-name",
            shard.served_model_name,
            "--host",
            shard.bind_addr,
            "--port",
            str(shard.http_port),
            "--max-model-len",
            str(shard.context_tokens // shard.slots),
            "--max-num-seqs",
            str(shard.slots),
            "--load-format",
            "safetensors",
        ]
        if shard.gpu_indices:
            flags += ["--tensor-parallel-size", str(len(shard.gpu_indices))]
        if is_hub_id(model):
            if not _COMMIT.match(shard.revision):
                raise ValueError(
                    f"vllm would download {model} itself: a pinned revision (a 40-hex "
                    f"commit) is needed, not {shard.revision or 'none'!r}"
                )
            flags += ["--revision", shard.revision]
        flags += shard.args
        env = engine_env(shard, KEY_ENV)
        return [Command(name="vllm", path=self.bin or "vllm", args=tuple(flags), env=env)]


def failure_cause(lines: Sequence[str]) -> str:
    """Why vLLM failed, from its output ``lines`` (oldest first); ``""`` when
    no line reports an error.

    vLLM's log prefix (``(EngineCore_DP0 pid=N) ERROR 12-02 00:41:07
    [core.py:710] ``) is taken off first; then the first Python exception line
    wins (``torch.OutOfMemoryError: CUDA out of memory …``, ``ValueError: …``)
    except vLLM's own summary ``RuntimeError: Engine core initialization
    failed. See root cause above.``, which points at an earlier one; else
    :func:`~llmgw.engines.base.error_line`. Prefixed ``vllm: ``.
    """
    bare = [_LOG_PREFIX.sub("", line, count=1) for line in lines]
    summary = "Engine core initialization failed"
    kept = [line for line in bare if summary not in line]
    cause = error_line(kept) or error_line(bare)
    return short(f"vllm: {cause}") if cause else ""

"""The sim engine's counters, and the Prometheus text of ``GET /metrics``
(vLLM's series names, so the control plane reads the sim as it reads vLLM)."""

from __future__ import annotations

import attrs

__all__ = ["Counters", "metrics_text"]


@attrs.define
class Counters:
    """What a sim engine counted since it started.

    Attributes:
        prompt_tokens: prompt tokens read (generation and embeddings).
        generation_tokens: tokens generated.
        cache_queries: prompt tokens looked up in the prefix cache.
        cache_hits: prompt tokens found there.
        finished: requests finished, by finish reason (``stop``,
            ``length``, ``abort``).
        failed: requests failed on purpose (``--fail-rate``).
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    finished: dict[str, int] = attrs.field(factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    failed: int = 0

    def generated(self, tokens: int) -> None:
        """Count ``tokens`` more generated tokens."""
        self.generation_tokens += tokens

    def finish(self, reason: str) -> None:
        """Count a request finished with OpenAI's ``finish_reason`` (vLLM
        counts a tool call's end, ``tool_calls``, as a plain ``stop``)."""
        self.finished["stop" if reason == "tool_calls" else reason] += 1


def metrics_text(model: str, slots: int, running: int, waiting: int, counters: Counters) -> str:
    """The Prometheus text served at ``/metrics``: vLLM's series for ``model``
    (``running``/``waiting`` requests; KV cache use as the fraction of
    ``slots`` in use, 0 when unlimited), then ``llmgw_sim_failures_total``."""
    label = '{model_name="' + model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
    usage = min(1.0, running / slots) if slots else 0.0
    lines = [
        "# HELP vllm:num_requests_running Number of requests generating now.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{label} {running}",
        "# HELP vllm:num_requests_waiting Number of requests waiting for a slot.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{label} {waiting}",
        "# HELP vllm:kv_cache_usage_perc Fraction of slots in use (1 means full).",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{label} {usage}",
        "# HELP vllm:prompt_tokens_total Prompt tokens read.",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{label} {counters.prompt_tokens}",
        "# HELP vllm:generation_tokens_total Tokens generated.",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{label} {counters.generation_tokens}",
        "# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{label} {counters.cache_queries}",
        "# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{label} {counters.cache_hits}",
        "# HELP vllm:request_success_total Requests finished, by finish reason.",
        "# TYPE vllm:request_success_total counter",
    ]
    inner = label[1:-1]
    for reason, count in counters.finished.items():
        lines.append(f'vllm:request_success_total{{{inner},finished_reason="{reason}"}} {count}')
    lines += [
        "# HELP llmgw_sim_failures_total Requests failed on purpose (--fail-rate).",
        "# TYPE llmgw_sim_failures_total counter",
        f"llmgw_sim_failures_total{label} {counters.failed}",
    ]
    return "\n".join(lines) + "\n"

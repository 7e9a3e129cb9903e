"""The control plane's Prometheus metrics.

One registry per process, served on its own listener (:9091 by default,
never the admin port).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["REGISTRY"]

REGISTRY: Final = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS_S: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

REQUESTS: Final = Counter(
    "llmgw_requests",
    "Client requests answered, by model and HTTP status.",
    ["model", "status"],
    registry=REGISTRY,
)
REQUEST_DURATION: Final = Histogram(
    "llmgw_request_duration_seconds",
    "Whole request time, from the first byte read to the last byte sent.",
    ["model"],
    buckets=_LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
TTFT: Final = Histogram(
    "llmgw_ttft_seconds",
    "Time to first token of streamed answers.",
    ["model"],
    buckets=_LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
TOKENS: Final = Counter(
    "llmgw_tokens",
    "Tokens processed, by model and direction (prompt, cached, completion).",
    ["model", "direction"],
    registry=REGISTRY,
)
GUARD_VERDICTS: Final = Counter(
    "llmgw_guard_verdicts",
    "Requests in which a guard rule matched, by rule id and the action it took"
    " (flag, mask, redact, block).",
    ["rule", "action"],
    registry=REGISTRY,
)
GUARD_DURATION: Final = Histogram(
    "llmgw_guard_duration_seconds",
    "Time spent guarding one request, both directions.",
    buckets=(0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5),
    registry=REGISTRY,
)
IN_FLIGHT: Final = Gauge(
    "llmgw_requests_in_flight", "Client requests being answered now.", registry=REGISTRY
)
USAGE_QUEUE_DEPTH: Final = Gauge(
    "llmgw_usage_queue_depth", "Usage rows waiting to be written.", registry=REGISTRY
)
USAGE_DROPPED: Final = Counter(
    "llmgw_usage_dropped", "Usage rows dropped because the buffer was full.", registry=REGISTRY
)
USAGE_WRITE_FAILURES: Final = Counter(
    "llmgw_usage_write_failures", "Failed attempts to write a usage batch.", registry=REGISTRY
)
USAGE_JOURNAL_BYTES: Final = Gauge(
    "llmgw_usage_journal_bytes",
    "Bytes of usage rows in the local journal not yet known to be in the store.",
    registry=REGISTRY,
)

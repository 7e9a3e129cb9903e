"""The engines' own metrics, scraped for the router (``docs/api.md``,
Which replica answers).

Every :data:`SCRAPE_EVERY_S` the control plane reads ``GET /metrics`` of
each Ready replica with its engine key and keeps, on the replica's
:class:`~llmgw.router.endpoint.Endpoint`, the free share of its KV cache
(``kv_free_ratio``), which the ``long-context`` profile ranks by. Outside
providers are not scraped (the router counts their requests itself), and a
replica whose metrics cannot be read keeps ``None`` ("unknown").

Metric names read, the first found wins (usage is a 0 to 1 share everywhere):

- vLLM: ``vllm:kv_cache_usage_perc``, older ``vllm:gpu_cache_usage_perc``;
- llama.cpp (``--metrics``): ``llamacpp:kv_cache_usage_ratio``;
- SGLang: ``sglang:token_usage``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NoReturn, Protocol

import httpx
import trio

from llmgw.router.endpoint import Endpoint

__all__ = [
    "KV_USAGE_METRICS",
    "SCRAPE_EVERY_S",
    "HasEndpoints",
    "kv_free_ratio",
    "serve_engine_metrics",
]

log = logging.getLogger("llmgw.router.metrics")

#: Seconds between two scrapes of every replica.
SCRAPE_EVERY_S: Final = 2.0
#: Deadline of one scrape, in seconds.
SCRAPE_TIMEOUT_S: Final = 1.0
#: Names of a KV-cache usage share (0 = empty, 1 = full), by preference.
KV_USAGE_METRICS: Final = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "llamacpp:kv_cache_usage_ratio",
    "sglang:token_usage",
)


def kv_free_ratio(text: str) -> float | None:
    """The free share of the KV cache (0 to 1) in a Prometheus text exposition,
    from the first of :data:`KV_USAGE_METRICS` present; ``None`` when none
    is. Several samples of one metric (labels per model) are averaged."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        name = line[:name_end]
        if name not in KV_USAGE_METRICS:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if value == value:  # not NaN
            found.setdefault(name, []).append(value)
    for name in KV_USAGE_METRICS:
        values = found.get(name)
        if values:
            usage = sum(values) / len(values)
            return min(1.0, max(0.0, 1.0 - usage))
    return None


class HasEndpoints(Protocol):
    """What the scraper reads: every model's ready endpoints (the control
    plane's ``Cluster`` is one)."""

    @property
    def endpoints(self) -> Mapping[str, Sequence[Endpoint]]: ...


async def scrape_once(client: httpx.AsyncClient, endpoints: Iterable[Endpoint]) -> None:
    """Read every endpoint's metrics at once; each within :data:`SCRAPE_TIMEOUT_S`."""

    async def one(endpoint: Endpoint) -> None:
        ratio = None
        with trio.move_on_after(SCRAPE_TIMEOUT_S):
            try:
                response = await client.get(
                    f"{endpoint.base_url}/metrics",
                    headers={k.decode(): v.decode() for k, v in endpoint.auth_headers},
                )
                if response.status_code == 200:
                    ratio = kv_free_ratio(response.text)
            except httpx.HTTPError as exc:
                log.debug("metrics of %s unreadable: %r", endpoint.label, exc)
        endpoint.kv_free_ratio = ratio

    async with trio.open_nursery() as nursery:
        for endpoint in endpoints:
            if not endpoint.external:
                nursery.start_soon(one, endpoint)


async def serve_engine_metrics(
    cluster: HasEndpoints, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> NoReturn:
    """Scrape the Ready replicas of ``cluster`` every :data:`SCRAPE_EVERY_S`
    until cancelled (module docstring)."""
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
        task_status.started()
        while True:
            endpoints = [e for eps in cluster.endpoints.values() for e in eps]
            await scrape_once(client, endpoints)
            await trio.sleep(SCRAPE_EVERY_S)

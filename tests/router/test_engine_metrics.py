"""Reading the engines' KV-cache usage for the long-context profile."""

from __future__ import annotations

import httpx

from llmgw.engines.testing import open_sim
from llmgw.router.endpoint import Endpoint
from llmgw.router.engine_metrics import kv_free_ratio, scrape_once


def test_vllm_usage_becomes_the_free_share() -> None:
    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    )
    assert kv_free_ratio(text) == 0.75


def test_llamacpp_ratio_is_read_and_the_preferred_name_wins() -> None:
    assert kv_free_ratio("llamacpp:kv_cache_usage_ratio 0.5\n") == 0.5
    text = "llamacpp:kv_cache_usage_ratio 0.5\nvllm:kv_cache_usage_perc 0.1\n"
    assert kv_free_ratio(text) == 0.9


def test_no_known_metric_nan_or_nonsense_is_unknown() -> None:
    assert kv_free_ratio("") is None
    assert kv_free_ratio("llamacpp:requests_processing 3\n") is None
    assert kv_free_ratio("vllm:kv_cache_usage_perc NaN\n") is None
    assert kv_free_ratio("vllm:kv_cache_usage_perc lots\n") is None


def test_usage_outside_zero_to_one_is_clamped() -> None:
    assert kv_free_ratio("vllm:kv_cache_usage_perc 1.5\n") == 0.0


async def test_a_running_sim_is_scraped_with_its_engine_key_and_a_dead_one_is_unknown() -> None:
    async with open_sim("--slots", "4", api_key="engine-key") as sim:
        live = Endpoint(
            replica_id="r-0", model="m", host="127.0.0.1", port=sim.port, api_key="engine-key"
        )
        wrong_key = Endpoint(
            replica_id="r-1", model="m", host="127.0.0.1", port=sim.port, api_key="nope"
        )
        dead = Endpoint(replica_id="r-2", model="m", host="127.0.0.1", port=1, api_key="x")
        dead.kv_free_ratio = 0.3
        async with httpx.AsyncClient() as client:
            await scrape_once(client, [live, wrong_key, dead])
    assert live.kv_free_ratio == 1.0  # idle: nothing in the cache
    assert wrong_key.kv_free_ratio is None
    assert dead.kv_free_ratio is None

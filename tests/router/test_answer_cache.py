"""The exact answer cache: keys, TTL, LRU within bytes, metrics."""

from __future__ import annotations

from typing import Any

from llmgw.metrics import REGISTRY
from llmgw.router.cache import (
    CACHE_REQUESTS,
    ENTRY_OVERHEAD_BYTES,
    AnswerCache,
    CachedAnswer,
    cache_key,
)

DOC: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "2+2?"}],
    "temperature": 0,
    "max_tokens": 16,
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def answer(body: bytes, *, stream: bool = False) -> CachedAnswer:
    return CachedAnswer(
        status=200,
        content_type=b"text/event-stream" if stream else b"application/json",
        body=body,
        stream=stream,
        stored_at=1_700_000_000.0,
    )


def key(n: int) -> bytes:
    return cache_key("p", "m", "chat", {**DOC, "seed": n})


# --- keys -----------------------------------------------------------------------------------


def test_the_key_ignores_field_order_and_fields_that_do_not_change_the_answer() -> None:
    base = cache_key("p1", "m", "chat", DOC)
    assert len(base) == 32
    reordered = dict(reversed(list(DOC.items())))
    assert cache_key("p1", "m", "chat", reordered) == base
    assert cache_key("p1", "m", "chat", {**DOC, "user": "alice", "metadata": {"a": 1}}) == base
    nested = {**DOC, "response_format": {"type": "json_schema", "json_schema": {"b": 1, "a": 2}}}
    nested_reordered = {
        **DOC,
        "response_format": {"json_schema": {"a": 2, "b": 1}, "type": "json_schema"},
    }
    assert cache_key("p1", "m", "chat", nested) == cache_key("p1", "m", "chat", nested_reordered)


def test_the_key_changes_with_what_changes_the_answer() -> None:
    base = cache_key("p1", "m", "chat", DOC)
    others = {
        cache_key("p2", "m", "chat", DOC),
        cache_key("p1", "n", "chat", DOC),
        cache_key("p1", "m", "completions", DOC),
        cache_key("p1", "m", "chat", {**DOC, "messages": [{"role": "user", "content": "2+3?"}]}),
        cache_key("p1", "m", "chat", {**DOC, "temperature": 0.7}),
        cache_key("p1", "m", "chat", {**DOC, "max_tokens": 17}),
        cache_key("p1", "m", "chat", {**DOC, "stream": True}),
        cache_key("p1", "m", "chat", {**DOC, "tools": [{"type": "function"}]}),
        cache_key("p1", "m", "chat", {**DOC, "response_format": {"type": "json_object"}}),
        cache_key("p1", "m", "chat", {**DOC, "stop": ["\n"]}),
        cache_key("p1", "m", "chat", {**DOC, "seed": 7}),
    }
    assert base not in others
    assert len(others) == 11


# --- the cache --------------------------------------------------------------------------------


def test_get_returns_what_was_put_until_its_ttl_ends() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock)
    streamed = answer(b'data: {"x":1}\n\ndata: [DONE]\n\n', stream=True)
    assert cache.get(key(1)) is None
    assert cache.put(key(1), streamed, ttl_s=60)
    assert cache.get(key(1)) is streamed
    assert cache.entries == 1
    assert cache.bytes == streamed.size + 32 + ENTRY_OVERHEAD_BYTES
    clock.now += 60
    assert cache.get(key(1)) is None  # expired, dropped
    assert cache.entries == 0
    assert cache.bytes == 0


def test_answers_larger_than_max_entry_bytes_or_without_ttl_are_not_kept() -> None:
    cache = AnswerCache(max_entry_bytes=100, clock=Clock())
    big = answer(b"x" * 200)
    assert big.size > 100
    assert not cache.put(key(1), big, ttl_s=60)
    assert not cache.put(key(2), answer(b"{}"), ttl_s=0)
    assert cache.entries == 0


def test_the_least_recently_used_go_first_to_stay_within_max_bytes() -> None:
    one = answer(b"x" * 100)
    cost = one.size + 32 + ENTRY_OVERHEAD_BYTES
    cache = AnswerCache(max_bytes=3 * cost, clock=Clock())
    for n in (1, 2, 3):
        assert cache.put(key(n), answer(b"x" * 100), ttl_s=60)
    assert cache.get(key(1)) is not None  # 1 is now the most recently used
    assert cache.put(key(4), one, ttl_s=60)
    assert cache.get(key(2)) is None
    assert all(cache.get(key(n)) is not None for n in (1, 3, 4))
    assert cache.bytes == 3 * cost
    assert not AnswerCache(max_bytes=cost - 1).put(key(1), one, ttl_s=60)


def test_putting_a_key_again_replaces_its_answer_and_its_bytes() -> None:
    cache = AnswerCache(clock=Clock())
    cache.put(key(1), answer(b"x" * 100), ttl_s=60)
    newer = answer(b"y" * 10)
    cache.put(key(1), newer, ttl_s=60)
    assert cache.get(key(1)) is newer
    assert cache.entries == 1
    assert cache.bytes == newer.size + 32 + ENTRY_OVERHEAD_BYTES


def test_prune_discard_and_clear() -> None:
    clock = Clock()
    cache = AnswerCache(clock=clock)
    cache.put(key(1), answer(b"a"), ttl_s=10)
    cache.put(key(2), answer(b"b"), ttl_s=100)
    cache.put(key(3), answer(b"c"), ttl_s=100)
    clock.now += 50
    assert cache.prune() == 1
    cache.discard(key(2))
    cache.discard(key(2))
    assert len(cache) == 1
    cache.clear()
    assert (cache.entries, cache.bytes) == (0, 0)


def test_age_is_whole_seconds_since_stored() -> None:
    stored = answer(b"{}")
    assert stored.age_s(stored.stored_at + 12.7) == 12
    assert stored.age_s(stored.stored_at - 5) == 0


def test_metrics_are_in_the_control_planes_registry_and_follow_the_cache() -> None:
    def value(name: str, labels: dict[str, str] | None = None) -> float:
        found = REGISTRY.get_sample_value(name, labels or {})
        assert found is not None
        return float(found)

    CACHE_REQUESTS.labels("m", "hit").inc()
    assert value("llmgw_cache_requests_total", {"model": "m", "result": "hit"}) >= 1
    before_bytes, before_entries = value("llmgw_cache_bytes"), value("llmgw_cache_entries")
    cache = AnswerCache(clock=Clock())
    cache.put(key(1), answer(b"abc"), ttl_s=60)
    cache.put(key(2), answer(b"abcd"), ttl_s=60)
    assert value("llmgw_cache_entries") == before_entries + 2
    assert value("llmgw_cache_bytes") == before_bytes + cache.bytes
    cache.discard(key(1))
    cache.clear()
    assert value("llmgw_cache_entries") == before_entries
    assert value("llmgw_cache_bytes") == before_bytes

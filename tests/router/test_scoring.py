"""Routing profiles, session affinity and the Endpoint's routing fields."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from llmgw.router.breaker import BreakerState
from llmgw.router.endpoint import Endpoint
from llmgw.router.scoring import PROFILES, choose, session_key


def ep(name: str, **kwargs: Any) -> Endpoint:
    return Endpoint(replica_id=name, model="m", host="127.0.0.1", port=8000, api_key="k", **kwargs)


def pick(endpoints: list[Endpoint], profile: str, **kwargs: Any) -> str:
    chosen = choose(endpoints, profile, **kwargs)
    assert chosen is not None
    return chosen.replica_id


def rng() -> random.Random:
    return random.Random(1234)


# --- Endpoint --------------------------------------------------------------------------


def test_endpoint_ttft_is_an_ewma_and_the_first_observation_is_taken_as_is() -> None:
    e = ep("a")
    assert e.ttft_ewma_s is None
    e.observe_ttft(1.0)
    assert e.ttft_ewma_s == 1.0
    e.observe_ttft(2.0)
    assert e.ttft_ewma_s == pytest.approx(1.0 + Endpoint.TTFT_ALPHA)
    e.observe_ttft(float("nan"))
    e.observe_ttft(-1.0)
    assert e.ttft_ewma_s == pytest.approx(1.0 + Endpoint.TTFT_ALPHA)


def test_endpoint_url_label_and_repr_hide_the_key() -> None:
    plain = ep("r1")
    assert plain.base_url == "http://127.0.0.1:8000"
    assert plain.label == "r1"
    outside = Endpoint(
        replica_id="external:gpt#2",
        model="gpt",
        host="api.example.com",
        port=443,
        api_key="sk-secret",
        tls=True,
        external=True,
        path_prefix="/openai",
    )
    assert outside.base_url == "https://api.example.com:443/openai"
    assert outside.label == "external:gpt#2"
    assert "sk-secret" not in repr(outside)
    assert outside.breaker is not plain.breaker


# --- choose -------------------------------------------------------------------------------


def test_an_unknown_profile_is_refused_even_without_endpoints() -> None:
    assert frozenset({"chat", "batch", "long-context"}) == PROFILES
    with pytest.raises(ValueError, match="unknown routing profile"):
        choose([], "fastest")
    assert choose([], "chat") is None


def test_batch_takes_the_shortest_queue() -> None:
    a, b, c = ep("a", in_flight=3), ep("b", in_flight=1), ep("c", in_flight=2)
    assert choose([a, b, c], "batch", rng=rng()) is b


def test_ties_are_spread() -> None:
    a, b = ep("a"), ep("b")
    draw = rng()
    picks = Counter(pick([a, b], "batch", rng=draw) for _ in range(200))
    assert set(picks) == {"a", "b"}


def test_long_context_takes_the_most_free_kv_cache_then_the_shortest_queue() -> None:
    a = ep("a", kv_free_ratio=0.2)
    b = ep("b", kv_free_ratio=0.9, in_flight=5)
    c = ep("c")  # unknown: 0.5
    assert choose([a, b, c], "long-context", rng=rng()) is b
    d = ep("d", kv_free_ratio=0.9, in_flight=2)
    assert choose([a, b, c, d], "long-context", rng=rng()) is d
    assert choose([a, c], "long-context", rng=rng()) is c


def test_excluded_and_broken_endpoints_are_skipped() -> None:
    a, b, c = ep("a"), ep("b", in_flight=1), ep("c", in_flight=2)
    a.breaker.failure(0.0, status=429)
    assert choose([a, b, c], "batch", exclude={"b"}, now=1.0, rng=rng()) is c
    assert choose([a, b, c], "batch", exclude={"b", "c"}, now=1.0) is None


def test_only_the_chosen_endpoint_takes_its_half_open_probe() -> None:
    a, b = ep("a", in_flight=0), ep("b", in_flight=5)
    a.breaker.failure(0.0, status=429)
    b.breaker.failure(0.0, status=429)
    assert choose([a, b], "batch", now=100.0, rng=rng()) is a
    assert a.breaker.state is BreakerState.HALF_OPEN
    assert b.breaker.available(100.0)
    # a's probe is out: b is the only choice now.
    assert choose([a, b], "batch", now=100.0, rng=rng()) is b
    assert choose([a, b], "batch", now=100.0, rng=rng()) is None


def test_chat_without_a_session_sends_most_to_the_fast_replica_and_some_to_the_slow() -> None:
    fast = ep("fast", ttft_ewma_s=0.1, slots=4)
    slow = ep("slow", ttft_ewma_s=0.4, slots=4)
    for _ in range(24):  # requests arriving while none has finished
        chosen = choose([fast, slow], "chat", rng=rng())
        assert chosen is not None
        chosen.in_flight += 1
    assert fast.in_flight > 2 * slow.in_flight
    assert slow.in_flight > 0
    # Idle again: everything to the fast one.
    fast.in_flight = slow.in_flight = 0
    assert choose([fast, slow], "chat", rng=rng()) is fast


def test_chat_tries_an_unmeasured_replica_as_if_it_were_the_fastest() -> None:
    known = ep("known", ttft_ewma_s=0.3, in_flight=1, slots=4)
    new = ep("new")
    assert choose([known, new], "chat", rng=rng()) is new


def test_a_session_sticks_to_one_replica_whatever_the_order_and_load() -> None:
    endpoints = [ep(f"r{i}", slots=8) for i in range(4)]
    first = choose(endpoints, "chat", session="u:alice", rng=rng())
    assert first is not None
    first.in_flight = 5  # busier than the rest, not saturated
    for order in (endpoints, endpoints[::-1]):
        assert choose(order, "chat", session="u:alice", rng=rng()) is first
    sessions = {f"s{i}" for i in range(200)}
    owners = Counter(pick(endpoints, "chat", session=s) for s in sessions)
    assert len(owners) == 4  # sessions spread over every replica


def test_removing_a_replica_moves_only_its_own_sessions() -> None:
    endpoints = [ep(f"r{i}") for i in range(4)]
    sessions = [f"s{i}" for i in range(300)]
    before = {s: choose(endpoints, "chat", session=s) for s in sessions}
    gone = endpoints[2]
    after = {s: choose(endpoints[:2] + endpoints[3:], "chat", session=s) for s in sessions}
    moved = [s for s in sessions if before[s] is not after[s]]
    assert moved
    assert all(before[s] is gone for s in moved)


def test_a_broken_session_replica_hands_over_to_the_same_neighbour_every_time() -> None:
    endpoints = [ep(f"r{i}") for i in range(4)]
    home = choose(endpoints, "chat", session="x", now=0.0)
    assert home is not None
    home.breaker.failure(0.0, status=429)
    stand_in = choose(endpoints, "chat", session="x", now=1.0)
    assert stand_in is not None
    assert stand_in is not home
    for _ in range(5):
        assert choose(endpoints[::-1], "chat", session="x", now=2.0) is stand_in


def test_a_saturated_session_replica_gives_way_to_the_soonest() -> None:
    a = ep("a", slots=2)
    b = ep("b", slots=2)
    home = choose([a, b], "chat", session="y")
    other = b if home is a else a
    assert home is not None
    home.in_flight = 2
    assert choose([a, b], "chat", session="y", rng=rng()) is other
    home.slots = 0  # unknown slots: never saturated
    assert choose([a, b], "chat", session="y", rng=rng()) is home


def test_outside_keys_split_traffic_by_weight_in_every_profile() -> None:
    one = ep("external:m#1", external=True, weight=1, in_flight=3)
    three = ep("external:m#2", external=True, weight=3)
    draw = rng()
    for profile in ("chat", "batch"):
        picks = Counter(pick([one, three], profile, rng=draw) for _ in range(4000))
        share = picks["external:m#2"] / 4000
        assert 0.7 < share < 0.8


def test_outside_sessions_split_by_weight_on_the_ring() -> None:
    one = ep("external:m#1", external=True, weight=1)
    three = ep("external:m#2", external=True, weight=3)
    picks = Counter(pick([one, three], "chat", session=f"s{i}") for i in range(2000))
    assert 0.65 < picks["external:m#2"] / 2000 < 0.85


def test_a_rate_limited_key_is_skipped_for_another() -> None:
    first = ep("external:m#1", external=True)
    second = ep("external:m#2", external=True)
    first.breaker.failure(0.0, status=429, retry_after_s=20.0)
    for _ in range(20):
        assert choose([first, second], "chat", now=5.0, rng=rng()) is second


# --- session_key --------------------------------------------------------------------------


CHAT = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ],
}


def test_session_key_prefers_a_header_then_user_then_metadata() -> None:
    doc = {**CHAT, "user": "alice", "metadata": {"user_id": "bob"}}
    assert session_key(doc, [(b"x-llmgw-session", b" conv-1 ")]) == "h:conv-1"
    assert session_key(doc, [(b"x-session-id", b"conv-2")]) == "h:conv-2"
    assert session_key(doc, [(b"x-session-id", b"  ")]) == "u:alice"
    assert session_key({**CHAT, "metadata": {"user_id": "bob"}}, []) == "m:bob"
    long = session_key({**CHAT, "user": "u" * 1000}, [])
    assert long is not None
    assert len(long) < 100


def test_session_key_of_a_continued_conversation_is_its_prefix() -> None:
    # A first turn has no cache anywhere: no session, the soonest replica.
    assert session_key(CHAT, []) is None
    second_turn = {
        **CHAT,
        "messages": [
            *CHAT["messages"],
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "more"},
        ],
    }
    first = session_key(second_turn, [])
    assert first is not None
    assert first.startswith("p:")
    third_turn = {
        **second_turn,
        "messages": [
            *second_turn["messages"],
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
        "temperature": 0.2,
    }
    assert session_key(third_turn, []) == first
    other = {
        **second_turn,
        "messages": [{"role": "user", "content": "bye"}, *second_turn["messages"][1:]],
    }
    assert session_key(other, []) != first
    assert session_key({**second_turn, "model": "n"}, []) != first


def test_no_session_for_a_bare_completions_request() -> None:
    assert session_key({"model": "m", "prompt": "hi"}, []) is None
    assert session_key({"model": "m", "messages": []}, []) is None

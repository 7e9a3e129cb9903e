"""The SSE relay: events joined into one write, usage read once, the usage
chunk kept from clients that did not ask for it."""

from __future__ import annotations

import orjson

from llmgw.gateway.sse import SseRelay


def _chunk(content: str | None = None, usage: dict[str, object] | None = None) -> bytes:
    doc: dict[str, object] = {"object": "chat.completion.chunk", "choices": []}
    if content is not None:
        doc["choices"] = [{"index": 0, "delta": {"content": content}}]
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}


def test_complete_events_in_hand_come_out_in_one_piece_and_partial_ones_wait() -> None:
    relay = SseRelay(pass_usage=True)
    first, second = _chunk("a"), _chunk("b")
    out = relay.feed(first + second[:10])
    assert out == first
    assert relay.feed(second[10:]) == second
    assert relay.content_chunks == 2


def test_usage_is_read_and_passed_on_when_the_client_asked() -> None:
    relay = SseRelay(pass_usage=True)
    stream = _chunk("a") + _chunk("b") + _chunk(usage=USAGE) + b"data: [DONE]\n\n"
    assert relay.feed(stream) == stream
    assert relay.usage is not None
    assert (
        relay.usage.prompt_tokens,
        relay.usage.completion_tokens,
        relay.usage.cached_tokens,
    ) == (7, 2, 3)
    assert relay.done


def test_the_usage_only_chunk_is_dropped_when_the_client_did_not_ask() -> None:
    relay = SseRelay(pass_usage=False)
    out = relay.feed(_chunk("a") + _chunk(usage=USAGE) + b"data: [DONE]\n\n")
    assert out == _chunk("a") + b"data: [DONE]\n\n"
    assert relay.usage is not None
    assert relay.usage.prompt_tokens == 7


def test_usage_on_a_chunk_that_still_has_choices_is_captured_and_stripped_if_unasked() -> None:
    relay = SseRelay(pass_usage=False)
    out = relay.feed(_chunk("z", usage=USAGE))
    assert relay.usage is not None
    assert relay.usage.completion_tokens == 2
    doc = orjson.loads(out.removeprefix(b"data: ").strip())
    assert "usage" not in doc
    assert doc["choices"][0]["delta"]["content"] == "z"
    assert relay.content_chunks == 1

"""The guarded stream's fast path (``llmgw/gateway/guarded_fast.py``): what
the client gets and what is recorded are the same as on the ordinary path
(each event parsed, guarded and written again), for any stream cut anywhere."""

from __future__ import annotations

import gc
import json
import weakref
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.gateway.chat_stream import parse_event
from llmgw.gateway.guarded import GuardedStream
from llmgw.gateway.sse import SseRelay
from llmgw.guard import Guards, Redactor, Verdict
from llmgw.guard.output import OutputGuard
from llmgw.settings import settings_from_doc

_ENVELOPE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _guard(doc: dict[str, Any]) -> Any:
    built = Guards().for_request(settings_from_doc({"guard": doc}).guard, "k", ("", "", ""))
    assert built is not None
    return built


_POLICIES = {
    "baseline": _guard({}),
    "observe": _guard({"default": ["observe"]}),
    "names": _guard(
        {
            "default": ["n"],
            "policies": {
                "n": {
                    "output": {
                        "pii": {"person": "redact", "email": "redact", "phone": "block"},
                        "secrets": "redact",
                    }
                }
            },
        }
    ),
    "deny": _guard(
        {"default": ["baseline", "d"], "policies": {"d": {"output": {"deny": ["project zeus"]}}}}
    ),
    "max_chars": _guard(
        {"default": ["baseline", "m"], "policies": {"m": {"output": {"max_chars": 60}}}}
    ),
}


def _chunk(text: str, *, index: int = 0, first: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    return {**_ENVELOPE, "choices": [choice]}


def _events(texts: list[str], *, usage: bool = True, done: bool = True) -> list[dict[str, Any]]:
    docs = [_chunk(text, first=at == 0) for at, text in enumerate(texts)]
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    docs.append({**_ENVELOPE, "choices": [last]})
    if usage:
        docs.append(
            {**_ENVELOPE, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
        )
    return docs


def _sse(docs: list[Any], *, prefix: bytes = b"data: ", end: bytes = b"\n\n") -> bytes:
    return b"".join(
        prefix + (b"[DONE]" if doc == "[DONE]" else orjson.dumps(doc)) + end for doc in docs
    )


def _run(
    policy: str, data: bytes, cuts: list[int], *, fast: bool, pass_usage: bool = False
) -> tuple[Any, ...]:
    verdict, redactor = Verdict(), Redactor()
    relay = SseRelay(pass_usage=pass_usage)
    stream = GuardedStream(
        relay, OutputGuard(_POLICIES[policy].output, verdict, redactor, restore=False)
    )
    if not fast:
        stream._fast = False
    out = []
    for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True):
        out.append(stream.feed(data[start:stop]))
    out.append(stream.finish())
    sent = b"".join(out)
    docs = [parse_event(event) for event in sent.split(b"\n\n") if event]
    usage = relay.usage and (relay.usage.prompt_tokens, relay.usage.completion_tokens)
    recorded = (verdict.rules, verdict.actions, verdict.events, verdict.stopped)
    return docs, recorded, dict(redactor.values), usage, relay.content_chunks, relay.done


_WORDS = [
    "the ", " plan", "tok7 ", " ", "\n", "\t", "Maria", " Lopez", "Dr.", " Watson",
    "4111", " 1111", "4111111111111111", "AKIAIOSF", "ODNN7EXAMPLE", "jane@",
    "example.com", "+1 415 555 2671", "é", "日本", "😀", " project", " zeus",
    '"quoted"', "back\\slash", "\x01", "sk-", "abcdefghijklmnopqrstuvwxyz0123",
]  # fmt: skip


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    texts = draw(st.lists(st.lists(st.sampled_from(_WORDS), max_size=3).map("".join), max_size=24))
    docs: list[Any] = _events(texts, usage=draw(st.booleans()))
    odd = draw(st.sampled_from(["none", "spaced", "tool_call", "second_choice", "broken"]))
    if odd == "spaced":
        data = b"".join(b"data: " + json.dumps(doc).encode() + b"\n\n" for doc in docs)
    else:
        if odd == "tool_call" and len(docs) > 3:
            call = {"index": 0, "function": {"arguments": '{"card":"4111111111111111"}'}}
            docs[2]["choices"][0]["delta"] = {"tool_calls": [call]}
        elif odd == "second_choice" and len(docs) > 3:
            docs.insert(2, _chunk("AKIAIOSFODNN7EXAMPLE more", index=1))
        data = _sse([*docs, "[DONE]"], end=draw(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"])))
        if odd == "broken":
            data = data.replace(b"tok7", b"tok\xff", 1).replace(b'"plan"}', b'"plan"', 1)
    cuts = draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=12))
    return data, sorted(set(cuts))


@settings(max_examples=150, deadline=None)
@given(stream=_streams(), policy=st.sampled_from(sorted(_POLICIES)), pass_usage=st.booleans())
def test_the_fast_path_sends_and_records_what_the_ordinary_path_does(
    stream: tuple[bytes, list[int]], policy: str, pass_usage: bool
) -> None:
    data, cuts = stream
    ordinary = _run(policy, data, cuts, fast=False, pass_usage=pass_usage)
    assert _run(policy, data, cuts, fast=True, pass_usage=pass_usage) == ordinary


def test_plain_events_go_on_byte_for_byte_and_rewritten_ones_carry_the_released_text() -> None:
    data = _sse([*_events(["Hi", "tok1 ", "tok2 ", "tok3 "], usage=False), "[DONE]"])
    relay = SseRelay(pass_usage=False)
    stream = GuardedStream(
        relay, OutputGuard(_POLICIES["baseline"].output, Verdict(), Redactor(), restore=False)
    )
    sent = b"".join(stream.feed(data[at : at + 1]) for at in range(len(data))) + stream.finish()
    assert stream._fast
    # The events after the one the envelope was learned from pass as they came.
    assert _sse([_chunk("tok2 "), _chunk("tok3 ")]) in sent
    assert relay.content_chunks == 5
    # Leading spaces (as real tokenizers cut words): the unfinished word is
    # held back and the event says what was released.
    data = _sse([*_events(["Hi", " there", " card", " 4111", " 1111", " 1111", " 1111", " ok"])])
    docs, recorded, *_ = _run("baseline", data, [], fast=True)
    texts = [
        doc["choices"][0]["delta"].get("content", "")
        for doc in docs
        if doc != "[DONE]" and doc["choices"]
    ]
    assert "".join(texts) == "Hi there card **** **** **** 1111 ok"
    assert texts[:3] == ["", "Hi ", "there "]
    assert recorded[0] == ["pii:card"]


def test_a_secret_split_over_plain_events_stops_the_choice_with_content_filter() -> None:
    data = _sse(_events(["Hi", " key ", "AKIAIOSF", "ODNN7EXAMPLE", " after", " more"]))
    for cuts in ([], list(range(1, len(data)))):
        docs, recorded, *_ = _run("baseline", data, cuts, fast=True)
        assert docs == _run("baseline", data, cuts, fast=False)[0]
        finishes = [doc["choices"][0]["finish_reason"] for doc in docs if doc["choices"]]
        assert finishes.count("content_filter") == 1
        # The stopped choice's events after it (the engine's own end, with
        # "stop") are not sent: its last event says content_filter.
        assert finishes[-1] == "content_filter"
        assert "AKIA" not in json.dumps(docs)
        assert recorded == (
            ["secret:aws_access_key"],
            {"secret:aws_access_key": "block"},
            {("output", "secret:aws_access_key"): "block"},
            True,
        )


def test_flag_only_rules_send_the_engines_bytes_and_record_values_split_over_events() -> None:
    data = _sse(_events(["Hi", " mail jane@", "example.com", " now"]))
    relay = SseRelay(pass_usage=True)
    verdict = Verdict()
    stream = GuardedStream(
        relay, OutputGuard(_POLICIES["observe"].output, verdict, Redactor(), restore=False)
    )
    sent = b"".join(stream.feed(data[at : at + 40]) for at in range(0, len(data), 40))
    assert sent + stream.finish() == data
    assert verdict.rules == ["pii:email"]
    assert relay.content_chunks == 5


def test_no_fast_path_with_restore_or_in_front_of_a_translator() -> None:
    from llmgw.gateway.anthropic import MessagesStream

    guard = _POLICIES["baseline"]
    redactor = Redactor()
    redactor.placeholder("EMAIL", b"a@b.io")
    restoring = GuardedStream(
        SseRelay(pass_usage=False), OutputGuard(guard.output, Verdict(), redactor, restore=True)
    )
    restoring.feed(_sse([_chunk("x")]))
    assert restoring._fast is False
    translated = GuardedStream(
        MessagesStream("m", "msg_1"),
        OutputGuard(guard.output, Verdict(), Redactor(), restore=False),
    )
    translated.feed(_sse([_chunk("x")]))
    assert translated._fast is False


@pytest.mark.parametrize("policy", ["baseline", "observe"])
@pytest.mark.parametrize("finished", [True, False])
def test_a_guarded_stream_is_freed_without_the_cyclic_collector(
    policy: str, finished: bool
) -> None:
    # The fast path held by the stream once held the stream's own methods:
    # a reference cycle per request, left to the cyclic collector, whose
    # passes then took 10 ms and more under load.
    data = _sse([*_events(["Hello", " there", ", friend"]), "[DONE]"])
    gc.collect()
    gc.disable()
    try:
        stream = GuardedStream(
            SseRelay(pass_usage=False),
            OutputGuard(_POLICIES[policy].output, Verdict(), Redactor(), restore=False),
        )
        stream.feed(data if finished else data[: len(data) // 2])
        assert stream._fast  # the fast path was taken
        if finished:
            stream.finish()
        gone = weakref.ref(stream)
        del stream
        assert gone() is None
    finally:
        gc.enable()

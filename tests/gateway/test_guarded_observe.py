"""Rules that only flag (``observe``) in front of the OpenAI relay
(``ObserveStream`` in ``llmgw/gateway/guarded_fast.py``): the client gets
byte for byte what the relay alone sends with the guard off, and what is
recorded is what the ordinary path (each event parsed and guarded) records,
for any stream cut anywhere, read in batches of any size."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.gateway import guarded_fast
from llmgw.gateway.guarded import GuardedStream
from llmgw.gateway.guarded_fast import ObserveStream
from llmgw.gateway.sse import SseRelay
from llmgw.guard import Guard, Guards, Redactor, Verdict
from llmgw.guard.output import FLAG_SCAN_BYTES, OutputGuard
from llmgw.settings import settings_from_doc

_ENVELOPE = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _observe() -> Guard:
    built = Guards().for_request(
        settings_from_doc({"guard": {"default": ["observe"]}}).guard, "k", ("", "", "")
    )
    assert built is not None
    return built


_OBSERVE = _observe()


def _chunk(text: str, *, index: int = 0, first: bool = False, field: str = "content") -> Any:
    delta: dict[str, Any] = {field: text}
    if first:
        delta = {"role": "assistant", **delta}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    return {**_ENVELOPE, "choices": [choice]}


def _events(texts: list[str], *, usage: bool = True) -> list[Any]:
    docs = [_chunk(text, first=at == 0) for at, text in enumerate(texts)]
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    docs.append({**_ENVELOPE, "choices": [last]})
    if usage:
        docs.append(
            {**_ENVELOPE, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
        )
    return docs


def _sse(docs: list[Any], *, end: bytes = b"\n\n") -> bytes:
    return b"".join(
        b"data: " + (b"[DONE]" if doc == "[DONE]" else orjson.dumps(doc)) + end for doc in docs
    )


def _run(
    data: bytes, cuts: list[int], *, mode: str, pass_usage: bool, batch: int = 16 * 1024
) -> tuple[Any, ...]:
    """What the client gets and what is recorded: ``mode`` ``off`` (the
    relay alone), ``ordinary`` (each event parsed) or ``observe``."""
    verdict = Verdict()
    relay = SseRelay(pass_usage=pass_usage)
    stream: Any = relay
    if mode != "off":
        stream = GuardedStream(
            relay, OutputGuard(_OBSERVE.output, verdict, Redactor(), restore=False)
        )
        if mode == "ordinary":
            stream._fast = False
    out = []
    with mock.patch.object(guarded_fast, "OBSERVE_BATCH_BYTES", batch):
        for start, stop in zip([0, *cuts], [*cuts, len(data)], strict=True):
            out.append(stream.feed(data[start:stop]))
        out.append(stream.finish())
    if mode == "observe":
        assert isinstance(stream._fast, ObserveStream)
    usage = relay.usage and (relay.usage.prompt_tokens, relay.usage.completion_tokens)
    recorded = (verdict.rules, verdict.actions, verdict.events, verdict.stopped)
    return b"".join(out), recorded, usage, relay.content_chunks, relay.done


_WORDS = [
    "the ", " plan", "tok7 ", " ", "\n", "\t", "Maria", " Lopez", "4111", " 1111",
    "4111111111111111", "AKIAIOSF", "ODNN7EXAMPLE", "jane@", "example.com",
    "+1 415 555 2671", "é", "日本", "😀", '"quoted"', "back\\slash", "\x01", "sk-",
    "abcdefghijklmnopqrstuvwxyz0123", "x" * 300, "word " * 60,
]  # fmt: skip


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    texts = draw(st.lists(st.lists(st.sampled_from(_WORDS), max_size=3).map("".join), max_size=40))
    docs: list[Any] = _events(texts, usage=draw(st.booleans()))
    odd = draw(
        st.sampled_from(
            ["none", "none", "spaced", "tool_call", "second_choice", "reasoning", "broken", "lines"]
        )
    )
    if odd == "spaced":
        data = b"".join(b"data: " + json.dumps(doc).encode() + b"\n\n" for doc in docs)
    else:
        if odd == "tool_call" and len(docs) > 3:
            call = {"index": 0, "function": {"arguments": '{"card":"4111111111111111"}'}}
            docs[2]["choices"][0]["delta"] = {"tool_calls": [call]}
        elif odd == "second_choice" and len(docs) > 3:
            at = draw(st.integers(1, len(docs) - 2))
            docs.insert(at, _chunk("AKIAIOSFODNN7EXAMPLE more", index=1))
        elif odd == "reasoning" and len(docs) > 3:
            docs.insert(2, _chunk("mail jane@example.com", field="reasoning_content"))
        data = _sse([*docs, "[DONE]"], end=draw(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"])))
        if odd == "lines":  # a comment, an event of two lines
            data = b": ping\n\n" + data
            at = data.find(b"data: ", len(data) // 2)
            data = data[:at] + b"event: chunk\n" + data[at:]
        if odd == "broken":
            data = data.replace(b"tok7", b"tok\xff", 1).replace(b'"plan"}', b'"plan"', 1)
            data = data.replace("日".encode(), "日".encode()[:2], 1)
    cuts = draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=12))
    return data, sorted(set(cuts))


@settings(max_examples=200, deadline=None)
@given(
    stream=_streams(),
    pass_usage=st.booleans(),
    batch=st.sampled_from([1, 200, 1000, 16 * 1024]),
    one_event_per_read=st.booleans(),
)
def test_observe_sends_what_the_relay_sends_and_records_what_the_ordinary_path_does(
    stream: tuple[bytes, list[int]], pass_usage: bool, batch: int, one_event_per_read: bool
) -> None:
    data, cuts = stream
    if one_event_per_read:  # as an engine's reads mostly come
        cuts = [at + 2 for at in range(len(data) - 2) if data[at : at + 2] == b"\n\n"]
        cuts = [at for at in cuts if 0 < at < len(data)]
    off = _run(data, cuts, mode="off", pass_usage=pass_usage)
    ordinary = _run(data, cuts, mode="ordinary", pass_usage=pass_usage)
    observed = _run(data, cuts, mode="observe", pass_usage=pass_usage, batch=batch)
    assert observed == ordinary
    assert observed[0] == off[0]
    assert observed[2:] == off[2:]


def test_values_split_over_events_and_batches_are_recorded_by_the_answers_end() -> None:
    texts = [
        "Hi",
        *(["filler "] * 200),
        " mail jane@",
        "example.com",
        " key AKIAIOSF",
        "ODNN7EXAMPLE",
    ]
    data = _sse([*_events(texts), "[DONE]"])
    reads = [event + b"\n\n" for event in data.split(b"\n\n") if event]
    assert sum(len(text) for text in texts) > FLAG_SCAN_BYTES
    for batch in (1, 500, 16 * 1024):
        verdict = Verdict()
        relay = SseRelay(pass_usage=False)
        stream = GuardedStream(
            relay, OutputGuard(_OBSERVE.output, verdict, Redactor(), restore=False)
        )
        with mock.patch.object(guarded_fast, "OBSERVE_BATCH_BYTES", batch):
            sent = b"".join(stream.feed(read) for read in reads[:-1])
            if batch == 16 * 1024:
                assert verdict.rules == []  # not read yet: less than a batch kept
            # Read once [DONE] comes: the usage row is written as it is sent.
            sent += stream.feed(reads[-1])
            assert verdict.rules == ["pii:email", "secret:aws_access_key"]
            sent += stream.finish()
        assert verdict.rules == ["pii:email", "secret:aws_access_key"]
        assert verdict.events == {
            ("output", "pii:email"): "flag",
            ("output", "secret:aws_access_key"): "flag",
        }
        assert not verdict.stopped
        assert b"AKIAIOSF" in sent
        assert sent == _run(data, [], mode="off", pass_usage=False)[0]
        assert relay.content_chunks == len(texts) + 1


def test_runs_of_plain_events_are_read_at_once_and_odd_ones_one_at_a_time() -> None:
    texts = [f"tok{n} " for n in range(40)]
    docs = _events(texts, usage=False)
    docs.insert(20, _chunk("AKIAIOSFODNN7EXAMPLE", index=1))  # another choice mid-run
    data = _sse([*docs, "[DONE]"])
    reads = [event + b"\n\n" for event in data.split(b"\n\n") if event]
    verdict = Verdict()
    guard = OutputGuard(_OBSERVE.output, verdict, Redactor(), restore=False)
    stream = GuardedStream(SseRelay(pass_usage=False), guard)
    fed: list[tuple[int, list[bytes]]] = []
    many = guard.note_plain_many

    def spy(index: int, pieces: list[bytes]) -> None:
        fed.append((index, list(pieces)))
        many(index, pieces)

    with mock.patch.object(guard, "note_plain_many", spy):
        for read in reads[:19]:
            stream.feed(read)
        stream.feed(b"".join(reads[19:]))  # several events in one read
        stream.finish()
    # The first event (parsed) teaches the envelope, less its role; the
    # reads of one plain event each after it in one call; then the read of
    # several events split: the plain ones up to the other choice's event
    # in one call, that event the ordinary way, the plain ones after it in
    # another.
    assert fed == [
        (0, [texts[0].encode()]),
        (0, [t.encode() for t in texts[1:19]]),
        (0, [texts[19].encode()]),
        (0, [t.encode() for t in texts[20:]]),
    ]
    assert verdict.rules == ["secret:aws_access_key"]


def test_note_plain_many_queues_and_scans_as_note_plain_one_piece_at_a_time() -> None:
    pieces = [b"word " * (n % 7) + b"jane@example.com " * (n % 3) for n in range(200)]
    pieces[57] = b"AKIAIOSF"
    pieces[58] = b"ODNN7EXAMPLE "
    for cut in (1, 3, 50, 200):
        one, many = Verdict(), Verdict()
        each = OutputGuard(_OBSERVE.output, one, Redactor(), restore=False)
        batched = OutputGuard(_OBSERVE.output, many, Redactor(), restore=False)
        for piece in pieces:
            if piece:
                each.note_plain(0, piece)
        for at in range(0, len(pieces), cut):
            batched.note_plain_many(0, pieces[at : at + cut])
        assert batched._choices[0].queued_bytes == each._choices[0].queued_bytes
        assert b"".join(batched._choices[0].queued) == b"".join(each._choices[0].queued)
        assert batched._choices[0].held == each._choices[0].held
        each.close(0)
        batched.close(0)
        assert (many.rules, many.events) == (one.rules, one.events)
        assert many.rules == ["pii:email", "secret:aws_access_key"]


def test_an_event_of_another_choice_amid_plain_ones_is_not_read_as_theirs() -> None:
    # Its envelope differs from the learned one in one digit only (the
    # index): read as choice 0's text it would complete a key.
    docs = _events(["Hi", "a ", "b ", "AKIAIOSF"], usage=False)
    docs.insert(5, _chunk("ODNN7EXAMPLE", index=1))
    docs.insert(6, _chunk(" ok"))
    data = _sse([*docs, "[DONE]"])
    reads = [event + b"\n\n" for event in data.split(b"\n\n") if event]
    for joined in (False, True):
        verdict = Verdict()
        stream = GuardedStream(
            SseRelay(pass_usage=False),
            OutputGuard(_OBSERVE.output, verdict, Redactor(), restore=False),
        )
        for read in [b"".join(reads)] if joined else reads:
            stream.feed(read)
        stream.finish()
        assert verdict.rules == []


def test_a_thinking_models_reasoning_events_do_not_use_up_the_learning() -> None:
    reasoning = [_chunk(f"step {n} ", field="reasoning_content") for n in range(40)]
    texts = [f"tok{n} " for n in range(30)]
    docs = [*reasoning, *_events(texts, usage=False)]
    data = _sse([*docs, "[DONE]"])
    verdict = Verdict()
    guard = OutputGuard(_OBSERVE.output, verdict, Redactor(), restore=False)
    stream = GuardedStream(SseRelay(pass_usage=False), guard)
    fed: list[list[bytes]] = []
    many = guard.note_plain_many

    def spy(index: int, pieces: list[bytes]) -> None:
        fed.append(list(pieces))
        many(index, pieces)

    with mock.patch.object(guard, "note_plain_many", spy):
        for event in data.split(b"\n\n")[:-1]:
            stream.feed(event + b"\n\n")
        stream.finish()
    assert fed == [[texts[0].encode()], [t.encode() for t in texts[1:]]]
    assert _run(data, [], mode="observe", pass_usage=False) == _run(
        data, [], mode="ordinary", pass_usage=False
    )

"""The stream relay and translators give the same answer however the engine's
bytes are cut, and whichever line ends (``\\n``, ``\\r\\n``, ``\\r``) the
engine uses: chat, completions, messages and responses shapes, usage with and
without choices, engine errors mid-stream (``docs/api.md``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from llmgw.gateway import anthropic, responses
from llmgw.gateway.chat_stream import ChatChunkReader
from llmgw.gateway.sse import SseRelay, normalize_line_ends

USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}


def _event(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _chat(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return _event({"id": "c1", "object": "chat.completion.chunk", "choices": [choice], **extra})


def _text(text: str, finish: str | None = None, **extra: Any) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return _event({"id": "t1", "object": "text_completion", "choices": [choice], **extra})


DONE = b"data: [DONE]\n\n"
ERROR = _event({"error": {"message": "engine exploded", "type": "server_error"}})

#: Engine streams: (name, bytes, usage expected or None).
CHAT_STREAMS = {
    "usage-only chunk": _chat({"role": "assistant", "content": ""})
    + b": a comment\n\n"
    + _chat({"content": "Hel"})
    + _chat({"content": 'lo "usage" \\n'})
    + _chat({}, "stop")
    + _event({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE})
    + DONE,
    "usage with choices": _chat({"role": "assistant", "content": "Hi"})
    + _chat({"content": "!"}, "stop", usage=USAGE)
    + DONE,
    "error mid-stream": _chat({"role": "assistant", "content": "Hal"}) + ERROR,
}
COMPLETION_STREAMS = {
    "usage-only chunk": _text("Hel")
    + _text("lo")
    + _text("", "length")
    + _event({"id": "t1", "object": "text_completion", "choices": [], "usage": USAGE})
    + DONE,
    "usage with choices": _text("Hel") + _text("lo", "stop", usage=USAGE) + DONE,
    "error mid-stream": _text("Hel") + ERROR,
}

LINE_ENDS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


def _with_line_ends(stream: bytes, end: bytes) -> bytes:
    return stream.replace(b"\n", end)


def _splits(stream: bytes) -> list[list[bytes]]:
    """Every cut in two, and one byte at a time."""
    cuts = [[stream[:at], stream[at:]] for at in range(len(stream) + 1)]
    return [*cuts, [stream[at : at + 1] for at in range(len(stream))]]


def _stable(out: bytes) -> list[Any]:
    """The SSE events of ``out``, their generated ids and times left out."""
    events: list[Any] = []
    for event in out.split(b"\n\n"):
        if not event:
            continue
        parsed: list[Any] = []
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                parsed.append(_without_ids(orjson.loads(line[6:])))
            else:
                parsed.append(line)
        events.append(parsed)
    return events


def _without_ids(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {
            k: _without_ids(v)
            for k, v in doc.items()
            if k not in ("id", "item_id", "created_at", "call_id")
        }
    if isinstance(doc, list):
        return [_without_ids(v) for v in doc]
    return doc


Shape = Any  # SseRelay | MessagesStream | ResponsesStream


def _run(make: Callable[[], Shape], pieces: list[bytes]) -> tuple[bytes, Shape]:
    shape = make()
    out = b"".join(shape.feed(piece) for piece in pieces) + shape.finish()
    return out, shape


def _check_every_split(make: Callable[[], Shape], stream: bytes) -> tuple[bytes, Shape]:
    """Feeds ``stream`` whole and cut everywhere, with each line end; every
    run must give the same events and read the same usage."""
    whole, reference = _run(make, [stream])
    expected = _stable(whole)
    for name, end in LINE_ENDS.items():
        engine = _with_line_ends(stream, end)
        for pieces in _splits(engine):
            out, shape = _run(make, pieces)
            assert _stable(out) == expected, (name, [len(p) for p in pieces][:2])
            assert shape.content_chunks == reference.content_chunks
            assert shape.done == reference.done
            got = None if shape.usage is None else vars_of(shape.usage)
            want = None if reference.usage is None else vars_of(reference.usage)
            assert got == want
    return whole, reference


def vars_of(usage: Any) -> tuple[int, int, int]:
    return (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


@pytest.mark.parametrize("pass_usage", [True, False])
@pytest.mark.parametrize("name", list(CHAT_STREAMS))
def test_chat_relay_is_the_same_cut_anywhere(name: str, pass_usage: bool) -> None:
    stream = CHAT_STREAMS[name]
    whole, relay = _check_every_split(lambda: SseRelay(pass_usage=pass_usage), stream)
    if name == "error mid-stream":
        assert b"engine exploded" in whole
        assert relay.usage is None
        assert relay.content_chunks == 1
        return
    assert relay.usage is not None
    assert vars_of(relay.usage) == (9, 3, 4)
    assert relay.done
    docs = [d for d in ChatChunkReader().feed(whole) if isinstance(d, dict)]
    assert ("usage" in docs[-1]) == pass_usage
    text = "".join(d["choices"][0]["delta"].get("content", "") for d in docs if d.get("choices"))
    assert text in ('Hello "usage" \\n', "Hi!")
    if not pass_usage:
        assert not any("usage" in d for d in docs)


@pytest.mark.parametrize("pass_usage", [True, False])
@pytest.mark.parametrize("name", list(COMPLETION_STREAMS))
def test_completions_relay_is_the_same_cut_anywhere(name: str, pass_usage: bool) -> None:
    stream = COMPLETION_STREAMS[name]
    whole, relay = _check_every_split(lambda: SseRelay(pass_usage=pass_usage), stream)
    if name == "error mid-stream":
        assert whole.endswith(ERROR)
        return
    assert relay.usage is not None
    assert vars_of(relay.usage) == (9, 3, 4)
    assert whole.endswith(DONE)
    assert (b'"usage"' in whole) == pass_usage


@pytest.mark.parametrize("name", list(CHAT_STREAMS))
def test_messages_translation_is_the_same_cut_anywhere(name: str) -> None:
    stream = CHAT_STREAMS[name]
    whole, shape = _check_every_split(
        lambda: anthropic.MessagesStream("m", "msg_1", input_tokens=5), stream
    )
    events = [line for line in whole.split(b"\n") if line.startswith(b"event: ")]
    assert events[0] == b"event: message_start"
    if name == "error mid-stream":
        assert events[-1] == b"event: error"
        assert b"engine exploded" in whole
    else:
        assert events[-1] == b"event: message_stop"
        assert shape.usage is not None
        assert b'"output_tokens":3' in whole


@pytest.mark.parametrize("name", list(CHAT_STREAMS))
def test_responses_translation_is_the_same_cut_anywhere(name: str) -> None:
    stream = CHAT_STREAMS[name]
    whole, shape = _check_every_split(
        lambda: responses.ResponsesStream("m", "resp_1", created_at=0), stream
    )
    events = [line for line in whole.split(b"\n") if line.startswith(b"event: ")]
    assert events[0] == b"event: response.created"
    if name == "error mid-stream":
        assert events[-1] == b"event: response.failed"
        assert b"engine exploded" in whole
    else:
        assert events[-1] == b"event: response.completed"
        assert b'"output_tokens":3' in whole
        assert shape.usage is not None


@pytest.mark.parametrize(
    ("raw", "after_cr", "normal", "ends_cr"),
    [
        (b"a\r\nb\rc\n", False, b"a\nb\nc\n", False),
        (b"a\r", False, b"a\n", True),
        (b"\nb", True, b"b", False),
        (b"\n", True, b"", False),
        (b"", True, b"", True),
        (b"\r\r", True, b"\n\n", True),
        (b"plain\n\n", False, b"plain\n\n", False),
    ],
)
def test_line_ends_are_normalized_across_pieces(
    raw: bytes, after_cr: bool, normal: bytes, ends_cr: bool
) -> None:
    assert normalize_line_ends(raw, after_cr) == (normal, ends_cr)


def test_cr_cr_and_crlf_crlf_end_events_for_the_relay() -> None:
    for end in (b"\r\r", b"\r\n\r\n", b"\n\n"):
        relay = SseRelay(pass_usage=True)
        out = relay.feed(b'data: {"choices":[{"delta":{"content":"x"}}]}' + end)
        assert out == b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
        assert relay.content_chunks == 1

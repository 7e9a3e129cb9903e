"""Engines' SSE streams relayed to the client (``llmgw/gateway/sse.py``,
``anthropic.MessagesStream``, ``responses.ResponsesStream``): arbitrary
engine bytes, cut anywhere.

The first byte picks the shape and the cuts. Checked: no exception; the
plain relay passes on the same events, in order, however the stream was
cut (blank lines aside), and the same usage; the translators' output is whole SSE events (``event:`` and
``data:`` lines, each ``data`` JSON) whatever came in."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import orjson
from _harness import cut, fuzz, instrumented

with instrumented():
    from llmgw.gateway import anthropic, responses
    from llmgw.gateway.sse import SseRelay, Usage

REQUEST = {"model": "m", "input": "hi"}


def counts(usage: Usage | None) -> list[int] | None:
    return None if usage is None else [getattr(usage, name) for name in Usage.__slots__]


def events(out: bytes) -> list[list[bytes]]:
    """The events in ``out``, each its lines; blank lines carry nothing in
    SSE, so runs of them are one boundary."""
    found = []
    for event in out.split(b"\n\n"):
        lines = [line for line in event.split(b"\n") if line]
        if lines:
            found.append(lines)
    return found


def check_events(out: bytes) -> None:
    assert out == b"" or out.endswith(b"\n\n"), out[-40:]
    for event in out.split(b"\n\n")[:-1]:
        lines = event.split(b"\n")
        assert lines[0].startswith(b"event: "), event
        assert lines[1].startswith(b"data: "), event
        orjson.loads(lines[1][6:])


def one_input(data: bytes) -> None:
    if not data:
        return
    shape, seed, body = data[0] % 4, data[0] >> 2, data[1:]
    pieces = cut(body, seed, most=16)
    if shape < 2:
        relay = SseRelay(pass_usage=shape == 1)
        whole = SseRelay(pass_usage=shape == 1)
        out = b"".join(relay.feed(piece) for piece in pieces) + relay.finish()
        at_once = whole.feed(body) + whole.finish()
        assert events(out) == events(at_once), (out, at_once)
        assert counts(relay.usage) == counts(whole.usage)
        return
    translator = (
        anthropic.MessagesStream("m", "msg_1", input_tokens=3)
        if shape == 2
        else responses.ResponsesStream("m", "resp_1", request=REQUEST)
    )
    out = translator.start()
    for piece in pieces:
        out += translator.feed(piece)
    out += translator.finish()
    check_events(out)


if __name__ == "__main__":
    fuzz(one_input)

"""Engines' whole (not streamed) chat answers translated for the client, as
``llmgw/gateway/relay.py`` does for ``/v1/messages`` and ``/v1/responses``:
any JSON object from an engine or an outside provider.

Checked: no exception (the relay calls these on any 200 object); the
result is JSON (``orjson.dumps`` takes it); ``usage_from`` gives whole
numbers (never negative) or nothing, and so does the message's ``usage``.
An object's ``_request`` (when an object) is the client's Responses request
echoed in the response, so its settings are fuzzed too."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import orjson
from _harness import fuzz, instrumented

with instrumented():
    from llmgw.gateway import anthropic, responses
    from llmgw.gateway.sse import Usage, usage_from

REQUEST = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f"}]}


def one_input(data: bytes) -> None:
    try:
        whole = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    usage = usage_from(whole)
    if usage is not None:
        counts = [getattr(usage, name) for name in Usage.__slots__]
        assert all(type(n) is int and n >= 0 for n in counts), counts
    if not isinstance(whole, dict):
        return
    message = anthropic.chat_to_message(whole, "m")
    orjson.dumps(message)
    assert all(n >= 0 for n in message["usage"].values() if isinstance(n, int)), message
    request = whole.get("_request")
    response = responses.chat_to_response(
        whole, "m", request=request if isinstance(request, dict) else REQUEST
    )
    orjson.dumps(response)


if __name__ == "__main__":
    fuzz(one_input)

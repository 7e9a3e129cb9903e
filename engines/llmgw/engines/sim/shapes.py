"""The sim engine's answers written in OpenAI's shapes: error bodies, whole
completion bodies, and the server-sent events of a stream.

A stream is given as a ``render`` function (the bytes of steps ``[a, b)``)
and its ``closing`` events (the finish chunk, the usage chunk when asked,
``data: [DONE]``), for :meth:`~llmgw.engines.sim.pacing.Pacer.stream` to
send at the configured rate.
"""

from __future__ import annotations

import secrets
import time
import zlib
from collections.abc import Callable
from typing import Any

import orjson

from llmgw.engines.sim.answers import (
    ARGUMENTS,
    CALL,
    CONTENT,
    REASONING,
    Plan,
    Rich,
    answer_text,
    answer_word,
)

__all__ = [
    "Render",
    "error_body",
    "rich_body",
    "rich_stream",
    "text_body",
    "text_stream",
]

#: The bytes of steps ``[start, end)`` of a stream.
Render = Callable[[int, int], list[bytes]]


def error_body(status: int, message: str, kind: str) -> bytes:
    """OpenAI's error body: ``{"error": {"message", "type": kind, "param":
    null, "code": status}}``."""
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    )


_token_json_cache: list[bytes] = []


def _token_json(index: int) -> bytes:
    """The JSON string of answer token ``index`` (``"tok7 "``), cached."""
    cache = _token_json_cache
    while len(cache) <= index:
        cache.append(orjson.dumps(answer_word(len(cache))))
    return cache[index]


def _ident(kind: str) -> tuple[str, str]:
    """A fresh id and the ``object`` of a whole answer to a ``chat`` or
    ``text`` (completions) request."""
    if kind == "chat":
        return f"chatcmpl-{secrets.token_hex(12)}", "chat.completion"
    return f"cmpl-{secrets.token_hex(12)}", "text_completion"


def text_body(kind: str, model: str, plan: Plan) -> bytes:
    """The whole plain answer (``plan.completion_tokens`` words) to a
    ``chat`` or ``text`` (completions) request, with ``usage``."""
    answer = answer_text(plan.completion_tokens)
    ident, obj = _ident(kind)
    choice: dict[str, Any]
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": answer},
            "logprobs": None,
            "finish_reason": plan.finish_reason,
        }
    else:
        choice = {
            "index": 0,
            "text": answer,
            "logprobs": None,
            "finish_reason": plan.finish_reason,
        }
    return orjson.dumps(
        {
            "id": ident,
            "object": obj,
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": plan.usage(),
        }
    )


def text_stream(
    kind: str, model: str, model_json: bytes, plan: Plan, include_usage: bool
) -> tuple[Render, list[bytes]]:
    """The events of a streamed plain answer to a ``chat`` or ``text``
    request: one step per token (``render``), then ``closing``.
    ``model_json`` is ``model`` as a JSON string."""
    created = int(time.time())
    if kind == "chat":
        ident, obj = f"chatcmpl-{secrets.token_hex(12)}", "chat.completion.chunk"
    else:
        ident, obj = f"cmpl-{secrets.token_hex(12)}", "text_completion"
    head = b'data: {"id":"%s","object":"%s","created":%d,"model":%s,"choices":[{"index":0,' % (
        ident.encode(),
        obj.encode(),
        created,
        model_json,
    )
    tail = b',"logprobs":null,"finish_reason":null}]}\n\n'
    if kind == "chat":
        first_head = head + b'"delta":{"role":"assistant","content":'
        head += b'"delta":{"content":'
        tail = b"}" + tail
        last: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None}
    else:
        head += b'"text":'
        first_head = head
        last = {"index": 0, "text": "", "logprobs": None}
    last["finish_reason"] = plan.finish_reason
    envelope = {"id": ident, "object": obj, "created": created, "model": model}
    closing = [b"data: " + orjson.dumps({**envelope, "choices": [last]}) + b"\n\n"]
    if include_usage:
        usage_chunk = {**envelope, "choices": [], "usage": plan.usage()}
        closing.append(b"data: " + orjson.dumps(usage_chunk) + b"\n\n")
    closing.append(b"data: [DONE]\n\n")

    def render(start: int, end: int) -> list[bytes]:
        parts: list[bytes] = []
        for index in range(start, end):
            parts += (first_head if index == 0 else head, _token_json(index), tail)
        return parts

    return render, closing


def _logprob(text: str, top: int) -> dict[str, Any]:
    """A made-up (deterministic) ``logprobs.content`` entry for ``text``."""
    value = -((zlib.crc32(text.encode()) % 1000) + 1) / 1000.0
    entry: dict[str, Any] = {
        "token": text,
        "logprob": value,
        "bytes": list(text.encode()),
        "top_logprobs": [],
    }
    if top:
        entry["top_logprobs"] = [
            {"token": text, "logprob": value, "bytes": list(text.encode())},
            *(
                {"token": f"alt{j}", "logprob": value - j, "bytes": list(f"alt{j}".encode())}
                for j in range(1, top)
            ),
        ]
    return entry


def _rich_delta(kind: str, text: str, call_id: str) -> dict[str, Any]:
    if kind == CONTENT:
        return {"content": text}
    if kind == REASONING:
        return {"reasoning_content": text}
    if kind == CALL:
        call = {"index": 0, "id": call_id, "type": "function"}
        return {"tool_calls": [{**call, "function": {"name": text, "arguments": ""}}]}
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def _rich_message(rich: Rich, call_id: str) -> dict[str, Any]:
    content = rich.text(CONTENT)
    name = rich.tool_name()
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if name is None and not content:
        message["content"] = ""
    reasoning = rich.text(REASONING)
    if reasoning:
        message["reasoning_content"] = reasoning
    if name is not None:
        function = {"name": name, "arguments": rich.text(ARGUMENTS)}
        message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
    return message


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def rich_body(model: str, rich: Rich, plan: Plan) -> bytes:
    """The whole chat answer ``rich``: ``rich.n`` choices, each with its
    reasoning, content, tool call and logprobs; ``usage`` from ``plan``."""
    logprobs = None
    if rich.top_logprobs is not None:
        top = rich.top_logprobs
        entries = [_logprob(text, top) for kind, text in rich.pieces if kind == CONTENT]
        logprobs = {"content": entries, "refusal": None}
    choices = [
        {
            "index": index,
            "message": _rich_message(rich, _call_id()),
            "logprobs": logprobs,
            "finish_reason": rich.finish_reason,
        }
        for index in range(rich.n)
    ]
    return orjson.dumps(
        {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": plan.usage(),
        }
    )


def rich_stream(
    model: str, rich: Rich, plan: Plan, include_usage: bool
) -> tuple[Render, list[bytes]]:
    """The events of the streamed chat answer ``rich``: one step per piece
    (``render``: one chunk per choice, a tool call's id, type and name
    first, then its arguments), then ``closing``."""
    envelope = {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    call_ids = [_call_id() for _ in range(rich.n)]
    top = rich.top_logprobs

    def render(start: int, end: int) -> list[bytes]:
        parts: list[bytes] = []
        for step in range(start, end):
            kind, text = rich.pieces[step]
            logprobs = None
            if top is not None and kind == CONTENT:
                logprobs = {"content": [_logprob(text, top)]}
            for index in range(rich.n):
                delta = _rich_delta(kind, text, call_ids[index])
                if step == 0:
                    delta = {"role": "assistant", **delta}
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
                chunk = {**envelope, "choices": [choice]}
                parts.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        return parts

    closing = [
        b"data: "
        + orjson.dumps(
            {
                **envelope,
                "choices": [
                    {
                        "index": index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": rich.finish_reason,
                    }
                ],
            }
        )
        + b"\n\n"
        for index in range(rich.n)
    ]
    if include_usage:
        usage_chunk = {**envelope, "choices": [], "usage": plan.usage()}
        closing.append(b"data: " + orjson.dumps(usage_chunk) + b"\n\n")
    closing.append(b"data: [DONE]\n\n")
    return render, closing

"""The sim engine: a fake OpenAI-compatible engine for tests and benchmarks.

Run it as ``python -m llmgw.engines.sim --host H --port N --model NAME
[options]`` (see :func:`parse_args`). The key comes from ``LLAMA_API_KEY``,
so the sim engine can stand in for llama.cpp; when it is set every route but
``/health`` needs ``Authorization: Bearer <key>``.

Routes:

- ``GET /health``: ``{"status": "ok"}``; ``503 {"status": "loading"}`` for
  the first ``--loading-seconds``.
- ``GET /v1/models``: the one model.
- ``POST /v1/chat/completions``, ``POST /v1/completions``: streamed (SSE) or
  not, in OpenAI's shapes, with ``usage`` (``prompt_tokens_details.cached_tokens``
  from a small prefix cache of 16-token blocks).
- Chat also honours ``tools``/``tool_choice``, ``n``, ``logprobs``/``top_logprobs``,
  ``stop`` and ``response_format`` (see below), and ``--reasoning``.
- ``POST /v1/embeddings``: deterministic unit vectors from a hash of each input.
- ``POST /tokenize``: ``{"tokens": [...], "count": n, "max_model_len": m}``.
- ``GET /metrics``: a few vLLM-style Prometheus series.

``--refuse-key KEY=STATUS`` (repeatable) answers ``STATUS`` (400 to 599, in
OpenAI's error shape) to every request but ``/health`` bearing
``Authorization: Bearer KEY``, whether or not the engine has a key of its
own: a keyless sim so stands in for an outside provider where one key is at
its limit (429) or refused (401) while the others are served.

The model: a prompt's tokens are its whitespace-separated words (at least
one). The answer is the words ``tok0 ``, ``tok1 `` … streamed ``--ttft-ms``
after the request, then at ``--tokens-per-second`` per stream however many
streams run. Streams wake at most every ``--tick-ms`` and send every token
due since the last wake in one write, so hundreds of streams fit on one core.
The answer never depends on ``seed`` or on chance: the same request gets the
same text.

Chat requests beyond plain text (answered on a slower path, each streamed
piece counted as one completion token):

- ``tools``: when ``tool_choice`` is not ``"none"`` and the last message is
  the user's, the answer is one call to the first tool (or the one
  ``tool_choice`` names) with arguments holding the schema's required
  properties as placeholders (string ``"sim"``, number/integer 1, boolean
  true, array [], object its own required ones), ``finish_reason``
  ``tool_calls``; streamed as OpenAI tool call deltas (id, type and name
  first, then the arguments in 8-character pieces).
- ``--reasoning``: ``--reasoning-tokens`` words ``thought0 `` … come first
  as ``reasoning_content`` (llama.cpp's and vLLM's field).
- ``n``: that many identical choices; ``usage.completion_tokens`` sums them.
- ``logprobs``/``top_logprobs``: a made-up ``logprobs.content`` entry per
  content piece.
- ``stop``: the content is cut before the first stop string it holds
  (``finish_reason`` ``stop``).
- ``response_format`` ``json_object``: the content is ``{"answer": "tok0 …"}``;
  ``json_schema``: placeholders for the schema, as for tools.
- ``max_tokens`` caps the pieces (reasoning first), ``finish_reason`` ``length``.

The app is a plain ASGI callable (:class:`SimEngine`) served by hypercorn's
trio worker (:func:`serve`).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import hmac
import math
import os
import random
import secrets
import signal
import struct
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial
from typing import Any, cast

import attrs
import orjson
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from llmgw.asgi import answer_lifespan
from llmgw.engines.base import Command, ShardLaunch, engine_env

__all__ = [
    "KEY_ENV",
    "SimAdapter",
    "SimConfig",
    "SimEngine",
    "main",
    "parse_args",
    "prompt_token_ids",
    "serve",
]

#: The environment variable holding the engine key (as for llama.cpp).
KEY_ENV = "LLAMA_API_KEY"

#: The largest request body read, in bytes; larger ones get 413.
MAX_BODY_BYTES = 32 * 1024 * 1024

#: Tokens per prefix-cache block (as vLLM's default block size).
CACHE_BLOCK_TOKENS = 16

#: Blocks the prefix cache remembers before forgetting the least recent.
CACHE_CAPACITY_BLOCKS = 65536

#: Token ids run from ``_FIRST_TOKEN_ID`` to ``_FIRST_TOKEN_ID + _VOCAB - 1``.
_VOCAB = 50000
_FIRST_TOKEN_ID = 100

#: hypercorn shutdown grace after SIGTERM, in seconds (open streams are cut).
_GRACEFUL_TIMEOUT = 0.5

#: Keep-alive of idle client connections, in seconds; longer than clients'
#: pool expiry (httpx: 5 s) so the server is not the one racing to close.
_KEEP_ALIVE_TIMEOUT = 75.0

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_FAIL_STATUSES = frozenset({429, 500, 502, 503})

#: OpenAI's error ``type`` for the statuses ``--refuse-key`` answers.
_REFUSAL_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


_counts = attrs.validators.ge(0)
_amounts = attrs.validators.ge(0.0)
_fraction = [attrs.validators.ge(0.0), attrs.validators.le(1.0)]


def _pairs(value: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple(value)


def _refusals(_: Any, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    for pair in value:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"'{attribute.name}' holds (key, status) pairs, not {pair!r}")
        key, status = pair
        if not key:
            raise ValueError(f"'{attribute.name}': a key must not be empty")
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"'{attribute.name}': the status for a key must be 400 to 599")


@attrs.frozen(kw_only=True)
class SimConfig:
    """How a sim engine behaves.

    Attributes:
        model: the model name it answers with and lists.
        host: the address to bind.
        port: the TCP port; 0 lets the kernel choose (printed at start).
        tokens_per_second: per-stream decode rate; 0 answers at once.
        tokens: answer length in tokens when a request gives no
            ``max_tokens``; a request's ``max_tokens`` caps it.
        ttft_ms: time to the first token, in milliseconds.
        fail_rate: fraction (0..1) of generation requests answered with
            ``fail_status`` in OpenAI's error shape.
        fail_status: the status of those failures (429, 500, 502 or 503).
        hang_rate: fraction (0..1) of generation requests that never answer
            (until the client goes away).
        slots: requests generating at once; more wait. 0 means unlimited.
        loading_seconds: how long after start ``/health`` says ``loading``
            (503) and the other routes answer 503.
        max_model_len: the context length reported by ``/tokenize`` and
            ``/v1/models``, in tokens.
        embedding_dim: length of embedding vectors unless a request asks
            for ``dimensions``.
        tick_ms: the least time between two writes to one stream, in ms.
        seed: seeds the choice of failing and hanging requests.
        reasoning: chat answers start with reasoning text
            (``reasoning_content``).
        reasoning_tokens: words of reasoning when ``reasoning`` is on.
        refuse_keys: ``(key, status)`` pairs: a request bearing ``Bearer
            key`` is answered ``status`` (400 to 599) and nothing else.

    Raises:
        ValueError: a value is out of range.
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    tokens_per_second: float = attrs.field(default=500.0, validator=_amounts)
    tokens: int = attrs.field(default=64, validator=_counts)
    ttft_ms: float = attrs.field(default=0.0, validator=_amounts)
    fail_rate: float = attrs.field(default=0.0, validator=_fraction)
    fail_status: int = attrs.field(default=500, validator=attrs.validators.in_(_FAIL_STATUSES))
    hang_rate: float = attrs.field(default=0.0, validator=_fraction)
    slots: int = attrs.field(default=0, validator=_counts)
    loading_seconds: float = attrs.field(default=0.0, validator=_amounts)
    max_model_len: int = attrs.field(default=32768, validator=_counts)
    embedding_dim: int = attrs.field(default=384, validator=_counts)
    tick_ms: float = attrs.field(default=50.0, validator=_amounts)
    seed: int = 0
    reasoning: bool = False
    reasoning_tokens: int = attrs.field(default=8, validator=_counts)
    refuse_keys: tuple[tuple[str, int], ...] = attrs.field(
        default=(), converter=_pairs, validator=_refusals
    )


# -- the model ----------------------------------------------------------------


def prompt_token_ids(text: str) -> list[int]:
    """The sim tokenizer: one id per whitespace-separated word of ``text``.

    Ids are ``crc32(word) mod 50000 + 100``, the same in every process. An
    empty or blank text still has one token (id 1, like a BOS token).
    """
    ids = [zlib.crc32(word.encode()) % _VOCAB + _FIRST_TOKEN_ID for word in text.split()]
    return ids or [1]


_token_json_cache: list[bytes] = []


def _token_json(index: int) -> bytes:
    """The JSON string of answer token ``index`` (``"tok7 "``), cached."""
    cache = _token_json_cache
    while len(cache) <= index:
        cache.append(orjson.dumps(f"tok{len(cache)} "))
    return cache[index]


def _answer_text(count: int) -> str:
    return "".join(f"tok{i} " for i in range(count))


class _PrefixCache:
    """Remembers prompts in blocks of :data:`CACHE_BLOCK_TOKENS` tokens, like a
    paged KV cache, so a repeated prefix reports ``cached_tokens``."""

    def __init__(self, capacity_blocks: int = CACHE_CAPACITY_BLOCKS) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity_blocks

    def lookup_and_insert(self, ids: Sequence[int]) -> int:
        """Cached tokens for ``ids`` (full blocks, leaving at least the last
        token to compute), then remembers all of ``ids``' full blocks."""
        size = CACHE_BLOCK_TOKENS
        usable_blocks = (len(ids) - 1) // size
        cached = 0
        chain = 0
        hitting = True
        for block in range(len(ids) // size):
            chain = hash((chain, tuple(ids[block * size : (block + 1) * size])))
            if chain in self._blocks:
                self._blocks.move_to_end(chain)
                if hitting and block < usable_blocks:
                    cached += size
            else:
                hitting = False
                self._blocks[chain] = None
                if len(self._blocks) > self._capacity:
                    self._blocks.popitem(last=False)
        return cached


def _embedding(data: bytes, dim: int) -> list[float]:
    """A unit vector of ``dim`` floats that depends only on ``data``."""
    seed = int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
    rng = random.Random(seed)
    vector = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


# -- request errors and helpers ---------------------------------------------------


class _RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def _error_body(status: int, message: str, kind: str) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    )


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, status: int, message: str, kind: str) -> None:
    await _send_json(send, status, _error_body(status, message, kind))


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client went away."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body: bytes = message.get("body", b"")
        size += len(body)
        if size > MAX_BODY_BYTES:
            raise _RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise _RequestError(400, f"the body is not JSON: {error}") from None
    if not isinstance(doc, dict):
        raise _RequestError(400, "the body must be a JSON object")
    return doc


def _flag(doc: dict[str, Any], name: str) -> bool:
    value = doc.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _RequestError(400, f"'{name}' must be a boolean")
    return value


def _max_tokens(doc: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = doc.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _RequestError(400, f"'{name}' must be a non-negative integer")
        return value
    return None


def _include_usage(doc: dict[str, Any]) -> bool:
    options = doc.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _RequestError(400, "'stream_options' must be an object")
    return _flag(options, "include_usage")


def _content_text(content: Any) -> str:
    """The text of a chat message's ``content``: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
        return " ".join(texts)
    raise _RequestError(400, "a message's 'content' must be a string or a list of parts")


def _chat_text(doc: dict[str, Any]) -> str:
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _RequestError(400, "'messages' must be a non-empty list")
    texts = []
    for message in messages:
        if not isinstance(message, dict):
            raise _RequestError(400, "each message must be an object")
        texts.append(_content_text(message.get("content")))
    return "\n".join(texts)


def _prompt_text(doc: dict[str, Any]) -> str:
    """The text of a completions ``prompt``: one string or token list."""
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return " ".join(str(t) for t in prompt)
    raise _RequestError(400, "'prompt' must be one string or one list of token ids")


def _embedding_inputs(doc: dict[str, Any]) -> list[bytes]:
    value = doc.get("input")
    if isinstance(value, str):
        return [value.encode()]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return [item.encode() for item in value]
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return [orjson.dumps(value)]
        if all(isinstance(item, list) for item in value):
            return [orjson.dumps(item) for item in value]
    raise _RequestError(400, "'input' must be a string, strings, or token id lists")


@attrs.define
class _Plan:
    """What one generation request will produce; ``done`` once its last
    bytes are handed to the server."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str
    done: bool = False

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# -- answers beyond plain text (chat) ----------------------------------------------------

#: Characters per streamed piece of JSON (tool call arguments, JSON answers).
_JSON_PIECE = 8

#: The most choices (``n``) and ``top_logprobs`` a request may ask for.
_MAX_CHOICES = 128
_MAX_TOP_LOGPROBS = 20

#: How deep :func:`_placeholder` follows a JSON schema.
_MAX_SCHEMA_DEPTH = 32

_PLACEHOLDERS: dict[Any, Any] = {
    "string": "sim",
    "number": 1,
    "integer": 1,
    "boolean": True,
    "array": [],
    "null": None,
}

# Piece kinds: reasoning text, content text, a tool call's head (its text
# is the function name), a piece of a tool call's arguments.
_REASONING, _CONTENT, _CALL, _ARGUMENTS = "r", "c", "t", "a"


@attrs.frozen
class _Rich:
    """A chat answer on the slower path: the pieces of one choice (each
    streamed as one chunk and counted as one token), repeated ``n`` times."""

    pieces: tuple[tuple[str, str], ...]
    finish_reason: str
    n: int
    top_logprobs: int | None  # None: no logprobs asked

    def text(self, kind: str) -> str:
        return "".join(text for k, text in self.pieces if k == kind)

    def tool_name(self) -> str | None:
        for kind, text in self.pieces:
            if kind == _CALL:
                return text
        return None


def _placeholder(schema: Any, depth: int = 0) -> Any:
    """A value that fits a (simple) JSON schema: objects hold just their
    required properties; unknown shapes give ``"sim"``."""
    if depth > _MAX_SCHEMA_DEPTH or not isinstance(schema, dict):
        return "sim"
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return _placeholder(options[0], depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        names = required if isinstance(required, list) else []
        return {
            name: _placeholder(properties.get(name), depth + 1)
            for name in names
            if isinstance(name, str)
        }
    return _PLACEHOLDERS.get(kind, "sim")


def _json_pieces(kind: str, text: str) -> list[tuple[str, str]]:
    return [(kind, text[i : i + _JSON_PIECE]) for i in range(0, len(text), _JSON_PIECE)]


def _bounded_int(doc: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _RequestError(400, f"'{name}' must be an integer from {low} to {high}")
    return value


def _stop_strings(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _RequestError(400, "'stop' must be a string or a list of strings")
    return [s for s in value if s]


def _tool_call(doc: dict[str, Any]) -> tuple[str, str] | None:
    """The (name, arguments JSON) of the call to answer with, or None."""
    tools = doc.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise _RequestError(400, "'tools' must be a list")
    functions: dict[str, Any] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise _RequestError(400, "each tool needs 'function.name'")
        assert isinstance(function, dict)
        functions.setdefault(name, function)
    choice = doc.get("tool_choice")
    if choice is None or choice in ("auto", "required"):
        name = next(iter(functions))
    elif choice == "none":
        return None
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise _RequestError(400, f"'tool_choice' names a tool not in 'tools': {name!r}")
    else:
        raise _RequestError(400, "'tool_choice' must be none, auto, required or a function")
    last = doc["messages"][-1]  # _chat_text checked the list
    if last.get("role") != "user":
        return None
    arguments = _placeholder(functions[name].get("parameters"))
    if not isinstance(arguments, dict):
        arguments = {}
    return name, orjson.dumps(arguments).decode()


def _json_answer(response_format: Any, tokens: int) -> str | None:
    """The JSON text ``response_format`` asks for, or None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            return orjson.dumps(_placeholder(schema)).decode()
        kind = "json_object"
    if kind == "json_object":
        return orjson.dumps({"answer": _answer_text(tokens)}).decode()
    raise _RequestError(400, "'response_format.type' must be text, json_object or json_schema")


def _cut_at_stop(
    pieces: list[tuple[str, str]], stops: list[str]
) -> tuple[list[tuple[str, str]], bool]:
    """``pieces`` with the content cut before the first stop string it holds."""
    content = "".join(text for kind, text in pieces if kind == _CONTENT)
    found = [at for at in (content.find(stop) for stop in stops) if at >= 0]
    if not found:
        return pieces, False
    left = min(found)
    kept: list[tuple[str, str]] = []
    for kind, text in pieces:
        if kind != _CONTENT:
            kept.append((kind, text))
            continue
        if left <= 0:
            break
        if len(text) >= left:
            kept.append((kind, text[:left]))
            break
        kept.append((kind, text))
        left -= len(text)
    return kept, True


def _rich_answer(doc: dict[str, Any], config: SimConfig, max_tokens: int | None) -> _Rich | None:
    """The answer when the request asks for more than plain text, else None
    (then the fast path answers)."""
    n = doc.get("n")
    if not (
        config.reasoning
        or doc.get("tools")
        or doc.get("logprobs")
        or doc.get("stop")
        or doc.get("response_format")
        or (n is not None and n != 1)
    ):
        return None
    choices = _bounded_int(doc, "n", 1, 1, _MAX_CHOICES)
    logprobs = _flag(doc, "logprobs")
    top = _bounded_int(doc, "top_logprobs", 0, 0, _MAX_TOP_LOGPROBS)
    stops = _stop_strings(doc.get("stop"))
    call = _tool_call(doc)
    pieces: list[tuple[str, str]] = []
    if config.reasoning:
        pieces += [(_REASONING, f"thought{i} ") for i in range(config.reasoning_tokens)]
    if call is not None:
        pieces.append((_CALL, call[0]))
        pieces += _json_pieces(_ARGUMENTS, call[1])
        finish = "tool_calls"
    else:
        json_text = _json_answer(doc.get("response_format"), config.tokens)
        if json_text is None:
            pieces += [(_CONTENT, f"tok{i} ") for i in range(config.tokens)]
        else:
            pieces += _json_pieces(_CONTENT, json_text)
        finish = "stop"
    if max_tokens is not None and max_tokens <= len(pieces):
        pieces = pieces[:max_tokens]
        finish = "length"
    if stops and call is None:
        pieces, stopped = _cut_at_stop(pieces, stops)
        if stopped:
            finish = "stop"
    return _Rich(tuple(pieces), finish, choices, top if logprobs else None)


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
    if kind == _CONTENT:
        return {"content": text}
    if kind == _REASONING:
        return {"reasoning_content": text}
    if kind == _CALL:
        call = {"index": 0, "id": call_id, "type": "function"}
        return {"tool_calls": [{**call, "function": {"name": text, "arguments": ""}}]}
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def _rich_message(rich: _Rich, call_id: str) -> dict[str, Any]:
    content = rich.text(_CONTENT)
    name = rich.tool_name()
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if name is None and not content:
        message["content"] = ""
    reasoning = rich.text(_REASONING)
    if reasoning:
        message["reasoning_content"] = reasoning
    if name is not None:
        function = {"name": name, "arguments": rich.text(_ARGUMENTS)}
        message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
    return message


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- the ASGI app -------------------------------------------------------------------


class SimEngine:
    """The sim engine as an ASGI 3 application (``await engine(scope, receive, send)``).

    Handles the ``lifespan`` and ``http`` scopes; keeps counters for
    ``/metrics``. ``api_key`` empty means keyless.
    """

    def __init__(self, config: SimConfig, *, api_key: str = "") -> None:
        self.config = config
        self._auth = f"Bearer {api_key}".encode() if api_key else b""
        #: ``Authorization`` header value → the status answered to it.
        self._refused: dict[bytes, int] = {
            f"Bearer {key}".encode(): status for key, status in config.refuse_keys
        }
        self._ready_at = time.monotonic() + config.loading_seconds
        self._created = int(time.time())
        self._rng = random.Random(config.seed)
        self._slots = trio.Semaphore(config.slots) if config.slots else None
        self._cache = _PrefixCache()
        self._model_json = orjson.dumps(config.model)
        self.running = 0
        self.waiting = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._cache_queries_total = 0
        self._cache_hits_total = 0
        self._finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self._failed_total = 0
        self._routes: dict[tuple[str, str], Callable[[Receive, Send], Awaitable[None]]] = {
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/tokenize"): self._tokenize,
        }
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await answer_lifespan(receive, send)

    def _loading(self) -> bool:
        return time.monotonic() < self._ready_at

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        path: str = scope["path"]
        if path in ("/health", "/v1/health"):
            if self._loading():
                await _send_json(send, 503, b'{"status":"loading"}')
            else:
                await _send_json(send, 200, b'{"status":"ok"}')
            return
        if self._refused and await self._refuse(scope, send):
            return
        if self._auth and not self._authorized(scope):
            await _send_error(send, 401, "Invalid API Key", "authentication_error")
            return
        if self._loading():
            await _send_error(send, 503, "Loading model", "unavailable_error")
            return
        handler = self._routes.get((method, path))
        if handler is None:
            if path in self._paths:
                await _send_error(
                    send, 405, f"{method} is not allowed on {path}", "invalid_request_error"
                )
            else:
                await _send_error(send, 404, f"no route {path}", "not_found_error")
            return
        try:
            await handler(receive, send)
        except _RequestError as error:
            await _send_error(send, error.status, error.message, error.kind)

    async def _refuse(self, scope: Scope, send: Send) -> bool:
        """Answers the status ``--refuse-key`` gives the request's key, if any."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                status = self._refused.get(bytes(value))
                if status is None:
                    return False
                kind = _REFUSAL_KINDS.get(status) or (
                    "server_error" if status >= 500 else "invalid_request_error"
                )
                message = f"this key is refused with {status} (sim engine --refuse-key)"
                await _send_error(send, status, message, kind)
                return True
        return False

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._auth)
        return False

    # -- plain routes

    async def _models(self, receive: Receive, send: Send) -> None:
        body = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "llmgw-sim",
                        "max_model_len": self.config.max_model_len,
                    }
                ],
            }
        )
        await _send_json(send, 200, body)

    async def _metrics(self, receive: Receive, send: Send) -> None:
        body = self.metrics_text().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def metrics_text(self) -> str:
        """The Prometheus text served at ``/metrics`` (vLLM's names)."""
        label = '{model_name="' + self.config.model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
        slots = self.config.slots
        usage = min(1.0, self.running / slots) if slots else 0.0
        lines = [
            "# HELP vllm:num_requests_running Number of requests generating now.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self.running}",
            "# HELP vllm:num_requests_waiting Number of requests waiting for a slot.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {self.waiting}",
            "# HELP vllm:kv_cache_usage_perc Fraction of slots in use (1 means full).",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {usage}",
            "# HELP vllm:prompt_tokens_total Prompt tokens read.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {self._prompt_tokens_total}",
            "# HELP vllm:generation_tokens_total Tokens generated.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {self._generation_tokens_total}",
            "# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{label} {self._cache_queries_total}",
            "# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{label} {self._cache_hits_total}",
            "# HELP vllm:request_success_total Requests finished, by finish reason.",
            "# TYPE vllm:request_success_total counter",
        ]
        inner = label[1:-1]
        for reason, count in self._finished.items():
            lines.append(
                f'vllm:request_success_total{{{inner},finished_reason="{reason}"}} {count}'
            )
        lines += [
            "# HELP llmgw_sim_failures_total Requests failed on purpose (--fail-rate).",
            "# TYPE llmgw_sim_failures_total counter",
            f"llmgw_sim_failures_total{label} {self._failed_total}",
        ]
        return "\n".join(lines) + "\n"

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        if isinstance(doc.get("content"), str):
            text: str = doc["content"]
        elif isinstance(doc.get("prompt"), str):
            text = doc["prompt"]
        elif "messages" in doc:
            text = _chat_text(doc)
        else:
            raise _RequestError(400, "give 'content', 'prompt' or 'messages'")
        ids = prompt_token_ids(text)
        body = orjson.dumps(
            {"tokens": ids, "count": len(ids), "max_model_len": self.config.max_model_len}
        )
        await _send_json(send, 200, body)

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        inputs = _embedding_inputs(doc)
        dim = doc.get("dimensions") or self.config.embedding_dim
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise _RequestError(400, "'dimensions' must be a positive integer")
        encoding = doc.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise _RequestError(400, "'encoding_format' must be 'float' or 'base64'")
        if await self._maybe_fail(send):
            return
        data = []
        tokens = 0
        for index, item in enumerate(inputs):
            tokens += len(prompt_token_ids(item.decode(errors="replace")))
            vector = _embedding(item, dim)
            embedding: list[float] | str = vector
            if encoding == "base64":
                embedding = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        self._prompt_tokens_total += tokens
        body = orjson.dumps(
            {
                "object": "list",
                "data": data,
                "model": self.config.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )
        await _send_json(send, 200, body)

    async def _read_json(self, receive: Receive) -> dict[str, Any] | None:
        body = await _read_body(receive)
        return None if body is None else _json_object(body)

    async def _maybe_fail(self, send: Send) -> bool:
        """Answers a simulated failure when the dice say so (``--fail-rate``)."""
        if self.config.fail_rate and self._rng.random() < self.config.fail_rate:
            self._failed_total += 1
            status = self.config.fail_status
            kind = "rate_limit_error" if status == 429 else "server_error"
            await _send_error(send, status, "simulated failure (sim engine --fail-rate)", kind)
            return True
        return False

    # -- generation

    def _plan(self, text: str, max_tokens: int | None) -> _Plan:
        ids = prompt_token_ids(text)
        cached = self._cache.lookup_and_insert(ids)
        self._prompt_tokens_total += len(ids)
        self._cache_queries_total += len(ids)
        self._cache_hits_total += cached
        count = self.config.tokens
        finish = "stop"
        if max_tokens is not None and max_tokens <= count:
            count = max_tokens
            finish = "length"
        return _Plan(len(ids), cached, count, finish)

    async def _chat(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        text = _chat_text(doc)
        stream = _flag(doc, "stream")
        include_usage = stream and _include_usage(doc)
        max_tokens = _max_tokens(doc, "max_completion_tokens", "max_tokens")
        rich = _rich_answer(doc, self.config, max_tokens)
        await self._generate(receive, send, "chat", text, max_tokens, stream, include_usage, rich)

    async def _completions(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        text = _prompt_text(doc)
        stream = _flag(doc, "stream")
        include_usage = stream and _include_usage(doc)
        max_tokens = _max_tokens(doc, "max_tokens")
        await self._generate(receive, send, "text", text, max_tokens, stream, include_usage)

    async def _generate(
        self,
        receive: Receive,
        send: Send,
        kind: str,
        text: str,
        max_tokens: int | None,
        stream: bool,
        include_usage: bool,
        rich: _Rich | None = None,
    ) -> None:
        if await self._maybe_fail(send):
            return
        hang = bool(self.config.hang_rate) and self._rng.random() < self.config.hang_rate
        plan = self._plan(text, max_tokens)
        if rich is not None:
            plan.completion_tokens = len(rich.pieces) * rich.n
            plan.finish_reason = rich.finish_reason
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            # Stop generating when the client goes away (ASGI http.disconnect).
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                if hang:
                    await trio.sleep_forever()
                await self._in_slot(send, kind, plan, started, stream, include_usage, rich)
            except trio.Cancelled:
                # hypercorn may report the disconnect while the last write is
                # still in send(); that request did finish.
                if not plan.done:
                    self._finished["abort"] += 1
                raise
            nursery.cancel_scope.cancel()

    async def _in_slot(
        self,
        send: Send,
        kind: str,
        plan: _Plan,
        started: float,
        stream: bool,
        include_usage: bool,
        rich: _Rich | None,
    ) -> None:
        if self._slots is not None:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            # A request that waited for a slot starts its clock now.
            started = trio.current_time()
        self.running += 1
        try:
            if rich is not None:
                if stream:
                    await self._stream_rich(send, rich, plan, started, include_usage)
                else:
                    await self._whole_rich(send, rich, plan, started)
            elif stream:
                await self._stream(send, kind, plan, started, include_usage)
            else:
                await self._whole(send, kind, plan, started)
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()

    def _finish(self, plan: _Plan) -> None:
        plan.done = True
        # vLLM counts a tool call's end as a plain stop.
        reason = plan.finish_reason
        self._finished["stop" if reason == "tool_calls" else reason] += 1

    def _first_token_at(self, started: float) -> float:
        return started + self.config.ttft_ms / 1000.0

    async def _whole(self, send: Send, kind: str, plan: _Plan, started: float) -> None:
        done_at = self._first_token_at(started)
        rate = self.config.tokens_per_second
        if rate and plan.completion_tokens > 1:
            done_at += (plan.completion_tokens - 1) / rate
        await trio.sleep_until(done_at)
        answer = _answer_text(plan.completion_tokens)
        self._generation_tokens_total += plan.completion_tokens
        choice: dict[str, Any]
        if kind == "chat":
            ident, obj = f"chatcmpl-{secrets.token_hex(12)}", "chat.completion"
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": answer},
                "logprobs": None,
                "finish_reason": plan.finish_reason,
            }
        else:
            ident, obj = f"cmpl-{secrets.token_hex(12)}", "text_completion"
            choice = {
                "index": 0,
                "text": answer,
                "logprobs": None,
                "finish_reason": plan.finish_reason,
            }
        body = orjson.dumps(
            {
                "id": ident,
                "object": obj,
                "created": int(time.time()),
                "model": self.config.model,
                "choices": [choice],
                "usage": plan.usage(),
            }
        )
        self._finish(plan)
        await _send_json(send, 200, body)

    async def _stream(
        self, send: Send, kind: str, plan: _Plan, started: float, include_usage: bool
    ) -> None:
        created = int(time.time())
        if kind == "chat":
            ident, obj = f"chatcmpl-{secrets.token_hex(12)}", "chat.completion.chunk"
        else:
            ident, obj = f"cmpl-{secrets.token_hex(12)}", "text_completion"
        head = b'data: {"id":"%s","object":"%s","created":%d,"model":%s,"choices":[{"index":0,' % (
            ident.encode(),
            obj.encode(),
            created,
            self._model_json,
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
        envelope = {"id": ident, "object": obj, "created": created, "model": self.config.model}
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

        await self._pace(send, plan, started, plan.completion_tokens, 1, render, closing)

    async def _pace(
        self,
        send: Send,
        plan: _Plan,
        started: float,
        steps: int,
        tokens_per_step: int,
        render: Callable[[int, int], list[bytes]],
        closing: list[bytes],
    ) -> None:
        """Stream ``steps`` steps (the bytes of steps [a, b) from ``render(a,
        b)``) at the configured rate, every step due in one write, then
        ``closing``."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        rate = self.config.tokens_per_second
        tick = self.config.tick_ms / 1000.0
        first_at = self._first_token_at(started)
        await trio.sleep_until(first_at)
        sent = 0
        while True:
            now = trio.current_time()
            due = steps if not rate else min(steps, 1 + int((now - first_at) * rate + 1e-9))
            parts = render(sent, due)
            self._generation_tokens_total += (due - sent) * tokens_per_step
            sent = due
            if sent == steps:
                parts += closing
                self._finish(plan)
                await send({"type": "http.response.body", "body": b"".join(parts)})
                return
            if parts:
                await send(
                    {"type": "http.response.body", "body": b"".join(parts), "more_body": True}
                )
            # Step `sent` is due at first_at + sent / rate; wake no sooner than a tick.
            await trio.sleep_until(max(first_at + sent / rate, now + tick))

    async def _whole_rich(self, send: Send, rich: _Rich, plan: _Plan, started: float) -> None:
        steps = len(rich.pieces)
        done_at = self._first_token_at(started)
        rate = self.config.tokens_per_second
        if rate and steps > 1:
            done_at += (steps - 1) / rate
        await trio.sleep_until(done_at)
        self._generation_tokens_total += plan.completion_tokens
        logprobs = None
        if rich.top_logprobs is not None:
            top = rich.top_logprobs
            entries = [_logprob(text, top) for kind, text in rich.pieces if kind == _CONTENT]
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
        body = orjson.dumps(
            {
                "id": f"chatcmpl-{secrets.token_hex(12)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.config.model,
                "choices": choices,
                "usage": plan.usage(),
            }
        )
        self._finish(plan)
        await _send_json(send, 200, body)

    async def _stream_rich(
        self, send: Send, rich: _Rich, plan: _Plan, started: float, include_usage: bool
    ) -> None:
        envelope = {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.config.model,
        }
        call_ids = [_call_id() for _ in range(rich.n)]
        top = rich.top_logprobs

        def render(start: int, end: int) -> list[bytes]:
            parts: list[bytes] = []
            for step in range(start, end):
                kind, text = rich.pieces[step]
                logprobs = None
                if top is not None and kind == _CONTENT:
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
        await self._pace(send, plan, started, len(rich.pieces), rich.n, render, closing)


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


# -- serving -------------------------------------------------------------------------


def _bind(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def serve(
    config: SimConfig,
    *,
    api_key: str = "",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a sim engine until SIGTERM or SIGINT, then return.

    Prints ``sim engine listening on H:P model NAME`` (flushed) once the port
    listens, and reports the port (the kernel's choice when ``config.port``
    is 0) through ``task_status``. Open streams get
    ``_GRACEFUL_TIMEOUT`` (0.5 s) after the signal before being cut.

    Raises:
        OSError: the address cannot be bound.
    """
    app = SimEngine(config, api_key=api_key)
    hyper = HypercornConfig()
    hyper.bind = [_bind(config.host, config.port)]
    hyper.graceful_timeout = _GRACEFUL_TIMEOUT
    hyper.keep_alive_timeout = _KEEP_ALIVE_TIMEOUT
    hyper.backlog = 4096
    hyper.accesslog = None
    hyper.loglevel = "WARNING"  # errors only; the listening line is ours
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

        async def stop_signal() -> None:
            async for _ in signals:
                return

        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(
                partial(
                    hypercorn_serve,
                    cast(Any, app),  # a plain-dict ASGI app; hypercorn's types are TypedDicts
                    hyper,
                    shutdown_trigger=stop_signal,
                    mode="asgi",
                )
            )
            port = int(binds[0].rsplit(":", 1)[1])
            print(f"sim engine listening on {config.host}:{port} model {config.model}", flush=True)
            task_status.started(port)


def parse_args(argv: Sequence[str] | None = None) -> SimConfig:
    """Parse the sim engine's command line into a :class:`SimConfig`.

    Exits with code 2 and a message on a bad or unknown flag (argparse).
    """
    parser = argparse.ArgumentParser(
        prog="python -m llmgw.engines.sim",
        description="A fake OpenAI-compatible engine for tests and benchmarks. "
        f"The key comes from {KEY_ENV}.",
        allow_abbrev=False,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0 lets the kernel choose")
    parser.add_argument("--model", required=True, help="the model name it answers to")
    parser.add_argument(
        "--tokens-per-second", type=float, default=500.0, help="per stream; 0 = instant"
    )
    parser.add_argument(
        "--tokens", type=int, default=64, help="answer length unless max_tokens is lower"
    )
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token (ms)")
    parser.add_argument(
        "--fail-rate", type=float, default=0.0, help="fraction answered with an error"
    )
    parser.add_argument("--fail-status", type=int, default=500, help="429, 500, 502 or 503")
    parser.add_argument("--hang-rate", type=float, default=0.0, help="fraction never answered")
    parser.add_argument(
        "--slots", type=int, default=0, help="requests generating at once; 0 = no limit"
    )
    parser.add_argument(
        "--loading-seconds", type=float, default=0.0, help="health says loading this long"
    )
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--embedding-dim", type=int, default=384)
    parser.add_argument(
        "--tick-ms", type=float, default=50.0, help="least time between writes to a stream"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reasoning", action="store_true", help="chat answers start with reasoning_content"
    )
    parser.add_argument(
        "--reasoning-tokens", type=int, default=8, help="reasoning words with --reasoning"
    )
    parser.add_argument(
        "--refuse-key",
        action="append",
        default=[],
        metavar="KEY=STATUS",
        help="answer STATUS (400-599) to requests bearing this key (repeatable)",
    )
    ns = parser.parse_args(argv)
    refusals = []
    for given in ns.refuse_key:
        key, _, status = given.rpartition("=")
        if not key or not status.isdigit():
            parser.error(f"--refuse-key {given!r}: give KEY=STATUS, e.g. BAD=429")
        refusals.append((key, int(status)))
    try:
        return SimConfig(
            model=ns.model,
            host=ns.host,
            port=ns.port,
            tokens_per_second=ns.tokens_per_second,
            tokens=ns.tokens,
            ttft_ms=ns.ttft_ms,
            fail_rate=ns.fail_rate,
            fail_status=ns.fail_status,
            hang_rate=ns.hang_rate,
            slots=ns.slots,
            loading_seconds=ns.loading_seconds,
            max_model_len=ns.max_model_len,
            embedding_dim=ns.embedding_dim,
            tick_ms=ns.tick_ms,
            seed=ns.seed,
            reasoning=ns.reasoning,
            reasoning_tokens=ns.reasoning_tokens,
            refuse_keys=tuple(refusals),
        )
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sim engine until SIGTERM or SIGINT; returns the exit code (0)."""
    config = parse_args(argv)
    api_key = os.environ.get(KEY_ENV, "")
    try:
        trio.run(partial(serve, config, api_key=api_key))
    except KeyboardInterrupt:  # SIGINT before the signal receiver was open
        pass
    return 0


# -- the adapter -----------------------------------------------------------------------


@attrs.frozen
class SimAdapter:
    """The :class:`~llmgw.engines.base.EngineAdapter` for the sim engine.

    One process per shard: ``python -m llmgw.engines.sim --host B --port P
    --model NAME *args``, the key in ``LLAMA_API_KEY``.
    """

    python: str = sys.executable

    @property
    def name(self) -> str:
        return "sim"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str:
        return "/metrics"

    def commands(self, shard: ShardLaunch) -> list[Command]:
        """``[python, -m, llmgw.engines.sim, --host, …, --port, …, --model, …,
        --slots, N, *args]``: the profile's slots bound the requests generating
        at once, as llama.cpp's ``--parallel`` does (a ``--slots`` in ``args``
        wins), so the router's idea of a replica's capacity holds."""
        args = (
            "-m",
            "llmgw.engines.sim",
            "--host",
            shard.bind_addr,
            "--port",
            str(shard.http_port),
            "--model",
            shard.served_model_name,
            "--slots",
            str(shard.slots),
            *shard.args,
        )
        return [Command(name="sim", path=self.python, args=args, env=engine_env(shard, KEY_ENV))]


if __name__ == "__main__":
    sys.exit(main())

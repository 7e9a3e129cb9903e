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
- ``POST /v1/embeddings``: deterministic unit vectors from a hash of each input.
- ``POST /tokenize``: ``{"tokens": [...], "count": n, "max_model_len": m}``.
- ``GET /metrics``: a few vLLM-style Prometheus series.

The model: a prompt's tokens are its whitespace-separated words (at least
one). The answer is the words ``tok0 ``, ``tok1 `` … streamed ``--ttft-ms``
after the request, then at ``--tokens-per-second`` per stream however many
streams run. Streams wake at most every ``--tick-ms`` and send every token
due since the last wake in one write, so hundreds of streams fit on one core.

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
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, cast

import attrs
import orjson
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from llmgw.engines.asgi import answer_lifespan
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


_counts = attrs.validators.ge(0)
_amounts = attrs.validators.ge(0.0)
_fraction = [attrs.validators.ge(0.0), attrs.validators.le(1.0)]


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


# -- the ASGI app -------------------------------------------------------------------


class SimEngine:
    """The sim engine as an ASGI 3 application (``await engine(scope, receive, send)``).

    Handles the ``lifespan`` and ``http`` scopes; keeps counters for
    ``/metrics``. ``api_key`` empty means keyless.
    """

    def __init__(self, config: SimConfig, *, api_key: str = "") -> None:
        self.config = config
        self._auth = f"Bearer {api_key}".encode() if api_key else b""
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
        await self._generate(receive, send, "chat", text, max_tokens, stream, include_usage)

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
    ) -> None:
        if await self._maybe_fail(send):
            return
        hang = bool(self.config.hang_rate) and self._rng.random() < self.config.hang_rate
        plan = self._plan(text, max_tokens)
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            # Stop generating when the client goes away (ASGI http.disconnect).
            nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                if hang:
                    await trio.sleep_forever()
                await self._in_slot(send, kind, plan, started, stream, include_usage)
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
            if stream:
                await self._stream(send, kind, plan, started, include_usage)
            else:
                await self._whole(send, kind, plan, started)
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()

    def _finish(self, plan: _Plan) -> None:
        plan.done = True
        self._finished[plan.finish_reason] += 1

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
        count = plan.completion_tokens
        rate = self.config.tokens_per_second
        tick = self.config.tick_ms / 1000.0
        first_at = self._first_token_at(started)
        await trio.sleep_until(first_at)
        sent = 0
        while True:
            now = trio.current_time()
            due = count if not rate else min(count, 1 + int((now - first_at) * rate + 1e-9))
            parts: list[bytes] = []
            for index in range(sent, due):
                parts += (first_head if index == 0 else head, _token_json(index), tail)
            self._generation_tokens_total += due - sent
            sent = due
            if sent == count:
                parts += closing
                self._finish(plan)
                await send({"type": "http.response.body", "body": b"".join(parts)})
                return
            if parts:
                await send(
                    {"type": "http.response.body", "body": b"".join(parts), "more_body": True}
                )
            # Token `sent` is due at first_at + sent / rate; wake no sooner than a tick.
            await trio.sleep_until(max(first_at + sent / rate, now + tick))


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
    ns = parser.parse_args(argv)
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
        """``[python, -m, llmgw.engines.sim, --host, …, --port, …, --model, …, *args]``."""
        args = (
            "-m",
            "llmgw.engines.sim",
            "--host",
            shard.bind_addr,
            "--port",
            str(shard.http_port),
            "--model",
            shard.served_model_name,
            *shard.args,
        )
        return [Command(name="sim", path=self.python, args=args, env=engine_env(shard, KEY_ENV))]


if __name__ == "__main__":
    sys.exit(main())

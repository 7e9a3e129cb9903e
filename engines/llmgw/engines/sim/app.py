"""The sim engine as an ASGI app (:class:`SimEngine`): its routes, the
engine key, ``--refuse-key``, loading, and the failures and hangs it is told
to make.

Routes:

- ``GET /health`` (or ``/v1/health``): ``{"status": "ok"}``; ``503
  {"status": "loading"}`` for the first ``--loading-seconds``. Needs no key.
- ``GET /v1/models``: the one model.
- ``POST /v1/chat/completions``, ``POST /v1/completions``: streamed (SSE) or
  not, in OpenAI's shapes, with ``usage`` (``prompt_tokens_details.cached_tokens``
  from the prefix cache).
- ``POST /v1/embeddings``: deterministic unit vectors from a hash of each input.
- ``POST /tokenize``: ``{"tokens": [...], "count": n, "max_model_len": m}``.
- ``GET /metrics``: a few vLLM-style Prometheus series.

Any other path answers 404, another method on a known path 405, a bad
request 400 (413 for a body over 32 MiB), each in OpenAI's error shape.
"""

from __future__ import annotations

import base64
import hmac
import random
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio

from llmgw.asgi import Receive, Scope, Send, answer_lifespan, cancel_on_disconnect
from llmgw.engines.sim import shapes
from llmgw.engines.sim.answers import (
    CONTENT,
    Plan,
    PrefixCache,
    Rich,
    embedding,
    prompt_token_ids,
    rich_answer,
)
from llmgw.engines.sim.config import SimConfig
from llmgw.engines.sim.metrics import Counters, metrics_text
from llmgw.engines.sim.pacing import Pacer
from llmgw.engines.sim.request import (
    RequestError,
    chat_text,
    embedding_inputs,
    flag,
    include_usage,
    json_object,
    max_tokens,
    prompt_text,
    read_body,
)

__all__ = ["SimEngine"]

#: OpenAI's error ``type`` for the statuses ``--refuse-key`` answers.
_REFUSAL_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


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
    await _send_json(send, status, shapes.error_body(status, message, kind))


class SimEngine:
    """The sim engine as an ASGI 3 application (``await engine(scope, receive, send)``).

    Handles the ``lifespan`` and ``http`` scopes. ``api_key`` empty means
    keyless; otherwise every route but ``/health`` needs ``Authorization:
    Bearer <api_key>`` (401 without).

    Attributes:
        config: how it behaves.
        counters: what it counted, served at ``/metrics``.
        pacer: its clock and slots (requests running and waiting).
    """

    def __init__(self, config: SimConfig, *, api_key: str = "") -> None:
        self.config = config
        self.counters = Counters()
        self.pacer = Pacer(config)
        self._auth = f"Bearer {api_key}".encode() if api_key else b""
        #: ``Authorization`` header value → the status answered to it.
        self._refused: dict[bytes, int] = {
            f"Bearer {key}".encode(): status for key, status in config.refuse_keys
        }
        self._ready_at = time.monotonic() + config.loading_seconds
        self._created = int(time.time())
        self._rng = random.Random(config.seed)
        self._cache = PrefixCache()
        self._model_json = orjson.dumps(config.model)
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
        except RequestError as error:
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
        text = metrics_text(
            self.config.model,
            self.config.slots,
            self.pacer.running,
            self.pacer.waiting,
            self.counters,
        )
        body = text.encode()
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

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        if isinstance(doc.get("content"), str):
            text: str = doc["content"]
        elif isinstance(doc.get("prompt"), str):
            text = doc["prompt"]
        elif "messages" in doc:
            text = chat_text(doc)
        else:
            raise RequestError(400, "give 'content', 'prompt' or 'messages'")
        ids = prompt_token_ids(text)
        body = orjson.dumps(
            {"tokens": ids, "count": len(ids), "max_model_len": self.config.max_model_len}
        )
        await _send_json(send, 200, body)

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        inputs = embedding_inputs(doc)
        dim = doc.get("dimensions") or self.config.embedding_dim
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise RequestError(400, "'dimensions' must be a positive integer")
        encoding = doc.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise RequestError(400, "'encoding_format' must be 'float' or 'base64'")
        if await self._maybe_fail(send):
            return
        data = []
        tokens = 0
        for index, item in enumerate(inputs):
            tokens += len(prompt_token_ids(item.decode(errors="replace")))
            vector = embedding(item, dim)
            value: list[float] | str = vector
            if encoding == "base64":
                value = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": value})
        self.counters.prompt_tokens += tokens
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
        body = await read_body(receive)
        return None if body is None else json_object(body)

    async def _maybe_fail(self, send: Send) -> bool:
        """Answers a simulated failure when the dice say so (``--fail-rate``)."""
        if self.config.fail_rate and self._rng.random() < self.config.fail_rate:
            self.counters.failed += 1
            status = self.config.fail_status
            kind = "rate_limit_error" if status == 429 else "server_error"
            await _send_error(send, status, "simulated failure (sim engine --fail-rate)", kind)
            return True
        return False

    # -- generation

    def _plan(self, text: str, max_tokens: int | None) -> Plan:
        ids = prompt_token_ids(text)
        cached = self._cache.lookup_and_insert(ids)
        self.counters.prompt_tokens += len(ids)
        self.counters.cache_queries += len(ids)
        self.counters.cache_hits += cached
        count = self.config.tokens
        finish = "stop"
        if max_tokens is not None and max_tokens <= count:
            count = max_tokens
            finish = "length"
        return Plan(len(ids), cached, count, finish)

    async def _chat(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        text = chat_text(doc)
        stream = flag(doc, "stream")
        usage = stream and include_usage(doc)
        limit = max_tokens(doc, "max_completion_tokens", "max_tokens")
        rich = rich_answer(doc, self.config, limit)
        # Scripted answers (SimConfig.replies): the first pair whose text the prompt holds.
        for when, reply in self.config.replies if rich is None else ():
            if when in text:
                rich = Rich(((CONTENT, reply),), "stop", 1, None)
                break
        await self._generate(receive, send, "chat", text, limit, stream, usage, rich)

    async def _completions(self, receive: Receive, send: Send) -> None:
        doc = await self._read_json(receive)
        if doc is None:
            return
        text = prompt_text(doc)
        stream = flag(doc, "stream")
        usage = stream and include_usage(doc)
        limit = max_tokens(doc, "max_tokens")
        await self._generate(receive, send, "text", text, limit, stream, usage)

    async def _generate(
        self,
        receive: Receive,
        send: Send,
        kind: str,
        text: str,
        limit: int | None,
        stream: bool,
        usage: bool,
        rich: Rich | None = None,
    ) -> None:
        if await self._maybe_fail(send):
            return
        hang = bool(self.config.hang_rate) and self._rng.random() < self.config.hang_rate
        plan = self._plan(text, limit)
        if rich is not None:
            plan.completion_tokens = len(rich.pieces) * rich.n
            plan.finish_reason = rich.finish_reason
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            # Stop generating when the client goes away (ASGI http.disconnect).
            nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope)
            try:
                if hang:
                    await trio.sleep_forever()
                async with self.pacer.slot(started) as started:
                    await self._answer(send, kind, plan, started, stream, usage, rich)
            except trio.Cancelled:
                # hypercorn may report the disconnect while the last write is
                # still in send(); that request did finish.
                if not plan.done:
                    self.counters.finished["abort"] += 1
                raise
            nursery.cancel_scope.cancel()

    async def _answer(
        self,
        send: Send,
        kind: str,
        plan: Plan,
        started: float,
        stream: bool,
        usage: bool,
        rich: Rich | None,
    ) -> None:
        """Answer ``plan`` (``rich`` on the slower path), whole or streamed,
        timed from ``started``."""
        model = self.config.model
        if stream:
            if rich is not None:
                render, closing = shapes.rich_stream(model, rich, plan, usage)
                steps, per_step = len(rich.pieces), rich.n
            else:
                render, closing = shapes.text_stream(kind, model, self._model_json, plan, usage)
                steps, per_step = plan.completion_tokens, 1

            def sent(count: int) -> None:
                self.counters.generated(count * per_step)

            await self.pacer.stream(
                send,
                started,
                steps,
                render,
                closing,
                sent=sent,
                finishing=lambda: self._finish(plan),
            )
            return
        steps = plan.completion_tokens if rich is None else len(rich.pieces)
        await self.pacer.until_done(started, steps)
        self.counters.generated(plan.completion_tokens)
        if rich is not None:
            body = shapes.rich_body(model, rich, plan)
        else:
            body = shapes.text_body(kind, model, plan)
        self._finish(plan)
        await _send_json(send, 200, body)

    def _finish(self, plan: Plan) -> None:
        plan.done = True
        self.counters.finish(plan.finish_reason)

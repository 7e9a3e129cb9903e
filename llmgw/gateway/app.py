"""The client API: one lean ASGI callable, no framework on the hot path.

Routes (``shared/spec/gateway-api.md``, ``ha-and-leader.md``):

- ``POST /v1/chat/completions``, ``POST /v1/completions`` — relayed to a
  ready replica of the model, streamed or not;
- ``GET /v1/models`` — the catalog;
- ``GET /health``, ``GET /ready``, ``GET /leader`` — open, no store access.

A request: read the body (bounded) → authenticate the key → parse and check
the body → pick a ready replica → forward with the engine's own key (the
client's ``Authorization`` never reaches the engine) → relay the answer,
joining the events in hand into one write → queue a usage row and count
metrics. A client that disconnects cancels the engine request.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import orjson
import trio

from llmgw import metrics
from llmgw.accounting.accountant import Accountant, Refused, Reservation
from llmgw.accounting.usage import UsageWriter
from llmgw.auth.keys import KeyAuthenticator, KeyRefused
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster, Endpoint
from llmgw.engines.asgi import answer_lifespan
from llmgw.store import KeyRecord, StoreError, UsageRow

from .errors import ApiError, bad_request, unauthorized
from .sse import SseRelay, Usage, usage_from
from .upstream import UpstreamError, UpstreamPool, UpstreamResponse

__all__ = ["MAX_BODY_BYTES", "Gateway"]

log = logging.getLogger("llmgw.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Largest request body accepted, in bytes (the sample proxy's 32 MB).
MAX_BODY_BYTES: Final = 32 * 1024 * 1024
#: Seconds a client is told to wait when no replica is ready.
RETRY_AFTER_S: Final = 5
#: Upstream deadlines, in seconds.
UPSTREAM_CONNECT_S: Final = 5.0
UPSTREAM_READ_S: Final = 600.0

_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream")
_NO_CACHE = (b"cache-control", b"no-cache")

_BROKEN_STREAM_EVENT: Final = (
    b'data: {"error":{"message":"The replica answering broke off mid-answer; retry.",'
    b'"type":"server_error","code":"upstream_error","param":null}}\n\n'
)

_CUT_STREAM_EVENT: Final = (
    b'data: {"error":{"message":"The gateway is stopping; the answer was cut short. Retry.",'
    b'"type":"server_error","code":"server_shutting_down","param":null}}\n\n'
)

_COMPLETION_ROUTES: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}


class Gateway:
    """The ASGI application for the client port.

    Args:
        authenticator: checks client keys.
        cluster: ready endpoints, the catalog's model names, leadership.
        usage: where usage rows go (never awaited on the request path).
        max_body_bytes: request bodies larger than this get 413.
        accounting: limits, budgets and a usage row per request; off only
            for the ``bare`` mode of ``llmgw bench overhead`` (a key, no
            accounting).
        accountant, resolver: the rate limits and budgets along each key's
            path in the tree (``shared/spec/accounting.md``); without them
            nothing is limited.
    """

    def __init__(
        self,
        *,
        authenticator: KeyAuthenticator,
        cluster: Cluster,
        usage: UsageWriter,
        max_body_bytes: int = MAX_BODY_BYTES,
        accounting: bool = True,
        accountant: Accountant | None = None,
        resolver: ScopeResolver | None = None,
    ) -> None:
        self._auth = authenticator
        self._accounting = accounting
        self._accountant = accountant if accounting else None
        self._resolver = resolver
        self._cluster = cluster
        self._usage = usage
        self._max_body_bytes = max_body_bytes
        self._pools: dict[tuple[str, int], UpstreamPool] = {}

    async def aclose(self) -> None:
        """Close the pooled upstream connections."""
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            await pool.aclose()

    # --- ASGI entry -------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await answer_lifespan(receive, send)
            return
        if kind != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if path in _COMPLETION_ROUTES:
            if method != "POST":
                await _answer(send, 405, _error(405, f"{path} takes POST"), [(b"allow", b"POST")])
                return
            await self._completion(scope, receive, send, _COMPLETION_ROUTES[path])
        elif path == "/health":
            await _answer(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            ready = self._cluster.is_leader and self._cluster.any_ready()
            await _answer(
                send, 200 if ready else 503, b'{"ready":%s}' % (b"true" if ready else b"false")
            )
        elif path == "/leader":
            leader = self._cluster.is_leader
            await _answer(
                send, 200 if leader else 503, b'{"leader":%s}' % (b"true" if leader else b"false")
            )
        elif path == "/v1/models":
            if method not in ("GET", "HEAD"):
                await _answer(send, 405, _error(405, f"{path} takes GET"), [(b"allow", b"GET")])
                return
            await self._models(scope, send)
        else:
            await _answer(send, 404, _error(404, f"no route {method} {path}", code="unknown_url"))

    # --- /v1/models --------------------------------------------------------------

    async def _models(self, scope: Scope, send: Send) -> None:
        try:
            await self._authenticate(scope)
        except ApiError as exc:
            await _answer(send, exc.status, exc.body(), exc.headers)
            return
        data = [
            {"id": name, "object": "model", "created": int(model.created_at), "owned_by": "llmgw"}
            for name, model in sorted(self._cluster.models.items())
        ]
        await _answer(send, 200, orjson.dumps({"object": "list", "data": data}))

    # --- completions ---------------------------------------------------------------

    async def _completion(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        call = _Call(kind)
        metrics.IN_FLIGHT.inc()
        try:
            call.key = await self._authenticate(scope)
            body = await _read_body(scope, receive, self._max_body_bytes)
            doc = _parse(body, kind)
            call.model = doc["model"]
            call.stream = doc.get("stream") is True
            call.prompt_estimate = estimate_prompt_tokens(doc, kind, bytes_per_token=4)
            if call.model not in self._cluster.models:
                raise ApiError(
                    404,
                    f"The model '{call.model}' does not exist",
                    code="model_not_found",
                    param="model",
                )
            if self._accountant is not None and self._resolver is not None:
                try:
                    path, call.scope_ids = await self._resolver.path(call.key)
                except StoreError as exc:
                    log.error("cannot read a key's limits: %s", exc)
                    raise _store_unavailable() from None
                try:
                    call.reservation = self._accountant.check(
                        path, call.model, estimate_tokens(doc, kind), time.time()
                    )
                except Refused as refused:
                    call.headers = self._accountant.rate_headers(path, time.time())
                    raise _refusal(refused) from None
                call.headers = call.reservation.headers()
            endpoint = self._pick(call.model)
            await self._forward(receive, send, call, doc, body, endpoint)
        except ApiError as exc:
            await _answer(
                send,
                exc.status,
                exc.body(),
                (*exc.headers, *call.headers, (b"x-request-id", call.request_id.encode())),
            )
            self._finish(call, exc.status, None)
        finally:
            metrics.IN_FLIGHT.dec()

    async def _authenticate(self, scope: Scope) -> KeyRecord:
        header = _header(scope, b"authorization")
        if not header:
            raise unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer sk-llmgw-…'."
            )
        scheme, _, secret = header.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise unauthorized("The Authorization header must be 'Bearer <key>'.")
        try:
            return await self._auth.check(secret.strip())
        except KeyRefused as exc:
            raise unauthorized(str(exc)) from None
        except StoreError as exc:
            log.error("cannot check a key: %s", exc)
            raise _store_unavailable() from None

    def _pick(self, model: str) -> Endpoint:
        endpoints = self._cluster.ready_endpoints(model)
        if not endpoints:
            raise ApiError(
                503,
                f"No replica of '{model}' is ready yet; retry shortly.",
                type="server_error",
                code="model_not_ready",
                headers=[(b"retry-after", str(RETRY_AFTER_S).encode())],
            )
        return min(endpoints, key=lambda e: e.in_flight)

    def _pool(self, endpoint: Endpoint) -> UpstreamPool:
        key = (endpoint.host, endpoint.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = UpstreamPool(endpoint.host, endpoint.port)
        return pool

    async def _forward(
        self,
        receive: Receive,
        send: Send,
        call: _Call,
        doc: dict[str, Any],
        body: bytes,
        endpoint: Endpoint,
    ) -> None:
        pass_usage = False
        if call.stream:
            options = doc.get("stream_options")
            pass_usage = isinstance(options, dict) and options.get("include_usage") is True
            if not pass_usage:
                # Always ask the engine for the final usage; the relay keeps
                # it from a client that did not ask.
                doc["stream_options"] = {**(options or {}), "include_usage": True}
                body = orjson.dumps(doc)
        path = b"/v1/chat/completions" if call.kind == "chat" else b"/v1/completions"
        headers = [
            (b"authorization", endpoint.authorization),
            (b"content-type", b"application/json"),
            (b"x-request-id", call.request_id.encode()),
        ]
        pool = self._pool(endpoint)
        call.replica_id = endpoint.replica_id
        endpoint.in_flight += 1
        outcome = _Outcome()
        try:
            with trio.CancelScope() as watch:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_disconnect, receive, watch)
                    await _attempt(
                        pool, path, body, headers, send, pass_usage, call, endpoint, outcome
                    )
                    nursery.cancel_scope.cancel()
            if watch.cancelled_caught and not outcome.finished:
                outcome.status = 499  # the client went away first
        finally:
            endpoint.in_flight -= 1
            if outcome.connect_error is None:
                call.ttft_s = outcome.ttft_s
                self._finish(call, outcome.status, outcome.usage)
        if outcome.connect_error is not None:
            raise ApiError(
                502,
                f"The replica serving '{call.model}' did not answer; retry.",
                type="server_error",
                code="upstream_error",
            ) from outcome.connect_error

    def _finish(self, call: _Call, status: int, usage: Usage | None) -> None:
        """Metrics, the accountant settled, the usage row queued. Never awaits."""
        duration_s = time.perf_counter() - call.started
        label = call.model if call.model in self._cluster.models else ""
        metrics.REQUESTS.labels(label, str(status)).inc()
        metrics.REQUEST_DURATION.labels(label).observe(duration_s)
        if call.ttft_s is not None:
            metrics.TTFT.labels(label).observe(call.ttft_s)
        if usage is not None:
            metrics.TOKENS.labels(label, "prompt").inc(usage.prompt_tokens)
            metrics.TOKENS.labels(label, "cached").inc(usage.cached_tokens)
            metrics.TOKENS.labels(label, "completion").inc(usage.completion_tokens)
        key = call.key
        if key is None or not self._accounting:
            return
        cost_micros = 0
        if call.reservation is not None and self._accountant is not None:
            now = time.time()
            if usage is not None:
                cost_micros = self._accountant.settle(
                    call.reservation,
                    prompt=usage.prompt_tokens,
                    cached=usage.cached_tokens,
                    completion=usage.completion_tokens,
                    now=now,
                    served_model=label or None,
                )
            else:
                self._accountant.release(call.reservation, now)
        project_id, team_id, org_id = call.scope_ids
        self._usage.record(
            UsageRow(
                request_id=call.request_id,
                created_at=time.time(),
                key_id=key.id,
                model=label or call.model[:200],
                served_model=label,
                status=status,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                cached_tokens=usage.cached_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                cost_micros=cost_micros,
                duration_ms=round(duration_s * 1000, 3),
                ttft_ms=None if call.ttft_s is None else round(call.ttft_s * 1000, 3),
                replica_id=call.replica_id,
                stream=call.stream,
                endpoint=call.kind,
                project_id=project_id,
                team_id=team_id,
                org_id=org_id,
            )
        )


# --- helpers -----------------------------------------------------------------------


class _Call:
    """One client request as it goes through the gateway."""

    __slots__ = (
        "headers",
        "key",
        "kind",
        "model",
        "prompt_estimate",
        "replica_id",
        "request_id",
        "reservation",
        "scope_ids",
        "started",
        "stream",
        "ttft_s",
    )

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.started = time.perf_counter()
        self.request_id = "req_" + secrets.token_hex(12)
        self.key: KeyRecord | None = None
        self.model = ""
        self.prompt_estimate = 0
        self.stream = False
        self.reservation: Reservation | None = None
        self.scope_ids: tuple[str, str, str] = ("", "", "")
        #: Response headers every answer carries (the rate-limit figures).
        self.headers: list[tuple[bytes, bytes]] = []
        self.replica_id = ""
        self.ttft_s: float | None = None


#: Output tokens assumed for a request that gives no max_tokens, when
#: estimating what it will spend (the model's max_output comes with the catalog).
DEFAULT_MAX_OUTPUT_TOKENS: Final = 512


def estimate_tokens(doc: dict[str, Any], kind: str) -> int:
    """The tokens a request may spend: its prompt (:func:`estimate_prompt_tokens`)
    plus its ``max_tokens``. Charged to the token limiters first, then
    settled with the real count."""
    output = doc.get("max_completion_tokens") or doc.get("max_tokens") or DEFAULT_MAX_OUTPUT_TOKENS
    return estimate_prompt_tokens(doc, kind) + int(output)


def estimate_prompt_tokens(doc: dict[str, Any], kind: str, *, bytes_per_token: int = 2) -> int:
    """A prompt's tokens from its size: one token per ``bytes_per_token``
    bytes of UTF-8 text, plus 4 a message for the chat template; at least 1.

    The default, 2, is on the high side (prose runs 4 or more bytes a
    token; repeated short words can run 2): what budgets and token limits
    hold before the real count is known, so a burst cannot overshoot by
    much. 4 is the typical figure, charged when an engine's count never
    came (an answer cut short)."""
    if kind == "chat":
        size = 0
        messages = doc.get("messages") or []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            size += (
                len(content.encode()) if isinstance(content, str) else len(orjson.dumps(content))
            )
        prompt = -(-size // bytes_per_token) + 4 * len(messages)
    else:
        given = doc.get("prompt")
        size = len(given.encode()) if isinstance(given, str) else len(orjson.dumps(given))
        prompt = -(-size // bytes_per_token)
    return max(prompt, 1)


def _store_unavailable() -> ApiError:
    return ApiError(
        503,
        "The gateway cannot reach its store just now; retry shortly.",
        type="server_error",
        code="store_unavailable",
        headers=[(b"retry-after", str(RETRY_AFTER_S).encode())],
    )


def _refusal(refused: Refused) -> ApiError:
    headers = []
    if refused.retry_after_s:
        headers.append((b"retry-after", str(max(1, round(refused.retry_after_s))).encode()))
    return ApiError(
        refused.status, refused.message, type=refused.type, code=refused.code, headers=headers
    )


class _Outcome:
    """What one upstream attempt came to (filled in as it goes)."""

    __slots__ = ("connect_error", "finished", "status", "ttft_s", "usage")

    def __init__(self) -> None:
        self.status = 502
        #: The engine's whole answer is in hand and being sent on.
        self.finished = False
        self.usage: Usage | None = None
        self.ttft_s: float | None = None
        self.connect_error: UpstreamError | None = None


async def _attempt(
    pool: UpstreamPool,
    path: bytes,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    send: Send,
    pass_usage: bool,
    call: _Call,
    endpoint: Endpoint,
    outcome: _Outcome,
) -> None:
    try:
        response = await pool.request(b"POST", path, headers, body)
    except UpstreamError as exc:
        log.warning("replica %s did not answer: %s", endpoint.replica_id, exc)
        outcome.connect_error = exc
        return
    async with response:
        try:
            outcome.status = response.status
            content_type = (
                b"content-type",
                response.header(b"content-type") or b"application/json",
            )
            extra = [
                (b"x-request-id", call.request_id.encode()),
                (b"x-llmgw-replica", endpoint.replica_id.encode()),
                *call.headers,
            ]
            if call.stream and response.status == 200:
                await _relay_stream(
                    response, send, [content_type, *extra], pass_usage, call, outcome
                )
            else:
                data = await response.read()
                if response.status == 200:
                    try:
                        outcome.usage = usage_from(orjson.loads(data))
                    except orjson.JSONDecodeError:
                        outcome.usage = None
                elif response.status in (401, 403):
                    # The engine refused the gateway's engine key: not the
                    # client's fault, and not to be shown as theirs.
                    log.error("replica %s refused the engine key", endpoint.replica_id)
                    outcome.status = 502
                    data = _error(
                        502, "The replica refused the gateway; retry.", code="upstream_error"
                    )
                    content_type = _JSON
                else:
                    data = _openai_error(response.status, data)
                    content_type = _JSON
                outcome.finished = True
                await _answer(send, outcome.status, data, extra, content_type=content_type)
        except UpstreamError as exc:
            log.warning("answer from replica %s broke off: %s", endpoint.replica_id, exc)
            outcome.status = 502


async def _relay_stream(
    response: UpstreamResponse,
    send: Send,
    headers: list[tuple[bytes, bytes]],
    pass_usage: bool,
    call: _Call,
    outcome: _Outcome,
) -> None:
    relay = SseRelay(pass_usage=pass_usage)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [headers[0], _NO_CACHE, *headers[1:]],
        }
    )
    try:
        while chunk := await response.receive():
            out = relay.feed(chunk)
            if out:
                if outcome.ttft_s is None and relay.content_chunks:
                    outcome.ttft_s = time.perf_counter() - call.started
                if relay.saw_done:
                    # The answer is complete once [DONE] is on its way: a
                    # client that closes right after it got everything.
                    outcome.finished = True
                await send({"type": "http.response.body", "body": out, "more_body": True})
        outcome.finished = True
        await send({"type": "http.response.body", "body": relay.flush(), "more_body": False})
    except UpstreamError:
        # The engine broke off mid-answer. Say so in the stream (the openai
        # client raises it as an APIError) and end the answer cleanly.
        if not relay.saw_done:
            await send(
                {"type": "http.response.body", "body": _BROKEN_STREAM_EVENT, "more_body": False}
            )
        raise
    except trio.Cancelled:
        # Cut short: the client left (then this is dropped), or the stop's
        # grace ran out (then the client is told, not left with a torn stream).
        if not relay.saw_done:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await send(
                    {"type": "http.response.body", "body": _CUT_STREAM_EVENT, "more_body": False}
                )
        raise
    finally:
        # Counted even when the answer was cut short: the client is charged
        # for what was generated, and for its prompt as estimated when the
        # engine's own count never came.
        outcome.usage = relay.usage
        if outcome.usage is None and relay.content_chunks:
            outcome.usage = Usage(
                prompt_tokens=call.prompt_estimate, completion_tokens=relay.content_chunks
            )


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    length = _header(scope, b"content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(
            413, f"The request body is larger than {limit} bytes.", code="request_too_large"
        )
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(499, "client disconnected", code="client_closed")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"The request body is larger than {limit} bytes.", code="request_too_large"
            )
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _parse(body: bytes, kind: str) -> dict[str, Any]:
    if not body:
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise bad_request("The request body must be a JSON object.")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string.", param="model")
    if kind == "chat":
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request(
                "'messages' is required and must be a non-empty array.", param="messages"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(
                    f"messages[{i}] must be an object with a 'role'.", param=f"messages[{i}]"
                )
    else:
        prompt = doc.get("prompt")
        if not isinstance(prompt, str | list) or not prompt:
            raise bad_request(
                "'prompt' is required and must be a string or an array.", param="prompt"
            )
    if doc.get("stream") is None:
        doc.pop("stream", None)  # null means the default: not streamed
    elif not isinstance(doc["stream"], bool):
        raise bad_request("'stream' must be true or false.", param="stream")
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    n = doc.get("n")
    if n is not None and n != 1:
        # Engines here answer one choice whatever n says, and the usage would
        # not match the answer: refused clearly until n is carried through.
        raise bad_request("'n' other than 1 is not supported yet.", param="n")
    for field in ("max_tokens", "max_completion_tokens"):
        value = doc.get(field)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise bad_request(f"'{field}' must be a positive integer.", param=field)
    return doc


def _openai_error(status: int, data: bytes) -> bytes:
    """An engine's error answer in OpenAI's shape: ``code`` a string or null,
    ``type`` and ``param`` present, the engine's message kept."""
    message, kind, code = f"The engine answered HTTP {status}.", None, None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        doc = None
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        if isinstance(error.get("message"), str):
            message = error["message"]
        if isinstance(error.get("type"), str):
            kind = error["type"]
        if error.get("code") is not None:
            code = str(error["code"])
    elif isinstance(error, str):
        message = error
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, type=kind, code=code).body()


def _error(status: int, message: str, *, code: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return ApiError(status, message, type=kind, code=code).body()


async def _answer(
    send: Send,
    status: int,
    body: bytes,
    headers: tuple[tuple[bytes, bytes], ...] | list[tuple[bytes, bytes]] = (),
    *,
    content_type: tuple[bytes, bytes] = _JSON,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [content_type, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})

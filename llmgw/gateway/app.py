"""The client API: one lean ASGI callable, no framework on the hot path.

Routes (``shared/spec/gateway-api.md``, ``ha-and-leader.md``):

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` —
  relayed to an endpoint of the model, streamed or not;
- ``POST /v1/messages`` (Anthropic) and ``POST /v1/responses`` (OpenAI
  Responses) — translated to the engines' chat API and back
  (:mod:`llmgw.gateway.anthropic`, :mod:`llmgw.gateway.responses`);
- ``GET /v1/models`` — the catalog;
- ``GET /health``, ``GET /ready``, ``GET /leader`` — open, no store access.

A request: read the body (bounded) → authenticate the key → refuse when the
system is stopped → parse, translate and check the body → resolve the model
(aliases) → limits and budgets → the answer cache → admission by band →
choose an endpoint (``llmgw.router.scoring``), retrying on another one when
it fails before the first byte and falling back to other models when the
model has no room → forward with the engine's own key (the client's
``Authorization`` never reaches the engine) → relay the answer, joining the
events in hand into one write → queue a usage row and count metrics. A
client that disconnects cancels the engine request.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, Final, Protocol

import orjson
import trio

from llmgw import metrics
from llmgw.accounting.accountant import Accountant, Refused, Reservation
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter
from llmgw.agent.protocol import ShardState
from llmgw.asgi import answer_lifespan
from llmgw.auth.keys import KeyAuthenticator, KeyRefused
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster, Endpoint
from llmgw.engines.registry import unsupported_request
from llmgw.router import scoring
from llmgw.router.admission import Admission, AdmissionTimeout, Band
from llmgw.router.breaker import counts_as_failure, earliest_recovery, parse_retry_after_s
from llmgw.router.cache import CACHE_REQUESTS, AnswerCache, CachedAnswer, cache_key
from llmgw.router.external import ProviderKeys
from llmgw.store import KeyRecord, ModelRecord, StoreError, UsageRow

from . import anthropic, responses
from .errors import ApiError, bad_request, unauthorized
from .sse import SseRelay, Usage, usage_from
from .upstream import UpstreamError, UpstreamPool, UpstreamResponse, default_ssl_context

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
#: Endpoints one request may be tried on (the first and the retries), when
#: each fails before any byte reached the client.
MAX_ATTEMPTS: Final = 3
#: Longest wait for a cooling-down endpoint to recover, in seconds.
MAX_RECOVERY_WAIT_S: Final = 30.0

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

#: Route → the request's kind.
_ROUTES: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
#: Kind → the engine route it is sent to (Anthropic and Responses requests
#: are translated to chat).
_UPSTREAM_PATH: Final = {
    "chat": b"/v1/chat/completions",
    "completions": b"/v1/completions",
    "embeddings": b"/v1/embeddings",
    "messages": b"/v1/chat/completions",
    "responses": b"/v1/chat/completions",
}


class _StreamShape(Protocol):
    """A streamed answer's relay or translator: engine SSE bytes in, client
    bytes out (:class:`SseRelay`, :class:`anthropic.MessagesStream`,
    :class:`responses.ResponsesStream`)."""

    usage: Usage | None
    content_chunks: int
    #: The answer's end is in hand (``[DONE]``, or the translated end).
    done: bool

    def feed(self, data: bytes) -> bytes: ...
    def finish(self) -> bytes: ...


class Gateway:
    """The ASGI application for the client port.

    Args:
        authenticator: checks client keys.
        cluster: ready endpoints, the catalog, the live settings, leadership.
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
        self._pools: dict[tuple[str, int, bool], UpstreamPool] = {}
        #: Outside models' keys, with the (url, key files) they were made from.
        self._providers: dict[str, tuple[object, ProviderKeys]] = {}
        self._names: dict[str, ModelRecord] = {}
        self._names_of: object = None
        settings = cluster.settings
        self._bands_of: object = settings.router.admission
        self._timeouts_of: object = settings.router.timeouts
        #: Read at start by the control plane; followed from here on.
        self._auth_of: object = settings.auth
        self._admission = Admission(_bands(settings.router.admission.bands))
        self._cache_settings: object = settings.router.cache
        self._cache = AnswerCache(
            max_bytes=settings.router.cache.max_bytes,
            max_entry_bytes=settings.router.cache.max_entry_bytes,
        )

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
        route = _ROUTES.get(path)
        if route is not None:
            if method != "POST":
                await _answer(send, 405, _error(405, f"{path} takes POST"), [(b"allow", b"POST")])
                return
            await self._completion(scope, receive, send, route)
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
        elif (
            path.startswith("/v1/") and method == "POST" and self._cluster.settings.serving.stopped
        ):
            await _answer(send, 503, _system_stopped().body())
        else:
            await _answer(send, 404, _error(404, f"no route {method} {path}", code="unknown_url"))

    # --- /v1/models --------------------------------------------------------------

    async def _models(self, scope: Scope, send: Send) -> None:
        try:
            key = await self._authenticate(scope)
            path = None
            if self._accountant is not None and self._resolver is not None:
                path, _ = await self._resolver.path(key)
        except ApiError as exc:
            await _answer(send, exc.status, exc.body(), exc.headers)
            return
        except StoreError:
            down = _store_unavailable()
            await _answer(send, down.status, down.body(), down.headers)
            return
        data = []
        for name, model in sorted(self._cluster.models.items()):
            if (
                path is not None
                and self._accountant is not None
                and not self._accountant.allowed(path, name)
            ):
                continue
            entry: dict[str, Any] = {
                "id": name,
                "object": "model",
                "created": int(model.created_at),
                "owned_by": "external" if model.external is not None else "llmgw",
                "max_output_tokens": model.max_output_tokens,
            }
            if model.aliases:
                entry["aliases"] = list(model.aliases)
            data.append(entry)
        await _answer(send, 200, orjson.dumps({"object": "list", "data": data}))

    # --- the model namespace --------------------------------------------------------

    def resolve(self, name: str) -> ModelRecord | None:
        """The catalog model called ``name`` or having it as an alias."""
        models = self._cluster.models
        if models is not self._names_of:
            names: dict[str, ModelRecord] = {}
            for model in models.values():
                for alias in model.aliases:
                    names.setdefault(alias, model)
            names.update(models)
            self._names, self._names_of = names, models
        return self._names.get(name)

    def _sync_settings(self) -> None:
        """Follow live changes of the admission bands, the cache bounds, and
        the default limits and prices (``auth.default_rpm``, ``default_tpm``,
        ``pricing``, ``default_price``)."""
        settings = self._cluster.settings
        if settings.auth is not self._auth_of:
            self._auth_of = auth = settings.auth
            if self._accountant is not None:
                self._accountant.prices = PriceBook(auth.pricing, auth.default_price)
                self._accountant.default_rpm = auth.default_rpm
                self._accountant.default_tpm = auth.default_tpm
        router = settings.router
        if router.timeouts is not self._timeouts_of:
            self._timeouts_of = router.timeouts
            for pool in self._pools.values():
                pool.connect_timeout_s = router.timeouts.connect
        if router.admission is not self._bands_of:
            self._bands_of = router.admission
            try:
                self._admission.set_bands(_bands(router.admission.bands))
            except ValueError as exc:  # the settings' own checks should stop this first
                log.error("admission bands not applied, keeping the last ones: %s", exc)
        if router.cache is not self._cache_settings:
            self._cache_settings = router.cache
            self._cache.clear()
            self._cache = AnswerCache(
                max_bytes=router.cache.max_bytes, max_entry_bytes=router.cache.max_entry_bytes
            )

    # --- completions ---------------------------------------------------------------

    async def _completion(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        call = _Call(kind)
        metrics.IN_FLIGHT.inc()
        try:
            call.key = await self._authenticate(scope)
            self._sync_settings()
            if self._cluster.settings.serving.stopped:
                raise _system_stopped()
            body = await _read_body(scope, receive, self._max_body_bytes)
            doc = _parse(body, kind)
            if kind in ("chat", "completions", "embeddings"):
                call.body = body  # sent on as it came unless the doc changes
            if kind == "messages":
                call.client_doc = doc
                doc = anthropic.request_to_chat(doc)
            elif kind == "responses":
                call.client_doc = doc
                doc = responses.request_to_chat(doc)
            call.stream = doc.get("stream") is True
            model = self.resolve(doc["model"])
            if model is None:
                raise ApiError(
                    404,
                    f"The model '{doc['model']}' does not exist",
                    code="model_not_found",
                    param="model",
                )
            call.model = model.name
            self._check(doc, model, kind)
            profile = _header(scope, b"x-llmgw-profile")
            call.profile = (
                profile.decode("latin-1") if profile else model.routing
            ) or self._cluster.settings.router.scoring
            if call.profile not in scoring.PROFILES:
                raise bad_request(
                    f"x-llmgw-profile must be one of {', '.join(sorted(scoring.PROFILES))}.",
                    param="x-llmgw-profile",
                )
            call.prompt_estimate = estimate_prompt_tokens(
                doc, _ESTIMATE_KIND[kind], bytes_per_token=4
            )
            if self._accountant is not None and self._resolver is not None:
                try:
                    call.path, call.scope_ids = await self._resolver.path(call.key)
                except StoreError as exc:
                    log.error("cannot read a key's limits: %s", exc)
                    raise _store_unavailable() from None
                try:
                    call.reservation = self._accountant.check(
                        call.path,
                        model.name,
                        estimate_tokens(doc, _ESTIMATE_KIND[kind]),
                        time.time(),
                    )
                except Refused as refused:
                    call.headers = self._accountant.rate_headers(call.path, time.time())
                    raise _refusal(refused) from None
                call.headers = call.reservation.headers()
            if model.on_demand:
                self._cluster.touch(model.name)
            refusal: list[ApiError] = []
            with trio.CancelScope() as watch:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_disconnect, receive, watch)
                    try:
                        await self._answer_request(scope, send, call, doc, model)
                    except ApiError as exc:
                        refusal.append(exc)  # raised out here, not in a group
                    nursery.cancel_scope.cancel()
            if refusal:
                raise refusal[0]
            if watch.cancelled_caught and not call.finished:
                self._finish(call, 499, call.usage)  # the client went away first
        except ApiError as exc:
            body = (
                anthropic.error_body(exc.status, exc.message) if kind == "messages" else exc.body()
            )
            await _answer(
                send,
                exc.status,
                body,
                (*exc.headers, *call.headers, (b"x-request-id", call.request_id.encode())),
            )
            self._finish(call, exc.status, None)
        finally:
            metrics.IN_FLIGHT.dec()
            if call.key is not None and not call.recorded:
                # Cut by the stop's grace (a cancellation, possibly inside an
                # exception group): what was generated is still charged and
                # recorded.
                self._finish(call, 503, call.usage)

    def _check(self, doc: dict[str, Any], model: ModelRecord, kind: str) -> None:
        """The model-dependent checks (``shared/spec/gateway-api.md``, pipeline step 3)."""
        if model.stopped:
            raise ApiError(
                503,
                f"The model '{model.name}' is stopped by an administrator.",
                type="server_error",
                code="model_stopped",
            )
        limit = model.max_output_tokens
        for field in ("max_tokens", "max_completion_tokens"):
            value = doc.get(field)
            if limit and isinstance(value, int) and value > limit:
                # Named as the client named it (Responses: max_output_tokens).
                asked = "max_output_tokens" if kind == "responses" else field
                raise bad_request(
                    f"'{asked}' is {value}, above the {limit} tokens '{model.name}' may answer.",
                    param=asked,
                )
        profile = model.profile
        if model.external is None and profile is not None:
            refused = unsupported_request(profile.engine, profile.args, doc)
            if refused is not None:
                field, why = refused
                raise bad_request(f"'{model.name}' {why}.", param=field)

    async def _authenticate(self, scope: Scope) -> KeyRecord:
        header = _header(scope, b"authorization")
        if not header:
            header = _header(scope, b"x-api-key")  # Anthropic's clients
            if header:
                header = b"Bearer " + header
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

    # --- cache, admission, routing -------------------------------------------------------

    async def _answer_request(
        self, scope: Scope, send: Send, call: _Call, doc: dict[str, Any], model: ModelRecord
    ) -> None:
        ttl_s = self._cache_ttl_s(call, scope)
        if ttl_s is not None:
            call.cache_key = cache_key(call.scope_ids[0], model.name, call.kind, doc)
            hit = self._cache.get(call.cache_key)
            CACHE_REQUESTS.labels(model.name, "hit" if hit is not None else "miss").inc()
            if hit is not None:
                await self._replay(send, call, hit)
                return
            call.cache_ttl_s = ttl_s
        endpoints = self._endpoints(model)
        capacity = 0 if model.external is not None else _capacity(endpoints, model)
        band = (call.key.band if call.key is not None else "") or (
            self._cluster.settings.router.admission.default_band
        )
        queued_at = time.perf_counter()
        try:
            ticket = await self._admission.admit(model.name, band, capacity)
        except AdmissionTimeout as exc:
            raise ApiError(
                504,
                f"'{model.name}' is busy and this request waited its band's limit; retry.",
                type="server_error",
                code="queue_timeout",
                headers=[(b"retry-after", str(max(1, round(exc.retry_after_s))).encode())],
            ) from None
        call.waited_s += time.perf_counter() - queued_at
        with ticket:
            await self._route(scope, send, call, doc, model)

    def _cache_ttl_s(self, call: _Call, scope: Scope) -> float | None:
        projects = self._cluster.settings.router.cache.projects
        if not projects or not call.scope_ids[0]:
            return None
        ttl_s = projects.get(call.scope_ids[0])
        if ttl_s is None:
            return None
        asked = _header(scope, b"x-llmgw-cache")
        if asked is not None and asked.strip().lower() in (b"no-store", b"bypass", b"off"):
            CACHE_REQUESTS.labels(call.model, "bypass").inc()
            return None
        return ttl_s

    def _endpoints(self, model: ModelRecord) -> list[Endpoint]:
        """The model's endpoints now: its Ready replicas, or its outside keys."""
        if model.external is not None:
            external = model.external
            source = (external.url, tuple((k.file, k.weight) for k in external.api_key_files))
            found = self._providers.get(model.name)
            if found is None or found[0] != source:
                found = self._providers[model.name] = (
                    source,
                    ProviderKeys(model.name, external.url, list(source[1])),
                )
            return found[1].refresh(time.monotonic())
        return self._cluster.ready_endpoints(model.name)

    def _loading(self, model: ModelRecord) -> bool:
        """The model has replicas starting, or loads on demand."""
        if model.on_demand:
            return True
        return any(
            s.model == model.name and s.wanted and s.state is ShardState.STARTING
            for s in self._cluster.shards.values()
        )

    async def _targets(
        self, call: _Call, model: ModelRecord, tried: set[str]
    ) -> tuple[ModelRecord, Endpoint]:
        """The model to send to (the one asked, else a fallback) and its endpoint.

        Waits for a loading model (bounded by ``on_demand.load_wait``) and for
        a cooling-down endpoint (bounded by :data:`MAX_RECOVERY_WAIT_S`).

        Raises:
            ApiError: 503 when nothing can answer.
        """
        waited_for_load = False
        while True:
            for target in self._candidates(call, model):
                endpoints = self._endpoints(target)
                chosen = scoring.choose(
                    endpoints, call.profile, session=call.session, exclude=tried
                )
                if chosen is not None:
                    return target, chosen
            if not waited_for_load and self._loading(model) and not tried:
                waited_for_load = True
                started = time.perf_counter()
                await self._wait_loaded(model)
                call.waited_s += time.perf_counter() - started
                continue
            endpoints = self._endpoints(model)
            recovery = earliest_recovery(e for e in endpoints if e.replica_id not in tried)
            if recovery is not None:
                delay_s = recovery - time.monotonic()
                if 0 < delay_s <= MAX_RECOVERY_WAIT_S:
                    await trio.sleep(delay_s)
                    continue
            raise ApiError(
                503,
                f"No replica of '{model.name}' is ready yet; retry shortly.",
                type="server_error",
                code="model_not_ready",
                headers=[(b"retry-after", str(RETRY_AFTER_S).encode())],
            )

    async def _wait_loaded(self, model: ModelRecord) -> None:
        """Wait, at most ``on_demand.load_wait``, for the model to have a Ready
        replica (an on-demand model is loaded by this wait)."""
        with trio.move_on_after(self._cluster.settings.on_demand.load_wait):
            try:
                await self._cluster.wait_ready(model.name)
            except LookupError:
                return  # removed from the catalog meanwhile

    def _candidates(self, call: _Call, model: ModelRecord) -> Iterator[ModelRecord]:
        """The model asked for, then its fallbacks the key may use, looked up
        only when the ones before could not take the request."""
        yield model
        for name in model.fallbacks:
            fallback = self.resolve(name)
            if fallback is None or fallback.stopped or fallback.name == model.name:
                continue
            if (
                call.path is not None
                and self._accountant is not None
                and not self._accountant.allowed(call.path, fallback.name)
            ):
                continue  # prompts go only where the key may send them
            yield fallback

    async def _route(
        self, scope: Scope, send: Send, call: _Call, doc: dict[str, Any], model: ModelRecord
    ) -> None:
        if call.profile == "chat":
            call.session = scoring.session_key(doc, scope["headers"])
        tried: set[str] = set()
        if call.stream:
            options = doc.get("stream_options")
            call.pass_usage = isinstance(options, dict) and options.get("include_usage") is True
            if not call.pass_usage:
                # Always ask the engine for the final usage; the relay keeps
                # it from a client that did not ask.
                doc["stream_options"] = {**(options or {}), "include_usage": True}
                call.body = None
        # The client's own bytes go on while they name the model served.
        body, body_for = call.body, doc["model"] if call.body is not None else None
        for attempt in range(MAX_ATTEMPTS):
            target, endpoint = await self._targets(call, model, tried)
            upstream_model = target.external.model if target.external is not None else target.name
            if body is None or body_for != upstream_model:
                doc["model"] = upstream_model
                body, body_for = orjson.dumps(doc), upstream_model
            call.served = target.name

            def can_retry(attempt: int = attempt, endpoint: Endpoint = endpoint) -> bool:
                return attempt < MAX_ATTEMPTS - 1 and self._more(call, model, tried, endpoint)

            if await self._forward(send, call, body, endpoint, can_retry):
                return
            tried.add(endpoint.replica_id)

    def _more(self, call: _Call, model: ModelRecord, tried: set[str], endpoint: Endpoint) -> bool:
        """Whether another endpoint could take a retry."""
        skip = {*tried, endpoint.replica_id}
        now = time.monotonic()
        for target in self._candidates(call, model):
            for other in self._endpoints(target):
                if other.replica_id not in skip and other.breaker.available(now):
                    return True
        return False

    def _pool(self, endpoint: Endpoint) -> UpstreamPool:
        key = (endpoint.host, endpoint.port, endpoint.tls)
        pool = self._pools.get(key)
        if pool is None:
            timeouts = self._cluster.settings.router.timeouts
            pool = self._pools[key] = UpstreamPool(
                endpoint.host,
                endpoint.port,
                ssl_context=default_ssl_context() if endpoint.tls else None,
                connect_timeout_s=timeouts.connect,
            )
        return pool

    async def _forward(
        self,
        send: Send,
        call: _Call,
        body: bytes,
        endpoint: Endpoint,
        can_retry: Callable[[], bool],
    ) -> bool:
        """One attempt on ``endpoint``. ``True`` when the client got an
        answer (good or not); ``False`` when it failed before any byte was
        sent and another endpoint should be tried (only when ``can_retry()``,
        asked only once it failed)."""
        path = endpoint.path_prefix.encode() + _UPSTREAM_PATH[call.kind]
        headers = [
            (b"authorization", endpoint.authorization),
            (b"content-type", b"application/json"),
            (b"x-request-id", call.request_id.encode()),
        ]
        pool = self._pool(endpoint)
        call.replica_id = endpoint.label
        endpoint.in_flight += 1
        sent_at = time.perf_counter()
        call.overhead_s = max(0.0, sent_at - call.started - call.waited_s)
        timeouts = self._cluster.settings.router.timeouts
        try:
            try:
                with trio.fail_after(timeouts.first_byte):
                    response = await pool.request(b"POST", path, headers, body)
                head_s = time.perf_counter() - sent_at
            except (UpstreamError, trio.TooSlowError) as exc:
                endpoint.breaker.failure(time.monotonic())
                log.warning("endpoint %s did not answer: %r", endpoint.label, exc)
                if can_retry():
                    return False
                raise ApiError(
                    502,
                    f"The replica serving '{call.model}' did not answer; retry.",
                    type="server_error",
                    code="upstream_error",
                ) from exc
            async with response:
                status = response.status
                if status != 200 and _retryable(endpoint, status) and can_retry():
                    retry_after = parse_retry_after_s(response.header(b"retry-after"), time.time())
                    if endpoint.external and status in (401, 403):
                        # A refused key sits out like one at its limit.
                        endpoint.breaker.failure(time.monotonic(), status=429)
                        log.error("external_key_refused: %s answered %d", endpoint.label, status)
                    else:
                        endpoint.breaker.failure(
                            time.monotonic(), status=status, retry_after_s=retry_after
                        )
                        log.warning(
                            "endpoint %s answered %d; trying another", endpoint.label, status
                        )
                    return False
                with trio.move_on_after(timeouts.generation) as generation:
                    await self._relay(send, call, endpoint, response)
                if generation.cancelled_caught:
                    log.warning(
                        "%s: generation over %.0f s; cut", endpoint.label, timeouts.generation
                    )
                    if not call.finished:
                        call.finished = True
                        self._finish(call, 504, call.usage)
                if call.ttft_s is not None:
                    endpoint.observe_ttft(call.ttft_s)
                elif not call.stream and status == 200:
                    # A whole answer's head comes after its generation: the
                    # replicas of one model see the same mix of requests, so
                    # this still ranks them by speed.
                    endpoint.observe_ttft(head_s)
                if status < 500 and status != 429:
                    endpoint.breaker.success()
                elif counts_as_failure(status):
                    endpoint.breaker.failure(time.monotonic(), status=status)
                return True
        finally:
            endpoint.in_flight -= 1

    async def _relay(
        self, send: Send, call: _Call, endpoint: Endpoint, response: UpstreamResponse
    ) -> None:
        status = response.status
        extra = [
            (b"x-request-id", call.request_id.encode()),
            (b"x-llmgw-replica", endpoint.label.encode()),
            (b"x-llmgw-overhead-ms", b"%.3f" % (call.overhead_s * 1000)),
            *call.headers,
        ]
        try:
            if call.stream and status == 200:
                await self._relay_stream(response, send, extra, call)
                return
            data = await response.read()
            content_type = (
                b"content-type",
                response.header(b"content-type") or b"application/json",
            )
            if status == 200:
                try:
                    answer = orjson.loads(data)
                except orjson.JSONDecodeError:
                    answer = None
                call.usage = usage_from(answer)
                if call.kind == "messages" and isinstance(answer, dict):
                    data = orjson.dumps(anthropic.chat_to_message(answer, call.client_model))
                    content_type = _JSON
                elif call.kind == "responses" and isinstance(answer, dict):
                    data = orjson.dumps(
                        responses.chat_to_response(
                            answer, call.client_model, request=call.client_doc
                        )
                    )
                    content_type = _JSON
            elif status in (401, 403) and not endpoint.external:
                # The engine refused the gateway's engine key: not the
                # client's fault, and not to be shown as theirs.
                log.error("replica %s refused the engine key", endpoint.label)
                status = 502
                data = _error(502, "The replica refused the gateway; retry.", code="upstream_error")
                content_type = _JSON
            elif status in (401, 403):
                # The provider refused the key llmgw holds, and no other key
                # was left to try (outside-providers.md: the 401 goes back).
                # Said so the caller does not take it for their own key.
                endpoint.breaker.failure(time.monotonic(), status=429)
                log.error("external_key_refused: %s answered %d", endpoint.label, status)
                message = (
                    f"The outside provider of '{call.model}' refused the key llmgw holds for it "
                    f"({endpoint.label}); your own key is fine. Tell the administrator."
                )
                data = (
                    anthropic.error_body(status, message)
                    if call.kind == "messages"
                    else ApiError(
                        status, message, type="upstream_auth_error", code="external_key_refused"
                    ).body()
                )
                content_type = _JSON
            else:
                data = _openai_error(status, data)
                if call.kind == "messages":
                    data = anthropic.error_body(status, _message_of(data))
                content_type = _JSON
            call.status = status
            call.finished = True
            await _answer(send, status, data, extra, content_type=content_type)
            self._finish(call, status, call.usage)
            if status == 200 and call.cache_key is not None:
                self._store_answer(call, content_type[1], data, stream=False)
        except UpstreamError as exc:
            log.warning("answer from %s broke off: %s", endpoint.label, exc)
            if not call.finished:
                call.finished = True
                self._finish(call, 502, call.usage)

    async def _relay_stream(
        self,
        response: UpstreamResponse,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        call: _Call,
    ) -> None:
        shape = self._stream_shape(call)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [_SSE, _NO_CACHE, *headers],
            }
        )
        kept: list[bytes] | None = [] if call.cache_key is not None else None
        kept_bytes = 0
        limit = self._cache.max_entry_bytes
        status = 502
        try:
            while chunk := await response.receive():
                out = shape.feed(chunk)
                if out:
                    if call.ttft_s is None and shape.content_chunks:
                        call.ttft_s = time.perf_counter() - call.started
                    if shape.done:
                        # The answer is complete once its end is on its way:
                        # a client may close right after it got everything.
                        call.finished = True
                    if kept is not None:
                        kept_bytes += len(out)
                        kept = kept if kept_bytes <= limit else None
                        if kept is not None:
                            kept.append(out)
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            ended = shape.done
            rest = shape.finish()
            call.finished = True
            status = 200
            await send({"type": "http.response.body", "body": rest, "more_body": False})
            if kept is not None and ended:
                kept.append(rest)
                self._store_answer(call, _SSE[1], b"".join(kept), stream=True)
        except UpstreamError:
            # The engine broke off mid-answer. Say so in the stream (the openai
            # client raises it as an APIError) and end the answer cleanly.
            if not shape.done:
                await send(
                    {"type": "http.response.body", "body": _broken(call), "more_body": False}
                )
            call.finished = True
            raise
        except trio.Cancelled:
            # Cut short: the client left (then this is dropped), or the stop's
            # grace ran out (then the client is told, not left with a torn stream).
            if not shape.done:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await send(
                        {"type": "http.response.body", "body": _cut(call), "more_body": False}
                    )
            raise
        finally:
            # Counted even when the answer was cut short: the client is charged
            # for what was generated, and for its prompt as estimated when the
            # engine's own count never came.
            call.usage = shape.usage
            if call.usage is None and shape.content_chunks:
                call.usage = Usage(
                    prompt_tokens=call.prompt_estimate, completion_tokens=shape.content_chunks
                )
            if call.finished:
                self._finish(call, 200 if shape.done else status, call.usage)

    def _stream_shape(self, call: _Call) -> _StreamShape:
        if call.kind == "messages":
            return anthropic.MessagesStream(
                call.client_model,
                anthropic.new_message_id(),
                input_tokens=call.prompt_estimate,
            )
        if call.kind == "responses":
            return responses.ResponsesStream(
                call.client_model, responses.new_response_id(), request=call.client_doc
            )
        return SseRelay(pass_usage=call.pass_usage)

    # --- the answer cache --------------------------------------------------------------

    def _store_answer(self, call: _Call, content_type: bytes, body: bytes, *, stream: bool) -> None:
        assert call.cache_key is not None
        assert call.cache_ttl_s is not None
        self._cache.put(
            call.cache_key,
            CachedAnswer(
                status=200,
                content_type=content_type,
                body=body,
                stream=stream,
                stored_at=time.time(),
            ),
            call.cache_ttl_s,
        )

    async def _replay(self, send: Send, call: _Call, hit: CachedAnswer) -> None:
        """A cached answer, as the client first got it: free, marked as a hit."""
        call.replica_id = "cache"
        call.cache_hit = True
        headers = [
            (b"x-request-id", call.request_id.encode()),
            (b"x-llmgw-cache", b"hit"),
            (b"x-llmgw-replica", b"cache"),
            (b"age", str(hit.age_s(time.time())).encode()),
            (b"x-llmgw-overhead-ms", b"%.3f" % ((time.perf_counter() - call.started) * 1000)),
            *call.headers,
        ]
        call.finished = True
        if hit.stream:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", hit.content_type), _NO_CACHE, *headers],
                }
            )
            await send({"type": "http.response.body", "body": hit.body, "more_body": False})
        else:
            await _answer(
                send, 200, hit.body, headers, content_type=(b"content-type", hit.content_type)
            )
        self._finish(call, 200, Usage())

    # --- after the answer -------------------------------------------------------------

    def _finish(self, call: _Call, status: int, usage: Usage | None) -> None:
        """Metrics, the accountant settled, the usage row queued. Never awaits."""
        if call.recorded:
            return
        call.recorded = True
        duration_s = time.perf_counter() - call.started
        label = call.model if call.model in self._cluster.models else ""
        served = call.served or label
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
                    served_model=served or None,
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
                served_model=served if served != label else "",
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
                cache_hit=call.cache_hit,
            )
        )


# --- helpers -----------------------------------------------------------------------


class _Call:
    """One client request as it goes through the gateway."""

    __slots__ = (
        "body",
        "cache_hit",
        "cache_key",
        "cache_ttl_s",
        "client_doc",
        "finished",
        "headers",
        "key",
        "kind",
        "model",
        "overhead_s",
        "pass_usage",
        "path",
        "profile",
        "prompt_estimate",
        "recorded",
        "replica_id",
        "request_id",
        "reservation",
        "scope_ids",
        "served",
        "session",
        "started",
        "status",
        "stream",
        "ttft_s",
        "usage",
        "waited_s",
    )

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.started = time.perf_counter()
        self.request_id = "req_" + secrets.token_hex(12)
        self.key: KeyRecord | None = None
        self.model = ""
        #: The model that answered (a fallback's name when one did).
        self.served = ""
        self.prompt_estimate = 0
        self.stream = False
        self.reservation: Reservation | None = None
        self.path: Any = None
        self.scope_ids: tuple[str, str, str] = ("", "", "")
        #: Response headers every answer carries (the rate-limit figures).
        self.headers: list[tuple[bytes, bytes]] = []
        self.replica_id = ""
        self.ttft_s: float | None = None
        self.profile = "chat"
        self.session: str | None = None
        #: The Anthropic or Responses request as the client sent it.
        self.client_doc: dict[str, Any] | None = None
        #: Seconds spent waiting in the admission queue or for a model to load.
        self.waited_s = 0.0
        #: Seconds the gateway itself took before the request went upstream.
        self.overhead_s = 0.0
        self.cache_key: bytes | None = None
        #: The client's body, while it can be sent on as it came.
        self.body: bytes | None = None
        self.cache_ttl_s: float | None = None
        self.cache_hit = False
        self.usage: Usage | None = None
        self.status = 502
        #: The client asked for the usage chunk of a stream.
        self.pass_usage = False
        #: The whole answer is in hand and being sent on.
        self.finished = False
        #: The usage row is queued (at most once).
        self.recorded = False

    @property
    def client_model(self) -> str:
        """The model name to report in translated answers: as the client asked."""
        if self.client_doc is not None and isinstance(self.client_doc.get("model"), str):
            return str(self.client_doc["model"])
        return self.model


#: The kind whose shape :func:`estimate_prompt_tokens` reads, after translation.
_ESTIMATE_KIND: Final = {
    "chat": "chat",
    "completions": "completions",
    "embeddings": "embeddings",
    "messages": "chat",
    "responses": "chat",
}

#: Output tokens assumed for a request that gives no max_tokens, when
#: estimating what it will spend (the model's max_output comes with the catalog).
DEFAULT_MAX_OUTPUT_TOKENS: Final = 512


def estimate_tokens(doc: dict[str, Any], kind: str) -> int:
    """The tokens a request may spend: its prompt (:func:`estimate_prompt_tokens`)
    plus its ``max_tokens`` (none for embeddings). Charged to the token
    limiters first, then settled with the real count."""
    if kind == "embeddings":
        return estimate_prompt_tokens(doc, kind)
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
        given = doc.get("prompt") if kind == "completions" else doc.get("input")
        size = len(given.encode()) if isinstance(given, str) else len(orjson.dumps(given))
        prompt = -(-size // bytes_per_token)
    return max(prompt, 1)


def _bands(settings: Any) -> list[Band]:
    return [
        Band(name=b.name, priority=b.priority, saturation=b.saturation, queue_ttl_s=b.queue_ttl)
        for b in settings
    ]


def _capacity(endpoints: list[Endpoint], model: ModelRecord) -> int:
    """The model's slots across its ready replicas (0 = not known: unbounded)."""
    if not endpoints:
        return 0
    profile = model.profile
    per_replica = profile.slots if profile is not None else 0
    total = 0
    for endpoint in endpoints:
        slots = endpoint.slots or per_replica
        if not slots:
            return 0
        total += slots
    return total


def _retryable(endpoint: Endpoint, status: int) -> bool:
    """An answer worth another endpoint: the engine is unreachable behind a
    proxy, overloaded or loading (502, 503, 504), or an outside key is at
    its limit or refused. A 500 or 501 is the engine answering this request
    badly; another replica of the model would answer it alike."""
    if status >= 500:
        return status not in (500, 501)
    return endpoint.external and status in (401, 403, 429)


def _message_of(body: bytes) -> str:
    try:
        doc = orjson.loads(body)
        return str(doc["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "The engine failed."


def _broken(call: _Call) -> bytes:
    if call.kind == "messages":
        return anthropic.error_event(
            "api_error", "The replica answering broke off mid-answer; retry."
        )
    return _BROKEN_STREAM_EVENT


def _cut(call: _Call) -> bytes:
    if call.kind == "messages":
        return anthropic.error_event(
            "overloaded_error", "The gateway is stopping; the answer was cut short. Retry."
        )
    return _CUT_STREAM_EVENT


def _system_stopped() -> ApiError:
    return ApiError(
        503,
        "llmgw is stopped by an administrator; 'llmgw start' resumes serving.",
        type="server_error",
        code="system_stopped",
    )


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
    if kind in ("messages", "responses"):
        return doc  # checked by their translators
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
    elif kind == "completions":
        prompt = doc.get("prompt")
        if not isinstance(prompt, str | list) or not prompt:
            raise bad_request(
                "'prompt' is required and must be a string or an array.", param="prompt"
            )
    else:
        given = doc.get("input")
        if not isinstance(given, str | list) or not given:
            raise bad_request(
                "'input' is required and must be a string or a non-empty array.", param="input"
            )
        if doc.get("stream"):
            raise bad_request("Embeddings are not streamed.", param="stream")
    if doc.get("stream") is None:
        doc.pop("stream", None)  # null means the default: not streamed
    elif not isinstance(doc["stream"], bool):
        raise bad_request("'stream' must be true or false.", param="stream")
    options = doc.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object.", param="stream_options")
    n = doc.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128):
        raise bad_request("'n' must be a whole number from 1 to 128.", param="n")
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

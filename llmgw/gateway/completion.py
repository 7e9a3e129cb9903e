"""The ``/v1`` POST routes: chat, completions, embeddings, Anthropic
messages and OpenAI responses (``docs/api.md``).

A request: authenticate the key → refuse when the system is stopped → read,
parse, translate and check the body → resolve the model (aliases) → the
routing profile → the guard's input rules (``docs/guardrails.md``) →
limits and budgets → the answer cache → admission by
band and the attempts of the router's route (retries, fallbacks), relayed
(:mod:`llmgw.gateway.relay`) → record it (:mod:`llmgw.gateway.recording`).
A client that disconnects cancels the engine request. Any
:class:`llmgw.errors.LlmgwError` is answered in the route's error shape
(:mod:`llmgw.gateway.errors`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Final

import trio

from llmgw import metrics
from llmgw.accounting.accountant import Accountant
from llmgw.asgi import Message, Receive, Scope, Send, while_connected
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.errors import LlmgwError, Refused, StoreError, describe
from llmgw.guard import Guards, Redactor, Verdict, guard_chat_doc
from llmgw.router.router import ClusterView, Route, Router
from llmgw.router.scoring import PROFILES
from llmgw.settings import ServerSettings
from llmgw.store import KeyRecord

from . import anthropic, responses
from .caching import Caching
from .credentials import authenticate
from .errors import (
    api_error,
    bad_request,
    error_body_for,
    model_not_found,
    shutting_down,
    system_stopped,
)
from .guarded import PromptJudge
from .http import answer, header
from .parse import (
    ESTIMATE_KIND,
    check_for_model,
    estimate_prompt_tokens,
    estimate_tokens,
    parse_body,
    read_body,
)
from .recording import Recorder
from .relay import CUT_ANSWER_S, Relay
from .request import NO_SCOPE, Outcome, Request, new_request_id
from .sse import Usage

__all__ = ["ROUTES", "Completions"]

log = logging.getLogger("llmgw.gateway")

#: Route → the request's kind.
ROUTES: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}


class Completions:
    """Answers the ``/v1`` POST routes (module docstring).

    Args:
        authenticator: checks client keys.
        cluster: the catalog (for the metrics' model label).
        settings: the live settings, changes applied (called per request).
        router, relay, caching, recorder: the gateway's parts.
        max_body_bytes: request bodies larger than this get 413.
        accountant, resolver: limits and budgets along each key's path in
            the tree; without both nothing is limited.
    """

    def __init__(
        self,
        *,
        authenticator: KeyAuthenticator,
        cluster: ClusterView,
        settings: Callable[[], ServerSettings],
        router: Router,
        relay: Relay,
        caching: Caching,
        recorder: Recorder,
        max_body_bytes: int,
        accountant: Accountant | None,
        resolver: ScopeResolver | None,
    ) -> None:
        self._auth = authenticator
        self._cluster = cluster
        self._settings = settings
        self._router = router
        self._relay = relay
        self._caching = caching
        self._recorder = recorder
        self._max_body_bytes = max_body_bytes
        self._accountant = accountant
        self._resolver = resolver
        self._guards = Guards()
        self._judge = PromptJudge(router, relay)
        relay.judging = self._judge  # the judge on answers shares its verdict cache

    async def __call__(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        """Answer one request of ``kind`` (a value of :data:`ROUTES`)."""
        started = time.perf_counter()
        request_id = new_request_id()
        outcome = Outcome()
        request: Request | None = None
        # What is known of a request refused before it is whole, to record it.
        key: KeyRecord | None = None
        model_name = ""
        stream = False
        scope_ids = NO_SCOPE
        rate_headers: tuple[tuple[bytes, bytes], ...] = ()
        client_left = False
        recorded = False
        answering = False  # the answer's head has gone

        def whole_request() -> Request:
            return request or Request(
                kind=kind,
                request_id=request_id,
                started=started,
                key=key,
                model=model_name,
                stream=stream,
                scope_ids=scope_ids,
            )

        async def send_end(message: Message) -> None:
            # The body message that carries the end of the answer (the relay
            # finishes the outcome just before it) waits until the usage row
            # is durable: a client that has its whole answer has its row.
            nonlocal recorded, answering
            if message["type"] == "http.response.start":
                answering = True
            if (
                not recorded
                and outcome.finished
                and key is not None
                and message["type"] == "http.response.body"
            ):
                recorded = True
                durable = self._recorder.record(whole_request(), outcome, self._cluster.models)
                if durable is not None:
                    await durable.wait()
            await send(message)

        metrics.IN_FLIGHT.inc()
        try:
            key = await authenticate(self._auth, scope)
            settings = self._settings()
            if settings.serving.stopped:
                raise system_stopped()
            raw = await read_body(scope, receive, self._max_body_bytes)
            doc = parse_body(raw, kind)
            # The client's bytes, sent on as they came unless the doc changes.
            body: bytes | None = raw
            client_doc = None
            if kind == "messages":
                client_doc, doc, body = doc, anthropic.request_to_chat(doc), None
            elif kind == "responses":
                client_doc, doc, body = doc, responses.request_to_chat(doc), None
            stream = doc.get("stream") is True
            model = self._router.resolve(doc["model"])
            if model is None:
                raise model_not_found(doc["model"])
            model_name = model.name
            check_for_model(doc, model, kind)
            asked = header(scope, b"x-llmgw-profile")
            profile = (
                asked.decode("latin-1") if asked else model.routing
            ) or settings.router.scoring
            if profile not in PROFILES:
                raise bad_request(
                    f"x-llmgw-profile must be one of {', '.join(sorted(PROFILES))}.",
                    param="x-llmgw-profile",
                )
            estimate_kind = ESTIMATE_KIND[kind]
            prompt_estimate = estimate_prompt_tokens(doc, estimate_kind, bytes_per_token=4)
            reservation = None
            permits = None
            accountant, resolver = self._accountant, self._resolver
            path = None
            if resolver is not None:
                try:
                    path, scope_ids = await resolver.path(key)
                except StoreError as exc:
                    log.error("cannot read a key's limits: %s", describe(exc))
                    raise
            # Guardrails on the prompt, before the limits and the cache
            # (docs/guardrails.md, Order).
            guard = await self._guards.for_request_async(
                settings.guard,
                key.id,
                scope_ids,
                resolver.names(key.id) if resolver is not None else NO_SCOPE,
            )
            redactor = None
            if guard is not None:
                outcome.verdict = Verdict()
                redactor = Redactor()
                if guard.input.active and guard_chat_doc(
                    doc, guard.input, outcome.verdict, redactor
                ):
                    body = None  # the doc changed: the client's bytes no longer go
                if guard.judges_input:
                    await self._judge.check(guard, doc, outcome.verdict)
            if accountant is not None and path is not None:
                try:
                    reservation = accountant.check(
                        path, model.name, estimate_tokens(doc, estimate_kind), time.time()
                    )
                except Refused:
                    rate_headers = tuple(accountant.rate_headers(path, time.time()))
                    raise
                rate_headers = tuple(reservation.headers())
                permits = functools.partial(accountant.allowed, path)
            options = doc.get("stream_options")
            request = Request(
                kind=kind,
                request_id=request_id,
                started=started,
                key=key,
                model=model_name,
                stream=stream,
                scope_ids=scope_ids,
                reservation=reservation,
                rate_headers=rate_headers,
                doc=doc,
                body=body,
                client_doc=client_doc,
                pass_usage=stream
                and isinstance(options, dict)
                and options.get("include_usage") is True,
                prompt_estimate=prompt_estimate,
                guard=guard,
                redactor=redactor,
            )
            route = self._router.route(
                model,
                profile=profile,
                band=key.band,
                doc=doc,
                headers=scope["headers"],
                permits=permits,
            )
            if stream:
                # Kept in the usage journal: a crash cutting it still leaves its row.
                self._recorder.begin(request, outcome, self._cluster.models)
            client_left = await while_connected(
                scope,
                receive,
                functools.partial(self._serve, send_end, scope, settings, request, route, outcome),
            )
        except trio.Cancelled:
            # The stop's grace ran out (a client that left is not this: its
            # request returns). A stream under way was told by the relay;
            # a request not yet answered gets a 503 rather than a dropped
            # connection.
            if not answering:
                error = shutting_down()
                with trio.CancelScope(shield=True), trio.move_on_after(CUT_ANSWER_S):
                    await answer(
                        send,
                        error.status,
                        error_body_for(error, kind),
                        (*error.headers, *rate_headers, (b"x-request-id", request_id.encode())),
                    )
            raise
        except LlmgwError as exc:
            error = api_error(exc)
            outcome.finish(error.status)
            outcome.usage = None
            await answer(
                send_end,
                error.status,
                error_body_for(error, kind),
                (*error.headers, *rate_headers, (b"x-request-id", request_id.encode())),
            )
        finally:
            metrics.IN_FLIGHT.dec()
            if not outcome.finished and key is not None:
                # The client went away first (499), or the stop's grace cut
                # it (503, a cancellation): what was generated is still
                # charged and recorded.
                outcome.finish(499 if client_left else 503)
                if outcome.usage is None and outcome.replica and request is not None:
                    # Sent to an engine, cut before any of its answer: the
                    # engine read the prompt (as estimated) all the same.
                    outcome.usage = Usage(prompt_tokens=request.prompt_estimate)
            if outcome.finished and not recorded:
                # Not awaited: a cut answer's row is durable with the next group.
                self._recorder.record(whole_request(), outcome, self._cluster.models)

    async def _serve(
        self,
        send: Send,
        scope: Scope,
        settings: ServerSettings,
        request: Request,
        route: Route,
        outcome: Outcome,
    ) -> None:
        """The answer cache, then admission and the relay."""
        guard = request.guard
        slot = (
            self._caching.slot(request, scope, settings.router.cache.projects)
            if guard is None or guard.cacheable
            else None
        )
        if slot is not None:
            hit = self._caching.get(slot, request.model)
            if hit is not None:
                await self._caching.replay(send, request, outcome, hit)
                return
        with await route.admit():
            await self._relay.forward(send, request, route, outcome, slot)

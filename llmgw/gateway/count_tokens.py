"""Anthropic's ``POST /v1/messages/count_tokens`` (``docs/api.md``): the
input tokens of a Messages request, counted by the tokenizer of an engine
serving the model.

A request: authenticate the key → refuse when the system is stopped → read
the body and check and translate it as ``/v1/messages`` does
(:func:`llmgw.gateway.anthropic.request_to_chat`; ``max_tokens`` may be left
out) → resolve the model (aliases) → the model's own checks (stopped, what
its engine cannot take) → the key's models allowlist and requests per minute
(:meth:`llmgw.accounting.accountant.Accountant.check_request`: one request,
no tokens, no budget) → a ready replica of that model (never a fallback:
another model's tokenizer counts otherwise; a loading model is waited for
as for any request; a replica that does not answer is tried elsewhere) →
its engine's tokenizer:

- llama.cpp: ``POST /apply-template`` with the chat request (its chat
  template applied to the messages and tools, as for a chat request), then
  ``POST /tokenize {"content": prompt, "add_special": true,
  "parse_special": true}``, which is how its chat path tokenizes a prompt;
- any other engine (the sim engine, vLLM): ``POST /tokenize`` with the
  chat's ``messages`` and ``tools`` and ``add_generation_prompt``, which
  answers ``count`` (or ``tokens``).

Answer: 200 ``{"input_tokens": N}`` (the whole prompt, cached or not) with
the ``x-ratelimit-*`` headers. Nothing is generated, so no usage row is
written and nothing is charged but the one request. Every error is in
Anthropic's shape (:func:`llmgw.gateway.errors.error_body_for`); a model
served by an outside provider is refused (400): there is no tokenizer to ask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

import orjson
import trio

from llmgw.accounting.accountant import Accountant
from llmgw.asgi import Receive, Scope, Send, while_connected
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.errors import LlmgwError
from llmgw.router.endpoint import Endpoint
from llmgw.router.router import Attempt, EndpointLost, Router
from llmgw.settings import ServerSettings
from llmgw.store import ModelRecord

from . import anthropic
from .credentials import authenticate
from .errors import (
    ApiError,
    api_error,
    bad_request,
    engine_error,
    error_body_for,
    model_not_found,
    system_stopped,
)
from .http import answer
from .parse import check_for_model, parse_body, read_body
from .relay import Relay
from .upstream import UpstreamError

__all__ = ["COUNT_TOKENS_PATH", "TokenCounter"]

#: The route this module answers.
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"
#: Engines whose tokenizer takes a prompt, the chat template applied first
#: through ``/apply-template``; every other engine's ``/tokenize`` takes messages.
_TEMPLATE_ENGINES: Final = frozenset({"llamacpp"})


class _NoCount(Exception):
    """An engine's answer (``status``, its body ``data``) that is not a count."""

    def __init__(self, status: int, data: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.data = data


class TokenCounter:
    """Answers ``POST /v1/messages/count_tokens`` (module docstring).

    Args:
        authenticator: checks client keys.
        settings: the live settings, changes applied (called per request).
        router: resolves models and hands out the replicas to ask.
        relay: its pooled connections to the engines.
        max_body_bytes: request bodies larger than this get 413.
        accountant, resolver: the allowlist and requests per minute along
            each key's path; without both neither is applied.
    """

    def __init__(
        self,
        *,
        authenticator: KeyAuthenticator,
        settings: Callable[[], ServerSettings],
        router: Router,
        relay: Relay,
        max_body_bytes: int,
        accountant: Accountant | None,
        resolver: ScopeResolver | None,
    ) -> None:
        self._auth = authenticator
        self._settings = settings
        self._router = router
        self._relay = relay
        self._max_body_bytes = max_body_bytes
        self._accountant = accountant
        self._resolver = resolver

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one request (the module docstring's steps)."""
        rate_headers: tuple[tuple[bytes, bytes], ...] = ()
        try:
            key = await authenticate(self._auth, scope)
            settings = self._settings()
            if settings.serving.stopped:
                raise system_stopped()
            raw = await read_body(scope, receive, self._max_body_bytes)
            chat = anthropic.request_to_chat(parse_body(raw, "messages"), counting=True)
            model = self._router.resolve(chat["model"])
            if model is None:
                raise model_not_found(chat["model"])
            check_for_model(chat, model, "messages")
            if model.external is not None:
                raise bad_request(
                    f"'{model.name}' is served by an outside provider, which has no tokenizer "
                    "llmgw can ask; tokens are counted only for models llmgw runs.",
                    param="model",
                )
            accountant, resolver = self._accountant, self._resolver
            if accountant is not None and resolver is not None:
                path, _ = await resolver.path(key)
                try:
                    reservation = accountant.check_request(path, model.name, time.time())
                except LlmgwError:
                    rate_headers = tuple(accountant.rate_headers(path, time.time()))
                    raise
                rate_headers = tuple(reservation.headers())
            count = 0

            async def counted() -> None:
                nonlocal count
                count = await self._count(scope, settings, model, key.band, chat)

            if await while_connected(scope, receive, counted):
                return  # the client left: nobody to answer
        except LlmgwError as exc:
            error = api_error(exc)
            await answer(
                send,
                error.status,
                error_body_for(error, "count_tokens"),
                (*error.headers, *rate_headers),
            )
            return
        await answer(send, 200, orjson.dumps({"input_tokens": count}), rate_headers)

    async def _count(
        self,
        scope: Scope,
        settings: ServerSettings,
        model: ModelRecord,
        band: str,
        chat: dict[str, Any],
    ) -> int:
        """The prompt's tokens by the tokenizer of a replica of ``model``.

        Raises:
            NotReady: no replica can be asked.
            ApiError: 502 ``upstream_error`` (no replica answered, or its
                answer held no count), or the engine's own error answer.
        """
        profile = model.profile
        engine = profile.engine if profile is not None else ""
        route = self._router.route(
            model,
            profile="batch",
            band=band,
            doc=chat,
            headers=scope["headers"],
            permits=lambda name: name == model.name,  # never a fallback
        )
        while True:
            attempt = await route.next()
            with attempt:
                try:
                    with (
                        attempt.waiting_first_byte(),
                        trio.fail_after(settings.router.timeouts.first_byte),
                    ):
                        count = await self._ask_tokenizer(attempt, engine, chat)
                except (UpstreamError, EndpointLost, trio.TooSlowError) as exc:
                    if route.unreachable(attempt, exc):
                        continue
                    raise ApiError(
                        502,
                        f"The replica serving '{model.name}' did not answer; retry.",
                        type="server_error",
                        code="upstream_error",
                    ) from exc
                except _NoCount as no:
                    if no.status != 200 and route.turned_away(attempt, no.status, None):
                        continue
                    route.answered(attempt, no.status, None)
                    raise _engine_refusal(attempt.endpoint, no) from None
                route.answered(attempt, 200, None)
                return count

    async def _ask_tokenizer(self, attempt: Attempt, engine: str, chat: dict[str, Any]) -> int:
        """The count of the replica ``attempt`` goes to.

        Raises:
            UpstreamError: the replica did not answer.
            _NoCount: it answered, but not with a count.
        """
        endpoint = attempt.endpoint
        if engine in _TEMPLATE_ENGINES:
            templated = await self._post(endpoint, b"/apply-template", chat)
            prompt = templated.get("prompt")
            if not isinstance(prompt, str):
                raise _NoCount(200, orjson.dumps(templated))
            tokenized = await self._post(
                endpoint,
                b"/tokenize",
                {"content": prompt, "add_special": True, "parse_special": True},
            )
        else:
            ask: dict[str, Any] = {
                "model": attempt.upstream_model,
                "messages": chat["messages"],
                "add_generation_prompt": True,
            }
            if "tools" in chat:
                ask["tools"] = chat["tools"]
            tokenized = await self._post(endpoint, b"/tokenize", ask)
        count = tokenized.get("count")
        tokens = tokenized.get("tokens")
        if not (isinstance(count, int) and count >= 0) and isinstance(tokens, list):
            count = len(tokens)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise _NoCount(200, orjson.dumps(tokenized))
        return count

    async def _post(self, endpoint: Endpoint, path: bytes, doc: dict[str, Any]) -> dict[str, Any]:
        """POST ``doc`` to ``endpoint`` with its engine key; its JSON answer.

        Raises:
            UpstreamError: no answer, or it broke off.
            _NoCount: an answer other than 200 with a JSON object.
        """
        pool = self._relay.pool(endpoint)
        headers = [
            *endpoint.auth_headers,
            (b"content-type", b"application/json"),
        ]
        response = await pool.request(
            b"POST", endpoint.path_prefix.encode() + path, headers, orjson.dumps(doc)
        )
        async with response:
            data = await response.read()
        if response.status != 200:
            raise _NoCount(response.status, data)
        try:
            answer_doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            answer_doc = None
        if not isinstance(answer_doc, dict):
            raise _NoCount(200, data)
        return answer_doc


def _engine_refusal(endpoint: Endpoint, no: _NoCount) -> ApiError:
    """The error answering an engine's answer that held no count: its own
    error passed on (400, 500 …), but 502 when it refused the gateway's
    engine key or answered 200 without a count."""
    if no.status == 200 or (no.status in (401, 403) and not endpoint.external):
        return ApiError(
            502,
            f"The replica {endpoint.label} did not give a token count; retry.",
            type="server_error",
            code="upstream_error",
        )
    return engine_error(no.status, no.data)

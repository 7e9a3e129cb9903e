"""The client API: one lean ASGI callable, no framework on the hot path
(``docs/api.md``).

Routes:

- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
  ``/v1/messages`` (Anthropic) and ``/v1/responses`` (OpenAI Responses) —
  routed and relayed (:mod:`llmgw.gateway.completion`);
- ``POST /v1/messages/count_tokens`` (Anthropic) — counted by an engine's
  tokenizer (:mod:`llmgw.gateway.count_tokens`);
- ``GET /v1/models`` — the catalog the key may use;
- ``GET /health``, ``GET /ready``, ``GET /leader`` — open, no store access.

Any other path or method is refused (404, 405) in the path's error shape:
Anthropic's on ``/v1/messages`` and below, OpenAI's elsewhere.

:class:`Gateway` puts the parts together — the router
(:class:`llmgw.router.router.Router`), the relay, the answer cache, the
recorder — and follows the live settings: each request looks once whether
``cluster.settings`` was replaced, and only then are the changed blocks
applied (admission bands, connect timeout, cache bounds, default limits
and prices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Protocol

import orjson

from llmgw.accounting.accountant import Accountant
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter
from llmgw.asgi import Receive, Scope, Send, answer_lifespan
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.errors import LlmgwError
from llmgw.router.router import ClusterView, Router
from llmgw.settings import ServerSettings

from .caching import Caching
from .completion import ROUTES, Completions
from .count_tokens import COUNT_TOKENS_PATH, TokenCounter
from .credentials import authenticate
from .errors import ApiError, api_error, error_body_on, system_stopped
from .forward import LeaderForward
from .http import answer
from .parse import MAX_BODY_BYTES
from .recording import Recorder
from .relay import Relay

__all__ = ["Gateway", "GatewayCluster"]


class GatewayCluster(ClusterView, Protocol):
    """What the gateway reads of the cluster: the router's view, plus
    leadership and readiness for ``/ready`` and ``/leader`` (the control
    plane's ``Cluster`` is one)."""

    @property
    def is_leader(self) -> bool: ...

    @property
    def routes_itself(self) -> bool:
        """``/v1`` is answered here rather than forwarded to the leader:
        leading, or a leader cut off from the store (``docs/ha.md``)."""
        ...

    def any_ready(self) -> bool:
        """Some model has a ready replica."""
        ...


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
            path in the tree; without them nothing is limited. The
            accountant's default limits and prices follow ``auth`` once the
            live settings change.

        forward: on a standby (not :attr:`GatewayCluster.is_leader`), ``/v1/*``
            goes to the leader through it; ``None``: answered here.

    Raises:
        ValueError: the live admission bands are not usable.
    """

    def __init__(
        self,
        *,
        authenticator: KeyAuthenticator,
        cluster: GatewayCluster,
        usage: UsageWriter,
        max_body_bytes: int = MAX_BODY_BYTES,
        accounting: bool = True,
        accountant: Accountant | None = None,
        resolver: ScopeResolver | None = None,
        forward: LeaderForward | None = None,
    ) -> None:
        self._auth = authenticator
        self._forward = forward
        self._cluster = cluster
        self._accountant = accountant if accounting else None
        self._resolver = resolver
        #: The settings last applied to the parts below.
        self._settings = settings = cluster.settings
        self._router = Router(cluster)
        self._caching = Caching(settings.router.cache)
        self._relay = Relay(cluster, self._caching)
        self._completions = Completions(
            authenticator=authenticator,
            cluster=cluster,
            settings=self._current_settings,
            router=self._router,
            relay=self._relay,
            caching=self._caching,
            recorder=Recorder(usage=usage, accountant=self._accountant, accounting=accounting),
            max_body_bytes=max_body_bytes,
            accountant=self._accountant,
            resolver=resolver,
        )
        self._count_tokens = TokenCounter(
            authenticator=authenticator,
            settings=self._current_settings,
            router=self._router,
            relay=self._relay,
            max_body_bytes=max_body_bytes,
            accountant=self._accountant,
            resolver=resolver,
        )

    @property
    def router(self) -> Router:
        """The router requests go through."""
        return self._router

    async def aclose(self) -> None:
        """Close the pooled upstream connections."""
        await self._relay.aclose()
        if self._forward is not None:
            await self._forward.aclose()

    # --- the live settings ---------------------------------------------------------

    def _current_settings(self) -> ServerSettings:
        """The live settings, applied first when they were replaced."""
        settings = self._cluster.settings
        if settings is not self._settings:
            self._settings_changed(self._settings, settings)
        return settings

    def _settings_changed(self, old: ServerSettings, new: ServerSettings) -> None:
        """Apply the blocks of ``new`` that are not ``old``'s (the live
        settings are replaced whole, every block anew): the default limits
        and prices (``auth``), the connect timeout, the admission bands, the
        answer cache's bounds (the cache starts empty)."""
        self._settings = new
        if new.auth is not old.auth and self._accountant is not None:
            auth = new.auth
            self._accountant.prices = PriceBook(auth.pricing, auth.default_price)
            self._accountant.default_rpm = auth.default_rpm
            self._accountant.default_tpm = auth.default_tpm
        router, was = new.router, old.router
        if router.timeouts is not was.timeouts:
            self._relay.set_connect_timeout(router.timeouts.connect)
        if router.admission is not was.admission:
            self._router.settings_changed(new)
        if router.cache is not was.cache:
            self._caching.settings_changed(router.cache)

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
        if (
            self._forward is not None
            and path.startswith("/v1/")
            and not self._cluster.routes_itself
        ):
            # A standby: the leader answers /v1 (llmgw.gateway.forward),
            # unless this control plane came to lead while it was held.
            held = await self._forward(scope, receive, send)
            if held is None:
                return
            receive = held
        route = ROUTES.get(path)
        if route is not None or path == COUNT_TOKENS_PATH:
            if method != "POST":
                await _refuse_method(send, path, "POST")
            elif route is not None:
                await self._completions(scope, receive, send, route)
            else:
                await self._count_tokens(scope, receive, send)
        elif path in OPEN_PATHS and method not in ("GET", "HEAD"):
            await _refuse_method(send, path, "GET")
        elif path == "/health":
            await answer(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            ready = self._cluster.is_leader and self._cluster.any_ready()
            await answer(
                send, 200 if ready else 503, b'{"ready":%s}' % (b"true" if ready else b"false")
            )
        elif path == "/leader":
            leader = self._cluster.is_leader
            await answer(
                send, 200 if leader else 503, b'{"leader":%s}' % (b"true" if leader else b"false")
            )
        elif path == "/v1/models":
            if method not in ("GET", "HEAD"):
                await _refuse_method(send, path, "GET")
                return
            await self._models(scope, send)
        elif (
            path.startswith("/v1/") and method == "POST" and self._cluster.settings.serving.stopped
        ):
            await answer(send, 503, error_body_on(path, system_stopped()))
        else:
            await _refuse(send, path, 404, f"no route {method} {path}", code="unknown_url")

    # --- /v1/models --------------------------------------------------------------

    async def _models(self, scope: Scope, send: Send) -> None:
        accountant = self._accountant
        try:
            key = await authenticate(self._auth, scope)
            path = None
            if accountant is not None and self._resolver is not None:
                path, _ = await self._resolver.path(key)
        except LlmgwError as exc:
            error = api_error(exc)
            await answer(send, error.status, error.body(), error.headers)
            return
        data = []
        for name, model in sorted(self._cluster.models.items()):
            if path is not None and accountant is not None and not accountant.allowed(path, name):
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
        await answer(send, 200, orjson.dumps({"object": "list", "data": data}))


#: The open routes, which answer GET and HEAD.
OPEN_PATHS: Final = frozenset({"/health", "/ready", "/leader"})


async def _refuse_method(send: Send, path: str, takes: str) -> None:
    """405 for a method ``path`` does not take, with ``Allow`` (RFC 9110
    section 15.5.6; a GET route also takes HEAD)."""
    allow = b"GET, HEAD" if takes == "GET" else takes.encode()
    await _refuse(
        send, path, 405, f"{path} takes {takes}", [(b"allow", allow)], code="method_not_allowed"
    )


async def _refuse(
    send: Send,
    path: str,
    status: int,
    message: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    code: str | None = None,
) -> None:
    """Answer a path or method there is no route for, in the path's error shape."""
    error = ApiError(status, message, code=code)
    await answer(send, status, error_body_on(path, error), headers)

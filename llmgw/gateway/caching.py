"""The exact answer cache on the request path (``docs/api.md``, The exact
answer cache): when it applies to a request, a hit replayed as the client
first got it, and a 200 answer kept. The cache itself is
:mod:`llmgw.router.cache`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import NamedTuple

from llmgw.asgi import Scope, Send
from llmgw.router.cache import CACHE_REQUESTS, AnswerCache, CachedAnswer, cache_key
from llmgw.settings import CacheSettings

from .http import NO_CACHE, answer, header
from .request import Outcome, Request
from .sse import Usage

__all__ = ["CacheSlot", "Caching"]


class CacheSlot(NamedTuple):
    """Where a request's answer is looked up and kept: its cache key, and
    how long the answer lives (its project's TTL, seconds)."""

    key: bytes
    ttl_s: float


class Caching:
    """The answer cache of one gateway.

    Args:
        settings: ``router.cache`` (its bounds; the projects are read per
            request).
    """

    def __init__(self, settings: CacheSettings) -> None:
        self._cache = AnswerCache(
            max_bytes=settings.max_bytes, max_entry_bytes=settings.max_entry_bytes
        )

    def settings_changed(self, settings: CacheSettings) -> None:
        """New bounds: the cache starts empty with them."""
        self._cache.clear()
        self._cache = AnswerCache(
            max_bytes=settings.max_bytes, max_entry_bytes=settings.max_entry_bytes
        )

    @property
    def max_entry_bytes(self) -> int:
        """The largest answer kept, in bytes."""
        return self._cache.max_entry_bytes

    def slot(
        self, request: Request, scope: Scope, projects: Mapping[str, float]
    ) -> CacheSlot | None:
        """The request's slot when the cache is on for its project
        (``projects``: project id → TTL seconds) and the client did not
        bypass it (``x-llmgw-cache: no-store``, ``bypass`` or ``off``, counted
        as a ``bypass``); else ``None``. The key holds the request's guard
        policies (``docs/guardrails.md``)."""
        project_id = request.scope_ids[0]
        if not projects or not project_id:
            return None
        ttl_s = projects.get(project_id)
        if ttl_s is None:
            return None
        asked = header(scope, b"x-llmgw-cache")
        if asked is not None and asked.strip().lower() in (b"no-store", b"bypass", b"off"):
            CACHE_REQUESTS.labels(request.model, "bypass").inc()
            return None
        model = request.model
        if request.guard is not None:
            # Answers kept under other policies are not this request's: a
            # kept answer passed the same output rules before it was kept.
            model = f"{model}\x00guard={','.join(request.guard.names)}"
        return CacheSlot(cache_key(project_id, model, request.kind, request.doc), ttl_s)

    def get(self, slot: CacheSlot, model: str) -> CachedAnswer | None:
        """The answer kept in ``slot``, counted as a ``hit`` or ``miss`` of ``model``."""
        hit = self._cache.get(slot.key)
        CACHE_REQUESTS.labels(model, "hit" if hit is not None else "miss").inc()
        return hit

    def keep(self, slot: CacheSlot, content_type: bytes, body: bytes, *, stream: bool) -> None:
        """Keep a 200 answer (``body`` as the client got it) in ``slot``."""
        self._cache.put(
            slot.key,
            CachedAnswer(
                status=200,
                content_type=content_type,
                body=body,
                stream=stream,
                stored_at=time.time(),
            ),
            slot.ttl_s,
        )

    async def replay(
        self, send: Send, request: Request, outcome: Outcome, hit: CachedAnswer
    ) -> None:
        """Answer with ``hit``, as the client first got it: free (no tokens
        charged), marked ``x-llmgw-cache: hit`` with its ``age``."""
        outcome.replica = "cache"
        outcome.cache_hit = True
        headers = [
            (b"x-request-id", request.request_id.encode()),
            (b"x-llmgw-cache", b"hit"),
            (b"x-llmgw-replica", b"cache"),
            (b"age", str(hit.age_s(time.time())).encode()),
            (b"x-llmgw-overhead-ms", b"%.3f" % ((time.perf_counter() - request.started) * 1000)),
            *request.rate_headers,
        ]
        outcome.finish(200)
        outcome.usage = Usage()
        if hit.stream:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", hit.content_type), NO_CACHE, *headers],
                }
            )
            await send({"type": "http.response.body", "body": hit.body, "more_body": False})
        else:
            await answer(
                send, 200, hit.body, headers, content_type=(b"content-type", hit.content_type)
            )

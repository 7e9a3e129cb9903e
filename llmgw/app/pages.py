"""The one hook between the client API and the pages: a prefix dispatch.

:func:`with_pages` wraps an ASGI app (the gateway, or the admin API) so that
``/``, ``/portal/…``, ``/static/…`` and ``/admin…`` go to the pages
(:mod:`llmgw.portal.app`) and everything else, ``/v1/…`` first, goes on
untouched: a ``/v1`` request costs one string comparison more.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from llmgw.asgi import Receive, Scope, Send

__all__ = ["PAGE_PREFIXES", "App", "is_page", "with_pages"]

App = Callable[..., Awaitable[None]]

#: Paths the pages answer below (besides ``/`` and ``/admin`` themselves).
PAGE_PREFIXES: Final = ("/portal/", "/static/", "/admin/")


def is_page(path: str) -> bool:
    """Whether ``path`` belongs to the pages (never a ``/v1`` or ``/api`` path)."""
    if path.startswith("/v1/") or path.startswith("/api/"):
        return False
    return path in ("/", "/admin") or path.startswith(PAGE_PREFIXES)


class with_pages:
    """An ASGI app: ``pages`` for page paths, ``api`` for the rest (and for
    lifespan)."""

    def __init__(self, api: App, pages: App) -> None:
        self._api = api
        self._pages = pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_page(scope["path"]):
            await self._pages(scope, receive, send)
        else:
            await self._api(scope, receive, send)

"""The prefix dispatch in front of the client port and the admin listener
(:mod:`llmgw.app.pages`): page paths go to the pages, everything else (``/v1``
first) to the API app, untouched."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.app.pages import is_page, with_pages


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/portal/chat",
        "/portal/sign-in",
        "/static/portal.0123abcd.js",
        "/admin",
        "/admin/people",
    ],
)
def test_page_paths_go_to_the_pages(path: str) -> None:
    assert is_page(path)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/models",
        "/v1/admin",
        "/api/v1/keys",
        "/health",
        "/ready",
        "/leader",
        "/administrator",
        "/portal",
        "//portal/chat",
    ],
)
def test_other_paths_go_to_the_api(path: str) -> None:
    assert not is_page(path)


async def test_the_dispatch_hands_each_scope_to_one_app_unchanged() -> None:
    seen: list[tuple[str, Any]] = []

    def app(name: str) -> Any:
        async def call(scope: Any, receive: Any, send: Any) -> None:
            seen.append((name, scope))

        return call

    both = with_pages(app("api"), app("pages"))
    v1 = {"type": "http", "path": "/v1/chat/completions"}
    page = {"type": "http", "path": "/portal/keys"}
    lifespan = {"type": "lifespan"}

    async def receive() -> Any:
        raise AssertionError("not read")

    async def send(message: Any) -> None:
        raise AssertionError("not sent")

    for scope in (v1, page, lifespan):
        await both(scope, receive, send)
    assert seen == [("api", v1), ("pages", page), ("api", lifespan)]
    assert seen[0][1] is v1

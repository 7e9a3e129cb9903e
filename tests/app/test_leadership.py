"""Giving the leader lease up at a stop is bounded and never raises."""

from __future__ import annotations

from typing import Any

import trio

from llmgw.app.leadership import RELEASE_TIMEOUT_S, release_leadership
from llmgw.store import StoreError


class _Store:
    """A store whose ``release_lease`` hangs, fails or works."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.released: list[tuple[str, str]] = []

    async def release_lease(self, name: str, holder: str) -> None:
        if self.how == "hang":
            await trio.sleep_forever()
        if self.how == "fail":
            raise StoreError("database is locked")
        self.released.append((name, holder))


async def test_a_store_that_hangs_is_given_up_on_within_the_release_timeout() -> None:
    store: Any = _Store("hang")
    with trio.fail_after(RELEASE_TIMEOUT_S + 1):
        await release_leadership(store, "me")


async def test_a_store_that_fails_is_logged_not_raised() -> None:
    store: Any = _Store("fail")
    with trio.fail_after(RELEASE_TIMEOUT_S + 1):
        await release_leadership(store, "me")


async def test_the_lease_is_released_even_when_the_caller_is_cancelled() -> None:
    store: Any = _Store("works")
    with trio.CancelScope() as scope:
        scope.cancel()
        await release_leadership(store, "me")
    assert store.released == [("leader", "me")]

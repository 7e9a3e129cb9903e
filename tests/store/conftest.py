"""Fixtures for the store contract suite.

``open_test_store`` is parametrised over the backends: each param gives a
function that opens *the same* database every time it is called, so tests
can close and reopen it. Add ``"postgres"`` to the params (with a database
made for the test) to run the whole contract suite on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from llmgw.store import Store
from llmgw.store.sqlite import open_sqlite_store

BACKENDS = ["sqlite"]


@pytest.fixture(params=BACKENDS)
def open_test_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], AbstractAsyncContextManager[Store]]:
    """A function that opens this test's store (the same database each call)."""
    backend = request.param
    if backend == "sqlite":
        path = tmp_path / "store.db"
        return lambda: open_sqlite_store(path)
    raise AssertionError(f"unknown store backend {backend!r}")


@pytest.fixture
async def store(
    open_test_store: Callable[[], AbstractAsyncContextManager[Store]],
) -> AsyncIterator[Store]:
    """An open, empty store, closed after the test."""
    async with open_test_store() as opened:
        yield opened

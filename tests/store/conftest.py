"""Fixtures for the store contract suite.

``open_test_store`` is parametrised over the backends: each param gives a
function that opens *the same* database every time it is called, so tests
can close and reopen it. Add ``"postgres"`` to the params (with a database
made for the test) to run the whole contract suite on PostgreSQL.

``hold_write_lock`` gives a context manager during which *another process*
holds the database's write lock (for SQLite, a ``BEGIN EXCLUSIVE``
transaction), for the tests of a store that cannot write.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from pathlib import Path

import pytest

from llmgw.store import Store
from llmgw.store.sqlite import open_sqlite_store

BACKENDS = ["sqlite"]

_SQLITE_LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=10, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin
conn.execute("ROLLBACK")
conn.close()
"""


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test."""
    return str(request.param)


@pytest.fixture
def open_test_store(
    backend: str, tmp_path: Path
) -> Callable[[], AbstractAsyncContextManager[Store]]:
    """A function that opens this test's store (the same database each call)."""
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


@pytest.fixture
def hold_write_lock(backend: str, tmp_path: Path) -> Callable[[], AbstractContextManager[None]]:
    """A context manager: another process holds the store's write lock inside it."""
    if backend == "sqlite":
        path = tmp_path / "store.db"

        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            with subprocess.Popen(
                [sys.executable, "-c", _SQLITE_LOCKER, str(path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            ) as locker:
                assert locker.stdin is not None
                assert locker.stdout is not None
                try:
                    assert locker.stdout.readline().strip() == "locked"
                    yield
                finally:
                    locker.stdin.close()
                    assert locker.wait(timeout=10) == 0

        return hold
    raise AssertionError(f"unknown store backend {backend!r}")

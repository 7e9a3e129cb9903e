"""Fixtures for the store contract suite.

``open_test_store`` is parametrised over the backends (:data:`BACKENDS`):
each param gives a function that opens *the same* database every time it is
called, so tests can close and reopen it.

``hold_write_lock`` gives a context manager during which *another process*
holds the lock the store's writes need (for SQLite, a ``BEGIN EXCLUSIVE``
transaction; for PostgreSQL, ``LOCK TABLE … IN EXCLUSIVE MODE`` on every
table of the store, which lets reads go on as SQLite's WAL does), for the
tests of a store that cannot write.

PostgreSQL: the session's throwaway server and a fresh database per test
(``postgres_server`` and ``postgres_db``, in ``tests/conftest.py``).
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
from llmgw.store.postgres import open_postgres_store
from llmgw.store.sqlite import open_sqlite_store

BACKENDS = ["sqlite", "postgres"]

_SQLITE_LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=10, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin
conn.execute("ROLLBACK")
conn.close()
"""

_POSTGRES_LOCKER = """
import sys, psycopg
conn = psycopg.connect(sys.argv[1])
tables = [r[0] for r in conn.execute(
    "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
    " AND tablename != 'schema_migrations'")]
conn.execute("LOCK TABLE " + ", ".join(tables) + " IN EXCLUSIVE MODE")
print("locked", flush=True)
sys.stdin.read()  # hold the locks until the test closes our stdin
conn.rollback()
conn.close()
"""


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test."""
    return str(request.param)


@pytest.fixture
def store_address(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """This test's store: a SQLite file path, or a PostgreSQL address."""
    if backend == "sqlite":
        return str(tmp_path / "store.db")
    if backend == "postgres":
        return str(request.getfixturevalue("postgres_db"))
    raise AssertionError(f"unknown store backend {backend!r}")


@pytest.fixture
def open_test_store(
    backend: str, store_address: str
) -> Callable[[], AbstractAsyncContextManager[Store]]:
    """A function that opens this test's store (the same database each call)."""
    if backend == "sqlite":
        return lambda: open_sqlite_store(store_address)
    if backend == "postgres":
        return lambda: open_postgres_store(store_address)
    raise AssertionError(f"unknown store backend {backend!r}")


@pytest.fixture
async def store(
    open_test_store: Callable[[], AbstractAsyncContextManager[Store]],
) -> AsyncIterator[Store]:
    """An open, empty store, closed after the test."""
    async with open_test_store() as opened:
        yield opened


@pytest.fixture
def hold_write_lock(backend: str, store_address: str) -> Callable[[], AbstractContextManager[None]]:
    """A context manager: another process holds the store's write lock inside it."""
    if backend == "sqlite":
        script = _SQLITE_LOCKER
    elif backend == "postgres":
        script = _POSTGRES_LOCKER
    else:
        raise AssertionError(f"unknown store backend {backend!r}")

    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        with subprocess.Popen(
            [sys.executable, "-c", script, store_address],
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

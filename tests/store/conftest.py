"""Fixtures for the store contract suite.

``open_test_store`` is parametrised over the backends (:data:`BACKENDS`):
each param gives a function that opens *the same* database every time it is
called, so tests can close and reopen it.

``hold_write_lock`` gives a context manager during which *another process*
holds the lock the store's writes need (for SQLite, a ``BEGIN EXCLUSIVE``
transaction; for PostgreSQL, ``LOCK TABLE … IN EXCLUSIVE MODE`` on every
table of the store, which lets reads go on as SQLite's WAL does), for the
tests of a store that cannot write.

PostgreSQL: one throwaway server per test session (``initdb`` and ``pg_ctl``
in a temporary folder, run as an unprivileged user when the tests run as
root, since ``initdb`` refuses root; its socket in that folder, TCP on a free
port of 127.0.0.1), and a fresh database per test. Without PostgreSQL's
binaries the postgres tests are skipped, except under ``CI=true``, where
they fail: ``.ci/run`` installs Debian's ``postgresql`` first.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from pathlib import Path

import attrs
import psycopg
import pytest

from llmgw.store import Store
from llmgw.store.postgres import open_postgres_store
from llmgw.store.sqlite import open_sqlite_store

BACKENDS = ["sqlite", "postgres"]

#: The user the test server runs as when the tests run as root.
_PG_USERS = ("postgres", "llmgw-test")

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


@attrs.frozen
class PostgresServer:
    """A running throwaway PostgreSQL server: superuser ``postgres``, no
    password (trust), TCP on 127.0.0.1:``port``."""

    port: int

    def address(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"


def _postgres_bin() -> Path | None:
    """The folder with ``initdb`` and ``pg_ctl``: Debian's newest, else the PATH's."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    return None


def _server_user() -> pwd.struct_passwd | None:
    """As root, the unprivileged user to run the server as (made if none
    exists); ``None`` when the tests do not run as root."""
    if os.geteuid() != 0:
        return None
    for name in _PG_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _PG_USERS[-1]],
        check=True,
    )
    return pwd.getpwnam(_PG_USERS[-1])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole test session, removed at its end."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        message = (
            "PostgreSQL's initdb and pg_ctl were not found (install Debian's postgresql "
            "package: apt-get install -y postgresql)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must run the PostgreSQL store tests", pytrace=False)
        pytest.skip(message)
    user = _server_user()
    base = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    uid: int | None = None
    gid: int | None = None
    groups: list[int] | None = None
    if user is not None:
        os.chown(base, user.pw_uid, user.pw_gid)
        uid, gid, groups = user.pw_uid, user.pw_gid, []
    data = base / "data"
    log = base / "server.log"
    port = _free_port()
    env = {**os.environ, "LC_ALL": "C", "TZ": "UTC"}
    try:
        subprocess.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "--locale=C",
                "--encoding=UTF8",
            ],
            check=True,
            capture_output=True,
            cwd=base,
            env=env,
            user=uid,
            group=gid,
            extra_groups=groups,
        )
        options = (
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        started = subprocess.run(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(log),
                "-o",
                options,
                "-w",
                "start",
            ],
            capture_output=True,
            text=True,
            cwd=base,
            env=env,
            user=uid,
            group=gid,
            extra_groups=groups,
        )
        if started.returncode != 0:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            pytest.fail(
                f"the test PostgreSQL server did not start: {started.stderr}\n{server_log}",
                pytrace=False,
            )
        try:
            yield PostgresServer(port=port)
        finally:
            subprocess.run(
                [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                capture_output=True,
                cwd=base,
                env=env,
                user=uid,
                group=gid,
                extra_groups=groups,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_db(request: pytest.FixtureRequest) -> Iterator[str]:
    """The address of a fresh, empty database on the session's server,
    dropped after the test."""
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(server.address("postgres"), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield server.address(name)
    finally:
        with psycopg.connect(server.address("postgres"), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


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

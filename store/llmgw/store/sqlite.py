"""The SQLite backend: :class:`SqliteStore` and :func:`open_sqlite_store`.

One file, one connection (opened with ``check_same_thread=False``), WAL
journal, ``synchronous=NORMAL`` and a busy timeout. Every store call is one
blocking function run by ``trio.to_thread.run_sync`` under the store's own
``trio.CapacityLimiter(1)``, so calls never overlap on the connection and the
event loop never blocks. Each write is one ``BEGIN IMMEDIATE`` transaction.
A call that still meets "database is locked" (another process holds the
write lock past the busy timeout) is retried with exponential back-off and
jitter before it fails with :class:`~llmgw.store.StoreError`.

Cancellation: a call that is running in its thread is waited for (trio's
``abandon_on_cancel=False``), so a write is never left half done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from functools import partial
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Final, TypeVar, final

import trio
from sqlite_utils import Database

from ._sqlite_schema import (
    apply_migrations,
    is_busy,
    load_migrations,
    packaged_migrations_dir,
    write_transaction,
)
from .interface import Conflict, StoreError
from .records import KeyRecord, Lease, ModelRecord, UsageRow

__all__ = ["SqliteStore", "open_sqlite_store"]

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_S: Final = 5.0
"""How long SQLite itself waits for another connection's lock, in seconds."""
LOCKED_ATTEMPTS: Final = 5
"""Tries per call when SQLite still reports "database is locked"."""
LOCKED_FIRST_DELAY_S: Final = 0.05
LOCKED_MAX_DELAY_S: Final = 1.0

_T = TypeVar("_T")


@final
class SqliteStore:
    """The :class:`~llmgw.store.Store` on one SQLite file.

    Get one from :func:`open_sqlite_store` (or :func:`llmgw.store.open_store`),
    which opens the file, applies migrations and closes it at exit; the
    constructor only wraps an open database.

    Every method may raise :class:`~llmgw.store.StoreError` when SQLite
    fails, including after the store was closed.
    """

    def __init__(self, db: Database, path: Path, limiter: trio.CapacityLimiter) -> None:
        """Wrap an open, migrated database.

        Args:
            db: the database; the store owns it from now on and closes it.
            path: its file, for messages.
            limiter: the limiter of capacity 1 that every use of ``db`` goes
                through.
        """
        self._db = db
        self._path = path
        self._limiter = limiter
        self._closed = False

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    async def aclose(self) -> None:
        """Close the connection once any running call has finished.

        Calls made afterwards raise :class:`~llmgw.store.StoreError`. Closing
        twice is harmless.
        """
        if self._closed:
            return
        self._closed = True
        await trio.to_thread.run_sync(self._db.close, limiter=self._limiter)

    async def _run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``fn(conn)`` in a worker thread; retry busy; translate errors."""

        def guarded() -> _T:
            # Checked in the thread, under the limiter, so a call queued
            # behind aclose() never touches a closed connection.
            if self._closed:
                raise StoreError(f"the SQLite store {self._path} is closed")
            return fn(self._db.conn)

        return await _call(guarded, self._limiter, self._path)

    # --- secrets -------------------------------------------------------------
    async def get_or_create_secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The secret named ``name``; made with ``make()`` and kept on first need.

        ``make`` is called (in the event loop's thread) only when the secret is
        missing; if another caller stores one first, theirs is returned and
        this one is dropped, so concurrent callers all get the same bytes.
        """
        found = await self._run(partial(_read_secret, name=name))
        if found is not None:
            return found
        return await self._run(partial(_keep_secret, name=name, value=bytes(make())))

    # --- keys ----------------------------------------------------------------
    async def insert_key(self, key: KeyRecord) -> None:
        """Keep a new key.

        Raises:
            Conflict: a key with this id or hash exists.
        """
        await self._run(partial(_insert_key, key=key))

    async def find_key_by_hash(self, key_hash: str) -> KeyRecord | None:
        """The key with this hash, revoked or not, or ``None``."""
        return await self._run(partial(_select_key, column="key_hash", value=key_hash))

    async def get_key(self, key_id: str) -> KeyRecord | None:
        """The key with this id, revoked or not, or ``None``."""
        return await self._run(partial(_select_key, column="id", value=key_id))

    async def list_keys(self) -> list[KeyRecord]:
        """Every key, oldest first."""
        return await self._run(_list_keys)

    async def revoke_key(self, key_id: str, at: float) -> bool:
        """Mark a key revoked at ``at`` (UTC epoch s); ``False`` when there is none.

        Revoking a revoked key keeps the first revocation time.
        """
        return await self._run(partial(_revoke_key, key_id=key_id, at=at))

    # --- usage ---------------------------------------------------------------
    async def insert_usage(self, rows: Sequence[UsageRow]) -> None:
        """Write a batch of usage rows in one transaction (all or none).

        A row whose ``request_id`` is already stored (or repeats earlier in
        the batch) is skipped, so a retried batch is never counted twice.
        """
        if not rows:
            return
        await self._run(partial(_insert_usage, rows=list(rows)))

    async def list_usage(self, *, last: int = 20, key_id: str | None = None) -> list[UsageRow]:
        """The ``last`` newest rows, newest first, optionally for one key.

        Raises:
            ValueError: ``last`` is negative.
        """
        if last < 0:
            raise ValueError(f"last must be 0 or more, not {last}")
        if last == 0:
            return []
        return await self._run(partial(_list_usage, last=last, key_id=key_id))

    async def get_usage(self, request_id: str) -> UsageRow | None:
        """The usage row of this request, or ``None``."""
        return await self._run(partial(_get_usage, request_id=request_id))

    # --- catalog -------------------------------------------------------------
    async def put_model(self, model: ModelRecord) -> None:
        """Insert or replace the model with this name."""
        await self._run(partial(_put_model, model=model))

    async def get_model(self, name: str) -> ModelRecord | None:
        """The model with this name, or ``None``."""
        return await self._run(partial(_get_model, name=name))

    async def list_models(self) -> list[ModelRecord]:
        """Every model, by name."""
        return await self._run(_list_models)

    async def delete_model(self, name: str) -> bool:
        """Remove the model with this name; ``False`` when there was none."""
        return await self._run(partial(_delete_model, name=name))

    # --- settings ------------------------------------------------------------
    async def get_setting(self, key: str) -> Any | None:
        """A JSON value kept under ``key``, or ``None``."""
        return await self._run(partial(_get_setting, key=key))

    async def put_setting(self, key: str, value: Any) -> None:
        """Keep the JSON value ``value`` under ``key``, replacing any other.

        Raises:
            TypeError: ``value`` is not JSON (e.g. a set).
            ValueError: ``value`` holds NaN or infinity, which JSON cannot.
        """
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
        await self._run(partial(_put_setting, key=key, text=text, now=time.time()))

    # --- leases --------------------------------------------------------------
    async def acquire_lease(self, name: str, holder: str, ttl_s: float, now: float) -> Lease | None:
        """Take or renew the lease ``name`` for ``holder`` until ``now + ttl_s``.

        Succeeds when the lease is free, expired, or already ``holder``'s (a
        renewal keeps the epoch; a takeover adds one). One conditional
        ``INSERT … ON CONFLICT DO UPDATE … WHERE``, so two contenders never
        both win.

        Args:
            name: the lease.
            holder: who asks (unique per process).
            ttl_s: how long it is held, in seconds.
            now: the current UTC epoch time in seconds.

        Returns:
            The lease now held, or ``None`` when someone else holds it and
            it has not expired.

        Raises:
            ValueError: ``ttl_s`` is not positive.
        """
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, not {ttl_s}")
        return await self._run(
            partial(_acquire_lease, name=name, holder=holder, expires_at=now + ttl_s, now=now)
        )

    async def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up now if ``holder`` has it (a clean stop).

        The row stays, expired, so the next holder's epoch still grows.
        """
        await self._run(partial(_release_lease, name=name, holder=holder))


@contextlib.asynccontextmanager
async def open_sqlite_store(
    path: str | os.PathLike[str], *, migrations_dir: Traversable | None = None
) -> AsyncIterator[SqliteStore]:
    """Open (or create) the SQLite store at ``path``; close it at exit.

    Creates the parent folder and the file (mode ``0600``: the store keeps
    secrets) when missing, sets WAL, ``synchronous=NORMAL`` and the busy
    timeout, then applies pending migrations, copying an existing database
    to ``<path>.bak-<NNNN>`` first.

    Args:
        path: the database file.
        migrations_dir: where the ``NNNN_what.sql`` files are; the ones
            shipped in the package when ``None`` (a seam for tests).

    Yields:
        The open store.

    Raises:
        StoreError: the file cannot be opened, a migration failed, or the
            database was written by a newer llmgw.

    Resource handling:
        The connection is closed when the block exits, even when it exits by
        cancellation.
    """
    db_path = Path(path)
    directory = packaged_migrations_dir() if migrations_dir is None else migrations_dir
    limiter = trio.CapacityLimiter(1)
    db = await _call(partial(_open_database, db_path, directory), limiter, db_path)
    store = SqliteStore(db, db_path, limiter)
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


# --- running calls -----------------------------------------------------------


async def _call(fn: Callable[[], _T], limiter: trio.CapacityLimiter, path: Path) -> _T:
    """Run ``fn`` in a worker thread; retry "database is locked"; wrap errors."""
    delay_s = LOCKED_FIRST_DELAY_S
    attempt = 1
    while True:
        try:
            return await trio.to_thread.run_sync(fn, limiter=limiter)
        except sqlite3.IntegrityError as exc:
            if exc.sqlite_errorcode in (
                sqlite3.SQLITE_CONSTRAINT_UNIQUE,
                sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY,
            ):
                raise Conflict(str(exc)) from exc
            raise StoreError(f"SQLite store {path}: {exc}") from exc
        except sqlite3.Error as exc:
            if not is_busy(exc) or attempt >= LOCKED_ATTEMPTS:
                raise StoreError(f"SQLite store {path}: {exc}") from exc
            logger.warning(
                "SQLite store %s is locked (try %d of %d); retrying in about %.2f s",
                path,
                attempt,
                LOCKED_ATTEMPTS,
                delay_s,
            )
            await trio.sleep(delay_s * random.uniform(0.5, 1.5))
            delay_s = min(delay_s * 2, LOCKED_MAX_DELAY_S)
            attempt += 1
        except OSError as exc:
            raise StoreError(f"SQLite store {path}: {exc}") from exc


def _open_database(path: Path, migrations_dir: Traversable) -> Database:
    migrations = load_migrations(migrations_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Create the file ourselves so it is private from the first byte; SQLite
    # gives its -wal and -shm files the same mode.
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    try:
        db = Database(conn, execute_plugins=False)
        db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        db.enable_wal()
        db.execute("PRAGMA synchronous = NORMAL")
        db.execute("PRAGMA foreign_keys = ON")
        apply_migrations(db, path, migrations)
    except BaseException:
        conn.close()
        raise
    return db


# --- the queries (each runs in a worker thread) ------------------------------


def _rows(
    conn: sqlite3.Connection, sql: str, params: Sequence[object] | Mapping[str, object] = ()
) -> list[sqlite3.Row]:
    cursor = conn.cursor()
    cursor.row_factory = sqlite3.Row
    return cursor.execute(sql, params).fetchall()


def _read_secret(conn: sqlite3.Connection, *, name: str) -> bytes | None:
    rows = _rows(conn, "SELECT value FROM secrets WHERE name = ?", (name,))
    return bytes(rows[0]["value"]) if rows else None


def _keep_secret(conn: sqlite3.Connection, *, name: str, value: bytes) -> bytes:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO secrets (name, value, created_at) VALUES (?, ?, ?)"
            " ON CONFLICT (name) DO NOTHING",
            (name, value, time.time()),
        )
        rows = _rows(conn, "SELECT value FROM secrets WHERE name = ?", (name,))
    return bytes(rows[0]["value"])


def _key_from_row(row: sqlite3.Row) -> KeyRecord:
    return KeyRecord(
        id=row["id"],
        name=row["name"],
        key_hash=row["key_hash"],
        prefix=row["prefix"],
        created_at=row["created_at"],
        is_admin=bool(row["is_admin"]),
        revoked_at=row["revoked_at"],
        expires_at=row["expires_at"],
    )


def _insert_key(conn: sqlite3.Connection, *, key: KeyRecord) -> None:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO keys (id, name, key_hash, prefix, created_at, is_admin, revoked_at,"
            " expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key.id,
                key.name,
                key.key_hash,
                key.prefix,
                key.created_at,
                int(key.is_admin),
                key.revoked_at,
                key.expires_at,
            ),
        )


def _select_key(conn: sqlite3.Connection, *, column: str, value: str) -> KeyRecord | None:
    # ``column`` is one of two names fixed in this module, never user input.
    rows = _rows(conn, f"SELECT * FROM keys WHERE {column} = ?", (value,))
    return _key_from_row(rows[0]) if rows else None


def _list_keys(conn: sqlite3.Connection) -> list[KeyRecord]:
    return [_key_from_row(r) for r in _rows(conn, "SELECT * FROM keys ORDER BY created_at, rowid")]


def _revoke_key(conn: sqlite3.Connection, *, key_id: str, at: float) -> bool:
    with write_transaction(conn):
        cursor = conn.execute(
            "UPDATE keys SET revoked_at = coalesce(revoked_at, ?) WHERE id = ?", (at, key_id)
        )
    return cursor.rowcount == 1


def _usage_from_row(row: sqlite3.Row) -> UsageRow:
    return UsageRow(
        request_id=row["request_id"],
        created_at=row["created_at"],
        key_id=row["key_id"],
        model=row["model"],
        status=row["status"],
        prompt_tokens=row["prompt_tokens"],
        cached_tokens=row["cached_tokens"],
        completion_tokens=row["completion_tokens"],
        duration_ms=row["duration_ms"],
        ttft_ms=row["ttft_ms"],
        replica_id=row["replica_id"],
        stream=bool(row["stream"]),
        endpoint=row["endpoint"],
    )


def _insert_usage(conn: sqlite3.Connection, *, rows: list[UsageRow]) -> None:
    # ON CONFLICT (request_id) DO NOTHING rather than INSERT OR IGNORE: only a
    # repeated request id is skipped; any other bad row still fails the batch.
    with write_transaction(conn):
        conn.executemany(
            "INSERT INTO usage (request_id, created_at, key_id, model, status, prompt_tokens,"
            " cached_tokens, completion_tokens, duration_ms, ttft_ms, replica_id, stream,"
            " endpoint) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (request_id) DO NOTHING",
            [
                (
                    r.request_id,
                    r.created_at,
                    r.key_id,
                    r.model,
                    r.status,
                    r.prompt_tokens,
                    r.cached_tokens,
                    r.completion_tokens,
                    r.duration_ms,
                    r.ttft_ms,
                    r.replica_id,
                    int(r.stream),
                    r.endpoint,
                )
                for r in rows
            ],
        )


def _list_usage(conn: sqlite3.Connection, *, last: int, key_id: str | None) -> list[UsageRow]:
    if key_id is None:
        rows = _rows(
            conn, "SELECT * FROM usage ORDER BY created_at DESC, rowid DESC LIMIT ?", (last,)
        )
    else:
        rows = _rows(
            conn,
            "SELECT * FROM usage WHERE key_id = ? ORDER BY created_at DESC, rowid DESC LIMIT ?",
            (key_id, last),
        )
    return [_usage_from_row(r) for r in rows]


def _get_usage(conn: sqlite3.Connection, *, request_id: str) -> UsageRow | None:
    rows = _rows(conn, "SELECT * FROM usage WHERE request_id = ?", (request_id,))
    return _usage_from_row(rows[0]) if rows else None


def _model_from_row(row: sqlite3.Row) -> ModelRecord:
    return ModelRecord(
        name=row["name"],
        engine=row["engine"],
        source=row["source"],
        replicas=row["replicas"],
        context_tokens=row["context_tokens"],
        slots=row["slots"],
        cpu_cores=row["cpu_cores"],
        args=tuple(json.loads(row["args"])),
        env=dict(json.loads(row["env"])),
        sha256=row["sha256"],
        created_at=row["created_at"],
    )


def _put_model(conn: sqlite3.Connection, *, model: ModelRecord) -> None:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO models (name, engine, source, replicas, context_tokens, slots,"
            " cpu_cores, args, env, sha256, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET engine = excluded.engine,"
            " source = excluded.source, replicas = excluded.replicas,"
            " context_tokens = excluded.context_tokens, slots = excluded.slots,"
            " cpu_cores = excluded.cpu_cores, args = excluded.args, env = excluded.env,"
            " sha256 = excluded.sha256, created_at = excluded.created_at",
            (
                model.name,
                model.engine,
                model.source,
                model.replicas,
                model.context_tokens,
                model.slots,
                model.cpu_cores,
                json.dumps(list(model.args)),
                json.dumps(model.env, sort_keys=True),
                model.sha256,
                model.created_at,
            ),
        )


def _get_model(conn: sqlite3.Connection, *, name: str) -> ModelRecord | None:
    rows = _rows(conn, "SELECT * FROM models WHERE name = ?", (name,))
    return _model_from_row(rows[0]) if rows else None


def _list_models(conn: sqlite3.Connection) -> list[ModelRecord]:
    return [_model_from_row(r) for r in _rows(conn, "SELECT * FROM models ORDER BY name")]


def _delete_model(conn: sqlite3.Connection, *, name: str) -> bool:
    with write_transaction(conn):
        cursor = conn.execute("DELETE FROM models WHERE name = ?", (name,))
    return cursor.rowcount == 1


def _get_setting(conn: sqlite3.Connection, *, key: str) -> Any | None:
    rows = _rows(conn, "SELECT value FROM settings WHERE key = ?", (key,))
    return json.loads(rows[0]["value"]) if rows else None


def _put_setting(conn: sqlite3.Connection, *, key: str, text: str, now: float) -> None:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value,"
            " updated_at = excluded.updated_at",
            (key, text, now),
        )


def _acquire_lease(
    conn: sqlite3.Connection, *, name: str, holder: str, expires_at: float, now: float
) -> Lease | None:
    # The single statement decides: the DO UPDATE only happens when the row
    # is ours or expired, and RETURNING yields nothing when it does not.
    with write_transaction(conn):
        rows = _rows(
            conn,
            "INSERT INTO leases (name, holder, epoch, expires_at) VALUES (:name, :holder, 1, :exp)"
            " ON CONFLICT (name) DO UPDATE SET"
            " epoch = CASE WHEN leases.holder = excluded.holder"
            " THEN leases.epoch ELSE leases.epoch + 1 END,"
            " holder = excluded.holder, expires_at = excluded.expires_at"
            " WHERE leases.holder = excluded.holder OR leases.expires_at <= :now"
            " RETURNING name, holder, epoch, expires_at",
            {"name": name, "holder": holder, "exp": expires_at, "now": now},
        )
    if not rows:
        return None
    row = rows[0]
    return Lease(
        name=row["name"], holder=row["holder"], epoch=row["epoch"], expires_at=row["expires_at"]
    )


def _release_lease(conn: sqlite3.Connection, *, name: str, holder: str) -> None:
    with write_transaction(conn):
        conn.execute(
            "UPDATE leases SET expires_at = 0 WHERE name = ? AND holder = ?", (name, holder)
        )

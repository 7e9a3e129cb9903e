"""SQLite plumbing shared by the store: write transactions and migrations.

Migrations are numbered ``NNNN_what.sql`` files in ``migrations/sqlite/``
(shipped inside the package). At open, every file whose number is not yet in
the ``schema_migrations`` table is applied in order, each in its own
``BEGIN IMMEDIATE`` transaction together with its ``schema_migrations`` row.
Before the first pending migration touches a database that already holds
tables, the database is copied to ``<db>.bak-<NNNN>`` (``NNNN`` = the schema
version the copy holds).

Everything here is blocking; callers run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import logging
import os
import re
import sqlite3
import stat
import time
from collections.abc import Iterator
from importlib.resources.abc import Traversable
from pathlib import Path

import attrs

from ._sqlite_utils import Database
from .interface import StoreError

__all__ = [
    "MIGRATIONS_TABLE",
    "Migration",
    "applied_versions",
    "apply_migrations",
    "backup_path",
    "is_busy",
    "load_migrations",
    "packaged_migrations_dir",
    "write_transaction",
]

logger = logging.getLogger(__name__)

MIGRATIONS_TABLE = "schema_migrations"

_MIGRATION_NAME = re.compile(r"^(\d{4})_[A-Za-z0-9_]+\.sql$")


@contextlib.contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """Run a block in one ``BEGIN IMMEDIATE`` transaction: commit or roll back.

    ``IMMEDIATE`` takes the write lock up front, so SQLite's busy timeout
    applies while waiting for it; a deferred ``BEGIN`` (sqlite-utils'
    ``atomic()``) can fail with "database is locked" at once when it later
    upgrades a read to a write while another connection writes.

    Raises:
        sqlite3.Error: from SQLite; the transaction is rolled back first.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        # The error may have ended the transaction already (a failed COMMIT
        # can, and so can some constraint errors); only roll back if open.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    else:
        try:
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


@attrs.frozen(kw_only=True)
class Migration:
    """One numbered migration file.

    Attributes:
        version: the number in the file name (``0003_x.sql`` → 3).
        name: the file name.
        sql: the statements, run inside one transaction.
    """

    version: int
    name: str
    sql: str


def packaged_migrations_dir() -> Traversable:
    """The ``migrations/sqlite`` folder shipped inside ``llmgw.store``."""
    return importlib.resources.files("llmgw.store").joinpath("migrations", "sqlite")


def load_migrations(directory: Traversable) -> list[Migration]:
    """Read the migration files in ``directory``, ordered by version.

    Files not ending in ``.sql`` are ignored.

    Raises:
        StoreError: a ``.sql`` file is not named ``NNNN_what.sql``, or two
            files share a version.
    """
    found: dict[int, Migration] = {}
    for entry in directory.iterdir():
        if not entry.name.endswith(".sql") or not entry.is_file():
            continue
        match = _MIGRATION_NAME.match(entry.name)
        if match is None:
            raise StoreError(f"migration file {entry.name!r} is not named like 0001_what.sql")
        version = int(match.group(1))
        if version in found:
            raise StoreError(
                f"migration files {found[version].name!r} and {entry.name!r} share version {version}"
            )
        found[version] = Migration(
            version=version, name=entry.name, sql=entry.read_text(encoding="utf-8")
        )
    return [found[v] for v in sorted(found)]


def applied_versions(conn: sqlite3.Connection) -> set[int]:
    """The versions recorded in ``schema_migrations`` (empty on a new database)."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (MIGRATIONS_TABLE,)
    ).fetchone()
    if exists is None:
        return set()
    return {int(row[0]) for row in conn.execute(f"SELECT version FROM {MIGRATIONS_TABLE}")}


def backup_path(db_path: Path, version: int) -> Path:
    """Where the copy taken before migrating from schema ``version`` goes."""
    return db_path.with_name(f"{db_path.name}.bak-{version:04d}")


def apply_migrations(db: Database, db_path: Path, migrations: list[Migration]) -> list[int]:
    """Apply the pending ``migrations`` to ``db``, backing it up first.

    Each migration runs in its own ``BEGIN IMMEDIATE`` transaction together
    with its ``schema_migrations`` row, and is skipped if another process
    recorded it meanwhile, so two processes opening one file never apply a
    migration twice. A failing migration is rolled back and stays pending;
    the ones before it stay applied.

    Args:
        db: the open database.
        db_path: the database file; the backup goes next to it.
        migrations: every known migration, ordered by version.

    Returns:
        The versions applied now, in order (empty when none was pending).

    Raises:
        StoreError: the database records a version this code does not know
            (it was written by a newer llmgw), or a migration failed.
        sqlite3.Error: the database failed outside a migration's SQL.
    """
    conn = db.conn
    known = {m.version for m in migrations}
    applied = applied_versions(conn)
    unknown = applied - known
    if unknown:
        raise StoreError(
            f"{db_path} has schema version(s) {sorted(unknown)} that this llmgw does not know; "
            "it was written by a newer llmgw: upgrade llmgw, or restore a backup"
        )
    pending = [m for m in migrations if m.version not in applied]
    if not pending:
        return []
    if _has_tables(db):
        current = max(applied, default=0)
        target = backup_path(db_path, current)
        _backup(conn, db_path, target)
        logger.info("backed up %s to %s before migrating", db_path, target)

    done: list[int] = []
    for migration in pending:
        with write_transaction(conn):
            conn.execute(
                f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} ("
                "version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            if migration.version in applied_versions(conn):
                continue
            try:
                # sqlite-utils runs a script statement by statement when a
                # transaction is open, instead of sqlite3's committing
                # executescript().
                db.executescript(migration.sql)
            except sqlite3.Error as exc:
                if is_busy(exc):
                    raise  # the caller retries "database is locked"
                raise StoreError(f"migration {migration.name} failed on {db_path}: {exc}") from exc
            conn.execute(
                f"INSERT INTO {MIGRATIONS_TABLE} (version, name, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.name, time.time()),
            )
        done.append(migration.version)
        logger.info("applied migration %s to %s", migration.name, db_path)
    return done


def is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` is SQLite's "database is locked" (busy), worth a retry."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "database is locked" in str(exc)


def _has_tables(db: Database) -> bool:
    return any(not name.startswith("sqlite_") for name in db.table_names())


def _backup(conn: sqlite3.Connection, db_path: Path, target: Path) -> None:
    """Copy the live database to ``target`` with SQLite's backup API.

    The backup API sees committed pages still in the WAL, which a plain file
    copy would miss. The copy is written under a temporary name, switched to
    a self-contained rollback journal, given the database's file mode and
    then renamed into place, so ``target`` is always a whole database.
    """
    partial = target.with_name(f"{target.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        with contextlib.closing(sqlite3.connect(partial)) as dest:
            conn.backup(dest)
            dest.execute("PRAGMA journal_mode = DELETE")
        os.chmod(partial, stat.S_IMODE(os.stat(db_path).st_mode))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)

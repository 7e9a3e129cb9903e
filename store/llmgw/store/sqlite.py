"""The SQLite backend: :class:`SqliteStore` and :func:`open_sqlite_store`.

One file, one connection (opened with ``check_same_thread=False``), WAL
journal, ``synchronous=NORMAL`` and a busy timeout. Every store call is one
blocking function run by ``trio.to_thread.run_sync`` under the store's own
``trio.CapacityLimiter(1)``, so calls never overlap on the connection and the
event loop never blocks. Each write is one ``BEGIN IMMEDIATE`` transaction.
A call that still meets "database is locked" (another process holds the
write lock past the busy timeout) is retried with exponential back-off and
jitter before it fails with :class:`~llmgw.store.StoreError`; a call gives up
once :data:`LOCKED_DEADLINE_S` has passed, so a write blocked by a lock held
elsewhere fails within about ``LOCKED_DEADLINE_S + BUSY_TIMEOUT_S`` seconds
(the usage writer keeps its batch and tries again later) instead of hanging.
Reads are not blocked by another writer (WAL).

Usage roll-ups: :meth:`SqliteStore.insert_usage` adds each new row into
``usage_hourly``, ``usage_daily`` and ``usage_monthly`` (per hour, UTC day
or calendar month, key, model and tree place) in the same transaction. :meth:`~SqliteStore.prune_usage`
deletes raw rows past the retention in short batches and leaves the
roll-ups alone. :meth:`~SqliteStore.spend_since_by_scope` and
:meth:`~SqliteStore.usage_summary` sum a range from whole months,
days and hours (the longest that fit) and, for the parts of an
hour at either end, the raw rows; where those raw rows were pruned, that
hour counts whole (``docs/up.md``, Usage kept).

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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from functools import partial
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Final, TypeVar, cast, final

import trio

from . import _people
from ._catalog_json import model_from_json, model_to_json
from ._common import (
    _KEYS_LAST_USED_SQL,
    _LIMITS_TABLES,
    _RAW_COLUMNS,
    _ROLLUP_TABLES,
    _SUMMARY_COLUMNS,
    ERROR_STATUS,
    _check_name,
    _limits_from_json,
    _limits_to_json,
    _new_id,
    _newest_uses,
    _pieces,
    _Sums,
    day_of,
    hour_of,
    join_token_refusal,
    month_of,
)
from ._sqlite_schema import (
    apply_migrations,
    is_busy,
    load_migrations,
    packaged_migrations_dir,
    write_transaction,
)
from ._sqlite_utils import Database
from .interface import (
    Conflict,
    Fenced,
    StoreError,
)
from .records import (
    GuardEvent,
    JoinToken,
    KeyRecord,
    Lease,
    Limits,
    ModelRecord,
    NodeCertificate,
    Org,
    Project,
    ProjectPath,
    Scope,
    SettingChange,
    SummaryBy,
    Team,
    UsageRow,
    UsageSummary,
)

__all__ = ["SqliteStore", "open_sqlite_store"]

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_S: Final = 1.0
"""How long SQLite itself waits for another connection's lock, in seconds.

Short on purpose: while a call waits here it holds the store's only
connection, so reads (key lookups) queue behind it; between tries they run.
"""
LOCKED_ATTEMPTS: Final = 10
"""Most tries per call when SQLite still reports "database is locked"."""
LOCKED_DEADLINE_S: Final = 5.0
"""No new try starts this long after a call's first one: a call blocked by a
lock held elsewhere fails within about ``LOCKED_DEADLINE_S + BUSY_TIMEOUT_S``."""
OPEN_DEADLINE_S: Final = 120.0
"""The same for opening, which may wait for another process's migration."""
LOCKED_FIRST_DELAY_S: Final = 0.05
LOCKED_MAX_DELAY_S: Final = 1.0


_T = TypeVar("_T")


@final
class SqliteStore(_people.PeopleMethods):
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

    async def update_key(self, key: KeyRecord) -> bool:
        """Replace the key with ``key.id`` by ``key`` (rotation, limits, band, last use).

        Two fields never go back, so a stale copy cannot undo a concurrent
        change: a revoked key stays revoked (the stored ``revoked_at`` wins
        when set) and ``last_used_at`` keeps the later of the two times.

        Returns:
            ``False`` when there is no key with this id (nothing is written).

        Raises:
            Conflict: ``key.key_hash`` belongs to another key.
            StoreError: ``key.project_id`` names no project.
        """
        return await self._run(partial(_update_key, key=key))

    async def mark_keys_used(self, used: Mapping[str, float]) -> None:
        """Record last uses (key id → UTC epoch s) in one transaction.

        A time earlier than the one stored is ignored; unknown ids are
        skipped. Meant for a batch of last uses collected in memory, so the
        request path never writes per request.
        """
        if not used:
            return
        await self._run(partial(_mark_keys_used, used=dict(used)))

    # --- tenancy tree --------------------------------------------------------
    async def ensure_project(
        self, org: str, team: str, project: str, now: float
    ) -> tuple[ProjectPath, list[str]]:
        """Make ``org/team/project`` exist, creating the levels that are missing.

        Names are unique per parent, so an existing team or project is never
        moved: ``Other/ml`` is a different team from ``Acme/ml``.

        Args:
            org: the organization's name.
            team: the team's name within the org.
            project: the project's name within the team.
            now: creation time (UTC epoch s) for the levels made now.

        Returns:
            The project's path, and what was created, top down, e.g.
            ``["org Acme", "team Acme/ml", "project Acme/ml/train"]``
            (empty when everything existed).

        Raises:
            ValueError: a name is not 1 to 64 letters, digits, ``-``, ``_`` or ``.``.
        """
        for level, name in (("org", org), ("team", team), ("project", project)):
            _check_name(level, name)
        return await self._run(
            partial(_ensure_project, org=org, team=team, project=project, now=now)
        )

    async def get_project_path(self, project_id: str) -> ProjectPath | None:
        """The project with this id and the team and org above it, or ``None``."""
        return await self._run(partial(_get_project_path, project_id=project_id))

    async def find_project(self, org: str, team: str, project: str) -> ProjectPath | None:
        """The project at ``org/team/project`` (names), or ``None``."""
        return await self._run(partial(_find_project, org=org, team=team, project=project))

    async def find_org(self, name: str) -> Org | None:
        """The organization with this name, or ``None``."""
        return await self._run(partial(_find_org, name=name))

    async def find_team(self, org: str, name: str) -> Team | None:
        """The team ``name`` in the organization named ``org``, or ``None``."""
        return await self._run(partial(_find_team, org=org, name=name))

    async def list_orgs(self) -> list[Org]:
        """Every organization, by name."""
        return await self._run(_list_orgs)

    async def list_teams(self) -> list[Team]:
        """Every team, by org name then team name."""
        return await self._run(_list_teams)

    async def list_tree(self) -> list[ProjectPath]:
        """Every project with its path, by org, team and project name.

        Orgs and teams without projects are not here; see :meth:`list_orgs`
        and :meth:`list_teams`.
        """
        return await self._run(_list_tree)

    async def set_limits(self, scope: Scope, id: str, limits: Limits) -> bool:
        """Replace the limits of the org, team, project or key with this id.

        Returns:
            ``False`` when there is no such id at that scope.

        Raises:
            ValueError: ``scope`` is not one of the four.
        """
        table = _LIMITS_TABLES.get(scope)
        if table is None:
            raise ValueError(f"scope must be one of {sorted(_LIMITS_TABLES)}, not {scope!r}")
        return await self._run(
            partial(_set_limits, table=table, id=id, text=_limits_to_json(limits))
        )

    # --- usage ---------------------------------------------------------------
    async def insert_usage(self, rows: Sequence[UsageRow]) -> None:
        """Write a batch of usage rows in one transaction (all or none).

        A row whose ``request_id`` is already stored (or repeats earlier in
        the batch) is skipped, so a retried batch is never counted twice.
        Each new row is also added into the hourly, daily and monthly
        roll-ups (hour, UTC day or calendar month, key, model = ``served_model`` or else ``model``, and the
        row's tree ids) in the same transaction. A row older than the pruning
        horizon is skipped too (logged): it may have been stored and pruned
        already, and its sums are then in the roll-ups.
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

    async def spend_since_by_scope(self, since: float) -> dict[str, int]:
        """Summed ``cost_micros`` of usage with ``created_at >= since``, per counter.

        Counters are named ``key:<id>``, ``project:<id>``, ``team:<id>`` and
        ``org:<id>``; every id seen in such usage is there (with 0 when it
        cost nothing), empty ids are not. Exact while the raw rows of the
        hour of ``since`` are kept: whole months, days and hours come from
        the roll-ups, the part of an hour after ``since`` from the raw rows (when
        those were pruned, that hour counts whole).
        """
        return await self._run(partial(_spend_since_by_scope, since=since))

    async def usage_summary(
        self, by: SummaryBy, since: float, until: float | None = None
    ) -> list[UsageSummary]:
        """Usage per key, project, team, org or model id, from the roll-ups.

        Exactly the rows with ``since <= created_at < until`` (``until``
        ``None`` = no end): whole months, days and hours from the monthly,
        daily and hourly roll-ups (the longest that fit), and the part of an
        hour at either end from the raw rows. Where the raw rows of such an
        hour were pruned, that hour counts whole. One read transaction, so
        the pieces are of one moment. Usage without a place in the tree is grouped under
        ``""``. Groups come most expensive first, then by group.

        Raises:
            ValueError: ``by`` is not one of the five.
        """
        column = _SUMMARY_COLUMNS.get(by)
        if column is None:
            raise ValueError(f"by must be one of {sorted(_SUMMARY_COLUMNS)}, not {by!r}")
        return await self._run(partial(_usage_summary, column=column, since=since, until=until))

    async def prune_usage(
        self, before: float, *, limit: int = 5000, fence: Lease | None = None
    ) -> int:
        """Delete at most ``limit`` raw usage rows older than ``before``, oldest first.

        ``before`` (UTC epoch s) is floored to its hour. One short write
        transaction (call again until it returns less than ``limit``); the
        roll-ups keep every pruned row's sums. The pruning horizon only
        moves forward: rows older than it are refused by
        :meth:`insert_usage` from then on. Nothing is written when no row is
        that old.

        Returns:
            How many rows were deleted.

        Raises:
            ValueError: ``limit`` is less than 1.
            Fenced: ``fence`` is no longer the lease's epoch (nothing deleted).
        """
        if limit < 1:
            raise ValueError(f"limit must be 1 or more, not {limit}")
        return await self._run(
            partial(_prune_usage, before=float(hour_of(before)), limit=limit, fence=fence)
        )

    async def usage_pruned_before(self) -> float | None:
        """The pruning horizon (raw rows older than it may be gone), or ``None``
        when no raw row was ever pruned."""
        return await self._run(_usage_pruned_before)

    async def export_usage(
        self,
        since: float,
        until: float | None,
        *,
        after_request_id: str = "",
        limit: int = 1000,
    ) -> list[UsageRow]:
        """One page of usage rows with ``since <= created_at < until``.

        Rows come in ``(created_at, request_id)`` order, read along an index.
        To stream everything, call again with ``after_request_id`` set to the
        last row's request id until a page is shorter than ``limit``.

        Raises:
            ValueError: ``limit`` is negative, or ``after_request_id`` names no
                stored row (it was pruned meanwhile: start again from its time).
        """
        if limit < 0:
            raise ValueError(f"limit must not be negative, not {limit}")
        return await self._run(
            partial(
                _export_usage,
                since=since,
                until=until,
                after_request_id=after_request_id,
                limit=limit,
            )
        )

    # --- catalog -------------------------------------------------------------
    async def put_model(self, model: ModelRecord, *, fence: Lease | None = None) -> None:
        """Insert or replace the model with this name.

        Raises:
            Fenced: ``fence`` is no longer the lease's epoch (nothing written).
        """
        await self._run(partial(_put_model, model=model, fence=fence))

    async def get_model(self, name: str) -> ModelRecord | None:
        """The model with this name, or ``None``."""
        return await self._run(partial(_get_model, name=name))

    async def list_models(self) -> list[ModelRecord]:
        """Every model, by name."""
        return await self._run(_list_models)

    async def delete_model(self, name: str, *, fence: Lease | None = None) -> bool:
        """Remove the model with this name; ``False`` when there was none.

        Raises:
            Fenced: ``fence`` is no longer the lease's epoch (nothing deleted).
        """
        return await self._run(partial(_delete_model, name=name, fence=fence))

    # --- settings ------------------------------------------------------------
    async def get_setting(self, key: str) -> Any | None:
        """A JSON value kept under ``key``, or ``None``."""
        return await self._run(partial(_get_setting, key=key))

    async def put_setting(self, key: str, value: Any, *, fence: Lease | None = None) -> None:
        """Keep the JSON value ``value`` under ``key``, replacing any other.

        Raises:
            TypeError: ``value`` is not JSON (e.g. a set).
            ValueError: ``value`` holds NaN or infinity, which JSON cannot.
            Fenced: ``fence`` is no longer the lease's epoch (nothing written).
        """
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
        await self._run(partial(_put_setting, key=key, text=text, now=time.time(), fence=fence))

    # --- the cluster settings document (versioned) -----------------------------
    async def get_settings_doc(self) -> tuple[int, dict[str, Any]] | None:
        """The live settings document and its version, or ``None`` before the
        first :meth:`put_settings_doc`."""
        return await self._run(_get_settings_doc)

    async def put_settings_doc(
        self,
        doc: Mapping[str, Any],
        *,
        expected_version: int | None,
        actor: str,
        note: str = "",
        fence: Lease | None = None,
    ) -> int:
        """Keep ``doc`` as the next version (a new ``settings_history`` row); return it.

        Args:
            doc: the whole document, plain JSON types.
            expected_version: write only if the live version is this one
                (0 = none yet); ``None`` writes whatever the live version is.
            actor: who makes the change.
            note: why (free text).

        Raises:
            Conflict: ``expected_version`` is not the live version.
            TypeError: ``doc`` is not JSON (e.g. holds a set).
            ValueError: ``doc`` holds NaN or infinity, which JSON cannot.
            Fenced: ``fence`` is no longer the lease's epoch (nothing written).
        """
        text = json.dumps(dict(doc), allow_nan=False, sort_keys=True, separators=(",", ":"))
        return await self._run(
            partial(
                _put_settings_doc,
                text=text,
                expected_version=expected_version,
                actor=actor,
                note=note,
                now=time.time(),
                fence=fence,
            )
        )

    async def settings_version(self) -> int:
        """The live document's version; 0 when there is none."""
        return await self._run(_settings_version)

    async def settings_history(self, last: int = 20) -> list[SettingChange]:
        """The ``last`` newest versions, newest first.

        Raises:
            ValueError: ``last`` is less than 1.
        """
        if last < 1:
            raise ValueError(f"last must be at least 1, not {last}")
        return await self._run(partial(_settings_history, last=last))

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

    # --- node identity -------------------------------------------------------
    async def insert_node_certificate(self, cert: NodeCertificate) -> None:
        """Keep a certificate just issued.

        Raises:
            Conflict: a certificate with this serial exists.
        """
        await self._run(partial(_insert_node_certificate, cert=cert))

    async def get_node_certificate(self, serial: str) -> NodeCertificate | None:
        """The certificate with this serial (lower-case hex), revoked or not, or ``None``."""
        rows = await self._run(
            partial(_select_node_certificates, where="serial = ?", params=(serial.lower(),))
        )
        return rows[0] if rows else None

    async def list_node_certificates(self, node_id: str | None = None) -> list[NodeCertificate]:
        """The certificates issued (to ``node_id`` when given), oldest first."""
        if node_id is None:
            return await self._run(partial(_select_node_certificates, where="1", params=()))
        return await self._run(
            partial(_select_node_certificates, where="node_id = ?", params=(node_id,))
        )

    async def revoke_node_certificates(self, node_id: str, at: float) -> int:
        """Revoke every valid certificate of ``node_id`` at ``at`` (UTC epoch s).

        Returns:
            How many were revoked now; already revoked ones keep their time.
        """
        return await self._run(partial(_revoke_node_certificates, node_id=node_id, at=at))

    async def insert_join_token(self, token: JoinToken) -> None:
        """Keep a join code's token (by hash).

        Raises:
            Conflict: a token with this hash exists.
        """
        await self._run(partial(_insert_join_token, token=token))

    async def get_join_token(self, token_hash: str) -> JoinToken | None:
        """The token with this hash, used or not, or ``None`` (nothing changes)."""
        return await self._run(partial(_select_join_token, token_hash=token_hash))

    async def use_join_token(self, token_hash: str, now: float) -> JoinToken:
        """Use the token with this hash, once: it is marked used at ``now``.

        One conditional ``UPDATE … WHERE used_at IS NULL AND expires_at > now``
        in a write transaction, so two concurrent uses never both succeed.

        Returns:
            The token as stored now (``used_at`` = ``now``).

        Raises:
            JoinTokenUnknown: no token has this hash.
            JoinTokenUsed: it was used before (``used_at`` says when).
            JoinTokenExpired: ``now`` is at or past its ``expires_at``.
        """
        return await self._run(partial(_use_join_token, token_hash=token_hash, now=now))

    async def list_guard_events(
        self,
        *,
        last: int = 50,
        request_id: str | None = None,
        rule: str | None = None,
        since: float | None = None,
    ) -> list[GuardEvent]:
        """Guard events, newest first; see :meth:`llmgw.store.Store.list_guard_events`."""
        if last < 0:
            raise ValueError(f"last must be 0 or more, not {last}")
        return await self._run(
            partial(_list_guard_events, last=last, request_id=request_id, rule=rule, since=since)
        )

    # --- people, memberships, sessions: PeopleMethods (docs/portal.md) -------
    async def _people(self, fn: Callable[..., _T], **kwargs: Any) -> _T:
        return await self._run(lambda conn: fn(_people.SqliteSql(conn), **kwargs))

    async def keys_last_used(self) -> dict[str, float]:
        """Each used key's last use; see :meth:`llmgw.store.Store.keys_last_used`."""
        return await self._run(
            lambda conn: _newest_uses(conn.execute(_KEYS_LAST_USED_SQL).fetchall())
        )


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
    db = await _call(
        partial(_open_database, db_path, directory), limiter, db_path, deadline_s=OPEN_DEADLINE_S
    )
    store = SqliteStore(db, db_path, limiter)
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


# --- running calls -----------------------------------------------------------


async def _call(
    fn: Callable[[], _T],
    limiter: trio.CapacityLimiter,
    path: Path,
    *,
    deadline_s: float | None = None,
) -> _T:
    """Run ``fn`` in a worker thread; retry "database is locked"; wrap errors.

    No new try starts after ``deadline_s`` (:data:`LOCKED_DEADLINE_S` when
    ``None``) from the first, nor after :data:`LOCKED_ATTEMPTS` tries.
    """
    give_up_at = trio.current_time() + (LOCKED_DEADLINE_S if deadline_s is None else deadline_s)
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
            sleep_s = delay_s * random.uniform(0.5, 1.5)
            if (
                not is_busy(exc)
                or attempt >= LOCKED_ATTEMPTS
                or trio.current_time() + sleep_s >= give_up_at
            ):
                if is_busy(exc):
                    raise StoreError(
                        f"SQLite store {path}: {exc} (gave up after {attempt} tries: another "
                        "connection holds the write lock)"
                    ) from exc
                raise StoreError(f"SQLite store {path}: {exc}") from exc
            logger.warning(
                "SQLite store %s is locked (try %d); retrying in about %.2f s",
                path,
                attempt,
                sleep_s,
            )
            await trio.sleep(sleep_s)
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
        project_id=row["project_id"],
        band=row["band"],
        limits=_limits_from_json(row["limits"]),
        last_used_at=row["last_used_at"],
        owner=row["owner"],
    )


def _key_params(key: KeyRecord) -> dict[str, object]:
    return {
        "id": key.id,
        "name": key.name,
        "key_hash": key.key_hash,
        "prefix": key.prefix,
        "created_at": key.created_at,
        "is_admin": int(key.is_admin),
        "revoked_at": key.revoked_at,
        "expires_at": key.expires_at,
        "project_id": key.project_id,
        "band": key.band,
        "limits": _limits_to_json(key.limits),
        "last_used_at": key.last_used_at,
        "owner": key.owner,
    }


def _insert_key(conn: sqlite3.Connection, *, key: KeyRecord) -> None:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO keys (id, name, key_hash, prefix, created_at, is_admin, revoked_at,"
            " expires_at, project_id, band, limits, last_used_at, owner) VALUES (:id, :name,"
            " :key_hash, :prefix, :created_at, :is_admin, :revoked_at, :expires_at,"
            " :project_id, :band, :limits, :last_used_at, :owner)",
            _key_params(key),
        )


def _update_key(conn: sqlite3.Connection, *, key: KeyRecord) -> bool:
    with write_transaction(conn):
        cursor = conn.execute(
            "UPDATE keys SET name = :name, key_hash = :key_hash, prefix = :prefix,"
            " created_at = :created_at, is_admin = :is_admin,"
            " revoked_at = coalesce(revoked_at, :revoked_at), expires_at = :expires_at,"
            " project_id = :project_id, band = :band, limits = :limits, owner = :owner,"
            " last_used_at = CASE WHEN last_used_at IS NULL THEN :last_used_at"
            " WHEN :last_used_at IS NULL THEN last_used_at"
            " ELSE max(last_used_at, :last_used_at) END"
            " WHERE id = :id",
            _key_params(key),
        )
    return cursor.rowcount == 1


def _mark_keys_used(conn: sqlite3.Connection, *, used: dict[str, float]) -> None:
    with write_transaction(conn):
        conn.executemany(
            "UPDATE keys SET last_used_at = max(coalesce(last_used_at, :at), :at) WHERE id = :id",
            [{"id": key_id, "at": at} for key_id, at in used.items()],
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
        project_id=row["project_id"],
        team_id=row["team_id"],
        org_id=row["org_id"],
        served_model=row["served_model"],
        images=row["images"],
        meshes=row["meshes"],
        cost_micros=row["cost_micros"],
        cache_hit=bool(row["cache_hit"]),
        guard_rules=row["guard_rules"],
        guard_action=row["guard_action"],
        guard_ms=row["guard_ms"],
    )


_INSERT_USAGE = (
    "INSERT INTO usage (request_id, created_at, key_id, model, status, prompt_tokens,"
    " cached_tokens, completion_tokens, duration_ms, ttft_ms, replica_id, stream, endpoint,"
    " project_id, team_id, org_id, served_model, images, meshes, cost_micros, cache_hit,"
    " guard_rules, guard_action, guard_ms)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    # Only a repeated request id is skipped; any other bad row fails the batch.
    " ON CONFLICT (request_id) DO NOTHING"
)


def _add_rollup(table: str, period: str) -> str:
    return (
        f"INSERT INTO {table} ({period}, key_id, model, project_id, team_id, org_id, requests,"
        " prompt_tokens, cached_tokens, completion_tokens, cost_micros, errors)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        f" ON CONFLICT ({period}, key_id, model, project_id, team_id, org_id) DO UPDATE SET"
        " requests = requests + excluded.requests,"
        " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
        " cached_tokens = cached_tokens + excluded.cached_tokens,"
        " completion_tokens = completion_tokens + excluded.completion_tokens,"
        " cost_micros = cost_micros + excluded.cost_micros,"
        " errors = errors + excluded.errors"
    )


_ADD_HOURLY = _add_rollup("usage_hourly", "hour")
_ADD_DAILY = _add_rollup("usage_daily", "day")
_ADD_MONTHLY = _add_rollup("usage_monthly", "month")

#: A group of the roll-ups without its period: key, model, project, team, org.
_Group = tuple[str, str, str, str, str]


def _usage_pruned_before(conn: sqlite3.Connection) -> float | None:
    row = conn.execute("SELECT pruned_before FROM usage_retention WHERE id = 1").fetchone()
    return None if row is None else float(row[0])


def _insert_usage(conn: sqlite3.Connection, *, rows: list[UsageRow]) -> None:
    # One statement per row, to learn which rows were new (rowcount 1): only
    # those go into the roll-ups, which are then added once per group.
    hourly: dict[tuple[int, _Group], list[int]] = {}
    daily: dict[tuple[int, _Group], list[int]] = {}
    monthly: dict[tuple[int, _Group], list[int]] = {}
    months: dict[int, int] = {}  # day → its month, computed once a batch
    too_old = 0
    with write_transaction(conn):
        horizon = _usage_pruned_before(conn)
        for r in rows:
            if horizon is not None and r.created_at < horizon:
                too_old += 1
                continue
            cursor = conn.execute(
                _INSERT_USAGE,
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
                    r.project_id,
                    r.team_id,
                    r.org_id,
                    r.served_model,
                    r.images,
                    r.meshes,
                    r.cost_micros,
                    int(r.cache_hit),
                    r.guard_rules,
                    r.guard_action,
                    r.guard_ms,
                ),
            )
            if cursor.rowcount != 1:
                continue
            if r.guard_events:
                conn.executemany(_INSERT_GUARD_EVENT, _guard_event_values(r))
            group = (r.key_id, r.served_model or r.model, r.project_id, r.team_id, r.org_id)
            adds = (
                1,
                r.prompt_tokens,
                r.cached_tokens,
                r.completion_tokens,
                r.cost_micros,
                int(r.status >= ERROR_STATUS),
            )
            day = day_of(r.created_at)
            month = months.get(day)
            if month is None:
                month = months[day] = month_of(day)
            for sums in (
                hourly.setdefault((hour_of(r.created_at), group), [0] * 6),
                daily.setdefault((day, group), [0] * 6),
                monthly.setdefault((month, group), [0] * 6),
            ):
                for i, add in enumerate(adds):
                    sums[i] += add
        conn.executemany(_ADD_HOURLY, [(at, *g, *sums) for (at, g), sums in hourly.items()])
        conn.executemany(_ADD_DAILY, [(at, *g, *sums) for (at, g), sums in daily.items()])
        conn.executemany(_ADD_MONTHLY, [(at, *g, *sums) for (at, g), sums in monthly.items()])
    if too_old:
        logger.warning(
            "%d usage row(s) older than the pruning horizon %s not written: they may have "
            "been stored and pruned already, and their sums are in the roll-ups",
            too_old,
            horizon,
        )


def _prune_usage(
    conn: sqlite3.Connection, *, before: float, limit: int, fence: Lease | None
) -> int:
    # Look first without the write lock: most passes find nothing to delete.
    if (
        conn.execute("SELECT 1 FROM usage WHERE created_at < ? LIMIT 1", (before,)).fetchone()
        is None
    ):
        return 0
    with write_transaction(conn):
        _check_fence(conn, fence)
        conn.execute(
            "INSERT INTO usage_retention (id, pruned_before) VALUES (1, ?)"
            " ON CONFLICT (id) DO UPDATE SET"
            " pruned_before = max(pruned_before, excluded.pruned_before)",
            (before,),
        )
        cursor = conn.execute(
            "DELETE FROM usage WHERE rowid IN (SELECT rowid FROM usage WHERE created_at < ?"
            " ORDER BY created_at LIMIT ?)",
            (before, limit),
        )
        conn.execute(
            "DELETE FROM guard_events WHERE id IN (SELECT id FROM guard_events"
            " WHERE created_at < ? ORDER BY created_at LIMIT ?)",
            (before, limit),
        )
        return cursor.rowcount


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


def _sum_usage(
    conn: sqlite3.Connection, *, columns: Sequence[str], since: float, until: float | None
) -> dict[tuple[str, ...], _Sums]:
    """Usage with ``since <= created_at < until`` summed per group of ``columns``
    (names of :data:`_RAW_COLUMNS`); see :func:`_pieces`."""
    with _read_snapshot(conn):
        return _sum_pieces(conn, columns=columns, since=since, until=until)


@contextlib.contextmanager
def _read_snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """Run several reads in one (deferred) transaction: in WAL mode they all
    see the database as it was at the first, whatever other connections
    write or prune meanwhile."""
    if conn.in_transaction:
        yield
        return
    conn.execute("BEGIN")
    try:
        yield
    finally:
        if conn.in_transaction:
            conn.execute("COMMIT")


def _sum_pieces(
    conn: sqlite3.Connection, *, columns: Sequence[str], since: float, until: float | None
) -> dict[tuple[str, ...], _Sums]:
    sums: dict[tuple[str, ...], _Sums] = {}
    width = len(columns)
    for source, lo, hi in _pieces(since, until, _usage_pruned_before(conn)):
        if source == "raw":
            select = ", ".join(_RAW_COLUMNS[c] for c in columns)
            sql = (
                f"SELECT {select}, count(*), sum(prompt_tokens), sum(cached_tokens),"
                f" sum(completion_tokens), sum(cost_micros), sum(status >= {ERROR_STATUS})"
                " FROM usage WHERE created_at >= ? AND created_at < ?"
            )
        else:
            table, period = _ROLLUP_TABLES[source]
            select = ", ".join(columns)
            sql = (
                f"SELECT {select}, sum(requests), sum(prompt_tokens), sum(cached_tokens),"
                " sum(completion_tokens), sum(cost_micros), sum(errors)"
                f" FROM {table} WHERE {period} >= ?"
            )
            if hi is not None:
                sql += f" AND {period} < ?"
        params = (lo,) if hi is None else (lo, hi)
        sql += " GROUP BY " + ", ".join(str(i + 1) for i in range(width))
        for row in conn.execute(sql, params):
            group = tuple(row[:width])
            found = sums.get(group)
            if found is None:
                sums[group] = [int(v) for v in row[width:]]
            else:
                for i, v in enumerate(row[width:]):
                    found[i] += int(v)
    return sums


def _spend_since_by_scope(conn: sqlite3.Connection, *, since: float) -> dict[str, int]:
    columns = ("key_id", "project_id", "team_id", "org_id")
    spend: dict[str, int] = {}
    for group, sums in _sum_usage(conn, columns=columns, since=since, until=None).items():
        for scope, id in zip(("key", "project", "team", "org"), group, strict=True):
            if id:
                counter = f"{scope}:{id}"
                spend[counter] = spend.get(counter, 0) + sums[4]
    return spend


def _usage_summary(
    conn: sqlite3.Connection, *, column: str, since: float, until: float | None
) -> list[UsageSummary]:
    summaries = [
        UsageSummary(
            group=group[0],
            requests=s[0],
            prompt_tokens=s[1],
            cached_tokens=s[2],
            completion_tokens=s[3],
            cost_micros=s[4],
            errors=s[5],
        )
        for group, s in _sum_usage(conn, columns=(column,), since=since, until=until).items()
    ]
    summaries.sort(key=lambda u: (-u.cost_micros, u.group))
    return summaries


def _export_usage(
    conn: sqlite3.Connection,
    *,
    since: float,
    until: float | None,
    after_request_id: str,
    limit: int,
) -> list[UsageRow]:
    where = ["created_at >= :since"]
    params: dict[str, object] = {"since": since, "limit": limit}
    if until is not None:
        where.append("created_at < :until")
        params["until"] = until
    if after_request_id:
        found = _rows(
            conn, "SELECT created_at FROM usage WHERE request_id = ?", (after_request_id,)
        )
        if not found:
            raise ValueError(f"after_request_id {after_request_id!r} names no stored usage row")
        where.append("(created_at, request_id) > (:after_at, :after_id)")
        params["after_at"] = found[0]["created_at"]
        params["after_id"] = after_request_id
    rows = _rows(
        conn,
        f"SELECT * FROM usage WHERE {' AND '.join(where)}"
        " ORDER BY created_at, request_id LIMIT :limit",
        params,
    )
    return [_usage_from_row(r) for r in rows]


# --- the tree ----------------------------------------------------------------


_PATH_SELECT = (
    "SELECT o.id AS o_id, o.name AS o_name, o.limits AS o_limits, o.created_at AS o_created,"
    " t.id AS t_id, t.name AS t_name, t.limits AS t_limits, t.created_at AS t_created,"
    " p.id AS p_id, p.name AS p_name, p.limits AS p_limits, p.created_at AS p_created"
    " FROM projects AS p JOIN teams AS t ON t.id = p.team_id JOIN orgs AS o ON o.id = t.org_id"
)


def _org_from_row(row: sqlite3.Row) -> Org:
    return Org(
        id=row["id"],
        name=row["name"],
        limits=_limits_from_json(row["limits"]),
        created_at=row["created_at"],
    )


def _team_from_row(row: sqlite3.Row) -> Team:
    return Team(
        id=row["id"],
        org_id=row["org_id"],
        name=row["name"],
        limits=_limits_from_json(row["limits"]),
        created_at=row["created_at"],
    )


def _path_from_row(row: sqlite3.Row) -> ProjectPath:
    org = Org(
        id=row["o_id"],
        name=row["o_name"],
        limits=_limits_from_json(row["o_limits"]),
        created_at=row["o_created"],
    )
    team = Team(
        id=row["t_id"],
        org_id=org.id,
        name=row["t_name"],
        limits=_limits_from_json(row["t_limits"]),
        created_at=row["t_created"],
    )
    project = Project(
        id=row["p_id"],
        team_id=team.id,
        name=row["p_name"],
        limits=_limits_from_json(row["p_limits"]),
        created_at=row["p_created"],
    )
    return ProjectPath(org=org, team=team, project=project)


def _ensure_project(
    conn: sqlite3.Connection, *, org: str, team: str, project: str, now: float
) -> tuple[ProjectPath, list[str]]:
    created: list[str] = []
    with write_transaction(conn):
        found = _rows(conn, "SELECT id FROM orgs WHERE name = ?", (org,))
        if found:
            org_id = cast(str, found[0]["id"])
        else:
            org_id = _new_id("org")
            conn.execute(
                "INSERT INTO orgs (id, name, created_at) VALUES (?, ?, ?)", (org_id, org, now)
            )
            created.append(f"org {org}")
        found = _rows(conn, "SELECT id FROM teams WHERE org_id = ? AND name = ?", (org_id, team))
        if found:
            team_id = cast(str, found[0]["id"])
        else:
            team_id = _new_id("team")
            conn.execute(
                "INSERT INTO teams (id, org_id, name, created_at) VALUES (?, ?, ?, ?)",
                (team_id, org_id, team, now),
            )
            created.append(f"team {org}/{team}")
        found = _rows(
            conn, "SELECT id FROM projects WHERE team_id = ? AND name = ?", (team_id, project)
        )
        if found:
            project_id = cast(str, found[0]["id"])
        else:
            project_id = _new_id("proj")
            conn.execute(
                "INSERT INTO projects (id, team_id, name, created_at) VALUES (?, ?, ?, ?)",
                (project_id, team_id, project, now),
            )
            created.append(f"project {org}/{team}/{project}")
        rows = _rows(conn, f"{_PATH_SELECT} WHERE p.id = ?", (project_id,))
    return _path_from_row(rows[0]), created


def _get_project_path(conn: sqlite3.Connection, *, project_id: str) -> ProjectPath | None:
    rows = _rows(conn, f"{_PATH_SELECT} WHERE p.id = ?", (project_id,))
    return _path_from_row(rows[0]) if rows else None


def _find_project(
    conn: sqlite3.Connection, *, org: str, team: str, project: str
) -> ProjectPath | None:
    rows = _rows(
        conn,
        f"{_PATH_SELECT} WHERE o.name = ? AND t.name = ? AND p.name = ?",
        (org, team, project),
    )
    return _path_from_row(rows[0]) if rows else None


def _find_org(conn: sqlite3.Connection, *, name: str) -> Org | None:
    rows = _rows(conn, "SELECT * FROM orgs WHERE name = ?", (name,))
    return _org_from_row(rows[0]) if rows else None


def _find_team(conn: sqlite3.Connection, *, org: str, name: str) -> Team | None:
    rows = _rows(
        conn,
        "SELECT t.* FROM teams AS t JOIN orgs AS o ON o.id = t.org_id"
        " WHERE o.name = ? AND t.name = ?",
        (org, name),
    )
    return _team_from_row(rows[0]) if rows else None


def _list_orgs(conn: sqlite3.Connection) -> list[Org]:
    return [_org_from_row(r) for r in _rows(conn, "SELECT * FROM orgs ORDER BY name")]


def _list_teams(conn: sqlite3.Connection) -> list[Team]:
    rows = _rows(
        conn,
        "SELECT t.* FROM teams AS t JOIN orgs AS o ON o.id = t.org_id ORDER BY o.name, t.name",
    )
    return [_team_from_row(r) for r in rows]


def _list_tree(conn: sqlite3.Connection) -> list[ProjectPath]:
    rows = _rows(conn, f"{_PATH_SELECT} ORDER BY o.name, t.name, p.name")
    return [_path_from_row(r) for r in rows]


def _set_limits(conn: sqlite3.Connection, *, table: str, id: str, text: str) -> bool:
    # ``table`` comes from _LIMITS_TABLES, never from user input.
    with write_transaction(conn):
        cursor = conn.execute(f"UPDATE {table} SET limits = ? WHERE id = ?", (text, id))
    return cursor.rowcount == 1


def _model_from_row(row: sqlite3.Row) -> ModelRecord:
    if row["spec"]:
        return model_from_json(row["spec"])
    return ModelRecord.simple(
        row["name"],
        row["engine"],
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


def _put_model(conn: sqlite3.Connection, *, model: ModelRecord, fence: Lease | None) -> None:
    first = model.profile
    engine = first.engine if first is not None else ("external" if model.external else "")
    with write_transaction(conn):
        _check_fence(conn, fence)
        conn.execute(
            "INSERT INTO models (name, engine, source, replicas, context_tokens, slots,"
            " cpu_cores, args, env, sha256, created_at, spec)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (name) DO UPDATE SET engine = excluded.engine,"
            " source = excluded.source, replicas = excluded.replicas,"
            " context_tokens = excluded.context_tokens, slots = excluded.slots,"
            " cpu_cores = excluded.cpu_cores, args = excluded.args, env = excluded.env,"
            " sha256 = excluded.sha256, created_at = excluded.created_at,"
            " spec = excluded.spec",
            (
                model.name,
                engine,
                model.source,
                model.replicas,
                first.context_tokens if first else 0,
                first.slots if first else 0,
                first.cpu_cores if first else 0,
                json.dumps(list(first.args) if first else []),
                json.dumps(first.env if first else {}, sort_keys=True),
                model.sha256,
                model.created_at,
                model_to_json(model),
            ),
        )


def _get_model(conn: sqlite3.Connection, *, name: str) -> ModelRecord | None:
    rows = _rows(conn, "SELECT * FROM models WHERE name = ?", (name,))
    return _model_from_row(rows[0]) if rows else None


def _list_models(conn: sqlite3.Connection) -> list[ModelRecord]:
    return [_model_from_row(r) for r in _rows(conn, "SELECT * FROM models ORDER BY name")]


def _delete_model(conn: sqlite3.Connection, *, name: str, fence: Lease | None) -> bool:
    with write_transaction(conn):
        _check_fence(conn, fence)
        cursor = conn.execute("DELETE FROM models WHERE name = ?", (name,))
    return cursor.rowcount == 1


def _get_setting(conn: sqlite3.Connection, *, key: str) -> Any | None:
    rows = _rows(conn, "SELECT value FROM settings WHERE key = ?", (key,))
    return json.loads(rows[0]["value"]) if rows else None


def _put_setting(
    conn: sqlite3.Connection, *, key: str, text: str, now: float, fence: Lease | None
) -> None:
    with write_transaction(conn):
        _check_fence(conn, fence)
        conn.execute(
            "INSERT INTO settings (key, value, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value,"
            " updated_at = excluded.updated_at",
            (key, text, now),
        )


def _settings_version(conn: sqlite3.Connection) -> int:
    rows = _rows(conn, "SELECT COALESCE(MAX(version), 0) AS v FROM settings_history")
    return int(rows[0]["v"])


def _get_settings_doc(conn: sqlite3.Connection) -> tuple[int, dict[str, Any]] | None:
    rows = _rows(
        conn, "SELECT version, document FROM settings_history ORDER BY version DESC LIMIT 1"
    )
    if not rows:
        return None
    return int(rows[0]["version"]), dict(json.loads(rows[0]["document"]))


def _put_settings_doc(
    conn: sqlite3.Connection,
    *,
    text: str,
    expected_version: int | None,
    actor: str,
    note: str,
    now: float,
    fence: Lease | None,
) -> int:
    with write_transaction(conn):
        _check_fence(conn, fence)
        current = _settings_version(conn)
        if expected_version is not None and expected_version != current:
            raise Conflict(
                f"the settings changed: version {current} is live, not {expected_version}"
            )
        version = current + 1
        conn.execute(
            "INSERT INTO settings_history (version, document, changed_at, actor, note)"
            " VALUES (?, ?, ?, ?, ?)",
            (version, text, now, actor, note),
        )
    return version


def _settings_history(conn: sqlite3.Connection, *, last: int) -> list[SettingChange]:
    rows = _rows(
        conn,
        "SELECT version, document, changed_at, actor, note FROM settings_history"
        " ORDER BY version DESC LIMIT ?",
        (last,),
    )
    return [
        SettingChange(
            version=int(r["version"]),
            document=dict(json.loads(r["document"])),
            changed_at=float(r["changed_at"]),
            actor=r["actor"],
            note=r["note"],
        )
        for r in rows
    ]


def _check_fence(conn: sqlite3.Connection, fence: Lease | None) -> None:
    """Inside a write transaction (which holds SQLite's write lock, so no
    takeover can land before it commits): refuse the write unless ``fence``
    still holds its lease at its epoch."""
    if fence is None:
        return
    row = conn.execute("SELECT holder, epoch FROM leases WHERE name = ?", (fence.name,)).fetchone()
    if row is None or int(row[1]) != fence.epoch or row[0] != fence.holder:
        raise Fenced.deposed(fence, None if row is None else (str(row[0]), int(row[1])))


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


def _node_certificate_from_row(row: sqlite3.Row) -> NodeCertificate:
    return NodeCertificate(
        serial=row["serial"],
        node_id=row["node_id"],
        issued_at=row["issued_at"],
        not_after=row["not_after"],
        revoked_at=row["revoked_at"],
    )


def _insert_node_certificate(conn: sqlite3.Connection, *, cert: NodeCertificate) -> None:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO node_certificates (serial, node_id, issued_at, not_after, revoked_at)"
            " VALUES (?, ?, ?, ?, ?)",
            (cert.serial.lower(), cert.node_id, cert.issued_at, cert.not_after, cert.revoked_at),
        )


def _select_node_certificates(
    conn: sqlite3.Connection, *, where: str, params: Sequence[object]
) -> list[NodeCertificate]:
    rows = _rows(
        conn,
        "SELECT serial, node_id, issued_at, not_after, revoked_at FROM node_certificates"
        f" WHERE {where} ORDER BY issued_at, serial",
        params,
    )
    return [_node_certificate_from_row(r) for r in rows]


def _revoke_node_certificates(conn: sqlite3.Connection, *, node_id: str, at: float) -> int:
    with write_transaction(conn):
        cursor = conn.execute(
            "UPDATE node_certificates SET revoked_at = ? WHERE node_id = ? AND revoked_at IS NULL",
            (at, node_id),
        )
    return cursor.rowcount


def _join_token_from_row(row: sqlite3.Row) -> JoinToken:
    return JoinToken(
        token_hash=row["token_hash"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        node_id=row["node_id"],
        labels=json.loads(row["labels"]),
        used_at=row["used_at"],
    )


def _insert_join_token(conn: sqlite3.Connection, *, token: JoinToken) -> None:
    with write_transaction(conn):
        conn.execute(
            "INSERT INTO join_tokens (token_hash, created_at, expires_at, node_id, labels, used_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (
                token.token_hash,
                token.created_at,
                token.expires_at,
                token.node_id,
                json.dumps(token.labels, sort_keys=True),
                token.used_at,
            ),
        )


_JOIN_TOKEN_COLUMNS = "token_hash, created_at, expires_at, node_id, labels, used_at"


def _select_join_token(conn: sqlite3.Connection, *, token_hash: str) -> JoinToken | None:
    rows = _rows(
        conn, f"SELECT {_JOIN_TOKEN_COLUMNS} FROM join_tokens WHERE token_hash = ?", (token_hash,)
    )
    return _join_token_from_row(rows[0]) if rows else None


def _use_join_token(conn: sqlite3.Connection, *, token_hash: str, now: float) -> JoinToken:
    with write_transaction(conn):
        rows = _rows(
            conn,
            "UPDATE join_tokens SET used_at = :now"
            " WHERE token_hash = :hash AND used_at IS NULL AND expires_at > :now"
            f" RETURNING {_JOIN_TOKEN_COLUMNS}",
            {"now": now, "hash": token_hash},
        )
        if rows:
            return _join_token_from_row(rows[0])
        found = _rows(
            conn,
            f"SELECT {_JOIN_TOKEN_COLUMNS} FROM join_tokens WHERE token_hash = ?",
            (token_hash,),
        )
    raise join_token_refusal(_join_token_from_row(found[0]) if found else None)


# --- guard events --------------------------------------------------------------------

_INSERT_GUARD_EVENT = (
    "INSERT INTO guard_events (request_id, created_at, key_id, model, direction, rule, action)"
    " VALUES (?, ?, ?, ?, ?, ?, ?)"
)


def _guard_event_values(row: UsageRow) -> list[tuple[object, ...]]:
    return [
        (row.request_id, row.created_at, row.key_id, row.model, direction, rule, action)
        for direction, rule, action in row.guard_events
    ]


def _list_guard_events(
    conn: sqlite3.Connection,
    *,
    last: int,
    request_id: str | None,
    rule: str | None,
    since: float | None,
) -> list[GuardEvent]:
    where: list[str] = []
    params: list[object] = []
    for column, value in (("request_id", request_id), ("rule", rule)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if since is not None:
        where.append("created_at >= ?")
        params.append(since)
    sql = (
        "SELECT request_id, created_at, key_id, model, direction, rule, action FROM guard_events"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + " ORDER BY created_at DESC, id DESC LIMIT ?"
    )
    return [GuardEvent(**dict(r)) for r in _rows(conn, sql, (*params, last))]

"""The PostgreSQL backend: :class:`PostgresStore` and :func:`open_postgres_store`.

A small pool of psycopg 3 connections (``psycopg_pool.ConnectionPool``, the
synchronous one: psycopg's async API needs asyncio, llmgw runs on trio).
Every store call is one blocking function run by ``trio.to_thread.run_sync``
under the store's own ``trio.CapacityLimiter`` (as many as the pool holds),
taking a connection from the pool for that call only. Connections are in
autocommit; each write is one explicit transaction.

Every connection is made with (unless the address sets them itself):

- ``connect_timeout`` = :data:`CONNECT_TIMEOUT_S` for *each* host of a
  multi-host address, so a dead member costs 3 s before the next is tried;
- TCP keepalives and ``tcp_user_timeout`` (:data:`TCP_USER_TIMEOUT_MS`), so a
  connection to a member that vanished fails in seconds, not in the kernel's
  quarter of an hour of retries;
- ``target_session_attrs=read-write`` when the address names more than one
  host, so the store always lands on the primary;
- ``statement_timeout`` (:data:`STATEMENT_TIMEOUT_S`) and ``lock_timeout``
  (:data:`LOCK_TIMEOUT_S`), so a call blocked by a lock held elsewhere fails
  with :class:`~llmgw.store.StoreError` instead of hanging (the usage writer
  keeps its batch and tries again later).

The pool checks a connection before handing it out, so one broken by a
failover is replaced rather than failing the next call.

A store found unreachable fails fast: a call waiting for a connection
gives up as soon as the pool's attempts to make one fail (rather than
after :data:`POOL_WAIT_S`, which stays the wait while every connection is
merely busy), and for :data:`UNREACHABLE_HOLD_S` after such a failure (or
a connection that broke) every call raises :class:`~llmgw.store.StoreError`
at once, checked when it gets its worker thread, but one at a time, which
tries (waiting at most :data:`PROBE_WAIT_S`). So while PostgreSQL is down
the callers that can do without it (a key already seen, the usage journal)
do so at once instead of queueing behind 10 s waits (``docs/ha.md``, the
store down).

Migrations: numbered ``NNNN_what.sql`` files in ``migrations/postgres/``,
applied at open, each in its own transaction with its ``schema_migrations``
row, under a transaction-scoped advisory lock, so two control planes
starting together never migrate at once (the lock cannot outlive its
transaction). No copy is taken first: back the database up with the
database's own tools (``docs/store.md``).

Usage and its roll-ups work as on SQLite (``docs/up.md``, Usage kept): a
batch is one ``INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING
RETURNING`` (one round trip, exactly once by request id) and one upsert per
roll-up level. A usage write locks the pruning horizon's row ``FOR SHARE``
and a prune updates it, so a row being pruned can never be stored again
(and counted twice) by a retried batch.

Cancellation: a call that is running in its thread is waited for (trio's
``abandon_on_cancel=False``), so a write is never left half done.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from functools import partial
from importlib.resources.abc import Traversable
from typing import Any, Final, TypeVar, final

import psycopg
import psycopg.errors
import psycopg_pool
import trio
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import DictRow, dict_row

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
from ._sqlite_schema import Migration, load_migrations
from .interface import Conflict, Fenced, StoreError
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

__all__ = [
    "CONNECT_TIMEOUT_S",
    "LOCK_TIMEOUT_S",
    "STATEMENT_TIMEOUT_S",
    "TCP_USER_TIMEOUT_MS",
    "PostgresStore",
    "apply_postgres_migrations",
    "describe_address",
    "is_postgres_address",
    "open_postgres_store",
    "postgres_conninfo",
]

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S: Final = 3
"""How long connecting to one host may take, in whole seconds (libpq's
``connect_timeout``, applied to each host of a multi-host address)."""
STATEMENT_TIMEOUT_S: Final = 10.0
"""The longest one statement may run (``statement_timeout``)."""
LOCK_TIMEOUT_S: Final = 5.0
"""The longest one statement may wait for a lock (``lock_timeout``): a write
blocked by a lock held elsewhere fails after about this long."""
KEEPALIVES_IDLE_S: Final = 5
KEEPALIVES_INTERVAL_S: Final = 2
KEEPALIVES_COUNT: Final = 3
TCP_USER_TIMEOUT_MS: Final = 10_000
"""How long sent data may stay unacknowledged before the kernel drops the
connection (``tcp_user_timeout``)."""
POOL_SIZE: Final = 4
"""Connections kept per store, and so calls running at once."""
POOL_WAIT_S: Final = 10.0
"""How long a call waits for a pooled connection (all busy, or none can be
made) before it fails."""
OPEN_WAIT_S: Final = 30.0
UNREACHABLE_HOLD_S: Final = 2.0
"""After a call found the store unreachable, how long other calls fail at
once (one at a time still tries), in seconds; renewed by each failure."""
PROBE_WAIT_S: Final = 3.0
"""How long the one call that tries an unreachable store waits for a
connection, in seconds."""
WAIT_SLICE_S: Final = 0.25
"""A call waiting for a connection looks this often whether the pool's
attempts to make one fail, in seconds."""
"""How long opening waits for the pool's first connection."""
MIGRATION_LOCK_TIMEOUT_S: Final = 60.0
"""How long a migration waits for another control plane's migration or for
locks on the tables it changes."""
RETRIES: Final = 4
"""Tries per call after a serialization failure or a deadlock."""

#: The advisory lock taken by migrations, for their transaction only.
_MIGRATION_LOCK_KEY: Final = 0x6C6C_6D67_7700_0001
_POSTGRES_SCHEMES: Final = ("postgresql://", "postgres://")
_SQLALCHEMY_SCHEME: Final = "postgresql+psycopg://"

_T = TypeVar("_T")
_Conn = psycopg.Connection[DictRow]


def is_postgres_address(address: str) -> bool:
    """Whether ``address`` names a PostgreSQL store: a ``postgresql://`` or
    ``postgres://`` URI (``postgresql+psycopg://`` too), or a libpq
    ``key=value`` DSN with ``host=`` or ``dbname=``."""
    text = address.strip()
    if text.lower().startswith((*_POSTGRES_SCHEMES, _SQLALCHEMY_SCHEME)):
        return True
    if "://" in text or "=" not in text:
        return False
    try:
        params = conninfo_to_dict(text)
    except psycopg.ProgrammingError:
        return False
    return "host" in params or "dbname" in params


def postgres_conninfo(address: str) -> str:
    """The libpq connection string llmgw connects with, from a store address.

    ``address`` is a libpq URI (``postgresql://user@a:5432,b:5432/llmgw``) or
    ``key=value`` DSN (``host=a,b,c dbname=llmgw
    target_session_attrs=read-write``). The connect timeout, keepalives,
    ``tcp_user_timeout``, the statement and lock timeouts and
    ``application_name`` are added unless the address sets them;
    ``target_session_attrs=read-write`` too when it names more than one host.

    Raises:
        ValueError: ``address`` is not a connection string libpq reads.
    """
    text = address.strip()
    for scheme in (_SQLALCHEMY_SCHEME, *_POSTGRES_SCHEMES):
        if text.lower().startswith(scheme):
            text = "postgresql://" + text[len(scheme) :]
            break
    try:
        params: dict[str, Any] = conninfo_to_dict(text)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"store address is not a PostgreSQL connection string: {exc}") from exc
    defaults: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1,
        "keepalives_idle": KEEPALIVES_IDLE_S,
        "keepalives_interval": KEEPALIVES_INTERVAL_S,
        "keepalives_count": KEEPALIVES_COUNT,
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
        "application_name": "llmgw",
    }
    if "," in str(params.get("host", "")) or "," in str(params.get("hostaddr", "")):
        defaults["target_session_attrs"] = "read-write"
    for name, value in defaults.items():
        params.setdefault(name, value)
    options = str(params.get("options", ""))
    for setting, value_ms in (
        ("statement_timeout", int(STATEMENT_TIMEOUT_S * 1000)),
        ("lock_timeout", int(LOCK_TIMEOUT_S * 1000)),
    ):
        if setting not in options:
            options = f"{options} -c {setting}={value_ms}".strip()
    params["options"] = options
    return make_conninfo("", **params)


def describe_address(conninfo: str) -> str:
    """The address for messages: hosts, ports and database, never a password."""
    params = conninfo_to_dict(conninfo)
    hosts = str(params.get("host") or params.get("hostaddr") or "localhost")
    ports = str(params.get("port") or "5432")
    host_list = hosts.split(",")
    port_list = ports.split(",")
    if len(port_list) == 1:
        port_list = port_list * len(host_list)
    members = ",".join(f"{h}:{p}" for h, p in zip(host_list, port_list, strict=False))
    return f"postgresql://{members}/{params.get('dbname') or params.get('user') or ''}"


@final
class PostgresStore(_people.PeopleMethods):
    """The :class:`~llmgw.store.Store` on a PostgreSQL database.

    Get one from :func:`open_postgres_store` (or :func:`llmgw.store.open_store`),
    which connects, applies migrations and closes the pool at exit; the
    constructor only wraps an open pool.

    Every method may raise :class:`~llmgw.store.StoreError` when PostgreSQL
    fails or cannot be reached, including after the store was closed.
    """

    def __init__(
        self,
        pool: psycopg_pool.ConnectionPool[_Conn],
        where: str,
        limiter: trio.CapacityLimiter,
    ) -> None:
        """Wrap an open pool of autocommit connections with ``dict_row`` rows.

        Args:
            pool: the pool; the store owns it from now on and closes it.
            where: the address without a password, for messages.
            limiter: the limiter every call goes through (as many tokens as
                the pool has connections).
        """
        self._pool = pool
        self._where = where
        self._limiter = limiter
        self._closed = False
        #: time.monotonic() until which the store counts unreachable.
        self._down_until = 0.0
        self._down_why = ""
        self._probing = False
        self._state_lock = threading.Lock()

    @property
    def where(self) -> str:
        """The store's address, without a password."""
        return self._where

    async def aclose(self) -> None:
        """Close the pool once running calls have finished. Closing twice is
        harmless; calls made afterwards raise :class:`~llmgw.store.StoreError`."""
        if self._closed:
            return
        self._closed = True
        await trio.to_thread.run_sync(partial(self._pool.close, timeout=POOL_WAIT_S))

    async def _run(self, fn: Callable[[_Conn], _T]) -> _T:
        """Run ``fn(conn)`` on a pooled connection in a worker thread; retry
        serialization failures and deadlocks; translate errors. Fails at
        once while the store counts unreachable, unless it is the one call
        that tries (the module docstring)."""

        def guarded() -> _T:
            # In the worker thread: a call queued for a thread while the
            # store went down fails here at once.
            if self._closed:
                raise StoreError(f"the PostgreSQL store {self._where} is closed")
            with self._state_lock:
                probe = time.monotonic() < self._down_until
                if probe and self._probing:
                    raise StoreError(
                        f"PostgreSQL store {self._where} unreachable ({self._down_why}); "
                        "not tried again yet"
                    )
                self._probing = self._probing or probe
            try:
                conn = self._connection(PROBE_WAIT_S if probe else POOL_WAIT_S)
                try:
                    with conn:
                        result = fn(conn)
                finally:
                    self._pool.putconn(conn)
            except psycopg.OperationalError as exc:
                if _unreachable(exc):
                    with self._state_lock:
                        self._down_until = time.monotonic() + UNREACHABLE_HOLD_S
                        self._down_why = str(exc).strip().splitlines()[0][:200]
                raise
            else:
                self._down_until = 0.0
                return result
            finally:
                if probe:
                    self._probing = False

        return await _call(guarded, self._limiter, self._where)

    def _connection(self, wait_s: float) -> _Conn:
        """A pooled connection within ``wait_s`` (in a worker thread).

        Raises:
            psycopg_pool.PoolTimeout: none within ``wait_s``.
            psycopg.OperationalError: the pool's attempts to make one failed
                meanwhile (the store cannot be reached).
        """
        deadline = time.monotonic() + wait_s
        failed = self._pool.get_stats().get("connections_errors", 0)
        while True:
            left_s = deadline - time.monotonic()
            try:
                return self._pool.getconn(timeout=max(0.01, min(WAIT_SLICE_S, left_s)))
            except psycopg_pool.PoolTimeout:
                if time.monotonic() >= deadline:
                    raise
                if self._pool.get_stats().get("connections_errors", 0) > failed:
                    raise psycopg.OperationalError(
                        "no connection can be made (the pool's attempts failed)"
                    ) from None

    # --- secrets -------------------------------------------------------------
    async def get_or_create_secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The secret named ``name``; made with ``make()`` and kept on first need.

        ``make`` is called only when the secret is missing; if another caller
        stores one first, theirs is returned, so every caller gets the same bytes.
        """
        found = await self._run(partial(_read_secret, name=name))
        if found is not None:
            return found
        return await self._run(partial(_keep_secret, name=name, value=bytes(make())))

    # --- keys ----------------------------------------------------------------
    async def insert_key(self, key: KeyRecord) -> None:
        """Keep a new key. Raises :class:`~llmgw.store.Conflict` if its id or hash exists."""
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
        """Mark a key revoked at ``at`` (the first revocation time stays);
        ``False`` when there is no such key."""
        return await self._run(partial(_revoke_key, key_id=key_id, at=at))

    async def update_key(self, key: KeyRecord) -> bool:
        """Replace the key with ``key.id``; see :meth:`llmgw.store.Store.update_key`."""
        return await self._run(partial(_update_key, key=key))

    async def mark_keys_used(self, used: Mapping[str, float]) -> None:
        """Record last uses (key id → UTC epoch s) in one statement; earlier
        times and unknown ids are ignored."""
        if not used:
            return
        await self._run(partial(_mark_keys_used, used=dict(used)))

    # --- tenancy tree --------------------------------------------------------
    async def ensure_project(
        self, org: str, team: str, project: str, now: float
    ) -> tuple[ProjectPath, list[str]]:
        """Make ``org/team/project`` exist; see :meth:`llmgw.store.Store.ensure_project`.

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
        """Every project with its path, by org, team and project name."""
        return await self._run(_list_tree)

    async def set_limits(self, scope: Scope, id: str, limits: Limits) -> bool:
        """Replace the limits of the org, team, project or key with this id;
        ``False`` when there is none.

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
        """Write a batch of usage rows in one transaction (all or none), each
        request id once, with the roll-ups; see :meth:`llmgw.store.Store.insert_usage`."""
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
        """Summed ``cost_micros`` since ``since`` per counter; see
        :meth:`llmgw.store.Store.spend_since_by_scope`."""
        return await self._run(partial(_spend_since_by_scope, since=since))

    async def usage_summary(
        self, by: SummaryBy, since: float, until: float | None = None
    ) -> list[UsageSummary]:
        """Usage per group from the roll-ups, in one read-only snapshot; see
        :meth:`llmgw.store.Store.usage_summary`.

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
        """Delete at most ``limit`` raw rows older than ``before`` (floored to
        its hour); see :meth:`llmgw.store.Store.prune_usage`.

        Raises:
            ValueError: ``limit`` is less than 1.
            Fenced: ``fence`` is no longer the lease's epoch.
        """
        if limit < 1:
            raise ValueError(f"limit must be 1 or more, not {limit}")
        return await self._run(
            partial(_prune_usage, before=float(hour_of(before)), limit=limit, fence=fence)
        )

    async def usage_pruned_before(self) -> float | None:
        """The pruning horizon, or ``None`` when no raw row was ever pruned."""
        return await self._run(_usage_pruned_before)

    async def export_usage(
        self,
        since: float,
        until: float | None,
        *,
        after_request_id: str = "",
        limit: int = 1000,
    ) -> list[UsageRow]:
        """One page of rows by ``(created_at, request_id)``; see
        :meth:`llmgw.store.Store.export_usage`.

        Raises:
            ValueError: ``limit`` is negative, or ``after_request_id`` names
                no stored row.
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
            TypeError: ``value`` is not JSON.
            ValueError: ``value`` holds NaN or infinity.
            Fenced: ``fence`` is no longer the lease's epoch.
        """
        text = json.dumps(value, allow_nan=False, separators=(",", ":"))
        await self._run(partial(_put_setting, key=key, text=text, now=time.time(), fence=fence))

    async def get_settings_doc(self) -> tuple[int, dict[str, Any]] | None:
        """The live settings document and its version, or ``None``."""
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
        """Keep ``doc`` as the next version; see :meth:`llmgw.store.Store.put_settings_doc`.

        Raises:
            Conflict: ``expected_version`` is not the live version.
            TypeError, ValueError: ``doc`` is not JSON.
            Fenced: ``fence`` is no longer the lease's epoch.
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
        """Take or renew the lease ``name``; see :meth:`llmgw.store.Store.acquire_lease`.

        Raises:
            ValueError: ``ttl_s`` is not positive.
        """
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, not {ttl_s}")
        return await self._run(
            partial(_acquire_lease, name=name, holder=holder, expires_at=now + ttl_s, now=now)
        )

    async def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up now if ``holder`` has it; the row stays, expired."""
        await self._run(partial(_release_lease, name=name, holder=holder))

    # --- node identity -------------------------------------------------------
    async def insert_node_certificate(self, cert: NodeCertificate) -> None:
        """Keep a certificate just issued. Raises :class:`~llmgw.store.Conflict`
        if its serial exists."""
        await self._run(partial(_insert_node_certificate, cert=cert))

    async def get_node_certificate(self, serial: str) -> NodeCertificate | None:
        """The certificate with this serial (lower-case hex), or ``None``."""
        rows = await self._run(
            partial(_select_node_certificates, where="serial = %s", params=(serial.lower(),))
        )
        return rows[0] if rows else None

    async def list_node_certificates(self, node_id: str | None = None) -> list[NodeCertificate]:
        """The certificates issued (to ``node_id`` when given), oldest first."""
        if node_id is None:
            return await self._run(partial(_select_node_certificates, where="true", params=()))
        return await self._run(
            partial(_select_node_certificates, where="node_id = %s", params=(node_id,))
        )

    async def revoke_node_certificates(self, node_id: str, at: float) -> int:
        """Revoke every valid certificate of ``node_id`` at ``at``; how many now."""
        return await self._run(partial(_revoke_node_certificates, node_id=node_id, at=at))

    async def insert_join_token(self, token: JoinToken) -> None:
        """Keep a join code's token. Raises :class:`~llmgw.store.Conflict` if
        the hash exists."""
        await self._run(partial(_insert_join_token, token=token))

    async def get_join_token(self, token_hash: str) -> JoinToken | None:
        """The token with this hash, used or not, or ``None``."""
        return await self._run(partial(_select_join_token, token_hash=token_hash))

    async def use_join_token(self, token_hash: str, now: float) -> JoinToken:
        """Use the token once; see :meth:`llmgw.store.Store.use_join_token`."""
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
        return await self._run(lambda conn: fn(_people.PgSql(conn), **kwargs))

    async def keys_last_used(self) -> dict[str, float]:
        """Each used key's last use; see :meth:`llmgw.store.Store.keys_last_used`."""
        return await self._run(
            lambda conn: _newest_uses(
                [
                    (r["id"], r["last_used_at"], r["newest"])
                    for r in conn.execute(_KEYS_LAST_USED_SQL)
                ]
            )
        )


@contextlib.asynccontextmanager
async def open_postgres_store(
    address: str, *, migrations_dir: Traversable | None = None
) -> AsyncIterator[PostgresStore]:
    """Open the PostgreSQL store at ``address``; close its pool at exit.

    Connects once (trying every host of a multi-host address, each within
    :data:`CONNECT_TIMEOUT_S`), applies pending migrations, then opens the
    pool.

    Args:
        address: a libpq URI or ``key=value`` DSN (:func:`postgres_conninfo`).
        migrations_dir: where the ``NNNN_what.sql`` files are; the ones
            shipped in the package when ``None`` (a seam for tests).

    Yields:
        The open store.

    Raises:
        ValueError: ``address`` is not a connection string.
        StoreError: no host can be reached, a migration failed, or the
            database was written by a newer llmgw.
    """
    conninfo = postgres_conninfo(address)
    where = describe_address(conninfo)
    directory = _packaged_migrations_dir() if migrations_dir is None else migrations_dir
    limiter = trio.CapacityLimiter(POOL_SIZE)
    await _call(partial(_migrate, conninfo, where, directory), limiter, where)
    pool: psycopg_pool.ConnectionPool[_Conn] = psycopg_pool.ConnectionPool(
        conninfo,
        connection_class=psycopg.Connection[DictRow],
        kwargs={"autocommit": True, "row_factory": dict_row},
        min_size=1,
        max_size=POOL_SIZE,
        open=False,
        timeout=POOL_WAIT_S,
        check=psycopg_pool.ConnectionPool.check_connection,
        name="llmgw-store",
    )
    try:
        await _call(partial(pool.open, wait=True, timeout=OPEN_WAIT_S), limiter, where)
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(pool.close)
        raise
    store = PostgresStore(pool, where, limiter)
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


# --- running calls -----------------------------------------------------------


async def _call(fn: Callable[[], _T], limiter: trio.CapacityLimiter, where: str) -> _T:
    """Run ``fn`` in a worker thread; retry serialization failures and
    deadlocks a few times; turn database errors into store errors."""
    delay_s = 0.05
    attempt = 1
    while True:
        try:
            return await trio.to_thread.run_sync(fn, limiter=limiter)
        except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected) as exc:
            if attempt >= RETRIES:
                raise StoreError(f"PostgreSQL store {where}: {exc}") from exc
            await trio.sleep(delay_s * random.uniform(0.5, 1.5))
            delay_s *= 2
            attempt += 1
        except psycopg.errors.UniqueViolation as exc:
            # The primary message names the constraint, not the values (a
            # key's hash stays out of messages).
            raise Conflict(exc.diag.message_primary or "a unique value is already taken") from exc
        except psycopg.errors.LockNotAvailable as exc:
            raise StoreError(
                f"PostgreSQL store {where}: waited {LOCK_TIMEOUT_S:g} s for a lock another "
                f"session holds ({str(exc).strip()})"
            ) from exc
        except psycopg.errors.QueryCanceled as exc:
            raise StoreError(
                f"PostgreSQL store {where}: a statement ran past its timeout ({str(exc).strip()})"
            ) from exc
        except psycopg_pool.PoolTimeout as exc:
            raise StoreError(
                f"PostgreSQL store {where}: no connection within {POOL_WAIT_S:g} s "
                f"(every host down, or every connection busy): {exc}"
            ) from exc
        except psycopg.Error as exc:
            raise StoreError(f"PostgreSQL store {where}: {str(exc).strip()}") from exc


def _unreachable(exc: psycopg.OperationalError) -> bool:
    """``exc`` says no connection could be made, or one broke: not a
    statement's or a lock's timeout, nor a pool whose connections were all
    busy for the whole wait (:class:`psycopg_pool.PoolTimeout`)."""
    return not isinstance(
        exc,
        psycopg_pool.PoolTimeout | psycopg.errors.QueryCanceled | psycopg.errors.LockNotAvailable,
    )


def _packaged_migrations_dir() -> Traversable:
    return importlib.resources.files("llmgw.store").joinpath("migrations", "postgres")


def _migrate(conninfo: str, where: str, directory: Traversable) -> list[int]:
    """Connect once and apply the pending migrations; the versions applied."""
    migrations = load_migrations(directory)
    try:
        conn = psycopg.connect(conninfo, autocommit=True, row_factory=dict_row)
    except psycopg.OperationalError as exc:
        raise StoreError(
            f"cannot connect to the PostgreSQL store {where}: {str(exc).strip()}"
        ) from exc
    with conn:
        return apply_postgres_migrations(conn, where, migrations)


def apply_postgres_migrations(conn: _Conn, where: str, migrations: list[Migration]) -> list[int]:
    """Apply the pending ``migrations``, each in its own transaction with its
    ``schema_migrations`` row, under the migration lock; skipped when another
    process applied it meanwhile.

    Raises:
        StoreError: the database records a version this code does not know,
            or a migration failed (it is rolled back and stays pending).
    """
    known = {m.version for m in migrations}
    done: list[int] = []
    for migration in [*migrations, None]:
        with conn.transaction():
            conn.execute("SET LOCAL statement_timeout = 0")
            conn.execute(f"SET LOCAL lock_timeout = {int(MIGRATION_LOCK_TIMEOUT_S * 1000)}")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_KEY,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
                " name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
            )
            applied = {
                int(r["version"]) for r in conn.execute("SELECT version FROM schema_migrations")
            }
            unknown = applied - known
            if unknown:
                raise StoreError(
                    f"{where} has schema version(s) {sorted(unknown)} that this llmgw does not "
                    "know; it was written by a newer llmgw: upgrade llmgw, or restore a backup"
                )
            if migration is None or migration.version in applied:
                continue
            try:
                conn.execute(migration.sql.encode())
            except psycopg.Error as exc:
                raise StoreError(
                    f"migration {migration.name} failed on {where}: {str(exc).strip()}"
                ) from exc
            conn.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (%s, %s, %s)",
                (migration.version, migration.name, time.time()),
            )
        done.append(migration.version)
        logger.info("applied migration %s to %s", migration.name, where)
    return done


# --- fencing -----------------------------------------------------------------


def _check_fence(conn: _Conn, fence: Lease | None) -> None:
    """Inside a write transaction: refuse the write unless ``fence`` still
    holds its lease at its epoch. The lease's row is locked ``FOR SHARE``
    until the write commits, so a takeover waits for it (and a write after
    the takeover sees the new epoch)."""
    if fence is None:
        return
    row = conn.execute(
        "SELECT holder, epoch FROM leases WHERE name = %s FOR SHARE", (fence.name,)
    ).fetchone()
    if row is None or int(row["epoch"]) != fence.epoch or row["holder"] != fence.holder:
        raise Fenced.deposed(
            fence, None if row is None else (str(row["holder"]), int(row["epoch"]))
        )


# --- the queries (each runs in a worker thread) ------------------------------


def _read_secret(conn: _Conn, *, name: str) -> bytes | None:
    row = conn.execute("SELECT value FROM secrets WHERE name = %s", (name,)).fetchone()
    return None if row is None else bytes(row["value"])


def _keep_secret(conn: _Conn, *, name: str, value: bytes) -> bytes:
    with conn.transaction():
        conn.execute(
            "INSERT INTO secrets (name, value, created_at) VALUES (%s, %s, %s)"
            " ON CONFLICT (name) DO NOTHING",
            (name, value, time.time()),
        )
        row = conn.execute("SELECT value FROM secrets WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return bytes(row["value"])


def _key_from_row(row: DictRow) -> KeyRecord:
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
        "is_admin": key.is_admin,
        "revoked_at": key.revoked_at,
        "expires_at": key.expires_at,
        "project_id": key.project_id,
        "band": key.band,
        "limits": _limits_to_json(key.limits),
        "last_used_at": key.last_used_at,
        "owner": key.owner,
    }


_KEY_COLUMNS = (
    "id, name, key_hash, prefix, created_at, is_admin, revoked_at, expires_at, project_id,"
    " band, limits, last_used_at, owner"
)


def _insert_key(conn: _Conn, *, key: KeyRecord) -> None:
    with conn.transaction():
        conn.execute(
            f"INSERT INTO keys ({_KEY_COLUMNS}) VALUES (%(id)s, %(name)s, %(key_hash)s,"
            " %(prefix)s, %(created_at)s, %(is_admin)s, %(revoked_at)s, %(expires_at)s,"
            " %(project_id)s, %(band)s, %(limits)s, %(last_used_at)s, %(owner)s)",
            _key_params(key),
        )


def _update_key(conn: _Conn, *, key: KeyRecord) -> bool:
    with conn.transaction():
        cursor = conn.execute(
            "UPDATE keys SET name = %(name)s, key_hash = %(key_hash)s, prefix = %(prefix)s,"
            " created_at = %(created_at)s, is_admin = %(is_admin)s,"
            " revoked_at = coalesce(revoked_at, %(revoked_at)s::float8),"
            " expires_at = %(expires_at)s, project_id = %(project_id)s, band = %(band)s,"
            " limits = %(limits)s, owner = %(owner)s,"
            # greatest() skips NULLs: the later time, or the one there is.
            " last_used_at = greatest(last_used_at, %(last_used_at)s::float8)"
            " WHERE id = %(id)s",
            _key_params(key),
        )
    return cursor.rowcount == 1


def _mark_keys_used(conn: _Conn, *, used: dict[str, float]) -> None:
    ids = sorted(used)
    with conn.transaction():
        conn.execute(
            "UPDATE keys AS k SET last_used_at = greatest(k.last_used_at, u.at)"
            " FROM unnest(%s::text[], %s::float8[]) AS u (id, at) WHERE k.id = u.id",
            (ids, [used[i] for i in ids]),
        )


def _select_key(conn: _Conn, *, column: str, value: str) -> KeyRecord | None:
    # ``column`` is one of two names fixed in this module, never user input.
    row = conn.execute(f"SELECT {_KEY_COLUMNS} FROM keys WHERE {column} = %s", (value,)).fetchone()
    return None if row is None else _key_from_row(row)


def _list_keys(conn: _Conn) -> list[KeyRecord]:
    rows = conn.execute(f"SELECT {_KEY_COLUMNS} FROM keys ORDER BY created_at, seq").fetchall()
    return [_key_from_row(r) for r in rows]


def _revoke_key(conn: _Conn, *, key_id: str, at: float) -> bool:
    with conn.transaction():
        cursor = conn.execute(
            "UPDATE keys SET revoked_at = coalesce(revoked_at, %s) WHERE id = %s", (at, key_id)
        )
    return cursor.rowcount == 1


# --- usage -------------------------------------------------------------------

_USAGE_COLUMNS = (
    "request_id, created_at, key_id, model, status, prompt_tokens, cached_tokens,"
    " completion_tokens, duration_ms, ttft_ms, replica_id, stream, endpoint, project_id,"
    " team_id, org_id, served_model, images, meshes, cost_micros, cache_hit, guard_rules,"
    " guard_action, guard_ms"
)
_USAGE_TYPES = [
    "text",
    "float8",
    "text",
    "text",
    "int4",
    "int8",
    "int8",
    "int8",
    "float8",
    "float8",
    "text",
    "bool",
    "text",
    "text",
    "text",
    "text",
    "text",
    "int8",
    "int8",
    "int8",
    "bool",
    "text",
    "text",
    "float8",
]

_INSERT_USAGE = (
    f"INSERT INTO usage ({_USAGE_COLUMNS}) SELECT * FROM unnest("
    + ", ".join(f"%s::{t}[]" for t in _USAGE_TYPES)
    # Only a repeated request id is skipped; any other bad row fails the batch.
    + ") ON CONFLICT (request_id) DO NOTHING RETURNING request_id"
)


def _usage_from_row(row: DictRow) -> UsageRow:
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


def _add_rollup(table: str, period: str) -> str:
    return (
        f"INSERT INTO {table} AS r ({period}, key_id, model, project_id, team_id, org_id,"
        " requests, prompt_tokens, cached_tokens, completion_tokens, cost_micros, errors)"
        " SELECT * FROM unnest(%s::int8[], %s::text[], %s::text[], %s::text[], %s::text[],"
        " %s::text[], %s::int8[], %s::int8[], %s::int8[], %s::int8[], %s::int8[], %s::int8[])"
        f" ON CONFLICT ({period}, key_id, model, project_id, team_id, org_id) DO UPDATE SET"
        " requests = r.requests + excluded.requests,"
        " prompt_tokens = r.prompt_tokens + excluded.prompt_tokens,"
        " cached_tokens = r.cached_tokens + excluded.cached_tokens,"
        " completion_tokens = r.completion_tokens + excluded.completion_tokens,"
        " cost_micros = r.cost_micros + excluded.cost_micros,"
        " errors = r.errors + excluded.errors"
    )


_ADD_ROLLUPS = (
    _add_rollup("usage_hourly", "hour"),
    _add_rollup("usage_daily", "day"),
    _add_rollup("usage_monthly", "month"),
)

#: A group of the roll-ups without its period: key, model, project, team, org.
_Group = tuple[str, str, str, str, str]


def _columns(items: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows turned into ``width`` column lists, for ``unnest``."""
    return [[item[i] for item in items] for i in range(width)]


def _usage_pruned_before(conn: _Conn) -> float | None:
    row = conn.execute("SELECT pruned_before FROM usage_retention WHERE id = 1").fetchone()
    return None if row is None or row["pruned_before"] is None else float(row["pruned_before"])


def _store_usage(conn: _Conn, batch: list[UsageRow]) -> None:
    """Inside the batch's transaction: insert the rows not stored yet and
    add those into the roll-ups."""
    values = [
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
            r.stream,
            r.endpoint,
            r.project_id,
            r.team_id,
            r.org_id,
            r.served_model,
            r.images,
            r.meshes,
            r.cost_micros,
            r.cache_hit,
            r.guard_rules,
            r.guard_action,
            r.guard_ms,
        )
        for r in batch
    ]
    new = {
        row["request_id"]
        for row in conn.execute(_INSERT_USAGE, _columns(values, len(_USAGE_TYPES))).fetchall()
    }
    events = [e for r in batch if r.request_id in new for e in _guard_event_values(r)]
    if events:
        with conn.cursor() as cursor:
            cursor.executemany(_INSERT_GUARD_EVENT, events)
    levels: tuple[dict[tuple[int, _Group], list[int]], ...] = ({}, {}, {})
    months: dict[int, int] = {}
    for r in batch:
        if r.request_id not in new:
            continue
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
        for sums_of, period in zip(levels, (hour_of(r.created_at), day, month), strict=True):
            sums = sums_of.setdefault((period, group), [0] * 6)
            for i, add in enumerate(adds):
                sums[i] += add
    for sql, sums_of in zip(_ADD_ROLLUPS, levels, strict=True):
        if not sums_of:
            continue
        # Sorted, so two writers lock the roll-up rows in one order.
        items = [(at, *g, *sums) for (at, g), sums in sorted(sums_of.items())]
        conn.execute(sql, _columns(items, 12))


def _insert_usage(conn: _Conn, *, rows: list[UsageRow]) -> None:
    unique: dict[str, UsageRow] = {}
    for r in rows:
        unique.setdefault(r.request_id, r)
    with conn.transaction():
        # FOR SHARE: a prune (which updates this row) waits for this batch,
        # or this batch for the prune and then sees its horizon.
        found = conn.execute(
            "SELECT pruned_before FROM usage_retention WHERE id = 1 FOR SHARE"
        ).fetchone()
        horizon = None if found is None else found["pruned_before"]
        batch = [r for r in unique.values() if horizon is None or r.created_at >= horizon]
        too_old = len(unique) - len(batch)
        if batch:
            _store_usage(conn, batch)
    if too_old:
        logger.warning(
            "%d usage row(s) older than the pruning horizon %s not written: they may have "
            "been stored and pruned already, and their sums are in the roll-ups",
            too_old,
            horizon,
        )


def _prune_usage(conn: _Conn, *, before: float, limit: int, fence: Lease | None) -> int:
    # Look first without writing: most passes find nothing to delete.
    if (
        conn.execute("SELECT 1 FROM usage WHERE created_at < %s LIMIT 1", (before,)).fetchone()
        is None
    ):
        return 0
    with conn.transaction():
        _check_fence(conn, fence)
        conn.execute(
            "UPDATE usage_retention SET pruned_before = greatest(pruned_before, %s) WHERE id = 1",
            (before,),
        )
        cursor = conn.execute(
            "DELETE FROM usage WHERE request_id IN (SELECT request_id FROM usage"
            " WHERE created_at < %s ORDER BY created_at LIMIT %s)",
            (before, limit),
        )
        conn.execute(
            "DELETE FROM guard_events WHERE id IN (SELECT id FROM guard_events"
            " WHERE created_at < %s ORDER BY created_at LIMIT %s)",
            (before, limit),
        )
        return cursor.rowcount


def _list_usage(conn: _Conn, *, last: int, key_id: str | None) -> list[UsageRow]:
    if key_id is None:
        rows = conn.execute(
            f"SELECT {_USAGE_COLUMNS} FROM usage ORDER BY created_at DESC, seq DESC LIMIT %s",
            (last,),
        ).fetchall()
    else:
        rows = conn.execute(
            f"SELECT {_USAGE_COLUMNS} FROM usage WHERE key_id = %s"
            " ORDER BY created_at DESC, seq DESC LIMIT %s",
            (key_id, last),
        ).fetchall()
    return [_usage_from_row(r) for r in rows]


def _get_usage(conn: _Conn, *, request_id: str) -> UsageRow | None:
    row = conn.execute(
        f"SELECT {_USAGE_COLUMNS} FROM usage WHERE request_id = %s", (request_id,)
    ).fetchone()
    return None if row is None else _usage_from_row(row)


@contextlib.contextmanager
def _read_snapshot(conn: _Conn) -> Iterator[None]:
    """Several reads in one read-only ``REPEATABLE READ`` transaction: they
    all see the database as it was at the first."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def _sum_usage(
    conn: _Conn, *, columns: Sequence[str], since: float, until: float | None
) -> dict[tuple[str, ...], _Sums]:
    """Usage with ``since <= created_at < until`` summed per group of
    ``columns``, exactly as on SQLite (``_common._pieces``)."""
    sums: dict[tuple[str, ...], _Sums] = {}
    width = len(columns)
    with _read_snapshot(conn):
        for source, lo, hi in _pieces(since, until, _usage_pruned_before(conn)):
            if source == "raw":
                select = ", ".join(f"{_RAW_COLUMNS[c]} AS g{i}" for i, c in enumerate(columns))
                sql = (
                    f"SELECT {select}, count(*) AS n, sum(prompt_tokens) AS p,"
                    " sum(cached_tokens) AS c, sum(completion_tokens) AS o,"
                    " sum(cost_micros) AS m,"
                    f" count(*) FILTER (WHERE status >= {ERROR_STATUS}) AS e"
                    " FROM usage WHERE created_at >= %s AND created_at < %s"
                )
            else:
                table, period = _ROLLUP_TABLES[source]
                select = ", ".join(f"{c} AS g{i}" for i, c in enumerate(columns))
                sql = (
                    f"SELECT {select}, sum(requests) AS n, sum(prompt_tokens) AS p,"
                    " sum(cached_tokens) AS c, sum(completion_tokens) AS o,"
                    " sum(cost_micros) AS m, sum(errors) AS e"
                    f" FROM {table} WHERE {period} >= %s"
                )
                if hi is not None:
                    sql += f" AND {period} < %s"
            params = (lo,) if hi is None else (lo, hi)
            sql += " GROUP BY " + ", ".join(str(i + 1) for i in range(width))
            for row in conn.execute(sql, params):
                group = tuple(row[f"g{i}"] for i in range(width))
                values = [int(row[k]) for k in ("n", "p", "c", "o", "m", "e")]
                found = sums.get(group)
                if found is None:
                    sums[group] = values
                else:
                    for i, v in enumerate(values):
                        found[i] += v
    return sums


def _spend_since_by_scope(conn: _Conn, *, since: float) -> dict[str, int]:
    columns = ("key_id", "project_id", "team_id", "org_id")
    spend: dict[str, int] = {}
    for group, sums in _sum_usage(conn, columns=columns, since=since, until=None).items():
        for scope, id in zip(("key", "project", "team", "org"), group, strict=True):
            if id:
                counter = f"{scope}:{id}"
                spend[counter] = spend.get(counter, 0) + sums[4]
    return spend


def _usage_summary(
    conn: _Conn, *, column: str, since: float, until: float | None
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
    conn: _Conn, *, since: float, until: float | None, after_request_id: str, limit: int
) -> list[UsageRow]:
    where = ["created_at >= %(since)s"]
    params: dict[str, object] = {"since": since, "limit": limit}
    if until is not None:
        where.append("created_at < %(until)s")
        params["until"] = until
    if after_request_id:
        found = conn.execute(
            "SELECT created_at FROM usage WHERE request_id = %s", (after_request_id,)
        ).fetchone()
        if found is None:
            raise ValueError(f"after_request_id {after_request_id!r} names no stored usage row")
        where.append("(created_at, request_id) > (%(after_at)s, %(after_id)s)")
        params["after_at"] = found["created_at"]
        params["after_id"] = after_request_id
    rows = conn.execute(
        f"SELECT {_USAGE_COLUMNS} FROM usage WHERE {' AND '.join(where)}"
        " ORDER BY created_at, request_id LIMIT %(limit)s",
        params,
    ).fetchall()
    return [_usage_from_row(r) for r in rows]


# --- the tree ----------------------------------------------------------------

_PATH_SELECT = (
    "SELECT o.id AS o_id, o.name AS o_name, o.limits AS o_limits, o.created_at AS o_created,"
    " t.id AS t_id, t.name AS t_name, t.limits AS t_limits, t.created_at AS t_created,"
    " p.id AS p_id, p.name AS p_name, p.limits AS p_limits, p.created_at AS p_created"
    " FROM projects AS p JOIN teams AS t ON t.id = p.team_id JOIN orgs AS o ON o.id = t.org_id"
)


def _org_from_row(row: DictRow) -> Org:
    return Org(
        id=row["id"],
        name=row["name"],
        limits=_limits_from_json(row["limits"]),
        created_at=row["created_at"],
    )


def _team_from_row(row: DictRow) -> Team:
    return Team(
        id=row["id"],
        org_id=row["org_id"],
        name=row["name"],
        limits=_limits_from_json(row["limits"]),
        created_at=row["created_at"],
    )


def _path_from_row(row: DictRow) -> ProjectPath:
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


def _ensure_level(
    conn: _Conn, *, insert: str, select: str, params: tuple[object, ...], new_id: str
) -> tuple[str, bool]:
    """Insert a level unless its name is taken under its parent (a
    concurrent caller may have just made it); its id and whether it is new."""
    made = conn.execute(insert, (new_id, *params)).fetchone()
    if made is not None:
        return str(made["id"]), True
    found = conn.execute(select, params[:-1]).fetchone()
    assert found is not None
    return str(found["id"]), False


def _ensure_project(
    conn: _Conn, *, org: str, team: str, project: str, now: float
) -> tuple[ProjectPath, list[str]]:
    created: list[str] = []
    with conn.transaction():
        org_id, new = _ensure_level(
            conn,
            insert="INSERT INTO orgs (id, name, created_at) VALUES (%s, %s, %s)"
            " ON CONFLICT (name) DO NOTHING RETURNING id",
            select="SELECT id FROM orgs WHERE name = %s",
            params=(org, now),
            new_id=_new_id("org"),
        )
        if new:
            created.append(f"org {org}")
        team_id, new = _ensure_level(
            conn,
            insert="INSERT INTO teams (id, org_id, name, created_at) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (org_id, name) DO NOTHING RETURNING id",
            select="SELECT id FROM teams WHERE org_id = %s AND name = %s",
            params=(org_id, team, now),
            new_id=_new_id("team"),
        )
        if new:
            created.append(f"team {org}/{team}")
        project_id, new = _ensure_level(
            conn,
            insert="INSERT INTO projects (id, team_id, name, created_at) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (team_id, name) DO NOTHING RETURNING id",
            select="SELECT id FROM projects WHERE team_id = %s AND name = %s",
            params=(team_id, project, now),
            new_id=_new_id("proj"),
        )
        if new:
            created.append(f"project {org}/{team}/{project}")
        row = conn.execute(f"{_PATH_SELECT} WHERE p.id = %s", (project_id,)).fetchone()
    assert row is not None
    return _path_from_row(row), created


def _get_project_path(conn: _Conn, *, project_id: str) -> ProjectPath | None:
    row = conn.execute(f"{_PATH_SELECT} WHERE p.id = %s", (project_id,)).fetchone()
    return None if row is None else _path_from_row(row)


def _find_project(conn: _Conn, *, org: str, team: str, project: str) -> ProjectPath | None:
    row = conn.execute(
        f"{_PATH_SELECT} WHERE o.name = %s AND t.name = %s AND p.name = %s", (org, team, project)
    ).fetchone()
    return None if row is None else _path_from_row(row)


def _find_org(conn: _Conn, *, name: str) -> Org | None:
    row = conn.execute("SELECT * FROM orgs WHERE name = %s", (name,)).fetchone()
    return None if row is None else _org_from_row(row)


def _find_team(conn: _Conn, *, org: str, name: str) -> Team | None:
    row = conn.execute(
        "SELECT t.* FROM teams AS t JOIN orgs AS o ON o.id = t.org_id"
        " WHERE o.name = %s AND t.name = %s",
        (org, name),
    ).fetchone()
    return None if row is None else _team_from_row(row)


def _list_orgs(conn: _Conn) -> list[Org]:
    return [_org_from_row(r) for r in conn.execute("SELECT * FROM orgs ORDER BY name")]


def _list_teams(conn: _Conn) -> list[Team]:
    rows = conn.execute(
        "SELECT t.* FROM teams AS t JOIN orgs AS o ON o.id = t.org_id ORDER BY o.name, t.name"
    )
    return [_team_from_row(r) for r in rows]


def _list_tree(conn: _Conn) -> list[ProjectPath]:
    rows = conn.execute(f"{_PATH_SELECT} ORDER BY o.name, t.name, p.name")
    return [_path_from_row(r) for r in rows]


def _set_limits(conn: _Conn, *, table: str, id: str, text: str) -> bool:
    # ``table`` comes from _LIMITS_TABLES, never from user input.
    with conn.transaction():
        cursor = conn.execute(f"UPDATE {table} SET limits = %s WHERE id = %s", (text, id))
    return cursor.rowcount == 1


# --- catalog and settings ----------------------------------------------------


def _model_from_row(row: DictRow) -> ModelRecord:
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


def _put_model(conn: _Conn, *, model: ModelRecord, fence: Lease | None) -> None:
    first = model.profile
    engine = first.engine if first is not None else ("external" if model.external else "")
    with conn.transaction():
        _check_fence(conn, fence)
        conn.execute(
            "INSERT INTO models (name, engine, source, replicas, context_tokens, slots,"
            " cpu_cores, args, env, sha256, created_at, spec)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
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


def _get_model(conn: _Conn, *, name: str) -> ModelRecord | None:
    row = conn.execute("SELECT * FROM models WHERE name = %s", (name,)).fetchone()
    return None if row is None else _model_from_row(row)


def _list_models(conn: _Conn) -> list[ModelRecord]:
    return [_model_from_row(r) for r in conn.execute("SELECT * FROM models ORDER BY name")]


def _delete_model(conn: _Conn, *, name: str, fence: Lease | None) -> bool:
    with conn.transaction():
        _check_fence(conn, fence)
        cursor = conn.execute("DELETE FROM models WHERE name = %s", (name,))
    return cursor.rowcount == 1


def _get_setting(conn: _Conn, *, key: str) -> Any | None:
    row = conn.execute("SELECT value FROM settings WHERE key = %s", (key,)).fetchone()
    return None if row is None else json.loads(row["value"])


def _put_setting(conn: _Conn, *, key: str, text: str, now: float, fence: Lease | None) -> None:
    with conn.transaction():
        _check_fence(conn, fence)
        conn.execute(
            "INSERT INTO settings (key, value, updated_at) VALUES (%s, %s, %s)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value,"
            " updated_at = excluded.updated_at",
            (key, text, now),
        )


def _settings_version(conn: _Conn) -> int:
    row = conn.execute("SELECT coalesce(max(version), 0) AS v FROM settings_history").fetchone()
    assert row is not None
    return int(row["v"])


def _get_settings_doc(conn: _Conn) -> tuple[int, dict[str, Any]] | None:
    row = conn.execute(
        "SELECT version, document FROM settings_history ORDER BY version DESC LIMIT 1"
    ).fetchone()
    if row is None:
        return None
    return int(row["version"]), dict(json.loads(row["document"]))


def _put_settings_doc(
    conn: _Conn,
    *,
    text: str,
    expected_version: int | None,
    actor: str,
    note: str,
    now: float,
    fence: Lease | None,
) -> int:
    with conn.transaction():
        _check_fence(conn, fence)
        # Writers take turns (readers go on), so the version read is the live one.
        conn.execute("LOCK TABLE settings_history IN SHARE ROW EXCLUSIVE MODE")
        current = _settings_version(conn)
        if expected_version is not None and expected_version != current:
            raise Conflict(
                f"the settings changed: version {current} is live, not {expected_version}"
            )
        version = current + 1
        conn.execute(
            "INSERT INTO settings_history (version, document, changed_at, actor, note)"
            " VALUES (%s, %s, %s, %s, %s)",
            (version, text, now, actor, note),
        )
    return version


def _settings_history(conn: _Conn, *, last: int) -> list[SettingChange]:
    rows = conn.execute(
        "SELECT version, document, changed_at, actor, note FROM settings_history"
        " ORDER BY version DESC LIMIT %s",
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


# --- leases ------------------------------------------------------------------


def _acquire_lease(
    conn: _Conn, *, name: str, holder: str, expires_at: float, now: float
) -> Lease | None:
    # One statement decides: the DO UPDATE only happens when the row is ours
    # or expired (re-checked on the row's latest version under its lock), and
    # RETURNING yields nothing when it does not.
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO leases AS l (name, holder, epoch, expires_at)"
            " VALUES (%(name)s, %(holder)s, 1, %(exp)s)"
            " ON CONFLICT (name) DO UPDATE SET"
            " epoch = CASE WHEN l.holder = excluded.holder THEN l.epoch ELSE l.epoch + 1 END,"
            " holder = excluded.holder, expires_at = excluded.expires_at"
            " WHERE l.holder = excluded.holder OR l.expires_at <= %(now)s"
            " RETURNING name, holder, epoch, expires_at",
            {"name": name, "holder": holder, "exp": expires_at, "now": now},
        ).fetchone()
    if row is None:
        return None
    return Lease(
        name=row["name"],
        holder=row["holder"],
        epoch=int(row["epoch"]),
        expires_at=float(row["expires_at"]),
    )


def _release_lease(conn: _Conn, *, name: str, holder: str) -> None:
    with conn.transaction():
        conn.execute(
            "UPDATE leases SET expires_at = 0 WHERE name = %s AND holder = %s", (name, holder)
        )


# --- node identity -----------------------------------------------------------


def _node_certificate_from_row(row: DictRow) -> NodeCertificate:
    return NodeCertificate(
        serial=row["serial"],
        node_id=row["node_id"],
        issued_at=row["issued_at"],
        not_after=row["not_after"],
        revoked_at=row["revoked_at"],
    )


def _insert_node_certificate(conn: _Conn, *, cert: NodeCertificate) -> None:
    with conn.transaction():
        conn.execute(
            "INSERT INTO node_certificates (serial, node_id, issued_at, not_after, revoked_at)"
            " VALUES (%s, %s, %s, %s, %s)",
            (cert.serial.lower(), cert.node_id, cert.issued_at, cert.not_after, cert.revoked_at),
        )


def _select_node_certificates(
    conn: _Conn, *, where: str, params: Sequence[object]
) -> list[NodeCertificate]:
    rows = conn.execute(
        "SELECT serial, node_id, issued_at, not_after, revoked_at FROM node_certificates"
        f" WHERE {where} ORDER BY issued_at, serial",
        params,
    )
    return [_node_certificate_from_row(r) for r in rows]


def _revoke_node_certificates(conn: _Conn, *, node_id: str, at: float) -> int:
    with conn.transaction():
        cursor = conn.execute(
            "UPDATE node_certificates SET revoked_at = %s"
            " WHERE node_id = %s AND revoked_at IS NULL",
            (at, node_id),
        )
    return cursor.rowcount


_JOIN_TOKEN_COLUMNS = "token_hash, created_at, expires_at, node_id, labels, used_at"


def _join_token_from_row(row: DictRow) -> JoinToken:
    return JoinToken(
        token_hash=row["token_hash"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        node_id=row["node_id"],
        labels=json.loads(row["labels"]),
        used_at=row["used_at"],
    )


def _insert_join_token(conn: _Conn, *, token: JoinToken) -> None:
    with conn.transaction():
        conn.execute(
            f"INSERT INTO join_tokens ({_JOIN_TOKEN_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s)",
            (
                token.token_hash,
                token.created_at,
                token.expires_at,
                token.node_id,
                json.dumps(token.labels, sort_keys=True),
                token.used_at,
            ),
        )


def _select_join_token(conn: _Conn, *, token_hash: str) -> JoinToken | None:
    row = conn.execute(
        f"SELECT {_JOIN_TOKEN_COLUMNS} FROM join_tokens WHERE token_hash = %s", (token_hash,)
    ).fetchone()
    return None if row is None else _join_token_from_row(row)


def _use_join_token(conn: _Conn, *, token_hash: str, now: float) -> JoinToken:
    with conn.transaction():
        row = conn.execute(
            "UPDATE join_tokens SET used_at = %(now)s"
            " WHERE token_hash = %(hash)s AND used_at IS NULL AND expires_at > %(now)s"
            f" RETURNING {_JOIN_TOKEN_COLUMNS}",
            {"now": now, "hash": token_hash},
        ).fetchone()
        if row is not None:
            return _join_token_from_row(row)
        found = _select_join_token(conn, token_hash=token_hash)
    raise join_token_refusal(found)


# --- guard events --------------------------------------------------------------------

_INSERT_GUARD_EVENT = (
    "INSERT INTO guard_events (request_id, created_at, key_id, model, direction, rule, action)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s)"
)


def _guard_event_values(row: UsageRow) -> list[tuple[object, ...]]:
    return [
        (row.request_id, row.created_at, row.key_id, row.model, direction, rule, action)
        for direction, rule, action in row.guard_events
    ]


def _list_guard_events(
    conn: _Conn,
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
            where.append(f"{column} = %s")
            params.append(value)
    if since is not None:
        where.append("created_at >= %s")
        params.append(since)
    sql = (
        "SELECT request_id, created_at, key_id, model, direction, rule, action FROM guard_events"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + " ORDER BY created_at DESC, id DESC LIMIT %s"
    )
    rows = conn.execute(sql, (*params, last)).fetchall()
    return [GuardEvent(**dict(r)) for r in rows]

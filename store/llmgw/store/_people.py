"""People, memberships and sessions, the same SQL for both backends.

Each backend wraps its connection in a :class:`Sql` (named parameters
written ``:name``; PostgreSQL's adapter rewrites them to ``%(name)s``) and
calls these functions in its worker thread, so the two stores cannot drift.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, TypeVar

import psycopg
from psycopg.rows import DictRow

from ._sqlite_schema import write_transaction
from .records import Membership, Person, SessionRecord, UsageRow

__all__ = [
    "PeopleMethods",
    "PgSql",
    "Sql",
    "SqliteSql",
    "delete_membership",
    "delete_person",
    "delete_session",
    "delete_sessions",
    "find_person",
    "forget_person",
    "get_person",
    "get_session",
    "insert_person",
    "insert_session",
    "list_memberships",
    "list_people",
    "put_membership",
    "update_person",
    "usage_of",
]

_T = TypeVar("_T")

_NAMED = re.compile(r"(?<!:):([a-z_][a-z0-9_]*)")


class Sql(Protocol):
    def rows(self, sql: str, params: Mapping[str, object]) -> list[Mapping[str, Any]]: ...

    def run(self, sql: str, params: Mapping[str, object]) -> int:
        """Execute; the number of rows changed."""
        ...

    def transaction(self) -> AbstractContextManager[object]: ...


class SqliteSql:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def rows(self, sql: str, params: Mapping[str, object]) -> list[Mapping[str, Any]]:
        cursor = self._conn.cursor()
        cursor.row_factory = sqlite3.Row
        return [dict(row) for row in cursor.execute(sql, params).fetchall()]

    def run(self, sql: str, params: Mapping[str, object]) -> int:
        return self._conn.execute(sql, params).rowcount

    def transaction(self) -> AbstractContextManager[object]:
        return write_transaction(self._conn)


class PgSql:
    def __init__(self, conn: psycopg.Connection[DictRow]) -> None:
        self._conn = conn

    def rows(self, sql: str, params: Mapping[str, object]) -> list[Mapping[str, Any]]:
        return list(self._conn.execute(_NAMED.sub(r"%(\1)s", sql), params).fetchall())

    def run(self, sql: str, params: Mapping[str, object]) -> int:
        return self._conn.execute(_NAMED.sub(r"%(\1)s", sql), params).rowcount

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with self._conn.transaction():
            yield

    def transaction(self) -> AbstractContextManager[object]:
        return self._transaction()


_PERSON_COLUMNS = "id, email, name, password_hash, state, staff_role, created_at"


def _person(row: Mapping[str, Any]) -> Person:
    return Person(
        id=row["id"],
        email=row["email"],
        name=row["name"],
        password_hash=row["password_hash"],
        state=row["state"],
        staff_role=row["staff_role"],
        created_at=row["created_at"],
    )


def _person_params(person: Person) -> dict[str, object]:
    return {
        "id": person.id,
        "email": person.email.lower(),
        "name": person.name,
        "password_hash": person.password_hash,
        "state": person.state,
        "staff_role": person.staff_role,
        "created_at": person.created_at,
    }


def insert_person(db: Sql, *, person: Person) -> None:
    with db.transaction():
        db.run(
            f"INSERT INTO people ({_PERSON_COLUMNS}) VALUES"
            " (:id, :email, :name, :password_hash, :state, :staff_role, :created_at)",
            _person_params(person),
        )


def get_person(db: Sql, *, person_id: str) -> Person | None:
    rows = db.rows(f"SELECT {_PERSON_COLUMNS} FROM people WHERE id = :id", {"id": person_id})
    return _person(rows[0]) if rows else None


def find_person(db: Sql, *, email: str) -> Person | None:
    rows = db.rows(
        f"SELECT {_PERSON_COLUMNS} FROM people WHERE email = :email", {"email": email.lower()}
    )
    return _person(rows[0]) if rows else None


def list_people(db: Sql) -> list[Person]:
    return [_person(r) for r in db.rows(f"SELECT {_PERSON_COLUMNS} FROM people ORDER BY email", {})]


def update_person(db: Sql, *, person: Person) -> bool:
    with db.transaction():
        changed = db.run(
            "UPDATE people SET email = :email, name = :name, password_hash = :password_hash,"
            " state = :state, staff_role = :staff_role WHERE id = :id",
            _person_params(person),
        )
    return changed == 1


def delete_person(db: Sql, *, person_id: str) -> bool:
    with db.transaction():
        db.run("DELETE FROM sessions WHERE person_id = :id", {"id": person_id})
        db.run("DELETE FROM memberships WHERE person_id = :id", {"id": person_id})
        changed = db.run("DELETE FROM people WHERE id = :id", {"id": person_id})
    return changed == 1


def forget_person(db: Sql, *, person_id: str, anonymous: str, at: float) -> bool:
    with db.transaction():
        rows = db.rows("SELECT email FROM people WHERE id = :id", {"id": person_id})
        if not rows:
            return False
        email = rows[0]["email"]
        db.run(
            "UPDATE keys SET owner = :anonymous, revoked_at = coalesce(revoked_at, :at)"
            " WHERE owner = :email",
            {"anonymous": anonymous, "email": email, "at": at},
        )
        db.run("DELETE FROM sessions WHERE person_id = :id", {"id": person_id})
        db.run("DELETE FROM memberships WHERE person_id = :id", {"id": person_id})
        db.run("DELETE FROM people WHERE id = :id", {"id": person_id})
    return True


def put_membership(db: Sql, *, membership: Membership) -> None:
    with db.transaction():
        db.run(
            "INSERT INTO memberships (person_id, scope, scope_id, role)"
            " VALUES (:person_id, :scope, :scope_id, :role)"
            " ON CONFLICT (person_id, scope, scope_id) DO UPDATE SET role = excluded.role",
            {
                "person_id": membership.person_id,
                "scope": membership.scope,
                "scope_id": membership.scope_id,
                "role": membership.role,
            },
        )


def delete_membership(db: Sql, *, person_id: str, scope: str, scope_id: str) -> bool:
    with db.transaction():
        changed = db.run(
            "DELETE FROM memberships WHERE person_id = :person_id AND scope = :scope"
            " AND scope_id = :scope_id",
            {"person_id": person_id, "scope": scope, "scope_id": scope_id},
        )
    return changed == 1


def list_memberships(db: Sql, *, person_id: str | None) -> list[Membership]:
    sql = "SELECT person_id, scope, scope_id, role FROM memberships"
    params: dict[str, object] = {}
    if person_id is not None:
        sql += " WHERE person_id = :person_id"
        params["person_id"] = person_id
    sql += " ORDER BY person_id, scope, scope_id"
    return [
        Membership(
            person_id=r["person_id"], scope=r["scope"], scope_id=r["scope_id"], role=r["role"]
        )
        for r in db.rows(sql, params)
    ]


def insert_session(db: Sql, *, session: SessionRecord) -> None:
    with db.transaction():
        db.run(
            "INSERT INTO sessions (token_hash, person_id, created_at, expires_at, client)"
            " VALUES (:token_hash, :person_id, :created_at, :expires_at, :client)",
            {
                "token_hash": session.token_hash,
                "person_id": session.person_id,
                "created_at": session.created_at,
                "expires_at": session.expires_at,
                "client": session.client,
            },
        )


def get_session(db: Sql, *, token_hash: str) -> SessionRecord | None:
    rows = db.rows(
        "SELECT token_hash, person_id, created_at, expires_at, client FROM sessions"
        " WHERE token_hash = :token_hash",
        {"token_hash": token_hash},
    )
    if not rows:
        return None
    r = rows[0]
    return SessionRecord(
        token_hash=r["token_hash"],
        person_id=r["person_id"],
        created_at=r["created_at"],
        expires_at=r["expires_at"],
        client=r["client"],
    )


def delete_session(db: Sql, *, token_hash: str) -> bool:
    with db.transaction():
        changed = db.run(
            "DELETE FROM sessions WHERE token_hash = :token_hash", {"token_hash": token_hash}
        )
    return changed == 1


def delete_sessions(db: Sql, *, person_id: str, before: float | None = None) -> int:
    """Every session of ``person_id`` (with ``before``: and any session that
    expired before that time, of anyone)."""
    with db.transaction():
        changed = db.run("DELETE FROM sessions WHERE person_id = :id", {"id": person_id})
        if before is not None:
            db.run("DELETE FROM sessions WHERE expires_at < :before", {"before": before})
    return changed


def usage_of(
    db: Sql,
    *,
    since: float,
    key_ids: tuple[str, ...] | None,
    project_id: str | None,
    limit: int,
) -> list[UsageRow]:
    """Usage rows since ``since`` of ``key_ids`` (or of ``project_id``), the
    newest ``limit`` of them, oldest first; only the fields a page sums are
    filled (ids, times, model, status, tokens, cost)."""
    params: dict[str, object] = {"since": since, "limit": limit}
    if key_ids is not None:
        if not key_ids:
            return []
        names = [f"k{i}" for i in range(len(key_ids))]
        params.update(zip(names, key_ids, strict=True))
        where = "key_id IN (" + ", ".join(":" + n for n in names) + ")"
    elif project_id is not None:
        params["project_id"] = project_id
        where = "project_id = :project_id"
    else:
        raise ValueError("name key_ids or a project_id")
    rows = db.rows(
        "SELECT request_id, created_at, key_id, project_id, team_id, org_id, model, served_model,"
        " status, prompt_tokens, cached_tokens, completion_tokens, cost_micros FROM usage"
        f" WHERE {where} AND created_at >= :since"
        " ORDER BY created_at DESC, request_id DESC LIMIT :limit",
        params,
    )
    return [
        UsageRow(
            request_id=r["request_id"],
            created_at=float(r["created_at"]),
            key_id=r["key_id"],
            project_id=r["project_id"],
            team_id=r["team_id"],
            org_id=r["org_id"],
            model=r["model"],
            served_model=r["served_model"],
            status=int(r["status"]),
            prompt_tokens=int(r["prompt_tokens"]),
            cached_tokens=int(r["cached_tokens"]),
            completion_tokens=int(r["completion_tokens"]),
            cost_micros=int(r["cost_micros"]),
        )
        for r in reversed(rows)
    ]


class PeopleMethods:
    """The store methods of people, memberships and sessions, one set for
    both stores: each calls the function of this module of the same name
    through :meth:`_people`, which the store gives (its connection wrapped
    in :class:`SqliteSql` or :class:`PgSql`, in its worker thread)."""

    async def _people(self, fn: Callable[..., _T], **kwargs: Any) -> _T:
        raise NotImplementedError

    async def insert_person(self, person: Person) -> None:
        """Keep a new person. Raises :class:`Conflict` if the id or address is taken."""
        await self._people(insert_person, person=person)

    async def get_person(self, person_id: str) -> Person | None:
        """The person with this id, or ``None``."""
        return await self._people(get_person, person_id=person_id)

    async def find_person(self, email: str) -> Person | None:
        """The person with this sign-in address (any case), or ``None``."""
        return await self._people(find_person, email=email)

    async def list_people(self) -> list[Person]:
        """Every person, by address."""
        return await self._people(list_people)

    async def update_person(self, person: Person) -> bool:
        """Replace the person with ``person.id``; ``False`` when there is none."""
        return await self._people(update_person, person=person)

    async def delete_person(self, person_id: str) -> bool:
        """Remove a person with their memberships and sessions."""
        return await self._people(delete_person, person_id=person_id)

    async def forget_person(self, person_id: str, anonymous: str, at: float) -> bool:
        """Erase a person's data; their keys are owned by ``anonymous``."""
        return await self._people(forget_person, person_id=person_id, anonymous=anonymous, at=at)

    async def put_membership(self, membership: Membership) -> None:
        """Add a membership, or change its role when it exists."""
        await self._people(put_membership, membership=membership)

    async def delete_membership(self, person_id: str, scope: str, scope_id: str) -> bool:
        """Remove one membership; ``False`` when there was none."""
        return await self._people(
            delete_membership, person_id=person_id, scope=scope, scope_id=scope_id
        )

    async def list_memberships(self, person_id: str | None = None) -> list[Membership]:
        """Every membership (of ``person_id`` when given)."""
        return await self._people(list_memberships, person_id=person_id)

    async def insert_session(self, session: SessionRecord) -> None:
        """Keep a new session. Raises :class:`Conflict` if the hash exists."""
        await self._people(insert_session, session=session)

    async def get_session(self, token_hash: str) -> SessionRecord | None:
        """The session with this token hash, or ``None``."""
        return await self._people(get_session, token_hash=token_hash)

    async def delete_session(self, token_hash: str) -> bool:
        """End one session; ``False`` when there was none."""
        return await self._people(delete_session, token_hash=token_hash)

    async def delete_sessions(self, person_id: str, *, before: float | None = None) -> int:
        """End every session of ``person_id``; with ``before``, drop expired ones too."""
        return await self._people(delete_sessions, person_id=person_id, before=before)

    async def usage_of(
        self,
        since: float,
        *,
        key_ids: Sequence[str] | None = None,
        project_id: str | None = None,
        limit: int = 50_000,
    ) -> list[UsageRow]:
        """Raw usage rows of some keys or of one project; see :meth:`llmgw.store.Store.usage_of`."""
        return await self._people(
            usage_of,
            since=since,
            key_ids=None if key_ids is None else tuple(key_ids),
            project_id=project_id,
            limit=limit,
        )

"""People on the admin API (``docs/portal.md``): accounts, staff roles,
states, passwords and memberships.

Routes (``WHO`` is a person's id or sign-in address):

- ``GET /api/v1/people`` — every person with their memberships;
- ``POST /api/v1/people`` ``{"email", "name"?, "password"?, "role"?,
  "state"?, "project"?|"team"?|"org"?, "member_role"?}`` — 201, the person
  and ``"password"`` (made up when not given; shown only here);
- ``POST /api/v1/people/WHO/role`` ``{"role"}`` (``""`` = none);
- ``POST /api/v1/people/WHO/approve|suspend|reinstate`` — a suspension ends
  their sessions at once;
- ``POST /api/v1/people/WHO/password`` ``{"password"?}`` — ends their
  sessions; answers the new password when it was made up;
- ``POST /api/v1/people/WHO/memberships`` ``{"project"|"team"|"org", "role"?}``;
- ``DELETE /api/v1/people/WHO`` — the account goes, its keys stay;
- ``POST /api/v1/people/WHO/forget`` — personal data erased; keys revoked and
  their usage kept under an anonymous id (answered).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Final

from quart_trio import QuartTrio

from llmgw import errors
from llmgw.auth.people import People
from llmgw.auth.tree import parse_project_path
from llmgw.store import Membership, Person, Store

from .errors import BadRequest
from .inputs import json_object

__all__ = ["add_people_routes", "membership_target", "person_view"]

_JOIN_FIELDS: Final = (
    "email",
    "name",
    "password",
    "role",
    "state",
    "project",
    "team",
    "org",
    "member_role",
)


async def person_view(store: Store, person: Person) -> dict[str, Any]:
    """A person as the API shows them (never the password hash)."""
    names = await _scope_names(store)
    return {
        "id": person.id,
        "email": person.email,
        "name": person.name,
        "state": person.state,
        "role": person.staff_role,
        "created_at": person.created_at,
        "memberships": [
            _membership_view(m, names) for m in await store.list_memberships(person.id)
        ],
    }


def _membership_view(m: Membership, names: dict[tuple[str, str], str]) -> dict[str, str]:
    return {
        "scope": m.scope,
        "id": m.scope_id,
        "path": names.get((m.scope, m.scope_id), m.scope_id),
        "role": m.role,
    }


async def _scope_names(store: Store) -> dict[tuple[str, str], str]:
    names: dict[tuple[str, str], str] = {}
    for path in await store.list_tree():
        names[("org", path.org.id)] = path.org.name
        names[("team", path.team.id)] = f"{path.org.name}/{path.team.name}"
        names[("project", path.project.id)] = path.path
    for org in await store.list_orgs():
        names.setdefault(("org", org.id), org.name)
    return names


async def membership_target(store: Store, doc: dict[str, Any]) -> tuple[str, str] | None:
    """``(scope, id)`` named by ``doc``'s ``project`` (created if missing),
    ``team`` or ``org``; ``None`` when none is named.

    Raises:
        BadRequest: more than one named, or a bad path. NotFound: an org or
            team that does not exist.
    """
    named = [k for k in ("project", "team", "org") if doc.get(k)]
    if not named:
        return None
    if len(named) > 1:
        raise BadRequest("Name one of 'project', 'team' or 'org'.")
    value = doc[named[0]]
    if not isinstance(value, str):
        raise BadRequest(f"'{named[0]}' must be a path like Acme/ml/train")
    if named[0] == "project":
        try:
            org, team, project = parse_project_path(value)
        except ValueError as exc:
            raise BadRequest(str(exc), param="project") from None
        path, _ = await store.ensure_project(org, team, project, now=time.time())
        return "project", path.project.id
    if named[0] == "team":
        org_name, _, team_name = value.partition("/")
        found = await store.find_team(org_name, team_name)
        if found is None:
            raise errors.NotFound(f"no team {value!r}")
        return "team", found.id
    org_found = await store.find_org(value)
    if org_found is None:
        raise errors.NotFound(f"no org {value!r}")
    return "org", org_found.id


def add_people_routes(app: QuartTrio, store: Store, people: People) -> None:
    """Add the routes of the module docstring to ``app``."""

    @app.get("/api/v1/people")
    async def list_people() -> Any:
        return {"data": [await person_view(store, p) for p in await store.list_people()]}

    @app.post("/api/v1/people")
    async def join() -> Any:
        doc = await json_object(allowed=_JOIN_FIELDS)
        password = doc.get("password")
        if password is not None and not isinstance(password, str):
            raise BadRequest("'password' must be a string", param="password")
        target = await membership_target(store, doc)
        person, secret = await people.join(
            doc.get("email"),
            name=str(doc.get("name") or ""),
            password=password,
            staff_role=str(doc.get("role") or ""),
            state=str(doc.get("state") or "active"),
        )
        if target is not None:
            await people.add_membership(
                person.id, target[0], target[1], str(doc.get("member_role") or "member")
            )
        view = await person_view(store, person)
        if password is None:
            view["password"] = secret
        return view, 201

    @app.post("/api/v1/people/<who>/role")
    async def set_role(who: str) -> Any:
        doc = await json_object(allowed=("role",))
        return await person_view(store, await people.set_role(who, str(doc.get("role") or "")))

    @app.post("/api/v1/people/<who>/approve")
    async def approve(who: str) -> Any:
        return await person_view(store, await people.approve(who))

    @app.post("/api/v1/people/<who>/reinstate")
    async def reinstate(who: str) -> Any:
        return await person_view(store, await people.set_state(who, "active"))

    @app.post("/api/v1/people/<who>/suspend")
    async def suspend(who: str) -> Any:
        return await person_view(store, await people.set_state(who, "suspended"))

    @app.post("/api/v1/people/<who>/password")
    async def password(who: str) -> Any:
        doc = await json_object(allowed=("password",))
        given = doc.get("password")
        new = given if given is not None else secrets.token_urlsafe(15)
        view = await person_view(store, await people.set_password(who, new))
        if given is None:
            view["password"] = new
        return view

    @app.post("/api/v1/people/<who>/memberships")
    async def add_membership(who: str) -> Any:
        doc = await json_object(allowed=("project", "team", "org", "role"))
        target = await membership_target(store, doc)
        if target is None:
            raise BadRequest("Name one of 'project', 'team' or 'org'.")
        await people.add_membership(who, target[0], target[1], str(doc.get("role") or "member"))
        return await person_view(store, await people.find(who))

    @app.delete("/api/v1/people/<who>")
    async def delete(who: str) -> Any:
        person = await people.delete(who)
        return {"id": person.id, "deleted": True}

    @app.post("/api/v1/people/<who>/forget")
    async def forget(who: str) -> Any:
        return {"forgotten": True, "anonymous_id": await people.forget(who)}

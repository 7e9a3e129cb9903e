"""Keys, the tenancy tree and limits, as the admin API manages them.

Rules (``shared/spec/tenancy-and-keys.md``): keys belong to a project, or
to a person (personal keys: their own limits and the defaults only); a
project path that does not exist yet is created (and the answer says which
levels were made); ``auth.max_key_ttl`` caps a key's life and is the expiry
of keys made without one; a level's limits only narrow what is above it (the
accountant enforces that along the path); ``keys init`` is idempotent and
never re-parents a team or project.

Money: budgets are given in currency units (``25`` or ``"25.50"``) and kept
in integer micro-units (``25_000_000``), the unit of prices
(``shared/spec/accounting.md``).
"""

from __future__ import annotations

import datetime as dt
import re
import time
from decimal import Decimal, InvalidOperation
from typing import Any, Final

import attrs
import trio

from llmgw.accounting.accountant import Accountant
from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.auth.tree import ScopeResolver, parse_project_path
from llmgw.settings import AuthSettings, parse_duration_s
from llmgw.store import KeyRecord, Store
from llmgw.store.records import Limits, Org, Project, ProjectPath, Team

__all__ = ["DEFAULT_PROJECT", "KeysService", "parse_budget_micros", "parse_since"]

#: Where keys made without ``--project`` go (a fresh install's one project).
DEFAULT_PROJECT: Final = "default/default/default"
MICROS_PER_UNIT: Final = 1_000_000
#: The largest budget accepted, in currency units.
MAX_BUDGET_UNITS: Final = 10**12
#: Key names and sign-in addresses: printable, no control characters.
_PRINTABLE: Final = re.compile(r"^[^\x00-\x1f\x7f]+$")
_LIMIT_FIELDS: Final = ("rpm", "tpm", "budget_day", "budget_month", "models")
_PERSON: Final = re.compile(r"^[^@\s]{1,64}@[^@\s]{1,255}$")


def parse_since(value: str, now: float) -> float:
    """A time: a duration back from ``now`` (``24h``, ``30d``), an ISO date or
    date-time (UTC when no zone is given), or epoch seconds.

    Raises:
        ValueError: none of those.
    """
    text = value.strip()
    if len(text) > 40:
        raise ValueError(f"{text[:40]!r}… is not a time")
    try:
        back_s = parse_duration_s(text)
    except (ValueError, OverflowError):
        pass
    else:
        if back_s > 100 * 365 * 86400:
            raise ValueError(f"{value!r} is more than a hundred years back")
        return now - back_s
    try:
        epoch = float(text)
    except ValueError:
        pass
    else:
        if not 0 <= epoch < 1e11:
            raise ValueError(f"{value!r} is not a time in epoch seconds")
        return epoch
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is not a time: give 24h, 30d, 2026-11-01, 2026-11-01T12:00 or epoch seconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def parse_budget_micros(value: object) -> int | None:
    """Currency units (``25``, ``"25.50"``) → integer micro-units; None stays None.

    Raises:
        ValueError: not a non-negative amount.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not an amount")
    text = str(value)
    if len(text) > 32:
        raise ValueError(f"{text[:32]!r}… is not an amount like 25 or 25.50")
    try:
        amount = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"{value!r} is not an amount like 25 or 25.50") from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"{value!r} is not a non-negative amount")
    if amount > MAX_BUDGET_UNITS:
        raise ValueError(f"{value!r} is more than the largest budget, {MAX_BUDGET_UNITS:,}")
    micros = int(amount * MICROS_PER_UNIT)
    if micros == 0 and amount > 0:
        raise ValueError(f"{value!r} is less than one micro-unit (0.000001)")
    return micros


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _limits_from(doc: object, base: Limits) -> Limits:
    if not isinstance(doc, dict):
        raise ValueError("limits must be a JSON object")
    unknown = set(doc) - set(_LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown limit(s) {sorted(unknown)}; known: {', '.join(_LIMIT_FIELDS)}")
    changes: dict[str, Any] = {}
    for name in ("rpm", "tpm"):
        if name in doc:
            value = doc[name]
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(
                    f"'{name}' must be a whole number (0 or more), or null to clear it"
                )
            changes[name] = value
    for name in ("budget_day", "budget_month"):
        if name in doc:
            changes[f"{name}_micros"] = parse_budget_micros(doc[name])
    if "models" in doc:
        models = doc["models"]
        if models is not None and (
            not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)
        ):
            raise ValueError("'models' must be a list of model names, or null to inherit")
        if models is not None and not models:
            raise ValueError(
                "'models' must name at least one model (null inherits the level above)"
            )
        changes["models"] = None if models is None else tuple(models)
    return attrs.evolve(base, **changes)


def _limits_doc(limits: Limits) -> dict[str, Any]:
    def units(micros: int | None) -> str | None:
        return None if micros is None else str(Decimal(micros) / MICROS_PER_UNIT)

    return {
        "rpm": limits.rpm,
        "tpm": limits.tpm,
        "budget_day": units(limits.budget_day_micros),
        "budget_month": units(limits.budget_month_micros),
        "models": None if limits.models is None else list(limits.models),
    }


class KeysService:
    """What the admin API's key, tree and limits routes do."""

    def __init__(
        self,
        store: Store,
        authenticator: KeyAuthenticator,
        resolver: ScopeResolver,
        settings: AuthSettings,
        accountant: Accountant | None = None,
    ) -> None:
        self._store = store
        self._accountant = accountant
        self._auth = authenticator
        self._resolver = resolver
        self._settings = settings
        #: One `keys init` at a time, so two runs never both make a key.
        self._init_lock = trio.Lock()

    def _expiry(self, expires: object, now: float) -> float | None:
        cap_s = self._settings.max_key_ttl
        if expires is None or expires == "":
            return None if cap_s is None else now + cap_s
        try:
            life_s = parse_duration_s(expires)
        except (ValueError, OverflowError) as exc:
            raise ValueError(f"'expires': {exc}") from None
        if life_s <= 0:
            raise ValueError("'expires' must be a positive duration like 30d")
        if cap_s is not None and life_s > cap_s:
            raise ValueError(
                f"'expires' {expires} is longer than auth.max_key_ttl ({_human(cap_s)})"
            )
        return now + life_s

    async def create(
        self,
        name: str,
        *,
        project: object = None,
        person: object = None,
        expires: object = None,
        band: object = "",
    ) -> dict[str, Any]:
        """Make a key in ``project`` (``ORG/TEAM/PROJECT``, created if missing),
        or a personal key of ``person`` (a sign-in address; no project).

        Raises:
            ValueError: a bad path, person, expiry or band, or both a project
                and a person.
        """
        now = time.time()
        if not _PRINTABLE.match(name) or len(name) > 200:
            raise ValueError("a key's name is 1 to 200 printable characters")
        if project is not None and not isinstance(project, str):
            raise ValueError("'project' must be a path like Acme/ml/train")
        if not isinstance(band, str) or len(band) > 64 or (band and not _PRINTABLE.match(band)):
            raise ValueError("'band' must be a short name")
        expires_at = self._expiry(expires, now)
        secret, record = new_key(name, now=now)
        if person is not None:
            if project is not None:
                raise ValueError("a key belongs to a project or to a person, not both")
            if (
                not isinstance(person, str)
                or not _PERSON.match(person)
                or not _PRINTABLE.match(person)
            ):
                raise ValueError("'person' must be a sign-in address like ada@example.com")
            record = attrs.evolve(record, owner=person, band=band, expires_at=expires_at)
            await self._store.insert_key(record)
            return {**self._key_doc(record, None), "key": secret, "created": []}
        org, team, proj = parse_project_path(project or DEFAULT_PROJECT)
        path, created = await self._store.ensure_project(org, team, proj, now)
        record = attrs.evolve(record, project_id=path.project.id, band=band, expires_at=expires_at)
        await self._store.insert_key(record)
        return {**self._key_doc(record, path), "key": secret, "created": created}

    async def rotate(self, key_id: str) -> dict[str, Any]:
        """A new secret for a key; the old one is refused at once.

        Raises:
            LookupError: no such key. ValueError: the key is revoked.
        """
        key = await self._store.get_key(key_id)
        if key is None:
            raise LookupError(f"No key {key_id!r}.")
        if key.revoked_at is not None:
            raise ValueError(f"Key {key_id!r} is revoked; make a new one.")
        if key.expires_at is not None and key.expires_at <= time.time():
            raise ValueError(f"Key {key_id!r} has expired; make a new one.")
        secret, fresh = new_key(key.name)
        await self._store.update_key(
            attrs.evolve(key, key_hash=fresh.key_hash, prefix=fresh.prefix)
        )
        self._auth.forget(key_id)
        path = await self._store.get_project_path(key.project_id) if key.project_id else None
        return {**self._key_doc(key, path), "prefix": fresh.prefix, "key": secret}

    async def list_keys(self) -> list[dict[str, Any]]:
        paths = {p.project.id: p for p in await self._store.list_tree()}
        return [
            self._key_doc(k, paths.get(k.project_id or "")) for k in await self._store.list_keys()
        ]

    async def tree(self) -> list[dict[str, Any]]:
        return [
            {
                "path": p.path,
                "project_id": p.project.id,
                "limits": {
                    "org": _limits_doc(p.org.limits),
                    "team": _limits_doc(p.team.limits),
                    "project": _limits_doc(p.project.limits),
                },
            }
            for p in await self._store.list_tree()
        ]

    async def set_limits(self, scope: str, ident: str, doc: object) -> dict[str, Any]:
        """Change some of a level's limits (fields left out stay; null clears).

        ``ident``: a key id for ``key``; a path for the others (``Acme``,
        ``Acme/ml``, ``Acme/ml/train``) or the level's id.

        Raises:
            LookupError: no such level. ValueError: bad scope or limits.
        """
        if scope not in ("org", "team", "project", "key"):
            raise ValueError("scope is one of org, team, project, key")
        target_id, current = await self._find(scope, ident)
        limits = _limits_from(doc, current)
        await self._store.set_limits(scope, target_id, limits)  # type: ignore[arg-type]
        self._auth.forget(target_id)
        self._resolver.forget()
        return {"scope": scope, "id": target_id, "limits": _limits_doc(limits)}

    async def _find(self, scope: str, ident: str) -> tuple[str, Limits]:
        ident = ident.strip().strip("/")
        if scope == "key":
            key = await self._store.get_key(ident)
            if key is None:
                raise LookupError(f"No key {ident!r}.")
            return key.id, key.limits
        parts = ident.split("/")
        if scope == "org" and len(parts) == 1:
            org = await self._store.find_org(parts[0])
            if org is not None:
                return org.id, org.limits
        if scope == "team" and len(parts) == 2:
            team = await self._store.find_team(parts[0], parts[1])
            if team is not None:
                return team.id, team.limits
        if scope == "project" and len(parts) == 3:
            found = await self._store.find_project(*parts)
            if found is not None:
                return found.project.id, found.project.limits
        for path in await self._store.list_tree():
            level: Org | Team | Project
            if scope == "org":
                level = path.org
            elif scope == "team":
                level = path.team
            else:
                level = path.project
            if level.id == ident:
                return level.id, level.limits
        raise LookupError(f"No {scope} {ident!r}.")

    async def init_tree(self, doc: object) -> dict[str, Any]:
        """Provision a tree (and keys) from ``{"orgs": [...]}``; idempotent.

        Shape: ``orgs: [{name, limits?, teams: [{name, limits?, projects:
        [{name, limits?, keys: [{name, band?, expires?}]}]}]}]``. A key is
        made only when its project has no live key of that name; existing
        levels keep their parents; given limits are applied.

        Raises:
            ValueError: a malformed document (nothing is changed then).
        """
        plan = _parse_tree(doc)
        for *_, keys in plan:
            for key_doc in keys:
                self._check_key_doc(key_doc)
        async with self._init_lock:
            return await self._apply_tree(plan)

    def _check_key_doc(self, key_doc: dict[str, Any]) -> None:
        """Everything :meth:`create` would refuse, refused before any change."""
        unknown = set(key_doc) - {"name", "band", "expires"}
        if unknown:
            raise ValueError(f"key {key_doc['name']!r}: unknown field(s) {sorted(unknown)}")
        band = key_doc.get("band", "")
        if not isinstance(band, str) or len(band) > 64:
            raise ValueError(f"key {key_doc['name']!r}: 'band' must be a short name")
        if not _PRINTABLE.match(key_doc["name"]) or len(key_doc["name"]) > 200:
            raise ValueError(f"key {key_doc['name']!r}: a name is 1 to 200 printable characters")
        self._expiry(key_doc.get("expires"), time.time())

    async def _apply_tree(self, plan: _TreePlan) -> dict[str, Any]:
        now = time.time()
        created: list[str] = []
        made_keys: list[dict[str, Any]] = []
        existing = await self._store.list_keys()
        for org_name, org_limits, team_name, team_limits, proj_name, proj_limits, keys in plan:
            path, levels = await self._store.ensure_project(org_name, team_name, proj_name, now)
            created += [level for level in levels if level not in created]
            for scope, level_id, limits_doc, base in (
                ("org", path.org.id, org_limits, path.org.limits),
                ("team", path.team.id, team_limits, path.team.limits),
                ("project", path.project.id, proj_limits, path.project.limits),
            ):
                if limits_doc is not None:
                    await self._store.set_limits(scope, level_id, _limits_from(limits_doc, base))  # type: ignore[arg-type]
            for key_doc in keys:
                live = [
                    k
                    for k in existing
                    if k.project_id == path.project.id
                    and k.name == key_doc["name"]
                    and k.revoked_at is None
                ]
                if live:
                    continue
                made = await self.create(
                    key_doc["name"],
                    project=path.path,
                    expires=key_doc.get("expires"),
                    band=key_doc.get("band", ""),
                )
                made_keys.append({"name": made["name"], "project": path.path, "key": made["key"]})
        self._resolver.forget()
        return {"created": created, "keys": made_keys}

    async def names(self, by: str) -> dict[str, str]:
        """Readable names for the ids ``ctl usage --by`` groups on: a key's
        name (with its id), a project/team path, an org's name."""
        if by == "key":
            return {k.id: f"{k.name} ({k.id})" for k in await self._store.list_keys()} | {
                "": "(no key)"
            }
        if by == "model":
            return {}
        names: dict[str, str] = {"": "(personal keys)"}
        for path in await self._store.list_tree():
            names[path.project.id] = path.path
            names[path.team.id] = f"{path.org.name}/{path.team.name}"
            names[path.org.id] = path.org.name
        return names

    def forget_key(self, key_id: str) -> None:
        """After a revoke: the key's cached path and its limiter counters go
        (tenancy-and-keys.md: revoking a key clears its limiter counters)."""
        self._resolver.forget()
        if self._accountant is not None:
            self._accountant.forget_key(key_id)

    @staticmethod
    def _key_doc(record: KeyRecord, path: ProjectPath | None) -> dict[str, Any]:
        return {
            "id": record.id,
            "name": record.name,
            "prefix": record.prefix,
            "project": path.path if path is not None else None,
            "person": record.owner or None,
            "band": record.band,
            "created_at": record.created_at,
            "is_admin": record.is_admin,
            "revoked_at": record.revoked_at,
            "expires_at": record.expires_at,
            "limits": _limits_doc(record.limits),
        }


_TreePlan = list[tuple[str, object, str, object, str, object, list[dict[str, Any]]]]


def _parse_tree(doc: object) -> _TreePlan:
    allowed = {
        "orgs": {"name", "limits", "teams"},
        "teams": {"name", "limits", "projects"},
        "projects": {"name", "limits", "keys"},
        "keys": {"name", "band", "expires"},
    }

    def items(parent: object, key: str, where: str) -> list[dict[str, Any]]:
        value = parent.get(key, []) if isinstance(parent, dict) else None
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ValueError(f"{where}.{key} must be a list of objects")
        for v in value:
            if not isinstance(v.get("name"), str) or not v["name"]:
                raise ValueError(f"every entry of {where}.{key} needs a 'name'")
            unknown = set(v) - allowed[key]
            if unknown:
                raise ValueError(f"{where}.{key} {v['name']!r}: unknown field(s) {sorted(unknown)}")
        return value

    if not isinstance(doc, dict) or set(doc) - {"orgs"}:
        raise ValueError("the tree must be an object with just 'orgs'")
    plan: _TreePlan = []
    for org in items(doc, "orgs", "$"):
        for team in items(org, "teams", org["name"]):
            for proj in items(team, "projects", f"{org['name']}/{team['name']}"):
                where = f"{org['name']}/{team['name']}/{proj['name']}"
                parse_project_path(where)
                keys = items(proj, "keys", where)
                for limits in (org.get("limits"), team.get("limits"), proj.get("limits")):
                    if limits is not None:
                        _limits_from(limits, Limits())
                plan.append(
                    (
                        org["name"],
                        org.get("limits"),
                        team["name"],
                        team.get("limits"),
                        proj["name"],
                        proj.get("limits"),
                        keys,
                    )
                )
    return plan

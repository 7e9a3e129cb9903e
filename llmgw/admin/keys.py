"""The admin API's keys, tenancy tree and limits: the rules, and their routes.

Rules: keys belong to a project, or to a person (personal keys: their own
limits and the defaults only); a project path that does not exist yet is
created (and the answer says which levels were made); ``auth.max_key_ttl``
caps a key's life and is the expiry of keys made without one; a level's
limits only narrow what is above it (the accountant enforces that along the
path); ``keys init`` is idempotent and never re-parents a team or project;
revoking a key clears its limiter counters. A band, a model or a level
that does not exist is refused (400 ``unknown_band``, 400
``model_not_found``, 404 ``not_found``) with the names that do. (The admin
API itself is opened by the admin token, never by a key:
:mod:`llmgw.auth.admin_token`.)

Money: budgets are given in currency units (``25`` or ``"25.50"``) and kept
in integer micro-units (``25_000_000``), the unit of prices.

Routes (a key is :func:`llmgw.admin.views.key_view`, never its secret
except where said):

- ``POST /api/v1/keys`` ``{"name", "project"? | "person"?, "expires"?,
  "band"?}`` → 201, the key with ``"key"`` (its secret, shown once) and
  ``"created"`` (tree levels made);
- ``GET /api/v1/keys`` → ``{"data": [key]}``;
- ``POST /api/v1/keys/<id>/rotate`` → the key with a new ``"key"``; 409
  ``key_revoked`` for a revoked or expired key;
- ``POST /api/v1/keys/<id>/revoke`` → ``{"id", "revoked": true}``; 409
  ``already_revoked``;
- ``POST /api/v1/tree`` (:meth:`KeysService.init_tree`) → ``{"created",
  "keys"}``; ``GET /api/v1/tree`` → ``{"data": [{"path", "project_id",
  "limits": {"org", "team", "project"}}]}``;
- ``PUT /api/v1/limits/<org|team|project|key>/<path or id>`` (limits, null
  clears one) → ``{"scope", "id", "limits"}``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, Final

import attrs
import trio
from quart_trio import QuartTrio

from llmgw import errors
from llmgw.accounting.accountant import Accountant
from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.auth.tree import ScopeResolver, parse_project_path
from llmgw.settings import DEFAULT_BANDS, AuthSettings, parse_duration_s
from llmgw.store import Store
from llmgw.store.records import Limits, Org, Project, Team

from .errors import BadRequest, Clash, NoSuch, known_names
from .inputs import json_body
from .views import MICROS_PER_UNIT, key_view, limits_view

__all__ = ["DEFAULT_PROJECT", "KeysService", "add_key_routes", "parse_budget_micros"]

#: Where keys made without ``--project`` go (a fresh install's one project).
DEFAULT_PROJECT: Final = "default/default/default"
#: The largest budget accepted, in currency units.
MAX_BUDGET_UNITS: Final = 10**12
#: The largest rpm or tpm a level may have.
MAX_RATE: Final = 10**12
#: Key names and sign-in addresses: printable, no control characters.
_PRINTABLE: Final = re.compile(r"^[^\x00-\x1f\x7f]+$")
_LIMIT_FIELDS: Final = ("rpm", "tpm", "budget_day", "budget_month", "models")
_PERSON: Final = re.compile(r"^[^@\s]{1,64}@[^@\s]{1,255}$")


def _project_path(path: str) -> tuple[str, str, str]:
    """:func:`~llmgw.auth.tree.parse_project_path`, its error in the tree.

    Raises:
        InvalidInput: not ``ORG/TEAM/PROJECT``.
    """
    try:
        return parse_project_path(path)
    except ValueError as exc:
        raise errors.InvalidInput(str(exc)) from None


def parse_budget_micros(value: object) -> int | None:
    """Currency units (``25``, ``"25.50"``) → integer micro-units; None stays None.

    Raises:
        InvalidInput: not a non-negative amount.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise errors.InvalidInput(f"{value!r} is not an amount")
    text = str(value)
    if len(text) > 32:
        raise errors.InvalidInput(f"{text[:32]!r}… is not an amount like 25 or 25.50")
    try:
        amount = Decimal(text)
    except InvalidOperation:
        raise errors.InvalidInput(f"{value!r} is not an amount like 25 or 25.50") from None
    if not amount.is_finite() or amount < 0:
        raise errors.InvalidInput(f"{value!r} is not a non-negative amount")
    if amount > MAX_BUDGET_UNITS:
        raise errors.InvalidInput(
            f"{value!r} is more than the largest budget, {MAX_BUDGET_UNITS:,}"
        )
    micros = int(amount * MICROS_PER_UNIT)
    if micros == 0 and amount > 0:
        raise errors.InvalidInput(f"{value!r} is less than one micro-unit (0.000001)")
    return micros


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _limits_from(doc: object, base: Limits) -> Limits:
    if not isinstance(doc, dict):
        raise errors.InvalidInput("limits must be a JSON object")
    unknown = set(doc) - set(_LIMIT_FIELDS)
    if unknown:
        raise errors.InvalidInput(
            f"unknown limit(s) {sorted(unknown)}; known: {', '.join(_LIMIT_FIELDS)}"
        )
    changes: dict[str, Any] = {}
    for name in ("rpm", "tpm"):
        if name in doc:
            value = doc[name]
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RATE
            ):
                raise errors.InvalidInput(
                    f"'{name}' must be a whole number from 0 to {MAX_RATE:,}, or null to clear it"
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
            raise errors.InvalidInput("'models' must be a list of model names, or null to inherit")
        if models is not None and not models:
            raise errors.InvalidInput(
                "'models' must name at least one model (null inherits the level above)"
            )
        changes["models"] = None if models is None else tuple(models)
    return attrs.evolve(base, **changes)


class KeysService:
    """What the admin API's key, tree and limits routes do."""

    def __init__(
        self,
        store: Store,
        authenticator: KeyAuthenticator,
        resolver: ScopeResolver,
        settings: AuthSettings,
        accountant: Accountant | None = None,
        *,
        bands: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        """Args:
        bands: the names of the live admission bands
            (``router.admission.bands``); a key's band must be one of them.
            ``None``: the default bands.
        """
        self._bands = bands or (lambda: [band.name for band in DEFAULT_BANDS])
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
            raise errors.InvalidInput(f"'expires': {exc}") from None
        if life_s <= 0:
            raise errors.InvalidInput("'expires' must be a positive duration like 30d")
        if cap_s is not None and life_s > cap_s:
            raise errors.InvalidInput(
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

        Returns:
            The key's view with ``"key"`` (its secret, shown only here) and
            ``"created"`` (the tree levels made, ``"org Acme"``, …).

        Raises:
            InvalidInput: a bad path, person, expiry or band (400
                ``unknown_band`` for a band not in ``router.admission.bands``,
                naming those), or both a project and a person.
        """
        now = time.time()
        if not _PRINTABLE.match(name) or len(name) > 200:
            raise errors.InvalidInput("a key's name is 1 to 200 printable characters")
        if project is not None and not isinstance(project, str):
            raise errors.InvalidInput("'project' must be a path like Acme/ml/train")
        if not isinstance(band, str) or len(band) > 64 or (band and not _PRINTABLE.match(band)):
            raise errors.InvalidInput("'band' must be a short name")
        self._check_band(band)
        expires_at = self._expiry(expires, now)
        secret, record = new_key(name, now=now)
        if person is not None:
            if project is not None:
                raise errors.InvalidInput("a key belongs to a project or to a person, not both")
            if (
                not isinstance(person, str)
                or not _PERSON.match(person)
                or not _PRINTABLE.match(person)
            ):
                raise errors.InvalidInput("'person' must be a sign-in address like ada@example.com")
            record = attrs.evolve(record, owner=person, band=band, expires_at=expires_at)
            await self._store.insert_key(record)
            return {**key_view(record, None), "key": secret, "created": []}
        org, team, proj = _project_path(project or DEFAULT_PROJECT)
        path, created = await self._store.ensure_project(org, team, proj, now)
        record = attrs.evolve(record, project_id=path.project.id, band=band, expires_at=expires_at)
        await self._store.insert_key(record)
        return {**key_view(record, path), "key": secret, "created": created}

    def _check_band(self, band: str, where: str = "") -> None:
        """Raises BadRequest (``unknown_band``) for a band that is not defined;
        "" (the default band) passes."""
        bands = list(self._bands())
        if band and band not in bands:
            raise BadRequest(
                f"{where}No band {band!r}; {known_names('bands', bands)} (router.admission.bands).",
                code="unknown_band",
                param="band",
            )

    async def _check_models(self, models: Sequence[str] | None, where: str = "") -> None:
        """Raises BadRequest (``model_not_found``) for a name that is not a
        model of the catalog (an alias is named as such)."""
        if models is None:
            return
        catalog = await self._store.list_models()
        names = {m.name for m in catalog}
        for name in models:
            if name in names:
                continue
            owner = next((m.name for m in catalog if name in m.aliases), None)
            if owner is not None:
                raise BadRequest(
                    f"{where}{name!r} is an alias of {owner!r}; limits name models by their name.",
                    code="model_not_found",
                    param="models",
                )
            raise BadRequest(
                f"{where}No model {name!r} in the catalog; {known_names('models', names)}.",
                code="model_not_found",
                param="models",
            )

    async def check_key(self, key_id: str) -> None:
        """Raises NotFound (listing the keys there are, revoked ones too)
        when there is no key ``key_id``."""
        if await self._store.get_key(key_id) is None:
            ids = [k.id for k in await self._store.list_keys()]
            raise NoSuch(f"No key {key_id!r}; {known_names('keys', ids, hint='llmgw keys list')}.")

    async def _no_key(self, key_id: str) -> NoSuch:
        ids = [k.id for k in await self._store.list_keys() if k.revoked_at is None]
        return NoSuch(
            f"No key {key_id!r}; {known_names('live keys', ids, hint='llmgw keys list')}."
        )

    async def rotate(self, key_id: str) -> dict[str, Any]:
        """A new secret for a key; the old one is refused at once.

        Returns:
            The key's view with its new ``"prefix"`` and ``"key"`` (the secret).

        Raises:
            NotFound: no such key. Refused (409 ``key_revoked``): the key is revoked
                or expired.
        """
        key = await self._store.get_key(key_id)
        if key is None:
            raise await self._no_key(key_id)
        if key.revoked_at is not None:
            raise Clash(f"Key {key_id!r} is revoked; make a new one.", code="key_revoked")
        if key.expires_at is not None and key.expires_at <= time.time():
            raise Clash(f"Key {key_id!r} has expired; make a new one.", code="key_revoked")
        secret, fresh = new_key(key.name)
        await self._store.update_key(
            attrs.evolve(key, key_hash=fresh.key_hash, prefix=fresh.prefix)
        )
        self._auth.forget(key_id)
        path = await self._store.get_project_path(key.project_id) if key.project_id else None
        return {**key_view(key, path), "prefix": fresh.prefix, "key": secret}

    async def list_keys(self) -> list[dict[str, Any]]:
        """Every key's view, revoked ones too (never a secret)."""
        paths = {p.project.id: p for p in await self._store.list_tree()}
        last_used = await self._store.keys_last_used()
        return [
            key_view(k, paths.get(k.project_id or ""), last_used=last_used.get(k.id))
            for k in await self._store.list_keys()
        ]

    async def tree(self) -> list[dict[str, Any]]:
        """Every project: ``{"path", "project_id", "limits": {"org", "team",
        "project"}}`` (each a limits view)."""
        return [
            {
                "path": p.path,
                "project_id": p.project.id,
                "limits": {
                    "org": limits_view(p.org.limits),
                    "team": limits_view(p.team.limits),
                    "project": limits_view(p.project.limits),
                },
            }
            for p in await self._store.list_tree()
        ]

    async def set_limits(self, scope: str, ident: str, doc: object) -> dict[str, Any]:
        """Change some of a level's limits (fields left out stay; null clears).

        ``ident``: a key id for ``key``; a path for the others (``Acme``,
        ``Acme/ml``, ``Acme/ml/train``) or the level's id.

        Returns:
            ``{"scope", "id" (the level's), "limits" (the new limits view)}``.

        Raises:
            NotFound: no such level (the message lists those there are).
            InvalidInput: bad scope or limits; a model not in the catalog
                (``model_not_found``).
        """
        if scope not in ("org", "team", "project", "key"):
            raise BadRequest(
                f"No scope {scope!r}; the scopes are: org, team, project, key.",
                code="unknown_scope",
                param="scope",
            )
        target_id, current = await self._find(scope, ident)
        limits = _limits_from(doc, current)
        if isinstance(doc, dict) and doc.get("models") is not None:
            await self._check_models(limits.models)
        await self._store.set_limits(scope, target_id, limits)  # type: ignore[arg-type]
        self._auth.forget(target_id)
        self._resolver.forget()
        return {"scope": scope, "id": target_id, "limits": limits_view(limits)}

    async def _find(self, scope: str, ident: str) -> tuple[str, Limits]:
        ident = ident.strip().strip("/")
        if scope == "key":
            key = await self._store.get_key(ident)
            if key is None:
                raise await self._no_key(ident)
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
        tree = await self._store.list_tree()
        paths = {
            "org": [p.org.name for p in tree],
            "team": [f"{p.org.name}/{p.team.name}" for p in tree],
            "project": [p.path for p in tree],
        }[scope]
        raise NoSuch(f"No {scope} {ident!r}; {known_names(scope + 's', paths)}.")

    async def init_tree(self, doc: object) -> dict[str, Any]:
        """Provision a tree (and keys) from ``{"orgs": [...]}``; idempotent.

        Shape: ``orgs: [{name, limits?, teams: [{name, limits?, projects:
        [{name, limits?, keys: [{name, band?, expires?}]}]}]}]``. A key is
        made only when its project has no live key of that name; existing
        levels keep their parents; given limits are applied.

        Raises:
            InvalidInput: a malformed document (nothing is changed then).
        """
        plan = _parse_tree(doc)
        for org, org_limits, team, team_limits, project, project_limits, keys in plan:
            for key_doc in keys:
                self._check_key_doc(key_doc)
            for where, limits in (
                (org, org_limits),
                (f"{org}/{team}", team_limits),
                (f"{org}/{team}/{project}", project_limits),
            ):
                if isinstance(limits, dict) and limits.get("models") is not None:
                    await self._check_models(_limits_from(limits, Limits()).models, f"{where}: ")
        async with self._init_lock:
            return await self._apply_tree(plan)

    def _check_key_doc(self, key_doc: dict[str, Any]) -> None:
        """Everything :meth:`create` would refuse, refused before any change."""
        unknown = set(key_doc) - {"name", "band", "expires"}
        if unknown:
            raise errors.InvalidInput(
                f"key {key_doc['name']!r}: unknown field(s) {sorted(unknown)}"
            )
        band = key_doc.get("band", "")
        if not isinstance(band, str) or len(band) > 64:
            raise errors.InvalidInput(f"key {key_doc['name']!r}: 'band' must be a short name")
        self._check_band(band, f"key {key_doc['name']!r}: ")
        if not _PRINTABLE.match(key_doc["name"]) or len(key_doc["name"]) > 200:
            raise errors.InvalidInput(
                f"key {key_doc['name']!r}: a name is 1 to 200 printable characters"
            )
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

    async def revoke(self, key_id: str) -> dict[str, Any]:
        """Revoke a key: it is refused at once, and its cached path and its
        limiter counters go.

        Raises:
            NotFound: no such key. Refused (409 ``already_revoked``): the key
                is already revoked.
        """
        key = await self._store.get_key(key_id)
        if key is None:
            raise await self._no_key(key_id)
        if key.revoked_at is not None:
            raise Clash(f"Key {key_id!r} is already revoked.", code="already_revoked")
        await self._store.revoke_key(key_id, time.time())
        self._auth.forget(key_id)
        self._resolver.forget()
        if self._accountant is not None:
            self._accountant.forget_key(key_id)
        return {"id": key_id, "revoked": True}


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
            raise errors.InvalidInput(f"{where}.{key} must be a list of objects")
        for v in value:
            if not isinstance(v.get("name"), str) or not v["name"]:
                raise errors.InvalidInput(f"every entry of {where}.{key} needs a 'name'")
            unknown = set(v) - allowed[key]
            if unknown:
                raise errors.InvalidInput(
                    f"{where}.{key} {v['name']!r}: unknown field(s) {sorted(unknown)}"
                )
        return value

    if not isinstance(doc, dict) or set(doc) - {"orgs"}:
        raise errors.InvalidInput("the tree must be an object with just 'orgs'")
    plan: _TreePlan = []
    for org in items(doc, "orgs", "$"):
        for team in items(org, "teams", org["name"]):
            for proj in items(team, "projects", f"{org['name']}/{team['name']}"):
                where = f"{org['name']}/{team['name']}/{proj['name']}"
                _project_path(where)
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


# --- the routes ---------------------------------------------------------------------

_KEY_FIELDS: Final = ("name", "project", "person", "expires", "band")


def add_key_routes(app: QuartTrio, keys: KeysService) -> None:
    """Add the routes of the module docstring to ``app``."""

    @app.post("/api/v1/keys")
    async def create_key() -> Any:
        doc = await json_body()
        if not isinstance(doc, dict):
            raise BadRequest(
                "Send a JSON object with 'name' (and 'project' or 'person', 'expires', 'band')."
            )
        unknown = set(doc) - set(_KEY_FIELDS)
        if unknown:
            raise BadRequest(f"Unknown field(s) {sorted(unknown)}.")
        name = doc.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise BadRequest("'name' is required: a string of 1 to 200 characters.")
        made = await keys.create(
            name.strip(),
            project=doc.get("project"),
            person=doc.get("person"),
            expires=doc.get("expires"),
            band=doc.get("band") or "",
        )
        return made, 201

    @app.get("/api/v1/keys")
    async def list_keys() -> Any:
        return {"data": await keys.list_keys()}

    @app.post("/api/v1/keys/<key_id>/rotate")
    async def rotate_key(key_id: str) -> Any:
        return await keys.rotate(key_id)

    @app.post("/api/v1/keys/<key_id>/revoke")
    async def revoke_key(key_id: str) -> Any:
        return await keys.revoke(key_id)

    @app.post("/api/v1/tree")
    async def init_tree() -> Any:
        return await keys.init_tree(await json_body())

    @app.get("/api/v1/tree")
    async def list_tree() -> Any:
        return {"data": await keys.tree()}

    @app.put("/api/v1/limits/<scope>/<path:ident>")
    async def set_limits(scope: str, ident: str) -> Any:
        return await keys.set_limits(scope, ident, await json_body())

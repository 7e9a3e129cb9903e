"""Admin routes of the live settings: the whole document, its history, one
key, and the answer cache per project (a setting too).

The settings are the whole ``ServerSettings`` document, durations in
seconds; they reach every control plane through the store within about a
second.

- ``GET /api/v1/config`` → ``{"version", "document"}``;
- ``GET /api/v1/config/history?last=N`` → ``{"data": [{"version",
  "changed_at", "actor", "note", "changed": [dotted keys changed from the
  version before; none for version 1], "document"}]}``, newest first;
- ``PUT /api/v1/config`` ``{"document", "expected_version"?, "note"?}``:
  replace it whole (validated: 400 naming the key path; 409 when
  ``expected_version`` is not the live version);
- ``PATCH /api/v1/config`` ``{"key": "router.admission.bands", "value": …,
  "expected_version"?, "note"?}``: set one dotted key (400 on an unknown
  key path or a bad value).

A change that names a ``router.admission.default_band`` that is not one of
``router.admission.bands`` is refused (400 ``invalid_settings``, naming the
bands). Bands replaced without the default band are taken: the keys of a
band no longer defined fall back to the band of highest priority.

Both changes answer ``{"version", "changed", "document"}``, plus
``"restart_needed": [dotted keys]`` when a changed key is read only at start
(:data:`llmgw.control.live.RESTART_KEYS`).

The exact answer cache (``docs/api.md``): ``PUT
/api/v1/projects/<ORG/TEAM/PROJECT>/cache`` ``{"ttl": "24h"}`` turns it on
for a project (``router.cache.projects`` keyed by the project's id),
``DELETE`` the same path turns it off; both answer ``{"project",
"project_id", "cache", "ttl_s", "changed", "version"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from quart_trio import QuartTrio

from llmgw.auth.tree import parse_project_path
from llmgw.control.live import RESTART_KEYS, LiveSettings
from llmgw.settings import (
    SettingsError,
    changed_keys,
    parse_duration_s,
    settings_from_doc,
    with_key,
)
from llmgw.store import Store

from .errors import BadRequest, NoSuch, known_names
from .inputs import actor, json_object, optional_int, query_int

__all__ = ["MAX_HISTORY", "add_config_routes"]

#: The most versions one history request may ask for.
MAX_HISTORY: Final = 1000

_Change = Callable[[dict[str, Any]], dict[str, Any]]


def _default_band(doc: dict[str, Any]) -> object:
    router = doc.get("router")
    admission = router.get("admission") if isinstance(router, dict) else None
    return admission.get("default_band") if isinstance(admission, dict) else None


def _known_default_band(change: _Change) -> _Change:
    """``change``, refusing a new ``router.admission.default_band`` that
    names no band (raises SettingsError, listing the bands)."""

    def checked(doc: dict[str, Any]) -> dict[str, Any]:
        before = _default_band(doc)
        changed = change(doc)
        if _default_band(changed) == before:
            return changed
        admission = settings_from_doc(changed).router.admission
        bands = [band.name for band in admission.bands]
        if admission.default_band not in bands:
            raise SettingsError(
                f"router.admission.default_band: no band {admission.default_band!r}; "
                f"{known_names('bands', bands)} (router.admission.bands)"
            )
        return changed

    return checked


def add_config_routes(app: QuartTrio, store: Store, live: LiveSettings) -> None:
    """Add the routes of the module docstring to ``app``.

    Args:
        store: where the settings' history is kept.
        live: this control plane's settings state (shared with the
            settings loop of :func:`llmgw.control.live.serve_settings`).
    """

    def settings_answer(version: int, changed: bool, before: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = {"version": version, "changed": changed, "document": live.doc}
        if changed:
            moved = changed_keys(before, live.doc)
            restart = [
                k for k in moved if any(k == r or k.startswith(r + ".") for r in RESTART_KEYS)
            ]
            if restart:
                answer["restart_needed"] = restart
        return answer

    @app.get("/api/v1/config")
    async def get_config() -> Any:
        await live.refresh()
        return {"version": live.version, "document": live.doc}

    @app.get("/api/v1/config/history")
    async def config_history() -> Any:
        last = query_int("last", 20)
        if last is None or not 1 <= last <= MAX_HISTORY:
            raise BadRequest(f"'last' must be a whole number from 1 to {MAX_HISTORY}.")
        changes = await store.settings_history(last + 1)
        data = []
        for at, change in enumerate(changes[:last]):
            # The first version (the seed) changed nothing: it is where the list starts.
            before = changes[at + 1].document if at + 1 < len(changes) else change.document
            data.append(
                {
                    "version": change.version,
                    "changed_at": change.changed_at,
                    "actor": change.actor,
                    "note": change.note,
                    "changed": changed_keys(before, change.document),
                    "document": change.document,
                }
            )
        return {"data": data}

    @app.put("/api/v1/config")
    async def put_config() -> Any:
        body = await json_object(allowed=("document", "expected_version", "note"))
        document = body.get("document")
        if not isinstance(document, dict):
            raise BadRequest("'document' must be the whole settings document (an object).")
        before = dict(live.doc)
        version, changed = await live.update(
            _known_default_band(lambda _: dict(document)),
            actor=actor(),
            note=str(body.get("note") or "replaced whole"),
            expected_version=optional_int(body, "expected_version"),
        )
        return settings_answer(version, changed, before)

    @app.patch("/api/v1/config")
    async def patch_config() -> Any:
        body = await json_object(allowed=("key", "value", "expected_version", "note"))
        key = body.get("key")
        if not isinstance(key, str) or "value" not in body:
            raise BadRequest("Send {'key': 'router.admission.bands', 'value': …}.")
        value = body["value"]
        before = dict(live.doc)
        version, changed = await live.update(
            _known_default_band(lambda doc: with_key(doc, key, value)),
            actor=actor(),
            note=str(body.get("note") or f"set {key}"),
            expected_version=optional_int(body, "expected_version"),
        )
        return settings_answer(version, changed, before)

    # --- the answer cache per project ---------------------------------------------

    async def set_project_cache(path: str, ttl_s: float | None) -> dict[str, Any]:
        try:
            org, team, name = parse_project_path(path)
        except ValueError as exc:
            raise BadRequest(str(exc), code="invalid_project", param="project") from None
        found = await store.find_project(org, team, name)
        if found is None:
            raise NoSuch(f"No project {path!r}.", code="project_not_found", param="project")
        project_id = found.project.id

        def change(doc: dict[str, Any]) -> dict[str, Any]:
            router = doc.get("router") or {}
            cache = router.get("cache") or {}
            projects = dict(cache.get("projects") or {})
            if ttl_s is None:
                projects.pop(project_id, None)
            else:
                projects[project_id] = ttl_s
            return with_key(doc, "router.cache.projects", projects)

        version, changed = await live.update(
            change,
            actor=actor(),
            note=f"answer cache {'off' if ttl_s is None else f'{ttl_s:g} s'} for {found.path}",
        )
        return {
            "project": found.path,
            "project_id": project_id,
            "cache": ttl_s is not None,
            "ttl_s": ttl_s,
            "changed": changed,
            "version": version,
        }

    @app.put("/api/v1/projects/<path:project>/cache")
    async def cache_on(project: str) -> Any:
        doc = await json_object(allowed=("ttl",))
        try:
            ttl_s = parse_duration_s(doc.get("ttl", "24h"))
        except ValueError as exc:
            raise BadRequest(f"ttl: {exc}", code="invalid_ttl", param="ttl") from None
        if ttl_s <= 0:
            raise BadRequest("ttl must be longer than 0 s.", code="invalid_ttl", param="ttl")
        return await set_project_cache(project, ttl_s)

    @app.delete("/api/v1/projects/<path:project>/cache")
    async def cache_off(project: str) -> Any:
        return await set_project_cache(project, None)

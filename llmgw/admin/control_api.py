"""Admin API routes that steer the cluster: live settings, whole-system
stop/start, the catalog's models, nodes and replicas
(``shared/spec/console-and-cli.md``, Admin REST API;
``reconciler-and-lifecycle.md``; ``catalog-and-placement.md``, Model commands).

Every route is JSON in and out; the admin key check of
:func:`llmgw.admin.app.make_admin_app` applies. Errors are
``{"error": {"message", "type", "code", "param"}}`` with status 400 (bad
input; the message names the key path or field), 404 (no such model or
route), 409 (a concurrent change: re-read and retry, or a name taken), 503
(the store cannot be reached). After each change the cluster is poked so the
reconciler (on the leader) acts at once; changes made here reach the other
control planes through the store within about a second.

Settings (the whole ``ServerSettings`` document, durations in seconds):

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

Both answer ``{"version", "changed", "document"}``, plus ``"restart_needed":
[dotted keys]`` when a changed key is read only at start
(:data:`llmgw.control.live.RESTART_KEYS`).

Whole system: ``POST /api/v1/system/stop`` / ``start`` set or clear
``serving.stopped`` → ``{"stopped", "changed", "version"}``.

Models (``<name>`` is a model's name; ``GET`` also takes an alias):

- ``GET /api/v1/models`` → ``{"data": [view]}``; ``GET /api/v1/models/<name>``
  → one view plus ``"shards"``. A view is ``{"name", "entry" (the catalog
  entry as stored), "engine", "external", "on_demand", "stopped",
  "replicas": {"wanted", "ready", "starting", "failed"}, "waiting":
  {replica id: why it is not placed}}``; ``wanted`` is
  what the reconciler aims at now (0 while the model or the whole system is
  stopped, or for an idle on-demand model);
- ``POST /api/v1/models`` (the entry form, 201; 409 if the name is taken),
  ``PUT /api/v1/models/<name>`` (replace the entry whole; a changed profile
  rolls the replicas);
- ``POST /api/v1/models/<name>/scale`` ``{"replicas": N, "profile"?}``: a
  stopped model starts at N; a model with several profiles needs ``profile``;
- ``POST …/stop`` (keeps the counts for ``start``), ``POST …/start``;
- ``DELETE /api/v1/models/<name>[?purge=1]``: see :func:`purge_weights`;
- ``POST …/context`` ``{"tokens"?, "slots"?, "max_output"?, "profile"?}``;
  see :func:`change_context`;
- ``GET …/placement`` → ``{"model", "nodes": [verdict]}``, every node and
  why it can or cannot take a replica.

The exact answer cache (``shared/spec/caching.md``): ``PUT
/api/v1/projects/<ORG/TEAM/PROJECT>/cache`` ``{"ttl": "24h"}`` turns it on
for a project (``router.cache.projects`` keyed by the project's id),
``DELETE`` the same path turns it off.

Nodes and replicas: ``GET /api/v1/nodes``, ``GET /api/v1/replicas``
(``?engine_keys=1`` adds each replica's engine key, for ``ctl bench``),
``POST /api/v1/nodes/<id>/cordon`` (no new replicas), ``/drain`` (cordon and
move its replicas away), ``/uncordon`` (clears both); these edit
``nodes.cordoned`` / ``nodes.draining`` in the live settings.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio
from quart import Response, g, request
from quart_trio import QuartTrio

from llmgw.agent.protocol import ShardState
from llmgw.auth.tree import parse_project_path
from llmgw.control.catalog import CatalogError, parse_model, validate_model
from llmgw.control.cluster import Cluster, ShardInfo, engine_key
from llmgw.control.live import RESTART_KEYS, LiveSettings
from llmgw.control.placement import explain, gpu_class_of, node_room
from llmgw.control.planning import ModelFacts, PlanningError, read_model_facts
from llmgw.control.reconciler import wanted_replicas
from llmgw.gateway.errors import error_body
from llmgw.settings import SettingsError, changed_keys, parse_duration_s, with_key
from llmgw.store import Conflict, ModelRecord, Store, StoreError, model_to_doc

__all__ = [
    "MAX_REPLICAS",
    "add_control_routes",
    "change_context",
    "model_view",
    "purge_weights",
    "replica_counts",
]

log = logging.getLogger("llmgw.admin")

#: The most replicas one scale request may ask for.
MAX_REPLICAS: Final = 256
MAX_HISTORY: Final = 1000


class _Refused(Exception):
    """An answer other than 2xx: status, message, code, param."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def _error(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return Response(
        error_body(message, type=kind, code=code, param=param),
        status=status,
        content_type="application/json",
    )


def _actor() -> str:
    """Who is calling: the admin key's name and id (set by the key check)."""
    return str(getattr(g, "admin_actor", "") or "admin")


async def _json_object(*, allowed: Sequence[str] | None = None) -> dict[str, Any]:
    doc = await request.get_json(silent=True)
    if not isinstance(doc, dict):
        raise _Refused(400, "Send a JSON object.")
    if allowed is not None:
        unknown = set(doc) - set(allowed)
        if unknown:
            raise _Refused(400, f"Unknown field(s) {sorted(unknown)}; known: {sorted(allowed)}.")
    return doc


def _count(doc: dict[str, Any], name: str, *, low: int, high: int) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _Refused(400, f"'{name}' must be a whole number from {low} to {high}.", param=name)
    return value


def _optional_int(doc: dict[str, Any], name: str) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Refused(400, f"'{name}' must be a whole number.", param=name)
    return value


# --- views ------------------------------------------------------------------------


def replica_counts(model: ModelRecord, cluster: Cluster) -> dict[str, int]:
    """``{"wanted", "ready", "starting", "failed"}`` replicas of ``model``.

    A replica counts once whatever its shards: ready when all its shards
    are, failed when one is, else starting. Replicas being stopped
    (no longer wanted, or retiring after a rolling restart) are not counted.
    ``wanted`` is the reconciler's own figure
    (:func:`~llmgw.control.reconciler.wanted_replicas`): 0 for outside
    models, while the model or the whole system is stopped, and for an
    on-demand model nobody asked for lately.
    """
    states: dict[str, list[ShardState]] = {}
    for shard in cluster.shards.values():
        if shard.model != model.name or not shard.wanted or getattr(shard, "retiring", False):
            continue
        states.setdefault(shard.replica_id, []).append(shard.state)
    counts = {"ready": 0, "starting": 0, "failed": 0}
    for shard_states in states.values():
        if all(s is ShardState.READY for s in shard_states):
            counts["ready"] += 1
        elif any(s is ShardState.FAILED for s in shard_states):
            counts["failed"] += 1
        elif any(s is ShardState.STARTING for s in shard_states):
            counts["starting"] += 1
    return {"wanted": wanted_replicas(model, cluster), **counts}


def model_view(model: ModelRecord, cluster: Cluster) -> dict[str, Any]:
    """A model as the API shows it (see the module docstring)."""
    profile = model.profile
    return {
        "name": model.name,
        "entry": model_to_doc(model),
        "engine": "external" if model.is_external else (profile.engine if profile else ""),
        "external": model.is_external,
        "on_demand": model.on_demand,
        "stopped": model.stopped,
        "replicas": replica_counts(model, cluster),
        # Replicas the reconciler could not place, and why (with figures).
        "waiting": {
            replica_id: reason
            for replica_id, reason in sorted(cluster.waiting.items())
            if _REPLICA_OF.match(replica_id[len(model.name) :])
            and replica_id.startswith(model.name)
        },
    }


#: What follows a model's name in its replica ids: ``-<n>`` or ``-<n>.g<k>``.
_REPLICA_OF = re.compile(r"^-\d+(\.g\d+)?$")


def _shard_view(shard: ShardInfo, cluster: Cluster, *, with_key: bool = False) -> dict[str, Any]:
    view: dict[str, Any] = {
        "replica_id": shard.replica_id,
        "shard_id": shard.shard_id,
        "model": shard.model,
        "node_id": shard.node_id,
        "port": shard.port,
        "state": str(shard.state),
        "reason": shard.reason,
        "last_lines": list(shard.last_lines),
        "restarts": getattr(shard, "restarts", shard.failures),
        "failures": shard.failures,
        "wanted": shard.wanted,
        "retiring": bool(getattr(shard, "retiring", False)),
        "stale": bool(getattr(shard, "stale", False)),
        "compute": str(getattr(shard, "compute", "")),
        "profile": str(getattr(shard, "profile", "")),
        "fingerprint": str(getattr(shard, "fingerprint", "")),
        "progress": str(getattr(shard, "progress", "")),
        "started_at": shard.started_at,
        "ready_at": shard.ready_at,
    }
    if with_key:
        view["engine_key"] = engine_key(cluster.secret, shard.replica_id)
    return view


def _node_view(node_id: str, cluster: Cluster) -> dict[str, Any]:
    node = cluster.nodes[node_id]
    hardware = node.hardware
    nodes_settings = cluster.settings.nodes
    gpus = node.gpus or hardware.gpus
    room = node_room(cluster, node_id)
    return {
        "node_id": node.node_id,
        "address": node.address,
        "connected": node.connected,
        "agent_version": node.agent_version,
        "last_seen": node.last_seen,
        "cpu_count": hardware.cpu_count,
        "memory_total_mb": hardware.memory_total_mb,
        "memory_available_mb": node.memory_available_mb,
        "load_1m": node.load_1m,
        "memory_bandwidth_gbps": node.memory_bandwidth_gbps,
        "core_bandwidth_gbps": node.core_bandwidth_gbps,
        # What the replicas here hold, to set beside what the node has.
        "reserved": {
            "memory_gb": round(room.memory_gb, 3),
            "cpu_cores": room.cpu_cores,
            "gpu_memory_mb": {str(i): mb for i, mb in sorted(room.gpu_mb.items())},
            "whole_gpus": sorted(room.whole_cards),
        },
        "gpus": [{**attrs.asdict(gpu), "gpu_class": gpu_class_of(gpu)} for gpu in gpus],
        "engines": list(getattr(node, "engines", ())),
        "labels": dict(getattr(node, "labels", {})),
        "cordoned": node.node_id in nodes_settings.cordoned,
        "draining": node.node_id in nodes_settings.draining,
        "replicas": sorted(
            {s.replica_id for s in cluster.shards.values() if s.node_id == node.node_id}
        ),
    }


# --- model changes ----------------------------------------------------------------


def _set_replicas(model: ModelRecord, replicas: int, profile: str | None) -> ModelRecord:
    """``model`` scaled to ``replicas`` (and started if stopped).

    Raises:
        _Refused: an outside model, an unknown profile, or several profiles
            and none named.
    """
    if model.is_external:
        raise _Refused(400, f"{model.name} is served by an outside provider; nothing to scale.")
    if not model.profiles:
        raise _Refused(400, f"{model.name} has no profile to scale.")
    names = [p.name for p in model.profiles]
    if profile is None:
        if len(model.profiles) > 1:
            raise _Refused(
                400,
                f"{model.name} has several profiles ({', '.join(names)}); name one with "
                "'profile' (--profile).",
                param="profile",
            )
        profile = names[0]
    if profile not in names:
        raise _Refused(
            400, f"{model.name} has no profile {profile!r}; it has {', '.join(names)}.", "profile"
        )
    profiles = tuple(
        attrs.evolve(p, replicas=replicas) if p.name == profile else p for p in model.profiles
    )
    return attrs.evolve(model, profiles=profiles, stopped=False)


def change_context(
    model: ModelRecord,
    *,
    tokens: int | None,
    slots: int | None,
    max_output: int | None,
    profile: str | None = None,
) -> tuple[ModelRecord, bool]:
    """``model`` with a new context (``POST /api/v1/models/<name>/context``).

    ``tokens`` is a profile's ``context_tokens``: the engine's whole context
    (llama.cpp ``--ctx-size``), shared by ``slots`` parallel sequences, so
    one request gets ``tokens // slots``. Changing ``tokens`` or ``slots``
    changes the profile (every profile, or only ``profile``): the
    reconciler replaces the replicas one at a time, each successor Ready
    before its predecessor stops. Changing only ``max_output`` touches the
    catalog alone and applies at once.

    Returns:
        The new entry and whether its replicas must restart.

    Raises:
        _Refused: nothing to change, an unknown profile, a per-request
            context beyond the trained one (``context_length``, when known),
            or ``max_output`` beyond the per-request context.
    """
    if tokens is None and slots is None and max_output is None:
        raise _Refused(400, "Give 'tokens', 'slots' or 'max_output'.")
    if model.is_external and (tokens is not None or slots is not None):
        raise _Refused(400, f"{model.name} is an outside model: only 'max_output' can change.")
    if profile is not None and profile not in {p.name for p in model.profiles}:
        raise _Refused(400, f"{model.name} has no profile {profile!r}.", param="profile")
    profiles = []
    restart = False
    for p in model.profiles:
        if profile is not None and p.name != profile:
            profiles.append(p)
            continue
        new = attrs.evolve(
            p,
            context_tokens=p.context_tokens if tokens is None else tokens,
            slots=p.slots if slots is None else slots,
        )
        per_request = new.context_tokens // max(new.slots, 1)
        if model.context_length and per_request > model.context_length:
            raise _Refused(
                400,
                f"{model.name}: {new.context_tokens} tokens over {new.slots} slots is "
                f"{per_request} per request, beyond the {model.context_length} it was trained "
                f"for; use at most {model.context_length * new.slots} tokens or more slots.",
                param="tokens",
            )
        restart = restart or new != p
        profiles.append(new)
    changed = attrs.evolve(model, profiles=tuple(profiles))
    if max_output is not None:
        changed = attrs.evolve(changed, max_output=max_output)
        limit = min(
            (p.context_tokens // max(p.slots, 1) for p in changed.profiles),
            default=changed.context_length,
        )
        if changed.context_length:
            limit = min(limit, changed.context_length) if limit else changed.context_length
        if limit and max_output > limit:
            raise _Refused(
                400,
                f"{model.name}: max_output {max_output} is beyond the {limit} tokens one "
                "request may hold; raise the context first.",
                param="max_output",
            )
    return changed, restart


def _local_facts(source: str) -> ModelFacts | None:
    """The shape of a model whose weights are readable here (enables the
    trained-context and KV-head checks), else ``None``. Only headers are read."""
    if not source or "://" in source or source.startswith("hf:"):
        return None
    path = Path(source).expanduser()
    if not path.exists():
        return None
    try:
        return read_model_facts(path)
    except (PlanningError, OSError) as exc:
        log.info("cannot read the shape of %s (%s); checked without it", source, exc)
        return None


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return path != root


def purge_weights(model: ModelRecord, others: Sequence[ModelRecord], data_dir: Path) -> list[str]:
    """Delete ``model``'s weights from this control plane's data directory
    (``DELETE /api/v1/models/<name>?purge=1``); the paths deleted.

    What purge does here: the entry's ``source``, when it is a local file or
    folder *inside* ``data_dir`` (symlinks resolved) that no other catalog
    entry's source is, contains or lies in, is deleted. Anything outside the
    data directory (a ``--model`` file of yours) is never touched; remote
    sources (``hf:``, URLs) have no copy here. Copies on nodes go when their
    replicas stop (the agents' weights caches); the mirror's versions go with
    the mirror work.
    """
    if not model.source or "://" in model.source or model.source.startswith("hf:"):
        return []
    root = data_dir.expanduser().resolve()
    target = Path(model.source).expanduser().resolve()
    if not _inside(target, root) or not target.exists():
        return []
    for other in others:
        if other.name == model.name or not other.source or "://" in other.source:
            continue
        theirs = Path(other.source).expanduser().resolve()
        if theirs == target or _inside(theirs, target) or _inside(target, theirs):
            log.info("purge of %s keeps %s: %s uses it", model.name, target, other.name)
            return []
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    log.info("purged %s of %s", target, model.name)
    return [str(target)]


# --- the routes ---------------------------------------------------------------------


def add_control_routes(
    app: QuartTrio,
    store: Store,
    cluster: Cluster,
    live: LiveSettings,
    *,
    data_dir: Path | None = None,
) -> None:
    """Add the routes of the module docstring to ``app``.

    Args:
        store: the store (catalog, settings).
        cluster: the live view; poked after each change.
        live: this control plane's settings state (shared with the
            settings loop of :func:`llmgw.control.live.serve_settings`).
        data_dir: where this control plane keeps weights; ``purge`` refuses
            without one.
    """

    @app.errorhandler(_Refused)
    async def refused(exc: _Refused) -> Response:
        return _error(exc.status, exc.message, exc.code, exc.param)

    @app.errorhandler(StoreError)
    async def store_failed(exc: StoreError) -> Response:
        if isinstance(exc, Conflict):
            return _error(409, f"{exc}; read it again and retry.", "conflict")
        log.warning("admin API: store error: %s", exc)
        return _error(503, f"The store cannot be reached: {exc}", "store_unavailable")

    @app.errorhandler(SettingsError)
    async def bad_settings(exc: SettingsError) -> Response:
        return _error(400, f"Settings not valid: {exc}", "invalid_settings")

    def settings_answer(
        version: int, changed: bool, before: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        answer: dict[str, Any] = {"version": version, "changed": changed, "document": live.doc}
        if before is not None and changed:
            moved = changed_keys(before, live.doc)
            restart = [
                k for k in moved if any(k == r or k.startswith(r + ".") for r in RESTART_KEYS)
            ]
            if restart:
                answer["restart_needed"] = restart
        return answer

    # --- settings -----------------------------------------------------------------

    @app.get("/api/v1/config")
    async def get_config() -> Any:
        await live.refresh()
        return {"version": live.version, "document": live.doc}

    @app.get("/api/v1/config/history")
    async def config_history() -> Any:
        try:
            last = int(request.args.get("last", "20"))
        except ValueError:
            last = 0
        if not 1 <= last <= MAX_HISTORY:
            raise _Refused(400, f"'last' must be a whole number from 1 to {MAX_HISTORY}.")
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
        body = await _json_object(allowed=("document", "expected_version", "note"))
        document = body.get("document")
        if not isinstance(document, dict):
            raise _Refused(400, "'document' must be the whole settings document (an object).")
        before = dict(live.doc)
        version, changed = await live.update(
            lambda _: dict(document),
            actor=_actor(),
            note=str(body.get("note") or "replaced whole"),
            expected_version=_optional_int(body, "expected_version"),
        )
        return settings_answer(version, changed, before)

    @app.patch("/api/v1/config")
    async def patch_config() -> Any:
        body = await _json_object(allowed=("key", "value", "expected_version", "note"))
        key = body.get("key")
        if not isinstance(key, str) or "value" not in body:
            raise _Refused(400, "Send {'key': 'router.admission.bands', 'value': …}.")
        value = body["value"]
        before = dict(live.doc)
        version, changed = await live.update(
            lambda doc: with_key(doc, key, value),
            actor=_actor(),
            note=str(body.get("note") or f"set {key}"),
            expected_version=_optional_int(body, "expected_version"),
        )
        return settings_answer(version, changed, before)

    # --- whole system ----------------------------------------------------------------

    async def set_stopped(stopped: bool) -> dict[str, Any]:
        version, changed = await live.update(
            lambda doc: with_key(doc, "serving.stopped", stopped),
            actor=_actor(),
            note="llmgw stop" if stopped else "llmgw start",
        )
        cluster.poke()
        return {"stopped": stopped, "changed": changed, "version": version}

    @app.post("/api/v1/system/stop")
    async def system_stop() -> Any:
        return await set_stopped(True)

    @app.post("/api/v1/system/start")
    async def system_start() -> Any:
        return await set_stopped(False)

    # --- models -----------------------------------------------------------------------

    async def find_model(name: str, *, aliases: bool = False) -> ModelRecord:
        model = await store.get_model(name)
        if model is None and aliases:
            model = next((m for m in await store.list_models() if name in m.aliases), None)
        if model is None:
            raise _Refused(404, f"No model {name!r} in the catalog.", "model_not_found")
        return model

    async def validate(model: ModelRecord, *, new: bool) -> None:
        existing = [m for m in await store.list_models() if m.name != model.name]
        facts = await trio.to_thread.run_sync(_local_facts, model.source)
        try:
            validate_model(model, existing, new=new, facts=facts)
        except CatalogError as exc:
            raise _Refused(400, str(exc), "invalid_model") from None

    def parse(doc: dict[str, Any]) -> ModelRecord:
        try:
            return parse_model(doc)
        except CatalogError as exc:
            raise _Refused(400, str(exc), "invalid_model") from None

    async def save(model: ModelRecord) -> dict[str, Any]:
        await store.put_model(model)
        # A new dict, never changed in place: readers (the gateway's alias
        # map) notice the catalog changed by its identity.
        cluster.models = {**cluster.models, model.name: model}
        cluster.poke()
        return model_view(model, cluster)

    async def change_model(
        name: str, change: Callable[[ModelRecord], ModelRecord]
    ) -> tuple[ModelRecord, ModelRecord]:
        model = await find_model(name)
        changed = change(model)
        if changed != model:
            await validate(changed, new=False)
            await save(changed)
        return model, changed

    @app.get("/api/v1/models")
    async def list_models() -> Any:
        return {"data": [model_view(m, cluster) for m in await store.list_models()]}

    @app.get("/api/v1/models/<name>")
    async def get_model(name: str) -> Any:
        model = await find_model(name, aliases=True)
        view = model_view(model, cluster)
        view["shards"] = [
            _shard_view(s, cluster) for s in cluster.shards.values() if s.model == model.name
        ]
        return view

    @app.post("/api/v1/models")
    async def add_model() -> Any:
        doc = await _json_object()
        model = parse(doc)
        if await store.get_model(model.name) is not None:
            raise _Refused(
                409,
                f"A model {model.name!r} is already in the catalog; change it with PUT "
                f"/api/v1/models/{model.name} (ctl model update) or remove it first.",
                "model_exists",
            )
        if not model.created_at:
            model = attrs.evolve(model, created_at=time.time())
        await validate(model, new=True)
        view = await save(model)
        log.info("model %s added by %s", model.name, _actor())
        return view, 201

    @app.put("/api/v1/models/<name>")
    async def replace_model(name: str) -> Any:
        doc = await _json_object()
        doc.setdefault("name", name)
        if doc["name"] != name:
            raise _Refused(400, f"The entry is named {doc['name']!r}, not {name!r}.", param="name")
        old = await find_model(name)
        model = parse(doc)
        if not model.created_at:
            model = attrs.evolve(model, created_at=old.created_at or time.time())
        await validate(model, new=False)
        view = await save(model)
        view["restart"] = old.profiles != model.profiles or old.source != model.source
        return view

    @app.post("/api/v1/models/<name>/scale")
    async def scale_model(name: str) -> Any:
        body = await _json_object(allowed=("replicas", "profile"))
        replicas = _count(body, "replicas", low=0, high=MAX_REPLICAS)
        if replicas is None:
            raise _Refused(400, "'replicas' is required.", param="replicas")
        profile = body.get("profile")
        if profile is not None and not isinstance(profile, str):
            raise _Refused(400, "'profile' must be a profile's name.", param="profile")
        old, new = await change_model(name, lambda m: _set_replicas(m, replicas, profile))
        view = model_view(new, cluster)
        view["started"] = old.stopped and not new.stopped
        return view

    async def set_model_stopped(name: str, stopped: bool) -> dict[str, Any]:
        old, new = await change_model(name, lambda m: attrs.evolve(m, stopped=stopped))
        view = model_view(new, cluster)
        view["changed"] = old != new
        return view

    @app.post("/api/v1/models/<name>/stop")
    async def stop_model(name: str) -> Any:
        return await set_model_stopped(name, True)

    @app.post("/api/v1/models/<name>/start")
    async def start_model(name: str) -> Any:
        return await set_model_stopped(name, False)

    @app.delete("/api/v1/models/<name>")
    async def remove_model(name: str) -> Any:
        purge = request.args.get("purge", "").lower() in ("1", "true", "yes")
        model = await find_model(name)
        if purge and data_dir is None:
            raise _Refused(400, "This control plane has no data directory to purge from.")
        await store.delete_model(name)
        cluster.models = {k: v for k, v in cluster.models.items() if k != name}
        cluster.poke()
        purged: list[str] = []
        if purge and data_dir is not None:
            others = await store.list_models()
            try:
                purged = await trio.to_thread.run_sync(purge_weights, model, others, data_dir)
            except OSError as exc:
                raise _Refused(
                    500, f"{name} removed, but its weights could not be deleted: {exc}"
                ) from None
        log.info("model %s removed by %s%s", name, _actor(), " (purged)" if purge else "")
        return {"name": name, "removed": True, "purged": purged}

    @app.post("/api/v1/models/<name>/context")
    async def model_context(name: str) -> Any:
        body = await _json_object(allowed=("tokens", "slots", "max_output", "profile"))
        tokens = _count(body, "tokens", low=1, high=1 << 24)
        slots = _count(body, "slots", low=1, high=1024)
        max_output = _count(body, "max_output", low=0, high=1 << 24)
        profile = body.get("profile")
        if profile is not None and not isinstance(profile, str):
            raise _Refused(400, "'profile' must be a profile's name.", param="profile")
        restart = False

        def change(model: ModelRecord) -> ModelRecord:
            nonlocal restart
            changed, restart = change_context(
                model, tokens=tokens, slots=slots, max_output=max_output, profile=profile
            )
            return changed

        _, new = await change_model(name, change)
        view = model_view(new, cluster)
        view["restart"] = restart
        return view

    @app.get("/api/v1/models/<name>/placement")
    async def model_placement(name: str) -> Any:
        model = await find_model(name, aliases=True)
        return {"model": model.name, "nodes": [v.to_doc() for v in explain(model, cluster)]}

    # --- nodes and replicas --------------------------------------------------------------

    @app.get("/api/v1/nodes")
    async def list_nodes() -> Any:
        return {"data": [_node_view(node_id, cluster) for node_id in sorted(cluster.nodes)]}

    @app.get("/api/v1/replicas")
    async def list_replicas() -> Any:
        keys = request.args.get("engine_keys", "").lower() in ("1", "true", "yes")
        shards = sorted(cluster.shards.values(), key=lambda s: (s.model, s.replica_id, s.shard_id))
        return {"data": [_shard_view(s, cluster, with_key=keys) for s in shards]}

    async def mark_node(node_id: str, action: str) -> dict[str, Any]:
        def change(doc: dict[str, Any]) -> dict[str, Any]:
            nodes = doc.get("nodes") or {}
            cordoned = [n for n in nodes.get("cordoned", []) if n != node_id]
            draining = [n for n in nodes.get("draining", []) if n != node_id]
            if action in ("cordon", "drain"):
                cordoned.append(node_id)
            if action == "drain":
                draining.append(node_id)
            return with_key(
                with_key(doc, "nodes.cordoned", sorted(cordoned)),
                "nodes.draining",
                sorted(draining),
            )

        version, changed = await live.update(change, actor=_actor(), note=f"{action} {node_id}")
        cluster.poke()
        nodes_settings = cluster.settings.nodes
        return {
            "node_id": node_id,
            "known": node_id in cluster.nodes,
            "cordoned": node_id in nodes_settings.cordoned,
            "draining": node_id in nodes_settings.draining,
            "changed": changed,
            "version": version,
        }

    @app.post("/api/v1/nodes/<node_id>/cordon")
    async def cordon(node_id: str) -> Any:
        return await mark_node(node_id, "cordon")

    @app.post("/api/v1/nodes/<node_id>/uncordon")
    async def uncordon(node_id: str) -> Any:
        return await mark_node(node_id, "uncordon")

    @app.post("/api/v1/nodes/<node_id>/drain")
    async def drain(node_id: str) -> Any:
        return await mark_node(node_id, "drain")

    # --- the answer cache per project ---------------------------------------------------

    async def set_project_cache(path: str, ttl_s: float | None) -> dict[str, Any]:
        try:
            org, team, name = parse_project_path(path)
        except ValueError as exc:
            raise _Refused(400, str(exc), "invalid_project", "project") from None
        found = await store.find_project(org, team, name)
        if found is None:
            raise _Refused(404, f"No project {path!r}.", "project_not_found", "project")
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
            actor=_actor(),
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
        doc = await _json_object(allowed=("ttl",))
        try:
            ttl_s = parse_duration_s(doc.get("ttl", "24h"))
        except ValueError as exc:
            raise _Refused(400, f"ttl: {exc}", "invalid_ttl", "ttl") from None
        if ttl_s <= 0:
            raise _Refused(400, "ttl must be longer than 0 s.", "invalid_ttl", "ttl")
        return await set_project_cache(project, ttl_s)

    @app.delete("/api/v1/projects/<path:project>/cache")
    async def cache_off(project: str) -> Any:
        return await set_project_cache(project, None)

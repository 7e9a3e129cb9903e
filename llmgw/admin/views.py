"""How the admin API shows llmgw's objects: one cattrs converter from the
domain's attrs classes to JSON types, and the views built with it.

A view is the object's own fields, unstructured, less those that are
internal (a node's send function, a key's hash, a shard's bookkeeping), with
the few renames the API has always used (a key's ``owner`` is its
``person``; budgets in micro-units are ``budget_day``/``budget_month`` in
currency units), plus figures computed from the cluster (a node's
reservations, a model's replica counts).

Shapes (every time is UTC epoch seconds, memory in MiB unless the name says
GB):

- replica (:func:`replica_view`): ``{"replica_id", "shard_id", "model",
  "node_id", "port", "state", "reason", "last_lines", "restarts",
  "failures", "wanted", "retiring", "stale", "compute", "profile",
  "fingerprint", "progress", "started_at", "ready_at", "download"}``
  (``download``: ``{"done_bytes", "total_bytes", "rate_bytes_per_s",
  "phase"}`` while its node fetches the weights, else null), ``"pid"``
  (the engine's process id on its node, 0 when none runs), plus
  ``"engine_key"`` when asked for;
- node (:func:`node_view`): ``{"node_id", "address", "connected",
  "agent_version", "last_seen", "cpu_count", "memory_total_mb",
  "memory_available_mb", "load_1m", "memory_bandwidth_gbps",
  "core_bandwidth_gbps", "reserved": {"memory_gb", "cpu_cores",
  "gpu_memory_mb": {card index: MiB}, "whole_gpus"}, "gpus": [{…the card,
  "gpu_class"}], "engines", "labels", "cordoned", "draining", "replicas"}``;
- model (:func:`model_view`): ``{"name", "entry" (the catalog entry as
  stored), "engine", "external", "on_demand", "stopped", "replicas":
  {"wanted", "ready", "starting", "failed"}, "waiting": {replica id: why it
  is not placed}, "downloads": [weights fetches under way]}``;
- key (:func:`key_view`): ``{"id", "name", "prefix", "project", "person",
  "band", "created_at", "is_admin", "revoked_at", "expires_at", "limits",
  "last_used_at"}`` (``last_used_at``: UTC epoch s of its last use, null
  when never used);
  limits (:func:`limits_view`): ``{"rpm", "tpm", "budget_day",
  "budget_month", "models"}``, budgets as decimal strings;
- usage rows and summaries: every field of
  :class:`~llmgw.store.UsageRow` / ``UsageSummary``;
- status (:func:`status_view`): ``{"leader", "nodes": [{"node_id",
  "address", "connected", "cpu_count", "memory_total_mb",
  "memory_available_mb", "gpus" (a count), "agent_version"}], "replicas":
  [{"replica_id", "model", "node_id", "port", "state", "reason",
  "failures", "last_lines", "download"}], "models": [names], "model_replicas":
  [{"name", "wanted", "ready", "starting", "failed", "stopped",
  "external"}], "serving": {"stopped"}, "settings_version"}``, to which
  the route adds ``"store"`` (:func:`store_view`) and ``"leadership"``
  (:func:`leadership_view`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any, Final

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override

from llmgw.agent.protocol import Gpu, ShardState
from llmgw.control.cluster import Cluster, NodeInfo, ShardInfo, engine_key
from llmgw.control.leader_record import LeaderView
from llmgw.control.placement import gpu_class_of, node_room
from llmgw.control.reconciler import wanted_replicas
from llmgw.store import GuardEvent, KeyRecord, ModelRecord, Store, UsageRow, model_to_doc
from llmgw.store.records import Limits, ProjectPath, UsageSummary

__all__ = [
    "MICROS_PER_UNIT",
    "gpu_view",
    "key_view",
    "limits_view",
    "model_view",
    "node_view",
    "replica_counts",
    "replica_view",
    "status_view",
    "summary_view",
    "usage_view",
]

#: Micro-units in one currency unit (the unit of budgets and prices).
MICROS_PER_UNIT: Final = 1_000_000

_converter = cattrs.Converter()
_converter.register_unstructure_hook(ShardState, str)


def _budget(micros: int | None) -> str | None:
    return None if micros is None else str(Decimal(micros) / MICROS_PER_UNIT)


def _register(
    cls: type[Any],
    keep: Iterable[str] | None = None,
    *,
    renames: Mapping[str, str] | None = None,
    hooks: Mapping[str, Callable[[Any], Any]] | None = None,
) -> None:
    """Unstructure ``cls`` to its fields in ``keep`` (all when ``None``),
    renamed by ``renames``, each through its hook in ``hooks``."""
    names = {f.name for f in attrs.fields(cls)}
    kept = names if keep is None else set(keep)
    if not kept | set(renames or {}) | set(hooks or {}) <= names:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(kept - names)}")
    overrides: dict[str, Any] = {
        f.name: override(omit=True) for f in attrs.fields(cls) if f.name not in kept
    }
    for name in set(renames or {}) | set(hooks or {}):
        overrides[name] = override(
            rename=(renames or {}).get(name), unstruct_hook=(hooks or {}).get(name)
        )
    _converter.register_unstructure_hook(
        cls, make_dict_unstructure_fn(cls, _converter, **overrides)
    )


# Each class's function is made once, taking the hooks of the classes it
# holds as they are then: a class is registered before those holding it.
_register(
    Limits,
    renames={"budget_day_micros": "budget_day", "budget_month_micros": "budget_month"},
    hooks={"budget_day_micros": _budget, "budget_month_micros": _budget},
)
_register(
    ShardInfo,
    (
        "replica_id", "shard_id", "model", "node_id", "port", "state", "reason", "last_lines",
        "restarts", "failures", "retiring", "stale", "compute", "profile", "fingerprint",
        "progress", "started_at", "ready_at", "download", "pid",
    ),
)  # fmt: skip
_register(
    NodeInfo,
    (
        "node_id", "address", "interface", "connected", "agent_version", "last_seen",
        "memory_available_mb", "load_1m", "memory_bandwidth_gbps", "core_bandwidth_gbps",
        "engines", "labels",
    ),
)  # fmt: skip
_register(
    KeyRecord,
    (
        "id", "name", "prefix", "owner", "band", "created_at", "is_admin", "revoked_at",
        "expires_at", "limits",
    ),
    renames={"owner": "person"},
    hooks={"owner": lambda owner: owner or None},
)  # fmt: skip

#: The fields of a replica and of a node that ``GET /api/v1/status`` shows.
_STATUS_REPLICA: Final = (
    "replica_id", "model", "node_id", "port", "state", "reason", "failures", "last_lines",
    "download",
)  # fmt: skip
_STATUS_NODE: Final = (
    "node_id", "address", "connected", "cpu_count", "memory_total_mb", "memory_available_mb",
    "agent_version",
)  # fmt: skip
#: What follows a model's name in its replica ids: ``-<n>`` or ``-<n>.g<k>``.
_REPLICA_OF: Final = re.compile(r"^-\d+(\.g\d+)?$")


def replica_view(shard: ShardInfo, cluster: Cluster, *, with_key: bool = False) -> dict[str, Any]:
    """A replica's shard; ``with_key`` adds its engine key (for benchmarks)."""
    view: dict[str, Any] = _converter.unstructure(shard)
    view["wanted"] = shard.wanted
    if with_key:
        view["engine_key"] = engine_key(cluster.secret, shard.replica_id)
    return view


def gpu_view(gpu: Gpu) -> dict[str, Any]:
    """A card as the agent reports it, with its class (``h100-80g``)."""
    return {**_converter.unstructure(gpu), "gpu_class": gpu_class_of(gpu)}


def _node_fields(node: NodeInfo) -> dict[str, Any]:
    """A node's own fields, with its CPUs and memory from its hardware."""
    view: dict[str, Any] = _converter.unstructure(node)
    view.update(cpu_count=node.hardware.cpu_count, memory_total_mb=node.hardware.memory_total_mb)
    return view


def node_view(node: NodeInfo, cluster: Cluster) -> dict[str, Any]:
    """A node with its hardware, what its replicas reserve, and its cordon."""
    room = node_room(cluster, node.node_id)
    nodes_settings = cluster.settings.nodes
    view = _node_fields(node)
    view.update(
        # What the replicas here hold, to set beside what the node has.
        reserved={
            "memory_gb": round(room.memory_gb, 3),
            "cpu_cores": room.cpu_cores,
            "gpu_memory_mb": {str(i): mb for i, mb in sorted(room.gpu_mb.items())},
            "whole_gpus": sorted(room.whole_cards),
        },
        gpus=[gpu_view(gpu) for gpu in node.gpus or node.hardware.gpus],
        cordoned=node.node_id in nodes_settings.cordoned,
        draining=node.node_id in nodes_settings.draining,
        replicas=sorted(
            {s.replica_id for s in cluster.shards.values() if s.node_id == node.node_id}
        ),
    )
    return view


def replica_counts(model: ModelRecord, cluster: Cluster) -> dict[str, int]:
    """``{"wanted", "ready", "starting", "failed"}`` replicas of ``model``.

    A replica counts once whatever its shards: ready when all its shards
    are, failed when one is, else starting. Replicas being stopped (no
    longer wanted, or retiring after a rolling restart) are not counted.
    ``wanted`` is the reconciler's own figure
    (:func:`~llmgw.control.reconciler.wanted_replicas`): 0 for outside
    models, while the model or the whole system is stopped, and for an
    on-demand model nobody asked for lately.
    """
    states: dict[str, list[ShardState]] = {}
    for shard in cluster.shards.values():
        if shard.model != model.name or not shard.wanted or shard.retiring:
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
    """A catalog entry with its live replica counts and why replicas wait."""
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
            if replica_id.startswith(model.name)
            and _REPLICA_OF.match(replica_id[len(model.name) :])
        },
        # Weights fetches under way for its replicas (bytes, rate, phase).
        "downloads": downloads_view(model.name, cluster),
    }


def downloads_view(model: str, cluster: Cluster) -> list[dict[str, Any]]:
    """The weights fetches of ``model``'s STARTING replicas: ``[{"replica_id",
    "node_id", "done_bytes", "total_bytes", "rate_bytes_per_s", "phase"}]``."""
    return [
        {"replica_id": s.replica_id, "node_id": s.node_id, **attrs.asdict(s.download)}
        for s in sorted(cluster.shards.values(), key=lambda s: s.replica_id)
        if s.model == model and s.download is not None
    ]


def limits_view(limits: Limits) -> dict[str, Any]:
    """A level's limits, budgets in currency units (``"25.5"``)."""
    view: dict[str, Any] = _converter.unstructure(limits)
    return view


def key_view(
    key: KeyRecord, path: ProjectPath | None, *, last_used: float | None = None
) -> dict[str, Any]:
    """A key (never its secret or hash) and the project it belongs to;
    ``last_used_at`` is ``last_used`` (from
    :meth:`~llmgw.store.Store.keys_last_used`) or else the stored last use."""
    view: dict[str, Any] = _converter.unstructure(key)
    view["project"] = path.path if path is not None else None
    view["last_used_at"] = last_used if last_used is not None else key.last_used_at
    return view


def usage_view(row: UsageRow) -> dict[str, Any]:
    """A usage row, every field but ``guard_events`` (kept in their own
    table: :func:`guard_events_view`)."""
    view: dict[str, Any] = _converter.unstructure(row)
    view.pop("guard_events", None)
    return view


def guard_events_view(events: list[GuardEvent]) -> list[dict[str, Any]]:
    """A request's guard events: direction, rule id and action each."""
    return [{"direction": e.direction, "rule": e.rule, "action": e.action} for e in events]


def summary_view(row: UsageSummary, name: str) -> dict[str, Any]:
    """A usage sum of one group, with the group's readable ``name``."""
    return {**_converter.unstructure(row), "name": name}


def status_view(cluster: Cluster, settings_version: int) -> dict[str, Any]:
    """``GET /api/v1/status``: the whole cluster in one answer."""
    return {
        "leader": cluster.is_leader,
        "nodes": [
            {
                **{k: v for k, v in _node_fields(n).items() if k in _STATUS_NODE},
                "gpus": len(n.hardware.gpus),
            }
            for n in cluster.nodes.values()
        ],
        "replicas": [
            {k: v for k, v in _converter.unstructure(s).items() if k in _STATUS_REPLICA}
            for s in cluster.shards.values()
        ],
        "models": sorted(cluster.models),
        "model_replicas": [
            {
                "name": m.name,
                **replica_counts(m, cluster),
                "stopped": m.stopped,
                "external": m.is_external,
            }
            for m in sorted(cluster.models.values(), key=lambda m: m.name)
        ],
        "serving": {"stopped": cluster.settings.serving.stopped},
        "settings_version": settings_version,
    }


def store_view(store: Store | None) -> dict[str, Any] | None:
    """Which store this control plane uses: ``{"kind": "sqlite", "address":
    path}`` or ``{"kind": "postgresql", "address": hosts, ports and database,
    never a password}``; ``None`` when not known."""
    if store is None:
        return None
    where = getattr(store, "where", None)
    if isinstance(where, str):
        return {"kind": "postgresql", "address": where}
    path = getattr(store, "path", None)
    if path is not None:
        return {"kind": "sqlite", "address": str(path)}
    return {"kind": type(store).__name__, "address": ""}


def leadership_view(cluster: Cluster, view: LeaderView | None) -> dict[str, Any]:
    """Who leads: ``{"holder", "epoch", "since" (UTC epoch s), "api" (its
    client API ``host:port``), "here" (this control plane)}``; this
    control plane's own lease while it leads, else the leader's record last
    read from the store; nulls when no leader is known."""
    lease = cluster.lease
    if cluster.is_leader and lease is not None:
        return {
            "holder": lease.holder,
            "epoch": lease.epoch,
            "since": cluster.leading_since,
            "api": (view.own_api or None) if view is not None else None,
            "here": True,
        }
    record = view.record if view is not None else None
    if record is None:
        return {"holder": None, "epoch": None, "since": None, "api": None, "here": False}
    return {
        "holder": record.holder,
        "epoch": record.epoch,
        "since": record.since or None,
        "api": record.api or None,
        "here": record.holder == view.holder if view is not None else False,
    }

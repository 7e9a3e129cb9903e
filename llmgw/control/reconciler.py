"""The reconciler: wanted (the catalog, scaling, demand, drains, settings)
against actual (the agents' reports). Leader only (``docs/catalog.md``,
What the reconciler does).

Each tick (:data:`TICK_S`, and at once when :attr:`Cluster.changed` fires) it
works out, per model, how many replicas are wanted and which **slot** each
fills, then moves the shards toward that:

- **Wanted** = the sum of the profiles' ``replicas``; 0 when the model is
  ``stopped``, when ``serving.stopped`` is set, for ``external`` models, and
  for ``on_demand`` models unless demanded (:meth:`Cluster.is_demanded`).
  Slots are numbered 0…N-1 and go to the profiles in priority order,
  highest first (ties in catalog order), each profile taking ``replicas``
  slots; a slot's replica uses its profile and nothing else.
- **Replica ids**: slot *n*'s first replica is ``<model>-<n>``; a successor
  started by a rolling restart or a move is ``<model>-<n>.g<k>``, *k* one
  above the highest generation the slot has had (:func:`replica_id_for`).
- **Scale up**: a missing slot is placed (:func:`~llmgw.control.placement.place`)
  and started with a port from the engine range, the engine key, the cards
  and the profile fingerprint. Nowhere to go: the slot waits and
  :attr:`Cluster.waiting` says why.
- **Scale down** and every other end of a replica go through
  :meth:`Cluster.retire`: out of the endpoints at once, ``StopShard`` once
  its requests in flight finished (at most :data:`RETIRE_DRAIN_S`),
  highest slot first; port and room are freed when the agent confirms
  (or :data:`STOP_CONFIRM_S` passed).
- **Rolling restart**: a READY replica whose fingerprint differs from its
  slot's profile (``stale``) or whose node is draining gets a successor;
  once the successor is READY the old one retires. One successor at a time
  per model, and the READY count never drops below what was READY. A stale
  or draining replica that is not READY is replaced at once. A successor
  that fits nowhere is retried each tick (the old one's room may free up).
- **Drain/cordon**: placement skips cordoned and draining nodes; a replica
  on a draining node that has nowhere to go keeps serving until
  ``nodes.drain_grace`` after the drain was first seen
  (:attr:`Cluster.drain_started`), then stops.
- **On demand**: not demanded → no new replicas; a READY one is evicted when
  idle (no :meth:`Cluster.touch`) for ``on_demand.evict_after_idle`` unless
  READY for less than ``on_demand.min_lifetime``; a STARTING one loads on.
- **Start deadline**: a STARTING shard with no progress (a ``ShardStatus``
  with ``progress``; the start counts) for its profile's
  ``startup_timeout_s`` is stopped and FAILED "no progress for N s".
- **Crash back-off**: a FAILED replica restarts in place after 1, 2, 4 … s
  (:func:`restart_delay_s`, capped at 60 s; afresh after 60 s READY). It
  stays FAILED until the restart is sent; ``restarts`` counts them. A
  failure naming a port "in use" marks the port busy on that node and
  moves the replica to another one.
- **Lost nodes**: a node whose link stayed down :data:`NODE_LOST_AFTER_S`
  loses its shards; their slots are placed elsewhere.
- Nothing is started or stopped before the catalog was read once.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Final, NoReturn, Protocol

import trio

from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState
from llmgw.errors import LinkError, describe
from llmgw.store import ModelRecord, Profile, StoreError

from .cluster import (
    NODE_LOST_AFTER_S,
    Cluster,
    ShardInfo,
    engine_key,
    replica_fingerprint,
    replica_id_for,
)
from .hf import endpoints as hf_endpoints
from .placement import check_node, gpu_need_mb, place

__all__ = [
    "CatalogSource",
    "PortRange",
    "engine_profile",
    "reconcile_once",
    "restart_delay_s",
    "serve_reconciler",
    "slot_profiles",
    "wanted_replicas",
    "weights_fetch",
]

log = logging.getLogger("llmgw.control.reconciler")

TICK_S: Final = 1.0
RESTART_BACKOFF_FIRST_S: Final = 1.0
RESTART_BACKOFF_MAX_S: Final = 60.0
#: A replica READY this long before it failed starts its back-off afresh.
STABLE_AFTER_S: Final = 60.0
#: Deadline for sending one command over a link.
SEND_TIMEOUT_S: Final = 5.0
#: A retiring replica's requests in flight get this long before ``StopShard``.
RETIRE_DRAIN_S: Final = 30.0
#: A stop the agent has not confirmed within this is taken as done.
STOP_CONFIRM_S: Final = 30.0
#: The start deadline of a shard whose profile is gone from the catalog.
DEFAULT_STARTUP_TIMEOUT_S: Final = 1200.0
#: Successors a model may have loading at once (rolling restarts, moves).
ROLLS_PER_MODEL: Final = 1

PortRange = tuple[int, int]


class CatalogSource(Protocol):
    """What the reconciler needs of the store: the catalog."""

    async def list_models(self) -> list[ModelRecord]: ...


def restart_delay_s(failures: int) -> float:
    """The wait before restart number ``failures`` (1, 2, 4, … capped at 60 s)."""
    return float(min(RESTART_BACKOFF_FIRST_S * 2 ** max(failures - 1, 0), RESTART_BACKOFF_MAX_S))


def slot_profiles(model: ModelRecord) -> list[Profile]:
    """The profile of each slot: profiles by priority, highest first (ties in
    catalog order), each repeated ``replicas`` times."""
    ordered = sorted(model.profiles, key=lambda p: -p.priority)
    return [p for p in ordered for _ in range(max(p.replicas, 0))]


def wanted_replicas(model: ModelRecord, cluster: Cluster) -> int:
    """How many replicas ``model`` wants now (module docstring, Wanted)."""
    if cluster.settings.serving.stopped or model.stopped or model.is_external:
        return 0
    if model.on_demand and not cluster.is_demanded(model.name):
        return 0
    return len(slot_profiles(model))


def engine_profile(model: ModelRecord, profile: Profile) -> protocol.EngineProfile:
    """The ``StartShard`` profile for a replica of ``model`` run as ``profile``."""
    return protocol.EngineProfile(
        name=model.name,
        engine=profile.engine,
        served_model_name=model.name,
        # With an origin the agent fetches the weights and sets the path.
        model_path="" if model.origin is not None else model.source,
        model_sha256="" if model.origin is not None else model.sha256,
        context_tokens=profile.context_tokens,
        slots=profile.slots,
        cpu_cores=profile.cpu_cores,
        args=tuple(profile.args),
        env=dict(profile.env),
    )


def weights_fetch(model: ModelRecord, cluster: Cluster) -> protocol.WeightsFetch | None:
    """What the node fetches for a replica of ``model``: its pinned
    ``origin`` with the hubs to ask (mirrors first, :func:`llmgw.control.hf.endpoints`);
    ``None`` for a model without one."""
    origin = model.origin
    if origin is None or origin.kind != "hf":
        return None
    return protocol.WeightsFetch(
        repo=origin.repo,
        revision=origin.revision,
        files=tuple(
            protocol.WeightsFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256)
            for f in origin.files
        ),
        main_file=origin.main_file,
        endpoints=hf_endpoints(cluster.settings),
    )


async def serve_reconciler(
    store: CatalogSource,
    cluster: Cluster,
    port_range: PortRange,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Reconcile until cancelled: read the catalog, :func:`reconcile_once`,
    sleep until the next tick, a due restart, or :attr:`Cluster.changed`.

    A catalog that cannot be read is logged and the last one kept.

    Returns:
        Never returns unless cancelled.
    """
    task_status.started()
    while True:
        changed = cluster.changed
        try:
            models = {m.name: m for m in await store.list_models()}
        except StoreError as exc:
            log.warning("cannot read the catalog (%s); keeping the last one", exc)
        else:
            cluster.load_catalog(models)
        if cluster.catalog_loaded:
            await reconcile_once(cluster.models, cluster, port_range)
        with trio.move_on_after(_next_wake_s(cluster)):
            await changed.wait()


async def reconcile_once(
    models: Mapping[str, ModelRecord], cluster: Cluster, port_range: PortRange
) -> None:
    """One pass: start, restart, roll, retire and stop shards so actual
    moves toward wanted (module docstring)."""
    now = cluster.now()
    _track_drains(cluster, now)
    await _stop_orphans(cluster)
    _forget_lost_nodes(cluster, now)
    _forget_unconfirmed_stops(cluster, now)
    waiting: dict[str, str] = {}
    for model in models.values():
        await _reconcile_model(model, cluster, port_range, now, waiting)
    for shard in list(cluster.shards.values()):
        if shard.model not in models:
            cluster.retire(shard, "its model is no longer in the catalog")
    for key, reason in waiting.items():
        if cluster.waiting.get(key) != reason:
            log.warning("%s waits: %s", key, reason)
    cluster.set_waiting(waiting)
    await _send_stops(cluster, now)


# --- per model ------------------------------------------------------------------


async def _reconcile_model(
    model: ModelRecord,
    cluster: Cluster,
    port_range: PortRange,
    now: float,
    waiting: dict[str, str],
) -> None:
    profiles = slot_profiles(model)
    fingerprints = [replica_fingerprint(model, p) for p in profiles]
    wanted = wanted_replicas(model, cluster)
    shards = [s for s in cluster.shards.values() if s.model == model.name and not s.retiring]
    for shard in shards:
        if 0 <= shard.slot < len(profiles):
            profile = profiles[shard.slot]
            cluster.check_fingerprint(shard, fingerprints[shard.slot])
            if not shard.profile:
                cluster.assign_profile(shard, profile, gpu_need_mb(model, profile, cluster))
    # Beyond what is wanted: highest slot first.
    extras = [s for s in shards if not 0 <= s.slot < wanted]
    extras.sort(key=lambda s: (s.slot, s.generation), reverse=True)
    idle_only = wanted == 0 and model.on_demand and _runs(model, cluster)
    for shard in extras:
        if idle_only:
            evict_why = _on_demand_evict(shard, cluster, now)
            if evict_why is None:
                await _tend(
                    shard, model, _profile_of(model, shard, profiles), cluster, port_range, now
                )
                continue
            cluster.retire(shard, evict_why)
        else:
            cluster.retire(shard, _why_not_wanted(model, cluster, wanted))
    by_slot: dict[int, list[ShardInfo]] = collections.defaultdict(list)
    for shard in shards:
        if 0 <= shard.slot < wanted and not shard.retiring:
            by_slot[shard.slot].append(shard)
    rolls = sum(1 for slot in range(wanted) if _rolling(by_slot[slot], cluster))
    for slot in range(wanted):
        started = await _reconcile_slot(
            model,
            slot,
            profiles[slot],
            fingerprints[slot],
            by_slot[slot],
            cluster,
            port_range,
            now,
            may_roll=rolls < ROLLS_PER_MODEL,
            waiting=waiting,
        )
        rolls += started


def _runs(model: ModelRecord, cluster: Cluster) -> bool:
    """Nothing but demand keeps ``model`` at zero."""
    return not (cluster.settings.serving.stopped or model.stopped or model.is_external)


def _why_not_wanted(model: ModelRecord, cluster: Cluster, wanted: int) -> str:
    if cluster.settings.serving.stopped:
        return "serving is stopped (serving.stopped)"
    if model.stopped:
        return "the model is stopped"
    if model.is_external:
        return "the model is served by an outside provider"
    return f"scaled down to {wanted} replica{'s' if wanted != 1 else ''}"


def _on_demand_evict(shard: ShardInfo, cluster: Cluster, now: float) -> str | None:
    """Why an on-demand replica nobody demands goes, or ``None`` to keep it."""
    if shard.state is ShardState.STARTING:
        return None
    if shard.state is not ShardState.READY or shard.ready_at is None:
        return "on-demand model not in use"
    settings = cluster.settings.on_demand
    if now - shard.ready_at < settings.min_lifetime:
        return None
    idle_since = max(shard.last_used_at, cluster.last_used(shard.model), shard.ready_at)
    idle_s = now - idle_since
    if idle_s < settings.evict_after_idle:
        return None
    return f"idle for {idle_s:.0f} s (on_demand.evict_after_idle {settings.evict_after_idle:.0f} s)"


def _bad(shard: ShardInfo, cluster: Cluster) -> str:
    """Why ``shard`` must be replaced, or "" when it may stay."""
    if shard.stale:
        return "its profile changed (stale fingerprint)"
    if shard.node_id in cluster.settings.nodes.draining:
        return f"node {shard.node_id} is draining"
    return ""


def _rolling(group: Sequence[ShardInfo], cluster: Cluster) -> bool:
    """A slot with a successor loading next to a READY replica it replaces."""
    good = [s for s in group if not _bad(s, cluster)]
    return (
        bool(good)
        and not any(s.state is ShardState.READY for s in good)
        and any(s.state is ShardState.READY for s in group if _bad(s, cluster))
    )


async def _reconcile_slot(
    model: ModelRecord,
    slot: int,
    profile: Profile,
    fingerprint: str,
    group: list[ShardInfo],
    cluster: Cluster,
    port_range: PortRange,
    now: float,
    *,
    may_roll: bool,
    waiting: dict[str, str],
) -> int:
    """Bring one slot to one healthy replica; 1 when a successor was started."""
    good = [s for s in group if not _bad(s, cluster)]
    bad = [s for s in group if _bad(s, cluster)]
    good_ready = [s for s in good if s.state is ShardState.READY]
    if good_ready:
        keep = min(good_ready, key=lambda s: (s.ready_at or 0.0, s.generation))
        for shard in group:
            if shard is not keep:
                what = "replaced by" if shard in bad else "a duplicate of"
                cluster.retire(
                    shard, f"{_bad(shard, cluster) or 'extra'}; {what} {keep.replica_id}"
                )
        await _tend(keep, model, profile, cluster, port_range, now)
        return 0
    ready_bad = [s for s in bad if s.state is ShardState.READY]
    for shard in bad:
        if shard.state is not ShardState.READY:
            cluster.retire(shard, f"{_bad(shard, cluster)}; not serving, replaced at once")
    for shard in ready_bad[1:]:
        cluster.retire(shard, f"a duplicate of {ready_bad[0].replica_id}")
    old = ready_bad[0] if ready_bad else None
    started = 0
    if good:
        keep = max(good, key=lambda s: s.generation)
        for shard in good:
            if shard is not keep:
                cluster.retire(shard, f"a duplicate of {keep.replica_id}")
        await _tend(keep, model, profile, cluster, port_range, now)
    elif old is None:
        await _start_new(model, slot, profile, fingerprint, cluster, port_range, now, waiting)
    elif may_roll:
        started = int(
            await _start_new(
                model, slot, profile, fingerprint, cluster, port_range, now, waiting, replacing=old
            )
        )
    else:
        waiting[replica_id_for(model.name, slot, _next_generation(cluster, model.name, slot))] = (
            f"to replace {old.replica_id} ({_bad(old, cluster)}) after the restart under way"
        )
    if old is not None and _drain_expired(old, cluster, now):
        grace = cluster.settings.nodes.drain_grace
        cluster.retire(
            old,
            f"node {old.node_id} drained: no successor READY within "
            f"nodes.drain_grace {grace:.0f} s",
        )
    return started


def _drain_expired(shard: ShardInfo, cluster: Cluster, now: float) -> bool:
    began = cluster.drain_started.get(shard.node_id)
    return began is not None and now - began >= cluster.settings.nodes.drain_grace


def _profile_of(model: ModelRecord, shard: ShardInfo, profiles: list[Profile]) -> Profile | None:
    for profile in model.profiles:
        if profile.name == shard.profile:
            return profile
    return profiles[shard.slot] if 0 <= shard.slot < len(profiles) else None


# --- one shard ----------------------------------------------------------------------


async def _tend(
    shard: ShardInfo,
    model: ModelRecord,
    profile: Profile | None,
    cluster: Cluster,
    port_range: PortRange,
    now: float,
) -> None:
    """Keep a wanted shard going: stops owed, start deadline, back-off restarts."""
    if shard.stop_pending:
        cluster.mark_stop_sent(shard)
        await _send_stop(cluster, shard.node_id, shard.shard_id)
    if shard.state is ShardState.STARTING:
        timeout_s = profile.startup_timeout_s if profile is not None else DEFAULT_STARTUP_TIMEOUT_S
        if now - max(shard.progress_at, shard.started_at) >= timeout_s:
            cluster.fail_shard(shard, f"no progress for {timeout_s:.0f} s")
            log.warning(
                "replica %s: no start-up progress for %.0f s; stopping it",
                shard.replica_id,
                timeout_s,
            )
            cluster.mark_stop_sent(shard)
            await _send_stop(cluster, shard.node_id, shard.shard_id)
    if profile is None:
        return
    if shard.state is ShardState.FAILED:
        if shard.restart_at == 0.0:
            # A replica that had run well starts its back-off afresh.
            stable = shard.ready_at is not None and now - shard.ready_at >= STABLE_AFTER_S
            cluster.count_failure(shard, afresh=stable)
            if "in use" in shard.reason:
                _move_off_busy_port(shard, cluster, port_range)
            delay_s = restart_delay_s(shard.failures)
            cluster.schedule_restart(shard, now + delay_s)
            log.warning(
                "replica %s failed (%s); restarting in %.0f s",
                shard.replica_id,
                shard.reason,
                delay_s,
            )
        elif now >= shard.restart_at and await _start(cluster, shard, model, profile):
            cluster.count_restart(shard)
    elif shard.state is ShardState.STOPPED and await _start(cluster, shard, model, profile):
        cluster.count_restart(shard)


def _move_off_busy_port(shard: ShardInfo, cluster: Cluster, port_range: PortRange) -> None:
    busy = shard.port
    cluster.mark_port_busy(shard.node_id, busy)
    port = _free_port(cluster, shard.node_id, port_range, avoid=frozenset({busy}))
    if port is not None:
        cluster.move_port(shard, port)
        log.warning(
            "port %d on %s is taken by another process; %s moves to %d",
            busy,
            shard.node_id,
            shard.replica_id,
            port,
        )


async def _start_new(
    model: ModelRecord,
    slot: int,
    profile: Profile,
    fingerprint: str,
    cluster: Cluster,
    port_range: PortRange,
    now: float,
    waiting: dict[str, str],
    *,
    replacing: ShardInfo | None = None,
) -> bool:
    """Place and start a new replica for ``slot`` (the successor of
    ``replacing``, when given); False when it fits nowhere."""
    generation = _next_generation(cluster, model.name, slot)
    replica_id = replica_id_for(model.name, slot, generation)
    choice = place(model, profile, cluster, replacing=replacing)
    if choice is None:
        waiting[replica_id] = _no_room(model, profile, cluster)
        return False
    port = _free_port(cluster, choice.node_id, port_range)
    if port is None:
        waiting[replica_id] = (
            f"no free engine port on {choice.node_id} in {port_range[0]}-{port_range[1]}"
        )
        return False
    shard = ShardInfo(
        shard_id=replica_id,
        replica_id=replica_id,
        model=model.name,
        node_id=choice.node_id,
        port=port,
        slot=slot,
        generation=generation,
        profile=profile.name,
        fingerprint=fingerprint,
        gpu_indices=choice.gpu_indices,
        memory_gb=profile.min_memory_gb,
        cpu_cores=choice.cpu_cores,
        gpu_memory_mb=gpu_need_mb(model, profile, cluster),
        started_at=now,
        progress_at=now,
        last_used_at=cluster.last_used(model.name),
    )
    cluster.add_shard(shard)
    cards = f", GPUs {', '.join(map(str, choice.gpu_indices))}" if choice.gpu_indices else ""
    log.info(
        "placing %s on %s: engine %s (profile %s) on port %d%s",
        replica_id,
        choice.node_id,
        profile.engine,
        profile.name,
        port,
        cards,
    )
    await _start(cluster, shard, model, profile)
    return True


def _next_generation(cluster: Cluster, model: str, slot: int) -> int:
    generations = [
        s.generation for s in cluster.shards.values() if s.model == model and s.slot == slot
    ]
    return max(generations) + 1 if generations else 1


def _no_room(model: ModelRecord, profile: Profile, cluster: Cluster) -> str:
    if not cluster.nodes:
        return f"profile {profile.name} fits on no node: no node is registered"
    reasons = "; ".join(
        f"{node_id}: {check_node(model, profile, node, cluster).reason}"
        for node_id, node in sorted(cluster.nodes.items())
    )
    return f"profile {profile.name} fits on no node: {reasons}"


def _free_port(
    cluster: Cluster,
    node_id: str,
    port_range: PortRange,
    avoid: frozenset[int] = frozenset(),
) -> int | None:
    """The lowest port of the range no shard on the node holds (retiring and
    stopping ones included) and not found busy there."""
    used = {s.port for s in cluster.shards.values() if s.node_id == node_id} | avoid
    node = cluster.nodes.get(node_id)
    if node is not None:
        used |= node.busy_ports
    for port in range(port_range[0], port_range[1] + 1):
        if port not in used:
            return port
    return None


async def _start(cluster: Cluster, shard: ShardInfo, model: ModelRecord, profile: Profile) -> bool:
    """Send ``StartShard``; False when the node is not connected."""
    node = cluster.nodes.get(shard.node_id)
    if node is None or node.send is None:
        return False
    cluster.mark_starting(shard)
    message = protocol.StartShard(
        correlation_id=uuid.uuid4().hex,
        shard_id=shard.shard_id,
        replica_id=shard.replica_id,
        profile=engine_profile(model, profile),
        port=shard.port,
        api_key=engine_key(cluster.secret, shard.replica_id),
        # The address the node is reached by, not every interface; the engine
        # key guards it.
        bind_addr=node.address or "127.0.0.1",
        gpu_indices=shard.gpu_indices,
        fingerprint=shard.fingerprint,
        weights=weights_fetch(model, cluster),
    )
    try:
        with trio.fail_after(SEND_TIMEOUT_S):
            await node.send(message)
    except (LinkError, trio.TooSlowError) as exc:
        log.warning("could not send StartShard for %s: %s", shard.shard_id, describe(exc))
    return True


# --- housekeeping -----------------------------------------------------------------------


def _track_drains(cluster: Cluster, now: float) -> None:
    draining = set(cluster.settings.nodes.draining)
    for node_id in draining:
        if node_id not in cluster.drain_started:
            cluster.drain_began(node_id, now)
            log.info("node %s is draining", node_id)
    for node_id in set(cluster.drain_started) - draining:
        cluster.drain_ended(node_id)


async def _stop_orphans(cluster: Cluster) -> None:
    for node_id, shard_id in cluster.take_orphans():
        await _send_stop(cluster, node_id, shard_id)


def _forget_lost_nodes(cluster: Cluster, now: float) -> None:
    for node in cluster.nodes.values():
        if node.connected or node.disconnected_at is None:
            continue
        if now - node.disconnected_at < NODE_LOST_AFTER_S:
            continue
        for shard in [s for s in cluster.shards.values() if s.node_id == node.node_id]:
            log.warning(
                "node %s lost (link down %.0f s): %s will be placed elsewhere",
                node.node_id,
                now - node.disconnected_at,
                shard.replica_id,
            )
            cluster.remove_shard(shard.shard_id)


def _forget_unconfirmed_stops(cluster: Cluster, now: float) -> None:
    for shard in list(cluster.shards.values()):
        if shard.stop_sent_at is not None and now - shard.stop_sent_at >= STOP_CONFIRM_S:
            log.warning(
                "%s on %s: stop not confirmed within %.0f s; taken as stopped",
                shard.replica_id,
                shard.node_id,
                STOP_CONFIRM_S,
            )
            cluster.remove_shard(shard.shard_id)


async def _send_stops(cluster: Cluster, now: float) -> None:
    """``StopShard`` for retiring shards whose requests are done, highest slot first."""
    retiring = [s for s in cluster.shards.values() if s.retiring and s.stop_sent_at is None]
    retiring.sort(key=lambda s: (s.model, s.slot, s.generation), reverse=True)
    for shard in retiring:
        if shard.state in (ShardState.FAILED, ShardState.STOPPED) and not shard.stop_pending:
            cluster.remove_shard(shard.shard_id)  # nothing runs to stop
            continue
        if (
            shard.state is ShardState.READY
            and cluster.in_flight(shard.replica_id) > 0
            and now - shard.retiring_at < RETIRE_DRAIN_S
        ):
            continue
        node = cluster.nodes.get(shard.node_id)
        if node is None or node.send is None:
            continue  # sent when the node is back, or forgotten once it is lost
        cluster.mark_stopping(shard, now)
        log.info("stopping %s on %s: %s", shard.replica_id, shard.node_id, shard.retire_reason)
        await _send_stop(cluster, shard.node_id, shard.shard_id)


async def _send_stop(cluster: Cluster, node_id: str, shard_id: str) -> None:
    node = cluster.nodes.get(node_id)
    if node is None or node.send is None:
        return
    try:
        with trio.fail_after(SEND_TIMEOUT_S):
            await node.send(protocol.StopShard(correlation_id=uuid.uuid4().hex, shard_id=shard_id))
    except (LinkError, trio.TooSlowError) as exc:
        log.warning("could not send StopShard for %s to %s: %s", shard_id, node_id, describe(exc))


def _next_wake_s(cluster: Cluster) -> float:
    """Until the next tick, or sooner when a restart falls due."""
    now = cluster.now()
    wake = TICK_S
    for shard in cluster.shards.values():
        if shard.state is ShardState.FAILED and shard.restart_at > 0.0 and not shard.retiring:
            wake = min(wake, shard.restart_at - now)
    return max(wake, 0.0)

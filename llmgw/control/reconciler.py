"""The reconciler: wanted (the catalog) against actual (the agents' reports).

Leader only. Each tick, and whenever the cluster changes, it

- places each missing replica on a connected node and sends ``StartShard``
  with a port from the engine port range and the replica's engine key;
- restarts a FAILED replica after a back-off that doubles from
  :data:`RESTART_BACKOFF_FIRST_S` to :data:`RESTART_BACKOFF_MAX_S`;
- stops replicas the catalog no longer wants.

This is the single-node core of ``shared/spec/reconciler-and-lifecycle.md``;
placement over several nodes, draining and adoption build on it.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Final, NoReturn

import trio

from llmgw.agent import protocol
from llmgw.agent.link import LINK_ERRORS
from llmgw.agent.protocol import ShardState
from llmgw.store import ModelRecord, Store, StoreError

from .cluster import Cluster, NodeInfo, ShardInfo, engine_key

__all__ = ["PortRange", "serve_reconciler"]

log = logging.getLogger("llmgw.control.reconciler")

TICK_S: Final = 1.0
RESTART_BACKOFF_FIRST_S: Final = 1.0
RESTART_BACKOFF_MAX_S: Final = 60.0
#: A replica READY this long before it failed starts its back-off afresh.
STABLE_AFTER_S: Final = 60.0
#: Deadline for sending one command over a link.
SEND_TIMEOUT_S: Final = 5.0

PortRange = tuple[int, int]


def restart_delay_s(failures: int) -> float:
    """The wait before restart number ``failures`` (1, 2, 4, … capped at 60 s)."""
    return float(min(RESTART_BACKOFF_FIRST_S * 2 ** max(failures - 1, 0), RESTART_BACKOFF_MAX_S))


def profile_of(model: ModelRecord) -> protocol.EngineProfile:
    profile = model.profile
    assert profile is not None
    return protocol.EngineProfile(
        name=model.name,
        engine=profile.engine,
        served_model_name=model.name,
        model_path=model.source,
        model_sha256=model.sha256,
        context_tokens=profile.context_tokens,
        slots=profile.slots,
        cpu_cores=profile.cpu_cores,
        args=tuple(profile.args),
        env=dict(profile.env),
    )


async def serve_reconciler(
    store: Store,
    cluster: Cluster,
    port_range: PortRange,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Reconcile until cancelled.

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
            models = cluster.models
        cluster.models = models
        await reconcile_once(models, cluster, port_range)
        with trio.move_on_after(TICK_S):
            await changed.wait()


async def reconcile_once(
    models: dict[str, ModelRecord], cluster: Cluster, port_range: PortRange
) -> None:
    """One pass: start, restart and stop shards so actual moves toward wanted."""
    now = time.time()
    wanted_ids: set[str] = set()
    for model in models.values():
        for index in range(model.replicas):
            replica_id = f"{model.name}-{index}"
            wanted_ids.add(replica_id)
            shard = cluster.shards.get(replica_id)
            if shard is None:
                node = _place(cluster, model)
                if node is None:
                    continue
                port = _free_port(cluster, node.node_id, port_range)
                if port is None:
                    log.warning("no free engine port on %s for %s", node.node_id, replica_id)
                    continue
                shard = ShardInfo(
                    shard_id=replica_id,
                    replica_id=replica_id,
                    model=model.name,
                    node_id=node.node_id,
                    port=port,
                )
                cluster.add_shard(shard)
                log.info(
                    "placing %s on %s: engine %s on port %d",
                    replica_id,
                    node.node_id,
                    model.profile.engine if model.profile else "?",
                    port,
                )
                await _start(cluster, shard, model)
            elif shard.state is ShardState.FAILED:
                if shard.restart_at == 0.0:
                    if shard.ready_at is not None and now - shard.ready_at >= STABLE_AFTER_S:
                        shard.failures = 0  # it had run well: a fresh start of the back-off
                    shard.failures += 1
                    if "in use" in shard.reason:
                        busy = shard.port
                        node = cluster.nodes.get(shard.node_id)
                        if node is not None:
                            node.busy_ports.add(busy)
                        port = _free_port(
                            cluster, shard.node_id, port_range, avoid=frozenset({busy})
                        )
                        if port is not None:
                            shard.port = port
                            log.warning(
                                "port %d on %s is taken by another process; %s moves to %d",
                                busy,
                                shard.node_id,
                                replica_id,
                                port,
                            )
                    delay_s = restart_delay_s(shard.failures)
                    shard.restart_at = now + delay_s
                    log.warning(
                        "replica %s failed (%s); restarting in %.0f s",
                        replica_id,
                        shard.reason,
                        delay_s,
                    )
                elif now >= shard.restart_at:
                    await _start(cluster, shard, model)
            elif shard.state is ShardState.STOPPED and shard.wanted:
                await _start(cluster, shard, model)
    for shard in list(cluster.shards.values()):
        if shard.shard_id not in wanted_ids:
            shard.wanted = False
            await _stop(cluster, shard)
            cluster.remove_shard(shard.shard_id)


def _place(cluster: Cluster, model: ModelRecord) -> NodeInfo | None:
    for node in cluster.nodes.values():
        if node.connected and node.send is not None and model.profile is not None and model.profile.engine in ("llamacpp", "sim"):
            return node
    return None


def _free_port(
    cluster: Cluster,
    node_id: str,
    port_range: PortRange,
    avoid: frozenset[int] = frozenset(),
) -> int | None:
    used = {s.port for s in cluster.shards.values() if s.node_id == node_id} | avoid
    node = cluster.nodes.get(node_id)
    if node is not None:
        used |= node.busy_ports
    for port in range(port_range[0], port_range[1] + 1):
        if port not in used:
            return port
    return None


async def _start(cluster: Cluster, shard: ShardInfo, model: ModelRecord) -> None:
    node = cluster.nodes.get(shard.node_id)
    if node is None or node.send is None:
        return
    shard.state = ShardState.STARTING
    shard.restart_at = 0.0
    shard.started_at = time.time()
    message = protocol.StartShard(
        correlation_id=uuid.uuid4().hex,
        shard_id=shard.shard_id,
        replica_id=shard.replica_id,
        profile=profile_of(model),
        port=shard.port,
        api_key=engine_key(cluster.secret, shard.replica_id),
        bind_addr="127.0.0.1" if node.address.startswith("127.") else "0.0.0.0",
    )
    try:
        with trio.fail_after(SEND_TIMEOUT_S):
            await node.send(message)
    except LINK_ERRORS as exc:
        log.warning("could not send StartShard for %s: %r", shard.shard_id, exc)


async def _stop(cluster: Cluster, shard: ShardInfo) -> None:
    node = cluster.nodes.get(shard.node_id)
    if node is None or node.send is None:
        return
    try:
        with trio.fail_after(SEND_TIMEOUT_S):
            await node.send(
                protocol.StopShard(correlation_id=uuid.uuid4().hex, shard_id=shard.shard_id)
            )
    except LINK_ERRORS as exc:
        log.warning("could not send StopShard for %s: %r", shard.shard_id, exc)

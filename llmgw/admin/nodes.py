"""Admin routes of the nodes and their replicas.

- ``GET /api/v1/nodes`` → ``{"data": [node view]}``
  (:func:`llmgw.admin.views.node_view`), by node id;
- ``GET /api/v1/replicas`` → ``{"data": [replica view]}``
  (:func:`llmgw.admin.views.replica_view`), by model and replica;
  ``?engine_keys=1`` adds each replica's engine key, for benchmarks;
- ``POST /api/v1/nodes/<id>/cordon`` (no new replicas), ``/drain`` (cordon
  and move its replicas away), ``/uncordon`` (clears both) → ``{"node_id",
  "known", "cordoned", "draining", "changed", "version"}``; these edit the
  settings ``nodes.cordoned`` / ``nodes.draining``;
- ``DELETE /api/v1/nodes/<id>`` → ``{"node_id", "revoked_certificates",
  "stopped", "was_connected"}``: removes a node from the cluster: its
  certificates are revoked (its next link is refused), its replicas'
  engines are stopped when it is connected, its link is closed, and it is
  forgotten, so that its replicas are placed elsewhere. 404 ``node_not_found``
  for a node that is not registered now and holds no certificate left to
  revoke (never known, or removed already);
- ``GET /api/v1/logs?node=…&source=…&lines=N`` → ``{"node", "source",
  "lines"}``: a node agent's last lines, or a shard's (``source`` = a shard
  id); ``node`` may be left out when there is one node. 404
  ``node_not_connected`` for a node that is not connected, 504 when it does
  not answer within :data:`LOGS_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Final

import trio
from quart import request
from quart_trio import QuartTrio

from llmgw import errors
from llmgw.agent import protocol
from llmgw.control.cluster import Cluster
from llmgw.control.live import LiveSettings
from llmgw.settings import with_key
from llmgw.store import Store

from .errors import BadRequest, NoSuch, known_names
from .inputs import actor, query_flag, query_int
from .views import node_view, replica_view

__all__ = ["LOGS_TIMEOUT_S", "MAX_LOG_LINES", "REMOVE_SEND_S", "add_node_routes"]

log = logging.getLogger("llmgw.admin.nodes")

#: Deadline for a node to answer a logs request, in seconds.
LOGS_TIMEOUT_S: Final = 10.0
#: Deadline for each frame to a node being removed (a stop, the close), in seconds.
REMOVE_SEND_S: Final = 5.0
#: The most lines one logs request may ask for.
MAX_LOG_LINES: Final = 2_000


def add_node_routes(app: QuartTrio, cluster: Cluster, live: LiveSettings, store: Store) -> None:
    """Add the routes of the module docstring to ``app``."""

    @app.get("/api/v1/nodes")
    async def list_nodes() -> Any:
        return {"data": [node_view(cluster.nodes[n], cluster) for n in sorted(cluster.nodes)]}

    @app.get("/api/v1/replicas")
    async def list_replicas() -> Any:
        keys = query_flag("engine_keys")
        shards = sorted(cluster.shards.values(), key=lambda s: (s.model, s.replica_id, s.shard_id))
        return {"data": [replica_view(s, cluster, with_key=keys) for s in shards]}

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

        version, changed = await live.update(change, actor=actor(), note=f"{action} {node_id}")
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

    @app.delete("/api/v1/nodes/<node_id>")
    async def remove_node(node_id: str) -> Any:
        certificates = await store.list_node_certificates(node_id)
        node = cluster.nodes.get(node_id)
        if node is None and all(c.revoked_at is not None for c in certificates):
            # Never known, or removed already: nothing is left to take out.
            raise NoSuch(
                f"No node {node_id!r}; {known_names('nodes', cluster.nodes)}.",
                code="node_not_found",
            )
        # Revoked first: from now on its links are refused.
        revoked = await store.revoke_node_certificates(node_id, time.time())
        send = node.send if node is not None else None
        close = node.close if node is not None else None
        # Forgotten at once: its replicas are placed elsewhere.
        gone = cluster.forget_node(node_id)
        stopped: list[str] = []
        if send is not None:
            for shard in gone:
                stop = protocol.StopShard(correlation_id=uuid.uuid4().hex, shard_id=shard.shard_id)
                try:
                    with trio.fail_after(REMOVE_SEND_S):
                        await send(stop)
                except (errors.LinkError, trio.TooSlowError) as exc:
                    log.warning("node %s: %s not stopped: %s", node_id, shard.shard_id, exc)
                else:
                    stopped.append(shard.replica_id)
        if close is not None:
            with trio.move_on_after(REMOVE_SEND_S):
                await close(f"node {node_id} was removed from the cluster")
        log.info(
            "node %s removed: %d certificate(s) revoked, %d replica(s) stopped",
            node_id,
            revoked,
            len(stopped),
        )
        return {
            "node_id": node_id,
            "revoked_certificates": revoked,
            "stopped": sorted(stopped),
            "was_connected": send is not None,
        }

    @app.get("/api/v1/logs")
    async def logs() -> Any:
        node_id = request.args.get("node", "")
        source = request.args.get("source", "")
        lines = query_int("lines", 200) or 0
        if not 1 <= lines <= MAX_LOG_LINES:
            raise BadRequest(f"'lines' must be a whole number from 1 to {MAX_LOG_LINES}.")
        if not node_id:
            if len(cluster.nodes) != 1:
                raise BadRequest("Name the node: 'node' is required when there are several.")
            node_id = next(iter(cluster.nodes))
        correlation_id = uuid.uuid4().hex
        ask = protocol.LogsRequest(correlation_id=correlation_id, source=source, lines=lines)
        try:
            with trio.fail_after(LOGS_TIMEOUT_S):
                reply = await cluster.ask(node_id, ask, correlation_id)
        except LookupError as exc:
            connected = [n for n, node in cluster.nodes.items() if node.connected]
            raise NoSuch(
                f"{str(exc).capitalize()}; {known_names('connected nodes', connected)}.",
                code="node_not_connected",
            ) from None
        except trio.TooSlowError:
            raise errors.UpstreamError(
                f"Node {node_id!r} did not answer within {LOGS_TIMEOUT_S:.0f} s."
            ) from None
        if isinstance(reply, protocol.Error):
            raise NoSuch(f"Node {node_id!r}: {reply.message}")
        assert isinstance(reply, protocol.LogsReply)
        return {"node": node_id, "source": source, "lines": list(reply.lines)}

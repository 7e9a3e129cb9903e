"""The agents' hub: the websocket endpoint every agent keeps a link to.

Links follow the rules of :mod:`llmgw.agent.session` (token, ``Register``
first within its deadline, version check, keepalive, ``Error`` answers to
frames that cannot be read). Once an agent has registered, the hub feeds
its heartbeats and shard status into the
:class:`~llmgw.control.cluster.Cluster` and hands replies to whoever asked.
A second agent registering a node already connected is refused.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import trio

from llmgw import errors
from llmgw.agent import protocol, session

from .cluster import Cluster

__all__ = ["serve_agent_hub"]

log = logging.getLogger("llmgw.control.hub")


async def serve_agent_hub(
    host: str,
    port: int,
    token: str,
    cluster: Cluster,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Accept agent links on ``host:port`` until cancelled.

    Args:
        host, port: where to listen (port 0 picks a free one).
        token: the agent token links must present (``Authorization: Bearer``).
        cluster: where the nodes' state goes.

    Returns:
        Never returns unless cancelled; ``task_status.started`` gets the
        bound port.
    """

    async def on_link(link: session.Link) -> None:
        await _handle(link, cluster)

    await session.serve_links(host, port, token, on_link, task_status=task_status)


async def _handle(link: session.Link, cluster: Cluster) -> None:
    """One agent's link, from its ``Register`` until it ends.

    Raises:
        LinkError: the link failed (the node is marked disconnected first).
    """
    # One bound method for the whole link: the cluster's node holds it, and
    # its identity says whether the node is still this link's.
    send = link.send
    node_id = ""
    try:
        first = await session.await_register(link)
        existing = cluster.nodes.get(first.node_id)
        if existing is not None and existing.connected and existing.send is not None:
            # Another agent holds this node's link: two agents for one node
            # would start engines twice and take each other's node down.
            log.warning(
                "agent link for node %s refused: that node is connected already", first.node_id
            )
            await link.refuse(
                errors.Refused(
                    f"node {first.node_id!r} is connected through another agent already; "
                    "give this agent its own --node-id"
                ),
                session.POLICY_VIOLATION,
                "node id in use",
            )
            return
        node_id = first.node_id
        link.name = f"node {node_id}"
        cluster.node_registered(first, send)
        log.info(
            "agent registered: node %s at %s (%d CPUs, %d MiB, %d GPUs)",
            node_id,
            first.address,
            first.hardware.cpu_count,
            first.hardware.memory_total_mb,
            len(first.hardware.gpus),
        )
        await send(protocol.Registered(node_id=node_id))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.keepalive)
            while True:
                _dispatch(cluster, node_id, await link.receive())
    finally:
        node = cluster.nodes.get(node_id) if node_id else None
        if node is not None and node.send is send:
            # Only this link's own node: a later link of the same node stays.
            cluster.node_disconnected(node_id)


def _dispatch(cluster: Cluster, node_id: str, message: protocol.Message) -> None:
    match message:
        case protocol.Heartbeat():
            cluster.heartbeat(message)
        case protocol.ShardStatus():
            if message.state is protocol.ShardState.FAILED:
                log.warning("shard %s on %s failed: %s", message.shard_id, node_id, message.reason)
            else:
                log.info("shard %s on %s is %s", message.shard_id, node_id, message.state)
            cluster.shard_status(message, node_id)
        case protocol.LogsReply():
            cluster.reply(message.correlation_id, message)
        case protocol.Error():
            if not (message.correlation_id and cluster.reply(message.correlation_id, message)):
                log.warning("node %s reports an error: %s", node_id, message.message)
        case _:
            log.warning(
                "node %s sent %s, which is not for a control plane", node_id, type(message).__name__
            )

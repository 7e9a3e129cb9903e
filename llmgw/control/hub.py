"""The agents' hub: the websocket endpoint every agent keeps a link to.

Each connection must present the agent token, then send ``Register`` within
:data:`REGISTER_TIMEOUT_S`. After that the hub feeds heartbeats and shard
status into the :class:`~llmgw.control.cluster.Cluster`, hands replies to
whoever asked, and answers frames it cannot read with ``Error`` without
dropping the link. Keepalive as on the agent's side: ping after 5 s idle,
3 s for the pong.
"""

from __future__ import annotations

import hmac
import logging
from typing import Final, NoReturn

import trio
import trio_websocket

from llmgw.agent import protocol
from llmgw.agent.link import PING_AFTER_IDLE_S, PONG_TIMEOUT_S

from .cluster import Cluster

__all__ = ["serve_agent_hub"]

log = logging.getLogger("llmgw.control.hub")

REGISTER_TIMEOUT_S: Final = 10.0


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

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        await _handle(request, token, cluster)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: trio_websocket.serve_websocket(
                handler,
                host,
                port,
                None,
                max_message_size=protocol.MAX_FRAME_BYTES,
                connect_timeout=10,
                disconnect_timeout=2,
                task_status=task_status,
            )
        )
        task_status.started(server.port)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


def _token_of(request: trio_websocket.WebSocketRequest) -> str:
    for name, value in request.headers:
        if name.lower() == b"authorization" and value.startswith(b"Bearer "):
            return value[7:].decode("latin-1")
    return ""


async def _handle(request: trio_websocket.WebSocketRequest, token: str, cluster: Cluster) -> None:
    if request.path != "/agent":
        await request.reject(404)
        return
    if not hmac.compare_digest(_token_of(request).encode(), token.encode()):
        log.warning("agent link refused: wrong or missing token")
        await request.reject(401)
        return
    ws = await request.accept()
    send_lock = trio.Lock()
    last_heard = trio.current_time()

    async def send(message: protocol.Message) -> None:
        frame = protocol.encode(message)
        async with send_lock:
            await ws.send_message(frame)

    node_id = ""
    try:
        with trio.fail_after(REGISTER_TIMEOUT_S):
            while True:
                try:
                    first = protocol.decode(await ws.get_message())
                except protocol.ProtocolError as exc:
                    await send(protocol.Error(message=str(exc)))
                    continue
                if isinstance(first, protocol.Register):
                    break
                await send(protocol.Error(message="the first message must be Register"))
        existing = cluster.nodes.get(first.node_id)
        if existing is not None and existing.connected and existing.send is not None:
            # Another agent holds this node's link: two agents for one node
            # would start engines twice and take each other's node down.
            log.warning(
                "agent link for node %s refused: that node is connected already", first.node_id
            )
            await send(
                protocol.Error(
                    message=f"node {first.node_id!r} is connected through another agent already; "
                    "give this agent its own --node-id"
                )
            )
            with trio.move_on_after(1):
                await ws.aclose(1008, "node id in use")
            return
        node_id = first.node_id
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

        async def keepalive() -> None:
            while True:
                idle_s = trio.current_time() - last_heard
                if idle_s < PING_AFTER_IDLE_S:
                    await trio.sleep(PING_AFTER_IDLE_S - idle_s)
                    continue
                with trio.fail_after(PONG_TIMEOUT_S):
                    await ws.ping()
                _touch()

        def _touch() -> None:
            nonlocal last_heard
            last_heard = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keepalive)
            while True:
                frame = await ws.get_message()
                _touch()
                try:
                    message = protocol.decode(frame)
                except protocol.ProtocolError as exc:
                    log.warning("bad frame from node %s: %s", node_id, exc)
                    await send(protocol.Error(message=str(exc)))
                    continue
                _dispatch(cluster, node_id, message)
    except* (trio_websocket.ConnectionClosed, trio.TooSlowError, trio.BrokenResourceError) as group:
        log.warning(
            "agent link %s closed: %s",
            node_id or "(unregistered)",
            type(group.exceptions[0]).__name__,
        )
    finally:
        if ws.closed is None:
            # Still open: the control plane is stopping. Say so, so the agent
            # does not take it for a broken link.
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await ws.aclose(1001, "control plane stopping")
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

"""The agents' hub: the websocket endpoint every agent keeps a link to.

Links follow the rules of :mod:`llmgw.agent.session` (token or mutual
TLS, ``Register`` first within its deadline, version check, keepalive,
``Error`` answers to frames that cannot be read). Once an agent has
registered, the hub feeds its heartbeats and shard status into the
:class:`~llmgw.control.cluster.Cluster` and hands replies to whoever asked.
A second agent registering a node already connected is refused.

With a cluster CA (``llmgw server``, :class:`HubTLS`) the hub listens with
mutual TLS and admits a certificate only when the store has it as issued
and not revoked (:func:`admit_certificate`); the node id is the
certificate's CN, and a ``Register`` naming another node is refused. After
``Registered`` it sends the agent hubs' URLs (``ControlPlanes``) so that the
agent can try each when it reconnects (``docs/cluster.md``).
"""

from __future__ import annotations

import datetime as dt
import logging
import ssl
from collections.abc import Awaitable, Callable
from functools import partial
from typing import NoReturn

import attrs
import trio
from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw import errors
from llmgw.agent import protocol, session
from llmgw.store import Store

from .cluster import Cluster
from .join import hub_urls

__all__ = ["HubTLS", "admit_certificate", "serve_agent_hub", "serve_standby_links"]

log = logging.getLogger("llmgw.control.hub")


@attrs.frozen(kw_only=True)
class HubTLS:
    """Mutual TLS on the agents' hub.

    Attributes:
        context: the server context, client certificates required against
            the cluster CA (``ClusterCA.server_ssl_context(client_certs=True)``).
        store: where the issued certificates are looked up.
        hosts: the names or addresses agents reach the hub by; each agent is
            sent ``wss://HOST:PORT/agent`` for each (``ControlPlanes``, the
            bound port), none when empty.
    """

    context: ssl.SSLContext
    store: Store
    hosts: tuple[str, ...] = ()


async def admit_certificate(store: Store, der: bytes) -> str:
    """The node id of an agent's certificate (DER), signed by the cluster CA
    already (the TLS handshake checked that): its CN, when the store has the
    certificate as issued to that node and not revoked.

    Raises:
        Refused: not issued by this cluster (unknown serial), revoked (with
            when), or its CN not the node it was issued to.
        StoreError: the store cannot be reached.
    """
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        raise errors.Refused("this node's certificate cannot be read") from None
    serial = format(cert.serial_number, "x")
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    common_name = names[0].value if names else ""
    cn = common_name if isinstance(common_name, str) else common_name.decode()
    record = await store.get_node_certificate(serial)
    if record is None:
        log.warning("agent certificate %s (node %r) has no record in this cluster", serial, cn)
        raise errors.Refused(
            f"node {cn!r}: certificate not issued by this cluster; join again with a new code"
        )
    if record.revoked_at is not None:
        when = dt.datetime.fromtimestamp(record.revoked_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        raise errors.Refused(
            f"node {record.node_id!r}: certificate revoked at {when} UTC; "
            "join again with a new code"
        )
    if record.node_id != cn:
        raise errors.Refused(
            f"node id mismatch: the certificate names {cn!r} but was issued to {record.node_id!r}"
        )
    return record.node_id


async def serve_agent_hub(
    host: str,
    port: int,
    token: str,
    cluster: Cluster,
    *,
    tls: HubTLS | None = None,
    standby_hint: Callable[[], str] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Accept agent links on ``host:port`` until cancelled.

    Args:
        host, port: where to listen (port 0 picks a free one).
        token: the agent token links must present (``Authorization:
            Bearer``) without ``tls``.
        cluster: where the nodes' state goes.
        tls: mutual TLS (``llmgw server``); ``None``: plain ``ws://`` with
            the token (``llmgw up``'s loopback agent).
        standby_hint: with ``tls``, while this control plane does not lead,
            agents are refused (:data:`~llmgw.agent.session.STANDBY_REASON`)
            with what this says of where the leader is.

    Returns:
        Never returns unless cancelled; ``task_status.started`` gets the
        bound port.
    """
    urls: list[str] = []

    hint = standby_hint if tls is not None else None

    async def on_link(link: session.Link) -> None:
        await _handle(link, cluster, tuple(urls), hint)

    if tls is None:
        await session.serve_links(host, port, token, on_link, task_status=task_status)
    store = tls.store

    async def admit(der: bytes) -> str:
        return await admit_certificate(store, der)

    async with trio.open_nursery() as nursery:
        bound: int = await nursery.start(
            partial(session.serve_links, host, port, "", on_link, tls=tls.context, admit=admit)
        )
        urls.extend(hub_urls(tls.hosts, bound))
        task_status.started(bound)
    raise AssertionError("unreachable")


async def _handle(
    link: session.Link,
    cluster: Cluster,
    urls: tuple[str, ...] = (),
    standby_hint: Callable[[], str] | None = None,
) -> None:
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
        certified = link.certified_node_id
        if certified and first.node_id != certified:
            log.warning("agent link refused: node %s registered as %r", certified, first.node_id)
            await link.refuse(
                errors.Refused(
                    f"node id mismatch: this node's certificate is for {certified!r}, "
                    f"it registered as {first.node_id!r}; set node_id: {certified} in agent.yaml "
                    "or leave it out"
                ),
                session.POLICY_VIOLATION,
                "node id mismatch",
            )
            return
        if standby_hint is not None and not cluster.is_leader:
            # Only the leader runs agents: the agent tries the next control
            # plane of its list at once.
            hint = standby_hint()
            log.info(
                "agent link from node %s refused: this control plane is a standby", first.node_id
            )
            await link.refuse(
                errors.Refused(f"this control plane is a standby; {hint}"),
                session.POLICY_VIOLATION,
                f"{session.STANDBY_REASON}; {hint}"[:120],
            )
            return
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
        cluster.node_registered(first, send, _closer(link))
        log.info(
            "agent registered: node %s at %s%s (%d CPUs, %d MiB, %d GPUs)",
            node_id,
            first.address,
            f" ({first.interface})" if first.interface else "",
            first.hardware.cpu_count,
            first.hardware.memory_total_mb,
            len(first.hardware.gpus),
        )
        await send(protocol.Registered(node_id=node_id))
        if urls:
            await send(protocol.ControlPlanes(urls=urls))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.keepalive)
            while True:
                _dispatch(cluster, node_id, await link.receive())
    finally:
        node = cluster.nodes.get(node_id) if node_id else None
        if node is not None and node.send is send:
            # Only this link's own node: a later link of the same node stays.
            cluster.node_disconnected(node_id)


def _closer(link: session.Link) -> Callable[[str], Awaitable[None]]:
    """Closes ``link`` as a refusal with a reason (``ctl nodes remove``)."""

    async def close(reason: str) -> None:
        await link.refuse(errors.Refused(reason), session.POLICY_VIOLATION, reason[:120])

    return close


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
        case protocol.LogsReply() | protocol.WeightsReply():
            cluster.reply(message.correlation_id, message)
        case protocol.Error():
            if not (message.correlation_id and cluster.reply(message.correlation_id, message)):
                log.warning("node %s reports an error: %s", node_id, message.message)
        case _:
            log.warning(
                "node %s sent %s, which is not for a control plane", node_id, type(message).__name__
            )


#: How often :func:`serve_standby_links` looks at the leadership, in seconds.
LEADERSHIP_POLL_S = 0.5


async def serve_standby_links(
    cluster: Cluster, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> NoReturn:
    """Close every agent's link when this control plane stops leading (its
    lease lost or not renewed in time), as a standby's refusal
    (:data:`~llmgw.agent.session.STANDBY_REASON`), so that agents move on to
    the new leader at once instead of staying linked to a control plane that
    no longer runs them. A leader cut off from the store keeps them
    (:attr:`Cluster.cut_off`: it still routes over their replicas) until the
    store answers again."""
    task_status.started()
    was_leader = cluster.routes_itself
    while True:
        await trio.sleep(LEADERSHIP_POLL_S)
        leading = cluster.routes_itself
        if was_leader and not leading:
            nodes = [n for n in cluster.nodes.values() if n.connected and n.close is not None]
            if nodes:
                log.warning(
                    "no longer leading: closing the links of %d agent(s) so they find the leader",
                    len(nodes),
                )
            for node in nodes:
                if node.close is not None:
                    try:
                        await node.close(
                            f"{session.STANDBY_REASON}; this control plane no longer leads"
                        )
                    except errors.LinkClosed:
                        pass
        was_leader = leading

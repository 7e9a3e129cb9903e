"""What the control plane knows of its nodes and shards, in memory.

The agent hub writes it (registrations, heartbeats, shard status); the
reconciler reads it and decides; the router reads the ready endpoints from
it. Everything here runs on the trio thread, so plain dicts suffice.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

import attrs
import trio

from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState
from llmgw.router.breaker import Breaker
from llmgw.store import ModelRecord

from .settings import ServerSettings

__all__ = ["Cluster", "Endpoint", "NodeInfo", "ShardInfo", "engine_key"]

log = logging.getLogger("llmgw.control")

#: How long a node may stay silent before it is counted lost, in seconds.
NODE_LOST_AFTER_S: Final = 30.0


def engine_key(secret: bytes, replica_id: str) -> str:
    """The engine key of a replica: ``hex(HMAC-SHA256(secret, replica_id))``.

    Any control plane holding the cluster secret derives the same key, so
    keys never travel between control planes (``shared/spec/security.md``).
    """
    return hmac.new(secret, replica_id.encode(), hashlib.sha256).hexdigest()


@attrs.define(kw_only=True)
class Endpoint:
    """A ready replica, or one outside-provider key, the router may send
    requests to (``shared/spec/routing.md``, endpoints).

    Attributes:
        replica_id: the replica; for an outside key ``external:<model>#<n>``.
        model: the catalog model it serves.
        base_url: ``http(s)://host:port`` plus ``path_prefix``.
        api_key: the engine key (never the client's), or the provider key.
        in_flight: requests sent and not yet finished (queue depth).
        slots: sequences the engine runs in parallel; 0 = unknown/unbounded.
        ttft_ewma_s: smoothed time to first token in seconds, ``None``
            until one was observed (:meth:`observe_ttft`).
        kv_free_ratio: free share of the KV cache, 0 … 1, from the engine's
            metrics; ``None`` when unknown.
        breaker: its circuit breaker (``llmgw.router.breaker``).
        weight: traffic share relative to the model's other outside keys (≥ 1).
        external: an outside-provider key, not a replica of ours.
        tls: speak HTTPS to it.
        path_prefix: path before ``/v1/…`` at the provider (``/openai``), or "".
    """

    #: Weight of the newest observation in :attr:`ttft_ewma_s`: about the
    #: last 10 requests count, so a replica that slows down is noticed
    #: within a few answers without one outlier swinging the choice.
    TTFT_ALPHA = 0.2

    replica_id: str
    model: str
    host: str
    port: int
    #: Kept out of ``repr``: an outside key must never reach a log.
    api_key: str = attrs.field(repr=False)
    in_flight: int = 0
    slots: int = 0
    ttft_ewma_s: float | None = None
    kv_free_ratio: float | None = None
    breaker: Breaker = attrs.field(factory=Breaker, eq=False, repr=False)
    weight: int = 1
    external: bool = False
    tls: bool = False
    path_prefix: str = ""

    @property
    def label(self) -> str:
        """What the ``x-llmgw-replica`` header and usage rows show: the replica
        id, or ``external:<model>#<n>`` for an outside key."""
        return self.replica_id

    def observe_ttft(self, seconds: float) -> None:
        """Fold one time to first token (seconds) into :attr:`ttft_ewma_s`
        (exponential moving average, weight :attr:`TTFT_ALPHA`; the first
        observation is taken as is). Negative or NaN values are ignored."""
        if not seconds >= 0:
            return
        previous = self.ttft_ewma_s
        self.ttft_ewma_s = (
            seconds if previous is None else previous + self.TTFT_ALPHA * (seconds - previous)
        )

    @property
    def base_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{_url_host(self.host)}:{self.port}{self.path_prefix}"

    @property
    def authorization(self) -> bytes:
        """The ``Authorization`` header value for this engine."""
        return f"Bearer {self.api_key}".encode()


@attrs.define(kw_only=True)
class NodeInfo:
    node_id: str
    address: str
    hardware: protocol.Hardware
    agent_version: str
    connected: bool = True
    last_seen: float = 0.0
    memory_available_mb: int = 0
    load_1m: float = 0.0
    send: Callable[[protocol.Message], Awaitable[None]] | None = None
    #: Engine ports found taken by other processes; not offered again.
    busy_ports: set[int] = attrs.field(factory=set)


@attrs.define(kw_only=True)
class ShardInfo:
    """One shard as the control plane sees it.

    ``wanted`` is False once the reconciler decided to stop it. ``failures``
    counts consecutive failures for the restart back-off.
    """

    shard_id: str
    replica_id: str
    model: str
    node_id: str
    port: int
    state: ShardState = ShardState.STARTING
    reason: str = ""
    last_lines: tuple[str, ...] = ()
    failures: int = 0
    restart_at: float = 0.0
    started_at: float = attrs.field(factory=time.time)
    ready_at: float | None = None
    wanted: bool = True
    fingerprint: str = ""


class Cluster:
    """The live view of nodes, shards and ready endpoints."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        self.shards: dict[str, ShardInfo] = {}
        self.endpoints: dict[str, list[Endpoint]] = {}
        #: The catalog as the reconciler last read it, by model name.
        self.models: dict[str, ModelRecord] = {}
        self.secret: bytes = b""
        #: The live settings, replaced whole by the settings loop.
        self.settings = ServerSettings()
        self.changed = trio.Event()
        self.is_leader = False
        self._pending: dict[str, trio.MemorySendChannel[protocol.Message]] = {}

    # --- notifications --------------------------------------------------------

    def poke(self) -> None:
        """Wake whoever waits on :attr:`changed` (the reconciler, ``/ready``)."""
        self.changed.set()
        self.changed = trio.Event()

    # --- from the hub -----------------------------------------------------------

    def node_registered(
        self, register: protocol.Register, send: Callable[[protocol.Message], Awaitable[None]]
    ) -> None:
        node = NodeInfo(
            node_id=register.node_id,
            address=register.address,
            hardware=register.hardware,
            agent_version=register.agent_version,
            last_seen=time.time(),
            memory_available_mb=register.hardware.memory_available_mb,
            send=send,
        )
        self.nodes[register.node_id] = node
        for running in register.running_shards:
            shard = self.shards.get(running.shard_id)
            if shard is None:
                continue  # adoption of unknown shards comes with the catalog work
            self._set_state(shard, running.state, "", ())
        # Shards the control plane thought were on this node but the agent
        # no longer runs have stopped.
        running_ids = {r.shard_id for r in register.running_shards}
        for shard in self.shards.values():
            if (
                shard.node_id == register.node_id
                and shard.shard_id not in running_ids
                and shard.state in (ShardState.STARTING, ShardState.READY)
            ):
                self._set_state(shard, ShardState.STOPPED, "not running after agent reconnect", ())
        self.poke()

    def node_disconnected(self, node_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.connected = False
            node.send = None
        self.poke()

    def heartbeat(self, beat: protocol.Heartbeat) -> None:
        node = self.nodes.get(beat.node_id)
        if node is not None:
            node.last_seen = time.time()
            node.memory_available_mb = beat.memory_available_mb
            node.load_1m = beat.load_1m

    def shard_status(self, status: protocol.ShardStatus) -> None:
        shard = self.shards.get(status.shard_id)
        if shard is None:
            log.info("status for unknown shard %s ignored", status.shard_id)
            return
        self._set_state(shard, status.state, status.reason, status.last_lines)
        self.poke()

    def _set_state(
        self, shard: ShardInfo, state: ShardState, reason: str, last_lines: tuple[str, ...]
    ) -> None:
        previous = shard.state
        shard.state = state
        if state is ShardState.READY:
            shard.reason = ""
            if shard.ready_at is None or previous is not ShardState.READY:
                shard.ready_at = time.time()
        elif state is ShardState.FAILED:
            last = next(
                (line.strip() for line in reversed(last_lines) if any(c.isalnum() for c in line)),
                "",
            )
            shard.reason = f"{reason}; last output: {last}" if last else reason
            shard.last_lines = last_lines
        self._rebuild_endpoints()

    def _rebuild_endpoints(self) -> None:
        old = {e.replica_id: e for eps in self.endpoints.values() for e in eps}
        endpoints: dict[str, list[Endpoint]] = {}
        for shard in self.shards.values():
            if shard.state is not ShardState.READY or not shard.wanted:
                continue
            node = self.nodes.get(shard.node_id)
            if node is None:
                continue
            ep = old.get(shard.replica_id)
            if ep is None or (ep.host, ep.port) != (node.address, shard.port):
                ep = Endpoint(
                    replica_id=shard.replica_id,
                    model=shard.model,
                    host=node.address,
                    port=shard.port,
                    api_key=engine_key(self.secret, shard.replica_id),
                )
            endpoints.setdefault(shard.model, []).append(ep)
        self.endpoints = endpoints

    # --- queries ---------------------------------------------------------------

    def ready_endpoints(self, model: str) -> list[Endpoint]:
        return self.endpoints.get(model, [])

    def any_ready(self) -> bool:
        return any(self.endpoints.values())

    def add_shard(self, shard: ShardInfo) -> None:
        self.shards[shard.shard_id] = shard
        self._rebuild_endpoints()

    def remove_shard(self, shard_id: str) -> None:
        self.shards.pop(shard_id, None)
        self._rebuild_endpoints()

    # --- request/reply over the link --------------------------------------------

    async def ask(
        self, node_id: str, message: protocol.Message, correlation_id: str
    ) -> protocol.Message:
        """Send a command that has a reply and wait for it.

        The caller bounds the wait (``trio.fail_after``).

        Raises:
            LookupError: the node is not connected.
        """
        node = self.nodes.get(node_id)
        if node is None or node.send is None:
            raise LookupError(f"node {node_id!r} is not connected")
        send, receive = trio.open_memory_channel[protocol.Message](1)
        self._pending[correlation_id] = send
        try:
            await node.send(message)
            return await receive.receive()
        finally:
            del self._pending[correlation_id]
            send.close()
            receive.close()

    def reply(self, correlation_id: str, message: protocol.Message) -> bool:
        """Hand a reply to whoever asked; ``False`` if nobody waits for it."""
        send = self._pending.get(correlation_id)
        if send is None:
            return False
        try:
            send.send_nowait(message)
        except trio.WouldBlock:
            return False
        return True


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address

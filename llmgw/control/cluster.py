"""What the control plane knows of its nodes and shards, in memory.

The agent hub reports into it (registrations, heartbeats, shard status); the
reconciler reads it and records what it decided; the router reads the ready
endpoints from it. All of them change it through :class:`Cluster`'s
methods only, never by setting a field of it, of a :class:`NodeInfo` or of a
:class:`ShardInfo`. Everything here runs on the trio thread, so plain dicts
suffice.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final

import attrs
import trio

from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState
from llmgw.router.endpoint import Endpoint
from llmgw.settings import ServerSettings
from llmgw.store import Lease, ModelRecord, Profile, profile_fingerprint

from .planning import replica_cores

__all__ = [
    "Cluster",
    "NodeInfo",
    "ShardInfo",
    "compute_lacks_gpu",
    "engine_key",
    "parse_replica_id",
    "replica_fingerprint",
    "replica_id_for",
]

log = logging.getLogger("llmgw.control")

#: How long a node's link may stay down before the node counts lost and its
#: replicas are placed elsewhere, in seconds.
NODE_LOST_AFTER_S: Final = 30.0


def engine_key(secret: bytes, replica_id: str) -> str:
    """The engine key of a replica: ``hex(HMAC-SHA256(secret, replica_id))``.

    Any control plane holding the cluster secret derives the same key, so
    keys never travel between control planes (``docs/up.md``, Engine keys).
    """
    return hmac.new(secret, replica_id.encode(), hashlib.sha256).hexdigest()


@attrs.define(kw_only=True)
class NodeInfo:
    """A node as its agent reported it.

    Attributes:
        hardware: what discovery found at registration.
        gpus: the cards as of the latest heartbeat (foreign memory
            re-evaluated each beat); at first ``hardware.gpus``.
        engines: the engines the agent has installed (``Register.engines``).
        labels: the node's labels, matched by profile selectors.
        connected: the link is up.
        disconnected_at: when the link went down (clock of
            :meth:`Cluster.now`), ``None`` while connected; the node counts
            lost :data:`NODE_LOST_AFTER_S` later.
        busy_ports: engine ports found taken by other processes; not
            offered again.
    """

    node_id: str
    address: str
    hardware: protocol.Hardware
    agent_version: str
    #: The network interface ``address`` is on, as the agent reported it.
    interface: str = ""
    connected: bool = True
    last_seen: float = 0.0
    memory_available_mb: int = 0
    load_1m: float = 0.0
    send: Callable[[protocol.Message], Awaitable[None]] | None = None
    #: Closes the node's link with a reason (``ctl nodes remove``); ``None``
    #: while it is not connected.
    close: Callable[[str], Awaitable[None]] | None = None
    busy_ports: set[int] = attrs.field(factory=set)
    engines: tuple[str, ...] = ()
    labels: dict[str, str] = attrs.field(factory=dict)
    gpus: tuple[protocol.Gpu, ...] = ()
    disconnected_at: float | None = None
    #: Measured memory read bandwidth, whole machine and one core, GB/s: the
    #: latest figures the agent sent (at first its registration's; 0 until
    #: it has measured).
    memory_bandwidth_gbps: float = attrs.field(
        default=attrs.Factory(lambda node: node.hardware.memory_bandwidth_gbps, takes_self=True)
    )
    core_bandwidth_gbps: float = attrs.field(
        default=attrs.Factory(lambda node: node.hardware.core_bandwidth_gbps, takes_self=True)
    )
    #: Engine installs that failed on the node: recipe name -> why
    #: (``Register.engine_failures``).
    engine_failures: dict[str, str] = attrs.field(factory=dict)


@attrs.define(kw_only=True)
class ShardInfo:
    """One shard as the control plane sees it; one shard per replica until
    multi-node layouts, so ``shard_id == replica_id``.

    Times are seconds on the clock of :meth:`Cluster.now` (wall-clock UTC
    epoch seconds unless a test injected another clock).

    Attributes:
        replica_id: ``<model>-<slot>`` for a replica's first generation,
            ``<model>-<slot>.g<generation>`` for a successor started by a
            rolling restart or a move (:func:`replica_id_for`).
        slot: which of the model's wanted replicas this is (0-based); -1
            when the id follows no known scheme (it is then an extra).
        generation: 1 for the first replica of a slot, +1 per successor.
        profile: the catalog profile it was started from ("" = not known
            yet, e.g. adopted before the catalog was read).
        fingerprint: :func:`replica_fingerprint` it was started with; "" =
            unknown (an agent too old to keep it).
        stale: the fingerprint differs from the catalog's current one for
            its slot; the reconciler rolls it.
        state, reason: as reported (``reason`` quotes the engine's last
            output line on FAILED).
        compute: what the engine said it runs on ("CPU", "CUDA0 …").
        progress, progress_at: the latest start-up progress and when it
            came; the start counts as progress (start deadline).
        failures: consecutive failures, for the restart back-off.
        restarts: restarts issued after failures or losses (visible count).
        restart_at: when the next restart is due; 0 = none scheduled.
        started_at, ready_at: the latest start; when it became READY.
        retiring: the reconciler decided it goes (scale-down, successor
            ready, drain, eviction, removed model): it takes no new
            requests, and is stopped once its requests finished.
        retire_reason: why it is retiring.
        stop_sent_at: when ``StopShard`` went out; the shard keeps its port
            and room until the agent confirms the stop.
        last_used_at: the latest request routed to its model (:meth:`Cluster.touch`).
        gpu_indices: the cards it was placed on.
        memory_gb, cpu_cores, gpu_memory_mb: what it reserves: host GB,
            cores, MiB on each card (0 = the cards whole).
        adopted: found running at registration rather than started here.
    """

    shard_id: str
    replica_id: str
    model: str
    node_id: str
    port: int
    slot: int = -1
    generation: int = 1
    profile: str = ""
    fingerprint: str = ""
    stale: bool = False
    state: ShardState = ShardState.STARTING
    reason: str = ""
    last_lines: tuple[str, ...] = ()
    compute: str = ""
    progress: str = ""
    progress_at: float = 0.0
    failures: int = 0
    restarts: int = 0
    restart_at: float = 0.0
    started_at: float = attrs.field(factory=time.time)
    ready_at: float | None = None
    retiring: bool = False
    retire_reason: str = ""
    retiring_at: float = 0.0
    stop_sent_at: float | None = None
    #: A StopShard must go out though the shard is not retiring (it failed
    #: here: no progress, or no GPU); the reconciler sends it.
    stop_pending: bool = False
    last_used_at: float = 0.0
    gpu_indices: tuple[int, ...] = ()
    memory_gb: float = 0.0
    cpu_cores: int = 0
    gpu_memory_mb: float = 0.0
    adopted: bool = False
    #: The node's weights fetch for it while STARTING (bytes done, total,
    #: rate; phase ``downloading`` or ``checking``); None otherwise.
    download: protocol.DownloadProgress | None = None
    #: The engine's process id on its node as last reported; 0 = none runs
    #: (or the agent does not say).
    pid: int = 0

    @property
    def wanted(self) -> bool:
        """Not retiring."""
        return not self.retiring


def replica_fingerprint(model: ModelRecord, profile: Profile) -> str:
    """The fingerprint a replica of ``profile`` is started with and compared
    against: ``profile_fingerprint`` of the profile with the fields that do
    not change a running engine — ``replicas``, ``priority``,
    ``startup_timeout_s`` — set to fixed values, so scaling or reordering
    profiles does not make replicas stale (no rolling restart)."""
    return profile_fingerprint(
        model, attrs.evolve(profile, replicas=1, priority=0, startup_timeout_s=1200.0)
    )


def replica_id_for(model: str, slot: int, generation: int = 1) -> str:
    """The replica id of ``slot``'s ``generation``: ``gemma-0``, ``gemma-0.g2``."""
    return f"{model}-{slot}" if generation <= 1 else f"{model}-{slot}.g{generation}"


def parse_replica_id(model: str, replica_id: str) -> tuple[int, int]:
    """``(slot, generation)`` of a replica id made by :func:`replica_id_for`;
    ``(-1, 1)`` for an id of another shape."""
    prefix = f"{model}-"
    if not replica_id.startswith(prefix):
        return -1, 1
    match = _REPLICA_TAIL.fullmatch(replica_id[len(prefix) :])
    if match is None:
        return -1, 1
    return int(match.group(1)), int(match.group(2) or 1)


_REPLICA_TAIL: Final = re.compile(r"(\d+)(?:\.g(\d+))?")
_GPU_WORDS: Final = ("cuda", "gpu", "rocm", "hip", "vulkan", "metal", "sycl", "nvidia")
_ZERO_OFFLOAD: Final = re.compile(r"\boffloaded 0/\d+ layers|\b0 layers offloaded")


def compute_lacks_gpu(compute: str) -> bool:
    """Whether the engine's own compute report says it runs without a GPU.

    The rule: lowercased, the text says "no gpu" / "no usable gpu", or
    reports zero layers offloaded ("offloaded 0/N layers", "0 layers
    offloaded"), or mentions "cpu" and none of cuda, gpu, rocm, hip, vulkan,
    metal, sycl, nvidia. So "CPU" is without GPU, "CUDA0 NVIDIA H100
    (+CPU)" is not; an empty report says nothing.
    """
    text = compute.lower()
    if not text.strip():
        return False
    if "no gpu" in text or "no usable gpu" in text or _ZERO_OFFLOAD.search(text):
        return True
    return "cpu" in text and not any(word in text for word in _GPU_WORDS)


class Cluster:
    """The live view of nodes, shards and ready endpoints.

    Everything below is read through properties and changed only through
    the methods: the hub reports (:meth:`node_registered`, :meth:`heartbeat`,
    :meth:`shard_status`, …), the reconciler decides (:meth:`add_shard`,
    :meth:`mark_starting`, :meth:`retire`, …), the composition root and the
    live settings set the rest (:meth:`set_leader`, :meth:`set_secret`,
    :meth:`apply_settings`). The mappings handed out are the cluster's own:
    read them, never change them.

    Args:
        clock: seconds now, for every time the cluster and the reconciler
            keep (default wall-clock ``time.time``; tests pass
            ``trio.current_time`` to run under a mock clock).

    Attributes:
        nodes, shards: by node id and shard id.
        endpoints: the READY, not retiring replicas per model (the router's view).
        models: the catalog as last read or edited, by model name; replaced
            whole, never changed in place (readers such as the gateway's
            alias map cache by its identity).
        catalog_loaded: the catalog was read whole at least once
            (:meth:`load_catalog`); the reconciler neither starts nor stops
            anything before.
        secret: the cluster secret engine keys derive from (:func:`engine_key`).
        settings: the live settings, replaced whole by the settings loop.
        changed: set (and replaced) on every change worth waking for (:meth:`poke`).
        is_leader: this control plane holds the leader lease.
        gpu_plans: the per-card GPU need in MiB of ``(model, profile)``,
            written by the model planner; placement takes cards whole
            without one.
        drain_started: when each draining node was first seen draining in
            the settings (kept in memory only: a new leader starts the
            grace afresh, which errs on serving longer).
        waiting: replicas the reconciler wants but cannot start yet, by
            the replica id they would get, with why ("profile default fits
            on no node: node-a: needs 12.0 GB host memory; …"); rewritten
            each pass. The jobs' "waiting for room" and ``ctl replicas``
            read it.
        orphans: ``(node_id, shard_id)`` of engines to stop that the
            cluster keeps no record for (duplicates found at adoption); the
            reconciler takes them (:meth:`take_orphans`) and sends their
            ``StopShard``.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._nodes: dict[str, NodeInfo] = {}
        self._shards: dict[str, ShardInfo] = {}
        self._endpoints: dict[str, list[Endpoint]] = {}
        self._models: dict[str, ModelRecord] = {}
        self._catalog_loaded = False
        self._secret = b""
        self._settings = ServerSettings()
        self._changed = trio.Event()
        self._is_leader = False
        #: time.monotonic() until which a new leader's nodes are still linking.
        self._settle_until = 0.0
        self._cut_off = False
        self._lease: Lease | None = None
        self._gpu_plans: dict[tuple[str, str], float] = {}
        self._drain_started: dict[str, float] = {}
        self._orphans: list[tuple[str, str]] = []
        self._waiting: dict[str, str] = {}
        self._clock = clock
        self._pending: dict[str, trio.MemorySendChannel[protocol.Message]] = {}
        #: Every READY shard's endpoint, retiring ones included (their
        #: requests in flight are counted until they stop).
        self._endpoint_of: dict[str, Endpoint] = {}
        self._last_used: dict[str, float] = {}
        self._waiters: collections.Counter[str] = collections.Counter()

    # --- the state, read only -------------------------------------------------------

    @property
    def nodes(self) -> Mapping[str, NodeInfo]:
        return self._nodes

    @property
    def shards(self) -> Mapping[str, ShardInfo]:
        return self._shards

    @property
    def endpoints(self) -> Mapping[str, list[Endpoint]]:
        return self._endpoints

    @property
    def models(self) -> Mapping[str, ModelRecord]:
        return self._models

    @property
    def catalog_loaded(self) -> bool:
        return self._catalog_loaded

    @property
    def secret(self) -> bytes:
        return self._secret

    @property
    def settings(self) -> ServerSettings:
        return self._settings

    @property
    def changed(self) -> trio.Event:
        return self._changed

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    @property
    def gpu_plans(self) -> Mapping[tuple[str, str], float]:
        return self._gpu_plans

    @property
    def drain_started(self) -> Mapping[str, float]:
        return self._drain_started

    @property
    def orphans(self) -> Sequence[tuple[str, str]]:
        return self._orphans

    @property
    def waiting(self) -> Mapping[str, str]:
        return self._waiting

    @waiting.setter
    def waiting(self, waiting: Mapping[str, str]) -> None:
        # Only while tests/admin still assigns it; it goes once they call set_waiting.
        self.set_waiting(waiting)

    def now(self) -> float:
        """Seconds now on the cluster's clock."""
        return self._clock()

    # --- notifications --------------------------------------------------------

    def poke(self) -> None:
        """Wake whoever waits on :attr:`changed` (the reconciler, ``/ready``)."""
        self._changed.set()
        self._changed = trio.Event()

    # --- set by the composition root, the settings loop, the admin API -------------

    def set_leader(
        self, leading: bool, *, settle_s: float = 0.0, lease: Lease | None = None
    ) -> None:
        """Whether this control plane holds the leader lease now. On coming
        to lead, ``settle_s`` seconds in which its nodes are still linking
        (:meth:`settling_s`), and the ``lease`` held (:attr:`lease`)."""
        if leading and not self._is_leader:
            self._settle_until = time.monotonic() + settle_s
            self._lease = lease
            self.leading_since = self.now()
        if not leading:
            self._lease = None
        self._is_leader = leading

    @property
    def lease(self) -> Lease | None:
        """The leader lease this control plane took when it came to lead
        (``None`` while not leading, or when it was not given): the admin
        API's writes carry it (``fence=``), so the store refuses them once
        another control plane has taken the lease over."""
        return self._lease

    @property
    def cut_off(self) -> bool:
        """This control plane led until the store stopped answering, and no
        other is known to lead: it keeps routing ``/v1`` over the replicas
        it knows and keeps its agents' links (``docs/ha.md``, the store
        down), the leader-only work stopped."""
        return self._cut_off and not self._is_leader

    @property
    def routes_itself(self) -> bool:
        """``/v1`` is answered here, not forwarded: leading, or cut off."""
        return self._is_leader or self._cut_off

    def set_cut_off(self, cut_off: bool) -> None:
        """See :attr:`cut_off`; set when a renewal failed for the store, cleared
        once the store answers again."""
        self._cut_off = cut_off

    def settling_s(self) -> float:
        """Seconds left of the window after this control plane came to lead
        in which its nodes are still linking to it (``set_leader``'s
        ``settle_s``): the router holds a request for a model with no ready
        replica meanwhile instead of refusing it. 0 when settled or not
        leading."""
        if not self._is_leader:
            return 0.0
        return max(0.0, self._settle_until - time.monotonic())

    def set_secret(self, secret: bytes) -> None:
        """The cluster secret engine keys derive from; set once at start,
        before any endpoint exists."""
        self._secret = secret

    def apply_settings(self, settings: ServerSettings) -> None:
        """Replace the live settings whole (the caller pokes when it matters)."""
        self._settings = settings

    def load_catalog(self, models: Mapping[str, ModelRecord]) -> None:
        """The catalog as read whole from the store, by model name: it
        replaces the one held and counts as loaded (:attr:`catalog_loaded`)."""
        self.replace_catalog(models)
        self._catalog_loaded = True

    def replace_catalog(self, models: Mapping[str, ModelRecord]) -> None:
        """Replace the catalog whole with ``models`` (by model name), e.g.
        after an edit through the admin API, so it is answered at once. A
        new dict each time: readers notice the change by its identity.
        Whether it counts as loaded is left as it was."""
        self._models = dict(models)

    def set_gpu_plan(self, model: str, profile: str, need_mb: float) -> None:
        """The per-card GPU need of ``(model, profile)``, in MiB."""
        self._gpu_plans[(model, profile)] = need_mb

    def set_fixed_endpoints(self, endpoints: Mapping[str, Sequence[Endpoint]]) -> None:
        """Serve ``endpoints`` (by model) with no shard behind them, for a
        cluster without agents (the gateway benchmark); the next change of
        a shard rebuilds the endpoints from the READY shards again."""
        self._endpoints = {model: list(eps) for model, eps in endpoints.items()}

    # --- demand, from the gateway ------------------------------------------------

    def touch(self, model: str, *, at: float | None = None) -> None:
        """Record a use of ``model`` (a request routed to it) at ``at``
        (default now; standby routers report theirs). Idle on-demand
        replicas are evicted ``on_demand.evict_after_idle`` seconds after
        the latest use. Cheap: call it per request."""
        when = self.now() if at is None else at
        if model in self._last_used and when <= self._last_used[model]:
            return
        self._last_used[model] = when
        for shard in self._shards.values():
            if shard.model == model:
                shard.last_used_at = max(shard.last_used_at, when)

    def last_used(self, model: str) -> float:
        """The latest :meth:`touch` of ``model``, 0 when never used."""
        return self._last_used.get(model, 0.0)

    def demand(self, model: str) -> None:
        """Ask for ``model`` to be loaded: records a use (:meth:`touch`) and
        wakes the reconciler, which starts the replicas of an on-demand
        model that has none. Then wait on :attr:`changed` until
        :meth:`ready_endpoints` has one, or use :meth:`wait_ready`."""
        self.touch(model)
        self.poke()

    def is_demanded(self, model: str) -> bool:
        """Whether an on-demand ``model`` is wanted now: someone waits in
        :meth:`wait_ready`, or it was used within ``on_demand.evict_after_idle``."""
        if self._waiters[model] > 0:
            return True
        used = self._last_used.get(model)
        if used is None:
            return False
        return self.now() - used < self._settings.on_demand.evict_after_idle

    async def wait_ready(self, model: str) -> None:
        """Demand ``model`` (:meth:`demand`) and wait until it has a READY
        endpoint. The demand holds while waiting. The caller bounds the
        wait (``trio.fail_after(settings.on_demand.load_wait)``); for a
        stopped model it would wait for ever.

        Raises:
            LookupError: ``model`` is not in the catalog.
        """
        if model not in self._models:
            raise LookupError(f"no model {model!r} in the catalog")
        self._waiters[model] += 1
        try:
            self.demand(model)
            while not self.ready_endpoints(model):
                await self._changed.wait()
        finally:
            self._waiters[model] -= 1
            if self._waiters[model] <= 0:
                del self._waiters[model]

    # --- from the hub -----------------------------------------------------------

    def node_registered(
        self,
        register: protocol.Register,
        send: Callable[[protocol.Message], Awaitable[None]],
        close: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        """A node (re)connected: record it and reconcile its running shards.

        Shards the control plane knows on this node take the agent's state
        and keep everything else (restart counts, retiring; a retiring one
        still running is sent its stop again). Shards it does
        not know are **adopted** without a restart (after a control-plane
        restart): a :class:`ShardInfo` from ``RunningShard`` (model, port,
        fingerprint, compute, cards, state), ``stale`` when the catalog is
        known and no profile of the model has that fingerprint. A shard id
        the cluster has on another node is a duplicate: the READY one is
        kept and the other engine stopped (:attr:`orphans`). Shards thought
        to be here that the agent no longer runs are STOPPED.
        """
        now = self.now()
        previous = self._nodes.get(register.node_id)
        node = NodeInfo(
            node_id=register.node_id,
            address=register.address,
            interface=register.interface,
            hardware=register.hardware,
            agent_version=register.agent_version,
            last_seen=now,
            memory_available_mb=register.hardware.memory_available_mb,
            send=send,
            close=close,
            busy_ports=previous.busy_ports if previous is not None else set(),
            engines=tuple(register.engines),
            labels=dict(register.labels),
            gpus=register.hardware.gpus,
            memory_bandwidth_gbps=register.hardware.memory_bandwidth_gbps
            or (previous.memory_bandwidth_gbps if previous is not None else 0.0),
            core_bandwidth_gbps=register.hardware.core_bandwidth_gbps
            or (previous.core_bandwidth_gbps if previous is not None else 0.0),
            engine_failures=dict(register.engine_failures),
        )
        self._nodes[register.node_id] = node
        for running in register.running_shards:
            shard = self._shards.get(running.shard_id)
            if shard is not None and shard.node_id == register.node_id:
                if running.compute:
                    shard.compute = running.compute
                if shard.retiring:
                    shard.stop_sent_at = None  # still running: the stop goes out again
                if shard.state is not running.state:
                    self._set_state(shard, running.state, "", ())
                continue
            if shard is not None:
                if shard.state is ShardState.READY and not shard.retiring:
                    log.warning(
                        "node %s runs %s, which is already on %s: stopping the duplicate",
                        register.node_id,
                        running.shard_id,
                        shard.node_id,
                    )
                    self._orphans.append((register.node_id, running.shard_id))
                    continue
                log.warning(
                    "node %s runs %s, placed again on %s meanwhile: keeping the running one",
                    register.node_id,
                    running.shard_id,
                    shard.node_id,
                )
                self._orphans.append((shard.node_id, shard.shard_id))
                del self._shards[shard.shard_id]
            adopted = self._adopt(running, register.node_id, now)
            self._shards[adopted.shard_id] = adopted
            log.info(
                "adopted %s on %s (port %d, %s%s)",
                adopted.replica_id,
                register.node_id,
                adopted.port,
                adopted.state,
                ", stale" if adopted.stale else "",
            )
        running_ids = {r.shard_id for r in register.running_shards}
        for shard in list(self._shards.values()):
            if shard.node_id != register.node_id or shard.shard_id in running_ids:
                continue
            if shard.retiring:
                del self._shards[shard.shard_id]  # it was going anyway, and is gone
            elif shard.state in (ShardState.STARTING, ShardState.READY):
                self._set_state(shard, ShardState.STOPPED, "not running after agent reconnect", ())
        self._rebuild_endpoints()
        self.poke()

    def _adopt(self, running: protocol.RunningShard, node_id: str, now: float) -> ShardInfo:
        slot, generation = parse_replica_id(running.model, running.replica_id)
        shard = ShardInfo(
            shard_id=running.shard_id,
            replica_id=running.replica_id,
            model=running.model,
            node_id=node_id,
            port=running.port,
            slot=slot,
            generation=generation,
            fingerprint=running.fingerprint,
            state=running.state,
            compute=running.compute,
            gpu_indices=tuple(running.gpu_indices),
            started_at=now,
            progress_at=now,
            ready_at=now if running.state is ShardState.READY else None,
            last_used_at=self._last_used.get(running.model, 0.0),
            adopted=True,
            pid=running.pid,
        )
        model = self._models.get(running.model)
        if model is not None and running.fingerprint:
            for profile in model.profiles:
                if replica_fingerprint(model, profile) == running.fingerprint:
                    self.assign_profile(
                        shard, profile, self._gpu_plans.get((model.name, profile.name), 0.0)
                    )
                    break
            else:
                shard.stale = True
        return shard

    def node_disconnected(self, node_id: str) -> None:
        """The node's link closed; its shards stay until it counts lost."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.connected = False
            node.send = None
            node.close = None
            node.disconnected_at = self.now()
            self._rebuild_endpoints()
        self.poke()

    def forget_node(self, node_id: str) -> list[ShardInfo]:
        """Forget ``node_id`` and its shards at once (``ctl nodes remove``),
        so that the reconciler places its replicas elsewhere; the shards
        forgotten (their engines are the caller's to stop). Nothing for a
        node it does not know."""
        self._nodes.pop(node_id, None)
        gone = [s for s in self._shards.values() if s.node_id == node_id]
        for shard in gone:
            del self._shards[shard.shard_id]
        self._rebuild_endpoints()
        self.poke()
        return gone

    def heartbeat(self, beat: protocol.Heartbeat) -> None:
        """Fold a heartbeat in: memory, load, measured bandwidth, and the
        cards' foreign use (kept as before when the beat carries none)."""
        node = self._nodes.get(beat.node_id)
        if node is not None:
            node.last_seen = self.now()
            node.memory_available_mb = beat.memory_available_mb
            node.load_1m = beat.load_1m
            if beat.gpus:
                node.gpus = beat.gpus
            # The agent measures after it registered: its figures come in
            # heartbeats; a beat without them keeps the last ones (agent.md).
            if beat.memory_bandwidth_gbps > 0:
                node.memory_bandwidth_gbps = beat.memory_bandwidth_gbps
            if beat.core_bandwidth_gbps > 0:
                node.core_bandwidth_gbps = beat.core_bandwidth_gbps

    def shard_status(self, status: protocol.ShardStatus, node_id: str | None = None) -> None:
        """Fold a shard's report in and wake the reconciler.

        ``node_id`` is the reporting node: a report about a shard the
        cluster has on another node (a stopped duplicate) is ignored. A
        retiring shard that reports STOPPED or FAILED is gone: it is
        removed, freeing its port and room. STOPPED after FAILED keeps
        FAILED (the back-off goes on). A READY shard placed on cards whose
        engine reports no GPU (:func:`compute_lacks_gpu`) is failed here
        and stopped by the reconciler. STARTING with ``progress`` moves the
        start deadline. STARTING from a READY shard (its engine stopped
        answering its health check; ``reason`` says so) takes it out of the
        endpoints, its attempts waiting for a first byte are retried
        elsewhere (:meth:`Endpoint.lose`), and its start deadline counts
        from then.
        """
        shard = self._shards.get(status.shard_id)
        if shard is None:
            log.info("status for unknown shard %s ignored", status.shard_id)
            return
        if node_id is not None and node_id != shard.node_id:
            log.info(
                "status for %s from %s ignored: it runs on %s",
                status.shard_id,
                node_id,
                shard.node_id,
            )
            return
        if shard.retiring and status.state in (ShardState.STOPPED, ShardState.FAILED):
            self.remove_shard(shard.shard_id)
            self.poke()
            return
        if status.compute:
            shard.compute = status.compute
        if status.state is ShardState.STARTING and status.progress:
            shard.progress = status.progress
            shard.progress_at = self.now()
        shard.download = status.download if status.state is ShardState.STARTING else None
        if status.pid or status.state not in (ShardState.STARTING, ShardState.READY):
            shard.pid = status.pid
        if status.state is ShardState.STARTING and shard.state is ShardState.READY:
            # Its engine stopped answering (the reason says so): out of
            # routing now; the start deadline counts from here.
            shard.progress_at = self.now()
            shard.progress = status.progress  # not the last start's
            log.warning("replica %s: %s", shard.replica_id, status.reason or "not ready")
        if status.state is ShardState.STOPPED and shard.state is ShardState.FAILED:
            self.poke()
            return
        self._set_state(shard, status.state, status.reason, status.last_lines)
        if (
            shard.state is ShardState.READY
            and shard.gpu_indices
            and compute_lacks_gpu(shard.compute)
        ):
            cards = ", ".join(map(str, shard.gpu_indices))
            self.fail_shard(
                shard,
                f"engine found no usable GPU although placed on GPU(s) {cards} "
                f"(engine reports: {shard.compute})",
            )
        self.poke()

    def fail_shard(self, shard: ShardInfo, reason: str) -> None:
        """Fail ``shard`` here (not on the agent's word) and have the
        reconciler send its ``StopShard``; the crash back-off restarts it."""
        shard.stop_pending = True
        self._set_state(shard, ShardState.FAILED, reason, ())

    def _set_state(
        self, shard: ShardInfo, state: ShardState, reason: str, last_lines: tuple[str, ...]
    ) -> None:
        previous = shard.state
        shard.state = state
        if state is ShardState.READY:
            shard.reason = ""
            if shard.ready_at is None or previous is not ShardState.READY:
                shard.ready_at = self.now()
        elif state is ShardState.FAILED:
            # The agent's reason names the cause (or the last output line).
            shard.reason = reason
            shard.last_lines = last_lines
        elif (state is ShardState.STOPPED and reason) or (
            # STARTING again after READY: its engine stopped answering.
            state is ShardState.STARTING and (reason or previous is ShardState.READY)
        ):
            shard.reason = reason
        self._rebuild_endpoints()

    def _rebuild_endpoints(self) -> None:
        """The routable endpoints from the READY shards. A replica on a node
        whose link is down is routed to only when its model has no replica
        on a connected node: a node cut off the network would otherwise take
        each request sent there for a connect timeout, while an agent merely
        restarting (its engines still serving) keeps its model answering."""
        old = self._endpoint_of
        kept: dict[str, Endpoint] = {}
        endpoints: dict[str, list[Endpoint]] = {}
        unlinked: dict[str, list[Endpoint]] = {}
        for shard in self._shards.values():
            if shard.state is not ShardState.READY:
                continue
            node = self._nodes.get(shard.node_id)
            if node is None:
                continue
            ep = old.get(shard.replica_id)
            if ep is None or (ep.host, ep.port) != (node.address, shard.port):
                ep = Endpoint(
                    replica_id=shard.replica_id,
                    model=shard.model,
                    host=node.address,
                    port=shard.port,
                    api_key=engine_key(self._secret, shard.replica_id),
                )
            kept[shard.replica_id] = ep
            if not shard.retiring:
                routable = endpoints if node.connected else unlinked
                routable.setdefault(shard.model, []).append(ep)
        for model, eps in unlinked.items():
            endpoints.setdefault(model, eps)
        for replica_id, ep in old.items():
            if kept.get(replica_id) is not ep:
                ep.lose()  # its attempts still waiting for a first byte go elsewhere
        self._endpoint_of = kept
        self._endpoints = endpoints

    # --- queries ---------------------------------------------------------------

    def ready_endpoints(self, model: str) -> list[Endpoint]:
        return self._endpoints.get(model, [])

    def any_ready(self) -> bool:
        return any(self._endpoints.values())

    def in_flight(self, replica_id: str) -> int:
        """Requests in flight on a READY replica (retiring ones included), 0
        when it has no endpoint."""
        ep = self._endpoint_of.get(replica_id)
        return 0 if ep is None else ep.in_flight

    def add_shard(self, shard: ShardInfo) -> None:
        """Record a shard (its ``last_used_at`` is at least its model's latest use)."""
        shard.last_used_at = max(shard.last_used_at, self._last_used.get(shard.model, 0.0))
        self._shards[shard.shard_id] = shard
        self._rebuild_endpoints()

    def remove_shard(self, shard_id: str) -> None:
        """Forget a shard (stopped, or its node lost); its port and room are free."""
        self._shards.pop(shard_id, None)
        self._rebuild_endpoints()

    def retire(self, shard: ShardInfo, reason: str) -> None:
        """Take ``shard`` out of service: no new requests; the reconciler
        stops it once its requests in flight are done. Repeating is a no-op."""
        if shard.retiring:
            return
        shard.retiring = True
        shard.retire_reason = reason
        shard.retiring_at = self.now()
        shard.restart_at = 0.0
        log.info("retiring %s on %s: %s", shard.replica_id, shard.node_id, reason)
        self._rebuild_endpoints()

    # --- decided by the reconciler --------------------------------------------------

    def check_fingerprint(self, shard: ShardInfo, fingerprint: str) -> None:
        """Compare ``shard`` with its slot's current ``fingerprint``: it is
        :attr:`~ShardInfo.stale` when it has a fingerprint and that differs."""
        shard.stale = bool(shard.fingerprint) and shard.fingerprint != fingerprint

    def assign_profile(self, shard: ShardInfo, profile: Profile, gpu_memory_mb: float) -> None:
        """``shard`` runs as ``profile`` and reserves what it asks: its host
        memory, its cores (:func:`~llmgw.control.placement.replica_cores` on
        its node) and ``gpu_memory_mb`` MiB on each card."""
        shard.profile = profile.name
        shard.memory_gb = profile.min_memory_gb
        node = self._nodes.get(shard.node_id)
        shard.cpu_cores = replica_cores(
            profile,
            node.hardware.cpu_count if node is not None else 0,
            on_cards=bool(shard.gpu_indices),
        )
        shard.gpu_memory_mb = gpu_memory_mb

    def mark_starting(self, shard: ShardInfo) -> None:
        """A ``StartShard`` goes out for ``shard``: STARTING from now (the
        start deadline counts from here), no restart scheduled, no longer
        READY."""
        now = self.now()
        was_ready = shard.state is ShardState.READY
        shard.state = ShardState.STARTING
        shard.restart_at = 0.0
        shard.started_at = now
        shard.progress_at = now
        shard.progress = ""
        shard.ready_at = None
        if was_ready:
            self._rebuild_endpoints()

    def count_failure(self, shard: ShardInfo, *, afresh: bool) -> None:
        """One more consecutive failure of ``shard``; ``afresh``: it had run
        well, so the count (and with it the back-off) starts over at 1."""
        if afresh:
            shard.failures = 0
        shard.failures += 1

    def schedule_restart(self, shard: ShardInfo, at: float) -> None:
        """Restart the FAILED ``shard`` at ``at`` (the cluster's clock)."""
        shard.restart_at = at

    def count_restart(self, shard: ShardInfo) -> None:
        """A restart of ``shard`` after a failure or a stop was sent."""
        shard.restarts += 1

    def mark_port_busy(self, node_id: str, port: int) -> None:
        """``port`` on ``node_id`` is taken by another process: never offered again."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.busy_ports.add(port)

    def move_port(self, shard: ShardInfo, port: int) -> None:
        """``shard`` is started on ``port`` from now on."""
        shard.port = port
        if shard.state is ShardState.READY:
            self._rebuild_endpoints()

    def mark_stop_sent(self, shard: ShardInfo) -> None:
        """The ``StopShard`` owed for a shard failed here went out."""
        shard.stop_pending = False

    def mark_stopping(self, shard: ShardInfo, at: float) -> None:
        """The retiring ``shard``'s ``StopShard`` went out at ``at``; it keeps
        its port and room until the agent confirms the stop."""
        shard.stop_sent_at = at
        shard.stop_pending = False

    def set_waiting(self, waiting: Mapping[str, str]) -> None:
        """Replace :attr:`waiting` whole (replica id → why it cannot start yet)."""
        self._waiting = dict(waiting)

    def take_orphans(self) -> list[tuple[str, str]]:
        """The ``(node_id, shard_id)`` engines to stop, handed over once."""
        orphans, self._orphans = self._orphans, []
        return orphans

    def drain_began(self, node_id: str, at: float) -> None:
        """``node_id`` was first seen draining at ``at`` (the drain grace counts from it)."""
        self._drain_started[node_id] = at

    def drain_ended(self, node_id: str) -> None:
        """``node_id`` is no longer draining."""
        del self._drain_started[node_id]

    # --- request/reply over the link --------------------------------------------

    async def ask(
        self, node_id: str, message: protocol.Message, correlation_id: str
    ) -> protocol.Message:
        """Send a command that has a reply and wait for it.

        The caller bounds the wait (``trio.fail_after``).

        Raises:
            LookupError: the node is not connected.
        """
        node = self._nodes.get(node_id)
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

    # --- changes asked through the admin API -------------------------------------

    def put_model(self, model: ModelRecord) -> None:
        """Add or replace the catalog entry ``model.name`` (the catalog is
        replaced whole, so readers that cache by its identity see the
        change) and wake the reconciler."""
        self.replace_catalog({**self._models, model.name: model})
        self.poke()

    def drop_model(self, name: str) -> None:
        """Remove the catalog entry ``name``, if there is one (the catalog is
        replaced whole), and wake the reconciler."""
        self.replace_catalog({k: v for k, v in self._models.items() if k != name})
        self.poke()

    #: When this control plane last came to lead (:meth:`now`'s clock);
    #: ``None`` before it ever led.
    leading_since: float | None = None

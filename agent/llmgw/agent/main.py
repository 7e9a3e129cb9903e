"""The agent process: discovery, the supervisor, telemetry and the link, in one nursery.

``serve_agent`` is what ``llmgw agent`` (through :func:`run_agent`) and
``llmgw up`` run. In ``llmgw up`` the agent owns its engines
(``owns_engines=True``): they stop with it. A standalone agent leaves them
running; the next agent process on the same state directory adopts them
(``docs/architecture.md``, Tasks; ``docs/catalog.md``, adoption).

Telemetry: memory bandwidth is measured only after the agent reached its
control plane, first after a random pause (10-120 s by default, so machines
that boot together do not measure together), then hourly, keeping the best
figure; it goes in every ``Heartbeat`` and the next ``Register``. Each
measurement waits for an idle node, runs at the lowest CPU priority and
gives way when the node gets busy (:mod:`llmgw.agent.background`;
``docs/up.md``, "Background measurements"). GPU readings are taken at most
every :data:`GPU_READ_INTERVAL_S` and dropped when older than
:data:`GPU_READING_MAX_AGE_S`.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from llmgw.engines.base import EngineAdapter
from llmgw.engines.llamacpp import LlamaCppAdapter
from llmgw.engines.registry import get_adapter

from . import background, discovery, installs, protocol
from .link import CONTROL_PLANES_FILE, AgentHandlers, ServerList, serve_link
from .processes import STOP_GRACE_S
from .state import default_state_dir
from .status_socket import AgentStatus, serve_status_socket
from .supervisor import Supervisor

__all__ = [
    "AGENT_VERSION",
    "BUILTIN_ENGINES",
    "AgentConfig",
    "advertised_engines",
    "install_engines",
    "run_agent",
    "serve_agent",
]

log = logging.getLogger("llmgw.agent")

AGENT_VERSION: Final = "0.1.0"
#: Shard status changes waiting for the link.
STATUS_QUEUE_SIZE: Final = 256
#: The least time between two GPU readings, in seconds (10 s).
GPU_READ_INTERVAL_S: Final = 10.0
#: How long one GPU reading may take, in seconds (5 s).
GPU_READ_TIMEOUT_S: Final = 5.0
#: How long a stopping agent gives its link to close as a stop, in seconds.
STOP_LINK_S: Final = 2.0
#: GPU readings older than this are not sent, in seconds (a minute).
GPU_READING_MAX_AGE_S: Final = 60.0


@attrs.frozen(kw_only=True)
class AgentConfig:
    """Attributes:
    server_url: the control plane's agent hub, ``ws://host:7443/agent``
        (``wss://`` with mutual TLS).
    token: the agent token the hub expects ("" with mutual TLS).
    servers: more agent hubs to try in turn after ``server_url``
        (agent.yaml's ``servers``); with the leader's list, kept in the
        state directory (:class:`~llmgw.agent.link.ServerList`).
    ssl_context: the node's certificate and the cluster CA, for ``wss://``
        (:func:`llmgw.agent.config.agent_ssl_context`).
    address: where the control plane and the gateway reach this node's
        engines, which listen there; the source address of the route to the
        control plane when empty.
    labels: the node's labels, sent in ``Register``.
    node_id: this node's name; the host name when empty.
    llamacpp_bin: a ``llama-server`` binary; the bundled launcher when None.
    owns_engines: stop the engines when the agent stops (``llmgw up``).
    state_dir: shard files and engine logs, for adoption
        (:mod:`llmgw.agent.state`); None = ``~/.local/state/llmgw/agent/<node>``
        (``$XDG_STATE_HOME`` if set).
    measure_bandwidth: measure memory bandwidth in the background.
    bandwidth_first_delay_s: the first measurement comes after a random
        pause in this range (seconds) once registered.
    bandwidth_interval_s: seconds between later measurements.
    bandwidth_busy_cpus: others using more CPUs than this (averaged over
        half a second) make the node busy: the measurement waits, or gives
        way; None = a tenth of the node's CPUs, at least 0.25
        (:func:`~llmgw.agent.background.busy_cpus_threshold`).
    engine_stop_grace_s: seconds an engine gets between SIGTERM and
        SIGKILL when it is stopped (:func:`~llmgw.agent.processes.stop_groups`;
        ``llmgw up`` gives less, its stop being bounded, ``docs/up.md``).
    stop: set it to stop the agent: its link closes as a stop (the
        control plane logs a stop, not a lost link), then its engines stop
        (when it owns them) and :func:`serve_agent` returns. ``None``: the
        agent runs until cancelled.
    engine_installs: names in ``recipes`` to install (each once) before
        the agent registers (:mod:`llmgw.agent.installs`); an engine is
        advertised in ``Register.engines`` only once installed and probed,
        and a failed one is reported in ``Register.engine_failures``.
    engines_dir: where installed engines live; None = ``engines/`` in the
        state directory.
    uv: the ``uv`` executable installs run.
    recipes: the recipes by name (:data:`~llmgw.agent.installs.RECIPES`).
    weights_dir: where pinned model versions are fetched to
        (``hf/<ORG>/<REPO>/<commit>/…``, ``docs/models-from-hf.md``); None =
        ``weights/`` in the state directory.
    """

    server_url: str
    token: str
    servers: tuple[str, ...] = ()
    ssl_context: ssl.SSLContext | None = None
    address: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    node_id: str = ""
    llamacpp_bin: str | None = None
    owns_engines: bool = False
    state_dir: Path | None = None
    measure_bandwidth: bool = True
    bandwidth_first_delay_s: tuple[float, float] = (10.0, 120.0)
    bandwidth_interval_s: float = 3600.0
    bandwidth_busy_cpus: float | None = None
    engine_stop_grace_s: float = STOP_GRACE_S
    stop: trio.Event | None = None
    engine_installs: tuple[str, ...] = ()
    engines_dir: Path | None = None
    uv: str = "uv"
    recipes: Mapping[str, installs.EngineRecipe] = installs.RECIPES
    weights_dir: Path | None = None


@attrs.define
class _Telemetry:
    """What the agent measured, for heartbeats and registrations."""

    memory_bandwidth_gbps: float = 0.0
    core_bandwidth_gbps: float = 0.0
    gpus: tuple[protocol.Gpu, ...] = ()
    gpus_read_at: float = -1e9
    #: Set once a control plane accepted this agent (any session).
    registered: trio.Event = attrs.field(factory=trio.Event)


async def serve_agent(
    config: AgentConfig, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the agent until cancelled, or until ``config.stop`` is set.

    Engines found running in the state directory are adopted before the
    first ``Register``, which lists them in ``running_shards``.

    Returns:
        Once ``config.stop`` is set, the link closed and the engines
        stopped (when it owns them); never otherwise unless cancelled.
        ``task_status.started`` gets the :class:`Supervisor` once it can
        take commands.

    Raises:
        StateDirBusy: another agent uses the state directory.
        OSError: the state directory cannot be created.
    """
    node_id = config.node_id or discovery.node_id()
    hardware = await discovery.discover_hardware_async()
    # Found again for each link (the route to the control plane it goes to).
    address = config.address or "127.0.0.1"
    send, receive = trio.open_memory_channel[protocol.ShardStatus](STATUS_QUEUE_SIZE)
    telemetry = _Telemetry(gpus=hardware.gpus, gpus_read_at=trio.current_time())
    state_dir = config.state_dir or default_state_dir(node_id)
    servers = ServerList([config.server_url, *config.servers], path=state_dir / CONTROL_PLANES_FILE)

    engines_dir = config.engines_dir or state_dir / "engines"
    # Filled once the supervisor holds the state directory (so two agents on
    # one directory never install into it at once), before the first Register.
    engine_failures: dict[str, str] = {}
    installed: dict[str, installs.InstalledEngine] = {}
    engines: tuple[str, ...] = BUILTIN_ENGINES

    def adapter_for(engine: str) -> EngineAdapter:
        vllm = installed.get("vllm")
        gpu_llamacpp = installed.get("llamacpp")
        if engine == "llamacpp" and not config.llamacpp_bin and gpu_llamacpp and hardware.gpus:
            # the GPU build's environment runs the bundled launcher
            return LlamaCppAdapter(python=gpu_llamacpp.executable)
        return get_adapter(
            engine, llamacpp_bin=config.llamacpp_bin, vllm_bin=vllm.executable if vllm else ""
        )

    supervisor = Supervisor(
        adapter_for=adapter_for,
        events=send,
        state_dir=state_dir,
        owns_engines=config.owns_engines,
        stop_grace_s=config.engine_stop_grace_s,
        weights_dir=config.weights_dir or state_dir / "weights",
    )

    async def register() -> protocol.Register:
        nonlocal address
        if not config.address:
            # The route to the control plane this link goes to.
            try:
                address = await trio.to_thread.run_sync(
                    discovery.route_address, _host_of(servers.current)
                )
            except OSError as exc:
                log.warning("no route to %s (%s); reporting %s", servers.current, exc, address)
        total_mb, available_mb = discovery.memory_mb()
        hw = attrs.evolve(
            hardware,
            memory_total_mb=total_mb,
            memory_available_mb=available_mb,
            memory_bandwidth_gbps=telemetry.memory_bandwidth_gbps,
            core_bandwidth_gbps=telemetry.core_bandwidth_gbps,
        )
        return protocol.Register(
            node_id=node_id,
            address=address,
            interface=discovery.interface_of(address),
            labels=dict(config.labels),
            agent_version=AGENT_VERSION,
            hardware=hw,
            engines=engines,
            running_shards=tuple(supervisor.running()),
            engine_failures=dict(engine_failures),
        )

    async def heartbeat() -> protocol.Heartbeat:
        total_mb, available_mb = discovery.memory_mb()
        return protocol.Heartbeat(
            node_id=node_id,
            memory_total_mb=total_mb,
            memory_available_mb=available_mb,
            cpu_count=hardware.cpu_count,
            load_1m=os.getloadavg()[0],
            gpus=await _gpu_readings(telemetry, bool(hardware.gpus)),
            memory_bandwidth_gbps=telemetry.memory_bandwidth_gbps,
            core_bandwidth_gbps=telemetry.core_bandwidth_gbps,
        )

    def logs(source: str, lines: int) -> list[str]:
        lines = max(lines, 1)
        if source:
            if supervisor.state(source) is None:
                raise LookupError(f"no shard {source!r} on node {node_id}")
            return supervisor.logs(source, lines)
        return list(_AGENT_LOG.lines)[-lines:]

    def on_registered(_: protocol.Registered) -> None:
        telemetry.registered.set()
        linked_since[0] = time.time()

    async def stop_engines() -> int:
        count = len(supervisor.running())
        if count:
            await supervisor.stop_all()
        return count

    handlers = AgentHandlers(
        register=register,
        heartbeat=heartbeat,
        start_shard=supervisor.start_shard,
        stop_shard=supervisor.stop_shard,
        logs=logs,
        status_events=receive,
        on_registered=on_registered,
        stop_engines=stop_engines,
        weights=supervisor.weights,
    )
    log.info("agent %s: state in %s", node_id, state_dir)
    # The read-only status socket for the node console (status_socket.py).
    linked_since = [time.time()]
    status = AgentStatus(
        node_id=node_id,
        version=AGENT_VERSION,
        state_dir=state_dir,
        control_planes=servers.urls,
        current=lambda: servers.current,
        linked=telemetry.registered.is_set,
        since=lambda: linked_since[0],
        running=supervisor.running,
        gpus=lambda: telemetry.gpus,
        log_lines=lambda: list(_AGENT_LOG.lines),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.serve)
        try:
            await nursery.start(serve_status_socket, status)
        except OSError as exc:
            log.warning("no status socket in %s: %s", state_dir, exc)
        engine_failures.update(
            await install_engines(config, engines_dir, has_gpu=bool(hardware.gpus))
        )
        installed.update(_chosen_installs(config, installs.installed_engines(engines_dir)))
        engines = advertised_engines(installed.values())
        async with trio.open_nursery() as link_nursery:
            # serve_link returns only once config.stop is set and the link closed.
            await link_nursery.start(
                partial(
                    serve_link,
                    servers,
                    config.token,
                    handlers,
                    stop=config.stop,
                    ssl_context=config.ssl_context,
                )
            )
            if config.measure_bandwidth:
                nursery.start_soon(_serve_bandwidth, config, telemetry, hardware.cpu_count)
            task_status.started(supervisor)
        nursery.cancel_scope.cancel()


def _host_of(url: str) -> str:
    """The host of ``ws[s]://host:port/path`` (an IPv6 address without brackets)."""
    netloc = url.split("://", 1)[-1].split("/", 1)[0]
    if netloc.startswith("["):
        return netloc[1:].split("]", 1)[0]
    return netloc.rsplit(":", 1)[0]


async def run_agent(config: AgentConfig) -> None:
    """Run :func:`serve_agent` until SIGINT or SIGTERM (``llmgw agent``).

    Engines keep running after it returns unless ``config.owns_engines``.

    Raises:
        StateDirBusy: another agent uses the state directory.
        OSError: the state directory cannot be created.
    """
    stop = trio.Event()
    config = attrs.evolve(config, stop=stop)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_agent, config)
            async for signum in signals:
                log.info(
                    "%s: agent stopping; engines %s",
                    signal.Signals(signum).name,
                    "stop too" if config.owns_engines else "keep running",
                )
                break
            # The link closes as a stop; what is left after that is cancelled.
            stop.set()
            nursery.cancel_scope.deadline = trio.current_time() + STOP_LINK_S


async def _gpu_readings(telemetry: _Telemetry, has_gpus: bool) -> tuple[protocol.Gpu, ...]:
    """The cards as now: re-read at most every :data:`GPU_READ_INTERVAL_S`
    (in a thread, :data:`GPU_READ_TIMEOUT_S` at most); a reading older than
    :data:`GPU_READING_MAX_AGE_S` is dropped, not re-sent. No cards at
    start (no driver) means none, without asking NVML again."""
    if not has_gpus:
        return ()
    now = trio.current_time()
    if now - telemetry.gpus_read_at >= GPU_READ_INTERVAL_S:
        with trio.move_on_after(GPU_READ_TIMEOUT_S):
            gpus, _ = await trio.to_thread.run_sync(discovery.discover_gpus, abandon_on_cancel=True)
            if gpus:
                telemetry.gpus = gpus
                telemetry.gpus_read_at = trio.current_time()
    if trio.current_time() - telemetry.gpus_read_at > GPU_READING_MAX_AGE_S:
        return ()
    return telemetry.gpus


def _bandwidth_measurer() -> tuple[Callable[..., Any], type[Exception], type[Exception]] | None:
    """``(measure_bandwidth, BandwidthError, BandwidthInterrupted)``, or None
    when :mod:`llmgw.agent.bandwidth` is not there."""
    try:
        from . import bandwidth
    except ImportError as exc:
        log.info("memory bandwidth not measured: %s", exc)
        return None
    return bandwidth.measure_bandwidth, bandwidth.BandwidthError, bandwidth.BandwidthInterrupted


async def _serve_bandwidth(config: AgentConfig, telemetry: _Telemetry, cpus: int) -> None:
    """Measure memory bandwidth once registered, after a random pause, then
    every ``bandwidth_interval_s``, keeping the best figures; each time only
    on an idle node, giving way when it gets busy
    (:func:`~llmgw.agent.background.run_when_idle`)."""
    found = _bandwidth_measurer()
    if found is None:
        return
    measure, error, interrupted = found
    busy_cpus = config.bandwidth_busy_cpus
    if busy_cpus is None:
        busy_cpus = background.busy_cpus_threshold(cpus)
    await telemetry.registered.wait()
    low, high = config.bandwidth_first_delay_s
    await trio.sleep(random.uniform(low, high))
    while True:
        try:
            result = await background.run_when_idle(
                "memory bandwidth measurement",
                lambda run: measure(run=run),
                busy_cpus=busy_cpus,
                interrupted=interrupted,
            )
        except (error, MemoryError, OSError) as exc:
            log.info("memory bandwidth not measured: %s; trying again later", exc)
        else:
            machine = float(result.machine_gbps)
            core = float(result.core_gbps)
            log.info("memory bandwidth: read_gbs=%.1f one_core_gbs=%.1f", machine, core)
            if machine > telemetry.memory_bandwidth_gbps:
                telemetry.memory_bandwidth_gbps = machine
                telemetry.core_bandwidth_gbps = core
        await trio.sleep(config.bandwidth_interval_s)


class _RingHandler(logging.Handler):
    """Keeps the agent's own last 2,000 log lines for ``ctl logs NODE``."""

    def __init__(self, size: int = 2000) -> None:
        super().__init__()
        from collections import deque

        self.lines: deque[str] = deque(maxlen=size)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


_AGENT_LOG = _RingHandler()
logging.getLogger("llmgw.agent").addHandler(_AGENT_LOG)


#: Engines every agent can run without an install: llama.cpp's CPU build
#: (xllamacpp, a dependency of llmgw) and the sim engine.
BUILTIN_ENGINES: Final = ("llamacpp", "sim")


async def install_engines(
    config: AgentConfig, engines_dir: Path, *, has_gpu: bool
) -> dict[str, str]:
    """Install each of ``config.engine_installs`` not yet installed
    (:func:`~llmgw.agent.installs.install`), one after the other.

    Returns:
        recipe name -> why it is not installed (an unknown name, a recipe
        for cards on a node without one, or the install's failure); empty
        when every one is installed and probed.
    """
    failures: dict[str, str] = {}
    for name in config.engine_installs:
        recipe = config.recipes.get(name)
        if recipe is None:
            known = ", ".join(sorted(config.recipes)) or "none"
            failures[name] = f"no install recipe {name!r} (known: {known})"
        elif recipe.needs_gpu and not has_gpu:
            failures[name] = f"{recipe.key} needs an NVIDIA card; this node has none"
        else:
            try:
                await installs.install(recipe, engines_dir, uv=config.uv)
            except (installs.InstallFailed, OSError) as exc:
                failures[name] = str(exc)
        if name in failures:
            log.warning("engine install %s: %s", name, failures[name])
    return failures


def advertised_engines(installed: Iterable[installs.InstalledEngine]) -> tuple[str, ...]:
    """``Register.engines``: :data:`BUILTIN_ENGINES` and every engine
    installed and probed (a GPU build of a built-in adds no name), sorted."""
    names = set(BUILTIN_ENGINES)
    names.update(e.engine for e in installed)
    return tuple(sorted(names))


def _chosen_installs(
    config: AgentConfig, found: Iterable[installs.InstalledEngine]
) -> dict[str, installs.InstalledEngine]:
    """Engine name -> the install its replicas run: the one of a recipe
    asked for (``engine_installs``), else any found (by directory name)."""
    wanted = {config.recipes[n].key for n in config.engine_installs if n in config.recipes}
    chosen: dict[str, installs.InstalledEngine] = {}
    for engine in found:
        held = chosen.get(engine.engine)
        if held is None or held.key not in wanted:
            chosen[engine.engine] = engine
    return chosen

"""The agent process: discovery, the supervisor and the link, in one nursery.

``serve_agent`` is what ``llmgw agent`` and ``llmgw up`` run. In ``llmgw up``
the agent owns its engines (``owns_engines=True``): they stop with it. A
standalone agent leaves them running for the next agent to adopt.
"""

from __future__ import annotations

import logging
import os
from typing import Final, NoReturn

import attrs
import trio

from llmgw.engines.base import EngineAdapter
from llmgw.engines.registry import get_adapter

from . import discovery, protocol
from .link import AgentHandlers, serve_link
from .supervisor import Supervisor

__all__ = ["AGENT_VERSION", "AgentConfig", "serve_agent"]

log = logging.getLogger("llmgw.agent")

AGENT_VERSION: Final = "0.1.0"
#: Shard status changes waiting for the link.
STATUS_QUEUE_SIZE: Final = 256


@attrs.frozen(kw_only=True)
class AgentConfig:
    """Attributes:
    server_url: the control plane's agent hub, ``ws://host:7443/agent``.
    token: the agent token the hub expects.
    node_id: this node's name; the host name when empty.
    llamacpp_bin: a ``llama-server`` binary; the bundled launcher when None.
    owns_engines: stop the engines when the agent stops (``llmgw up``).
    """

    server_url: str
    token: str
    node_id: str = ""
    llamacpp_bin: str | None = None
    owns_engines: bool = False


async def serve_agent(
    config: AgentConfig, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
) -> NoReturn:
    """Run the agent until cancelled.

    Returns:
        Never returns unless cancelled; ``task_status.started`` gets the
        :class:`Supervisor` once it can take commands.
    """
    node_id = config.node_id or discovery.node_id()
    hardware = await discovery.discover_hardware_async()
    host = config.server_url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
    address = discovery.route_address(host.strip("[]"))
    send, receive = trio.open_memory_channel[protocol.ShardStatus](STATUS_QUEUE_SIZE)

    def adapter_for(engine: str) -> EngineAdapter:
        return get_adapter(engine, llamacpp_bin=config.llamacpp_bin)

    supervisor = Supervisor(
        adapter_for=adapter_for,
        events=send,
        owns_engines=config.owns_engines,
    )

    async def register() -> protocol.Register:
        total_mb, available_mb = discovery.memory_mb()
        hw = attrs.evolve(hardware, memory_total_mb=total_mb, memory_available_mb=available_mb)
        return protocol.Register(
            node_id=node_id,
            address=address,
            agent_version=AGENT_VERSION,
            hardware=hw,
            engines=("llamacpp", "sim"),
            running_shards=tuple(supervisor.running()),
        )

    async def heartbeat() -> protocol.Heartbeat:
        total_mb, available_mb = discovery.memory_mb()
        return protocol.Heartbeat(
            node_id=node_id,
            memory_total_mb=total_mb,
            memory_available_mb=available_mb,
            cpu_count=hardware.cpu_count,
            load_1m=os.getloadavg()[0],
        )

    def logs(source: str, lines: int) -> list[str]:
        lines = max(lines, 1)
        if source:
            if supervisor.state(source) is None:
                raise LookupError(f"no shard {source!r} on node {node_id}")
            return supervisor.logs(source, lines)
        return list(_AGENT_LOG.lines)[-lines:]

    handlers = AgentHandlers(
        register=register,
        heartbeat=heartbeat,
        start_shard=supervisor.start_shard,
        stop_shard=supervisor.stop_shard,
        logs=logs,
        status_events=receive,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.serve)
        await nursery.start(serve_link, config.server_url, config.token, handlers)
        task_status.started(supervisor)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


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

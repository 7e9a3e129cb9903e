"""The agent's read-only status socket, for the node console
(``llmgw console --node``, ``docs/console.md``).

A Unix socket, ``STATE_DIR/agent.sock`` (:data:`STATUS_SOCKET`), mode
0600: each connection gets one JSON document and is closed; what is sent
to it is ignored. The document (:func:`snapshot` builds it)::

    {"node_id", "version", "pid", "state": "linked" | "connecting",
     "since" (epoch seconds the state began), "now" (epoch seconds),
     "control_planes": [{"url", "current", "answers": bool}],
     "engines": [{"shard_id", "replica_id", "model", "state", "port",
                  "pid", "alive": bool, "gpus": [int]}],
     "gpus": [{"index", "name", "memory_total_mb", "memory_used_mb"}],
     "disk": {"path", "free_bytes", "total_bytes"},
     "warnings": ["…"]}   (the agent's WARNING and ERROR lines, newest last)

Nothing in it needs the admin token or a reachable control plane: it is
made from the agent's own memory, its state directory and ``/proc``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from . import protocol

__all__ = [
    "PROBE_TIMEOUT_S",
    "STATUS_SOCKET",
    "AgentStatus",
    "pid_alive",
    "probe_address",
    "serve_status_socket",
    "snapshot",
]

log = logging.getLogger("llmgw.agent.status")

#: The socket's file name in the state directory.
STATUS_SOCKET: Final = "agent.sock"
#: Deadline for one control plane to accept a TCP connection, in seconds.
PROBE_TIMEOUT_S: Final = 1.0
#: Deadline to write one answer, in seconds.
SEND_TIMEOUT_S: Final = 5.0
#: The most warning lines in one answer.
MAX_WARNINGS: Final = 50


@attrs.define(kw_only=True)
class AgentStatus:
    """What the agent knows of itself, read when a client connects.

    Attributes:
        node_id: the node's name.
        version: the agent's version.
        state_dir: the state directory (its disk is the one reported).
        control_planes: the agent hubs it knows, in the order it tries them.
        current: the hub it dials now.
        linked: whether a control plane accepted it on the current link.
        since: epoch seconds ``linked`` last changed.
        running: the shards the supervisor runs.
        gpus: the last GPU readings.
        log_lines: the agent's recent log lines.
    """

    node_id: str
    version: str
    state_dir: Path
    control_planes: Callable[[], list[str]]
    current: Callable[[], str]
    linked: Callable[[], bool]
    since: Callable[[], float]
    running: Callable[[], list[protocol.RunningShard]]
    gpus: Callable[[], tuple[protocol.Gpu, ...]]
    log_lines: Callable[[], Iterable[str]]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    if pid <= 0:
        return False
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def _host_port(url: str) -> tuple[str, int]:
    netloc = url.split("://", 1)[-1].split("/", 1)[0]
    default = 443 if url.startswith("wss://") else 80
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default
    host, _, port = netloc.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else (netloc, default)


async def probe_address(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the host of the agent hub ``url`` accepts a TCP connection
    within ``timeout_s`` seconds."""
    try:
        host, port = _host_port(url)
    except ValueError:
        return False
    with trio.move_on_after(timeout_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


async def snapshot(status: AgentStatus) -> dict[str, Any]:
    """The document of the module docstring (probing every control plane
    at once, each within :data:`PROBE_TIMEOUT_S`)."""
    urls = status.control_planes()
    answers: dict[str, bool] = {}

    async def probe(url: str) -> None:
        answers[url] = await probe_address(url)

    async with trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(probe, url)
    try:
        usage = shutil.disk_usage(status.state_dir)
        disk = {
            "path": str(status.state_dir),
            "free_bytes": usage.free,
            "total_bytes": usage.total,
        }
    except OSError:
        disk = {"path": str(status.state_dir), "free_bytes": None, "total_bytes": None}
    warnings = [line for line in status.log_lines() if " WARNING " in line or " ERROR " in line][
        -MAX_WARNINGS:
    ]
    current = status.current()
    return {
        "node_id": status.node_id,
        "version": status.version,
        "pid": os.getpid(),
        "state": "linked" if status.linked() and answers.get(current, False) else "connecting",
        "since": status.since(),
        "now": time.time(),
        "control_planes": [
            {"url": url, "current": url == current, "answers": answers.get(url, False)}
            for url in urls
        ],
        "engines": [
            {
                "shard_id": shard.shard_id,
                "replica_id": shard.replica_id,
                "model": shard.model,
                "state": str(shard.state),
                "port": shard.port,
                "pid": shard.pid,
                "alive": pid_alive(shard.pid),
                "gpus": list(shard.gpu_indices),
            }
            for shard in status.running()
        ],
        "gpus": [
            {
                "index": gpu.index,
                "name": gpu.name,
                "memory_total_mb": gpu.memory_total_mb,
                "memory_used_mb": gpu.memory_used_mb,
            }
            for gpu in status.gpus()
        ],
        "disk": disk,
        "warnings": warnings,
    }


async def serve_status_socket(
    status: AgentStatus, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the socket ``status.state_dir / STATUS_SOCKET`` until cancelled
    (``task_status.started`` gets its path once it listens); a stale socket
    file left by an agent that died is replaced. The file is removed when
    this returns.

    Raises:
        OSError: the socket cannot be made (the state directory is not
            writable, or its path is too long for a Unix socket).
    """
    path = status.state_dir / STATUS_SOCKET
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old_umask)
    sock.listen(16)
    listener = trio.SocketListener(sock)

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                doc = await snapshot(status)
                with trio.fail_after(SEND_TIMEOUT_S):
                    await stream.send_all(json.dumps(doc).encode() + b"\n")
            except (trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
                log.debug("status socket: %s", exc)

    try:
        async with listener:
            task_status.started(path)
            await trio.serve_listeners(answer, [listener])
    finally:
        path.unlink(missing_ok=True)

"""The agent's read-only status socket, served by trio, read as a client does."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import trio

from llmgw.agent import protocol
from llmgw.agent.status_socket import AgentStatus, pid_alive, serve_status_socket


def _status(state_dir: Path, hub: str) -> AgentStatus:
    shard = protocol.RunningShard(
        shard_id="m-0",
        replica_id="m-0",
        model="m",
        state=protocol.ShardState.READY,
        port=1234,
        pid=os.getpid(),
    )
    return AgentStatus(
        node_id="n1",
        version="0.1.0",
        state_dir=state_dir,
        control_planes=lambda: [hub],
        current=lambda: hub,
        linked=lambda: True,
        since=lambda: 1.0,
        running=lambda: [shard],
        gpus=lambda: (),
        log_lines=lambda: ["x INFO fine", "y WARNING llmgw.agent: careful"],
    )


def _read(path: Path) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    doc: dict[str, object] = json.loads(data)
    return doc


async def test_the_socket_answers_the_agents_state(tmp_path: Path) -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    hub = f"ws://127.0.0.1:{listener.getsockname()[1]}/agent"
    (tmp_path / "agent.sock").write_text("stale")
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_status_socket, _status(tmp_path, hub))
        assert path == tmp_path / "agent.sock"
        assert path.stat().st_mode & 0o777 == 0o600
        doc = await trio.to_thread.run_sync(_read, path)
        nursery.cancel_scope.cancel()
    listener.close()
    assert doc["state"] == "linked"
    assert doc["control_planes"] == [{"url": hub, "current": True, "answers": True}]
    engines = doc["engines"]
    assert isinstance(engines, list)
    assert engines[0]["alive"] is True
    assert engines[0]["state"] == "READY"
    assert doc["warnings"] == ["y WARNING llmgw.agent: careful"]
    assert not (tmp_path / "agent.sock").exists()


async def test_a_control_plane_that_does_not_answer_is_said_so(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hub = f"ws://127.0.0.1:{port}/agent"
    async with trio.open_nursery() as nursery:
        path = await nursery.start(serve_status_socket, _status(tmp_path, hub))
        doc = await trio.to_thread.run_sync(_read, path)
        nursery.cancel_scope.cancel()
    assert doc["state"] == "connecting"
    assert doc["control_planes"] == [{"url": hub, "current": True, "answers": False}]


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(0)
    assert not pid_alive(2**22 + 1)

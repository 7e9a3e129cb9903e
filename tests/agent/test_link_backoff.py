"""The agent's link backs off when the control plane refuses it."""

from __future__ import annotations

import gc

import pytest
import trio
import trio_websocket

from llmgw.agent import protocol
from llmgw.agent.link import AgentHandlers, serve_link
from llmgw.control.cluster import Cluster
from llmgw.control.hub import serve_agent_hub

TOKEN = "t0ken"
REGISTER = protocol.Register(
    node_id="node-a",
    address="127.0.0.1",
    agent_version="test",
    hardware=protocol.Hardware(cpu_count=2, memory_total_mb=1024),
)


def _handlers() -> AgentHandlers:
    async def register() -> protocol.Register:
        return REGISTER

    async def heartbeat() -> protocol.Heartbeat:
        return protocol.Heartbeat(
            node_id="node-a", memory_total_mb=1024, memory_available_mb=512, cpu_count=2
        )

    async def start_shard(_: protocol.StartShard) -> None:
        return None

    async def stop_shard(_: str) -> None:
        return None

    _, receive = trio.open_memory_channel[protocol.ShardStatus](1)
    return AgentHandlers(
        register=register,
        heartbeat=heartbeat,
        start_shard=start_shard,
        stop_shard=stop_shard,
        logs=lambda _source, _lines: [],
        status_events=receive,
    )


async def test_an_agent_refused_for_a_node_already_connected_backs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = Cluster()
    await _refused_agent(cluster)
    refusals = [r for r in caplog.records if "that node is connected already" in r.getMessage()]
    # Back-off from 0.5 s, doubling, jittered: at most 4 tries in 3 s (without
    # it the agent tried about 8 times).
    assert 1 <= len(refusals) <= 4


async def _refused_agent(cluster: Cluster) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_agent_hub, "127.0.0.1", 0, TOKEN, cluster)
            url = f"ws://127.0.0.1:{port}/agent"
            headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
            async with trio_websocket.open_websocket_url(url, extra_headers=headers) as holder:
                await holder.send_message(protocol.encode(REGISTER))
                assert isinstance(protocol.decode(await holder.get_message()), protocol.Registered)
                # A second agent for the same node, refused on every try.
                original = cluster.nodes["node-a"]
                with trio.move_on_after(3.0):
                    async with trio.open_nursery() as agents:
                        agents.start_soon(serve_link, url, TOKEN, _handlers())
                        while True:
                            await cluster.changed.wait()
                assert cluster.nodes["node-a"] is original
                assert original.connected
            nursery.cancel_scope.cancel()


async def _closed_port() -> int:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]  # bound, never listening: refused
    return port


async def test_a_control_plane_not_there_is_a_warning_naming_the_socket_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"ws://127.0.0.1:{await _closed_port()}/agent"
    with trio.fail_after(10), caplog.at_level("INFO", logger="llmgw.agent.link"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_link, url, TOKEN, _handlers())
            while not caplog.records:  # noqa: ASYNC110 (records wake no one)
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    first = caplog.records[0]
    assert first.levelname == "WARNING"
    assert first.getMessage().startswith(
        f"cannot reach the control plane at {url} (cannot connect: "
    )
    assert "HandshakeError" not in first.getMessage()


async def test_after_the_control_plane_said_it_stops_not_reaching_it_is_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A control plane that closes with "going away" and is gone: the agent
    says so and retries quietly (info), no "lost" and no warning."""
    cluster = Cluster()
    with trio.fail_after(20), caplog.at_level("INFO", logger="llmgw.agent.link"):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as hub:
                port = await hub.start(serve_agent_hub, "127.0.0.1", 0, TOKEN, cluster)
                outer.start_soon(serve_link, f"ws://127.0.0.1:{port}/agent", TOKEN, _handlers())
                while "node-a" not in cluster.nodes:  # noqa: ASYNC110
                    await trio.sleep(0.01)
                hub.cancel_scope.cancel()  # the hub closes its links with GOING_AWAY
            while not any("cannot reach" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await trio.sleep(0.01)
            outer.cancel_scope.cancel()
        gc.collect()
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert any("is stopping; will reconnect" in m for _, m in messages), messages
    assert [m for level, m in messages if level != "INFO"] == [], messages
    assert not [m for _, m in messages if "lost" in m], messages

"""The agents' hub over a real websocket: registration, bad frames, tokens."""

from __future__ import annotations

import gc

import msgpack
import pytest
import trio
import trio_websocket

from llmgw.agent import protocol, session
from llmgw.control.cluster import Cluster
from llmgw.control.hub import serve_agent_hub

TOKEN = "t0ken"

REGISTER = protocol.Register(
    node_id="node-a",
    address="127.0.0.1",
    agent_version="test",
    hardware=protocol.Hardware(cpu_count=2, memory_total_mb=1024),
)


async def _hub(nursery: trio.Nursery, cluster: Cluster) -> str:
    port = await nursery.start(serve_agent_hub, "127.0.0.1", 0, TOKEN, cluster)
    return f"ws://127.0.0.1:{port}/agent"


def _auth(token: str = TOKEN) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {token}".encode())]


async def test_an_agent_that_registers_is_in_the_cluster_until_it_disconnects() -> None:
    cluster = Cluster()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _hub(nursery, cluster)
            async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as ws:
                await ws.send_message(protocol.encode(REGISTER))
                reply = protocol.decode(await ws.get_message())
                assert reply == protocol.Registered(node_id="node-a")
                assert cluster.nodes["node-a"].connected
            while cluster.nodes["node-a"].connected:
                await cluster.changed.wait()
            nursery.cancel_scope.cancel()


# trio-websocket leaves the client socket of a link the server closed to the
# garbage collector (as in the oversized-frame test below).
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_second_agent_for_a_connected_node_is_refused_and_the_first_stays() -> None:
    cluster = Cluster()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _hub(nursery, cluster)
            async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as first:
                await first.send_message(protocol.encode(REGISTER))
                assert isinstance(protocol.decode(await first.get_message()), protocol.Registered)
                async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as second:
                    await second.send_message(protocol.encode(REGISTER))
                    reply = protocol.decode(await second.get_message())
                    assert isinstance(reply, protocol.Error)
                    assert "connected through another agent" in reply.message
                    with pytest.raises(trio_websocket.ConnectionClosed):
                        await second.get_message()
                # The refused link's end leaves the node to the first agent.
                await trio.sleep(0.2)
                assert cluster.nodes["node-a"].connected
                assert cluster.nodes["node-a"].send is not None
            nursery.cancel_scope.cancel()


async def test_unknown_and_malformed_frames_are_answered_with_an_error_and_the_link_stays() -> None:
    cluster = Cluster()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _hub(nursery, cluster)
            async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as ws:
                await ws.send_message(protocol.encode(REGISTER))
                assert isinstance(protocol.decode(await ws.get_message()), protocol.Registered)
                for frame in (
                    msgpack.packb({"type": "FromTheFuture", "v": protocol.PROTOCOL_VERSION}),
                    b"\xc1\xc1",
                    msgpack.packb({"type": "ShardStatus", "shard_id": 3}),
                ):
                    await ws.send_message(frame)
                    error = protocol.decode(await ws.get_message())
                    assert isinstance(error, protocol.Error)
                    assert error.message
                beat = protocol.Heartbeat(
                    node_id="node-a", memory_total_mb=1024, memory_available_mb=512, cpu_count=2
                )
                await ws.send_message(protocol.encode(beat))
                await ws.ping()
                assert cluster.nodes["node-a"].memory_available_mb == 512
            nursery.cancel_scope.cancel()


def _other_version(message: protocol.Message, version: int = 2) -> bytes:
    doc = msgpack.unpackb(protocol.encode(message))
    doc["v"] = version
    frame: bytes = msgpack.packb(doc)
    return frame


async def _closing_code(ws: trio_websocket.WebSocketConnection) -> int | None:
    with pytest.raises(trio_websocket.ConnectionClosed) as closed:
        await ws.get_message()
    return closed.value.reason.code if closed.value.reason is not None else None


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_register_of_another_version_is_answered_and_the_link_closed() -> None:
    cluster = Cluster()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _hub(nursery, cluster)
            async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as ws:
                await ws.send_message(_other_version(REGISTER))
                error = protocol.decode(await ws.get_message())
                assert error == protocol.Error(
                    message="agent speaks protocol 2, this control plane speaks 1"
                )
                assert await _closing_code(ws) == session.PROTOCOL_ERROR
            assert "node-a" not in cluster.nodes
            nursery.cancel_scope.cancel()
    gc.collect()


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_registered_agent_sending_another_version_is_disconnected() -> None:
    cluster = Cluster()
    beat = protocol.Heartbeat(
        node_id="node-a", memory_total_mb=1024, memory_available_mb=512, cpu_count=2
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _hub(nursery, cluster)
            async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as ws:
                await ws.send_message(protocol.encode(REGISTER))
                assert isinstance(protocol.decode(await ws.get_message()), protocol.Registered)
                await ws.send_message(_other_version(beat, 3))
                error = protocol.decode(await ws.get_message())
                assert error == protocol.Error(
                    message="agent speaks protocol 3, this control plane speaks 1"
                )
                assert await _closing_code(ws) == session.PROTOCOL_ERROR
            while cluster.nodes["node-a"].connected:
                await cluster.changed.wait()
            assert cluster.nodes["node-a"].memory_available_mb != 512
            nursery.cancel_scope.cancel()
    gc.collect()


async def test_frames_before_register_are_answered_and_the_link_waits_for_it() -> None:
    cluster = Cluster()
    beat = protocol.Heartbeat(
        node_id="node-a", memory_total_mb=1024, memory_available_mb=512, cpu_count=2
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _hub(nursery, cluster)
            async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as ws:
                await ws.send_message(protocol.encode(beat))
                error = protocol.decode(await ws.get_message())
                assert error == protocol.Error(message="the first message must be Register")
                await ws.send_message(protocol.encode(REGISTER))
                assert isinstance(protocol.decode(await ws.get_message()), protocol.Registered)
            nursery.cancel_scope.cancel()


# trio-websocket 0.12 leaves the client socket of a link closed with 1009 to
# the garbage collector: that ResourceWarning is the library's, not this test's.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_oversized_frame_closes_only_that_link() -> None:
    cluster = Cluster()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _hub(nursery, cluster)
            async with trio_websocket.open_websocket_url(
                url, extra_headers=_auth(), max_message_size=2 * protocol.MAX_FRAME_BYTES
            ) as ws:
                await ws.send_message(protocol.encode(REGISTER))
                await ws.get_message()
                await ws.send_message(b"\x00" * (protocol.MAX_FRAME_BYTES + 1))
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await ws.get_message()
                reason = closed.value.reason
                code = reason.code if reason is not None else None
                del closed  # its traceback holds the connection
            assert code == 1009  # message too big
            async with trio_websocket.open_websocket_url(url, extra_headers=_auth()) as ws:
                await ws.send_message(protocol.encode(REGISTER))
                assert isinstance(protocol.decode(await ws.get_message()), protocol.Registered)
            nursery.cancel_scope.cancel()
    gc.collect()


async def _handshake_status(port: int, token: str) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            b"GET /agent HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            + (f"Authorization: Bearer {token}\r\n".encode() if token else b"")
            + b"\r\n"
        )
        head = b""
        while b"\r\n" not in head:
            head += await stream.receive_some(1024)
        return head.split(b"\r\n", 1)[0]


async def test_a_link_without_the_agent_token_is_refused() -> None:
    cluster = Cluster()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_agent_hub, "127.0.0.1", 0, TOKEN, cluster)
            for token in ("wrong", ""):
                assert b" 401 " in await _handshake_status(port, token)
            assert not cluster.nodes
            nursery.cancel_scope.cancel()

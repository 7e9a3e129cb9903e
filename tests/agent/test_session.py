"""The link's session rules, from the agent's end: the Error frame, link
failures as llmgw.errors, the version check, the keepalive."""

from __future__ import annotations

import base64
import gc
import hashlib
import logging
import warnings
from collections.abc import Awaitable, Callable
from functools import partial

import msgpack
import pytest
import trio
import trio_websocket

from llmgw import errors
from llmgw.agent import protocol, session
from llmgw.agent.link import AgentHandlers, serve_link

TOKEN = "t0ken"
REGISTER = protocol.Register(
    node_id="node-a",
    address="127.0.0.1",
    agent_version="test",
    hardware=protocol.Hardware(cpu_count=2, memory_total_mb=1024),
)


async def _register() -> protocol.Register:
    return REGISTER


def _other_version(message: protocol.Message, version: int = 2) -> bytes:
    doc = msgpack.unpackb(protocol.encode(message))
    doc["v"] = version
    frame: bytes = msgpack.packb(doc)
    return frame


def test_an_error_becomes_one_error_frame() -> None:
    frame = protocol.encode(session.error_frame(errors.NotFound("no shard 'x' on n1"), "c1"))
    assert msgpack.unpackb(frame) == {
        "type": "Error",
        "v": protocol.PROTOCOL_VERSION,
        "message": "no shard 'x' on n1",
        "correlation_id": "c1",
    }
    mismatch = protocol.VersionMismatch(2, peer="agent", me="this control plane")
    assert session.error_frame(mismatch) == protocol.Error(
        message="agent speaks protocol 2, this control plane speaks 1"
    )


async def _serve(
    nursery: trio.Nursery, handler: Callable[[trio_websocket.WebSocketRequest], Awaitable[None]]
) -> str:
    server = await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None)
    return f"ws://127.0.0.1:{server.port}/agent"


async def test_a_control_plane_that_cannot_be_reached_is_a_link_closed() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
    with trio.fail_after(10), pytest.raises(errors.LinkClosed) as closed:
        async with session.connect(f"ws://127.0.0.1:{port}/agent", TOKEN, _register):
            pass
    # trio-websocket's HandshakeError has no text: the socket's error says why.
    assert str(closed.value).startswith("cannot connect: ")
    assert "HandshakeError" not in str(closed.value)
    assert len(str(closed.value)) > len("cannot connect: ") + 5


async def test_a_refused_handshake_is_a_link_closed_naming_the_status() -> None:
    async def refuse(request: trio_websocket.WebSocketRequest) -> None:
        await request.reject(401)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, refuse)
            with pytest.raises(errors.LinkClosed, match="rejected with HTTP 401"):
                async with session.connect(url, TOKEN, _register):
                    pass
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("code", "kind"), [(1000, errors.LinkClosed), (1001, session.PeerStopping)]
)
async def test_a_link_the_peer_closes_is_a_link_closed(
    code: int, kind: type[errors.LinkClosed]
) -> None:
    async def close_after_register(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()
        await ws.aclose(code, "bye")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, close_after_register)
            async with session.connect(url, TOKEN, _register) as link:
                with pytest.raises(errors.LinkClosed) as closed:
                    await link.receive()
                assert type(closed.value) is kind
                with pytest.raises(errors.LinkClosed):
                    await link.send(REGISTER)
                del closed
            nursery.cancel_scope.cancel()
    gc.collect()


def _handlers(start_shard: Callable[[protocol.StartShard], Awaitable[None]]) -> AgentHandlers:
    async def heartbeat() -> protocol.Heartbeat:
        return protocol.Heartbeat(
            node_id="node-a", memory_total_mb=1024, memory_available_mb=512, cpu_count=2
        )

    async def stop_shard(_: str) -> None:
        return None

    _, receive = trio.open_memory_channel[protocol.ShardStatus](1)
    return AgentHandlers(
        register=_register,
        heartbeat=heartbeat,
        start_shard=start_shard,
        stop_shard=stop_shard,
        logs=lambda _source, _lines: [],
        status_events=receive,
    )


async def _no_start(_: protocol.StartShard) -> None:
    return None


async def test_a_frame_of_another_version_is_answered_and_the_agent_closes_the_link() -> None:
    seen: list[protocol.Message] = []
    codes: list[int | None] = []
    done = trio.Event()

    async def hub_of_version_2(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        seen.append(protocol.decode(await ws.get_message()))
        await ws.send_message(_other_version(protocol.Registered(node_id="node-a")))
        seen.append(protocol.decode(await ws.get_message()))
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await ws.get_message()
        codes.append(closed.value.reason.code if closed.value.reason else None)
        done.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, hub_of_version_2)
            nursery.start_soon(serve_link, url, TOKEN, _handlers(_no_start))
            await done.wait()
            nursery.cancel_scope.cancel()
    assert seen[0] == REGISTER
    assert seen[1] == protocol.Error(message="control plane speaks protocol 2, this agent speaks 1")
    assert codes == [session.PROTOCOL_ERROR]
    gc.collect()


async def test_a_command_failing_with_an_llmgw_error_is_answered_with_an_error_frame() -> None:
    async def refuse_start(_: protocol.StartShard) -> None:
        raise errors.AgentError("no room for that shard")

    replies: list[protocol.Message] = []
    done = trio.Event()

    async def hub(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()  # Register
        start = protocol.StartShard(
            correlation_id="c7",
            shard_id="s",
            replica_id="r",
            profile=protocol.EngineProfile(name="m", engine="sim", served_model_name="m"),
            port=1,
        )
        await ws.send_message(protocol.encode(start))
        while not replies:
            message = protocol.decode(await ws.get_message())
            if isinstance(message, protocol.Error):
                replies.append(message)
        done.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, hub)
            nursery.start_soon(serve_link, url, TOKEN, _handlers(refuse_start))
            await done.wait()
            nursery.cancel_scope.cancel()
    assert replies == [protocol.Error(message="no room for that shard", correlation_id="c7")]
    gc.collect()


async def _silent_websocket_server(
    *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accepts one websocket handshake, then never reads again: no pongs."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listener:
        task_status.started(listener.socket.getsockname()[1])
        stream = await listener.accept()
    async with stream:
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(4096)
        key = next(
            line.split(b":", 1)[1].strip()
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        accept = base64.b64encode(
            hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest()
        )
        await stream.send_all(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        await trio.sleep_forever()


async def test_a_peer_that_does_not_answer_pings_ends_the_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(session, "PING_AFTER_IDLE_S", 0.1)
    monkeypatch.setattr(session, "PONG_TIMEOUT_S", 0.2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_silent_websocket_server)
            url = f"ws://127.0.0.1:{port}/agent"
            with pytest.raises(errors.LinkClosed, match=r"did not answer a ping within 0\.2 s"):
                async with session.connect(url, TOKEN, _register) as link:
                    await link.keepalive()
            nursery.cancel_scope.cancel()
    gc.collect()


async def test_a_stopped_link_closes_as_a_stop_and_serve_link_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``stop`` closes the link with GOING_AWAY ("agent stopping"), which the
    control plane's end reads as a stop, and serve_link returns; nothing is
    logged as lost."""
    codes: list[tuple[int, str | None]] = []
    registered, hub_done = trio.Event(), trio.Event()

    async def read_until_closed(ws: trio_websocket.WebSocketConnection) -> None:
        while True:
            await ws.get_message()

    async def hub(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()  # Register
        registered.set()
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            await read_until_closed(ws)
        reason = closed.value.reason
        assert reason is not None
        codes.append((reason.code, reason.reason))
        hub_done.set()

    stop = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, hub)
            async with trio.open_nursery() as link:
                link.start_soon(partial(serve_link, url, TOKEN, _handlers(_no_start), stop=stop))
                await registered.wait()
                stop.set()
            # serve_link returned by itself: the inner nursery closed.
            await hub_done.wait()
            nursery.cancel_scope.cancel()
    assert codes == [(session.GOING_AWAY, "agent stopping")]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    gc.collect()


async def test_the_hub_logs_an_agent_that_stops_as_a_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ended = trio.Event()

    async def on_link(link: session.Link) -> None:
        try:
            await session.await_register(link)
            await link.receive()
        finally:
            ended.set()

    with trio.fail_after(10), caplog.at_level(logging.INFO, logger="llmgw.agent.session"):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(session.serve_links, "127.0.0.1", 0, TOKEN, on_link)
            async with session.connect(f"ws://127.0.0.1:{port}/agent", TOKEN, _register) as link:
                await link.close(session.GOING_AWAY, "agent stopping")
            # The hub logs as soon as on_link ends, before it checkpoints again.
            await ended.wait()
            nursery.cancel_scope.cancel()
    [record] = [r for r in caplog.records if "closed" in r.getMessage()]
    assert record.levelno == logging.INFO
    assert record.getMessage().endswith("closed: the agent is stopping")
    gc.collect()


async def test_a_link_the_control_plane_closes_leaves_no_socket_open() -> None:
    """The agent closes its own socket when the control plane closed the
    link first (trio-websocket 0.12 does not: the socket was left to the
    garbage collector, a ResourceWarning in whatever test ran then)."""

    async def close_after_register(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()
        await ws.aclose(session.GOING_AWAY, "bye")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, close_after_register)
            async with session.connect(url, TOKEN, _register) as link:
                stream = link._ws._stream
                stream = getattr(stream, "inner", stream)  # under session's watch
                assert isinstance(stream, trio.SocketStream)
                sock = stream.socket
                assert sock.fileno() != -1
                with pytest.raises(session.PeerStopping):
                    await link.receive()
            nursery.cancel_scope.cancel()
    assert sock.fileno() == -1, "the agent's socket is still open"


async def test_a_refused_handshake_leaves_no_socket_open() -> None:
    """A link the control plane refuses (HTTP 401) closes its socket
    (trio-websocket's open_websocket_url left it to the garbage collector)."""

    async def refuse(request: trio_websocket.WebSocketRequest) -> None:
        await request.reject(401)

    gc.collect()  # what earlier tests left, not this one's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                url = await _serve(nursery, refuse)
                for _ in range(3):
                    with pytest.raises(errors.LinkClosed, match="rejected with HTTP 401"):
                        async with session.connect(url, TOKEN, _register):
                            pass
                nursery.cancel_scope.cancel()
        gc.collect()
    port = url.rsplit(":", 1)[1].split("/")[0]
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not [text for text in leaked if f"raddr=('127.0.0.1', {port})" in text], leaked

"""HTTP/1.1 edge cases on the client port (``llmgw.gateway.server``), fed raw
bytes over a real socket: request smuggling, framing, limits and slow
clients, answered as RFC 9112 says (or closed). The smuggling cases run
through the whole gateway in front of a recording sim engine, to show that a
request hidden in a body never reaches an engine nor skips the key check.
The limits are those stated in ``docs/api.md`` (HTTP limits)."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import trio

from llmgw.accounting.accountant import Accountant
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter
from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster
from llmgw.engines.sim.app import SimEngine
from llmgw.engines.sim.config import SimConfig
from llmgw.gateway import server
from llmgw.gateway.app import Gateway
from llmgw.gateway.parse import MAX_BODY_BYTES
from llmgw.gateway.server import serve_http1
from llmgw.router.endpoint import Endpoint
from llmgw.store import ModelRecord, open_sqlite_store
from llmgw.store.records import Limits

ENGINE_KEY = "engine-secret"
CHAT = b'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


@attrs.define
class Edge:
    port: int
    secret: str
    engine_seen: list[tuple[str, str]]

    async def exchange(self, data: bytes, *, wait_s: float = 10.0) -> bytes:
        """Send ``data``; every byte answered until the server closes."""
        return await exchange(self.port, data, wait_s=wait_s)

    def chat(self, *, key: str | None = None, extra: str = "") -> bytes:
        """A whole chat request head and body, with ``key`` (default: the rig's)."""
        auth = f"authorization: Bearer {self.secret if key is None else key}\r\n"
        return (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n{auth}"
            f"content-type: application/json\r\ncontent-length: {len(CHAT)}\r\n{extra}\r\n"
        ).encode() + CHAT


async def exchange(port: int, data: bytes, *, wait_s: float = 10.0) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        with trio.fail_after(wait_s):
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:  # reset: what came before counts
                    break
                if not chunk:
                    break
                got += chunk
    return got


def statuses(data: bytes) -> list[int]:
    """The status of every final answer in ``data``, in order."""
    codes = (int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data))
    return [code for code in codes if code >= 200]


@pytest.fixture
async def edge(tmp_path: Path) -> AsyncIterator[Edge]:
    """The gateway on a real port in front of a sim engine that records every
    request it is sent."""
    seen: list[tuple[str, str]] = []
    sim = SimEngine(
        SimConfig(model="sim-model", tokens=3, tokens_per_second=0, tick_ms=0),
        api_key=ENGINE_KEY,
    )

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append((scope["method"], scope["path"]))
        await sim(scope, receive, send)

    async with open_sqlite_store(tmp_path / "llmgw.db") as store, trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, recording, "127.0.0.1:0", stop, 1.0)
        sim_port = int(address.rsplit(":", 1)[1])
        path, _ = await store.ensure_project("acme", "search", "web", time.time())
        await store.set_limits("project", path.project.id, Limits(rpm=10**6, tpm=10**9))
        secret, record = new_key("edges")
        await store.insert_key(attrs.evolve(record, project_id=path.project.id))
        cluster = Cluster()
        cluster.set_leader(True)
        cluster.replace_catalog(
            {"sim-model": ModelRecord.simple("sim-model", "sim", slots=0, created_at=1.0)}
        )
        cluster.set_fixed_endpoints(
            {
                "sim-model": [
                    Endpoint(
                        replica_id="sim-model-0",
                        model="sim-model",
                        host="127.0.0.1",
                        port=sim_port,
                        api_key=ENGINE_KEY,
                    )
                ]
            }
        )
        gateway = Gateway(
            authenticator=KeyAuthenticator(store),
            cluster=cluster,
            usage=UsageWriter(),
            accountant=Accountant(PriceBook({})),
            resolver=ScopeResolver(store),
        )
        address = await nursery.start(serve_http1, gateway, "127.0.0.1:0", stop, 1.0)
        try:
            yield Edge(int(address.rsplit(":", 1)[1]), secret, seen)
        finally:
            await gateway.aclose()
            stop.set()


def engine_chats(edge: Edge) -> int:
    return sum(1 for _, path in edge.engine_seen if path == "/v1/chat/completions")


# -- smuggling: one parse of the framing, and a request hidden in a body stays a body


async def test_a_whole_request_is_relayed_once(edge: Edge) -> None:
    got = await edge.exchange(edge.chat(extra="connection: close\r\n"))
    assert statuses(got) == [200], got
    assert engine_chats(edge) == 1


async def test_content_length_with_transfer_encoding_is_refused_and_closed(edge: Edge) -> None:
    # A front proxy reading Content-Length would see the hidden request as
    # body; read as chunked it would be a second request. Either way it must
    # never be answered nor reach the engine (RFC 9112 section 6.1: close).
    hidden = edge.chat()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\n"
        f"content-length: {5 + len(hidden)}\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    got = await edge.exchange(head.encode() + b"0\r\n\r\n" + hidden)
    assert statuses(got) == [400], got
    assert b"connection: close" in got.lower()
    assert engine_chats(edge) == 0


async def test_two_different_content_lengths_are_refused(edge: Edge) -> None:
    hidden = edge.chat()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\n"
        f"content-length: {len(CHAT)}\r\ncontent-length: {len(CHAT) + len(hidden)}\r\n\r\n"
    )
    got = await edge.exchange(head.encode() + CHAT + hidden)
    assert statuses(got) == [400], got
    assert engine_chats(edge) == 0


async def test_equal_content_lengths_are_one(edge: Edge) -> None:
    # RFC 9110 section 8.6: a list of one repeated value may be taken as that value.
    got = await edge.exchange(
        edge.chat(extra=f"content-length: {len(CHAT)}\r\nconnection: close\r\n")
    )
    assert statuses(got) == [200], got
    assert engine_chats(edge) == 1


async def test_a_request_hidden_in_a_body_is_only_a_body(edge: Edge) -> None:
    # Without a key: the whole thing is refused at the key check, body unread.
    hidden = edge.chat()
    no_key = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"content-length: {len(hidden)}\r\nconnection: close\r\n\r\n"
    ).encode() + hidden
    assert statuses(await edge.exchange(no_key)) == [401]
    # With a key: the body is a body (not JSON), one 400, and nothing reaches the engine.
    keyed = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\n"
        f"content-length: {len(hidden)}\r\nconnection: close\r\n\r\n"
    ).encode() + hidden
    assert statuses(await edge.exchange(keyed)) == [400]
    # Chunked, the hidden request split over chunks and ending the body.
    chunked = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\n"
        "transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    ).encode()
    for piece in (hidden[:10], hidden[10:]):
        chunked += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    assert statuses(await edge.exchange(chunked + b"0\r\n\r\n")) == [400]
    assert engine_chats(edge) == 0


async def test_a_request_after_a_refused_one_is_never_read(edge: Edge) -> None:
    # A malformed request closes the connection: what follows is not read.
    bad = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: +4\r\n\r\n"
    got = await edge.exchange(bad + edge.chat())
    assert statuses(got) == [400], got
    assert engine_chats(edge) == 0


@pytest.mark.parametrize(
    "encoding",
    ["gzip, chunked", "chunked, identity", "identity", "chunked\r\ntransfer-encoding: chunked"],
)
async def test_transfer_codings_other_than_chunked_alone_are_refused(
    edge: Edge, encoding: str
) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\ntransfer-encoding: {encoding}\r\n\r\n"
    )
    got = await edge.exchange(head.encode() + b"0\r\n\r\n" + edge.chat())
    assert statuses(got) in ([400], [501]), got
    assert engine_chats(edge) == 0


@pytest.mark.parametrize(
    "line",
    [
        "transfer-encoding : chunked",  # whitespace before the colon (RFC 9112 section 5.1)
        "transfer-encoding:\x0bchunked",
        " transfer-encoding: chunked",  # obs-fold at the start of the fields
    ],
)
async def test_malformed_framing_headers_are_refused(edge: Edge, line: str) -> None:
    head = f"POST /v1/chat/completions HTTP/1.1\r\n{line}\r\nhost: x\r\n\r\n"
    got = await edge.exchange(head.encode() + b"0\r\n\r\n" + edge.chat())
    assert statuses(got) == [400], got
    assert engine_chats(edge) == 0


async def test_pipelined_requests_are_answered_in_order_each_checked(edge: Edge) -> None:
    data = (
        b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
        + edge.chat()
        + edge.chat(key="sk-llmgw-not-a-key")
        + b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    got = await edge.exchange(data)
    assert statuses(got) == [200, 200, 401, 200], got
    assert engine_chats(edge) == 1


# -- chunk sizes, folding, line ends


async def test_a_chunk_size_too_long_to_read_is_refused(edge: Edge) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    got = await edge.exchange(head.encode() + b"1" + b"0" * 20 + b"\r\nab")
    assert statuses(got) == [400], got


async def test_a_chunk_larger_than_the_body_limit_is_413(edge: Edge) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    size = MAX_BODY_BYTES + 1
    got = await edge.exchange(head.encode() + f"{size:x}\r\n".encode() + b"a" * size + b"\r\n")
    assert statuses(got) == [413], got
    assert engine_chats(edge) == 0


async def test_obsolete_line_folding_is_replaced_by_a_space() -> None:
    # RFC 9112 section 5.2: a server may replace each obs-fold with SP.
    seen: list[bytes | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(dict(scope["headers"]).get(b"x-folded"))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with serving(app) as port:
        got = await exchange(
            port, b"GET / HTTP/1.1\r\nhost: x\r\nx-folded: a\r\n b\r\nconnection: close\r\n\r\n"
        )
    assert statuses(got) == [204], got
    assert seen == [b"a b"]


async def test_a_bare_lf_ends_a_line_and_a_bare_cr_is_refused(edge: Edge) -> None:
    # RFC 9112 section 2.2: LF alone may be taken as a line end; a bare CR may not.
    got = await edge.exchange(b"GET /health HTTP/1.1\nhost: x\nconnection: close\n\n")
    assert statuses(got) == [200], got
    got = await edge.exchange(b"GET /health HTTP/1.1\rhost: x\r\nconnection: close\r\n\r\n")
    assert statuses(got) == [400], got


async def test_an_http_version_other_than_1_is_505(edge: Edge) -> None:
    got = await edge.exchange(b"GET /health HTTP/2.0\r\nhost: x\r\n\r\n")
    assert statuses(got) == [505], got


async def test_http_1_0_is_answered_and_closed(edge: Edge) -> None:
    got = await edge.exchange(b"GET /health HTTP/1.0\r\n\r\n")
    assert statuses(got) == [200], got


async def test_connect_and_upgrade_open_no_tunnel(edge: Edge) -> None:
    got = await edge.exchange(b"CONNECT example.com:443 HTTP/1.1\r\nhost: x\r\n\r\n" + edge.chat())
    assert statuses(got) == [501], got
    upgrade = (
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
    )
    got = await edge.exchange(upgrade + edge.chat(extra="connection: close\r\n"))
    assert statuses(got) == [200, 200], got
    assert engine_chats(edge) == 1


# -- limits


async def test_a_head_over_the_limit_is_431_and_closed(edge: Edge) -> None:
    big = "x-big: " + "a" * server.MAX_HEAD_BYTES + "\r\n"
    got = await edge.exchange(f"GET /health HTTP/1.1\r\nhost: x\r\n{big}\r\n".encode())
    assert statuses(got) == [431], got


async def test_too_many_headers_is_431(edge: Edge) -> None:
    many = "".join(f"x-h{i}: v\r\n" for i in range(server.MAX_HEADERS + 1))
    got = await edge.exchange(f"GET /health HTTP/1.1\r\nhost: x\r\n{many}\r\n".encode())
    assert statuses(got) == [431], got
    fine = "".join(f"x-h{i}: v\r\n" for i in range(server.MAX_HEADERS - 2))
    got = await edge.exchange(
        f"GET /health HTTP/1.1\r\nhost: x\r\n{fine}connection: close\r\n\r\n".encode()
    )
    assert statuses(got) == [200], got


async def test_a_declared_body_over_32_mb_is_413_before_it_is_sent(edge: Edge) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\ncontent-length: {MAX_BODY_BYTES + 1}\r\n\r\n"
    )
    started = trio.current_time()
    got = await edge.exchange(head.encode(), wait_s=5)
    assert statuses(got) == [413], got
    assert trio.current_time() - started < 4  # answered and closed, body unread
    assert engine_chats(edge) == 0


async def test_a_body_over_32_mb_as_it_comes_is_413(edge: Edge) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    piece = b"a" * 1024 * 1024
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    got = await edge.exchange(head.encode() + chunk * 33 + b"0\r\n\r\n")
    assert statuses(got) == [413], got
    assert engine_chats(edge) == 0


async def test_expect_100_continue_is_answered_before_the_body(edge: Edge) -> None:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        f"authorization: Bearer {edge.secret}\r\nexpect: 100-continue\r\n"
        f"content-length: {len(CHAT)}\r\nconnection: close\r\n\r\n"
    )
    stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
    async with stream:
        await stream.send_all(head.encode())
        with trio.fail_after(5):
            first = await stream.receive_some(65536)
        assert first.startswith(b"HTTP/1.1 100 "), first
        await stream.send_all(CHAT)
        got = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                got += chunk
    assert statuses(got) == [200], got


# -- slow clients


@pytest.mark.parametrize("kept_alive", [False, True])
async def test_a_head_sent_one_byte_at_a_time_is_cut_at_the_head_timeout(
    edge: Edge, monkeypatch: pytest.MonkeyPatch, kept_alive: bool
) -> None:
    # The head timeout bounds the whole head, not the gap between bytes; on
    # a kept-alive connection it counts from the next request's first byte.
    monkeypatch.setattr(server, "FIRST_REQUEST_TIMEOUT_S", 0.5)
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 100 + b"\r\n\r\n"
    stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
    closed_after = None
    async with stream:
        if kept_alive:
            await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(5):
                assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
            await trio.sleep(0.6)  # idle longer than the head timeout: still open
        started = trio.current_time()
        with trio.fail_after(5):
            for byte in head:
                try:
                    await stream.send_all(bytes([byte]))
                except trio.BrokenResourceError:
                    break
                with trio.move_on_after(0.05):
                    if await stream.receive_some(65536) == b"":
                        closed_after = trio.current_time() - started
                        break
    assert closed_after is not None, "the slow head was never cut"
    assert 0.4 < closed_after < 2.0


async def test_an_idle_kept_alive_connection_is_closed_at_the_keep_alive_timeout(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The idle wait and the next head share one cancel scope: idle, the
    # keep-alive timeout applies (not the head's, set far off here).
    monkeypatch.setattr(server, "KEEP_ALIVE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(server, "FIRST_REQUEST_TIMEOUT_S", 600.0)
    stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
    async with stream:
        await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(30):
            assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        answered = trio.current_time()
        with trio.fail_after(30):
            assert await stream.receive_some(65536) == b""
        assert trio.current_time() - answered >= 0.45


async def test_a_client_that_never_reads_is_cut_and_the_app_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server, "SEND_TIMEOUT_S", 0.5)
    told = trio.Event()

    async def endless(scope: Any, receive: Any, send: Any) -> None:
        async def watch() -> None:
            message = await receive()
            while message["type"] != "http.disconnect":
                message = await receive()
            told.set()
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})

    async with serving(endless) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(20):
                await told.wait()


async def test_a_body_trickled_below_the_least_rate_is_408_and_closed(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A body of 200 bytes at about 20 bytes/s against a least rate of 100
    # bytes/s after a 0.3 s grace: refused long before the body is whole.
    monkeypatch.setattr(server, "BODY_GRACE_S", 0.3)
    monkeypatch.setattr(server, "MIN_BODY_RATE_BYTES_PER_S", 100)
    body = b'{"model":"sim-model","messages":[],"x":"' + b"a" * 150 + b'"}'
    head = (
        edge.chat()
        .split(b"\r\n\r\n", 1)[0]
        .replace(f"content-length: {len(CHAT)}".encode(), f"content-length: {len(body)}".encode())
    )
    stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
    got = b""
    sent = 0
    async with stream:
        await stream.send_all(head + b"\r\n\r\n")
        with trio.fail_after(20):
            for byte in body:
                try:
                    await stream.send_all(bytes([byte]))
                except trio.BrokenResourceError:
                    break
                sent += 1
                with trio.move_on_after(0.05):
                    chunk = await stream.receive_some(65536)
                    got += chunk
                    if not chunk:
                        break
            while chunk := await _receive_or_reset(stream):
                got += chunk
    assert statuses(got) == [408], got
    assert b"too slowly" in got
    assert sent < len(body), "the whole trickled body was taken"
    assert edge.engine_seen == []


async def test_a_slow_body_within_the_least_rate_is_served(
    edge: Edge, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "BODY_GRACE_S", 5.0)
    monkeypatch.setattr(server, "MIN_BODY_RATE_BYTES_PER_S", 100)
    request = edge.chat()
    half = len(request) - len(CHAT) // 2
    stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
    got = b""
    async with stream:
        await stream.send_all(request[:half])
        await trio.sleep(0.2)
        await stream.send_all(request[half:])
        with trio.fail_after(20):
            while not got.endswith(b"0\r\n\r\n") and b"}" not in got.partition(b"\r\n\r\n")[2]:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                got += chunk
    assert statuses(got) == [200], got


async def _receive_or_reset(stream: trio.SocketStream) -> bytes:
    try:
        return await stream.receive_some(65536)
    except trio.BrokenResourceError:
        return b""


# -- the server alone


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    """``serve_http1(app)`` on a free port; yields the port."""
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, app, "127.0.0.1:0", stop, 1.0)
        try:
            yield int(address.rsplit(":", 1)[1])
        finally:
            stop.set()


def test_the_servers_own_refusals_are_openai_shaped_json() -> None:
    doc = orjson.loads(server._error_body('a "quoted" \\ message'))
    assert doc == {
        "error": {
            "message": 'a "quoted" \\ message',
            "type": "invalid_request_error",
            "code": None,
            "param": None,
        }
    }

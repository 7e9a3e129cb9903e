"""The client port's two ways of reading a request (``llmgw/gateway/server.py``):
plain heads read and answered by the server itself, any other handed to h11
for that request; both on one connection, in order, framed alike."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from llmgw.gateway import server
from llmgw.gateway.server import serve_http1


async def app(scope: Any, receive: Any, send: Any) -> None:
    """``/s``: the body streamed back in two pieces (no length, so chunked);
    ``/n``: 204; else the body back whole with its length; the request's
    method and path in ``x-seen``."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    seen = (b"x-seen", f"{scope['method']} {scope['path']}".encode())
    if scope["path"] == "/n":
        await send({"type": "http.response.start", "status": 204, "headers": [seen]})
        await send({"type": "http.response.body", "body": b""})
    elif scope["path"] == "/s":
        await send({"type": "http.response.start", "status": 200, "headers": [seen]})
        await send({"type": "http.response.body", "body": body[:1], "more_body": True})
        await send({"type": "http.response.body", "body": body[1:], "more_body": False})
    else:
        headers = [seen, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def serving() -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, app, "127.0.0.1:0", stop, 1.0)
        try:
            yield int(address.rsplit(":", 1)[1])
        finally:
            stop.set()


async def exchange(port: int, data: bytes, *, eof: bool = False) -> bytes:
    """Send ``data`` (then close the sending side when ``eof``), then read
    until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        if eof:
            await stream.send_eof()
        got = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                got += chunk
    return got


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


async def test_plain_and_h11_requests_share_a_connection_in_order() -> None:
    chunked = (
        b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    )
    bare_lf = b"POST /lf HTTP/1.1\nhost: x\ncontent-length: 2\n\nlf"
    data = (
        post("/a", b"one")
        + chunked
        + post("/b", b"two", "connection: keep-alive\r\n")
        + bare_lf
        + post("/d", b"four", "connection: close\r\n")
    )
    async with serving() as port:
        got = await exchange(port, data)
    assert re.findall(rb"x-seen: ([^\r]*)\r\n", got) == [
        b"POST /a",
        b"POST /c",
        b"POST /b",
        b"POST /lf",
        b"POST /d",
    ], got
    for body in (b"one", b"abc", b"two", b"lf", b"four"):
        assert b"\r\n\r\n" + body in got, (body, got)
    assert got.count(b"HTTP/1.1 200 ") == 5


async def test_a_plain_requests_answer_is_framed_as_h11_frames_it() -> None:
    async with serving() as port:
        got = await exchange(
            port, post("/s", b"xyz") + post("/n", b"") + post("/a", b"ok", "connection: close\r\n")
        )
    streamed, rest = got.split(b"0\r\n\r\n", 1)
    assert streamed == (
        b"HTTP/1.1 200 \r\nx-seen: POST /s\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"1\r\nx\r\n2\r\nyz\r\n"
    )
    assert rest == (
        b"HTTP/1.1 204 \r\nx-seen: POST /n\r\n\r\n"
        b"HTTP/1.1 200 \r\nx-seen: POST /a\r\ncontent-length: 2\r\nConnection: close\r\n\r\nok"
    )


async def test_a_plain_body_cut_by_the_clients_close_is_400() -> None:
    async with serving() as port:
        got = await exchange(port, post("/a", b"12345")[:-2], eof=True)
    assert got.startswith(b"HTTP/1.1 400 "), got
    assert b"\r\nconnection: close\r\n" in got


def test_a_plain_head_is_read_as_h11_reads_it() -> None:
    head = server._plain_head(
        b"POST /v1/x?q=1 HTTP/1.1\r\nHost: a\r\nX-Two:  b  c \t\r\nContent-Length: 007"
    )
    assert head is not None
    assert (head.method, head.target, head.length) == (b"POST", b"/v1/x?q=1", 7)
    assert head.headers == [(b"host", b"a"), (b"x-two", b"b  c"), (b"content-length", b"007")]
    assert server._plain_head(b"GET / HTTP/1.1\r\nhost: a\r\nx-empty:") is not None


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.0\r\nhost: a",
        b"GET / HTTP/2.0\r\nhost: a",
        b"HEAD / HTTP/1.1\r\nhost: a",
        b"CONNECT a:443 HTTP/1.1\r\nhost: a",
        b"GET / HTTP/1.1",
        b"GET / HTTP/1.1\r\nhost: a\r\nhost: b",
        b"GET / HTTP/1.1\r\nhost: a\nx: b",
        b"GET / HTTP/1.1\r\nhost: a\rx: b",
        b"GET / HTTP/1.1\r\nhost: a\r\nx: b\r\n c",
        b"GET / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked",
        b"GET / HTTP/1.1\r\nhost: a\r\nexpect: 100-continue",
        b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close",
        b"GET / HTTP/1.1\r\nhost: a\r\nupgrade: websocket",
        b"GET / HTTP/1.1\r\nhost: a\r\ncontent-length: 1\r\ncontent-length: 1",
        b"GET / HTTP/1.1\r\nhost: a\r\ncontent-length: +1",
        b"GET / HTTP/1.1\r\nhost: a\r\ncontent-length: 1234567890123456789",
        b"GET / HTTP/1.1\r\nhost: a\r\nx: \x00",
        b"GET / HTTP/1.1\r\nhost: a\r\nx y: b",
        b"GET /a b HTTP/1.1\r\nhost: a",
        b"GET / HTTP/1.1\r\nhost: a" + b"\r\nx: y" * server.MAX_HEADERS,
        b"GET / HTTP/1.1\r\nhost: a\r\nx: " + b"y" * server.MAX_HEAD_BYTES,
    ],
)
def test_any_other_head_is_left_to_h11(head: bytes) -> None:
    assert server._plain_head(head) is None

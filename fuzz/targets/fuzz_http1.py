"""The client port's HTTP/1.1 server (``llmgw/gateway/server.py``) fed raw
bytes, cut anywhere, over an in-memory stream, on a mock clock so its
timeouts pass at once.

Checked: no exception escapes the connection; it ends within the server's
own timeouts (virtual time); every byte it sends parses as HTTP/1.1
answers (status line, header fields, a body framed by its length or
chunked, or to the close); there is one answer per request the app saw,
plus at most one refusal of the server's own, last, with
``connection: close``; no answer is a 500 (the app here never fails).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import trio
import trio.testing
from _harness import cut, fuzz, instrumented

with instrumented():
    from llmgw.gateway import server

BODY_LIMIT = 4096
#: Longer than any of the server's timeouts added up: a connection still
#: open after this much virtual time hangs.
VIRTUAL_BOUND_S = 4 * (
    server.FIRST_REQUEST_TIMEOUT_S
    + server.KEEP_ALIVE_TIMEOUT_S
    + server.BODY_READ_TIMEOUT_S
    + server.SEND_TIMEOUT_S
    + server.LINGER_S
)
STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [\x20-\x7e]*")
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


async def app(scope: Any, receive: Any, send: Any) -> None:
    """Answers by the path's first letter, as the gateway's routes do:
    ``/n`` without reading the body (a 401), ``/s`` streamed, else after
    reading the body (413 past :data:`BODY_LIMIT`)."""
    path = scope["path"]
    assert isinstance(path, str) and isinstance(scope["method"], str)
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in scope["headers"])
    if path.startswith("/n"):
        await answer(send, 401, b'{"error":"no key"}')
        return
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if size > BODY_LIMIT:
            await answer(send, 413, b'{"error":"too large"}')
            return
        if not message.get("more_body", False):
            break
    if path.startswith("/s"):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"data: 1\n\n", b"", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await answer(send, 200, b'{"read":%d}' % size)


async def answer(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Seen:
    requests = 0


def counting(inner: Any) -> Any:
    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        Seen.requests += 1
        await inner(scope, receive, send)

    return wrapped


def answers(out: bytes, heads: bool) -> list[tuple[int, dict[bytes, list[bytes]]]]:
    """Every final answer in ``out``; AssertionError where it is not HTTP.
    ``heads``: whether a request may have been a HEAD (its answer has a
    ``content-length`` or ``transfer-encoding: chunked`` but no body)."""
    found = []
    at = 0
    while at < len(out):
        end = out.find(b"\r\n\r\n", at)
        assert end >= 0, f"an answer's head is cut off: {out[at : at + 200]!r}"
        status_line, *lines = out[at:end].split(b"\r\n")
        matched = STATUS_LINE.fullmatch(status_line)
        assert matched, f"bad status line {status_line!r}"
        status = int(matched[1])
        fields: dict[bytes, list[bytes]] = {}
        for line in lines:
            name, colon, value = line.partition(b":")
            assert colon and TOKEN.fullmatch(name), f"bad header line {line!r}"
            fields.setdefault(name.lower(), []).append(value.strip())
        at = end + 4
        if status < 200:
            continue
        if b"content-length" in fields:
            (length,) = fields[b"content-length"]
            size = int(length)
            if size and heads and (at == len(out) or out.startswith(b"HTTP/1.", at)):
                pass  # the answer to a HEAD: no body
            else:
                assert len(out) >= at + size, "a body shorter than its content-length"
                at += size
        elif fields.get(b"transfer-encoding") == [b"chunked"]:
            if heads and (at == len(out) or out.startswith(b"HTTP/1.", at)):
                found.append((status, fields))
                continue  # the answer to a HEAD of a streamed route: no body
            while True:
                line_end = out.find(b"\r\n", at)
                assert line_end >= 0, "a chunk size line cut off"
                size = int(out[at:line_end], 16)
                at = line_end + 2
                if size == 0:
                    assert out.startswith(b"\r\n", at), "no end after the last chunk"
                    at += 2
                    break
                assert out.startswith(b"\r\n", at + size), "a chunk not ended by CRLF"
                at += size + 2
        else:
            at = len(out)  # the body runs to the close
        found.append((status, fields))
    return found


async def exchange(pieces: list[bytes]) -> bytes:
    client, server_side = trio.testing.memory_stream_pair()
    connection = server._Connection(server_side, counting(app), ("127.0.0.1", 8080), None)
    out = bytearray()
    with trio.fail_after(VIRTUAL_BOUND_S):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                async with server_side:
                    await connection.serve(trio.Event(), lambda: None)

            async def read() -> None:
                while chunk := await client.receive_some(65536):
                    out.extend(chunk)

            nursery.start_soon(serve)
            nursery.start_soon(read)
            try:
                for piece in pieces:
                    await client.send_all(piece)
                    await trio.sleep(0.001)
                await client.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the server closed first (a refusal): it need not read the rest
    return bytes(out)


def one_input(data: bytes) -> None:
    seed, data = (data[0], data[1:]) if data else (0, b"")
    Seen.requests = 0
    try:
        out = trio.run(
            exchange, cut(data, seed), clock=trio.testing.MockClock(autojump_threshold=0)
        )
    except BaseExceptionGroup as group:
        while isinstance(group, BaseExceptionGroup):
            group = group.exceptions[0]
        raise group from None
    found = answers(out, heads=b"HEAD" in data)
    assert all(status != 500 for status, _ in found), out
    assert Seen.requests <= len(found) <= Seen.requests + 1, (Seen.requests, out)
    if len(found) > Seen.requests:
        status, fields = found[-1]
        assert status >= 400 and fields.get(b"connection") == [b"close"], out


if __name__ == "__main__":
    fuzz(one_input)

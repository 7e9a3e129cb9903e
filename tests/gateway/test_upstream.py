"""The upstream pool against a real sim engine and a hostile fake."""

from __future__ import annotations

from functools import partial

import orjson
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.engines.testing import open_sim
from llmgw.gateway.upstream import UpstreamError, UpstreamPool

KEY = "k" * 64
AUTH = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
CHAT = orjson.dumps(
    {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
)


async def test_sequential_requests_reuse_one_connection_and_bodies_arrive_whole() -> None:
    with trio.fail_after(30):
        async with open_sim(api_key=KEY) as sim:
            pool = UpstreamPool("127.0.0.1", sim.port)
            try:
                for _ in range(5):
                    async with await pool.request(
                        b"POST", b"/v1/chat/completions", AUTH, CHAT
                    ) as response:
                        assert response.status == 200
                        assert (
                            response.header(
                                b"content-type",
                            )
                            is not None
                        )
                        body = await response.read()
                    assert body.endswith(b"data: [DONE]\n\n")
                    assert body.count(b'"content":"tok') == 4
                assert pool.statistics() == {"idle": 1, "opened": 1}
            finally:
                await pool.aclose()


async def test_concurrent_requests_open_one_connection_each_and_keep_them_idle_after() -> None:
    with trio.fail_after(30):
        async with open_sim(api_key=KEY) as sim:
            pool = UpstreamPool("127.0.0.1", sim.port)
            statuses: list[int] = []

            async def one() -> None:
                async with await pool.request(
                    b"POST", b"/v1/chat/completions", AUTH, CHAT
                ) as response:
                    await response.read()
                    statuses.append(response.status)

            try:
                async with trio.open_nursery() as nursery:
                    for _ in range(20):
                        nursery.start_soon(one)
                assert statuses == [200] * 20
                assert pool.statistics() == {"idle": 20, "opened": 20}
            finally:
                await pool.aclose()


async def test_an_answer_not_read_to_its_end_does_not_return_its_connection() -> None:
    with trio.fail_after(30):
        async with open_sim("--tokens-per-second", "20", api_key=KEY) as sim:
            pool = UpstreamPool("127.0.0.1", sim.port)
            try:
                async with await pool.request(
                    b"POST", b"/v1/chat/completions", AUTH, CHAT
                ) as response:
                    assert await response.receive()
                assert pool.statistics()["idle"] == 0
            finally:
                await pool.aclose()


async def test_an_unreachable_engine_is_an_error_before_any_response() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connection refused
        pool = UpstreamPool("127.0.0.1", port)
        with pytest.raises(UpstreamError) as caught:
            await pool.request(b"POST", b"/", AUTH, b"{}")
    assert caught.value.before_response


async def test_a_connection_the_engine_closed_while_idle_is_replaced_transparently() -> None:
    """A fake engine answers one request per connection, then closes it
    without saying so (no Connection: close)."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}"

    async def one_answer_then_close(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(4096)
            await stream.send_all(answer)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(
                partial(trio.serve_tcp, one_answer_then_close, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            pool = UpstreamPool("127.0.0.1", port)
            try:
                for _ in range(3):
                    async with await pool.request(b"GET", b"/", [], b"") as response:
                        assert await response.read() == b"{}"
                    await trio.sleep(0.05)  # let the fake close its side
                assert pool.statistics()["opened"] == 3
            finally:
                await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_a_streamed_answer_waits_for_each_event_instead_of_trying_an_empty_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fake engine sends its head, then one chunk at a time with pauses:
    every piece arrives whole, and no read of the engine's socket but the
    body's first finds it empty (after a read that took all there was, the
    next waits first), neither for the head nor for the body."""
    import os

    pieces = [b"data: %d\n\n" % n for n in range(5)]

    async def streaming(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(4096)
            await trio.sleep(0.05)  # the answer is not there when the read starts
            await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in pieces:
                await trio.sleep(0.02)
                await stream.send_all(b"%x\r\n%s\r\n" % (len(piece), piece))
            await stream.send_all(b"0\r\n\r\n")
            await trio.sleep(1)

    reads: list[int] = []
    empty: list[int] = []
    real_read = os.read

    def counting_read(fd: int, size: int) -> bytes:
        reads.append(fd)
        try:
            return real_read(fd, size)
        except BlockingIOError:
            empty.append(fd)
            raise

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(
                partial(trio.serve_tcp, streaming, 0, host="127.0.0.1")
            )
            port = listener.socket.getsockname()[1]
            pool = UpstreamPool("127.0.0.1", port)
            monkeypatch.setattr(os, "read", counting_read)
            try:
                async with await pool.request(b"POST", b"/", [], b"{}") as response:
                    got = []
                    while piece := await response.receive():
                        got.append(piece)
                assert got == pieces
                assert reads
                # At most the body's first read tries the socket at once.
                assert len(empty) <= 1
            finally:
                monkeypatch.undo()
                await pool.aclose()
            nursery.cancel_scope.cancel()


# -- the body reader, alone

_CHUNKED = b"5\r\nhello\r\n1;ext=1\r\n \r\nA \r\n0123456789\r\n0\r\nx-trailer: 1\r\n\r\n"


@pytest.mark.parametrize("rest", [b"", b"HTTP/1.1 200 OK\r\n"])
def test_a_chunked_body_is_the_same_cut_anywhere(rest: bytes) -> None:
    from llmgw.gateway.upstream import BodyReader

    wire = _CHUNKED + rest
    cuts = [[wire[:at], wire[at:]] for at in range(len(wire) + 1)]
    for pieces in [*cuts, [wire[at : at + 1] for at in range(len(wire))]]:
        reader = BodyReader(chunked=True, length=None)
        body = b"".join(reader.feed(piece) for piece in pieces)
        assert body == b"hello 0123456789"
        assert reader.done
        assert reader.rest == rest


def test_a_chunked_body_read_one_whole_chunk_at_a_time_is_the_same() -> None:
    """Each read exactly one chunk (the streamed answer's usual read, taken
    the short way), mixed with reads that are not."""
    from llmgw.gateway.upstream import BodyReader

    chunks = [b"5\r\nhello\r\n", b"00A\r\n0123456789\r\n", b"1;x=1\r\n!\r\n"]
    chunks += [b"f\r\n" + b"e" * 15 + b"\r\n", b"3\r\nab", b"c\r\n", b"2\r\nxy\r\n0\r\n\r\n"]
    reader = BodyReader(chunked=True, length=None)
    pieces = [reader.feed(chunk) for chunk in chunks]
    assert pieces == [b"hello", b"0123456789", b"!", b"e" * 15, b"ab", b"c", b"xy"]
    assert reader.done
    assert reader.rest == b""


def test_a_body_of_a_given_length_ends_there() -> None:
    from llmgw.gateway.upstream import BodyReader

    reader = BodyReader(chunked=False, length=5)
    assert reader.feed(b"he") == b"he"
    assert not reader.done
    assert reader.feed(b"lloXY") == b"llo"
    assert reader.done
    assert reader.rest == b"XY"
    assert BodyReader(chunked=False, length=0).done
    to_close = BodyReader(chunked=False, length=None)
    assert to_close.feed(b"abc") == b"abc"
    assert not to_close.done


@pytest.mark.parametrize(
    "wire",
    [
        b"zz\r\nhello\r\n",  # not hex
        b"5\r\nhelloXX",  # no CRLF after the data
        b"\r\n",  # an empty size
        b"1" * 17 + b"\r\n",  # too many digits
        b"5" * 5000,  # a size line that never ends
        b"0x5\r\nhello\r\n",  # a prefix int() would take
        b"+5\r\nhello\r\n",  # a sign
        b"5\r\nhelloX\n",  # one whole chunk's length, no CRLF after the data
        b"5\r\nhello\n\r",
    ],
)
def test_a_malformed_chunk_is_a_framing_error(wire: bytes) -> None:
    from llmgw.gateway.upstream import BodyReader, FramingError

    reader = BodyReader(chunked=True, length=None)
    with pytest.raises(FramingError):
        reader.feed(wire)


# -- the answer's head, alone


def test_an_answer_head_is_parsed_with_lower_case_names() -> None:
    from llmgw.gateway.upstream import parse_head

    head = parse_head(
        b"HTTP/1.1 429 Too Many\r\nRetry-After:  3 \r\nContent-Length: 2\r\ncontent-length: 2\r\nX-Empty:\r\n"
        b"Content-Type: text/plain"
    )
    assert (head.status, head.http_version) == (429, b"1.1")
    assert head.headers == [
        (b"retry-after", b"3"),
        (b"content-length", b"2"),
        (b"x-empty", b""),
        (b"content-type", b"text/plain"),
    ]
    assert parse_head(b"HTTP/1.0 200\nA: b").headers == [(b"a", b"b")]


@pytest.mark.parametrize(
    "block",
    [
        b"HTTP/2 200 OK",
        b"HTTP/1.1 20 OK",
        b"SPDY 200 OK",
        b"HTTP/1.1 200 OK\r\n folded: line",
        b"HTTP/1.1 200 OK\r\nno colon",
        b"HTTP/1.1 200 OK\r\nbad name: x",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1",
        b"HTTP/1.1 200 OK\r\nx: a\rb",
    ],
)
def test_a_malformed_answer_head_is_refused(block: bytes) -> None:
    from llmgw.gateway.upstream import FramingError, parse_head

    with pytest.raises(FramingError):
        parse_head(block)


async def test_a_header_that_would_break_the_request_is_not_sent() -> None:
    pool = UpstreamPool("127.0.0.1", 9)  # never dialed: refused before
    with pytest.raises(UpstreamError) as caught:
        await pool.request(b"POST", b"/v1/x", [(b"x-id", b"a\r\nx-injected: 1")], b"{}")
    assert caught.value.before_response
    assert pool.statistics()["opened"] == 0


@st.composite
def _chunked_reads(draw: st.DrawFn) -> tuple[list[bytes], bytes]:
    """A chunked body (sizes in either case, with leading zeros, some with
    extensions) cut into reads: mostly one whole chunk each (the short
    way), sometimes more or less than one."""
    pieces = draw(st.lists(st.binary(min_size=1, max_size=40), max_size=8))
    wire: list[bytes] = []
    for piece in pieces:
        size = b"%x" % len(piece)
        if draw(st.booleans()):
            size = size.upper()
        size = b"0" * draw(st.integers(0, 2)) + size
        extension = b";x=1" if draw(st.integers(0, 4)) == 0 else b""
        wire.append(size + extension + b"\r\n" + piece + b"\r\n")
    wire.append(b"0\r\n\r\n")
    reads: list[bytes] = []
    at = 0
    while at < len(wire):
        take = draw(st.sampled_from([1, 1, 1, 2]))
        joined = b"".join(wire[at : at + take])
        if draw(st.integers(0, 5)) == 0 and len(joined) > 1:
            cut_at = draw(st.integers(1, len(joined) - 1))
            reads += [joined[:cut_at], joined[cut_at:]]
        else:
            reads.append(joined)
        at += take
    return reads, b"".join(pieces)


@settings(max_examples=300, deadline=None)
@given(_chunked_reads())
def test_a_chunked_body_read_in_whole_chunks_or_not_is_the_body(
    case: tuple[list[bytes], bytes],
) -> None:
    from llmgw.gateway.upstream import BodyReader

    reads, body = case
    reader = BodyReader(chunked=True, length=None)
    assert b"".join(reader.feed(data) for data in reads) == body
    assert reader.done
    assert reader.rest == b""

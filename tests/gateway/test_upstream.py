"""The upstream pool against a real sim engine and a hostile fake."""

from __future__ import annotations

from functools import partial

import orjson
import pytest
import trio

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

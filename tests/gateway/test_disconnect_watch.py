"""A client that goes away cancels its engine request, through the real
client port (``llmgw/gateway/server.py``): the server's one disconnect
watch (``epoll``, ``llmgw.watch_disconnect`` in the scope's extensions)
instead of a task per request, in front of the sim engine."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import trio

from llmgw.accounting.accountant import Accountant
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter
from llmgw.asgi import WATCH_DISCONNECT
from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster
from llmgw.engines.sim.app import SimEngine
from llmgw.engines.sim.config import SimConfig
from llmgw.gateway.app import Gateway
from llmgw.gateway.parse import estimate_prompt_tokens
from llmgw.gateway.server import serve_http1
from llmgw.router.endpoint import Endpoint
from llmgw.store import ModelRecord, Store, open_sqlite_store
from llmgw.store.records import Limits

ENGINE_KEY = "engine-secret"
DEADLINE_S = 30.0


@attrs.define
class Port:
    sim: SimEngine
    port: int
    secret: str
    store: Store
    usage: UsageWriter
    stop: trio.Event

    def request(self, doc: dict[str, Any], *, connection: str = "") -> bytes:
        body = orjson.dumps(doc)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            f"authorization: Bearer {self.secret}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{connection}\r\n"
        )
        return head.encode() + body


async def wait_for(condition: Callable[[], bool]) -> None:
    with trio.fail_after(DEADLINE_S):
        while not condition():  # noqa: ASYNC110 (the engine's state, polled)
            await trio.sleep(0.01)


@pytest.fixture
async def port(tmp_path: Path) -> AsyncIterator[Port]:
    """The gateway on the real client port, in front of a sim engine whose
    first token takes 60 s (so an answer is never done within a test)."""
    async with open_sqlite_store(tmp_path / "llmgw.db") as store, trio.open_nursery() as nursery:
        sim = SimEngine(
            SimConfig(model="sim-model", tokens=5, ttft_ms=60_000, tick_ms=0),
            api_key=ENGINE_KEY,
        )
        stop = trio.Event()
        address = await nursery.start(serve_http1, sim, "127.0.0.1:0", stop, 1.0)
        path, _ = await store.ensure_project("acme", "search", "web", time.time())
        await store.set_limits("project", path.project.id, Limits(rpm=10**6, tpm=10**9))
        secret, record = new_key("watch")
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
                        port=int(address.rsplit(":", 1)[1]),
                        api_key=ENGINE_KEY,
                    )
                ]
            }
        )
        usage = UsageWriter()
        gateway = Gateway(
            authenticator=KeyAuthenticator(store),
            cluster=cluster,
            usage=usage,
            accountant=Accountant(PriceBook({})),
            resolver=ScopeResolver(store),
        )
        client_port = await nursery.start(serve_http1, gateway, "127.0.0.1:0", stop, 1.0)
        try:
            yield Port(sim, int(client_port.rsplit(":", 1)[1]), secret, store, usage, stop)
        finally:
            await gateway.aclose()
            stop.set()


CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}]}


async def rows_with_status(port: Port, status: int) -> int:
    await port.usage.flush(port.store)
    rows = await port.store.list_usage(last=100)
    return sum(1 for row in rows if row.status == status)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["close", "half-close", "reset"])
async def test_a_client_that_leaves_before_its_answer_cancels_the_engine_request(
    port: Port, stream: bool, how: str
) -> None:
    stream_ = await trio.open_tcp_stream("127.0.0.1", port.port)
    await stream_.send_all(port.request({**CHAT, "stream": stream}))
    await wait_for(lambda: port.sim.pacer.running == 1)
    if how == "half-close":
        await stream_.send_eof()
    elif how == "reset":
        # SO_LINGER 0: the close sends a reset, not a FIN.
        stream_.socket.setsockopt(
            trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, b"\1\0\0\0\0\0\0\0"
        )
    if how != "half-close":
        await stream_.aclose()
    # The engine sees its request cancelled (the gateway closed it).
    await wait_for(lambda: port.sim.counters.finished["abort"] == 1)
    assert port.sim.pacer.running == 0
    await stream_.aclose()
    with trio.fail_after(DEADLINE_S):
        while await rows_with_status(port, 499) != 1:  # noqa: ASYNC110 (the store, polled)
            await trio.sleep(0.05)
    # The engine had the prompt: it is charged (as estimated), nothing more.
    (row,) = [row for row in await port.store.list_usage(last=100) if row.status == 499]
    prompt = estimate_prompt_tokens({**CHAT, "stream": stream}, "chat", bytes_per_token=4)
    assert prompt > 0
    assert (row.prompt_tokens, row.completion_tokens) == (prompt, 0)


async def test_a_client_that_left_while_its_request_was_read_is_cancelled_at_once(
    port: Port,
) -> None:
    # The request and the close arrive together: the close is known before
    # the watch is armed, so the request ends (499) without an answer.
    stream_ = await trio.open_tcp_stream("127.0.0.1", port.port)
    async with stream_:
        await stream_.send_all(port.request(CHAT))
        await stream_.send_eof()
        with trio.fail_after(DEADLINE_S):
            assert await stream_.receive_some(65536) == b""
    with trio.fail_after(DEADLINE_S):
        while await rows_with_status(port, 499) != 1:  # noqa: ASYNC110 (the store, polled)
            await trio.sleep(0.05)
    assert port.sim.pacer.running == 0


async def test_requests_one_after_another_on_a_connection_are_watched_each(
    port: Port,
) -> None:
    # Answers that come back (an unknown model: 404 before the engine) keep
    # the connection; each later request is watched again, and a client
    # leaving during the third cancels it.
    stream_ = await trio.open_tcp_stream("127.0.0.1", port.port)
    async with stream_:
        for _ in range(2):
            await stream_.send_all(port.request({**CHAT, "model": "nope"}))
            got = b""
            with trio.fail_after(DEADLINE_S):
                while b'"model_not_found"' not in got:
                    got += await stream_.receive_some(65536)
            assert got.startswith(b"HTTP/1.1 404 ")
        await stream_.send_all(port.request(CHAT))
        await wait_for(lambda: port.sim.pacer.running == 1)
    await wait_for(lambda: port.sim.counters.finished["abort"] == 1)


async def test_the_watch_is_offered_to_apps_on_the_client_port(port: Port) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope.get("extensions", {}).get(WATCH_DISCONNECT))
        await receive()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, app, "127.0.0.1:0", stop, 1.0)
        stream_ = await trio.open_tcp_stream("127.0.0.1", int(address.rsplit(":", 1)[1]))
        async with stream_:
            await stream_.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(DEADLINE_S):
                assert (await stream_.receive_some(65536)).startswith(b"HTTP/1.1 204 ")
        stop.set()
    assert len(seen) == 1
    assert callable(seen[0])


async def test_a_request_the_stop_cuts_before_its_answer_gets_a_503(port: Port) -> None:
    # The stop's grace (1 s here) runs out while the engine has not
    # answered: the client gets a 503 it can retry, not a dropped
    # connection, and the request is recorded as 503.
    stream_ = await trio.open_tcp_stream("127.0.0.1", port.port)
    async with stream_:
        await stream_.send_all(port.request(CHAT))
        await wait_for(lambda: port.sim.pacer.running == 1)
        port.stop.set()
        got = b""
        with trio.fail_after(DEADLINE_S):
            while chunk := await stream_.receive_some(65536):
                got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), got
    assert b"retry-after: 1" in head.lower()
    assert orjson.loads(body)["error"]["code"] == "server_shutting_down"
    with trio.fail_after(DEADLINE_S):
        while await rows_with_status(port, 503) != 1:  # noqa: ASYNC110 (the store, polled)
            await trio.sleep(0.05)

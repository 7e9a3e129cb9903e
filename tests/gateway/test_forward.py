"""A standby's ``/v1``: forwarded to the leader, a stream relayed as it
comes (``llmgw.gateway.forward``)."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from llmgw.asgi import Receive, Scope, Send
from llmgw.gateway.forward import FORWARDED_HEADER, LeaderForward
from llmgw.gateway.server import serve_http1


class _Leader:
    """A leader's client API: echoes what it got, then streams two events
    with a pause between them (released by ``go``)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.go = trio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.seen.append(
            {
                "path": scope["path"],
                "query": scope["query_string"],
                "headers": dict(scope["headers"]),
                "body": body,
            }
        )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"x-from", b"leader")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
        await self.go.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def test_a_stream_is_forwarded_piece_by_piece_with_headers_and_body() -> None:
    leader = _Leader()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        leader_address = await nursery.start(serve_http1, leader, "127.0.0.1:0", stop, 1.0)
        forward = LeaderForward(lambda: leader_address)
        standby = await nursery.start(serve_http1, forward, "127.0.0.1:0", stop, 1.0)
        async with (
            httpx.AsyncClient(base_url=f"http://{standby}") as client,
            client.stream(
                "POST",
                "/v1/chat/completions?x=1",
                content=b'{"model":"m","stream":true}',
                headers={"authorization": "Bearer sk-test"},
            ) as response,
        ):
            assert response.status_code == 200
            assert response.headers["x-from"] == "leader"
            chunks = response.aiter_raw()
            # The first event arrives while the leader still holds the second.
            with trio.fail_after(5):
                first = await chunks.__anext__()
            assert first == b"data: one\n\n"
            leader.go.set()
            rest = b"".join([c async for c in chunks])
            assert rest == b"data: [DONE]\n\n"
        seen = leader.seen[0]
        assert seen["path"] == "/v1/chat/completions"
        assert seen["query"] == b"x=1"
        assert seen["body"] == b'{"model":"m","stream":true}'
        assert seen["headers"][b"authorization"] == b"Bearer sk-test"
        assert seen["headers"][FORWARDED_HEADER] == b"1"
        await forward.aclose()
        stop.set()


async def test_no_leader_known_or_reachable_is_503_with_retry_after() -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        none_known = await nursery.start(
            serve_http1, LeaderForward(lambda: None, hold_s=0), "127.0.0.1:0", stop, 1.0
        )
        # A port nothing listens on.
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sock.getsockname()[1]}"
        unreachable = await nursery.start(
            serve_http1, LeaderForward(lambda: dead, hold_s=0), "127.0.0.1:0", stop, 1.0
        )
        async with httpx.AsyncClient() as client:
            for address, says in (
                (none_known, "knows no leader"),
                (unreachable, "cannot be reached"),
            ):
                response = await client.post(f"http://{address}/v1/chat/completions", content=b"{}")
                assert response.status_code == 503
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "no_leader"
                assert says in response.json()["error"]["message"]
            # Forwarded once already: never passed on again.
            looped = await client.post(
                f"http://{unreachable}/v1/chat/completions",
                content=b"{}",
                headers={"x-llmgw-forwarded": "1"},
            )
            assert looped.status_code == 503
            assert "knows no leader" in looped.json()["error"]["message"]
        stop.set()


async def test_a_request_is_held_until_a_leader_answers_or_this_one_leads() -> None:
    leader = _Leader()
    leader.go.set()
    stop = trio.Event()
    known: list[str] = []
    leading = False
    async with trio.open_nursery() as nursery:
        leader_address = await nursery.start(serve_http1, leader, "127.0.0.1:0", stop, 1.0)
        forward = LeaderForward(
            lambda: known[0] if known else None, is_leader=lambda: leading, hold_s=5
        )
        standby = await nursery.start(serve_http1, forward, "127.0.0.1:0", stop, 1.0)

        async def leader_found_later() -> None:
            await trio.sleep(0.5)
            known.append(leader_address)

        nursery.start_soon(leader_found_later)
        async with httpx.AsyncClient() as client:
            held = await client.post(f"http://{standby}/v1/chat/completions", content=b"{}")
        assert held.status_code == 200
        assert held.headers["x-from"] == "leader"
        # This control plane leads while the request waits: it is handed back
        # with its body.
        known.clear()
        got: list[Any] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b'{"a":1}', "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            got.append(message)

        async def lead_soon() -> None:
            nonlocal leading
            await trio.sleep(0.3)
            leading = True

        nursery.start_soon(lead_soon)
        scope: Any = {
            "type": "http",
            "path": "/v1/chat/completions",
            "headers": [],
            "method": "POST",
        }
        handed = await forward(scope, receive, send)
        assert handed is receive
        assert got == []
        await forward.aclose()
        stop.set()

"""The gateway built in-process and called as an ASGI app in memory (no
socket to the gateway), in front of the sim engine served in the same trio
run, over a real catalog, store, accountant and ``Cluster``."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
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
from llmgw.gateway.app import Gateway, GatewayCluster
from llmgw.gateway.server import serve_http1
from llmgw.router.endpoint import Endpoint
from llmgw.router.router import ClusterView
from llmgw.settings import (
    AdmissionSettings,
    BandSettings,
    RouterSettings,
    ServerSettings,
    ServingSettings,
)
from llmgw.store import ModelRecord, Store, UsageRow, open_sqlite_store
from llmgw.store.records import External, Limits

ENGINE_KEY = "engine-secret"


@attrs.define
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@attrs.define
class Rig:
    gateway: Gateway
    cluster: Cluster
    store: Store
    usage: UsageWriter
    secret: str
    sim_port: int

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Sequence[tuple[bytes, bytes]] | None = None,
    ) -> Answer:
        """One request, as an ASGI call in memory."""
        data = b"" if body is None else orjson.dumps(body)
        return await self.call_raw(method, path, data, headers=headers)

    async def call_raw(
        self,
        method: str,
        path: str,
        data: bytes,
        *,
        headers: Sequence[tuple[bytes, bytes]] | None = None,
    ) -> Answer:
        """One request whose body is ``data`` as it is, as an ASGI call in memory."""
        if headers is None:
            headers = [(b"authorization", f"Bearer {self.secret}".encode())]
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": [(b"content-length", str(len(data)).encode()), *headers],
        }
        read = False
        gone = trio.Event()
        messages: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": data, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        await self.gateway(scope, receive, send)
        start = messages[0]
        assert start["type"] == "http.response.start"
        assert not messages[-1].get("more_body", False)
        return Answer(
            start["status"],
            dict(start["headers"]),
            b"".join(m.get("body", b"") for m in messages[1:]),
        )

    async def row(self, request_id: bytes) -> UsageRow:
        await self.usage.flush(self.store)
        row = await self.store.get_usage(request_id.decode())
        assert row is not None
        return row


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_sqlite_store(tmp_path / "llmgw.db") as store, trio.open_nursery() as nursery:
        sim = SimEngine(
            SimConfig(model="sim-model", tokens=5, tokens_per_second=0, tick_ms=0),
            api_key=ENGINE_KEY,
        )
        stop = trio.Event()
        address = await nursery.start(serve_http1, sim, "127.0.0.1:0", stop, 1.0)
        port = int(address.rsplit(":", 1)[1])
        path, _ = await store.ensure_project("acme", "search", "web", time.time())
        roomy = Limits(rpm=10**6, tpm=10**9)
        await store.set_limits("project", path.project.id, roomy)
        secret, record = new_key("inprocess")
        await store.insert_key(attrs.evolve(record, project_id=path.project.id))
        cluster = Cluster()
        cluster.set_leader(True)
        cluster.replace_catalog(
            {
                "sim-model": ModelRecord.simple(
                    "sim-model", "sim", slots=0, aliases=("sim",), created_at=1.0
                ),
                "elsewhere": ModelRecord.simple("elsewhere", "sim", fallbacks=("sim-model",)),
            }
        )
        cluster.set_fixed_endpoints(
            {
                "sim-model": [
                    Endpoint(
                        replica_id="sim-model-0",
                        model="sim-model",
                        host="127.0.0.1",
                        port=port,
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
        try:
            yield Rig(gateway, cluster, store, usage, secret, port)
        finally:
            await gateway.aclose()
            stop.set()


def test_the_control_planes_cluster_is_what_the_gateway_and_router_read() -> None:
    cluster = Cluster()
    as_router: ClusterView = cluster
    as_gateway: GatewayCluster = cluster
    assert as_router is as_gateway


async def test_a_chat_answer_is_relayed_and_recorded(rig: Rig) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    got = await rig.call("POST", "/v1/chat/completions", body)
    assert got.status == 200, got.body
    assert got.headers[b"x-llmgw-replica"] == b"sim-model-0"
    assert b"x-ratelimit-limit-requests" in got.headers
    assert float(got.headers[b"x-llmgw-overhead-ms"]) >= 0
    answer = got.json()
    assert answer["object"] == "chat.completion"
    row = await rig.row(got.headers[b"x-request-id"])
    assert (row.model, row.status, row.replica_id, row.endpoint) == (
        "sim-model",
        200,
        "sim-model-0",
        "chat",
    )
    assert row.completion_tokens == answer["usage"]["completion_tokens"]
    assert row.project_id
    assert not row.stream


async def test_a_stream_is_relayed_with_the_usage_the_client_did_not_ask_for_kept_back(
    rig: Rig,
) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    got = await rig.call("POST", "/v1/chat/completions", body)
    assert got.status == 200
    assert got.headers[b"content-type"] == b"text/event-stream"
    assert got.body.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in got.body
    row = await rig.row(got.headers[b"x-request-id"])
    assert row.stream
    assert row.status == 200
    assert row.completion_tokens > 0
    assert row.ttft_ms is not None


async def test_an_anthropic_request_is_translated_both_ways(rig: Rig) -> None:
    body = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    got = await rig.call("POST", "/v1/messages", body)
    assert got.status == 200, got.body
    message = got.json()
    assert (message["type"], message["model"]) == ("message", "sim")


async def test_a_fallback_answers_for_a_model_without_a_replica(rig: Rig) -> None:
    body = {"model": "elsewhere", "messages": [{"role": "user", "content": "hi"}]}
    got = await rig.call("POST", "/v1/chat/completions", body)
    assert got.status == 200, got.body
    row = await rig.row(got.headers[b"x-request-id"])
    assert (row.model, row.served_model) == ("elsewhere", "sim-model")


async def test_errors_take_the_routes_shape_and_are_recorded(rig: Rig) -> None:
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    got = await rig.call("POST", "/v1/chat/completions", chat)
    assert got.status == 404
    assert got.json() == {
        "error": {
            "message": "The model 'nope' does not exist",
            "type": "invalid_request_error",
            "code": "model_not_found",
            "param": "model",
        }
    }
    row = await rig.row(got.headers[b"x-request-id"])
    assert (row.status, row.model) == (404, "")
    got = await rig.call("POST", "/v1/messages", {**chat, "max_tokens": 3})
    assert got.status == 404
    assert got.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model 'nope' does not exist"},
    }
    got = await rig.call("POST", "/v1/chat/completions", chat, headers=[])
    assert got.status == 401
    assert got.json()["error"]["code"] == "invalid_api_key"
    # Both ways of sending a key are named (Anthropic's clients use x-api-key).
    assert "Authorization: Bearer" in got.json()["error"]["message"]
    assert "x-api-key" in got.json()["error"]["message"]
    got = await rig.call(
        "POST", "/v1/chat/completions", chat, headers=[(b"authorization", b"Bearer sk-llmgw-no")]
    )
    assert (got.status, got.json()["error"]["code"]) == (401, "invalid_api_key")
    got = await rig.call("GET", "/v1/chat/completions")
    assert (got.status, got.headers[b"allow"]) == (405, b"POST")


async def test_no_replica_is_503_with_retry_after(rig: Rig) -> None:
    rig.cluster.set_fixed_endpoints({})
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    got = await rig.call("POST", "/v1/chat/completions", body)
    assert got.status == 503
    assert got.headers[b"retry-after"] == b"5"
    assert got.json()["error"]["code"] == "model_not_ready"


async def test_a_replica_that_does_not_answer_is_502(rig: Rig) -> None:
    rig.cluster.endpoints["sim-model"][0].port = 1  # nothing listens there
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    got = await rig.call("POST", "/v1/chat/completions", body)
    assert got.status == 502
    assert got.json()["error"]["code"] == "upstream_error"


async def test_open_routes_and_the_catalog(rig: Rig) -> None:
    assert (await rig.call("GET", "/health")).status == 200
    ready = await rig.call("GET", "/ready")
    assert (ready.status, ready.json()) == (200, {"ready": True})
    assert (await rig.call("GET", "/leader")).json() == {"leader": True}
    models = await rig.call("GET", "/v1/models")
    assert [m["id"] for m in models.json()["data"]] == ["elsewhere", "sim-model"]
    assert (await rig.call("GET", "/nowhere")).status == 404


async def test_live_settings_are_followed_once_replaced(rig: Rig) -> None:
    gold = BandSettings(name="gold", priority=300)
    rig.cluster.apply_settings(
        ServerSettings(
            router=RouterSettings(admission=AdmissionSettings(bands=(gold,), default_band="gold"))
        )
    )
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    assert (await rig.call("POST", "/v1/chat/completions", body)).status == 200
    assert rig.gateway.router.admission.band("gold") is gold
    rig.cluster.apply_settings(ServerSettings(serving=ServingSettings(stopped=True)))
    got = await rig.call("POST", "/v1/chat/completions", body)
    assert (got.status, got.json()["error"]["code"]) == (503, "system_stopped")


# --- Anthropic's count_tokens, and Anthropic's error shape on its paths ---------------

COUNT = "/v1/messages/count_tokens"
ASK = [{"role": "user", "content": "how many tokens are in here?"}]
WEATHER = {
    "name": "weather",
    "description": "The weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def anthropic_error(got: Answer, status: int, kind: str) -> str:
    """The message of an answer in Anthropic's error shape, checked to be one."""
    assert got.status == status, got.body
    doc = got.json()
    assert set(doc) == {"type", "error"}, doc
    assert doc["type"] == "error"
    assert set(doc["error"]) == {"type", "message"}, doc
    assert doc["error"]["type"] == kind, doc
    message: str = doc["error"]["message"]
    assert message
    return message


async def key_with(rig: Rig, limits: Limits) -> str:
    """A new key in the rig's project with its own ``limits``."""
    path, _ = await rig.store.ensure_project("acme", "search", "web", time.time())
    secret, record = new_key("limited")
    await rig.store.insert_key(attrs.evolve(record, project_id=path.project.id, limits=limits))
    return secret


def bearer(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"x-api-key", secret.encode())]


async def test_count_tokens_is_the_engines_count_of_what_a_message_would_send(rig: Rig) -> None:
    cases: list[dict[str, Any]] = [
        {"messages": ASK},
        {"system": "You answer briefly.", "messages": ASK},
        {
            "system": [{"type": "text", "text": "Be kind."}],
            "messages": [
                *ASK,
                {"role": "assistant", "content": [{"type": "text", "text": "Forty-two."}]},
                {"role": "user", "content": "and now?"},
            ],
            "tools": [WEATHER],
        },
    ]
    counts = []
    for case in cases:
        got = await rig.call("POST", COUNT, {"model": "sim", **case})
        assert got.status == 200, got.body
        assert got.headers[b"content-type"] == b"application/json"
        assert b"x-ratelimit-remaining-requests" in got.headers
        counted = got.json()
        assert set(counted) == {"input_tokens"}
        sent = await rig.call(
            "POST", "/v1/messages", {"model": "sim-model", "max_tokens": 2, **case}
        )
        assert sent.status == 200, sent.body
        usage = sent.json()["usage"]
        # Anthropic's input_tokens leave out what was read from the cache.
        assert counted["input_tokens"] == usage["input_tokens"] + usage.get(
            "cache_read_input_tokens", 0
        )
        counts.append(counted["input_tokens"])
    assert counts[0] < counts[1] < counts[2]


async def test_count_tokens_writes_no_usage_row_but_counts_as_a_request(rig: Rig) -> None:
    secret = await key_with(rig, Limits(rpm=2))
    body = {"model": "sim-model", "messages": ASK}
    first = await rig.call("POST", COUNT, body, headers=bearer(secret))
    assert first.status == 200, first.body
    assert b"x-request-id" not in first.headers
    assert first.headers[b"x-ratelimit-limit-requests"] == b"2"
    assert first.headers[b"x-ratelimit-remaining-requests"] == b"1"
    assert (await rig.call("POST", COUNT, body, headers=bearer(secret))).status == 200
    refused = await rig.call("POST", COUNT, body, headers=bearer(secret))
    message = anthropic_error(refused, 429, "rate_limit_error")
    assert "request" in message
    assert int(refused.headers[b"retry-after"]) >= 1
    assert refused.headers[b"x-ratelimit-remaining-requests"] == b"0"
    # The same key's messages are limited by the same count.
    sent = await rig.call("POST", "/v1/messages", {**body, "max_tokens": 2}, headers=bearer(secret))
    anthropic_error(sent, 429, "rate_limit_error")
    await rig.usage.flush(rig.store)
    assert [r.status for r in await rig.store.list_usage(last=100)] == [429]


async def test_count_tokens_refusals_are_in_anthropics_shape(rig: Rig) -> None:
    body = {"model": "sim-model", "messages": ASK}
    anthropic_error(await rig.call("POST", COUNT, body, headers=[]), 401, "authentication_error")
    anthropic_error(
        await rig.call("POST", COUNT, body, headers=bearer("sk-llmgw-nope")),
        401,
        "authentication_error",
    )
    assert "nope" in anthropic_error(
        await rig.call("POST", COUNT, {**body, "model": "nope"}), 404, "not_found_error"
    )
    assert "messages" in anthropic_error(
        await rig.call("POST", COUNT, {"model": "sim-model"}), 400, "invalid_request_error"
    )
    assert "max_tokens" in anthropic_error(
        await rig.call("POST", COUNT, {**body, "max_tokens": 0}), 400, "invalid_request_error"
    )
    not_json = await rig.call_raw("POST", COUNT, b"{not json")
    assert "JSON" in anthropic_error(not_json, 400, "invalid_request_error")
    wrong = await rig.call("GET", COUNT)
    anthropic_error(wrong, 405, "invalid_request_error")
    assert wrong.headers[b"allow"] == b"POST"
    narrow = await key_with(rig, Limits(models=("elsewhere",)))
    assert "sim-model" in anthropic_error(
        await rig.call("POST", COUNT, body, headers=bearer(narrow)), 403, "permission_error"
    )
    rig.cluster.apply_settings(ServerSettings(serving=ServingSettings(stopped=True)))
    assert "stopped" in anthropic_error(
        await rig.call("POST", COUNT, body), 503, "overloaded_error"
    )


async def test_count_tokens_asks_only_a_replica_of_the_model_itself(rig: Rig) -> None:
    # 'elsewhere' has no replica; its fallback's tokenizer is another model's.
    got = await rig.call("POST", COUNT, {"model": "elsewhere", "messages": ASK})
    anthropic_error(got, 503, "overloaded_error")
    assert got.headers[b"retry-after"] == b"5"


async def test_count_tokens_when_the_replica_fails(rig: Rig) -> None:
    body = {"model": "sim-model", "messages": ASK}
    endpoint = rig.cluster.endpoints["sim-model"][0]
    endpoint.api_key = "not-the-engine-key"
    anthropic_error(await rig.call("POST", COUNT, body), 502, "api_error")
    endpoint.port = 1  # nothing listens there
    assert "did not answer" in anthropic_error(
        await rig.call("POST", COUNT, body), 502, "api_error"
    )


async def test_count_tokens_is_refused_for_a_model_of_an_outside_provider(rig: Rig) -> None:
    outside = ModelRecord(
        name="outside",
        external=External(url="https://api.example.com", model="gpt-x", api_key_files=()),
    )
    rig.cluster.replace_catalog({**rig.cluster.models, "outside": outside})
    got = await rig.call("POST", COUNT, {"model": "outside", "messages": ASK})
    assert "outside provider" in anthropic_error(got, 400, "invalid_request_error")


async def test_every_error_on_an_anthropic_path_is_in_anthropics_shape(rig: Rig) -> None:
    message = {"model": "sim-model", "max_tokens": 2, "messages": ASK}
    anthropic_error(
        await rig.call("POST", "/v1/messages", message, headers=[]), 401, "authentication_error"
    )
    anthropic_error(await rig.call("GET", "/v1/messages"), 405, "invalid_request_error")
    anthropic_error(await rig.call("POST", "/v1/messages/batches", message), 404, "not_found_error")
    anthropic_error(await rig.call("GET", "/v1/messages/msg_1"), 404, "not_found_error")
    anthropic_error(
        await rig.call_raw("POST", "/v1/messages", b"[1,"), 400, "invalid_request_error"
    )
    anthropic_error(
        await rig.call("POST", "/v1/messages", {**message, "max_tokens": 10**6}),
        400,
        "invalid_request_error",
    )
    # Not Anthropic's: OpenAI's shape.
    assert (await rig.call("POST", "/v1/messagesx", message)).json()["error"]["code"] == (
        "unknown_url"
    )
    assert (await rig.call("GET", "/v1/models/x")).json()["error"]["code"] == "unknown_url"
    # The engine refusing the gateway's key is the gateway's failure: 502.
    endpoint = rig.cluster.endpoints["sim-model"][0]
    endpoint.api_key = "not-the-engine-key"
    anthropic_error(await rig.call("POST", "/v1/messages", message), 502, "api_error")
    endpoint.port = 1
    anthropic_error(await rig.call("POST", "/v1/messages", message), 502, "api_error")
    rig.cluster.set_fixed_endpoints({})
    anthropic_error(await rig.call("POST", "/v1/messages", message), 503, "overloaded_error")
    rig.cluster.apply_settings(ServerSettings(serving=ServingSettings(stopped=True)))
    for path in ("/v1/messages", COUNT, "/v1/messages/batches"):
        anthropic_error(await rig.call("POST", path, message), 503, "overloaded_error")


async def test_an_engines_own_error_is_passed_on_in_anthropics_shape(rig: Rig) -> None:
    failing = SimEngine(
        SimConfig(model="sim-model", fail_rate=1.0, fail_status=500, tick_ms=0),
        api_key=ENGINE_KEY,
    )
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, failing, "127.0.0.1:0", stop, 1.0)
        rig.cluster.endpoints["sim-model"][0].port = int(address.rsplit(":", 1)[1])
        got = await rig.call(
            "POST", "/v1/messages", {"model": "sim-model", "max_tokens": 2, "messages": ASK}
        )
        assert "simulated failure" in anthropic_error(got, 500, "api_error")
        stop.set()


async def test_a_gateway_fault_is_a_500_in_the_paths_shape() -> None:
    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("a bug")

    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, broken, "127.0.0.1:0", stop, 1.0)
        port = int(address.rsplit(":", 1)[1])
        for path, anthropic_shaped in (("/v1/messages", True), ("/v1/chat/completions", False)):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".encode()
                )
                data = b""
                with trio.fail_after(10):
                    while b"}" not in data.partition(b"\r\n\r\n")[2][-2:]:
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            break
                        data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 500"), head
            doc = orjson.loads(body)
            if anthropic_shaped:
                assert doc == {
                    "type": "error",
                    "error": {"type": "api_error", "message": "internal error"},
                }
            else:
                assert doc["error"]["code"] == "internal_error"
        stop.set()


async def _exchange(port: int, head: str) -> bytes:
    """Send request heads (the last with ``connection: close``); every byte answered, to EOF."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head.encode())
        data = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                data += chunk
    return data


def _status_and_headers(data: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


async def test_head_is_answered_with_gets_status_and_headers_and_no_body(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, rig.gateway, "127.0.0.1:0", stop, 1.0)
        port = int(address.rsplit(":", 1)[1])
        key = f"authorization: Bearer {rig.secret}\r\n"
        for path in ("/health", "/ready", "/leader", "/v1/models"):
            request = f"{{}} {path} HTTP/1.1\r\nhost: x\r\n{key}connection: close\r\n\r\n"
            got_status, got_headers, got_body = _status_and_headers(
                await _exchange(port, request.format("GET"))
            )
            head_status, head_headers, head_body = _status_and_headers(
                await _exchange(port, request.format("HEAD"))
            )
            assert got_status.startswith(b"HTTP/1.1 200"), (path, got_status)
            assert int(got_headers[b"content-length"]) == len(got_body) > 0
            got_headers.pop(b"date", None)
            head_headers.pop(b"date", None)
            assert (head_status, head_headers) == (got_status, got_headers), path
            assert head_body == b"", path
        # On one kept-alive connection a HEAD's answer leaves the next answer whole.
        data = await _exchange(
            port,
            "HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n"
            "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        first, _, rest = data.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200")
        assert rest.startswith(b"HTTP/1.1 200")
        assert rest.endswith(b'\r\n\r\n{"status":"ok"}')
        stop.set()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_an_engine_without_a_key_is_sent_no_authorization_header(rig: Rig) -> None:
    keyless = SimEngine(SimConfig(model="sim-model", tokens=3, tokens_per_second=0, tick_ms=0))
    seen: list[list[tuple[bytes, bytes]]] = []

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(list(scope["headers"]))
        await keyless(scope, receive, send)

    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        address = await nursery.start(serve_http1, recording, "127.0.0.1:0", stop, 1.0)
        endpoint = rig.cluster.endpoints["sim-model"][0]
        endpoint.port = int(address.rsplit(":", 1)[1])
        for no_key in ("", " "):
            endpoint.api_key = no_key
            for path, body in (
                ("/v1/chat/completions", {"model": "sim", "messages": ASK, "max_tokens": 2}),
                ("/v1/messages", {"model": "sim-model", "messages": ASK, "max_tokens": 2}),
                ("/v1/messages/count_tokens", {"model": "sim-model", "messages": ASK}),
            ):
                got = await rig.call("POST", path, body)
                assert got.status == 200, (path, got.body)
            assert endpoint.auth_headers == []
        stop.set()
    assert len(seen) >= 6
    assert all(name != b"authorization" for headers in seen for name, _ in headers)


@pytest.mark.parametrize("path", ["/health", "/ready", "/leader", "/v1/models"])
@pytest.mark.parametrize("method", ["POST", "TRACE", "DELETE", "PUT"])
async def test_the_get_routes_refuse_other_methods_with_allow(
    rig: Rig, path: str, method: str
) -> None:
    # Found by schemathesis (tests/e2e/test_openapi.py): /health, /ready and
    # /leader answered 200 to any method; a 405's Allow left out HEAD.
    got = await rig.call(method, path)
    assert got.status == 405, got.body
    assert got.headers[b"allow"] == b"GET, HEAD"
    assert got.json()["error"]["code"] == "method_not_allowed"


# --- the attempt's deadlines: the first byte's, then the generation's ---------------


async def _slow_sim(rig: Rig, nursery: trio.Nursery, stop: trio.Event, **config: Any) -> None:
    """The rig's replica moved to a sim engine of its own, ``config`` (SimConfig)."""
    sim = SimEngine(SimConfig(model="sim-model", tick_ms=0, **config), api_key=ENGINE_KEY)
    address = await nursery.start(serve_http1, sim, "127.0.0.1:0", stop, 1.0)
    rig.cluster.endpoints["sim-model"][0].port = int(address.rsplit(":", 1)[1])


def _timeouts(rig: Rig, **seconds: float) -> None:
    from llmgw.settings import TimeoutSettings

    rig.cluster.apply_settings(
        ServerSettings(router=RouterSettings(timeouts=TimeoutSettings(**seconds)))
    )


async def test_a_replica_without_a_first_byte_in_time_is_502_and_recorded(rig: Rig) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await _slow_sim(rig, nursery, stop, tokens=3, ttft_ms=5000)
        _timeouts(rig, first_byte=0.2)
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
        with trio.fail_after(30):
            # Not streamed: the sim sends the head once the answer is done.
            got = await rig.call("POST", "/v1/chat/completions", body)
        assert got.status == 502, got.body
        assert got.json()["error"]["code"] == "upstream_error"
        row = await rig.row(got.headers[b"x-request-id"])
        assert row.status == 502
        stop.set()


async def test_a_generation_over_its_deadline_is_cut_with_a_504_row_and_the_next_is_served(
    rig: Rig,
) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await _slow_sim(rig, nursery, stop, tokens=200, tokens_per_second=20)
        _timeouts(rig, first_byte=20, generation=0.5)
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
        started = trio.current_time()
        with trio.fail_after(30):
            got = await rig.call("POST", "/v1/chat/completions", {**body, "stream": True})
        assert trio.current_time() - started < 8  # not the 10 s the whole answer takes
        assert got.status == 200
        assert b'"content":"tok0 "' in got.body
        assert not got.body.endswith(b"data: [DONE]\n\n")
        row = await rig.row(got.headers[b"x-request-id"])
        assert row.status == 504
        assert 0 < row.completion_tokens < 200
        # A fast answer within the same deadlines is whole.
        _timeouts(rig, first_byte=5, generation=30)
        with trio.fail_after(30):
            whole = await rig.call("POST", "/v1/chat/completions", {**body, "max_tokens": 3})
        assert whole.status == 200
        assert (await rig.row(whole.headers[b"x-request-id"])).status == 200
        stop.set()

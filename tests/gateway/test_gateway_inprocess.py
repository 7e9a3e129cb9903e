"""The gateway built in-process and called as an ASGI app in memory (no
socket to the gateway), in front of the sim engine served in the same trio
run, over a real catalog, store, accountant and ``Cluster``."""

from __future__ import annotations

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
from llmgw.store.records import Limits

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

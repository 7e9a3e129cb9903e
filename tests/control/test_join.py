"""The join port over real TLS on loopback: join codes, the routes, each refusal."""

from __future__ import annotations

import hashlib
import logging
import ssl
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw import errors
from llmgw.agent import protocol
from llmgw.agent.join import JoinFailed, join_cluster
from llmgw.agent.joincode import JoinCode
from llmgw.control.ca import ClusterCA
from llmgw.control.cluster import Cluster
from llmgw.control.join import (
    MAX_BODY_BYTES,
    JoinService,
    hub_urls,
    reachable_hosts,
    serve_join,
)
from llmgw.store import NodeCertificate, Store, open_sqlite_store


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@attrs.define
class Port:
    service: JoinService
    store: Store
    cluster: Cluster
    clock: Clock
    ca: ClusterCA
    url: str

    def trusting(self) -> httpx.AsyncClient:
        ctx = ssl.create_default_context(cadata=self.ca.ca_pem.decode())
        return httpx.AsyncClient(base_url=self.url, verify=ctx, timeout=10)

    async def code(self, **kw: Any) -> JoinCode:
        made = await self.service.make_code(expires_s=kw.pop("expires_s", 600), **kw)
        return JoinCode.decode(made.code)

    async def join(self, token: str, node_id: str = "node-b", csr: str | None = None) -> Any:
        async with self.trusting() as client:
            response = await client.post(
                "/v1/join",
                json={"token": token, "csr_pem": csr or make_csr()[1], "node_id": node_id},
            )
        return response.status_code, response.json()


def make_csr() -> tuple[ec.EllipticCurvePrivateKey, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM).decode()


@pytest.fixture
async def port(tmp_path: Path) -> AsyncIterator[Port]:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        ca = ClusterCA.load_or_create(tmp_path / "ca", [])
        cluster = Cluster()
        clock = Clock()
        service = JoinService(
            ca, store, cluster, servers=["wss://127.0.0.1:7443/agent"], clock=clock
        )
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_join, "127.0.0.1", 0, service)
            yield Port(service, store, cluster, clock, ca, f"https://127.0.0.1:{bound}")
            nursery.cancel_scope.cancel()


async def test_the_ca_and_the_time_are_served_to_anyone(port: Port) -> None:
    # No trust yet: what a node does before it checks the fingerprint.
    async with httpx.AsyncClient(base_url=port.url, verify=False, timeout=10) as client:
        ca = (await client.get("/v1/join/ca")).json()
        time_doc = (await client.get("/v1/join/time")).json()
    assert ca == {"ca_pem": port.ca.ca_pem.decode(), "fingerprint": port.ca.fingerprint}
    assert isinstance(time_doc["time_s"], float)


async def test_a_code_carries_the_listeners_address_the_token_and_the_fingerprint(
    port: Port,
) -> None:
    made = await port.service.make_code(expires_s=600, labels={"rack": "r1"})
    code = JoinCode.decode(made.code)
    assert code.addresses == (port.url.removeprefix("https://"),)
    assert code.fingerprint == port.ca.fingerprint
    assert made.expires_at == port.clock.now + 600
    stored = await port.store.get_join_token(hashlib.sha256(code.token.encode()).hexdigest())
    assert stored is not None
    assert stored.labels == {"rack": "r1"}
    assert code.token not in repr(stored)  # kept hashed only


async def test_a_node_joins_once_and_gets_a_certificate_naming_it(port: Port) -> None:
    code = await port.code(labels={"gpu": "h100"})
    key, csr = make_csr()
    status, doc = await port.join(code.token, "node-b", csr)
    assert status == 200, doc
    assert doc["node_id"] == "node-b"
    assert doc["servers"] == ["wss://127.0.0.1:7443/agent"]
    assert doc["ca_pem"] == port.ca.ca_pem.decode()
    assert doc["labels"] == {"gpu": "h100"}
    cert = x509.load_pem_x509_certificate(doc["cert_pem"].encode())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-b"
    assert cert.public_key() == key.public_key()
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(port.ca.ca_pem))
    stored = await port.store.get_node_certificate(format(cert.serial_number, "x"))
    assert stored is not None
    assert (stored.node_id, stored.revoked_at) == ("node-b", None)

    status, doc = await port.join(code.token, "node-c")
    assert status == 410
    assert doc["error"]["code"] == "join_code_used"
    assert "already used at" in doc["error"]["message"]


async def test_the_codes_node_id_wins_over_the_one_asked(port: Port) -> None:
    code = await port.code(node_id="gpu-7")
    status, doc = await port.join(code.token, "whatever-host")
    assert status == 200, doc
    assert doc["node_id"] == "gpu-7"


async def test_an_expired_code_is_refused_as_expired(port: Port) -> None:
    code = await port.code(expires_s=60)
    port.clock.now += 60
    status, doc = await port.join(code.token)
    assert status == 410
    assert doc["error"]["code"] == "join_code_expired"
    assert "expired at" in doc["error"]["message"]


async def test_a_forged_code_is_refused_as_unknown(port: Port) -> None:
    await port.code()
    status, doc = await port.join("made-up-token")
    assert status == 403
    assert doc["error"]["code"] == "join_code_unknown"
    assert "not one of this cluster's" in doc["error"]["message"]


async def test_a_bad_request_is_refused_and_the_code_stays_usable(port: Port) -> None:
    code = await port.code()
    status, doc = await port.join(code.token, csr="-----BEGIN CERTIFICATE REQUEST-----\nxx\n")
    assert status == 400
    assert "not a PEM PKCS#10 request" in doc["error"]["message"]
    status, doc = await port.join(code.token, node_id="bad/id")
    assert status == 400
    assert "node id 'bad/id' is not valid" in doc["error"]["message"]
    async with port.trusting() as client:
        response = await client.post("/v1/join", json={"csr_pem": "x"})
        assert response.status_code == 400
        assert "token is missing" in response.json()["error"]["message"]
        response = await client.post("/v1/join", content=b"{nope")
        assert response.status_code == 400
    status, doc = await port.join(code.token)
    assert status == 200, doc


async def test_a_node_id_of_a_connected_node_with_a_valid_certificate_is_taken(
    port: Port,
) -> None:
    first = await port.code()
    status, doc = await port.join(first.token, "node-b")
    assert status == 200
    serial = format(x509.load_pem_x509_certificate(doc["cert_pem"].encode()).serial_number, "x")

    async def send(_: protocol.Message) -> None:
        pass

    port.cluster.node_registered(
        protocol.Register(
            node_id="node-b",
            address="127.0.0.1",
            agent_version="test",
            hardware=protocol.Hardware(cpu_count=2, memory_total_mb=1024),
        ),
        send,
    )
    second = await port.code()
    status, doc = await port.join(second.token, "node-b")
    assert status == 409
    assert doc["error"]["code"] == "node_id_taken"
    assert (
        f"node 'node-b' is connected now with a valid certificate (serial {serial})"
        in (doc["error"]["message"])
    )
    # The code was not spent: it works for another id.
    status, doc = await port.join(second.token, "node-c")
    assert status == 200


async def test_joining_again_under_a_node_id_revokes_its_earlier_certificates(
    port: Port,
) -> None:
    await port.store.insert_node_certificate(
        NodeCertificate("0abc", "node-b", port.clock.now - 10, port.clock.now + 1000)
    )
    code = await port.code()
    status, _ = await port.join(code.token, "node-b")
    assert status == 200
    old = await port.store.get_node_certificate("0abc")
    assert old is not None
    assert old.revoked_at == port.clock.now
    assert len(await port.store.list_node_certificates("node-b")) == 2


async def test_other_routes_methods_and_large_bodies_are_refused(port: Port) -> None:
    async with port.trusting() as client:
        assert (await client.get("/v1/nothing")).status_code == 404
        assert (await client.get("/v1/join")).status_code == 405
        assert (await client.post("/v1/join/ca")).status_code == 405
        big = await client.post("/v1/join", content=b"x" * (MAX_BODY_BYTES + 1))
        assert big.status_code == 413


async def test_a_client_that_never_speaks_does_not_stop_others(port: Port) -> None:
    host, bound = port.url.removeprefix("https://").rsplit(":", 1)
    idle = await trio.open_tcp_stream(host, int(bound))
    try:
        async with port.trusting() as client:
            assert (await client.get("/v1/join/ca")).status_code == 200
    finally:
        await idle.aclose()


async def test_codes_are_checked_before_anything_is_kept(port: Port) -> None:
    with pytest.raises(errors.InvalidInput, match="expires_s must be from 1"):
        await port.service.make_code(expires_s=0)
    with pytest.raises(errors.InvalidInput, match="label name 'bad name' is not valid"):
        await port.service.make_code(expires_s=60, labels={"bad name": "x"})
    with pytest.raises(errors.InvalidInput, match="node id"):
        await port.service.make_code(expires_s=60, node_id="-x")


def test_reachable_hosts_put_advertised_names_first_and_loopback_last() -> None:
    assert reachable_hosts("127.0.0.1", []) == ["127.0.0.1"]
    assert reachable_hosts("10.0.0.5", ["gw.example"]) == ["gw.example", "10.0.0.5"]
    found = reachable_hosts("0.0.0.0", ["gw.example"])
    assert found[0] == "gw.example"
    assert all(":" not in h for h in found)  # an IPv4 listener: no IPv6 address
    assert hub_urls(["10.0.0.5", "fd00::1"], 7443) == [
        "wss://10.0.0.5:7443/agent",
        "wss://[fd00::1]:7443/agent",
    ]


async def test_a_node_refuses_a_certificate_that_does_not_name_the_address_dialled(
    tmp_path: Path,
) -> None:
    """The join port at 127.0.0.2, which the certificate does not name (no --advertise)."""
    async with open_sqlite_store(tmp_path / "s.db") as store:
        ca = ClusterCA.load_or_create(tmp_path / "ca", [])
        service = JoinService(ca, store, Cluster(), servers=[])
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_join, "127.0.0.2", 0, service)
            made = await service.make_code(expires_s=60)
            assert service.addresses == (f"127.0.0.2:{bound}",)
            with pytest.raises(JoinFailed) as refused:
                await trio.to_thread.run_sync(
                    partial(
                        join_cluster, JoinCode.decode(made.code), tmp_path / "node", node_id="n"
                    )
                )
            nursery.cancel_scope.cancel()
    assert str(refused.value).startswith(
        f"the control plane at 127.0.0.2:{bound} presents a certificate that does not verify "
        "for 127.0.0.2"
    )
    assert str(refused.value).endswith("start it with --advertise 127.0.0.2")
    assert not (tmp_path / "node" / "agent.yaml").exists()


async def test_the_join_port_s_log_lists_the_addresses_codes_carry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As ``HOST:PORT, HOST:PORT``, not a Python tuple."""
    caplog.set_level(logging.INFO, logger="llmgw.control")
    async with open_sqlite_store(tmp_path / "s.db") as store:
        ca = ClusterCA.load_or_create(tmp_path / "ca", [])
        service = JoinService(ca, store, Cluster(), servers=["wss://127.0.0.1:7443/agent"])
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(serve_join, "127.0.0.1", 0, service)
            nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records]
    assert f"join port on 127.0.0.1:{bound} (codes carry 127.0.0.1:{bound})" in said, said
    issued = [line for line in said if line.startswith("issued the control plane's certificate")]
    assert issued, said
    assert issued[0].startswith("issued the control plane's certificate (there was none) for ")


async def test_a_control_plane_of_another_ca_is_refused_saying_what_to_do(
    port: Port, tmp_path: Path
) -> None:
    made = await port.service.make_code(expires_s=60)
    real = JoinCode.decode(made.code)
    wrong = JoinCode(real.addresses, real.token, "sha256:" + "0" * 64)
    with pytest.raises(JoinFailed) as refused:
        await trio.to_thread.run_sync(partial(join_cluster, wrong, tmp_path / "node", node_id="n"))
    said = str(refused.value)
    assert f"but this code was made for sha256:{'0' * 64}" in said
    assert said.endswith(
        "run `llmgw node add` on the control plane this node should join and use the line it prints"
    ), said

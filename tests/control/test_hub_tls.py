"""The agents' hub with mutual TLS, over real TLS and real websockets on
loopback: the agent's certificate from the cluster CA admits it under the
certificate's node id; a self-made, unknown or revoked certificate, another
cluster's control plane and a Register naming another node are refused,
each saying why; the agent learns the control planes' list and tries each."""

from __future__ import annotations

import gc
import json
import logging
import socket
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import cast

import attrs
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw import errors
from llmgw.agent import protocol, session
from llmgw.agent.config import TlsFiles, agent_ssl_context
from llmgw.agent.link import CONTROL_PLANES_FILE, AgentHandlers, ServerList, serve_link
from llmgw.control.ca import ClusterCA
from llmgw.control.cluster import Cluster
from llmgw.control.hub import HubTLS, serve_agent_hub, serve_standby_links
from llmgw.store import NodeCertificate, Store, open_sqlite_store

HARDWARE = protocol.Hardware(cpu_count=2, memory_total_mb=1024)

pytestmark = [
    # trio-websocket leaves the client socket of a link the server closed
    # to the garbage collector.
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _register(node_id: str) -> protocol.Register:
    return protocol.Register(
        node_id=node_id,
        address="127.0.0.1",
        interface="lo",
        agent_version="test",
        hardware=HARDWARE,
    )


def _node_files(folder: Path, ca: ClusterCA | None, node_id: str) -> tuple[TlsFiles, str]:
    """A node key and certificate under ``folder`` (issued by ``ca``, or
    self-made when ``ca`` is None), with ``ca``'s certificate as the
    node's CA; the certificate's serial."""
    folder.mkdir(parents=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)])
    if ca is not None:
        csr = x509.CertificateSigningRequestBuilder().subject_name(name).sign(key, hashes.SHA256())
        issued = ca.issue(csr.public_bytes(serialization.Encoding.PEM), node_id)
        pem, serial = issued.pem, issued.serial
    else:
        now = time.time()
        import datetime as dt

        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(dt.datetime.fromtimestamp(now - 60, dt.UTC))
            .not_valid_after(dt.datetime.fromtimestamp(now + 3600, dt.UTC))
            .sign(key, hashes.SHA256())
        )
        pem, serial = cert.public_bytes(serialization.Encoding.PEM), format(cert.serial_number, "x")
    (folder / "node.crt").write_bytes(pem)
    (folder / "node.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return TlsFiles(ca=folder / "ca.crt", cert=folder / "node.crt", key=folder / "node.key"), serial


@attrs.define
class Setup:
    tmp: Path
    ca: ClusterCA
    store: Store
    cluster: Cluster

    async def node(
        self, node_id: str, *, record: bool = True, ca: ClusterCA | None = None
    ) -> TlsFiles:
        """TLS files of a node issued by this cluster (kept in its store
        when ``record``), or by ``ca``; the node trusts this cluster's CA."""
        issuer = self.ca if ca is None else ca
        files, serial = _node_files(self.tmp / f"node-{node_id}-{id(issuer)}", issuer, node_id)
        files.ca.write_bytes(self.ca.ca_pem)
        if record and ca is None:
            now = time.time()
            await self.store.insert_node_certificate(
                NodeCertificate(serial=serial, node_id=node_id, issued_at=now, not_after=now + 3600)
            )
        return files

    async def hub(self, nursery: trio.Nursery, hosts: tuple[str, ...] = ("127.0.0.1",)) -> str:
        tls = HubTLS(
            context=self.ca.server_ssl_context(client_certs=True), store=self.store, hosts=hosts
        )
        port = await nursery.start(
            partial(serve_agent_hub, "127.0.0.1", 0, "", self.cluster, tls=tls)
        )
        return f"wss://127.0.0.1:{port}/agent"


@pytest.fixture(autouse=True)
def _collect_refused_sockets() -> Iterator[None]:
    """The sockets of refused links trio-websocket leaves to the garbage
    collector are collected here, not in a later test."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture(name="setup")
async def setup_fixture(tmp_path: Path) -> AsyncIterator[Setup]:
    ca = ClusterCA.load_or_create(tmp_path / "ca", ["127.0.0.1", "localhost"])
    async with open_sqlite_store(tmp_path / "llmgw.db") as store:
        yield Setup(tmp=tmp_path, ca=ca, store=store, cluster=Cluster())


async def _refusal(url: str, files: TlsFiles, node_id: str) -> str:
    """What the agent's end says when the control plane refuses it."""
    with pytest.raises(session.PeerRefused) as refused:  # noqa: PT012
        async with session.connect(
            url, "", partial(_async, _register(node_id)), ssl_context=agent_ssl_context(files)
        ) as link:
            while True:
                await link.receive()
    return str(refused.value)


async def _async(value: protocol.Register) -> protocol.Register:
    return value


async def test_a_node_with_its_certificate_registers_under_the_certificate_s_node_id(
    setup: Setup,
) -> None:
    files = await setup.node("node-b")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery, hosts=("127.0.0.1", "10.9.9.9"))
            async with session.connect(
                url, "", partial(_async, _register("node-b")), ssl_context=agent_ssl_context(files)
            ) as link:
                assert await link.receive() == protocol.Registered(node_id="node-b")
                planes = await link.receive()
                port = url.split(":")[2].split("/")[0]
                assert planes == protocol.ControlPlanes(
                    urls=(f"wss://127.0.0.1:{port}/agent", f"wss://10.9.9.9:{port}/agent")
                )
                node = setup.cluster.nodes["node-b"]
                assert node.connected
                assert (node.address, node.interface) == ("127.0.0.1", "lo")
            nursery.cancel_scope.cancel()


async def test_a_self_made_certificate_fails_the_handshake_and_the_agent_says_it_was_refused(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    files, _ = _node_files(setup.tmp / "self", None, "node-b")
    files.ca.write_bytes(setup.ca.ca_pem)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            said = await _refusal(url, files, "node-b")
            nursery.cancel_scope.cancel()
    assert "the control plane refused this node's certificate" in said
    assert "join again with a new code" in said
    assert "node-b" not in setup.cluster.nodes
    assert any("TLS handshake failed" in r.getMessage() for r in caplog.records)


async def test_another_cluster_s_certificate_is_refused_in_the_handshake(setup: Setup) -> None:
    other = ClusterCA.load_or_create(setup.tmp / "other-ca", ["127.0.0.1"])
    files = await setup.node("node-b", ca=other)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            said = await _refusal(url, files, "node-b")
            nursery.cancel_scope.cancel()
    assert "the control plane refused this node's certificate" in said


async def test_a_certificate_this_cluster_has_no_record_of_is_refused_saying_so(
    setup: Setup,
) -> None:
    files = await setup.node("node-b", record=False)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            said = await _refusal(url, files, "node-b")
            nursery.cancel_scope.cancel()
    assert (
        "the control plane refused this node: node 'node-b': certificate not issued by this cluster"
        in said
    )
    assert "node-b" not in setup.cluster.nodes


async def test_a_revoked_certificate_is_refused_saying_when_it_was_revoked(setup: Setup) -> None:
    files = await setup.node("node-b")
    assert await setup.store.revoke_node_certificates("node-b", time.time()) == 1
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            said = await _refusal(url, files, "node-b")
            nursery.cancel_scope.cancel()
    assert "the control plane refused this node: node 'node-b': certificate revoked at" in said
    assert "node-b" not in setup.cluster.nodes


async def test_a_register_claiming_another_node_id_is_refused(setup: Setup) -> None:
    files = await setup.node("node-b")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            with pytest.raises(session.PeerRefused):  # noqa: PT012
                async with session.connect(
                    url,
                    "",
                    partial(_async, _register("node-c")),
                    ssl_context=agent_ssl_context(files),
                ) as link:
                    error = await link.receive()
                    assert isinstance(error, protocol.Error)
                    assert "node id mismatch" in error.message
                    assert "certificate is for 'node-b'" in error.message
                    await link.receive()
            nursery.cancel_scope.cancel()
    assert "node-c" not in setup.cluster.nodes
    assert "node-b" not in setup.cluster.nodes


async def test_a_control_plane_of_another_cluster_is_refused_by_the_agent(setup: Setup) -> None:
    files = await setup.node("node-b")
    # The node trusts another CA than the one that signed this hub's certificate.
    other = ClusterCA.load_or_create(setup.tmp / "other-ca", ["127.0.0.1"])
    files.ca.write_bytes(other.ca_pem)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            with pytest.raises(errors.LinkClosed) as closed:
                async with session.connect(
                    url,
                    "",
                    partial(_async, _register("node-b")),
                    ssl_context=agent_ssl_context(files),
                ):
                    pass
            nursery.cancel_scope.cancel()
    assert "the control plane's certificate is not from this node's cluster CA" in str(closed.value)


def _dead_url() -> str:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"wss://127.0.0.1:{sock.getsockname()[1]}/agent"


def _handlers(node_id: str, registered: trio.Event) -> AgentHandlers:
    async def heartbeat() -> protocol.Heartbeat:
        return protocol.Heartbeat(
            node_id=node_id, memory_total_mb=1024, memory_available_mb=512, cpu_count=2
        )

    async def nothing(_: object) -> None:
        return None

    _, receive = trio.open_memory_channel[protocol.ShardStatus](1)
    return AgentHandlers(
        register=partial(_async, _register(node_id)),
        heartbeat=heartbeat,
        start_shard=nothing,
        stop_shard=nothing,
        logs=lambda _source, _lines: [],
        status_events=receive,
        on_registered=lambda _: registered.set(),
    )


async def test_the_agent_tries_each_control_plane_and_keeps_the_leader_s_list(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    files = await setup.node("node-b")
    state = setup.tmp / "state"
    dead = _dead_url()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery, hosts=("127.0.0.1", "10.9.9.9"))
            port = url.split(":")[2].split("/")[0]
            servers = ServerList([dead, url], path=state / CONTROL_PLANES_FILE)
            registered = trio.Event()
            stop = trio.Event()
            nursery.start_soon(
                partial(
                    serve_link,
                    servers,
                    "",
                    _handlers("node-b", registered),
                    stop=stop,
                    ssl_context=agent_ssl_context(files),
                )
            )
            await registered.wait()
            assert setup.cluster.nodes["node-b"].connected
            # The leader's list is kept, after those given (a file: nothing to wait on).
            while not (state / CONTROL_PLANES_FILE).exists():  # noqa: ASYNC110
                await trio.sleep(0.05)
            stop.set()
            while setup.cluster.nodes["node-b"].connected:
                await setup.cluster.changed.wait()
            nursery.cancel_scope.cancel()
    kept = json.loads((state / CONTROL_PLANES_FILE).read_text())
    assert kept == {"urls": [f"wss://127.0.0.1:{port}/agent", f"wss://10.9.9.9:{port}/agent"]}
    assert ServerList([dead], path=state / CONTROL_PLANES_FILE).urls() == [
        dead,
        url,
        f"wss://10.9.9.9:{port}/agent",
    ]
    tried = [
        r.getMessage() for r in caplog.records if "cannot reach the control plane" in r.getMessage()
    ]
    assert tried, "the dead control plane was not tried first"
    assert f"trying {url}" in tried[0]


class _StoreDown:
    """A store that cannot be asked."""

    async def get_node_certificate(self, serial: str) -> NodeCertificate | None:
        raise errors.StoreError(f"database is locked (asked for {serial})")


async def test_a_store_that_cannot_be_asked_refuses_the_link_for_now_and_the_hub_stays(
    setup: Setup,
) -> None:
    files = await setup.node("node-b")
    tls = HubTLS(
        context=setup.ca.server_ssl_context(client_certs=True),
        store=cast(Store, _StoreDown()),
        hosts=("127.0.0.1",),
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                partial(serve_agent_hub, "127.0.0.1", 0, "", setup.cluster, tls=tls)
            )
            url = f"wss://127.0.0.1:{port}/agent"
            for _ in range(2):  # the hub is still there for the next try
                said = await _refusal(url, files, "node-b")
                assert "cannot check this node's certificate now" in said
            nursery.cancel_scope.cancel()


async def test_doctor_finds_a_revoked_certificate_refused_with_the_hub_s_reason(
    setup: Setup,
) -> None:
    """The hub checks the certificate before it answers anything: a plain
    ``GET /agent`` (doctor's) with a revoked certificate gets 403 and the
    reason, not the 400 of a request that does not upgrade."""
    from llmgw.agent import doctor

    files = await setup.node("node-b")
    good = await setup.node("node-c")
    assert await setup.store.revoke_node_certificates("node-b", time.time()) == 1
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            port = int(url.split(":")[2].split("/")[0])
            cp = doctor.ControlPlane("127.0.0.1", port)
            results = []
            for tls in (files, good):
                context = doctor.client_ssl_context(tls.ca, tls.cert, tls.key)
                results.append(
                    await doctor.check_reachable(
                        cp, port, context, ca_file=tls.ca, client_cert=True
                    )
                )
            nursery.cancel_scope.cancel()
    revoked, accepted = results
    assert revoked.status == "fail", revoked
    assert "refused this node's certificate (HTTP/1.1 403 Forbidden: node 'node-b': " in (
        revoked.found
    )
    assert "certificate revoked at" in revoked.found
    assert accepted.status == "ok", accepted


async def test_an_agent_whose_certificate_was_revoked_stops_its_engines_and_retries_slowly(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A node removed while its agent was offline: when the agent comes back
    the hub refuses its revoked certificate (403); the agent stops its
    engines (they would hold their ports and memory for nothing), says so,
    and asks again only at the back-off's maximum."""
    files = await setup.node("node-b")
    assert await setup.store.revoke_node_certificates("node-b", time.time()) == 1
    stops: list[float] = []

    async def stop_engines() -> int:
        stops.append(trio.current_time())
        return 2 if len(stops) == 1 else 0

    async def register() -> protocol.Register:
        return _register("node-b")

    async def heartbeat() -> protocol.Heartbeat:
        return protocol.Heartbeat(
            node_id="node-b", memory_total_mb=1024, memory_available_mb=512, cpu_count=2
        )

    async def nothing(_: object) -> None:
        return None

    _, receive = trio.open_memory_channel[protocol.ShardStatus](1)
    handlers = AgentHandlers(
        register=register,
        heartbeat=heartbeat,
        start_shard=nothing,
        stop_shard=nothing,
        logs=lambda _source, _lines: [],
        status_events=receive,
        stop_engines=stop_engines,
    )
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await setup.hub(nursery)
            await nursery.start(
                partial(serve_link, url, "", handlers, ssl_context=agent_ssl_context(files))
            )
            await trio.sleep(4)  # the old back-off asked again within 1 s, then 2 s
            nursery.cancel_scope.cancel()
    assert len(stops) == 1
    said = [r.getMessage() for r in caplog.records if r.name == "llmgw.agent.link"]
    assert any(
        "certificate revoked at" in line
        and "stopped its 2 engine(s); this node is not in the cluster" in line
        and "trying again in 15 s" in line
        for line in said
    ), said


async def test_a_standby_refuses_the_agent_naming_the_leader_and_the_agent_fails_over(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """Two control planes of one store: the agent, refused by the standby,
    links to the leader at once; when the leader goes and the standby
    leads, the agent links to it."""
    caplog.set_level(logging.INFO)
    files = await setup.node("node-b")
    leader, standby = Cluster(), Cluster()
    leader.set_leader(True)
    tls = HubTLS(context=setup.ca.server_ssl_context(client_certs=True), store=setup.store)
    registered: list[trio.Event] = [trio.Event(), trio.Event()]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            port_s = await nursery.start(
                partial(
                    serve_agent_hub,
                    "127.0.0.1",
                    0,
                    "",
                    standby,
                    tls=tls,
                    standby_hint=lambda: "the leader is at wss://leader.example:7443/agent",
                )
            )
            leader_scope = trio.CancelScope()

            async def leader_hub(*, task_status: trio.TaskStatus[int]) -> None:
                with leader_scope:
                    await serve_agent_hub(
                        "127.0.0.1",
                        0,
                        "",
                        leader,
                        tls=tls,
                        standby_hint=lambda: "",
                        task_status=task_status,
                    )

            port_l = await nursery.start(leader_hub)
            standby_url = f"wss://127.0.0.1:{port_s}/agent"
            servers = ServerList([standby_url, f"wss://127.0.0.1:{port_l}/agent"])
            handlers = _handlers("node-b", registered[0])
            handlers.on_registered = lambda _: next(e for e in registered if not e.is_set()).set()
            nursery.start_soon(
                partial(serve_link, servers, "", handlers, ssl_context=agent_ssl_context(files))
            )
            await registered[0].wait()
            assert leader.nodes["node-b"].connected
            assert "node-b" not in standby.nodes
            said = [r.getMessage() for r in caplog.records if "standby" in r.getMessage()]
            assert any("wss://leader.example:7443/agent" in m for m in said), said
            # The leader goes away; the standby leads.
            leader_scope.cancel()
            standby.set_leader(True)
            await registered[1].wait()
            assert standby.nodes["node-b"].connected
            nursery.cancel_scope.cancel()


async def test_a_leader_that_stops_leading_sends_its_agents_to_the_new_one(
    setup: Setup,
) -> None:
    files = await setup.node("node-c")
    first, second = Cluster(), Cluster()
    first.set_leader(True)
    tls = HubTLS(context=setup.ca.server_ssl_context(client_certs=True), store=setup.store)
    registered: list[trio.Event] = [trio.Event(), trio.Event()]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            ports = []
            for cluster in (first, second):
                ports.append(
                    await nursery.start(
                        partial(
                            serve_agent_hub,
                            "127.0.0.1",
                            0,
                            "",
                            cluster,
                            tls=tls,
                            standby_hint=lambda: "no leader is known yet",
                        )
                    )
                )
                await nursery.start(serve_standby_links, cluster)
            servers = ServerList([f"wss://127.0.0.1:{p}/agent" for p in ports])
            handlers = _handlers("node-c", registered[0])
            handlers.on_registered = lambda _: next(e for e in registered if not e.is_set()).set()
            nursery.start_soon(
                partial(serve_link, servers, "", handlers, ssl_context=agent_ssl_context(files))
            )
            await registered[0].wait()
            assert first.nodes["node-c"].connected
            # The lease moves: the first stops leading, the second leads.
            second.set_leader(True)
            first.set_leader(False)
            await registered[1].wait()
            assert second.nodes["node-c"].connected
            while first.nodes["node-c"].connected:
                await first.changed.wait()
            nursery.cancel_scope.cancel()

"""A node's agent.yaml: its shape, unknown keys refused with their path,
relative paths resolved against its folder, the node id from the
certificate; and the address and interface the agent reports."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.agent import discovery
from llmgw.agent.config import AgentFileError, agent_config, load_agent_yaml
from llmgw.control.ca import ClusterCA


def _joined(folder: Path, node_id: str = "node-b") -> Path:
    """A data directory as ``llmgw join`` leaves it: agent.yaml and tls/."""
    ca = ClusterCA.load_or_create(folder / "cp-ca", ["127.0.0.1"])
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    issued = ca.issue(csr.public_bytes(serialization.Encoding.PEM), node_id)
    tls = folder / "node" / "tls"
    tls.mkdir(parents=True)
    (tls / "ca.crt").write_bytes(ca.ca_pem)
    (tls / "node.crt").write_bytes(issued.pem)
    (tls / "node.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path = folder / "node" / "agent.yaml"
    path.write_text(
        "servers: [wss://10.0.0.1:7443/agent, wss://cp.example:7443/agent]\n"
        "tls: {ca: tls/ca.crt, cert: tls/node.crt, key: tls/node.key}\n"
        "labels: {rack: r1}\n"
    )
    return path


def test_a_joined_node_s_file_gives_mutual_tls_and_the_certificate_s_node_id(
    tmp_path: Path,
) -> None:
    path = _joined(tmp_path)
    loaded = load_agent_yaml(path)
    folder = path.parent
    assert loaded.tls.cert == folder / "tls" / "node.crt"
    assert loaded.tls.ca == folder / "tls" / "ca.crt"
    assert loaded.state_dir == folder / "agent"
    config = agent_config(loaded)
    assert config.server_url == "wss://10.0.0.1:7443/agent"
    assert config.servers == ("wss://cp.example:7443/agent",)
    assert config.node_id == "node-b"
    assert config.token == ""
    assert config.labels == {"rack": "r1"}
    assert config.ssl_context is not None
    assert config.ssl_context.verify_mode is ssl.CERT_REQUIRED
    assert config.ssl_context.check_hostname


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ("tls: {ca: tls/ca.crt, cert: tls/node.crt, key: tls/node.key, certfile: x}\n",
         "unknown key tls.certfile"),
        ("serverz: []\n", "unknown key serverz"),
        ("engines: {vllm: {bin: x}}\n", "unknown key engines.vllm"),
        ("labels: [a]\n", "labels"),
    ],
)  # fmt: skip
def test_unknown_keys_and_wrong_types_are_refused_with_their_path(
    tmp_path: Path, extra: str, said: str
) -> None:
    path = _joined(tmp_path)
    lines = [line for line in path.read_text().splitlines(keepends=True)]
    key = extra.split(":", 1)[0]
    kept = [line for line in lines if not line.startswith(f"{key}:")]
    path.write_text("".join(kept) + extra)
    with pytest.raises(AgentFileError) as refused:
        load_agent_yaml(path)
    assert str(path) in str(refused.value)
    assert said in str(refused.value)


def test_plain_ws_servers_missing_files_and_another_node_id_are_refused(tmp_path: Path) -> None:
    path = _joined(tmp_path)
    text = path.read_text()
    path.write_text(text.replace("wss://10.0.0.1", "ws://10.0.0.1"))
    with pytest.raises(AgentFileError, match=r"servers\[0\] .* is not wss://"):
        load_agent_yaml(path)
    path.write_text(text.replace("tls/node.key", "tls/gone.key"))
    with pytest.raises(AgentFileError, match=r"tls\.key .*gone\.key is not there"):
        load_agent_yaml(path)
    path.write_text(text + "node_id: node-c\n")
    with pytest.raises(
        AgentFileError, match=r"node_id 'node-c' but the certificate .* is for 'node-b'"
    ):
        agent_config(load_agent_yaml(path))
    path.write_text("tls: {ca: a, cert: b, key: c}\n")
    with pytest.raises(AgentFileError, match="servers is required"):
        load_agent_yaml(path)


def test_the_interface_of_an_address_is_named() -> None:
    assert discovery.interface_of(discovery.route_address("127.0.0.1")) == "lo"
    assert discovery.interface_of("192.0.2.77") == ""
    assert discovery.interface_of("not an address") == ""


def test_engine_installs_and_uv_come_from_the_file(tmp_path: Path) -> None:
    path = _joined(tmp_path)
    path.write_text(path.read_text() + "engines: {install: [vllm, llamacpp-cu128], uv: /opt/uv}\n")
    config = agent_config(load_agent_yaml(path))
    assert config.engine_installs == ("vllm", "llamacpp-cu128")
    assert config.uv == "/opt/uv"
    plain = agent_config(load_agent_yaml(_joined(tmp_path / "other")))
    assert (plain.engine_installs, plain.uv) == ((), "uv")

"""``llmgw node add`` and ``llmgw join`` as real processes against a control
plane with a join port, over loopback with real TLS: the node's files, and
each refusal with its own message."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import attrs
import pytest
import trio
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.agent.joincode import JoinCode
from llmgw.app.control_plane import Addresses, ServerConfig, serve_control_plane
from llmgw.auth.admin_token import ADMIN_TOKEN_FILE, new_admin_token, write_admin_token
from llmgw.control.cluster import Cluster
from llmgw.store import Store, open_sqlite_store

#: A command's deadline, in seconds.
COMMAND_TIMEOUT_S = 60


@attrs.frozen
class ControlPlane:
    data_dir: Path
    addresses: Addresses
    store: Store


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    data_dir = tmp_path / "cp"
    data_dir.mkdir()
    config = ServerConfig(
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        agent_listen="127.0.0.1:0",
        join_listen="127.0.0.1:0",
        data_dir=data_dir,
    )
    async with open_sqlite_store(data_dir / "llmgw.db") as store:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            addresses: Addresses = await nursery.start(
                partial(serve_control_plane, config, store, Cluster(), stop)
            )
            # What `llmgw server` leaves for the admin clients.
            write_admin_token(data_dir / ADMIN_TOKEN_FILE, new_admin_token())
            (data_dir / "run.json").write_text(json.dumps({"admin": addresses.admin}))
            yield ControlPlane(data_dir, addresses, store)
            stop.set()


async def llmgw(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(COMMAND_TIMEOUT_S):
        return await trio.run_process(
            [sys.executable, "-m", "llmgw.cli", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, "LLMGW_DATA_DIR": "/nonexistent"},
        )


async def node_add(cp: ControlPlane, *args: str) -> dict[str, object]:
    done = await llmgw("node", "add", "--data-dir", str(cp.data_dir), "--json", *args)
    assert done.returncode == 0, done.stderr.decode()
    doc = json.loads(done.stdout)
    assert isinstance(doc, dict)
    return doc


async def join(code: str, data_dir: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await llmgw(
        "join", code, "--data-dir", str(data_dir), "--node-id", "node-b", "--no-start", *args
    )


def refusal(done: subprocess.CompletedProcess[bytes]) -> str:
    """The one error line of a refused command."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.decode().splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, done.stderr.decode()
    return lines[0]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_node_add_prints_the_one_line_to_run(cp: ControlPlane) -> None:
    done = await llmgw(
        "node", "add", "--data-dir", str(cp.data_dir), "--expires", "10m", "--labels", "rack=r1"
    )
    assert done.returncode == 0, done.stderr.decode()
    lines = done.stdout.decode().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("llmgw join llmgw1.")
    code = JoinCode.decode(lines[0].removeprefix("llmgw join "))
    join_port = cp.addresses.join.rsplit(":", 1)[1]
    assert code.addresses == (f"127.0.0.1:{join_port}",)
    assert "works once, until" in done.stderr.decode()


async def test_a_node_joins_and_gets_its_files_and_certificate(
    cp: ControlPlane, tmp_path: Path
) -> None:
    made = await node_add(cp, "--labels", "rack=r1,gpu=none")
    node_dir = tmp_path / "node"
    done = await join(str(made["code"]), node_dir)
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    config_path = node_dir / "agent.yaml"
    assert f"llmgw agent --config {config_path}" in out
    assert f"ExecStart={sys.executable} -m llmgw.cli agent --config {config_path}" in out
    assert "KillMode=process" in out

    assert mode(node_dir) == 0o700
    assert mode(node_dir / "tls") == 0o700
    assert mode(node_dir / "tls" / "node.key") == 0o600
    doc = yaml.safe_load(config_path.read_text())
    hub_port = cp.addresses.agent_hub.rsplit(":", 1)[1]
    assert doc == {
        "servers": [f"wss://127.0.0.1:{hub_port}/agent"],
        "tls": {"ca": "tls/ca.crt", "cert": "tls/node.crt", "key": "tls/node.key"},
        "node_id": "node-b",
        "address": "",
        "labels": {"rack": "r1", "gpu": "none"},
    }
    ca = x509.load_pem_x509_certificate((cp.data_dir / "ca" / "ca.crt").read_bytes())
    assert (node_dir / "tls" / "ca.crt").read_bytes() == (
        cp.data_dir / "ca" / "ca.crt"
    ).read_bytes()
    cert = x509.load_pem_x509_certificate((node_dir / "tls" / "node.crt").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-b"
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    key = serialization.load_pem_private_key(
        (node_dir / "tls" / "node.key").read_bytes(), password=None
    )
    assert key.public_key() == cert.public_key()
    stored = await cp.store.get_node_certificate(format(cert.serial_number, "x"))
    assert stored is not None
    assert (stored.node_id, stored.revoked_at) == ("node-b", None)

    # The same data directory again: refused unless --force.
    other = await node_add(cp)
    line = refusal(await join(str(other["code"]), node_dir))
    assert f"{node_dir} already holds a node that joined" in line
    assert "--force" in line
    done = await join(str(other["code"]), node_dir, "--force")
    assert done.returncode == 0, done.stderr.decode()


async def test_a_replayed_code_is_refused_as_used(cp: ControlPlane, tmp_path: Path) -> None:
    made = await node_add(cp)
    assert (await join(str(made["code"]), tmp_path / "first")).returncode == 0
    line = refusal(await join(str(made["code"]), tmp_path / "second"))
    assert "this join code was already used at" in line
    assert not (tmp_path / "second" / "agent.yaml").exists()


async def test_an_expired_code_is_refused_as_expired(cp: ControlPlane, tmp_path: Path) -> None:
    made = await node_add(cp, "--expires", "1s")
    expires_at = made["expires_at"]
    assert isinstance(expires_at, float)
    # Past its end (a wall-clock time, so slept until rather than polled).
    await trio.sleep(max(0.0, expires_at - time.time()) + 0.1)
    assert time.time() > expires_at
    line = refusal(await join(str(made["code"]), tmp_path / "node"))
    assert "this join code expired at" in line


async def test_a_forged_code_is_refused_as_unknown(cp: ControlPlane, tmp_path: Path) -> None:
    real = JoinCode.decode(str((await node_add(cp))["code"]))
    forged = JoinCode(real.addresses, "a-token-nobody-made", real.fingerprint)
    line = refusal(await join(forged.encode(), tmp_path / "node"))
    assert "this join code is not one of this cluster's" in line


async def test_a_control_plane_with_another_ca_is_refused_and_the_code_kept(
    cp: ControlPlane, tmp_path: Path
) -> None:
    real = JoinCode.decode(str((await node_add(cp))["code"]))
    wrong = JoinCode(real.addresses, real.token, "sha256:" + "0" * 64)
    line = refusal(await join(wrong.encode(), tmp_path / "node"))
    assert "has CA sha256:" in line
    assert f"but this code was made for sha256:{'0' * 64}" in line
    assert "not the control plane that made the code" in line
    # Nothing was sent: the real code still works.
    assert (await join(real.encode(), tmp_path / "node")).returncode == 0


async def test_unreachable_addresses_are_each_named(cp: ControlPlane, tmp_path: Path) -> None:
    real = JoinCode.decode(str((await node_add(cp))["code"]))
    # Port 1 on loopback: nothing listens there.
    nowhere = JoinCode(("127.0.0.1:1", "127.0.0.2:1"), real.token, real.fingerprint)
    line = refusal(await join(nowhere.encode(), tmp_path / "node"))
    assert "cannot reach the control plane at any address of the code" in line
    assert "127.0.0.1:1 (" in line
    assert "127.0.0.2:1 (" in line
    # A dead first address is skipped.
    detour = JoinCode(("127.0.0.1:1", *real.addresses), real.token, real.fingerprint)
    assert (await join(detour.encode(), tmp_path / "node")).returncode == 0


async def test_text_that_is_not_a_code_is_refused_saying_so(tmp_path: Path) -> None:
    line = refusal(await join("hello", tmp_path / "node"))
    assert "this is not a join code" in line

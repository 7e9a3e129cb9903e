"""``llmgw doctor`` as a real process: its lines, ``--json``, the exit
status, the control planes from ``--server`` or the node's ``agent.yaml``
(checked against real local listeners; certificates made with ``openssl``)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner

from llmgw.agent.doctor import CheckResult
from llmgw.cli.doctor import format_results
from llmgw.cli.main import cli


async def run_doctor(*args: str) -> tuple[int, list[dict[str, Any]]]:
    """``llmgw doctor --json ARGS`` in its own process: exit status and results."""
    with trio.fail_after(120):
        done = await trio.run_process(
            [sys.executable, "-m", "llmgw.cli", "doctor", "--json", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode in (0, 1), done.stderr.decode()
    results: list[dict[str, Any]] = json.loads(done.stdout)
    assert done.returncode == (1 if any(r["status"] == "fail" for r in results) else 0)
    return done.returncode, results


def test_lines_with_the_fix_indented_below() -> None:
    text = format_results(
        [
            CheckResult("cpu", "ok", "2 CPUs, AVX2 FMA AVX-512F"),
            CheckResult("memory", "warn", "1.0 GB available of 4.0 GB", "stop something"),
            CheckResult("reach", "fail", "10.0.0.1:7443 (agent link): refused", "open 7443"),
        ]
    )
    assert text.splitlines() == [
        "ok   cpu     2 CPUs, AVX2 FMA AVX-512F",
        "WARN memory  1.0 GB available of 4.0 GB",
        "             fix: stop something",
        "FAIL reach   10.0.0.1:7443 (agent link): refused",
        "             fix: open 7443",
    ]


async def test_not_joined_warns_about_the_control_plane(tmp_path: Path) -> None:
    _, results = await run_doctor("--data-dir", str(tmp_path))
    assert [r["name"] for r in results] == ["cpu", "memory", "gpu", "disk", "reach", "clock"]
    assert set(results[0]) == {"name", "status", "found", "fix"}
    assert results[4]["status"] == results[5]["status"] == "warn"
    assert results[4]["found"] == "not joined: no control plane to check"
    assert str(tmp_path / "weights") in results[3]["found"]


async def test_a_closed_port_fails_with_exit_status_1(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        code, results = await run_doctor(
            "--data-dir", str(tmp_path), "--server", f"127.0.0.1:{port}", "--join-port", str(port)
        )
    assert code == 1
    remote = results[4:]
    assert [(r["name"], r["status"]) for r in remote] == [
        ("reach", "fail"),
        ("reach", "fail"),
        ("clock", "fail"),
    ]
    assert remote[0]["found"] == f"127.0.0.1:{port} (agent link): connection refused"
    assert f"open TCP {port}" in remote[0]["fix"]


def test_a_bad_server_address_is_refused() -> None:
    result = CliRunner().invoke(cli, ["doctor", "--server", "cp:http"])
    assert result.exit_code == 2
    assert "--server" in result.output
    assert "HOST:PORT" in result.output


def test_a_broken_agent_yaml_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(
        "servers: [wss://10.0.0.1:7443/agent]\n"
        "tls: {ca: ca.crt, cert: node.crt, key: node.key, certfile: x}\n"
    )
    result = CliRunner().invoke(cli, ["doctor", "--config", str(config)])
    assert result.exit_code == 1
    assert "tls.certfile" in result.output  # the loader names the key at fault
    assert result.output.count(str(config)) == 1


# --- a joined node against a real control plane's two ports -----------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _make_certs(directory: Path) -> None:
    """``ca.crt``, ``server.crt|key`` (127.0.0.1) and ``node.crt|key``."""
    directory.mkdir(parents=True)
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
        "-subj", "/CN=cluster-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    for name, san in (("server", "IP:127.0.0.1"), ("node", "DNS:node-b")):
        ext = directory / f"{name}.ext"
        ext.write_text(
            f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n"
            "authorityKeyIdentifier=keyid\n"
        )
        key, csr = directory / f"{name}.key", directory / f"{name}.csr"
        _openssl("req", "-new", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-out", str(directory / f"{name}.crt"), "-days", "2",
            "-extfile", str(ext),
        )  # fmt: skip


Handler = Callable[[trio.abc.Stream], Awaitable[None]]


@asynccontextmanager
async def serving_tls(handler: Handler, context: ssl.SSLContext) -> AsyncIterator[int]:
    """A TLS listener on 127.0.0.1 running ``handler`` per connection; yields its port."""

    async def guarded(stream: trio.abc.Stream) -> None:
        try:
            await handler(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client left
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, guarded, 0, context, host="127.0.0.1")
        )
        yield int(listeners[0].transport_listener.socket.getsockname()[1])
        nursery.cancel_scope.cancel()


async def answer_http(stream: trio.abc.Stream) -> None:
    """The hub's 400 to a plain GET, or the join port's time."""
    request = b""
    while b"\r\n\r\n" not in request:
        chunk = await stream.receive_some()
        if not chunk:
            return
        request += chunk
    if request.startswith(b"GET /v1/join/time "):
        body = json.dumps({"time_s": time.time()}).encode()
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n"
    else:
        body, head = b"", "HTTP/1.1 400 \r\ncontent-length: 0\r\n"
    await stream.send_all(f"{head}connection: close\r\n\r\n".encode() + body)


async def test_a_joined_node_checks_its_control_plane_from_agent_yaml(tmp_path: Path) -> None:
    """agent.yaml in the data directory names the control plane and the TLS
    files: both ports answer TLS verified against the CA, the node's
    certificate is accepted on the agent port, the clocks agree."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes this test's certificates")
    tls = tmp_path / "tls"
    _make_certs(tls)
    agent_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    agent_side.load_cert_chain(str(tls / "server.crt"), str(tls / "server.key"))
    agent_side.load_verify_locations(str(tls / "ca.crt"))
    agent_side.verify_mode = ssl.CERT_REQUIRED
    join_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    join_side.load_cert_chain(str(tls / "server.crt"), str(tls / "server.key"))
    async with (
        serving_tls(answer_http, agent_side) as agent_port,
        serving_tls(answer_http, join_side) as join_port,
    ):
        (tmp_path / "agent.yaml").write_text(
            f"servers: [wss://127.0.0.1:{agent_port}/agent]\n"
            "tls: {ca: tls/ca.crt, cert: tls/node.crt, key: tls/node.key}\n"
            "node_id: node-b\n"
        )
        _, results = await run_doctor("--data-dir", str(tmp_path), "--join-port", str(join_port))
    remote = {(r["name"], r["found"].split(" ")[0]): r for r in results[4:]}
    agent = remote["reach", f"127.0.0.1:{agent_port}"]
    join = remote["reach", f"127.0.0.1:{join_port}"]
    clock = remote["clock", f"127.0.0.1:{join_port}:"]
    assert agent["status"] == "ok", agent
    assert "mutual TLS ok, node certificate accepted" in agent["found"]
    assert f"verified against {tls / 'ca.crt'}" in agent["found"]
    assert join["status"] == "ok", join
    assert clock["status"] == "ok", clock
    assert len(results) == 7

"""``llmgw server`` as a real process: the control plane alone (no agent, no
starter model), with ``llmgw up``'s first start, lock and graceful stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def _server_argv(data_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llmgw.cli",
        "server",
        "--data-dir",
        str(data_dir),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--agent-listen",
        "127.0.0.1:0",
        "--join-listen",
        "127.0.0.1:0",
        *args,
    ]


def _wait(predicate: object, timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()  # type: ignore[operator]
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@pytest.fixture(name="server")
def server_fixture(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    data_dir = tmp_path / "data"
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            _server_argv(data_dir),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield process, data_dir, log_path
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_server_runs_the_control_plane_alone_and_stops_on_sigterm(
    server: tuple[subprocess.Popen[bytes], Path, Path],
) -> None:
    process, data_dir, log_path = server

    def ready() -> bool:
        assert process.poll() is None, log_path.read_text()
        return "ready in" in log_path.read_text()

    _wait(ready, 60, "the ready line")
    run = json.loads((data_dir / "run.json").read_text())
    assert set(run) == {"pid", "api", "admin", "metrics", "agent_hub", "join"}
    assert (data_dir / "admin-token").stat().st_mode & 0o777 == 0o600
    assert (data_dir / "client-key").stat().st_mode & 0o777 == 0o600
    admin = {"authorization": f"Bearer {(data_dir / 'admin-token').read_text().strip()}"}
    client = {"authorization": f"Bearer {(data_dir / 'client-key').read_text().strip()}"}
    # No agent in the process and no starter model in the catalog.
    nodes = httpx.get(f"http://{run['admin']}/api/v1/nodes", headers=admin, timeout=10)
    assert nodes.status_code == 200
    assert nodes.json()["data"] == []
    models = httpx.get(f"http://{run['api']}/v1/models", headers=client, timeout=10)
    assert models.status_code == 200
    assert models.json()["data"] == []
    assert not (data_dir / "agent").exists()

    # A second server on the same data directory is refused, saying why.
    second = subprocess.run(
        _server_argv(data_dir), capture_output=True, text=True, timeout=60, check=False
    )
    assert second.returncode == 1
    assert "another llmgw server is using" in second.stderr

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    log = log_path.read_text()
    assert "SIGTERM: stopping" in log, log
    assert log.rstrip().endswith("stopped"), log
    assert not (data_dir / "run.json").exists()


def test_server_refuses_a_port_in_use_naming_the_option(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = f"127.0.0.1:{sock.getsockname()[1]}"
        result = subprocess.run(
            _server_argv(tmp_path / "data", "--join-listen", taken),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1
    assert f"cannot listen on {taken} (join): address already in use" in result.stderr
    assert "--join-listen HOST:PORT" in result.stderr
    assert not (tmp_path / "data" / "llmgw.db").exists()

"""Fixtures that run ``llmgw up`` as a real process, as a user would."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

STARTUP_TIMEOUT_S = 240.0


def up_argv(data_dir: Path, *args: str) -> list[str]:
    """``llmgw up`` in ``data_dir`` with every listener on a free loopback port."""
    return [
        sys.executable,
        "-m",
        "llmgw.cli",
        "up",
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
        *args,
    ]


class Up:
    """A running ``llmgw up`` in its own data directory.

    Attributes:
        process: the ``llmgw up`` process (its own process group).
        data_dir: its data directory.
        output: where its stderr goes (read with :meth:`log`).
    """

    def __init__(self, data_dir: Path, args: list[str]) -> None:
        self.data_dir = data_dir
        self.output = data_dir.parent / f"{data_dir.name}.log"
        # Below the kernel's ephemeral range (32768 and up on Linux by
        # default), so no outgoing connection can be holding an engine's port.
        base = random.randrange(22000, 32000, 100)
        self.engine_ports = (base, base + 99)
        command = up_argv(data_dir, "--engine-ports", f"{base}-{base + 99}", *args)
        self._log_file = self.output.open("wb")
        self.process = subprocess.Popen(
            command,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.run: dict[str, str] = {}

    def log(self) -> str:
        return self.output.read_text(errors="replace")

    @property
    def base_url(self) -> str:
        return f"http://{self.run['api']}"

    @property
    def admin_key(self) -> str:
        return (self.data_dir / "admin-key").read_text().strip()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"llmgw up exited with {self.process.returncode}:\n{self.log()}"
                )
            run_file = self.data_dir / "run.json"
            if not self.run and run_file.exists():
                try:
                    self.run = json.loads(run_file.read_text())
                except ValueError:
                    pass
            if self.run:
                try:
                    if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"llmgw up not ready within {timeout_s} s:\n{self.log()}")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmgw.cli", *args, "--data-dir", str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log_file.close()


@pytest.fixture(name="up_argv")
def up_argv_fixture() -> Callable[..., list[str]]:
    """:func:`up_argv`, for tests that run ``llmgw up`` themselves."""
    return up_argv


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[object]:
    started: list[Up] = []

    def start(*args: str, name: str = "data") -> Up:
        up = Up(tmp_path / name, list(args))
        started.append(up)
        return up

    yield start
    for up in started:
        up.stop()


#: Settings for tests that send more than the default 60 requests a minute
#: (``auth.*`` is read once at start, so it goes in server.yaml).
ROOMY_SETTINGS: dict[str, object] = {"auth": {"default_rpm": 1_000_000, "default_tpm": 10**10}}


def admin_request(
    up: Up, method: str, path: str, body: object = None, *, timeout: float = 30.0
) -> httpx.Response:
    """One call to the admin API of ``up`` (``/api/v1/…``) with its admin key."""
    return httpx.request(
        method,
        f"http://{up.run['admin']}{path}",
        json=body,
        headers={"authorization": f"Bearer {up.admin_key}"},
        timeout=timeout,
    )


@pytest.fixture(name="admin_request")
def admin_request_fixture() -> Callable[..., httpx.Response]:
    """:func:`admin_request`: ``admin_request(up, "POST", "/api/v1/models", doc)``."""
    return admin_request


@pytest.fixture(scope="module")
def start_module_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Up]]:
    """Like ``start_up``, for one ``llmgw up`` shared by a module's tests:
    ``start(*args, settings={...})`` writes ``settings`` (default
    :data:`ROOMY_SETTINGS`) as its server.yaml, starts it and waits until
    it is ready. Every one started is stopped after the module."""
    started: list[Up] = []

    def start(*args: str, settings: dict[str, object] | None = None) -> Up:
        data_dir = tmp_path_factory.mktemp("up") / "data"
        data_dir.mkdir()
        doc = ROOMY_SETTINGS if settings is None else settings
        (data_dir / "server.yaml").write_text(json.dumps(doc))  # JSON is YAML
        up = Up(data_dir, list(args))
        started.append(up)
        up.wait_ready()
        return up

    yield start
    for up in started:
        up.stop()

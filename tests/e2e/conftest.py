"""Fixtures that run ``llmgw up`` (and ``llmgw agent``) as real processes,
as a user would, and the helpers the end-to-end tests share.

``tests`` is not a package, so the test modules do not import this file:
what they share comes to them as fixtures (``up_argv``, ``admin_request``,
``procs``, ``agent_type``) or as methods of :class:`Up`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

STARTUP_TIMEOUT_S = 240.0

#: Marks every process this test run starts (``llmgw up``, its agent, the
#: engines it starts, which inherit its environment), so that clean-up
#: kills only this run's engines, never those of a user or of another run
#: on the same machine that happen to listen in the same port range.
TEST_RUN_VARIABLE = "LLMGW_TEST_RUN"
os.environ.setdefault(TEST_RUN_VARIABLE, f"{os.getpid()}-{time.time_ns()}")
_TEST_RUN_MARK = f"{TEST_RUN_VARIABLE}={os.environ[TEST_RUN_VARIABLE]}".encode()


def wait_for(
    predicate: Callable[[], Any], timeout_s: float, what: str, *, interval_s: float = 0.2
) -> Any:
    """Poll ``predicate`` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


class Procs:
    """The processes of the machine, read from ``/proc``."""

    @staticmethod
    def start_time(pid: int) -> int | None:
        """``/proc/<pid>/stat`` field 22, None when gone or a zombie: a
        restarted engine would have another one even with a reused pid."""
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        fields = raw[raw.rfind(")") + 2 :].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])

    @staticmethod
    def with_port() -> Iterator[tuple[int, list[bytes], int]]:
        """Every process whose command line carries ``--port N``: its pid,
        command line and N."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--port" not in argv:
                continue
            try:
                port = int(argv[argv.index(b"--port") + 1])
            except (IndexError, ValueError):
                continue
            yield int(entry.name), argv, port

    @classmethod
    def on_port(cls, port: int) -> list[int]:
        """The processes whose command line carries ``--port PORT`` (an engine)."""
        return [pid for pid, _, found in cls.with_port() if found == port]

    @staticmethod
    def started_by_this_run(pid: int) -> bool:
        """Whether ``pid`` carries this test run's mark in its environment
        (:data:`TEST_RUN_VARIABLE`)."""
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False
        return _TEST_RUN_MARK in environ

    @classmethod
    def engines_in(cls, ports: tuple[int, int], engine: str = "") -> dict[int, int]:
        """Live engine processes (``llmgw.engines.<engine>…``) of this test
        run listening in ``ports`` (inclusive): pid → port."""
        module = f"llmgw.engines.{engine}".encode()
        return {
            pid: port
            for pid, argv, port in cls.with_port()
            if any(a.startswith(module) for a in argv)
            and ports[0] <= port <= ports[1]
            and cls.start_time(pid) is not None
            and cls.started_by_this_run(pid)
        }

    @staticmethod
    def kill_groups(pgids: Iterable[int]) -> None:
        """SIGKILL these process groups (those already gone are passed over)."""
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(name="procs", scope="session")
def procs_fixture() -> Procs:
    """:class:`Procs`: ``procs.start_time(pid)``, ``procs.engines_in(ports)`` …"""
    return Procs()


def read_run(data_dir: Path) -> dict[str, str]:
    """The ``run.json`` of ``llmgw up`` in ``data_dir`` ({} while it is not
    written, or half written)."""
    try:
        run: dict[str, str] = json.loads((data_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return run


class Agent:
    """A separate ``llmgw agent`` of a running ``llmgw up`` (each start in
    its own session), appending to one log.

    Attributes:
        process: the agent process of the last :meth:`start`, if any.
        mark: where that agent's lines start in the log.
    """

    def __init__(self, up: Any, state_dir: Path, log_path: Path, node_id: str) -> None:
        """``up``: anything with ``llmgw up``'s ``run`` (its run.json) and ``data_dir``."""
        self.argv = [
            sys.executable,
            "-m",
            "llmgw.cli",
            "agent",
            "--server",
            f"ws://{up.run['agent_hub']}/agent",
            "--token-file",
            str(up.data_dir / "agent-token"),
            "--state-dir",
            str(state_dir),
            "--node-id",
            node_id,
        ]
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.mark = 0

    def start(self) -> None:
        self.mark = len(self.log())
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def running_log(self) -> str:
        """The lines of the agent running now."""
        return self.log()[self.mark :]

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(name="agent_type", scope="session")
def agent_type_fixture() -> type[Agent]:
    """:class:`Agent`: ``agent_type(up, state_dir, log_path, node_id)``."""
    return Agent


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

    #: :func:`wait_for`, for the tests' helpers that hold an ``Up``.
    wait_for = staticmethod(wait_for)

    @property
    def base_url(self) -> str:
        return f"http://{self.run['api']}"

    @property
    def admin_token(self) -> str:
        """The admin token (``DATA_DIR/admin-token``): the admin API only."""
        return (self.data_dir / "admin-token").read_text().strip()

    @property
    def client_key(self) -> str:
        """The client key ``llmgw up`` made (``DATA_DIR/client-key``): ``/v1``."""
        return (self.data_dir / "client-key").read_text().strip()

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"llmgw up exited with {self.process.returncode}:\n{self.log()}"
                )
            if not self.run:
                self.run = read_run(self.data_dir)
            if self.run:
                try:
                    if httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"llmgw up not ready within {timeout_s} s:\n{self.log()}")

    def wait_run(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait for run.json (with ``--no-agent``, ``/ready`` waits for an agent)."""
        self.run = wait_for(lambda: read_run(self.data_dir), timeout_s, f"run.json:\n{self.log()}")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmgw.cli", *args, "--data-dir", str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def status(self) -> dict[str, Any]:
        """``ctl status --json``."""
        result = self.cli("ctl", "status", "--json")
        assert result.returncode == 0, result.stderr
        doc: dict[str, Any] = json.loads(result.stdout)
        return doc

    def usage_row(self, request_id: str) -> dict[str, Any]:
        """The usage row of ``request_id`` (``ctl request``), once it is written."""

        def row() -> dict[str, Any] | None:
            result = self.cli("ctl", "request", request_id, "--json")
            if result.returncode != 0:
                return None
            found: dict[str, Any] = json.loads(result.stdout)
            return found

        found: dict[str, Any] = wait_for(row, 15, f"the usage row of {request_id}")
        return found

    def post(
        self,
        path: str,
        body: object,
        headers: dict[str, str] | None = None,
        *,
        http: httpx.Client | None = None,
        timeout: float = 30.0,
    ) -> httpx.Response:
        """``POST`` to the gateway (``path`` from ``/v1``) with the client key,
        through ``http`` if given (its timeout then)."""
        url = f"{self.base_url}{path}"
        sent = {"authorization": f"Bearer {self.client_key}", **(headers or {})}
        if http is not None:
            return http.post(url, json=body, headers=sent)
        return httpx.post(url, json=body, headers=sent, timeout=timeout)

    def admin(self, method: str, path: str, body: object = None) -> httpx.Response:
        """:func:`admin_request` on this one."""
        return admin_request(self, method, path, body)

    def engine_metrics(self, port: int) -> str:
        """The ``/metrics`` text of the engine serving on ``port``, with the
        engine's key read from its environment (``LLAMA_API_KEY``)."""
        pid = Procs.on_port(port)[0]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        [key] = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"LLAMA_API_KEY=")]
        return httpx.get(
            f"http://127.0.0.1:{port}/metrics",
            headers={"authorization": f"Bearer {key}"},
            timeout=5,
        ).text

    def openai_client(
        self, timeout: float | None = None, *, api_key: str | None = None
    ) -> openai.OpenAI:
        """The official OpenAI client on the gateway, with no retries, the client
        key unless ``api_key`` is given, and the client's default timeout
        unless ``timeout`` is."""
        key = self.client_key if api_key is None else api_key
        if timeout is None:
            return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0)
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, timeout=timeout
        )

    def anthropic_client(self, timeout: float) -> anthropic.Anthropic:
        """The official Anthropic client on the gateway, with the client key and no retries."""
        return anthropic.Anthropic(
            base_url=self.base_url, api_key=self.client_key, max_retries=0, timeout=timeout
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


@pytest.fixture(name="up_argv", scope="session")
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
    """One call to the admin API of ``up`` (``/api/v1/…``) with its admin token."""
    return httpx.request(
        method,
        f"http://{up.run['admin']}{path}",
        json=body,
        headers={"authorization": f"Bearer {up.admin_token}"},
        timeout=timeout,
    )


@pytest.fixture(name="admin_request", scope="session")
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

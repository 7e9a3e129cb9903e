"""Helpers the end-to-end tests of ``llmgw server`` share: waiting for a
condition, a process with its log file, free ports, and the pieces of an
HA cluster (two control planes on one PostgreSQL, a node with a sim
engine, client load that fails over).

``tests`` is no package: pytest puts this folder on ``sys.path``, so a
test module imports it as ``processes`` (``tests.e2e.processes`` for the
type checker)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

__all__ = [
    "HaCluster",
    "Load",
    "Process",
    "engines",
    "free_ports",
    "kill_new_engines",
    "llmgw",
    "started_processes",
    "status",
    "wait_until",
]


def wait_until(
    predicate: Callable[[], Any], timeout_s: float, what: str, *, every_s: float = 0.1
) -> Any:
    """``predicate()``'s first truthy answer, asked every ``every_s``.

    Raises:
        AssertionError: none within ``timeout_s``, naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports of 127.0.0.1 free now (nothing listens on them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def status(url: str) -> int:
    """``GET url``'s status, 0 when nothing answers within 2 s."""
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


class Process:
    """A command run in its own session, its output appended to ``log_path``."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        """True, or an AssertionError with the log when it has ended."""
        assert self.process.poll() is None, self.log()
        return True

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its group after 30 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def engines(ports: tuple[int, int]) -> dict[int, int | None]:
    """Live sim engines listening in ``ports`` (inclusive): pid → start time."""
    found: dict[int, int | None] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        if b"--port" not in argv or not any(a.startswith(b"llmgw.engines.sim") for a in argv):
            continue
        try:
            port = int(argv[argv.index(b"--port") + 1])
        except (IndexError, ValueError):
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        if ports[0] <= port <= ports[1] and fields[0] not in ("Z", "X"):
            found[int(entry.name)] = int(fields[19])
    return found


def kill_new_engines(before: Sequence[int], ports: tuple[int, int]) -> None:
    """Engines outlive their agent by design: a test's own go with it."""
    for pid in set(engines(ports)) - set(before):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def llmgw(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m llmgw.cli ARGS``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class HaCluster:
    """Two ``llmgw server`` (``cp-a``, ``cp-b``) on one PostgreSQL store, a
    node joined with ``llmgw join`` listing both hubs, and a sim model.

    Args:
        tmp_path: where data directories and logs go.
        store: the PostgreSQL address.
        started: processes started are added here (the caller stops them).
        engine_ports: the engine port range of both control planes.
        lease_ttl_s: ``--lease-ttl``; ``None``: the default.
        settings: extra ``server.yaml`` text.
    """

    names = ("cp-a", "cp-b")

    def __init__(
        self,
        tmp_path: Path,
        store: str,
        started: list[Process],
        engine_ports: tuple[int, int],
        *,
        lease_ttl_s: float | None = None,
        settings: str = "",
    ) -> None:
        self.tmp_path = tmp_path
        self.store = store
        self.started = started
        self.engine_ports = engine_ports
        self.lease_ttl_s = lease_ttl_s
        self.config = tmp_path / "server.yaml"
        # No rate limit in the way of the load.
        self.config.write_text(
            "auth:\n  default_rpm: 1000000\n  default_tpm: 100000000\n" + settings
        )
        self.ports = {
            n: dict(zip(("api", "admin", "hub"), free_ports(3), strict=True)) for n in self.names
        }
        self.apis = {n: f"127.0.0.1:{self.ports[n]['api']}" for n in self.names}
        self.hubs = [f"wss://127.0.0.1:{self.ports[n]['hub']}/agent" for n in self.names]
        self.servers: dict[str, Process] = {}
        self.agent: Process | None = None
        self.key = ""

    def start_server(self, name: str) -> Process:
        p = self.ports[name]
        ttl = [] if self.lease_ttl_s is None else ["--lease-ttl", str(self.lease_ttl_s)]
        server = Process(
            [
                sys.executable, "-m", "llmgw.cli", "server", "--data-dir", str(self.tmp_path / name),
                "--store", self.store, "--config", str(self.config),
                "--listen", f"127.0.0.1:{p['api']}", "--admin-listen", f"127.0.0.1:{p['admin']}",
                "--metrics-listen", "127.0.0.1:0", "--agent-listen", f"127.0.0.1:{p['hub']}",
                "--join-listen", "127.0.0.1:0",
                "--engine-ports", f"{self.engine_ports[0]}-{self.engine_ports[1]}", *ttl,
            ],
            self.tmp_path / f"{name}.log",
        )  # fmt: skip
        self.servers[name] = server
        self.started.append(server)
        return server

    def restart(self, name: str) -> None:
        """Stop ``name`` (when it runs), start it again, wait until it answers ``/health``."""
        self.servers[name].stop()
        back = self.start_server(name)
        api = self.apis[name]
        wait_until(
            lambda: back.alive() and status(f"http://{api}/health") == 200,
            60,
            f"{name} listens again",
        )

    def ctl(self, cp: str, *args: str) -> subprocess.CompletedProcess[str]:
        return llmgw("ctl", *args, "--data-dir", str(self.tmp_path / cp))

    def leaders(self) -> list[str]:
        """The control planes answering ``/leader`` 200 now."""
        return [n for n in self.names if status(f"http://{self.apis[n]}/leader") == 200]

    def start(self, model: str, node: str) -> None:
        """cp-a (leading), then cp-b (standing by), the node, ``model`` READY."""
        a = self.start_server("cp-a")
        wait_until(lambda: a.alive() and "ready in" in a.log(), 60, "A leads")
        b = self.start_server("cp-b")
        wait_until(
            lambda: b.alive() and (self.tmp_path / "cp-b" / "run.json").exists(),
            60,
            "B listens",
        )
        node_dir = self.tmp_path / "node"
        added = llmgw("node", "add", "--json", "--data-dir", str(self.tmp_path / "cp-a"))
        assert added.returncode == 0, added.stderr
        code = json.loads(added.stdout)["command"].split()[-1]
        joined = llmgw("join", code, "--data-dir", str(node_dir), "--node-id", node, "--no-start")
        assert joined.returncode == 0, joined.stderr
        agent_yaml = node_dir / "agent.yaml"
        doc = yaml.safe_load(agent_yaml.read_text())
        doc["servers"] = self.hubs
        agent_yaml.write_text(yaml.safe_dump(doc))
        agent = Process(
            [sys.executable, "-m", "llmgw.cli", "agent", "--config", str(agent_yaml)],
            self.tmp_path / "agent.log",
        )
        self.agent = agent
        self.started.append(agent)
        added_model = self.ctl(
            "cp-a", "model", "add", model, "--engine", "sim", "--min-memory-gb", "0.1"
        )
        assert added_model.returncode == 0, added_model.stderr
        wait_until(lambda: self.ready_on("cp-a"), 120, f"a READY replica:\n{agent.log()}")
        self.key = (self.tmp_path / "cp-a" / "client-key").read_text().strip()

    def ready_on(self, cp: str) -> list[dict[str, Any]]:
        """The READY replicas ``cp`` lists."""
        assert self.agent is not None
        self.agent.alive()
        result = self.ctl(cp, "replicas", "--json")
        if result.returncode != 0:
            return []
        return [r for r in json.loads(result.stdout)["data"] if r["state"].lower() == "ready"]


class Load:
    """``clients`` threads sending chat requests for ``model`` (half
    streamed), each to the first control plane that answers 200, in the
    order of :attr:`apis` (which a test may change)."""

    def __init__(self, apis: list[str], key: str, model: str, clients: int = 4) -> None:
        self.apis = apis
        self.key = key
        self.model = model
        self.answers: list[tuple[float, str, str]] = []  # (when, api, request id)
        self.failed: list[float] = []
        #: Why attempts failed: "HTTP 503 no_leader", "ConnectError", …
        self.why: dict[str, int] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(timeout=60)

    def _one(self, client: httpx.Client, api: str, stream: bool) -> str | None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "stream": stream,
        }
        headers = {"authorization": f"Bearer {self.key}"}
        try:
            if stream:
                with client.stream(
                    "POST", f"http://{api}/v1/chat/completions", json=body, headers=headers
                ) as response:
                    if response.status_code != 200:
                        response.read()
                        self._note(f"HTTP {response.status_code} {_code(response)}")
                        return None
                    text = b"".join(response.iter_raw())
                    if b"[DONE]" not in text:
                        self._note("stream cut")
                        return None
                    return str(response.headers.get("x-request-id"))
            response = client.post(f"http://{api}/v1/chat/completions", json=body, headers=headers)
            if response.status_code != 200:
                self._note(f"HTTP {response.status_code} {_code(response)}")
                return None
            return str(response.headers.get("x-request-id"))
        except httpx.HTTPError as exc:
            self._note(type(exc).__name__)
            return None

    def _note(self, why: str) -> None:
        with self._lock:
            self.why[why] = self.why.get(why, 0) + 1

    def _run(self, index: int) -> None:
        n = 0
        with httpx.Client(timeout=httpx.Timeout(15.0, connect=2.0)) as client:
            while not self.stopping.is_set():
                n += 1
                stream = (n + index) % 2 == 0
                for api in list(self.apis):
                    request_id = self._one(client, api, stream)
                    if request_id is not None:
                        with self._lock:
                            self.answers.append((time.monotonic(), api, request_id))
                        break
                else:
                    with self._lock:
                        self.failed.append(time.monotonic())
                    time.sleep(0.1)
                time.sleep(0.02)

    def first_answer_by(self, api: str, after: float) -> float | None:
        with self._lock:
            times = [t for t, a, _ in self.answers if a == api and t > after]
        return min(times) if times else None

    def answered_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for t, _, _ in self.answers if start <= t <= end)

    def failed_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for t in self.failed if start <= t <= end)

    def take_why(self) -> dict[str, int]:
        with self._lock:
            why = dict(self.why)
            self.why.clear()
        return why

    def request_ids(self) -> set[str]:
        with self._lock:
            return {request_id for _, _, request_id in self.answers}


def _code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


def started_processes() -> Iterator[list[Process]]:
    """For a fixture: the list a test adds its processes to, stopped after
    it in reverse order."""
    processes: list[Process] = []
    yield processes
    for process in reversed(processes):
        process.stop()

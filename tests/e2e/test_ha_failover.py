"""Two ``llmgw server`` on one PostgreSQL (a throwaway server, ``pg_ctl``)
and one node (``llmgw join``, mutual TLS) with a sim engine, under
continuous load from clients given both control planes' addresses.

SIGKILL the leader: the standby leads, the agent links to it, the engine
keeps its pid, requests succeed again, and once the killed control plane
is started again (replaying its usage journal) no answered request lacks
its usage row. Then the same with SIGTERM on the new leader. The figures
(time from the signal to the first answer by the new leader, requests
failed in the gap) are printed, not asserted (``docs/ha.md``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import yaml

NODE = "node-ha"
MODEL = "sim-ha"
ENGINE_PORTS = (23300, 23399)
CLIENTS = 4


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


class _Process:
    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        assert self.process.poll() is None, self.log()
        return True

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


@pytest.fixture(name="started")
def started_fixture() -> Iterator[list[_Process]]:
    processes: list[_Process] = []
    before = set(_engines())
    yield processes
    for process in reversed(processes):
        process.stop()
    # Engines outlive their agent by design: this test's go with it.
    for pid in set(_engines()) - before:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _server(tmp_path: Path, name: str, store: str, ports: dict[str, int]) -> _Process:
    p = ports
    config = tmp_path / "server.yaml"
    # No rate limit in the way of the load.
    config.write_text("auth:\n  default_rpm: 1000000\n  default_tpm: 100000000\n")
    return _Process(
        [
            sys.executable, "-m", "llmgw.cli", "server", "--data-dir", str(tmp_path / name),
            "--store", store, "--config", str(config),
            "--listen", f"127.0.0.1:{p['api']}", "--admin-listen", f"127.0.0.1:{p['admin']}",
            "--metrics-listen", "127.0.0.1:0", "--agent-listen", f"127.0.0.1:{p['hub']}",
            "--join-listen", "127.0.0.1:0",
            "--engine-ports", f"{ENGINE_PORTS[0]}-{ENGINE_PORTS[1]}",
        ],
        tmp_path / f"{name}.log",
    )  # fmt: skip


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


class _Load:
    """``CLIENTS`` threads sending chat requests (half streamed), each to
    the first control plane that answers 200, in the order given."""

    def __init__(self, apis: list[str], key: str) -> None:
        self.apis = apis
        self.key = key
        self.answers: list[tuple[float, str, str]] = []  # (when, api, request id)
        self.failed: list[float] = []
        #: Why attempts failed: "HTTP 503 no_leader", "ConnectError", …
        self.why: dict[str, int] = {}
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(CLIENTS)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(timeout=60)

    def _one(self, client: httpx.Client, api: str, stream: bool) -> str | None:
        body = {
            "model": MODEL,
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
                for api in self.apis:
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

    def failed_between(self, start: float, end: float) -> int:
        with self._lock:
            return sum(1 for t in self.failed if start <= t <= end)


def _code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


def _engines() -> dict[int, int | None]:
    """Live sim engines in ENGINE_PORTS: pid → start time."""
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
        if ENGINE_PORTS[0] <= port <= ENGINE_PORTS[1] and fields[0] not in ("Z", "X"):
            found[int(entry.name)] = int(fields[19])
    return found


def test_the_standby_takes_over_on_sigkill_and_on_sigterm_losing_nothing(
    tmp_path: Path, started: list[_Process], postgres_db: str
) -> None:
    names = ("cp-a", "cp-b")
    ports = dict(
        zip(
            names,
            [dict(zip(("api", "admin", "hub"), _free_ports(3), strict=True)) for _ in names],
            strict=True,
        )
    )
    apis = [f"127.0.0.1:{ports[n]['api']}" for n in names]
    hubs = [f"wss://127.0.0.1:{ports[n]['hub']}/agent" for n in names]
    servers = {n: _server(tmp_path, n, postgres_db, ports[n]) for n in ("cp-a",)}
    started.append(servers["cp-a"])
    _wait(lambda: servers["cp-a"].alive() and "ready in" in servers["cp-a"].log(), 60, "A leads")
    servers["cp-b"] = _server(tmp_path, "cp-b", postgres_db, ports["cp-b"])
    started.append(servers["cp-b"])
    _wait(
        lambda: servers["cp-b"].alive() and (tmp_path / "cp-b" / "run.json").exists(),
        60,
        "B listens",
    )
    assert "ready in" not in servers["cp-b"].log()  # a standby
    # Both serve the same cluster CA (kept in the store).
    assert (tmp_path / "cp-a" / "ca" / "ca.crt").read_bytes() == (
        tmp_path / "cp-b" / "ca" / "ca.crt"
    ).read_bytes()
    assert httpx.get(f"http://{apis[0]}/leader").status_code == 200
    assert httpx.get(f"http://{apis[1]}/leader").status_code == 503
    assert httpx.get(f"http://{apis[1]}/health").status_code == 200

    def llmgw(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmgw.cli", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def ctl(cp: str, *args: str) -> subprocess.CompletedProcess[str]:
        return llmgw("ctl", *args, "--data-dir", str(tmp_path / cp))

    node_dir = tmp_path / "node"
    added = llmgw("node", "add", "--json", "--data-dir", str(tmp_path / "cp-a"))
    assert added.returncode == 0, added.stderr
    code = json.loads(added.stdout)["command"].split()[-1]
    joined = llmgw("join", code, "--data-dir", str(node_dir), "--node-id", NODE, "--no-start")
    assert joined.returncode == 0, joined.stderr
    agent_yaml = node_dir / "agent.yaml"
    doc = yaml.safe_load(agent_yaml.read_text())
    doc["servers"] = hubs
    agent_yaml.write_text(yaml.safe_dump(doc))
    agent = _Process(
        [sys.executable, "-m", "llmgw.cli", "agent", "--config", str(agent_yaml)],
        tmp_path / "agent.log",
    )
    started.append(agent)
    model = ctl("cp-a", "model", "add", MODEL, "--engine", "sim", "--min-memory-gb", "0.1")
    assert model.returncode == 0, model.stderr

    def ready_on(cp: str) -> list[dict[str, Any]]:
        agent.alive()
        result = ctl(cp, "replicas", "--json")
        if result.returncode != 0:
            return []
        return [r for r in json.loads(result.stdout)["data"] if r["state"].lower() == "ready"]

    _wait(lambda: ready_on("cp-a"), 120, f"a READY replica:\n{agent.log()}")
    engines = _engines()
    assert len(engines) == 1
    key = (tmp_path / "cp-a" / "client-key").read_text().strip()
    load = _Load(apis, key)
    load_started = time.monotonic()
    load.start()
    figures: list[str] = []
    try:
        time.sleep(3)
        # Through the standby too: it forwards /v1 to the leader.
        forwarded = httpx.post(
            f"http://{apis[1]}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert forwarded.status_code == 200, forwarded.text

        for how, old, new in ((signal.SIGKILL, "cp-a", "cp-b"), (signal.SIGTERM, "cp-b", "cp-a")):
            old_api, new_api = apis[names.index(old)], apis[names.index(new)]
            # The new leader is tried only when the old one fails: an answer
            # from it after the signal is its own, not one it forwarded.
            load.apis = [old_api, new_api]
            time.sleep(1)
            answered_before = len(load.answers)
            signalled = time.monotonic()
            servers[old].signal(how)

            def answered_by_new(api: str = new_api, since: float = signalled) -> float | None:
                return load.first_answer_by(api, since)

            first = _wait(
                answered_by_new,
                60,
                f"an answer by {new} after {how.name}:\n{servers[new].log()}\n{agent.log()}",
            )
            servers[old].process.wait(timeout=30)
            time.sleep(3)
            failed = load.failed_between(signalled, time.monotonic())
            why = dict(load.why)
            load.why.clear()
            assert httpx.get(f"http://{new_api}/leader").status_code == 200
            assert _engines() == engines, "the engine was restarted"
            assert len(load.answers) > answered_before
            figures.append(
                f"{how.name} {old}: first answer by {new} after {first - signalled:.2f} s; "
                f"requests failed in the gap: {failed}; engines restarted: 0; "
                f"failed attempts by cause (either control plane): {why}"
            )
            # The old control plane comes back as a standby (replaying its journal).
            servers[old].stop()
            servers[old] = _server(tmp_path, old, postgres_db, ports[old])
            started.append(servers[old])
            back = servers[old]

            def listens(back: _Process = back, api: str = old_api) -> bool:
                return back.alive() and _status(f"http://{api}/health") == 200

            _wait(listens, 60, f"{old} listens again")
            assert _status(f"http://{old_api}/leader") == 503
        time.sleep(2)
    finally:
        load.stop()
    load_s = time.monotonic() - load_started
    answered = {request_id for _, _, request_id in load.answers}
    assert answered

    def stored() -> set[str]:
        with psycopg.connect(postgres_db) as conn:
            return {r[0] for r in conn.execute("SELECT request_id FROM usage")}

    # The leader's usage writer flushes within its interval.
    _wait(lambda: answered <= stored(), 30, "every answered request's usage row")
    lost = answered - stored()
    figures.append(
        f"answers: {len(answered)} by {CLIENTS} clients in {load_s:.0f} s "
        f"({len(answered) / load_s:.1f}/s); usage rows lost: {len(lost)}; "
        f"requests failed over the whole run: {len(load.failed)}"
    )
    print("\nHA failover figures:\n  " + "\n  ".join(figures))
    assert not lost


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0

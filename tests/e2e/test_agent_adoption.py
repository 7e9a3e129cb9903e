"""A standalone ``llmgw agent`` dies and the next one adopts its engines.

``llmgw up --no-agent`` runs the control plane only; a separate ``llmgw
agent`` process serves two sim models. The agent is SIGKILLed: its engines
keep running; the next agent on the same state directory finds them and
registers them, and the same processes go on answering through the
gateway — nothing is restarted (``reconciler-and-lifecycle.md``, Adoption).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

MODELS = ("a", "b")
DEADLINE_S = 90.0


def _wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _start_time(pid: int) -> int | None:
    """``/proc/<pid>/stat`` field 22 (None when gone or a zombie): a
    restarted engine would have another one even with a reused pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _sim_engines(ports: tuple[int, int]) -> dict[int, int]:
    """Sim engines listening in ``ports`` (inclusive): pid → port."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"llmgw.engines.sim" not in argv or b"--port" not in argv:
            continue
        at = argv.index(b"--port")
        try:
            port = int(argv[at + 1])
        except (IndexError, ValueError):
            continue
        if ports[0] <= port <= ports[1] and _start_time(int(entry.name)) is not None:
            found[int(entry.name)] = port
    return found


class Agent:
    """An ``llmgw agent`` process of the test (its own session)."""

    def __init__(self, up: Any, state_dir: Path, log_path: Path) -> None:
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
            "adoption-node",
        ]
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Things to end after the test, last first: agents, then the engines
    (by process group) in the ports of each ``llmgw up``."""
    items: list[Any] = []
    yield items
    for item in reversed(items):
        if isinstance(item, Agent):
            item.kill(signal.SIGTERM)
    for item in items:
        if isinstance(item, tuple):
            for pid in _sim_engines(item):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _status(up: Any) -> dict[str, Any]:
    result = up.cli("ctl", "status", "--json")
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def _ready_replicas(up: Any) -> dict[str, dict[str, Any]]:
    """The READY replicas by model (one each expected)."""
    return {r["model"]: r for r in _status(up)["replicas"] if r["state"] == "READY"}


def _shard_files(state_dir: Path) -> dict[str, dict[str, Any]]:
    """The agent's shard files by model: the engine pid and port."""
    found = {}
    for path in (state_dir / "shards").glob("*.json"):
        doc = json.loads(path.read_text())
        found[doc["start"]["profile"]["name"]] = {
            "pid": doc["procs"][0]["pid"],
            "port": doc["start"]["port"],
            "shard_id": doc["start"]["shard_id"],
        }
    return found


def _chat(up: Any, model: str) -> httpx.Response:
    return httpx.post(
        f"{up.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {up.admin_key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )


def test_a_killed_agent_s_engines_are_adopted_by_the_next_agent(
    start_up: Any, tmp_path: Path, cleanup: list[Any]
) -> None:
    up = start_up("--no-agent", "--engine", "sim", *(f"--model-name={m}" for m in MODELS))
    cleanup.append(up.engine_ports)
    run_file = up.data_dir / "run.json"
    _wait_for(run_file.exists, DEADLINE_S, f"run.json:\n{up.log()}")
    up.run = json.loads(run_file.read_text())
    token_file = up.data_dir / "agent-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    state_dir = tmp_path / "agent-state"
    agent = Agent(up, state_dir, tmp_path / "agent.log")
    cleanup.append(agent)
    agent.start()
    up.wait_ready(DEADLINE_S)
    _wait_for(
        lambda: (
            set(_ready_replicas(up)) == set(MODELS) and set(_shard_files(state_dir)) == set(MODELS)
        ),
        DEADLINE_S,
        f"both models ready:\n{up.log()}\n{agent.log()}",
    )
    before = _shard_files(state_dir)
    replicas_before = _ready_replicas(up)
    engines = {model: (f["pid"], _start_time(f["pid"])) for model, f in before.items()}
    assert all(started is not None for _, started in engines.values())
    assert set(_sim_engines(up.engine_ports)) == {pid for pid, _ in engines.values()}

    agent.kill(signal.SIGKILL)
    for model, (pid, started) in engines.items():
        assert _start_time(pid) == started, f"engine of {model} died with its agent"
    for model in MODELS:  # still answering, through the gateway, with no agent
        assert _chat(up, model).status_code == 200

    mark = len(agent.log())
    agent.start()
    _wait_for(
        lambda: (
            agent.log()[mark:].count(": adopted ") == len(MODELS)
            and set(_ready_replicas(up)) == set(MODELS)
            and all(n["connected"] for n in _status(up)["nodes"])
        ),
        DEADLINE_S,
        f"the new agent registered the adopted engines:\n{agent.log()}\n{up.log()}",
    )
    for model in MODELS:
        answer = _chat(up, model)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
    # Nothing was restarted: the same processes, the same replicas and ports.
    assert _shard_files(state_dir) == before
    for model, (pid, started) in engines.items():
        assert _start_time(pid) == started, f"engine of {model} was restarted"
    assert set(_sim_engines(up.engine_ports)) == {pid for pid, _ in engines.values()}
    replicas_after = _ready_replicas(up)
    for model in MODELS:
        assert replicas_after[model]["replica_id"] == replicas_before[model]["replica_id"]
        assert replicas_after[model]["port"] == before[model]["port"]

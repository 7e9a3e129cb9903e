"""A standalone ``llmgw agent`` dies and the next one adopts its engines.

``llmgw up --no-agent`` runs the control plane only; a separate ``llmgw
agent`` process serves two sim models. The agent is SIGKILLed: its engines
keep running; the next agent on the same state directory finds them and
registers them, and the same processes go on answering through the
gateway — nothing is restarted (``reconciler-and-lifecycle.md``, Adoption).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

MODELS = ("a", "b")
DEADLINE_S = 90.0


@pytest.fixture
def cleanup(procs: Any) -> Iterator[list[Any]]:
    """Things to end after the test, last first: agents, then the engines
    (by process group) in the ports of each ``llmgw up``."""
    items: list[Any] = []
    yield items
    for item in reversed(items):
        if not isinstance(item, tuple):
            item.kill(signal.SIGTERM)
    for item in items:
        if isinstance(item, tuple):
            procs.kill_groups(procs.engines_in(item, "sim"))


def _ready_replicas(up: Any) -> dict[str, dict[str, Any]]:
    """The READY replicas by model (one each expected)."""
    return {r["model"]: r for r in up.status()["replicas"] if r["state"] == "READY"}


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
    answer: httpx.Response = up.post(
        "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    return answer


def test_a_killed_agent_s_engines_are_adopted_by_the_next_agent(
    start_up: Any,
    tmp_path: Path,
    cleanup: list[Any],
    procs: Any,
    agent_type: Any,
) -> None:
    up = start_up("--no-agent", "--engine", "sim", *(f"--model-name={m}" for m in MODELS))
    cleanup.append(up.engine_ports)
    up.wait_run(DEADLINE_S)
    token_file = up.data_dir / "agent-token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    state_dir = tmp_path / "agent-state"
    agent = agent_type(up, state_dir, tmp_path / "agent.log", "adoption-node")
    cleanup.append(agent)
    agent.start()
    up.wait_ready(DEADLINE_S)
    up.wait_for(
        lambda: (
            set(_ready_replicas(up)) == set(MODELS) and set(_shard_files(state_dir)) == set(MODELS)
        ),
        DEADLINE_S,
        f"both models ready:\n{up.log()}\n{agent.log()}",
    )
    before = _shard_files(state_dir)
    replicas_before = _ready_replicas(up)
    engines = {model: (f["pid"], procs.start_time(f["pid"])) for model, f in before.items()}
    assert all(started is not None for _, started in engines.values())
    assert set(procs.engines_in(up.engine_ports, "sim")) == {pid for pid, _ in engines.values()}

    agent.kill(signal.SIGKILL)
    for model, (pid, started) in engines.items():
        assert procs.start_time(pid) == started, f"engine of {model} died with its agent"
    for model in MODELS:  # still answering, through the gateway, with no agent
        assert _chat(up, model).status_code == 200

    agent.start()
    up.wait_for(
        lambda: (
            agent.running_log().count(": adopted ") == len(MODELS)
            and set(_ready_replicas(up)) == set(MODELS)
            and all(n["connected"] for n in up.status()["nodes"])
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
        assert procs.start_time(pid) == started, f"engine of {model} was restarted"
    assert set(procs.engines_in(up.engine_ports, "sim")) == {pid for pid, _ in engines.values()}
    replicas_after = _ready_replicas(up)
    for model in MODELS:
        assert replicas_after[model]["replica_id"] == replicas_before[model]["replica_id"]
        assert replicas_after[model]["port"] == before[model]["port"]

"""``llmgw server`` with a node linked over mutual TLS, as real processes on
loopback: ``llmgw node add`` and ``llmgw join CODE --no-start`` write the
node's files, ``llmgw agent --config agent.yaml`` (a dead control plane
listed first) registers under its certificate's node id with its address
and interface, serves a sim model the gateway answers through, keeps the
leader's list of control planes; ``ctl nodes remove`` takes it out, and its
next link is refused as revoked."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

if TYPE_CHECKING:
    from tests.e2e.processes import Process, free_ports, llmgw, started_processes, wait_until
else:  # tests is no package: pytest puts this folder on sys.path
    from processes import Process, free_ports, llmgw, started_processes, wait_until

NODE = "node-e2e"
MODEL = "sim-remote"


@pytest.fixture(name="started")
def started_fixture() -> Iterator[list[Process]]:
    yield from started_processes()


def test_a_node_links_over_mutual_tls_serves_and_is_removed(
    tmp_path: Path, started: list[Process]
) -> None:
    data_dir = tmp_path / "cp"
    node_dir = tmp_path / "node"
    server = Process(
        [
            sys.executable, "-m", "llmgw.cli", "server", "--data-dir", str(data_dir),
            "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0", "--agent-listen", "127.0.0.1:0",
            "--join-listen", "127.0.0.1:0", "--engine-ports", "23100-23199",
        ],
        tmp_path / "server.log",
    )  # fmt: skip
    started.append(server)
    wait_until(lambda: server.alive() and "ready in" in server.log(), 60, "the server's ready line")
    run = json.loads((data_dir / "run.json").read_text())
    hub = f"wss://{run['agent_hub']}/agent"

    added = llmgw("node", "add", "--labels", "rack=r1", "--json", "--data-dir", str(data_dir))
    assert added.returncode == 0, added.stderr
    code = json.loads(added.stdout)["command"].split()[-1]
    joined = llmgw("join", code, "--data-dir", str(node_dir), "--node-id", NODE, "--no-start")
    assert joined.returncode == 0, joined.stderr
    agent_yaml = node_dir / "agent.yaml"
    doc = yaml.safe_load(agent_yaml.read_text())
    assert doc["servers"] == [hub]
    # A dead control plane first: the agent tries it, then the next.
    dead = f"wss://127.0.0.1:{free_ports(1)[0]}/agent"
    doc["servers"] = [dead, hub]
    agent_yaml.write_text(yaml.safe_dump(doc))
    agent = Process(
        [sys.executable, "-m", "llmgw.cli", "agent", "--config", str(node_dir / "agent.yaml")],
        tmp_path / "agent.log",
    )
    started.append(agent)

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return llmgw("ctl", *args, "--data-dir", str(data_dir))

    def node() -> dict[str, Any] | None:
        agent.alive()
        result = ctl("nodes", "--json")
        assert result.returncode == 0, result.stderr
        found = [n for n in json.loads(result.stdout)["data"] if n["node_id"] == NODE]
        return found[0] if found and found[0]["connected"] else None

    registered = wait_until(node, 60, f"{NODE} registered:\n{agent.log()}\n{server.log()}")
    assert registered["address"] == "127.0.0.1"
    assert registered["interface"] == "lo"
    assert registered["labels"] == {"rack": "r1"}
    table = ctl("nodes").stdout.splitlines()
    assert table[1].split()[:4] == [NODE, "127.0.0.1", "lo", "up"]
    # The dead control plane was tried first, then the live one.
    assert f"cannot reach the control plane at {dead}" in agent.log()
    kept = node_dir / "agent" / "control-planes.json"
    wait_until(kept.exists, 10, "the control planes' list kept")
    assert json.loads(kept.read_text())["urls"] == [hub]

    added = ctl("model", "add", MODEL, "--engine", "sim", "--min-memory-gb", "0.1")
    assert added.returncode == 0, added.stderr

    def ready() -> list[dict[str, Any]]:
        result = ctl("replicas", "--json")
        return [r for r in json.loads(result.stdout)["data"] if r["state"].lower() == "ready"]

    replicas = wait_until(ready, 120, f"a READY replica:\n{agent.log()}")
    assert replicas[0]["node_id"] == NODE
    key = (data_dir / "client-key").read_text().strip()
    answer = httpx.post(
        f"http://{run['api']}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text

    # The agent stops (its engine keeps running) and the node is removed
    # while it is away: the next agent adopts the engine, is refused, and
    # stops it.
    agent.stop()
    shards = node_dir / "agent" / "shards"
    assert list(shards.iterdir()) != []

    def disconnected() -> bool:
        result = ctl("nodes", "--json")
        found = [n for n in json.loads(result.stdout)["data"] if n["node_id"] == NODE]
        return bool(found) and not found[0]["connected"]

    wait_until(disconnected, 30, f"{NODE} disconnected")
    removed = ctl("nodes", "remove", NODE)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.startswith(f"node {NODE} removed: 1 certificate(s) revoked")
    assert "its agent stops the engines it still runs when it next connects" in removed.stdout
    agent = Process(
        [sys.executable, "-m", "llmgw.cli", "agent", "--config", str(node_dir / "agent.yaml")],
        tmp_path / "agent-again.log",
    )
    started.append(agent)
    wait_until(
        lambda: "certificate revoked at" in agent.log(),
        60,
        f"the agent told its certificate is revoked:\n{agent.log()}",
    )
    assert "the control plane refused this node" in agent.log()
    wait_until(
        lambda: "stopped its 1 engine(s); this node is not in the cluster" in agent.log(),
        60,
        f"the agent stopped its engines:\n{agent.log()}",
    )
    assert list(shards.iterdir()) == []
    listed = json.loads(ctl("nodes", "--json").stdout)["data"]
    assert [n["node_id"] for n in listed] == []
    unknown = ctl("nodes", "remove", NODE + "-x")
    assert unknown.returncode == 1
    assert "No node" in unknown.stderr

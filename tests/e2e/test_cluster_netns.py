"""A control plane and two nodes on three "machines" (network namespaces on
one bridge, :mod:`netns`; ``docs/testing-clusters.md``).

Machine ``a`` runs the control plane alone (``llmgw server``) listening on
its bridge address, its admin API on its own 127.0.0.1; machines ``b`` and
``c`` join it (``llmgw node add`` in ``a``, ``llmgw join CODE`` in each)
and run the agent over mutual TLS (``wss://<a>:7443/agent``) with their own
data directory. No machine reaches another's loopback, so whatever the
gateway answers came over the bridge.

1. A sim model scaled to 4 replicas spreads 2 and 2 over the nodes
   (placement's spread: the node with the fewest replicas of the model,
   ``docs/catalog.md``, Placement); ``ctl nodes`` shows each node at its
   bridge address, the engines listen in their own machine, and the
   official ``openai`` client run in ``a`` gets answers, streamed and not,
   from replicas on both nodes.
2. Node ``b``'s cable is pulled for 20 s: its engines keep running (same
   processes), ``ctl nodes`` shows it disconnected and then connected
   again, its replicas are neither restarted nor placed elsewhere, and no
   replica changes state while its node's link is up (a watcher in ``a``
   reads the admin API every half second throughout).

3. Refusals, with one control plane and two other machines: from ``c``,
   a code already used by ``b``'s join, an expired code and a code whose
   CA fingerprint is not the cluster's are each refused by ``llmgw join``
   with its own message, writing nothing; an agent in ``c`` with a
   self-made certificate is refused by the control plane at every try and
   never registers; node ``b``, removed with ``ctl nodes remove``, is
   refused as revoked (its agent reconnecting, then restarted) and stays
   out of ``ctl nodes``.

The harness's own promises (isolation, removal) are checked by a quick
test beside it, not marked slow.

Also printed, not asserted: the seconds from starting node ``b``'s agent to
its first replica READY.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.agent.joincode import JoinCode

if TYPE_CHECKING:
    from tests.e2e import netns
else:  # tests is no package: pytest puts this folder on sys.path
    import netns

MODEL = "sim-net"
REPLICAS = 4
NODES = ("node-b", "node-c")
#: Deadline for one condition (a start, a registration, a reconnection), s.
DEADLINE_S = 120.0
#: How long node b's cable is out, s (shorter than the control plane's 30 s
#: before it counts a node lost and places its replicas elsewhere).
CUT_S = 20.0
#: Watcher samples wanted after node b is back, to see that nothing flaps.
SAMPLES_AFTER = 20
CHATS = 8
#: Where the control plane listens in machine a (the defaults of ``llmgw server``).
PORTS = {"api": 8080, "admin": 9090, "metrics": 9091, "agents": 7443, "join": 7444}

#: Run in machine a: the admin API's nodes and replicas every half second,
#: one JSON line each, until SIGTERM.
WATCHER = """
import json, signal, sys, time
from pathlib import Path
from llmgw.admin.client import AdminClient
running = True
def stop(*_):
    global running
    running = False
signal.signal(signal.SIGTERM, stop)
client = AdminClient.from_data_dir(Path(sys.argv[1]))
with open(sys.argv[2], "a") as out:
    while running:
        t = time.time()
        try:
            doc = {"t": t, "nodes": client.call("GET", "/api/v1/nodes")["data"],
                   "replicas": client.call("GET", "/api/v1/replicas")["data"]}
        except Exception as exc:
            doc = {"t": t, "error": repr(exc)}
        out.write(json.dumps(doc) + "\\n")
        out.flush()
        time.sleep(0.5)
"""

#: Run in machine a: chat completions through the official openai client,
#: CHATS plain then CHATS streamed; prints one JSON list of
#: {"stream", "replica", "content"}. Each request of a round has its own
#: session id (``x-llmgw-session``): the ``chat`` routing profile sends a
#: session to its replica on a hash ring of the replica ids, so the same
#: ids reach the same replicas at every run (``netns-0`` … ``netns-7`` cover
#: all four), where requests without one go to the replica measured
#: fastest, often one alone (``docs/api.md``, Which replica answers).
CHAT = """
import json, sys, openai
base_url, key, model, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
messages = [{"role": "user", "content": "Say hello from the other machine."}]
found = []
for i in range(count):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=8,
        extra_headers={"x-llmgw-session": f"netns-{i}"})
    answer = raw.parse()
    found.append({"stream": False, "replica": raw.headers.get("x-llmgw-replica"),
                  "content": answer.choices[0].message.content})
for i in range(count):
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=messages, max_tokens=8, stream=True,
            extra_headers={"x-llmgw-session": f"netns-{i}"}) as raw:
        text = "".join(chunk.choices[0].delta.content or ""
                       for chunk in raw.parse() if chunk.choices)
        found.append({"stream": True, "replica": raw.headers.get("x-llmgw-replica"),
                      "content": text})
print(json.dumps(found))
"""


@pytest.fixture
def network(tmp_path: Path) -> Iterator[netns.Network]:
    if reason := netns.skip_reason():
        pytest.skip(reason)
    with netns.machines(tmp_path, ("a", "b", "c")) as built:
        yield built
        # pytest shows a test's teardown output only when it failed.
        built.print_logs()


def _llmgw(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmgw.cli", *args]


def _ctl(machine: netns.Machine, *args: str) -> Any:
    """``llmgw ctl ARGS --json`` in ``machine`` with its data directory; the
    ``data`` of the answer."""
    result = machine.run(
        _llmgw("ctl", *args, "--json", "--data-dir", str(machine.data_dir)), timeout_s=60
    )
    assert result.returncode == 0, f"ctl {' '.join(args)}: {result.stderr}"
    doc = json.loads(result.stdout)
    return doc["data"] if isinstance(doc, dict) and "data" in doc else doc


def _nodes(a: netns.Machine) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in _ctl(a, "nodes")}


def _replicas(a: netns.Machine) -> dict[str, dict[str, Any]]:
    return {r["replica_id"]: r for r in _ctl(a, "replicas") if r["model"] == MODEL}


def _engines(state_dir: Path) -> dict[str, tuple[int, int | None, int]]:
    """The engines an agent's state directory records: shard id → (pid,
    its start time, port)."""
    found = {}
    for path in (state_dir / "shards").glob("*.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written
        pid = doc["procs"][0]["pid"]
        found[doc["start"]["shard_id"]] = (pid, _start_time(pid), doc["start"]["port"])
    return found


def _start_time(pid: int) -> int | None:
    """``/proc/<pid>/stat`` field 22; None when gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _watched(path: Path) -> list[dict[str, Any]]:
    samples = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        assert "error" not in doc, f"the admin API did not answer the watcher: {doc}"
        samples.append(doc)
    return samples


def _node(sample: dict[str, Any], node_id: str) -> dict[str, Any]:
    """``node_id``'s row in a watcher sample."""
    found: dict[str, Any] = next(n for n in sample["nodes"] if n["node_id"] == node_id)
    return found


def _start_control_plane(a: netns.Machine) -> netns.Process:
    """The control plane alone in machine ``a`` (``llmgw server``): client
    API, agents' hub and join port on its bridge address, admin API and
    metrics on its own 127.0.0.1 (:data:`PORTS`); the sim model
    :data:`MODEL` (one replica) added with ``ctl model add``; returned once
    that is done."""
    process = a.start(
        "llmgw-server",
        _llmgw(
            "server",
            "--data-dir",
            str(a.data_dir),
            "--listen",
            f"{a.address}:{PORTS['api']}",
            "--admin-listen",
            f"127.0.0.1:{PORTS['admin']}",
            "--metrics-listen",
            f"127.0.0.1:{PORTS['metrics']}",
            "--agent-listen",
            f"{a.address}:{PORTS['agents']}",
            "--join-listen",
            f"{a.address}:{PORTS['join']}",
        ),
    )
    netns.wait_for(
        lambda: (a.data_dir / "run.json").exists() or not process.running(),
        DEADLINE_S,
        "the control plane's run.json",
    )
    assert process.running(), process.log()
    _ctl(a, "model", "add", MODEL, "--engine", "sim", "--replicas", "1", "--min-memory-gb", "0.1")
    return process


def _node_add(a: netns.Machine, *args: str) -> dict[str, Any]:
    """``llmgw node add --json ARGS`` in ``a``: its answer (``code``,
    ``expires_at`` …)."""
    added = a.run(
        _llmgw("node", "add", "--json", *args, "--data-dir", str(a.data_dir)), timeout_s=60
    )
    assert added.returncode == 0, added.stderr
    doc: dict[str, Any] = json.loads(added.stdout)
    return doc


def _start_node(
    a: netns.Machine, machine: netns.Machine, node_id: str, code: str = ""
) -> tuple[netns.Process, Path]:
    """A node ``node_id`` in ``machine``: ``llmgw node add --json`` in ``a``
    gives a join code (or ``code``, made before), ``llmgw join CODE`` in
    ``machine`` joins and runs the agent. Its join process (the agent once
    joined) and its state directory (the shard files, ``shards/*.json``)."""
    code = code or _node_add(a, "--node-id", node_id)["code"]
    process = machine.start(
        "llmgw-join",
        _llmgw("join", code, "--data-dir", str(machine.data_dir), "--node-id", node_id),
    )
    return process, machine.data_dir / "agent"


#: Run in a machine: listen on argv[1]:argv[2], answer one connection with
#: b"pong", exit.
LISTEN_ONCE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
connection, _ = server.accept()
connection.sendall(b"pong")
connection.close()
"""
#: Run in a machine: connect to argv[1]:argv[2] (2 s at most) and print what
#: came, or the error's class name.
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as s:
        print(s.recv(4).decode())
except OSError as exc:
    print(type(exc).__name__)
"""


def test_machines_reach_each_other_only_over_the_bridge(tmp_path: Path) -> None:
    """The harness itself: a reaches b's bridge address, not b's loopback;
    the host reaches neither; everything is gone after the block, the
    processes left running in the machines too."""
    if reason := netns.skip_reason():
        pytest.skip(reason)
    port = 7000
    with netns.machines(tmp_path, ("a", "b")) as network:
        a, b = network["a"], network["b"]
        assert a.address != b.address
        assert a.address.rsplit(".", 1)[0] == b.address.rsplit(".", 1)[0] == network.subnet
        # b's loopback is its own: a reaches its own, where nothing listens.
        on_loopback = b.start(
            "loopback", [sys.executable, "-c", LISTEN_ONCE, "127.0.0.1", str(port)]
        )
        netns.wait_for(lambda: "listening" in on_loopback.log(), 30, "b listening on 127.0.0.1")
        assert a.python(CONNECT, "127.0.0.1", str(port)).stdout.strip() == "ConnectionRefusedError"
        on_bridge = b.start("bridge", [sys.executable, "-c", LISTEN_ONCE, b.address, str(port + 1)])
        netns.wait_for(lambda: "listening" in on_bridge.log(), 30, "b listening on its address")
        assert (b.address, port + 1) in b.listening()
        # The host has no address on the bridge, so no way in.
        host = subprocess.run(
            [sys.executable, "-c", CONNECT, b.address, str(port + 1)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert host.stdout.strip() != "pong", "the host reached a machine"
        assert a.python(CONNECT, b.address, str(port + 1)).stdout.strip() == "pong"
        left_running = b.start("sleeper", ["sleep", "3600"])
        assert left_running.pid in b.pids()
        names = [m.netns for m in network.machines]
    assert left_running.popen.poll() is not None, "a process outlived its machine"
    assert on_loopback.popen.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert not set(names) & {line.split()[0] for line in listed.stdout.splitlines() if line}
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True, check=True)
    assert network.bridge not in links.stdout
    assert f"lgw{network.tag}" not in links.stdout


@pytest.mark.slow
def test_a_model_spreads_over_two_nodes_on_other_machines_and_a_cut_node_comes_back(
    network: netns.Network,
) -> None:
    a, b, c = network["a"], network["b"], network["c"]
    control_plane = _start_control_plane(a)
    agents: dict[str, netns.Process] = {}
    state_dirs: dict[str, Path] = {}

    def start_agent(machine: netns.Machine, node_id: str) -> float:
        """Start ``node_id`` in ``machine``; the wall-clock time it started."""
        started = time.time()
        agents[node_id], state_dirs[node_id] = _start_node(a, machine, node_id)
        return started

    def first_ready_on(node_id: str) -> float:
        """The ``ready_at`` of the first replica READY on ``node_id``, once there is one."""

        def found() -> float | None:
            ready = [
                r["ready_at"]
                for r in _replicas(a).values()
                if r["node_id"] == node_id and r["state"] == "READY" and r["ready_at"]
            ]
            return float(min(ready)) if ready else None

        return netns.wait_for(found, DEADLINE_S, f"a replica READY on {node_id}")

    # Node b first: the model's one replica goes there.
    b_started = start_agent(b, "node-b")
    b_ready = first_ready_on("node-b")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"node-b: llmgw join started → first replica READY in {b_ready - b_started:.2f} s "
        f"(load average {load} on {os.cpu_count()} CPUs)"
    )
    # Node c, then 4 replicas: the 3 new ones go where the model has fewest.
    c_started = start_agent(c, "node-c")
    netns.wait_for(
        lambda: _nodes(a).get("node-c", {}).get("connected"), DEADLINE_S, "node-c registered"
    )
    _ctl(a, "scale", MODEL, str(REPLICAS))
    c_ready = first_ready_on("node-c")
    print(
        f"node-c: llmgw join started → first replica READY in {c_ready - c_started:.2f} s "
        "(including its registration and the scale command)"
    )

    def all_ready() -> dict[str, dict[str, Any]] | None:
        replicas = _replicas(a)
        ready = len(replicas) == REPLICAS and all(r["state"] == "READY" for r in replicas.values())
        return replicas if ready else None

    replicas = netns.wait_for(all_ready, DEADLINE_S, f"{REPLICAS} replicas READY")
    assert Counter(r["node_id"] for r in replicas.values()) == dict.fromkeys(NODES, 2), replicas

    # The watcher reads the admin API from now to the end.
    watch_path = a.root / "watch.jsonl"
    watcher = a.start("watcher", [sys.executable, "-c", WATCHER, str(a.data_dir), str(watch_path)])

    nodes = _nodes(a)
    assert set(nodes) == set(NODES)
    for node_id, machine in (("node-b", b), ("node-c", c)):
        assert nodes[node_id]["address"] == machine.address, nodes[node_id]
        assert nodes[node_id]["connected"]

    # Each engine runs in its own node's machine and listens there, on the
    # node's address only; none runs in a.
    engines = {"node-b": _engines(state_dirs["node-b"]), "node-c": _engines(state_dirs["node-c"])}
    for node_id, machine in (("node-b", b), ("node-c", c)):
        mine = {rid for rid, r in replicas.items() if r["node_id"] == node_id}
        assert set(engines[node_id]) == mine, (engines, replicas)
        listening = machine.listening()
        for replica_id, (pid, started, port) in engines[node_id].items():
            assert started is not None, f"engine of {replica_id} is not running"
            assert pid in machine.pids(), f"engine of {replica_id} is not in {machine.netns}"
            assert port == replicas[replica_id]["port"]
            hosts = {host for host, p in listening if p == port}
            assert hosts == {machine.address}, (replica_id, port, listening)
            print(
                f"{replica_id} on {node_id}: engine pid {pid} listening on {sorted(hosts)}:{port}"
            )
    assert not [p for p in a.pids() if "llmgw.engines" in _cmdline(p)], "an engine runs in a"

    # The openai client in machine a, plain and streamed.
    client_key = (a.data_dir / "client-key").read_text().strip()

    def chat_round() -> list[dict[str, Any]]:
        """CHAT in machine a: every answer has content and came from one of
        the replicas, and every replica answered."""
        chat = a.python(
            CHAT,
            f"http://{a.address}:{PORTS['api']}/v1",
            client_key,
            MODEL,
            str(CHATS),
            timeout_s=120,
        )
        assert chat.returncode == 0, chat.stderr
        answers: list[dict[str, Any]] = json.loads(chat.stdout)
        assert len(answers) == 2 * CHATS
        for answer in answers:
            assert answer["content"], answer
            assert answer["replica"] in replicas, answer
        for stream in (False, True):
            answered = {x["replica"] for x in answers if x["stream"] is stream}
            assert answered == set(replicas), answers
        return answers

    answers = chat_round()
    print(
        "answered by:",
        sorted(
            Counter(f"{x['replica']}@{replicas[x['replica']]['node_id']}" for x in answers).items()
        ),
    )
    # The control plane reached the engines over the bridge: connections
    # from a's address to engine ports, seen inside each node's machine (the
    # gateway's pooled ones, or the metrics scraper's).
    for node_id, machine in (("node-b", b), ("node-c", c)):
        engine_ports = {port for _, _, port in engines[node_id].values()}

        def from_a(machine: netns.Machine = machine, engine_ports: set[int] = engine_ports) -> bool:
            return any(
                local[1] in engine_ports and peer[0] == a.address
                for local, peer in machine.connections()
            )

        netns.wait_for(from_a, 30, f"a connection from {a.address} to an engine on {node_id}")

    # Node b's cable out for CUT_S.
    cut_at = time.time()
    b.link_down()
    try:
        netns.wait_for(
            lambda: not _nodes(a)["node-b"]["connected"], DEADLINE_S, "node-b shown disconnected"
        )
        print(f"node-b: shown disconnected {time.time() - cut_at:.1f} s after its cable was pulled")
        time.sleep(max(0.0, cut_at + CUT_S - time.time()))
        # While cut off: its engines and its agent keep running.
        assert {k: v[:2] for k, v in _engines(state_dirs["node-b"]).items()} == {
            k: v[:2] for k, v in engines["node-b"].items()
        }
        assert agents["node-b"].running(), agents["node-b"].log()
    finally:
        b.link_up()
    back_at = time.time()
    nodes = netns.wait_for(
        lambda: (found := _nodes(a))["node-b"]["connected"] and found,
        DEADLINE_S,
        "node-b connected again",
    )
    print(f"node-b: connected again {time.time() - back_at:.1f} s after its cable came back")
    assert nodes["node-b"]["address"] == b.address

    def samples_back() -> bool:
        back = [
            s for s in _watched(watch_path) if s["t"] > back_at and _node(s, "node-b")["connected"]
        ]
        return len(back) >= SAMPLES_AFTER

    netns.wait_for(samples_back, DEADLINE_S, f"{SAMPLES_AFTER} watcher samples with node-b back")
    watcher.stop()

    # Same engine processes on both nodes, same agent.
    for node_id in NODES:
        now = _engines(state_dirs[node_id])
        assert now == engines[node_id], f"{node_id}'s engines changed: {engines[node_id]} → {now}"
    assert agents["node-b"].running(), agents["node-b"].log()
    assert agents["node-c"].running(), agents["node-c"].log()

    # What the control plane showed all along.
    samples = _watched(watch_path)
    b_connected = [_node(s, "node-b")["connected"] for s in samples]
    assert b_connected[0], b_connected
    assert b_connected[-1], b_connected
    assert not all(b_connected), f"the watcher never saw node-b disconnected: {b_connected}"
    downs = [i for i, up in enumerate(b_connected) if not up]
    assert downs == list(range(downs[0], downs[-1] + 1)), (
        f"node-b went down more than once: {b_connected}"
    )
    steady = ("replica_id", "node_id", "port", "restarts", "failures", "started_at", "ready_at")
    for sample, b_up in zip(samples, b_connected, strict=True):
        seen = {r["replica_id"]: r for r in sample["replicas"] if r["model"] == MODEL}
        assert set(seen) == set(replicas), f"replicas changed: {sorted(seen)}"
        for replica_id, replica in seen.items():
            before = replicas[replica_id]
            assert {k: replica[k] for k in steady} == {k: before[k] for k in steady}, (
                f"{replica_id} changed: {before} → {replica}"
            )
            assert not replica["retiring"], replica
            if replica["node_id"] == "node-c" or b_up:
                assert replica["state"] == "READY", f"{replica_id} flapped: {replica}"
        assert _node(sample, "node-c")["connected"], "node-c lost its link"
    shown_while_cut = {
        r["replica_id"]: r["state"]
        for s, b_up in zip(samples, b_connected, strict=True)
        if not b_up
        for r in s["replicas"]
        if r["node_id"] == "node-b"
    }
    print(f"node-b's replicas while it was cut off: {shown_while_cut}")

    # Every replica answers again, node b's too.
    chat_round()

    for agent in agents.values():
        agent.stop(signal.SIGTERM)
    assert control_plane.stop(signal.SIGINT) == 0, control_plane.log()


def _refused_join(machine: netns.Machine, code: str, node_id: str) -> str:
    """``llmgw join CODE`` in ``machine``, which must be refused: its exit
    status not 0, no ``agent.yaml`` nor ``tls/`` left in its data
    directory; its message (the last line of its stderr, after the
    addresses it tried) returned."""
    result = machine.run(
        _llmgw("join", code, "--data-dir", str(machine.data_dir), "--node-id", node_id),
        timeout_s=60,
    )
    assert result.returncode != 0, (result.stdout, result.stderr)
    assert not (machine.data_dir / "agent.yaml").exists(), result.stderr
    assert not (machine.data_dir / "tls").exists(), result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines, result
    return lines[-1]


def _self_made_node(folder: Path, node_id: str, cluster_ca: Path, server: str) -> Path:
    """An ``agent.yaml`` in ``folder`` for ``node_id`` with a certificate of
    its own CA (made here, not the cluster's), trusting ``cluster_ca`` for
    the control plane at ``server``; its path."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "self-made CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    tls = folder / "tls"
    tls.mkdir(parents=True)
    (tls / "ca.crt").write_bytes(cluster_ca.read_bytes())
    (tls / "self-made-ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (tls / "node.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tls / "node.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    (tls / "node.key").chmod(0o600)
    config = folder / "agent.yaml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "servers": [server],
                "tls": {"ca": "tls/ca.crt", "cert": "tls/node.crt", "key": "tls/node.key"},
                "node_id": node_id,
            }
        )
    )
    return config


@pytest.mark.slow
def test_bad_codes_and_certificates_are_refused(network: netns.Network) -> None:
    """Node b joins; then from machine c its code replayed, an expired code
    and a code with another CA's fingerprint are each refused by ``llmgw
    join`` with its own message, writing nothing; an agent in c with a
    self-made certificate is refused by the control plane and never
    registers; node b, removed (``ctl nodes remove``), is refused as
    revoked when its agent links again and stays out of ``ctl nodes``."""
    a, b, c = network["a"], network["b"], network["c"]
    control_plane = _start_control_plane(a)
    b_code = _node_add(a, "--node-id", "node-b")["code"]
    b_agent, _ = _start_node(a, b, "node-b", code=b_code)
    netns.wait_for(
        lambda: _nodes(a).get("node-b", {}).get("connected"), DEADLINE_S, "node-b registered"
    )

    # Three codes that do not work, each run in c.
    replayed = _refused_join(c, b_code, "node-c")
    expired_code = _node_add(a, "--expires", "1s", "--node-id", "node-c")
    netns.wait_for(lambda: time.time() > expired_code["expires_at"] + 1, 30, "the 1 s code expired")
    expired = _refused_join(c, expired_code["code"], "node-c")
    good = JoinCode.decode(_node_add(a, "--node-id", "node-c")["code"])
    other_fingerprint = "sha256:" + hashlib.sha256(b"another cluster's CA").hexdigest()
    assert other_fingerprint != good.fingerprint
    forged = JoinCode(good.addresses, good.token, other_fingerprint).encode()
    wrong_ca = _refused_join(c, forged, "node-c")
    print(f"replayed: {replayed}\nexpired: {expired}\nwrong CA: {wrong_ca}")
    assert f"has CA {good.fingerprint}" in wrong_ca, wrong_ca
    assert f"this code was made for {other_fingerprint}" in wrong_ca, wrong_ca
    assert len({replayed, expired, wrong_ca}) == 3
    # Each message has its own words, and only its own.
    words = {"already used": replayed, "expired at": expired, "made for": wrong_ca}
    for word, message in words.items():
        assert [w for w in words if w in message] == [word], message
    assert set(_nodes(a)) == {"node-b"}

    # An agent in c with a certificate of its own CA: the TLS handshake is
    # refused, at every try, and it never registers.
    config = _self_made_node(
        c.root / "self-made",
        "node-self",
        a.data_dir / "ca" / "ca.crt",
        f"wss://{a.address}:{PORTS['agents']}/agent",
    )
    self_made = c.start("self-made-agent", _llmgw("agent", "--config", str(config)))
    refused_cert = "the control plane refused this node's certificate"

    def refused_twice(process: netns.Process, words: str, node_id: str) -> bool:
        assert node_id not in _nodes(a), f"{node_id} registered: {process.log()}"
        return process.log().count(words) >= 2

    netns.wait_for(
        lambda: refused_twice(self_made, refused_cert, "node-self"),
        DEADLINE_S,
        "the self-made agent refused twice",
    )
    assert self_made.running(), self_made.log()
    assert f"agent link from {c.address}" in control_plane.log(), control_plane.log()

    # Node b removed: its certificate revoked, its link closed; its agent,
    # left reconnecting, is refused as revoked and stays out.
    assert "certificate revoked" not in b_agent.log()
    removed = _ctl(a, "nodes", "remove", "node-b")
    assert removed["revoked_certificates"] >= 1, removed
    assert "node-b" not in _nodes(a)
    netns.wait_for(
        lambda: refused_twice(b_agent, "certificate revoked", "node-b"),
        DEADLINE_S,
        "node-b's agent refused as revoked twice",
    )
    assert "the control plane refused this node" in b_agent.log(), b_agent.log()
    assert b_agent.running(), b_agent.log()
    # Restarted, it is refused the same way.
    b_agent.stop(signal.SIGTERM)
    restarted = b.start("agent-again", _llmgw("agent", "--config", str(b.data_dir / "agent.yaml")))
    netns.wait_for(
        lambda: refused_twice(restarted, "certificate revoked", "node-b"),
        DEADLINE_S,
        "node-b's restarted agent refused as revoked twice",
    )
    assert set(_nodes(a)) == set(), _nodes(a)

    for process in (self_made, restarted):
        process.stop(signal.SIGTERM)
    assert control_plane.stop(signal.SIGINT) == 0, control_plane.log()

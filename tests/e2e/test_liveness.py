"""A replica whose engine hangs after READY (SIGSTOP: its port accepts,
nothing answers) through ``llmgw up --engine sim``: its agent's liveness
probes take it out of routing with a reason, the requests waiting on it are
retried on the other replica, and it is READY again once it answers, or
restarted when it stays silent past the agent's limit (``docs/catalog.md``, Replica states; ``docs/api.md``, Which replica answers).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

TIMEOUT_S = 30.0
#: How long the replica may take to show not ready: the agent's 6 s of
#: silence, its probe deadline, the report; with room for a busy machine.
NOT_READY_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def up(start_module_up: Callable[..., Any]) -> Any:
    return start_module_up("--engine", "sim", "--model-name", "sim-model")


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(
        timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=100, max_keepalive_connections=100)
    ) as client:
        yield client


def _replica(up: Any, replica_id: str) -> dict[str, Any] | None:
    """``ctl replicas --json``'s row of ``replica_id``."""
    result = up.cli("ctl", "replicas", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = doc["data"] if isinstance(doc, dict) else doc
    found: dict[str, Any] | None = next((r for r in rows if r["replica_id"] == replica_id), None)
    return found


@pytest.mark.slow
def test_a_hung_replica_leaves_routing_its_requests_go_elsewhere_and_it_comes_back(
    up: Any, admin_request: Callable[..., httpx.Response], http: httpx.Client, procs: Any
) -> None:
    """30 concurrent requests (30 s client timeout) on a model of two
    replicas; one engine is SIGSTOPped while they run. Every request ends
    200; the replica shows not ready with the reason; after SIGCONT it is
    READY again and takes traffic."""
    added = admin_request(
        up,
        "POST",
        "/api/v1/models",
        {
            "name": "hang",
            "profiles": [
                {
                    "name": "default",
                    "engine": "sim",
                    "replicas": 2,
                    "min_memory_gb": 0.1,
                    "args": ["--ttft-ms", "300", "--tokens-per-second", "0"],
                }
            ],
        },
    )
    assert added.status_code == 201, added.text
    up.wait_for(
        lambda: admin_request(up, "GET", "/api/v1/models/hang").json()["replicas"]["ready"] == 2,
        60,
        "two ready replicas of hang",
    )
    replicas = admin_request(up, "GET", "/api/v1/replicas").json()["data"]
    ports = {r["replica_id"]: r["port"] for r in replicas if r["model"] == "hang"}
    victims = procs.on_port(ports["hang-0"])
    assert victims, f"no engine process with --port {ports['hang-0']}"
    victim = victims[0]

    def one(i: int) -> httpx.Response:
        body = {
            "model": "hang",
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 4,
        }
        response: httpx.Response = up.post(
            "/v1/chat/completions", body, {"x-llmgw-profile": "batch"}, http=http, timeout=TIMEOUT_S
        )
        return response

    def not_ready() -> dict[str, Any] | None:
        row = _replica(up, "hang-0")
        return row if row is not None and row["state"] != "READY" and row["reason"] else None

    log_before = len(up.log())
    os.kill(victim, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(30) as pool:
            futures = [pool.submit(one, i) for i in range(30)]
            row = up.wait_for(not_ready, NOT_READY_WITHIN_S, "hang-0 not ready with a reason")
            results = [f.result() for f in futures]
    finally:
        os.kill(victim, signal.SIGCONT)
    failed = [(r.status_code, r.text) for r in results if r.status_code != 200]
    assert collections.Counter(r.status_code for r in results) == {200: 30}, failed
    assert "not answering its health check" in row["reason"], row
    # The stopped replica had been given requests: they went to the other one.
    assert "hang-0 left routing before it answered" in up.log()[log_before:], up.log()[log_before:]
    assert {r.headers["x-llmgw-replica"] for r in results} == {"hang-1"}
    # Answering again: READY, the same engine (not restarted), and it takes traffic.
    up.wait_for(
        lambda: (_replica(up, "hang-0") or {}).get("state") == "READY", 60, "hang-0 READY again"
    )
    assert procs.on_port(ports["hang-0"]) == [victim]

    def served_by_hang_0() -> bool:
        return bool(one(0).headers.get("x-llmgw-replica") == "hang-0")

    up.wait_for(served_by_hang_0, 30, "a request answered by hang-0")
    assert (_replica(up, "hang-0") or {}).get("restarts", 0) == 0


@pytest.mark.slow
def test_a_replica_silent_past_the_limit_is_restarted(
    up: Any, admin_request: Callable[..., httpx.Response], procs: Any
) -> None:
    """An engine that stays stopped (SIGSTOP) past the agent's 60 s limit is
    stopped and restarted through the crash back-off: a new engine process
    on the replica, READY, one restart counted."""
    added = admin_request(
        up,
        "POST",
        "/api/v1/models",
        {
            "name": "frozen",
            "profiles": [{"name": "default", "engine": "sim", "min_memory_gb": 0.1}],
        },
    )
    assert added.status_code == 201, added.text
    up.wait_for(
        lambda: (_replica(up, "frozen-0") or {}).get("state") == "READY", 60, "frozen-0 READY"
    )
    row = _replica(up, "frozen-0")
    assert row is not None
    (victim,) = procs.on_port(row["port"])
    log_before = len(up.log())
    os.kill(victim, signal.SIGSTOP)
    try:

        def restarted() -> dict[str, Any] | None:
            found = _replica(up, "frozen-0")
            ok = found is not None and found["state"] == "READY" and found["restarts"] >= 1
            return found if ok else None

        after = up.wait_for(restarted, 150, "frozen-0 restarted and READY")
    finally:
        if procs.start_time(victim) is not None:
            os.kill(victim, signal.SIGCONT)
    assert procs.start_time(victim) is None  # the stopped engine was killed
    assert procs.on_port(after["port"]) != [victim]
    log = up.log()[log_before:]
    assert "not answering its health check for" in log, log
    assert "(restarted after 60 s)" in log, log

"""``llmgw up``'s stop is bounded: SIGINT with a long stream in flight
returns within the grace plus a few seconds, every time, and leaves no
engine process and no listening port behind (``docs/up.md``, Stopping)."""

from __future__ import annotations

import signal
import socket
import threading
from typing import Any

import httpx
import pytest

from llmgw.app.control_plane import GRACE_S
from llmgw.app.up import STOP_AFTER_GRACE_S

#: How long a stop may take from the signal to the exit, in seconds: the
#: grace plus 5 s (``llmgw up`` itself promises the grace plus
#: STOP_AFTER_GRACE_S, which is less).
STOP_DEADLINE_S = GRACE_S + 5.0
#: Starts of ``llmgw up --engine sim`` in the repeated test.
SIM_RUNS = 10

SIM_MODEL = "sim-model"
STARTER_MODEL = "gemma-3-270m"


def _refused(address: str) -> bool:
    """Whether a connection to ``host:port`` is refused (nothing listens)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


class _Stream:
    """A streamed chat answer read in a thread until it ends or breaks."""

    def __init__(self, up: Any, model: str) -> None:
        self.lines = 0
        self.first = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(up, model), daemon=True)
        self._thread.start()

    def _read(self, up: Any, model: str) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Write a very long story about a river."}],
            "max_tokens": 1000,
            "stream": True,
        }
        headers = {"authorization": f"Bearer {up.client_key}"}
        try:
            with httpx.stream(
                "POST", f"{up.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        self.lines += 1
                        self.first.set()
        except httpx.HTTPError:
            pass
        finally:
            self.first.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _stop_with_a_stream_in_flight(up: Any, procs: Any, model: str) -> None:
    """Start a long stream, SIGINT ``up`` while it runs, and check the stop:
    within :data:`STOP_DEADLINE_S`, exit 0, the engines gone, every port refused."""
    up.wait_ready()
    replicas = up.status()["replicas"]
    assert len(replicas) == 1, replicas
    engine_port = replicas[0]["port"]
    engine_pids = procs.on_port(engine_port)
    assert engine_pids
    addresses = [
        up.run["api"],
        up.run["admin"],
        up.run["metrics"],
        up.run["agent_hub"],
        f"127.0.0.1:{engine_port}",
    ]
    stream = _Stream(up, model)
    assert stream.first.wait(60), up.log()
    assert stream.lines > 0, up.log()
    up.process.send_signal(signal.SIGINT)
    up.process.wait(timeout=STOP_DEADLINE_S)
    stream.join(5)
    assert up.process.returncode == 0, up.log()
    assert "stopped" in up.log()
    assert not (up.data_dir / "run.json").exists()
    # `llmgw up` reaped its engines before it exited.
    assert [p for p in engine_pids if procs.start_time(p) is not None] == [], up.log()
    assert [a for a in addresses if not _refused(a)] == [], up.log()
    # Cut at the end of the grace, the stop still reads as a stop: the agent
    # leaves before the hub closes (it said "link … lost: HandshakeError:").
    stop = up.log()[up.log().index("no new requests") :]
    assert "closed: the agent is stopping" in stop, stop
    for wrong in ("lost", "cannot reach", "ABNORMAL"):
        assert wrong not in stop, stop


def test_the_bound_leaves_room_for_the_exit() -> None:
    """The promise (grace + STOP_AFTER_GRACE_S) fits in what the tests allow."""
    assert GRACE_S + STOP_AFTER_GRACE_S < STOP_DEADLINE_S


def test_sigint_with_a_long_stream_in_flight_stops_within_the_bound_ten_times(
    start_up: Any, procs: Any
) -> None:
    """Ten starts of the sim engine (1,000 tokens at 20 a second, 50 s an
    answer): each SIGINT comes with a stream in flight that the grace cuts,
    and each stop returns within the grace plus 5 s with nothing left."""
    for run in range(SIM_RUNS):
        up = start_up(
            "--engine",
            "sim",
            "--model-name",
            SIM_MODEL,
            "--engine-arg=--tokens-per-second",
            "--engine-arg=20",
            "--engine-arg=--tokens",
            "--engine-arg=1000",
            name=f"data{run}",
        )
        _stop_with_a_stream_in_flight(up, procs, SIM_MODEL)


@pytest.mark.slow
def test_sigint_with_the_starter_model_streaming_stops_within_the_bound(
    start_up: Any, procs: Any
) -> None:
    """The same with llama.cpp and the starter model, twice: its engine is
    stopped within the bound too."""
    for run in range(2):
        up = start_up(name=f"starter{run}")
        _stop_with_a_stream_in_flight(up, procs, STARTER_MODEL)

"""Background measurements never compete with requests: the memory-bandwidth
probe waits for an idle node, runs at the lowest CPU priority, and gives way
when the node gets busy (``docs/up.md``, "Background measurements").

The node's load is read from ``/proc/stat``. Where a test must decide when
"a request is in flight", it gives :func:`run_when_idle` a clock of its own:
the CPU the others use (an engine answering takes whole cores) plus what the
measurement's threads really used, so only the others' share is made up.
The measurement itself is the real one, in real threads.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.agent import background
from llmgw.agent import main as agent_main
from llmgw.agent.background import (
    Yielding,
    busy_cpu_seconds,
    busy_cpus_threshold,
    lowest_cpu_priority,
    run_when_idle,
)
from llmgw.agent.bandwidth import (
    Bandwidth,
    BandwidthError,
    BandwidthInterrupted,
    measure_bandwidth,
)
from llmgw.agent.main import AgentConfig
from llmgw.agent.weights import assemble_starter_model
from llmgw.engines.testing import engine_process_env, read_line, stop_process

MIB = 1024**2
#: ``SCHED_IDLE`` in ``/proc/PID/task/TID/stat``'s policy field.
SCHED_IDLE = 5
DEADLINE_S = 60.0

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="thread priorities and /proc are Linux's"
)


def _nice_and_policy(tid: int) -> tuple[int, int]:
    """A thread's nice value and scheduling policy, from /proc."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": field 3 is fields[0]
    return int(fields[19 - 3]), int(fields[41 - 3])


class _Node:
    """A made-up node load for :func:`run_when_idle`: the others use
    ``others_cpus`` CPUs while :attr:`in_flight` is set, none otherwise;
    the measurement's own threads count with their real CPU time."""

    def __init__(self, others_cpus: float = 2.0) -> None:
        self.others_cpus = others_cpus
        self.in_flight = False
        self.others_s = 0.0
        self.at = trio.current_time()
        self.run: Yielding | None = None

    def clock(self) -> float:
        now = trio.current_time()
        if self.in_flight:
            self.others_s += self.others_cpus * (now - self.at)
        self.at = now
        return self.others_s + (self.run.cpu_s if self.run is not None else 0.0)


@pytest.fixture
def short_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "WINDOW_S", 0.05)


def test_busy_cpu_seconds_reads_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    ticks = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(f"cpu  {ticks} {ticks} {ticks} 9999 500 {ticks} {ticks} {ticks} 7 7\ncpu0 1\n")
    assert busy_cpu_seconds(stat) == pytest.approx(6.0)
    assert busy_cpu_seconds(tmp_path / "none") == 0.0
    assert busy_cpu_seconds() > 0 or not sys.platform.startswith("linux")


def test_busy_threshold_is_a_tenth_of_the_cpus_at_least_a_quarter_of_one() -> None:
    assert busy_cpus_threshold(2) == 0.25
    assert busy_cpus_threshold(64) == pytest.approx(6.4)


@linux_only
def test_lowest_priority_is_for_the_calling_thread_only() -> None:
    me = threading.get_native_id()
    before = _nice_and_policy(me)
    seen: list[tuple[int, int]] = []

    def lowered() -> None:
        lowest_cpu_priority()
        seen.append(_nice_and_policy(threading.get_native_id()))

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen == [(19, SCHED_IDLE)]
    assert _nice_and_policy(me) == before


@linux_only
def test_the_measurement_runs_at_the_lowest_priority_and_stops_when_asked() -> None:
    """Every thread that touches or sums the buffer is SCHED_IDLE at nice 19
    while it works; the caller's thread is not lowered; a set stop ends the
    measurement with BandwidthInterrupted."""
    run = Yielding()
    outcome: list[BaseException | Bandwidth] = []
    caller: list[tuple[int, int]] = []

    def measure() -> None:
        caller.append(_nice_and_policy(threading.get_native_id()))
        try:
            while True:  # measure again and again until stopped
                measure_bandwidth(buffer_bytes=64 * MIB, seconds=0.1, run=run)
        except BaseException as exc:
            outcome.append(exc)
        caller.append(_nice_and_policy(threading.get_native_id()))

    thread = threading.Thread(target=measure)
    thread.start()
    try:
        seen: dict[int, tuple[int, int]] = {}
        end = time.monotonic() + DEADLINE_S
        while not seen and time.monotonic() < end:
            for tid in list(run.thread_ids):
                try:
                    seen[tid] = _nice_and_policy(tid)
                except FileNotFoundError:  # that pass's thread has ended
                    pass
            time.sleep(0.001)
        assert seen, "no measuring thread was seen"
        assert set(seen.values()) == {(19, SCHED_IDLE)}
    finally:
        run.stop.set()
        thread.join(DEADLINE_S)
    assert not thread.is_alive()
    [result] = outcome
    assert isinstance(result, BandwidthInterrupted)
    assert caller[0] == caller[1] != (19, SCHED_IDLE)  # the caller's thread is as it was
    assert run.cpu_s > 0


async def test_it_does_not_start_while_a_request_is_in_flight(short_windows: None) -> None:
    node = _Node()
    node.in_flight = True
    started = trio.Event()

    def work(run: Yielding) -> str:
        trio.from_thread.run_sync(started.set)
        return "measured"

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:

            async def measure() -> None:
                result = await run_when_idle(
                    "test",
                    work,
                    busy_cpus=0.25,
                    interrupted=BandwidthInterrupted,
                    clock=node.clock,
                )
                assert result == "measured"

            nursery.start_soon(measure)
            # Many windows go by with the request in flight: nothing starts.
            for _ in range(40):
                await trio.sleep(background.WINDOW_S / 2)
                node.clock()
            assert not started.is_set()
            node.in_flight = False
            await started.wait()


async def test_it_gives_way_when_a_request_arrives_and_finishes_later(
    short_windows: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The real measurement starts on the idle node; a request arrives; the
    measurement stops within a window or two (its threads see the stop
    between 32 MiB pieces), waits while the request runs, then measures."""
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    node = _Node()
    tries: list[Yielding] = []
    working = trio.Event()
    interrupted = trio.Event()

    def work(run: Yielding) -> Bandwidth:
        node.run = run
        tries.append(run)
        first = len(tries) == 1
        if first:
            trio.from_thread.run_sync(working.set)
        try:
            if first:  # measures again and again: it must be stopped
                while True:
                    measure_bandwidth(buffer_bytes=64 * MIB, seconds=0.1, threads=2, run=run)
            return measure_bandwidth(buffer_bytes=32 * MIB, seconds=0.1, threads=2, run=run)
        except BandwidthInterrupted:
            trio.from_thread.run_sync(interrupted.set)
            raise

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            results: list[Bandwidth] = []

            async def measure() -> None:
                results.append(
                    await run_when_idle(
                        "memory bandwidth measurement",
                        work,
                        busy_cpus=0.25,
                        interrupted=BandwidthInterrupted,
                        retry_after_s=0.0,
                        clock=node.clock,
                    )
                )

            nursery.start_soon(measure)
            await working.wait()
            node.in_flight = True  # a request arrives
            await interrupted.wait()
            assert tries[0].stop.is_set()
            # While it runs, no second try starts.
            for _ in range(20):
                await trio.sleep(background.WINDOW_S / 2)
                node.clock()
            assert len(tries) == 1
            node.in_flight = False  # the request is done
        [result] = results
    assert len(tries) == 2
    assert result.machine_gbps > 0
    assert "memory bandwidth measurement gave way: the node got busy" in caplog.text


@linux_only
async def test_a_busy_node_read_from_proc_stat_keeps_it_waiting(short_windows: None) -> None:
    """Real load: processes spinning on every CPU (as an engine answering on
    the CPU does) keep the node busy by /proc/stat, so the measurement does
    not start while they run."""
    spin = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass\n"
    spinners = [
        await trio.lowlevel.open_process([sys.executable, "-c", spin])
        for _ in range(os.cpu_count() or 1)
    ]
    started = trio.Event()

    def work(run: Yielding) -> None:
        trio.from_thread.run_sync(started.set)

    try:
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:

                async def measure() -> None:
                    await run_when_idle(
                        "test", work, busy_cpus=0.25, interrupted=BandwidthInterrupted
                    )

                nursery.start_soon(measure)
                for _ in range(20):  # 20 windows of 50 ms
                    await trio.sleep(background.WINDOW_S)
                assert not started.is_set()
                nursery.cancel_scope.cancel()
    finally:
        for spinner in spinners:
            spinner.kill()
            with trio.move_on_after(10):
                await spinner.wait()


#: Where the engine tests keep the assembled starter GGUF (tests/engines/conftest.py).
CACHE_DIR = Path("/tmp/llmgw-test-cache")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@linux_only
@pytest.mark.slow
# In a full run, a socket of this test's own httpx client to llama.cpp was
# once reported unclosed by the collector at teardown (not reproduced alone,
# 4 runs); the test's client, not the code under test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_the_real_probe_waits_while_the_starter_model_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case, real throughout: llama.cpp streams an answer from
    the starter model while the probe (reading /proc/stat) is due: it does
    not start while the answer streams. Then, where the node becomes idle
    (skipped on a machine others keep busy), it starts, and a new request
    makes it give way."""
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    model = await trio.to_thread.run_sync(assemble_starter_model, CACHE_DIR)
    port = _free_port()
    cpus = os.cpu_count() or 1
    argv = [
        *(sys.executable, "-m", "llmgw.engines.llamacpp", "-m", str(model)),
        *("--port", str(port), "--parallel", "1", "--threads", "1", "-c", "4096"),
    ]
    with (tmp_path / "llama.log").open("wb") as log:
        engine = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=log, env=engine_process_env("")
        )
    tries: list[Yielding] = []
    started = trio.Event()
    measured: list[Bandwidth] = []
    long_answer = {"prompt": "Once upon a time", "n_predict": 4000, "ignore_eos": True}
    skipped = ""

    def work(run: Yielding) -> Bandwidth:
        tries.append(run)
        trio.from_thread.run_sync(started.set)
        # Measures again and again for a minute, so that the request below
        # surely comes while it runs.
        end = time.monotonic() + 60
        while True:
            result = measure_bandwidth(buffer_bytes=64 * MIB, seconds=0.2, run=run)
            if time.monotonic() > end:
                return result

    async def probe() -> None:
        measured.append(
            await run_when_idle(
                "memory bandwidth measurement",
                work,
                busy_cpus=busy_cpus_threshold(cpus),
                interrupted=BandwidthInterrupted,
                retry_after_s=3600.0,  # one try is enough here
            )
        )

    try:
        assert engine.stdout is not None
        with trio.fail_after(180):
            buffer = bytearray()
            while "listening on" not in await read_line(engine.stdout, buffer):
                pass
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client,
                trio.open_nursery() as nursery,
            ):
                # 400 tokens, read to the end (breaking out of httpx's
                # stream leaves its inner generators to the collector).
                streamed = {**long_answer, "n_predict": 400, "stream": True}
                async with client.stream("POST", "/completion", json=streamed) as answer:
                    lines = answer.aiter_lines()
                    await anext(lines)  # the first token: the answer is streaming
                    nursery.start_soon(probe)
                    tokens = 1
                    async for line in lines:
                        tokens += line.startswith("data: ")
                    # 400 tokens streamed, many windows: the probe never started.
                    assert tokens >= 400
                    assert not started.is_set()
                # The stream is closed: llama.cpp stops generating.
                with trio.move_on_after(30):
                    await started.wait()
                if not started.is_set():
                    skipped = "the node never became idle (others keep it busy)"
                else:
                    reply = await client.post("/completion", json={**long_answer, "n_predict": 200})
                    assert reply.status_code == 200
                    assert not measured
                    assert tries[0].stop.is_set()
                nursery.cancel_scope.cancel()
        if skipped:
            pytest.skip(skipped)
        assert "memory bandwidth measurement gave way: the node got busy" in caplog.text
    finally:
        await stop_process(engine)


async def test_an_error_of_the_work_reaches_the_caller_as_itself(short_windows: None) -> None:
    # Not inside an exception group: the agent's ``except BandwidthError``
    # must catch it (a machine whose largest cache asks for a bigger buffer
    # than a quarter of its memory once stopped ``llmgw up`` this way).
    node = _Node()

    def work(run: Yielding) -> str:
        raise BandwidthError("a buffer of at least 3840 MiB is needed")

    with trio.fail_after(DEADLINE_S), pytest.raises(BandwidthError, match="3840 MiB"):
        await run_when_idle(
            "test", work, busy_cpus=0.25, interrupted=BandwidthInterrupted, clock=node.clock
        )


async def test_the_agent_logs_a_measurement_it_cannot_make_and_goes_on(
    short_windows: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tries: list[float] = []
    tried_twice = trio.Event()

    def measure(run: Yielding) -> Bandwidth:
        tries.append(time.monotonic())
        if len(tries) == 2:
            trio.from_thread.run_sync(tried_twice.set)
        raise BandwidthError("a buffer of at least 3840 MiB is needed")

    monkeypatch.setattr(
        agent_main,
        "_bandwidth_measurer",
        lambda: (measure, BandwidthError, BandwidthInterrupted),
    )
    config = AgentConfig(
        server_url="ws://127.0.0.1:1/agent",
        token="",
        bandwidth_first_delay_s=(0.0, 0.0),
        bandwidth_interval_s=0.01,
        bandwidth_busy_cpus=64.0,  # whatever else runs, the node counts as idle
    )
    telemetry = agent_main._Telemetry()
    telemetry.registered.set()
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    with trio.move_on_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent_main._serve_bandwidth, config, telemetry, 2)
            await tried_twice.wait()
            nursery.cancel_scope.cancel()
    assert len(tries) >= 2  # tried again after the first failure, still running
    assert "memory bandwidth not measured: a buffer" in caplog.text
    assert "trying again later" in caplog.text
    assert telemetry.memory_bandwidth_gbps == 0.0

"""Engine processes: /proc reading, process groups, strays, stopping."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from llmgw.agent import processes

DEADLINE_S = 20

#: Prints its pid, forks a child that leaves the group (setsid) and prints
#: its pid, then sleeps; with "ignore" it ignores SIGTERM.
FAMILY = r"""
import os, signal, sys, time
if "ignore" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


async def first_number(path: Path) -> int:
    """The first number written to ``path``, once there is one."""
    while True:
        words = (await trio.Path(path).read_text()).split()
        if words:
            return int(words[0])
        await trio.sleep(0.05)


def alive(pid: int) -> bool:
    stat = processes.read_stat(pid)
    return stat is not None and stat.state != "Z"


def test_read_stat_of_this_process() -> None:
    """Parent, group and a start time from ``/proc/<pid>/stat``; gone is None."""
    stat = processes.read_stat(os.getpid())
    assert stat is not None
    assert (stat.ppid, stat.pgrp) == (os.getppid(), os.getpgrp())
    assert stat.start_time > 0
    assert processes.read_stat(2**22 + 1) is None  # above pid_max


def test_same_process_by_start_time() -> None:
    """The same pid with another start time is another process."""
    stat = processes.read_stat(os.getpid())
    assert stat is not None
    assert processes.same_process(os.getpid(), stat.start_time)
    assert processes.same_process(os.getpid(), 0)
    assert not processes.same_process(os.getpid(), stat.start_time + 1)


def test_inherited_env_drops_engine_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine never inherits the agent's engine keys; Python output is unbuffered."""
    monkeypatch.setenv("VLLM_API_KEY", "leak")
    monkeypatch.setenv("LLMGW_SOMETHING", "kept")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    env = processes.inherited_env()
    assert "VLLM_API_KEY" not in env
    assert env["LLMGW_SOMETHING"] == "kept"
    assert env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize("ignore_term", [False, True])
async def test_stop_groups_kills_the_group_and_its_strays(
    tmp_path: Path, ignore_term: bool
) -> None:
    """A process in its own group and a stray that left it are both gone
    after a stop (with SIGKILL when SIGTERM is ignored), the child reaped,
    within the grace and REAP_DEADLINE_S."""
    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    out_path = tmp_path / "out"
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT, 0o600)
    argv = [sys.executable, str(script), *(["ignore"] if ignore_term else [])]
    with trio.fail_after(DEADLINE_S):
        try:
            process = await processes.start_in_new_group(argv, env={}, output_fd=out)
        finally:
            os.close(out)
        stray = await first_number(out_path)
        try:
            assert os.getpgid(process.pid) == process.pid
            found = processes.find_strays(frozenset({process.pid}))
            assert stray in {p.pid for p in found}
            # Bounded: the grace, then at most REAP_DEADLINE_S (1 s to spare
            # for reading /proc on a busy machine).
            with trio.fail_after(0.3 + processes.REAP_DEADLINE_S + 1):
                await processes.stop_groups(
                    frozenset({process.pid}), [process], grace_s=0.3, label="test"
                )
            assert process.returncode == (-signal.SIGKILL if ignore_term else -signal.SIGTERM)
            assert not alive(stray)
            assert not processes.any_alive(frozenset({process.pid}), found)
        finally:
            for pid in (process.pid, stray):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


async def test_wait_not_child_returns_when_gone(tmp_path: Path) -> None:
    """Waiting for a process by pid ends when it exits; a wrong start time
    (a reused pid) ends at once."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", "import time; time.sleep(0.3)"]
    )
    stat = processes.read_stat(process.pid)
    assert stat is not None
    with trio.fail_after(DEADLINE_S):
        await processes.wait_not_child(process.pid, stat.start_time + 1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(process.wait)  # reaps it, so it is not a zombie
            await processes.wait_not_child(process.pid, stat.start_time)
    assert process.returncode == 0

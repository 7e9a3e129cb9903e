"""Engine processes: start them in their own process group, find them in
``/proc``, wait for them, stop them with their strays.

- :func:`start_in_new_group` runs a command in a new session (its own
  process group), stdin from ``/dev/null``, stdout and stderr to a file, with
  the agent's environment less any engine key (:func:`inherited_env`);
- :func:`read_stat` and :func:`same_process` tell a running process apart
  from a later one given the same pid (by its start time in clock ticks since
  boot, ``/proc/<pid>/stat`` field 22);
- :func:`wait_not_child` waits for a process that is not our child (an
  adopted engine) through a pidfd, or by polling ``/proc``;
- :func:`stop_groups` stops process groups and their **strays**
  (descendants that left the group, found in ``/proc`` up to
  :data:`STRAY_MAX_DEPTH` levels down): SIGTERM, a grace period polled every
  :data:`STOP_POLL_S`, then SIGKILL, and our own children reaped.

Linux only (``/proc``, ``os.pidfd_open``).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Final

import attrs
import trio

__all__ = [
    "PID_POLL_S",
    "REAP_DEADLINE_S",
    "STOP_GRACE_S",
    "STOP_POLL_S",
    "STRAY_MAX_DEPTH",
    "Pid",
    "Stat",
    "any_alive",
    "find_strays",
    "inherited_env",
    "process_table",
    "read_stat",
    "same_process",
    "signal_all",
    "start_in_new_group",
    "stop_groups",
    "wait_not_child",
]

log = logging.getLogger(__name__)

#: How long a stopped engine gets between SIGTERM and SIGKILL, in seconds.
STOP_GRACE_S: Final = 5.0
#: How often a stopping engine is checked for exit, in seconds.
STOP_POLL_S: Final = 0.1
#: How long SIGKILL and reaping may take after the SIGTERM grace, in seconds.
REAP_DEADLINE_S: Final = 2.0
#: How deep the search for strays goes below a group's processes.
STRAY_MAX_DEPTH: Final = 32
#: How often a process that is not our child is checked for exit when the
#: kernel has no pidfds, in seconds.
PID_POLL_S: Final = 0.5

#: Engine key variables never passed down from the agent's own environment:
#: a keyless shard must not inherit some other key.
_KEY_VARIABLES: Final = frozenset(
    {"LLAMA_API_KEY", "VLLM_API_KEY", "FREETOKEN_API_KEY", "STRATA_API_KEY"}
)


@attrs.frozen
class Pid:
    """A process, told apart from a later one with the same id by its start time."""

    pid: int
    start_time: int


@attrs.frozen
class Stat:
    """What ``/proc/<pid>/stat`` says of a process: its parent, its process
    group, its state letter (``R``, ``S``, ``Z``…) and its start time (clock
    ticks since boot)."""

    ppid: int
    pgrp: int
    state: str
    start_time: int


# --- starting ---------------------------------------------------------------------


def inherited_env() -> dict[str, str]:
    """The agent's environment less engine keys, with ``PYTHONUNBUFFERED=1``
    (Python engines otherwise hold their output back in a file's buffer)."""
    env = {k: v for k, v in os.environ.items() if k not in _KEY_VARIABLES}
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


async def start_in_new_group(
    argv: Sequence[str], *, env: Mapping[str, str], output_fd: int
) -> trio.Process:
    """Start ``argv`` in a new session (its process group id is its pid),
    stdin from ``/dev/null``, stdout and stderr to ``output_fd`` (which the
    caller still closes), environment :func:`inherited_env` updated with
    ``env``.

    Raises:
        OSError: the command cannot be started (missing, not executable).
    """
    return await trio.lowlevel.open_process(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=output_fd,
        stderr=output_fd,
        start_new_session=True,
        env={**inherited_env(), **env},
    )


# --- /proc --------------------------------------------------------------------------


def read_stat(pid: int) -> Stat | None:
    """``/proc/<pid>/stat``'s parent, group, state and start time; ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may hold anything, ")" included.
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return Stat(
            state=fields[0], ppid=int(fields[1]), pgrp=int(fields[2]), start_time=int(fields[19])
        )
    except (IndexError, ValueError):
        return None


def same_process(pid: int, start_time: int) -> bool:
    """Whether process ``pid`` still runs (not a zombie) and is the process
    that was started at ``start_time`` (its pid was not given to another);
    ``start_time`` 0 means unknown and matches any."""
    stat = read_stat(pid)
    return (
        stat is not None
        and stat.state not in ("Z", "X")
        and (start_time == 0 or stat.start_time == start_time)
    )


def process_table() -> dict[int, Stat]:
    """Every process in ``/proc`` now, by pid."""
    table: dict[int, Stat] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = read_stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def find_strays(groups: frozenset[int]) -> set[Pid]:
    """Live descendants (≤ :data:`STRAY_MAX_DEPTH` levels) of the members of
    ``groups`` (process group ids) that are in none of them."""
    table = process_table()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, stat in table.items():
        children[stat.ppid].append(pid)
    level = [pid for pid, stat in table.items() if stat.pgrp in groups]
    strays: set[Pid] = set()
    seen = set(level)
    for _ in range(STRAY_MAX_DEPTH):
        below = [child for pid in level for child in children.get(pid, ()) if child not in seen]
        if not below:
            break
        seen.update(below)
        for pid in below:
            stat = table[pid]
            if stat.pgrp not in groups and stat.state != "Z":
                strays.add(Pid(pid, stat.start_time))
        level = below
    return strays


def _stray_alive(stray: Pid) -> bool:
    stat = read_stat(stray.pid)
    return stat is not None and stat.start_time == stray.start_time and stat.state != "Z"


def any_alive(groups: frozenset[int], strays: set[Pid]) -> bool:
    """Whether a non-zombie member of ``groups`` or a stray still runs."""
    if any(_stray_alive(stray) for stray in strays):
        return True
    for pgid in groups:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        # Something is in the group; zombies don't count.
        if any(stat.pgrp in groups and stat.state != "Z" for stat in process_table().values()):
            return True
        break
    return False


def signal_all(groups: frozenset[int], strays: set[Pid], sig: signal.Signals) -> None:
    """Send ``sig`` to every process group of ``groups`` and to the strays
    still alive (as the same process); gone ones are skipped, refusals logged."""
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("not allowed to signal process group %d", pgid)
    for stray in strays:
        if not _stray_alive(stray):
            continue
        try:
            os.kill(stray.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("not allowed to signal stray process %d", stray.pid)


# --- waiting and stopping -----------------------------------------------------------


async def wait_not_child(pid: int, start_time: int) -> None:
    """Return once process ``pid`` (not a child of ours, started at
    ``start_time``, see :func:`same_process`) has exited: through a pidfd
    when the kernel has them, else by polling ``/proc`` every
    :data:`PID_POLL_S` seconds."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):
        while True:
            if not same_process(pid, start_time):
                return
            await trio.sleep(PID_POLL_S)
    try:
        if not same_process(pid, start_time):
            return  # gone (its pid reused) before the pidfd was opened
        await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)


async def stop_groups(
    groups: frozenset[int],
    children: Sequence[trio.Process],
    *,
    grace_s: float = STOP_GRACE_S,
    label: str = "",
) -> None:
    """Stop the process groups ``groups`` and their strays, and reap
    ``children`` (those of their processes that are ours).

    Strays are found first; groups and strays get SIGTERM, then up to
    ``grace_s`` seconds polled every :data:`STOP_POLL_S`; whatever still runs
    (strays found again) gets SIGKILL; the children are then waited for.
    Everything after the SIGTERM wait, SIGKILL and reaping included, takes
    at most :data:`REAP_DEADLINE_S` seconds, so a stop takes at most
    ``grace_s + REAP_DEADLINE_S`` seconds (and the few milliseconds of
    reading ``/proc``). ``label`` names the owner in log lines
    (``"shard s1"``). Nothing to do for no groups. Never raises for
    processes that are gone or may not be signalled (logged).
    """
    if not groups:
        return
    strays = await trio.to_thread.run_sync(find_strays, groups)
    signal_all(groups, strays, signal.SIGTERM)
    gone = await _wait_gone(groups, strays, children, grace_s)
    reaped_by = trio.current_time() + REAP_DEADLINE_S
    if not gone:
        strays |= await trio.to_thread.run_sync(find_strays, groups)
        log.warning("%s: still running after SIGTERM; SIGKILL", label or "engine")
        signal_all(groups, strays, signal.SIGKILL)
    with trio.move_on_at(reaped_by):
        if not gone:
            await _wait_gone(groups, strays, children, REAP_DEADLINE_S)
        for child in children:
            await child.wait()


async def _wait_gone(
    groups: frozenset[int], strays: set[Pid], children: Sequence[trio.Process], deadline_s: float
) -> bool:
    with trio.move_on_after(deadline_s):
        while True:
            for child in children:
                child.poll()  # reaps our own children
            if not await trio.to_thread.run_sync(any_alive, groups, strays):
                return True
            await trio.sleep(STOP_POLL_S)
    return False

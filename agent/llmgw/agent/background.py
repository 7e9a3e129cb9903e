"""Background measurements that never compete with requests.

A background measurement (the memory-bandwidth probe) runs only on an idle
node, in threads at the lowest CPU priority, and gives way as soon as the
node gets busy: ``docs/up.md``, "Background measurements".

- **Idle** is read from the whole node's CPU time (``/proc/stat``): over each
  window, the CPUs used by everything but the measurement itself (engines
  answering, the gateway, anything else) stay under a threshold
  (:func:`busy_cpus_threshold`). An engine answering a request on the CPU
  uses whole cores, so a request in flight is seen within one window.
- **Lowest priority**: every thread that does the work calls
  :func:`lowest_cpu_priority` first (Linux: ``SCHED_IDLE``, run only on a
  CPU nothing else wants, and nice 19); the caller's own thread is left as
  it is.
- **Yielding**: :func:`run_when_idle` waits for an idle node, runs the work
  in a thread and watches the node meanwhile; when others use more than the
  threshold it sets :attr:`Yielding.stop`, the work raises (it checks the
  event between small pieces), the worker is waited for, and it all starts
  again from waiting.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Final, TypeVar

import attrs
import trio

__all__ = [
    "IDLE_WINDOWS",
    "WINDOW_S",
    "Yielding",
    "busy_cpu_seconds",
    "busy_cpus_threshold",
    "lowest_cpu_priority",
    "run_when_idle",
    "wait_until_idle",
]

log = logging.getLogger("llmgw.agent")

T = TypeVar("T")

#: Seconds of one look at the node's CPU time.
WINDOW_S: Final = 0.5
#: Windows in a row the node must be idle before a measurement starts (2 s).
IDLE_WINDOWS: Final = 4
#: The fields of ``/proc/stat``'s ``cpu`` line that are busy time: user,
#: nice, system, irq, softirq, steal (guest time is inside user and nice).
_BUSY_FIELDS: Final = (0, 1, 2, 5, 6, 7)
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def lowest_cpu_priority() -> None:
    """Put the calling thread at the lowest CPU priority: on Linux
    ``SCHED_IDLE`` (it runs only when a CPU has nothing else to run) and
    nice 19, for this thread only (threads it starts inherit both). Elsewhere
    nothing changes (nice would apply to the whole process). A refusal (a
    container's seccomp rules) leaves the thread as it was."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    with suppress(OSError, AttributeError):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def busy_cpu_seconds(stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds all CPUs have spent busy since boot (``/proc/stat``'s
    ``cpu`` line: user, nice, system, irq, softirq, steal); 0.0 when it
    cannot be read (no ``/proc``: the node then always looks idle)."""
    try:
        with stat.open() as f:
            first = f.readline()
    except OSError:
        return 0.0
    fields = first.split()
    if not fields or fields[0] != "cpu":
        return 0.0
    values = [int(v) for v in fields[1:] if v.isdigit()]
    return sum(values[i] for i in _BUSY_FIELDS if i < len(values)) / _CLOCK_TICKS


def busy_cpus_threshold(cpus: int) -> float:
    """The CPUs others may use while the node still counts as idle: a tenth
    of the node's CPUs, at least a quarter of one."""
    return max(0.25, cpus / 10)


@attrs.define
class Yielding:
    """One run of a background measurement, shared with its threads.

    Attributes:
        stop: set when the node got busy; the work checks it between pieces
            and raises.
        cpu_s: CPU seconds the work's threads have used so far (they add
            ``time.thread_time()`` differences as they go), so that the
            watcher counts only the others' use.
        thread_ids: the native ids of the threads that did the work.
    """

    stop: threading.Event = attrs.field(factory=threading.Event)
    cpu_s: float = 0.0
    thread_ids: set[int] = attrs.field(factory=set)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    def joined(self) -> None:
        """Note the calling thread as one doing the work."""
        with self._lock:
            self.thread_ids.add(threading.get_native_id())

    def add_cpu(self, seconds: float) -> None:
        """Count ``seconds`` of CPU used by one of the work's threads."""
        with self._lock:
            self.cpu_s += seconds


#: Reads the node's busy CPU seconds (:func:`busy_cpu_seconds`; tests give others).
BusyClock = Callable[[], float]


async def wait_until_idle(
    busy_cpus: float,
    *,
    what: str = "background measurement",
    clock: BusyClock = busy_cpu_seconds,
    windows: int = IDLE_WINDOWS,
) -> None:
    """Return once ``windows`` windows of :data:`WINDOW_S` in a row each saw
    the node's CPUs used less than ``busy_cpus`` (in CPUs, averaged over the
    window); the first busy window is logged, naming ``what`` waits. Runs
    until then; cancel it to give up."""
    quiet = 0
    said = False
    before, at = clock(), trio.current_time()
    while quiet < windows:
        await trio.sleep(WINDOW_S)
        now, now_at = clock(), trio.current_time()
        used = (now - before) / max(now_at - at, 1e-3)
        before, at = now, now_at
        if used < busy_cpus:
            quiet += 1
            continue
        quiet = 0
        if not said:
            log.info(
                "%s waits for an idle node (%.2f CPUs busy, under %.2f wanted)",
                what,
                used,
                busy_cpus,
            )
            said = True


async def run_when_idle(
    what: str,
    work: Callable[[Yielding], T],
    *,
    busy_cpus: float,
    interrupted: type[BaseException],
    retry_after_s: float = 10.0,
    clock: BusyClock = busy_cpu_seconds,
    idle_windows: int = IDLE_WINDOWS,
) -> T:
    """Run ``work`` (blocking, in a worker thread) on an idle node, giving
    way whenever the node gets busy, until it completes.

    Args:
        what: the measurement's name, for the log.
        work: called with a fresh :class:`Yielding` each try; it runs its
            heavy parts in threads that call :func:`lowest_cpu_priority`,
            adds their CPU time to :attr:`Yielding.cpu_s`, and raises
            ``interrupted`` soon after :attr:`Yielding.stop` is set.
        busy_cpus: others using more CPUs than this make the node busy
            (:func:`busy_cpus_threshold`).
        interrupted: the exception ``work`` raises when stopped.
        retry_after_s: seconds to wait after giving way before waiting for
            idle again.
        clock: the node's busy CPU seconds (:func:`busy_cpu_seconds`).
        idle_windows: windows in a row the node must be idle first.

    Returns:
        What ``work`` returned.

    Raises:
        Whatever ``work`` raises other than ``interrupted``.
    """
    while True:
        await wait_until_idle(busy_cpus, what=what, clock=clock, windows=idle_windows)
        run = Yielding()
        others = 0.0

        async def watch(run: Yielding = run) -> None:
            nonlocal others
            before, mine, at = clock(), run.cpu_s, trio.current_time()
            while True:
                await trio.sleep(WINDOW_S)
                now, now_mine, now_at = clock(), run.cpu_s, trio.current_time()
                used = ((now - before) - (now_mine - mine)) / max(now_at - at, 1e-3)
                before, mine, at = now, now_mine, now_at
                if used > busy_cpus:
                    others = used
                    run.stop.set()
                    return

        failed: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            try:
                result = await trio.to_thread.run_sync(
                    functools.partial(work, run), abandon_on_cancel=True
                )
            except interrupted:
                pass
            except trio.Cancelled:
                run.stop.set()  # the abandoned thread ends at its next piece
                raise
            except Exception as exc:
                # Raised out of the nursery it would reach the caller inside
                # an exception group, past its ``except`` for the error.
                failed = exc
            else:
                return result
            finally:
                nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed
        log.info(
            "%s gave way: the node got busy (%.2f CPUs used by others); "
            "trying again once it is idle",
            what,
            others,
        )
        await trio.sleep(retry_after_s)

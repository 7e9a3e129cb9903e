"""Memory read bandwidth of this machine, all cores and one core.

The rule: every CPU sums its share of a
64-bit-integer buffer at once, 4 passes, the best kept (GB/s = bytes/s/1e9);
then one core sums 512 MiB, 3 passes, the best, capped at the all-core
figure. The sums run in numpy (native code, the GIL released), one thread
per CPU: a Python loop would measure the interpreter.

The buffer is at most 2 GiB and at most ¼ of ``MemAvailable``, and at least
``max(256 MiB, 8 x the largest CPU cache)``; when that cannot be had nothing
is measured (:class:`BandwidthError`) and the caller tries again later.
Within those bounds it is ``max(512 MiB, 64 MiB per CPU)``.

Runs in a few seconds and blocks: the agent runs it through
:func:`llmgw.agent.background.run_when_idle`, after it has reached its
control plane, never in the start-up scan. Allocating the buffer is part of
the cost (first touch of each page: ~1-2 s per GiB on a VM). Every touch and
sum runs in threads of its own at the lowest CPU priority
(:func:`~llmgw.agent.background.lowest_cpu_priority`), in pieces of
:data:`PIECE_BYTES`, between which a set
:attr:`~llmgw.agent.background.Yielding.stop` ends the measurement with
:class:`BandwidthInterrupted`.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs
import numpy as np

from llmgw import errors

from .background import Yielding, lowest_cpu_priority

__all__ = [
    "MAX_BUFFER_BYTES",
    "MIN_BUFFER_BYTES",
    "PIECE_BYTES",
    "Bandwidth",
    "BandwidthError",
    "BandwidthInterrupted",
    "buffer_bytes_for",
    "largest_cache_bytes",
    "measure_bandwidth",
]

MIB: Final = 1024**2
#: The largest buffer measured.
MAX_BUFFER_BYTES: Final = 2048 * MIB
#: The smallest buffer worth measuring (also at least 8 x the largest cache).
MIN_BUFFER_BYTES: Final = 256 * MIB
#: The one-core pass reads this much (or the whole buffer when smaller).
_CORE_BYTES: Final = 512 * MIB
_ALL_PASSES: Final = 4
_CORE_PASSES: Final = 3
#: Each thread touches and sums its part in pieces of this size, checking
#: between pieces whether it should stop (32 MiB: a few ms each).
PIECE_BYTES: Final = 32 * MIB
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)", re.IGNORECASE)
_SIZE_UNIT: Final = {"": 1, "K": 1024, "M": MIB, "G": 1024 * MIB}


class BandwidthError(errors.AgentError, RuntimeError):
    """Nothing was measured: not enough memory for a buffer of the minimum
    size (the message gives the figures), or the buffer could not be had."""


class BandwidthInterrupted(BandwidthError):
    """Nothing was measured: stopped part-way because the node got busy
    (:attr:`~llmgw.agent.background.Yielding.stop`)."""


@attrs.frozen
class Bandwidth:
    """Measured memory read bandwidth, GB/s (10^9 bytes/s).

    Attributes:
        core_gbps: one core (capped at ``machine_gbps``).
        machine_gbps: every CPU reading at once.
    """

    core_gbps: float
    machine_gbps: float


def largest_cache_bytes(root: Path = Path("/sys/devices/system/cpu")) -> int:
    """The largest CPU cache of any level, bytes, from
    ``cpu*/cache/index*/size`` (``"32768K"``); 0 when none can be read."""
    largest = 0
    for path in root.glob("cpu[0-9]*/cache/index[0-9]*/size"):
        try:
            match = _SIZE.match(path.read_text())
        except OSError:
            continue
        if match is not None:
            largest = max(largest, int(match.group(1)) * _SIZE_UNIT[match.group(2).upper()])
    return largest


def _mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        text = meminfo.read_text()
    except OSError:
        return 0
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024  # kB = KiB
    return values.get("MemAvailable", values.get("MemFree", 0))


def buffer_bytes_for(mem_available_bytes: int, largest_cache: int, cpus: int = 1) -> int:
    """The buffer to measure with, bytes, rounded down to whole MiB.

    The spec's bounds: at most 2 GiB and ¼ of ``MemAvailable``, at least
    ``max(256 MiB, 8 x largest_cache)``. Within them our pick is
    ``max(512 MiB, 64 MiB x cpus)`` (so the one-core pass reads its 512 MiB,
    and every reader of a big machine reads well beyond its cache) — filling
    a buffer costs ~1-2 s per GiB on a VM, so no bigger than it needs.

    Raises:
        BandwidthError: the upper bound is below the lower one.
    """
    floor = max(MIN_BUFFER_BYTES, 8 * largest_cache)
    ceiling = min(MAX_BUFFER_BYTES, mem_available_bytes // 4) // MIB * MIB
    if ceiling < floor:
        raise BandwidthError(
            f"a buffer of at least {floor // MIB} MiB is needed and at most "
            f"{ceiling // MIB} MiB can be had (the smaller of {MAX_BUFFER_BYTES // MIB} MiB "
            f"and a quarter of the {mem_available_bytes // MIB} MiB available)"
        )
    wanted = max(floor, _CORE_BYTES, 64 * MIB * max(cpus, 1))
    return min(wanted, ceiling)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _in_threads(
    chunks: list[np.ndarray], work: Callable[[np.ndarray], object], run: Yielding
) -> float:
    """Run ``work`` on every chunk at once, one new thread each at the
    lowest CPU priority, piece by piece (:data:`PIECE_BYTES`); the wall time
    from the first start to the last end, seconds. The calling thread only
    waits.

    Raises:
        BandwidthInterrupted: ``run.stop`` was set.
    """
    barrier = threading.Barrier(len(chunks))
    starts = [0.0] * len(chunks)
    ends = [0.0] * len(chunks)
    failures: list[BaseException] = []
    step = max(1, PIECE_BYTES // max(chunks[0].itemsize, 1))

    def run_one(index: int) -> None:
        lowest_cpu_priority()
        run.joined()
        cpu = time.thread_time()
        try:
            barrier.wait()
            starts[index] = time.perf_counter()
            chunk = chunks[index]
            for at in range(0, len(chunk), step):
                if run.stop.is_set():
                    raise BandwidthInterrupted("not measured: the node got busy")
                work(chunk[at : at + step])
                now = time.thread_time()
                run.add_cpu(now - cpu)
                cpu = now
            ends[index] = time.perf_counter()
        except BaseException as exc:
            failures.append(exc)
            barrier.abort()
        finally:
            run.add_cpu(time.thread_time() - cpu)

    threads = [
        threading.Thread(target=run_one, args=(i,), name=f"bandwidth-{i}", daemon=True)
        for i in range(len(chunks))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if run.stop.is_set():
        raise BandwidthInterrupted("not measured: the node got busy")
    if failures:
        raise failures[0]
    return max(ends) - min(starts)


def _best_rate(
    chunks: list[np.ndarray], nbytes: int, passes: int, deadline: float, run: Yielding
) -> float:
    """The best of ``passes`` all-at-once sums, bytes/s; stops early (after
    one pass at least) once ``deadline`` (``time.perf_counter()``) passed.

    Raises:
        BandwidthInterrupted: ``run.stop`` was set.
    """
    best = 0.0
    for done in range(passes):
        if done and time.perf_counter() > deadline:
            break
        seconds = _in_threads(chunks, np.add.reduce, run)
        if seconds > 0:
            best = max(best, nbytes / seconds)
    return best


def measure_bandwidth(
    *,
    buffer_bytes: int | None = None,
    seconds: float = 3.0,
    threads: int | None = None,
    run: Yielding | None = None,
) -> Bandwidth:
    """Measure memory read bandwidth: all CPUs at once, then one core.

    Args:
        buffer_bytes: the buffer's size; ``None`` = :func:`buffer_bytes_for`
            (the spec's bounds: up to 2 GiB and ¼ of ``MemAvailable``).
            A given size is used as it is (tests use small ones).
        seconds: time allowed for the passes after the buffer is filled;
            each phase runs at least one pass and stops taking more once
            its share of this is spent. Filling the buffer comes on top
            (~1-2 s per GiB on a VM).
        threads: readers for the all-CPU figure; ``None`` = the CPUs this
            process may run on (``sched_getaffinity``).
        run: lets another thread stop the measurement (``run.stop``) and
            see the CPU time it used (``run.cpu_s``); None = a run nobody
            stops.

    Returns:
        :class:`Bandwidth` in GB/s (10^9 bytes/s), the one-core figure
        capped at the all-core one.

    Raises:
        BandwidthError: too little memory for the minimum buffer, or the
            buffer could not be allocated.
        BandwidthInterrupted: ``run.stop`` was set before it ended.
        ValueError: ``buffer_bytes`` below 8 MiB or ``seconds`` negative.
    """
    if buffer_bytes is None:
        buffer_bytes = buffer_bytes_for(
            _mem_available_bytes(), largest_cache_bytes(), threads or _cpu_count()
        )
    if buffer_bytes < 8 * MIB:
        raise ValueError(f"buffer_bytes must be at least 8 MiB, not {buffer_bytes}")
    if seconds < 0:
        raise ValueError(f"seconds must not be negative, not {seconds}")
    readers = max(1, threads if threads is not None else _cpu_count())
    run = run if run is not None else Yielding()
    items = buffer_bytes // 8
    try:
        buffer = np.empty(items, dtype=np.uint64)
    except MemoryError:
        raise BandwidthError(f"cannot allocate {buffer_bytes // MIB} MiB") from None
    chunks = np.array_split(buffer, readers)
    # Touch every page with a non-zero value, each reader its own part (an
    # untouched or zeroed buffer may map the shared zero page and read fast).
    _in_threads(chunks, lambda chunk: chunk.fill(1), run)
    nbytes = items * 8
    start = time.perf_counter()
    machine = _best_rate(chunks, nbytes, _ALL_PASSES, start + seconds / 2, run)
    core_part = buffer[: min(items, _CORE_BYTES // 8)]
    core = _best_rate([core_part], core_part.nbytes, _CORE_PASSES, start + seconds, run)
    del chunks, core_part, buffer
    machine_gbps = machine / 1e9
    return Bandwidth(core_gbps=min(core / 1e9, machine_gbps), machine_gbps=machine_gbps)

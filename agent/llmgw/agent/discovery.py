"""What this machine is: CPUs, memory, OS, NVIDIA cards, and how to reach it.

The rules for configuration, identity and the host's discovery:

- the node id is the hostname;
- the node's address is the source address on the route to the control plane
  (a UDP ``connect()`` sends nothing);
- no NVIDIA library means no NVIDIA cards, which is not an error.

Everything here is synchronous and quick except NVML, which may stall on a
sick driver: async callers use :func:`discover_hardware_async`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import platform
import socket
from pathlib import Path
from typing import Final

import psutil
import pynvml
import trio

from llmgw.agent.protocol import Gpu, Hardware

__all__ = [
    "INTERESTING_CPU_FLAGS",
    "discover_gpus",
    "discover_hardware",
    "discover_hardware_async",
    "interface_of",
    "memory_mb",
    "node_id",
    "route_address",
]

log = logging.getLogger(__name__)

#: CPU flags worth reporting: what engine builds are chosen by (x86 and ARM).
INTERESTING_CPU_FLAGS: Final = frozenset(
    {"avx", "avx2", "avx512f", "fma", "sse4_2", "f16c", "neon", "asimd"}
)

_MEMINFO: Final = Path("/proc/meminfo")
_CPUINFO: Final = Path("/proc/cpuinfo")
_OS_RELEASE: Final = (Path("/etc/os-release"), Path("/usr/lib/os-release"))


def node_id() -> str:
    """This node's id: its hostname."""
    return socket.gethostname()


def route_address(target_host: str) -> str:
    """The local address this machine uses to reach ``target_host``.

    Sends nothing: a UDP socket is connected (which only picks a route) and
    asked for its own address. A loopback target (``localhost``,
    ``127.0.0.0/8``, ``::1``) gives ``127.0.0.1``.

    Raises:
        OSError: the name does not resolve, or there is no route to it.
    """
    if target_host in ("localhost", "localhost.localdomain"):
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(target_host.strip("[]")).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass  # a name, resolved below
    infos = socket.getaddrinfo(target_host, 9, type=socket.SOCK_DGRAM)
    last_error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        if ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback:
            return "127.0.0.1"
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.connect(sockaddr)
            except OSError as exc:
                last_error = exc
                continue
            return str(sock.getsockname()[0])
    raise last_error or OSError(f"no address found for {target_host!r}")


def interface_of(address: str) -> str:
    """The name of the network interface holding ``address`` (``"eth0"``;
    ``"lo"`` for a loopback address), or ``""`` when none of this machine's
    interfaces has it (an address given in agent.yaml for a NAT, say)."""
    try:
        wanted = ipaddress.ip_address(address.strip("[]").split("%")[0])
    except ValueError:
        return ""
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(addr.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return ""


def _meminfo_mb() -> dict[str, int]:
    values: dict[str, int] = {}
    for line in _MEMINFO.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            values[key] = int(parts[0]) // 1024
    return values


def memory_mb() -> tuple[int, int]:
    """``(total, available)`` memory in MB (MiB) from ``/proc/meminfo``.

    ``available`` falls back to ``MemFree`` on kernels without ``MemAvailable``.

    Raises:
        OSError: ``/proc/meminfo`` cannot be read.
    """
    values = _meminfo_mb()
    total = values.get("MemTotal", 0)
    return total, values.get("MemAvailable", values.get("MemFree", 0))


def _os_release() -> dict[str, str]:
    for path in _OS_RELEASE:
        try:
            text = path.read_text()
        except OSError:
            continue
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key and not key.startswith("#"):
                fields[key] = value.strip().strip("\"'")
        return fields
    return {}


def _cpu_flags() -> tuple[str, ...]:
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted(INTERESTING_CPU_FLAGS.intersection(value.split())))
    return ()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def discover_gpus() -> tuple[tuple[Gpu, ...], str]:
    """The NVIDIA cards NVML sees (with the memory in use now) and the driver version.

    Returns ``((), "")`` when NVML cannot start (no driver or library). A
    field a card or driver cannot report is left empty. Blocks on NVML: call
    it from a thread in async code.
    """
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("no NVIDIA cards: %s", exc)
        return (), ""
    try:
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = ""
        gpus: list[Gpu] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                capability = f"{major}.{minor}"
            except pynvml.NVMLError:
                capability = ""
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError:
                uuid = ""
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                Gpu(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_total_mb=int(memory.total) // (1024 * 1024),
                    memory_used_mb=int(memory.used) // (1024 * 1024),
                    uuid=uuid,
                    compute_capability=capability,
                )
            )
        return tuple(gpus), driver
    except pynvml.NVMLError as exc:
        log.warning("NVML failed while listing cards: %s", exc)
        return (), ""
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)


def discover_hardware() -> Hardware:
    """What this machine has, as ``Register`` reports it.

    CPU count is the CPUs this process may run on; memory is in MB (MiB);
    ``cpu_flags`` keeps only :data:`INTERESTING_CPU_FLAGS`; ``gpus`` is empty
    without an NVIDIA driver. Blocks on NVML: async callers use
    :func:`discover_hardware_async`.

    Raises:
        OSError: ``/proc/meminfo`` cannot be read.
    """
    total, available = memory_mb()
    release = _os_release()
    gpus, driver = discover_gpus()
    return Hardware(
        cpu_count=len(os.sched_getaffinity(0)),
        memory_total_mb=total,
        memory_available_mb=available,
        gpus=gpus,
        os_id=release.get("ID", ""),
        os_version=release.get("VERSION_ID", ""),
        arch=platform.machine(),
        cpu_flags=_cpu_flags(),
        nvidia_driver=driver,
    )


async def discover_hardware_async() -> Hardware:
    """:func:`discover_hardware` in a worker thread (NVML may block)."""
    return await trio.to_thread.run_sync(discover_hardware)

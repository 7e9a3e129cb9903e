"""Discovery on this machine, and the NVML path against a fake NVML."""

from __future__ import annotations

import ipaddress
import os
import platform
import socket
import types

import pynvml
import pytest
import trio

from llmgw.agent import discovery
from llmgw.agent.protocol import Gpu


def test_hardware_is_sane() -> None:
    """CPU, memory, OS and flags come back with plausible values."""
    hw = discovery.discover_hardware()
    assert hw.cpu_count == len(os.sched_getaffinity(0)) >= 1
    assert hw.memory_total_mb > 100
    assert 0 < hw.memory_available_mb <= hw.memory_total_mb
    assert hw.arch == platform.machine()
    assert hw.os_id
    assert set(hw.cpu_flags) <= discovery.INTERESTING_CPU_FLAGS
    assert list(hw.cpu_flags) == sorted(hw.cpu_flags)
    for gpu in hw.gpus:
        assert gpu.memory_total_mb > 0
    assert bool(hw.nvidia_driver) or not hw.gpus


async def test_hardware_async() -> None:
    """The async variant runs discovery in a thread with the same answer."""
    with trio.fail_after(30):
        hw = await discovery.discover_hardware_async()
    assert hw.cpu_count == len(os.sched_getaffinity(0))
    assert hw.arch == platform.machine()


def test_memory_mb() -> None:
    """(total, available) in MB, available no more than total."""
    total, available = discovery.memory_mb()
    assert 0 < available <= total


def test_no_nvml_means_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver-less machine has no cards and that is not an error."""

    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    hw = discovery.discover_hardware()
    assert hw.gpus == ()
    assert hw.nvidia_driver == ""


def test_gpus_from_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cards are read from NVML (bytes or str names, memory in use), missing
    fields stay empty, and NVML is always shut down."""
    calls: list[str] = []

    def capability(handle: int) -> tuple[int, int]:
        if handle == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return (8, 9)

    fake = {
        "nvmlInit": lambda: calls.append("init"),
        "nvmlShutdown": lambda: calls.append("shutdown"),
        "nvmlSystemGetDriverVersion": lambda: "550.54.15",
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda index: index,
        "nvmlDeviceGetName": lambda handle: b"NVIDIA L4" if handle == 0 else "Tesla T4",
        "nvmlDeviceGetMemoryInfo": lambda handle: types.SimpleNamespace(
            total=(handle + 1) << 34, used=(handle + 1) << 30
        ),
        "nvmlDeviceGetUUID": lambda handle: f"GPU-{handle}",
        "nvmlDeviceGetCudaComputeCapability": capability,
    }
    for name, value in fake.items():
        monkeypatch.setattr(pynvml, name, value)
    gpus, driver = discovery.discover_gpus()
    assert driver == "550.54.15"
    assert gpus == (
        Gpu(
            index=0,
            name="NVIDIA L4",
            memory_total_mb=16384,
            memory_used_mb=1024,
            uuid="GPU-0",
            compute_capability="8.9",
        ),
        Gpu(
            index=1,
            name="Tesla T4",
            memory_total_mb=32768,
            memory_used_mb=2048,
            uuid="GPU-1",
            compute_capability="",
        ),
    )
    assert calls == ["init", "shutdown"]


def test_nvml_shut_down_after_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An NVML error while listing still shuts NVML down; no cards reported."""
    calls: list[str] = []

    def broken() -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", broken)
    assert discovery.discover_gpus() == ((), "")
    assert calls == ["init", "shutdown"]


def test_node_id_is_hostname() -> None:
    """The node id is the hostname."""
    assert discovery.node_id() == socket.gethostname()


@pytest.mark.parametrize("target", ["127.0.0.1", "127.1.2.3", "localhost", "::1"])
def test_route_address_loopback(target: str) -> None:
    """A loopback control plane is reached from 127.0.0.1."""
    assert discovery.route_address(target) == "127.0.0.1"


def test_route_address_outside() -> None:
    """An outside address is reached from one of this machine's addresses."""
    try:
        address = discovery.route_address("203.0.113.7")
    except OSError as exc:  # no default route on this machine
        pytest.skip(f"no route: {exc}")
    parsed = ipaddress.ip_address(address)
    assert not parsed.is_loopback
    assert not parsed.is_unspecified

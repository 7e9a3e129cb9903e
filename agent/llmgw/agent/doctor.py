"""``llmgw doctor``: what this node has and whether it can serve, one check at a time.

Each check gives a :class:`CheckResult`: a ``name``, a ``status`` (``ok``,
``warn`` or ``fail``), what it ``found``, and for a warning or a failure the
``fix`` in one sentence. The checks (``docs/doctor.md`` explains each line):

- ``cpu``: CPUs this process may run on and the vector extensions (AVX2,
  AVX-512, FMA on x86; NEON, SVE on ARM). No AVX2 on x86 is a warning:
  llama.cpp runs about 5x slower; in a VM the CPU type hides it.
- ``memory``: total and available; under 2 GB available is a warning.
- ``gpu``: the NVIDIA cards and their driver (:mod:`llmgw.agent.discovery`).
  No NVIDIA card is fine; a card on the PCI bus that no driver answers for
  is a failure.
- ``disk``: free space where weights go; under 20 GB warns, under 2 GB fails.
- ``reach``: each control plane address on its agent port (7443) and join
  port (7444): a TCP connect, then a TLS handshake verified against the
  node's CA file when there is one.
- ``clock``: this clock against the control plane's (``GET /v1/join/time`` on
  its join port); over 1 s off warns, over 30 s fails (certificates).

Each decision is a plain function of what was measured (``cpu_result``,
``memory_result``, …) so it can be tested with any figures; the ``probe_*``
functions read this machine, and :func:`run_doctor` runs every check, the ones
that wait concurrently, each remote call under a deadline.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from functools import partial
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

import attrs
import httpx
import pynvml
import trio

from llmgw import errors
from llmgw.agent import discovery
from llmgw.agent.protocol import Gpu

__all__ = [
    "DEFAULT_AGENT_PORT",
    "DEFAULT_JOIN_PORT",
    "CheckResult",
    "ControlPlane",
    "DoctorConfig",
    "Status",
    "check_clock",
    "check_reachable",
    "clock_result",
    "cpu_result",
    "disk_result",
    "gpu_result",
    "memory_result",
    "not_joined_results",
    "nvidia_pci_cards",
    "parse_control_plane",
    "probe_cpu",
    "probe_gpus",
    "run_doctor",
]

Status = Literal["ok", "warn", "fail"]

#: The control plane's agent hub (wss, mutual TLS) and join port (HTTPS).
DEFAULT_AGENT_PORT: Final = 7443
DEFAULT_JOIN_PORT: Final = 7444

_GB: Final = 1_000_000_000
#: Memory available under this warns.
MEMORY_WARN_BYTES: Final = 2 * _GB
#: Free space for weights under these warns / fails.
DISK_WARN_BYTES: Final = 20 * _GB
DISK_FAIL_BYTES: Final = 2 * _GB
#: Clock offsets over these warn / fail (certificates stop verifying).
CLOCK_WARN_S: Final = 1.0
CLOCK_FAIL_S: Final = 30.0

_PCI_DEVICES: Final = Path("/sys/bus/pci/devices")
_CPUINFO: Final = Path("/proc/cpuinfo")
_NVIDIA_VENDOR: Final = "0x10de"
#: PCI classes of a GPU: VGA controller, 3D controller (not NVIDIA's audio
#: functions or NVSwitches).
_GPU_CLASSES: Final = ("0x0300", "0x0302")

_TIME_SYNC_FIX: Final = (
    "turn on time sync here and on the control plane: `timedatectl set-ntp true` "
    "(systemd-timesyncd) or install chrony"
)


@attrs.frozen
class CheckResult:
    """One line of ``llmgw doctor``.

    ``name`` is the check (``cpu``, ``memory``, ``gpu``, ``disk``, ``reach``,
    ``clock``); ``found`` what it saw; ``fix`` one sentence, empty when
    ``status`` is ``ok``.
    """

    name: str
    status: Status
    found: str
    fix: str = ""


@attrs.frozen
class ControlPlane:
    """One control plane address: ``host`` (a name or an address, IPv6
    without brackets), its agent port and its join port."""

    host: str
    agent_port: int = DEFAULT_AGENT_PORT
    join_port: int = DEFAULT_JOIN_PORT

    def address(self, port: int) -> str:
        """``host:port``, an IPv6 host in brackets."""
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"


@attrs.frozen
class DoctorConfig:
    """What :func:`run_doctor` checks.

    ``weights_dir``: where weights go (need not exist: its nearest existing
    parent's file system is measured). ``control_planes``: empty when the
    node has not joined. ``ca_file``: the cluster CA the control plane's
    certificate is verified against (none: the handshake is checked but the
    certificate is not). ``cert_file``/``key_file``: this node's certificate,
    presented on the agent port. ``join_scheme``: ``https`` (``http`` only
    in tests). Deadlines in seconds: ``connect_timeout_s`` for each TCP
    connect and again for each TLS handshake, ``clock_timeout_s`` for the
    time request, ``gpu_timeout_s`` for NVML (a sick driver can stall it).
    """

    weights_dir: Path
    control_planes: tuple[ControlPlane, ...] = ()
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    join_scheme: Literal["https", "http"] = "https"
    connect_timeout_s: float = 3.0
    clock_timeout_s: float = 5.0
    gpu_timeout_s: float = 20.0


# --- control plane addresses -------------------------------------------------


def parse_control_plane(text: str, *, join_port: int = DEFAULT_JOIN_PORT) -> ControlPlane:
    """A control plane from ``HOST``, ``HOST:PORT``, ``[IPV6]:PORT`` or an
    agent URL (``wss://HOST:PORT/agent``, as ``agent.yaml``'s ``servers``).

    The port given is the agent port (default 7443); the join port is
    ``join_port``.

    Raises:
        errors.InvalidInput: no host, or a port that is not 1-65535.
    """
    raw = text.strip()
    if not raw:
        raise errors.InvalidInput("a control plane address is empty: give HOST or HOST:PORT")
    try:
        parts = urlsplit(raw if "://" in raw else f"//{raw}")
        port = parts.port
    except ValueError:
        if raw.count(":") > 1 and "[" not in raw and "://" not in raw:
            return ControlPlane(raw, DEFAULT_AGENT_PORT, join_port)  # bare IPv6
        raise errors.InvalidInput(
            f"{text!r} is not a control plane address: give HOST, HOST:PORT (port 1-65535) "
            "or wss://HOST:PORT/agent"
        ) from None
    host = parts.hostname
    if not host:
        raise errors.InvalidInput(
            f"{text!r} names no host: give HOST, HOST:PORT or wss://HOST:PORT/agent"
        )
    if port == 0:
        raise errors.InvalidInput(f"{text!r}: the port must be 1-65535")
    return ControlPlane(host, port or DEFAULT_AGENT_PORT, join_port)


# --- cpu ----------------------------------------------------------------------


def probe_cpu(cpuinfo: Path = _CPUINFO) -> tuple[int, str, frozenset[str]]:
    """``(cpus, arch, flags)``: the CPUs this process may run on, the machine
    architecture and every CPU flag of the first CPU in ``/proc/cpuinfo``
    (``flags`` on x86, ``Features`` on ARM; empty when unreadable)."""
    flags: frozenset[str] = frozenset()
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = frozenset(value.split())
            break
    return len(os.sched_getaffinity(0)), platform.machine(), flags


def cpu_result(cpus: int, arch: str, flags: Collection[str]) -> CheckResult:
    """The ``cpu`` line: the count and the vector extensions.

    On x86 a missing AVX2 warns: in a VM (the ``hypervisor`` flag) the fix is
    the VM's CPU type, on bare metal a newer CPU. ARM and others only report.
    """
    have = set(flags)
    plural = "CPU" if cpus == 1 else "CPUs"
    if arch in ("x86_64", "amd64", "i686", "i386"):
        shown = [
            n for f, n in (("avx2", "AVX2"), ("fma", "FMA"), ("avx512f", "AVX-512F")) if f in have
        ]
        found = f"{cpus} {plural}, " + (" ".join(shown) if shown else "none of AVX2 FMA AVX-512F")
        if "avx2" in have:
            return CheckResult("cpu", "ok", found)
        if "hypervisor" in have:
            fix = (
                "this VM's CPU type hides AVX2 (llama.cpp runs about 5x slower): set it to the "
                "host's CPU (libvirt `<cpu mode='host-passthrough'/>`, Proxmox `cpu: host`) "
                "and restart the VM"
            )
        else:
            fix = (
                "this CPU has no AVX2 and llama.cpp runs about 5x slower on it: "
                "serve CPU models from a newer machine"
            )
        return CheckResult("cpu", "warn", found + (", no AVX2" if shown else ""), fix)
    if arch in ("aarch64", "arm64"):
        shown = [n for f, n in (("asimd", "NEON"), ("sve", "SVE"), ("sve2", "SVE2")) if f in have]
        return CheckResult("cpu", "ok", f"{cpus} {plural}, " + (" ".join(shown) or "no NEON"))
    return CheckResult("cpu", "ok", f"{cpus} {plural}, {arch or 'unknown architecture'}")


# --- memory -------------------------------------------------------------------


def memory_result(total_bytes: int, available_bytes: int) -> CheckResult:
    """The ``memory`` line: under 2 GB available warns."""
    found = f"{_gb(available_bytes)} available of {_gb(total_bytes)}"
    if available_bytes < MEMORY_WARN_BYTES:
        return CheckResult(
            "memory",
            "warn",
            found,
            "under 2 GB is free for engines: stop what else runs here or give the machine more memory",
        )
    return CheckResult("memory", "ok", found)


# --- gpus ---------------------------------------------------------------------


def nvidia_pci_cards(devices: Path = _PCI_DEVICES) -> int:
    """How many NVIDIA GPUs are on the PCI bus, driver or not (sysfs vendor
    ``0x10de``, class VGA or 3D controller); 0 when sysfs is unreadable."""
    count = 0
    try:
        entries = list(devices.iterdir())
    except OSError:
        return 0
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text().strip().lower()
            klass = (entry / "class").read_text().strip().lower()
        except OSError:
            continue
        if vendor == _NVIDIA_VENDOR and klass.startswith(_GPU_CLASSES):
            count += 1
    return count


def probe_gpus() -> tuple[tuple[Gpu, ...], str, str]:
    """``(cards, driver version, NVML's error)`` from
    :func:`llmgw.agent.discovery.discover_gpus`; the error is NVML's own
    text when it found no card (``""`` when it started and there are none).
    Blocks on NVML: call it from a thread."""
    gpus, driver = discovery.discover_gpus()
    if gpus:
        return gpus, driver, ""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return (), driver, errors.describe(exc)
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass
    return (), driver, ""


def gpu_result(
    pci_cards: int, gpus: Sequence[Gpu], driver: str, nvml_error: str = ""
) -> CheckResult:
    """The ``gpu`` line.

    No card on the bus and none from NVML: ok (a CPU node). Cards on the bus
    that NVML does not list: fail, the driver is missing or broken. Fewer
    listed than on the bus: warn. Otherwise the cards and the driver.
    """
    if not gpus:
        if pci_cards == 0:
            return CheckResult("gpu", "ok", "no NVIDIA cards (CPU only)")
        why = f" (NVML: {nvml_error})" if nvml_error else ""
        return CheckResult(
            "gpu",
            "fail",
            f"{pci_cards} NVIDIA {_cards(pci_cards)} on the PCI bus but no working driver{why}",
            "install the NVIDIA driver (e.g. `ubuntu-drivers install`, or your distribution's "
            "nvidia-driver package), reboot, and check that `nvidia-smi` lists the cards",
        )
    names: dict[str, int] = {}
    for gpu in gpus:
        key = f"{gpu.name} {math.ceil(gpu.memory_total_mb / 1024)} GiB"
        names[key] = names.get(key, 0) + 1
    listed = ", ".join(f"{n} x {name}" for name, n in names.items())
    found = f"{listed}, driver {driver or 'version unknown'}"
    if pci_cards > len(gpus):
        return CheckResult(
            "gpu",
            "warn",
            f"{found}; {pci_cards} NVIDIA {_cards(pci_cards)} on the PCI bus",
            "the driver does not see every card: look in `dmesg` for NVRM or Xid errors "
            "and `nvidia-smi -q` for the missing ones",
        )
    return CheckResult("gpu", "ok", found)


# --- disk ---------------------------------------------------------------------


def disk_result(path: Path, free_bytes: int, total_bytes: int) -> CheckResult:
    """The ``disk`` line for the weights directory ``path``: under 20 GB
    free warns, under 2 GB fails."""
    found = f"{_gb(free_bytes)} free of {_gb(total_bytes)} for weights in {path}"
    fix = f"free space on the file system of {path} or mount a larger disk there"
    if free_bytes < DISK_FAIL_BYTES:
        return CheckResult("disk", "fail", found, fix)
    if free_bytes < DISK_WARN_BYTES:
        return CheckResult("disk", "warn", found, fix + " (a 7B model takes 5-15 GB)")
    return CheckResult("disk", "ok", found)


def _disk_usage(path: Path) -> tuple[Path, int, int]:
    """``(measured path, free, total)`` of ``path`` or its nearest existing parent."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return probe, usage.free, usage.total


# --- reachability -------------------------------------------------------------


def client_ssl_context(
    ca_file: Path | None, cert_file: Path | None = None, key_file: Path | None = None
) -> ssl.SSLContext:
    """A TLS client context: verifying against ``ca_file`` (names checked)
    when given, else verifying nothing; presenting ``cert_file``/``key_file``
    when both are given.

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: a file holds no usable certificate or key.
    """
    if ca_file is not None:
        context = ssl.create_default_context(cafile=str(ca_file))
    else:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert_file is not None and key_file is not None:
        context.load_cert_chain(str(cert_file), str(key_file))
    return context


async def check_reachable(
    cp: ControlPlane,
    port: int,
    context: ssl.SSLContext,
    *,
    ca_file: Path | None = None,
    client_cert: bool = False,
    timeout_s: float = 3.0,
) -> CheckResult:
    """The ``reach`` line for ``cp`` on ``port``: a TCP connect within
    ``timeout_s``, then a TLS handshake within ``timeout_s`` with ``context``
    (``ca_file`` only names in the result what the context verifies against).
    With ``client_cert`` (``context`` presents this node's certificate), also
    whether the control plane accepted that certificate, within ``timeout_s``."""
    address = cp.address(port)
    role = "agent link" if port == cp.agent_port else "join"
    where = f"{address} ({role})"
    firewall = (
        f"open TCP {port} from this node to {cp.host} (a firewall on either side, "
        f"e.g. `ufw allow {port}/tcp` on the control plane) and check that `llmgw server` runs there"
    )
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_tcp_stream(cp.host, port)
    except trio.TooSlowError:
        return CheckResult(
            "reach", "fail", f"{where}: no answer within {timeout_s:g} s (dropped?)", firewall
        )
    except OSError as exc:
        return CheckResult("reach", "fail", f"{where}: {_connect_error(exc)}", firewall)
    tls = trio.SSLStream(stream, context, server_hostname=cp.host, https_compatible=True)
    try:
        with trio.fail_after(timeout_s):
            await tls.do_handshake()
    except trio.TooSlowError:
        await trio.aclose_forcefully(stream)
        return CheckResult(
            "reach",
            "fail",
            f"{where}: TCP connects but no TLS handshake within {timeout_s:g} s",
            f"something other than llmgw answers on {address}: check the address and port",
        )
    except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
        await trio.aclose_forcefully(stream)
        return _tls_failure(cp, where, address, exc)
    verified = f"verified against {ca_file}" if ca_file is not None else "not verified: no CA file"
    if not client_cert:
        await trio.aclose_forcefully(tls)
        return CheckResult("reach", "ok", f"{where}: TLS ok, certificate {verified}")
    refusal = await _certificate_refusal(tls, cp, timeout_s)
    if refusal:
        return CheckResult(
            "reach",
            "fail",
            f"{where}: TLS ok but the control plane refused this node's certificate ({refusal})",
            "this node's certificate is revoked, expired or from another cluster: join again "
            "with a fresh code (`llmgw node add` on the control plane)",
        )
    return CheckResult(
        "reach", "ok", f"{where}: mutual TLS ok, node certificate accepted, certificate {verified}"
    )


async def _certificate_refusal(
    tls: trio.SSLStream[trio.SocketStream], cp: ControlPlane, timeout_s: float
) -> str:
    """Why the control plane refused this node's certificate, ``""`` when it did not.

    With TLS 1.3 a server's verdict on the client's certificate comes after
    the client's handshake ends, so one plain ``GET /agent`` is sent and the
    first answer read within ``timeout_s``. The hub checks the certificate
    first: one it refuses gets 403 with the reason as the body (returned
    after the status line); one it accepts gets 400 (no upgrade). A TLS
    alert, a 401/403, or a close without any answer is a refusal; no answer
    in time is not. Closes ``tls``.
    """
    request = f"GET /agent HTTP/1.1\r\nHost: {cp.host}\r\nConnection: close\r\n\r\n"
    refused = ""
    answer = b""
    try:
        with trio.move_on_after(timeout_s):
            await tls.send_all(request.encode())
            answer = bytes(await tls.receive_some(4096))
            if not answer:
                return "it closed the connection without answering"
            status = answer.split(b"\r\n", 1)[0]
            if status.split(b" ")[1:2] not in ([b"401"], [b"403"]):
                return ""
            refused = status.decode(errors="replace")
            # The hub's 403 says why in its body ("certificate revoked at …"),
            # then closes.
            while len(answer) < 8192:
                more = await tls.receive_some(4096)
                if not more:
                    break
                answer += more
    except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
        if refused:
            pass  # the answer came; a close without close_notify after it is fine
        else:
            cause: BaseException = exc
            while not isinstance(cause, ssl.SSLError) and cause.__cause__ is not None:
                cause = cause.__cause__
            if isinstance(cause, ssl.SSLError):
                return cause.reason or errors.describe(cause)
            return f"it closed the connection without answering: {errors.describe(cause)}"
    finally:
        await trio.aclose_forcefully(tls)
    if not refused:
        return ""
    body = answer.partition(b"\r\n\r\n")[2].decode(errors="replace").strip()
    return f"{refused}: {body}" if body else refused


def _connect_error(exc: BaseException) -> str:
    """What a failed connect says: the first attempt's reason (``connection
    refused``), not trio's "all attempts … failed"."""
    tls = _ssl_cause(exc)
    if tls is not None:
        return _ssl_text(tls)
    reason: BaseException | None = exc
    seen = 0
    while reason is not None and seen < 16:
        if isinstance(reason, socket.gaierror):
            return f"the name does not resolve ({reason.strerror})"
        if isinstance(reason, OSError) and reason.errno is not None:
            return os.strerror(reason.errno).lower()
        cause = reason.__cause__
        if cause is None and not reason.__suppress_context__:
            cause = reason.__context__
        if cause is None and reason.args and isinstance(reason.args[0], BaseException):
            cause = reason.args[0]  # httpcore's errors wrap the original this way
        if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
            cause = cause.exceptions[0]
        reason, seen = cause, seen + 1
    return errors.describe(exc)


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    """The :class:`ssl.SSLError` in ``exc``'s causes (httpx and httpcore wrap
    it), or ``None``. Looked for before any plain OSError: an SSLError is one
    too, with errno 1, which would read "operation not permitted"."""
    reason: BaseException | None = exc
    seen = 0
    while reason is not None and seen < 16:
        if isinstance(reason, ssl.SSLError):
            return reason
        cause = reason.__cause__
        if cause is None and not reason.__suppress_context__:
            cause = reason.__context__
        if cause is None and reason.args and isinstance(reason.args[0], BaseException):
            cause = reason.args[0]
        if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
            cause = cause.exceptions[0]
        reason, seen = cause, seen + 1
    return None


def _ssl_text(cause: ssl.SSLError) -> str:
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"certificate refused ({cause.verify_message})"
    return f"the TLS handshake failed ({cause.reason or errors.describe(cause)})"


def _ssl_fix(cp: ControlPlane, cause: ssl.SSLCertVerificationError) -> str:
    """What to do about the control plane's certificate failing to verify."""
    code = cause.verify_code
    if code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
        return (
            f"the control plane's certificate does not name {cp.host}: start "
            f"`llmgw server --advertise {cp.host}` (it re-issues its certificate), "
            "or use an address it names"
        )
    if code in (9, 10):  # not yet valid, expired
        return "check the clocks here and on the control plane"
    return (
        "the control plane's certificate is not from this node's cluster CA (another "
        "cluster's?): join again with a fresh code (`llmgw node add` on the control plane)"
    )


def _tls_failure(cp: ControlPlane, where: str, address: str, exc: BaseException) -> CheckResult:
    cause: BaseException = exc
    while not isinstance(cause, ssl.SSLError) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        fix = _ssl_fix(cp, cause)
        if cause.verify_code in (9, 10):
            fix += " (see the clock line)"
        return CheckResult("reach", "fail", f"{where}: {_ssl_text(cause)}", fix)
    return CheckResult(
        "reach",
        "fail",
        f"{where}: TCP connects but the TLS handshake failed ({errors.describe(cause)})",
        f"something other than llmgw's TLS answers on {address}: check the address and port",
    )


# --- clock --------------------------------------------------------------------


def clock_result(address: str, offset_s: float, round_trip_s: float) -> CheckResult:
    """The ``clock`` line: ``offset_s`` = the control plane's time minus
    ours at the request's midpoint; over 1 s warns, over 30 s fails."""
    ahead = "ahead of" if offset_s >= 0 else "behind"
    found = (
        f"{address}: its clock is {abs(offset_s):.3f} s {ahead} this one "
        f"(round trip {round_trip_s * 1000:.0f} ms)"
    )
    if abs(offset_s) > CLOCK_FAIL_S:
        return CheckResult("clock", "fail", found + ": certificates may not verify", _TIME_SYNC_FIX)
    if abs(offset_s) > CLOCK_WARN_S:
        return CheckResult("clock", "warn", found, _TIME_SYNC_FIX)
    return CheckResult("clock", "ok", found)


async def check_clock(
    cp: ControlPlane,
    context: ssl.SSLContext,
    *,
    scheme: Literal["https", "http"] = "https",
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.time,
) -> CheckResult:
    """The ``clock`` line for ``cp``: ``GET /v1/join/time`` on its join port
    (answer ``{"time_s": epoch seconds}``) within ``timeout_s``, compared
    with ``clock()`` at the midpoint of the request."""
    address = cp.address(cp.join_port)
    url = f"{scheme}://{address}/v1/join/time"
    unreachable = (
        f"make the join port reachable (see the reach line for {address}) and check "
        "that `llmgw server` runs there"
    )
    try:
        # httpx's own timeouts end the request (closing its socket); the outer
        # bound only catches what they do not cover (a cancelled request may
        # leave its socket to the garbage collector).
        with trio.fail_after(3 * timeout_s):
            # One request, its connection closed as soon as the answer is read
            # (none is kept in a pool to be closed, or collected, later).
            async with httpx.AsyncClient(
                verify=context,
                timeout=timeout_s,
                limits=httpx.Limits(max_keepalive_connections=0),
                headers={"connection": "close"},
            ) as client:
                started = clock()
                began = time.monotonic()
                response = await client.get(url)
                round_trip_s = time.monotonic() - began
                ended = clock()
    except (trio.TooSlowError, httpx.TimeoutException):
        return CheckResult(
            "clock", "fail", f"{address}: no answer within {timeout_s:g} s", unreachable
        )
    except httpx.HTTPError as exc:
        tls = _ssl_cause(exc)
        if isinstance(tls, ssl.SSLCertVerificationError):
            fix = _ssl_fix(cp, tls)
        elif tls is not None:
            fix = (
                f"something other than llmgw's TLS answers on {address}: check the address and port"
            )
        else:
            fix = unreachable
        return CheckResult(
            "clock", "fail", f"{address}: cannot ask its time: {_connect_error(exc)}", fix
        )
    if response.status_code == 404:
        return CheckResult(
            "clock",
            "warn",
            f"{address}: no /v1/join/time (404)",
            "the control plane's llmgw is older than this node's: upgrade it to check clocks",
        )
    try:
        body = response.json()
        their_time = float(body["time_s"])
        if response.status_code != 200 or not math.isfinite(their_time):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return CheckResult(
            "clock",
            "fail",
            f"{address}: /v1/join/time answered {response.status_code} without a time",
            f"{address} does not look like llmgw's join port: check the address and port",
        )
    offset_s = their_time - (started + ended) / 2
    return clock_result(address, offset_s, round_trip_s)


def not_joined_results() -> list[CheckResult]:
    """The ``reach`` and ``clock`` lines of a node with no control plane."""
    fix = (
        "join with the line `llmgw node add` prints on the control plane, "
        "or name one with --server HOST"
    )
    return [
        CheckResult("reach", "warn", "not joined: no control plane to check", fix),
        CheckResult("clock", "warn", "not joined: no control plane to check", fix),
    ]


# --- all ----------------------------------------------------------------------


async def run_doctor(config: DoctorConfig) -> list[CheckResult]:
    """Every check on this machine, in order: cpu, memory, gpu, disk, then
    for each control plane its agent port, its join port and its clock (or
    the two "not joined" warnings). The checks that wait run concurrently;
    the whole takes at most the longest deadline."""
    slots: list[list[CheckResult]] = []

    def slot() -> list[CheckResult]:
        slots.append([])
        return slots[-1]

    async def fill(into: list[CheckResult], check: Callable[[], Awaitable[CheckResult]]) -> None:
        into.append(await check())

    cpus, arch, flags = probe_cpu()
    slot().append(cpu_result(cpus, arch, flags))
    try:
        total_mb, available_mb = discovery.memory_mb()
        slot().append(memory_result(total_mb * 1024 * 1024, available_mb * 1024 * 1024))
    except OSError as exc:
        slot().append(
            CheckResult(
                "memory",
                "warn",
                f"cannot read /proc/meminfo: {errors.describe(exc)}",
                "run doctor on Linux with /proc mounted",
            )
        )
    gpu_slot = slot()
    try:
        measured, free, total = _disk_usage(config.weights_dir)
        note = "" if measured == config.weights_dir else f" (not made yet: measured {measured})"
        result = disk_result(config.weights_dir, free, total)
        slot().append(attrs.evolve(result, found=result.found + note))
    except OSError as exc:
        slot().append(
            CheckResult(
                "disk",
                "fail",
                f"cannot measure {config.weights_dir}: {errors.describe(exc)}",
                "give a weights directory this user can read (--data-dir)",
            )
        )

    context: ssl.SSLContext | None = None
    ca_file = config.ca_file
    presents_cert = config.cert_file is not None and config.key_file is not None
    if config.control_planes:
        try:
            context = client_ssl_context(config.ca_file, config.cert_file, config.key_file)
        except (OSError, ssl.SSLError) as exc:
            slot().append(
                CheckResult(
                    "tls",
                    "fail",
                    f"cannot load this node's TLS files: {errors.describe(exc)}",
                    "join again with a fresh code (`llmgw node add` on the control plane)",
                )
            )
            context = client_ssl_context(None)
            ca_file, presents_cert = None, False
    else:
        slot().extend(not_joined_results())

    async with trio.open_nursery() as nursery:

        async def gpus() -> CheckResult:
            try:
                with trio.fail_after(config.gpu_timeout_s):
                    found, driver, nvml_error = await trio.to_thread.run_sync(
                        probe_gpus, abandon_on_cancel=True
                    )
            except trio.TooSlowError:
                return CheckResult(
                    "gpu",
                    "fail",
                    f"NVML did not answer within {config.gpu_timeout_s:g} s",
                    "the NVIDIA driver is stuck: look in `dmesg` for Xid errors and reboot",
                )
            return gpu_result(nvidia_pci_cards(), found, driver, nvml_error)

        nursery.start_soon(fill, gpu_slot, gpus)
        if context is not None:
            for cp in config.control_planes:
                for port in (cp.agent_port, cp.join_port):
                    reach = partial(
                        check_reachable,
                        cp,
                        port,
                        context,
                        ca_file=ca_file,
                        client_cert=presents_cert and port == cp.agent_port,
                        timeout_s=config.connect_timeout_s,
                    )
                    nursery.start_soon(fill, slot(), reach)
                clock = partial(
                    check_clock,
                    cp,
                    context,
                    scheme=config.join_scheme,
                    timeout_s=config.clock_timeout_s,
                )
                nursery.start_soon(fill, slot(), clock)
    return [result for results in slots for result in results]


def _gb(value: int) -> str:
    return f"{value / _GB:.1f} GB"


def _cards(n: int) -> str:
    return "card" if n == 1 else "cards"

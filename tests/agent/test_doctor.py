"""``llmgw doctor``'s checks: each decision with given figures, the probes on
fake files, and the remote checks against real local servers (TCP, TLS made
with the ``openssl`` command, HTTP(S) answering ``/v1/join/time``)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path

import attrs
import pynvml
import pytest
import trio

from llmgw import errors
from llmgw.agent import doctor
from llmgw.agent.doctor import CheckResult, ControlPlane, DoctorConfig
from llmgw.agent.protocol import Gpu

GB = 1_000_000_000


# --- decisions ----------------------------------------------------------------


def test_cpu_with_avx2_is_ok_and_lists_the_extensions() -> None:
    result = doctor.cpu_result(2, "x86_64", {"sse4_2", "avx", "avx2", "fma", "avx512f"})
    assert result == CheckResult("cpu", "ok", "2 CPUs, AVX2 FMA AVX-512F")


def test_cpu_without_avx2_in_a_vm_warns_with_the_vm_cpu_type() -> None:
    """kvm64 shows sse4_2 and the hypervisor flag but no AVX2 or FMA."""
    result = doctor.cpu_result(4, "x86_64", {"sse4_2", "hypervisor", "lm"})
    assert result.status == "warn"
    assert result.found == "4 CPUs, none of AVX2 FMA AVX-512F"
    assert "host-passthrough" in result.fix
    assert "5x slower" in result.fix


def test_cpu_without_avx2_on_bare_metal_warns_without_a_vm_fix() -> None:
    result = doctor.cpu_result(1, "x86_64", {"sse4_2", "avx", "fma"})
    assert result.status == "warn"
    assert result.found == "1 CPU, FMA, no AVX2"
    assert "host-passthrough" not in result.fix
    assert "5x slower" in result.fix


def test_cpu_on_arm_reports_neon_and_sve() -> None:
    result = doctor.cpu_result(64, "aarch64", {"fp", "asimd", "sve", "sve2"})
    assert result == CheckResult("cpu", "ok", "64 CPUs, NEON SVE SVE2")


def test_probe_cpu_reads_every_flag_of_the_first_cpu(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu sse4_2 hypervisor avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    cpus, arch, flags = doctor.probe_cpu(cpuinfo)
    assert cpus >= 1
    assert arch
    assert flags == {"fpu", "sse4_2", "hypervisor", "avx2"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert doctor.probe_cpu(arm)[2] == {"fp", "asimd", "sve"}
    assert doctor.probe_cpu(tmp_path / "missing")[2] == frozenset()


def test_memory_under_2_gb_available_warns() -> None:
    low = doctor.memory_result(16 * GB, 1_500_000_000)
    assert low.status == "warn"
    assert low.found == "1.5 GB available of 16.0 GB"
    assert low.fix
    assert doctor.memory_result(16 * GB, 2 * GB).status == "ok"


def _gpu(index: int, name: str = "NVIDIA H200", mb: int = 143_771) -> Gpu:
    return Gpu(index=index, name=name, memory_total_mb=mb, memory_used_mb=0)


def test_no_nvidia_card_is_ok() -> None:
    assert doctor.gpu_result(0, (), "", "NVML Shared Library Not Found") == CheckResult(
        "gpu", "ok", "no NVIDIA cards (CPU only)"
    )


def test_a_card_without_a_working_driver_fails() -> None:
    result = doctor.gpu_result(2, (), "", "Driver Not Loaded")
    assert result.status == "fail"
    assert (
        result.found
        == "2 NVIDIA cards on the PCI bus but no working driver (NVML: Driver Not Loaded)"
    )
    assert "install the NVIDIA driver" in result.fix


def test_cards_with_their_driver_are_ok_and_a_missing_one_warns() -> None:
    gpus = (_gpu(0), _gpu(1))
    ok = doctor.gpu_result(2, gpus, "550.54.15")
    assert ok == CheckResult("gpu", "ok", "2 x NVIDIA H200 141 GiB, driver 550.54.15")
    short = doctor.gpu_result(3, gpus, "550.54.15")
    assert short.status == "warn"
    assert "3 NVIDIA cards on the PCI bus" in short.found
    assert "dmesg" in short.fix


def test_nvidia_pci_cards_counts_gpus_only(tmp_path: Path) -> None:
    """An NVIDIA 3D controller counts; its audio function and an Intel GPU do not."""
    for name, vendor, klass in (
        ("0000:3b:00.0", "0x10de", "0x030200"),
        ("0000:3b:00.1", "0x10de", "0x040300"),
        ("0000:00:02.0", "0x8086", "0x030000"),
        ("0000:86:00.0", "0x10DE", "0x030000"),
    ):
        device = tmp_path / name
        device.mkdir()
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(klass + "\n")
    (tmp_path / "0000:99:00.0").mkdir()  # unreadable: skipped
    assert doctor.nvidia_pci_cards(tmp_path) == 2
    assert doctor.nvidia_pci_cards(tmp_path / "missing") == 0


def test_probe_gpus_keeps_nvmls_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver that is installed but not loaded: no cards, and NVML's words."""

    def not_loaded() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", not_loaded)
    gpus, driver, reason = doctor.probe_gpus()
    assert (gpus, driver) == ((), "")
    assert reason == "Driver Not Loaded"


async def test_a_stuck_driver_fails_the_gpu_line_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NVML that never answers: the line fails at gpu_timeout_s, the rest is reported."""
    release = threading.Event()

    def stuck() -> tuple[tuple[Gpu, ...], str, str]:
        release.wait(30)
        return (), "", ""

    monkeypatch.setattr(doctor, "probe_gpus", stuck)
    try:
        with trio.fail_after(30):
            results = await doctor.run_doctor(DoctorConfig(weights_dir=tmp_path, gpu_timeout_s=0.2))
    finally:
        release.set()
    gpu = results[2]
    assert gpu.name == "gpu"
    assert gpu.status == "fail"
    assert gpu.found == "NVML did not answer within 0.2 s"
    assert "Xid" in gpu.fix
    assert len(results) == 6


@pytest.mark.parametrize(
    ("free", "status"), [(GB // 2, "fail"), (2 * GB, "warn"), (19 * GB, "warn"), (20 * GB, "ok")]
)
def test_disk_thresholds(free: int, status: str) -> None:
    result = doctor.disk_result(Path("/var/lib/llmgw-weights"), free, 500 * GB)
    assert result.status == status
    assert "/var/lib/llmgw-weights" in result.found
    assert bool(result.fix) == (status != "ok")


@pytest.mark.parametrize(
    ("offset", "status", "word"),
    [
        (0.2, "ok", "ahead of"),
        (-5.0, "warn", "behind"),
        (1.5, "warn", "ahead of"),
        (-31.0, "fail", "behind"),
    ],
)
def test_clock_thresholds(offset: float, status: str, word: str) -> None:
    result = doctor.clock_result("10.0.0.1:7444", offset, 0.004)
    assert result.status == status
    assert f"{abs(offset):.3f} s {word} this one" in result.found
    if status != "ok":
        assert "chrony" in result.fix


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1", ControlPlane("10.0.0.1", 7443, 7444)),
        ("cp.example:9443", ControlPlane("cp.example", 9443, 7444)),
        ("wss://10.0.0.1:7443/agent", ControlPlane("10.0.0.1", 7443, 7444)),
        ("wss://cp.example/agent", ControlPlane("cp.example", 7443, 7444)),
        ("[fd00::1]:7000", ControlPlane("fd00::1", 7000, 7444)),
        ("fd00::1", ControlPlane("fd00::1", 7443, 7444)),
    ],
)
def test_parse_control_plane(text: str, expected: ControlPlane) -> None:
    assert doctor.parse_control_plane(text) == expected


@pytest.mark.parametrize("text", ["", "host:http", "host:70000", "wss:///agent", "host:0"])
def test_parse_control_plane_refuses_bad_addresses(text: str) -> None:
    with pytest.raises(errors.InvalidInput, match=r"HOST|port"):
        doctor.parse_control_plane(text)


def test_ipv6_addresses_are_bracketed() -> None:
    assert ControlPlane("fd00::1").address(7443) == "[fd00::1]:7443"
    assert ControlPlane("cp").address(7444) == "cp:7444"


# --- real servers ---------------------------------------------------------------


@attrs.frozen
class Certs:
    """A CA, the control plane's certificate (names 127.0.0.1 and localhost)
    and a node's, made by ``openssl``; a second CA that signed nothing here."""

    ca: Path
    server_cert: Path
    server_key: Path
    node_cert: Path
    node_key: Path
    other_ca: Path
    stranger_cert: Path
    stranger_key: Path
    misnamed_cert: Path
    misnamed_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def _issue(directory: Path, ca: tuple[Path, Path], name: str, san: str) -> tuple[Path, Path]:
    cert, key, csr = (directory / f"{name}.{ext}" for ext in ("crt", "key", "csr"))
    ext = directory / f"{name}.ext"
    ext.write_text(
        f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes these tests' certificates")
    directory = tmp_path_factory.mktemp("certs")
    ca = _make_ca(directory, "cluster-ca")
    other = _make_ca(directory, "other-ca")
    server = _issue(directory, ca, "cp", "IP:127.0.0.1,DNS:localhost")
    node = _issue(directory, ca, "node-b", "DNS:node-b")
    misnamed = _issue(directory, ca, "elsewhere", "DNS:elsewhere.example,IP:10.9.9.9")
    stranger = _issue(directory, other, "stranger", "DNS:stranger")
    return Certs(ca[0], *server, *node, other[0], *stranger, *misnamed)


def _server_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        context.load_verify_locations(str(client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


Handler = Callable[[trio.abc.Stream], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler, context: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """A listener on 127.0.0.1 running ``handler`` per connection (over TLS
    with ``context``); yields its port."""

    async def guarded(stream: trio.abc.Stream) -> None:
        try:
            if isinstance(stream, trio.SSLStream):
                await stream.do_handshake()
            await handler(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client gave up: what some tests do on purpose
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        if context is None:
            listeners = await nursery.start(partial(trio.serve_tcp, guarded, 0, host="127.0.0.1"))
            sock = listeners[0].socket
        else:
            listeners = await nursery.start(
                partial(trio.serve_ssl_over_tcp, guarded, 0, context, host="127.0.0.1")
            )
            sock = listeners[0].transport_listener.socket
        yield int(sock.getsockname()[1])
        nursery.cancel_scope.cancel()


async def hold_open(stream: trio.abc.Stream) -> None:
    """Read until the client closes."""
    while await stream.receive_some():
        pass


async def ssh_banner(stream: trio.abc.Stream) -> None:
    """Answer like an ssh server, not TLS."""
    await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\n")
    await hold_open(stream)


async def not_upgraded(stream: trio.abc.Stream) -> None:
    """Answer the first request 400, as trio-websocket's hub does a plain GET."""
    await stream.receive_some()
    await stream.send_all(b"HTTP/1.1 400 \r\ncontent-length: 0\r\nConnection: close\r\n\r\n")


async def forbidden(stream: trio.abc.Stream) -> None:
    """Answer the first request 403, as a hub refusing a revoked certificate."""
    await stream.receive_some()
    await stream.send_all(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")


def time_answer(time_s: float | None, status: str = "200 OK") -> Handler:
    """A handler answering one HTTP request with ``{"time_s": time_s}``
    (a 404 page when ``time_s`` is None)."""

    async def answer(stream: trio.abc.Stream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            chunk = await stream.receive_some()
            if not chunk:
                return
            request += chunk
        assert request.startswith(b"GET /v1/join/time HTTP/1.1\r\n"), request
        body = json.dumps({"time_s": time_s}).encode() if time_s is not None else b"not found"
        head = status if time_s is not None else "404 Not Found"
        await stream.send_all(
            f"HTTP/1.1 {head}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )

    return answer


@contextmanager
def closed_port() -> Iterator[int]:
    """A port bound on 127.0.0.1 with nothing listening: a connect is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def test_reach_a_closed_port_fails_with_the_port_in_the_fix() -> None:
    with closed_port() as port:
        cp = ControlPlane("127.0.0.1", port)
        result = await doctor.check_reachable(cp, port, doctor.client_ssl_context(None))
    assert result.status == "fail"
    assert result.found == f"127.0.0.1:{port} (agent link): connection refused"
    assert f"open TCP {port} from this node to 127.0.0.1" in result.fix


async def test_reach_a_plain_tcp_listener_fails_the_tls_handshake() -> None:
    """Something answers TCP but not TLS: the connect is fine, the handshake
    is not (an ssh banner at once; silence after the deadline)."""
    for handler, why in (
        (ssh_banner, "the TLS handshake failed ("),
        (hold_open, "no TLS handshake within 0.5 s"),
    ):
        async with serving(handler) as port:
            cp = ControlPlane("127.0.0.1", 7443, port)
            with trio.fail_after(10):
                result = await doctor.check_reachable(
                    cp, port, doctor.client_ssl_context(None), timeout_s=0.5
                )
        assert result.status == "fail"
        assert result.found.startswith(f"127.0.0.1:{port} (join): TCP connects but {why}"), result
        assert f"127.0.0.1:{port}" in result.fix


async def test_reach_over_mutual_tls_verified_against_the_ca(certs: Certs) -> None:
    server = _server_context(certs.server_cert, certs.server_key, client_ca=certs.ca)
    async with serving(not_upgraded, server) as port:
        cp = ControlPlane("127.0.0.1", port)
        context = doctor.client_ssl_context(certs.ca, certs.node_cert, certs.node_key)
        with trio.fail_after(10):
            result = await doctor.check_reachable(
                cp, port, context, ca_file=certs.ca, client_cert=True
            )
    assert result == CheckResult(
        "reach",
        "ok",
        f"127.0.0.1:{port} (agent link): mutual TLS ok, node certificate accepted, "
        f"certificate verified against {certs.ca}",
    )


async def test_reach_finds_this_nodes_certificate_refused(certs: Certs) -> None:
    """TLS 1.3 tells the client after its handshake: a refused certificate
    (another CA's) shows as the alert, a revoked one as a 403."""
    server = _server_context(certs.server_cert, certs.server_key, client_ca=certs.ca)
    stranger = doctor.client_ssl_context(certs.ca, certs.stranger_cert, certs.stranger_key)
    async with serving(hold_open, server) as port:
        with trio.fail_after(10):
            alert = await doctor.check_reachable(
                ControlPlane("127.0.0.1", port), port, stranger, ca_file=certs.ca, client_cert=True
            )
    assert alert.status == "fail"
    assert "refused this node's certificate (" in alert.found, alert
    assert "join again" in alert.fix
    node = doctor.client_ssl_context(certs.ca, certs.node_cert, certs.node_key)
    async with serving(forbidden, server) as port:
        with trio.fail_after(10):
            revoked = await doctor.check_reachable(
                ControlPlane("127.0.0.1", port), port, node, ca_file=certs.ca, client_cert=True
            )
    assert revoked.status == "fail"
    assert "refused this node's certificate (HTTP/1.1 403 Forbidden)" in revoked.found


async def test_reach_refuses_a_control_plane_of_another_ca(certs: Certs) -> None:
    async with serving(hold_open, _server_context(certs.server_cert, certs.server_key)) as port:
        cp = ControlPlane("127.0.0.1", port)
        context = doctor.client_ssl_context(certs.other_ca)
        with trio.fail_after(10):
            result = await doctor.check_reachable(cp, port, context, ca_file=certs.other_ca)
    assert result.status == "fail"
    assert "certificate refused" in result.found
    assert "join again" in result.fix


async def test_reach_names_the_advertise_fix_for_a_certificate_of_other_names(
    certs: Certs,
) -> None:
    server = _server_context(certs.misnamed_cert, certs.misnamed_key)
    async with serving(hold_open, server) as port:
        cp = ControlPlane("127.0.0.1", port)
        with trio.fail_after(10):
            result = await doctor.check_reachable(
                cp, port, doctor.client_ssl_context(certs.ca), ca_file=certs.ca
            )
    assert result.status == "fail"
    assert "llmgw server --advertise 127.0.0.1" in result.fix


async def test_clock_offset_is_their_time_minus_the_request_midpoint() -> None:
    """The server says 1000.0; our clock reads 990 before and 992 after: 9 s."""
    readings = iter([990.0, 992.0])
    async with serving(time_answer(1000.0)) as port:
        with trio.fail_after(10):
            result = await doctor.check_clock(
                ControlPlane("127.0.0.1", 7443, port),
                doctor.client_ssl_context(None),
                scheme="http",
                clock=lambda: next(readings),
            )
    assert result.status == "warn"
    assert result.found.startswith(f"127.0.0.1:{port}: its clock is 9.000 s ahead of this one")
    assert "timedatectl set-ntp true" in result.fix


async def test_clock_behind_by_minutes_fails_and_in_step_is_ok(certs: Certs) -> None:
    """Over HTTPS verified against the CA, with the real clock."""
    import time

    server = _server_context(certs.server_cert, certs.server_key)
    context = doctor.client_ssl_context(certs.ca)
    for shift, status in ((-120.0, "fail"), (0.0, "ok")):
        async with serving(time_answer(time.time() + shift), server) as port:
            with trio.fail_after(10):
                result = await doctor.check_clock(ControlPlane("127.0.0.1", 7443, port), context)
        assert result.status == status, result


async def test_clock_says_a_certificate_failure_not_operation_not_permitted(
    certs: Certs,
) -> None:
    """An ssl.SSLError carries errno 1: it is told as the certificate's
    failure, with the certificate's fix, not as "operation not permitted"."""
    for server, ca, fix in (
        (
            _server_context(certs.misnamed_cert, certs.misnamed_key),
            certs.ca,
            "llmgw server --advertise 127.0.0.1",
        ),
        (_server_context(certs.server_cert, certs.server_key), certs.other_ca, "another cluster"),
    ):
        async with serving(time_answer(1000.0), server) as port:
            with trio.fail_after(10):
                result = await doctor.check_clock(
                    ControlPlane("127.0.0.1", 7443, port), doctor.client_ssl_context(ca)
                )
        assert result.status == "fail"
        assert "operation not permitted" not in result.found, result
        assert result.found.startswith(
            f"127.0.0.1:{port}: cannot ask its time: certificate refused ("
        ), result
        assert fix in result.fix, result
        assert "make the join port reachable" not in result.fix


async def test_clock_without_the_endpoint_or_a_time() -> None:
    context = doctor.client_ssl_context(None)
    async with serving(time_answer(None)) as port:
        with trio.fail_after(10):
            old = await doctor.check_clock(
                ControlPlane("127.0.0.1", 1, port), context, scheme="http"
            )
    assert old.status == "warn"
    assert "404" in old.found
    async with serving(time_answer(float("nan"))) as port:
        with trio.fail_after(10):
            odd = await doctor.check_clock(
                ControlPlane("127.0.0.1", 1, port), context, scheme="http"
            )
    assert odd.status == "fail"
    assert "without a time" in odd.found
    with closed_port() as port:
        with trio.fail_after(10):
            down = await doctor.check_clock(
                ControlPlane("127.0.0.1", 1, port), context, scheme="http"
            )
    assert down.status == "fail"
    assert down.found == f"127.0.0.1:{port}: cannot ask its time: connection refused"


async def test_run_doctor_on_this_machine_not_joined(tmp_path: Path) -> None:
    with trio.fail_after(60):
        results = await doctor.run_doctor(DoctorConfig(weights_dir=tmp_path / "weights"))
    assert [r.name for r in results] == ["cpu", "memory", "gpu", "disk", "reach", "clock"]
    by_name = {r.name: r for r in results}
    assert by_name["reach"].status == by_name["clock"].status == "warn"
    assert by_name["reach"].found == "not joined: no control plane to check"
    assert str(tmp_path / "weights") in by_name["disk"].found
    assert "not made yet" in by_name["disk"].found
    for result in results:
        assert bool(result.fix) == (result.status != "ok"), result


async def test_run_doctor_checks_each_control_plane_concurrently(tmp_path: Path) -> None:
    """Two control planes, one listening (plain HTTP time, plain TCP on its
    agent port) and one refusing: each gets its reach and clock lines, in order."""
    async with serving(ssh_banner) as agent_port, serving(time_answer(0.0)) as join_port:
        with closed_port() as dead:
            config = DoctorConfig(
                weights_dir=tmp_path,
                control_planes=(
                    ControlPlane("127.0.0.1", agent_port, join_port),
                    ControlPlane("127.0.0.1", dead, dead),
                ),
                join_scheme="http",
                connect_timeout_s=0.5,
            )
            with trio.fail_after(60):
                results = await doctor.run_doctor(config)
    remote = [(r.name, r.status, r.found.split(" ")[0]) for r in results[4:]]
    assert remote == [
        ("reach", "fail", f"127.0.0.1:{agent_port}"),  # TCP, no TLS
        ("reach", "fail", f"127.0.0.1:{join_port}"),  # plain HTTP, no TLS
        ("clock", "fail", f"127.0.0.1:{join_port}:"),  # 1970: certificates would fail
        ("reach", "fail", f"127.0.0.1:{dead}"),
        ("reach", "fail", f"127.0.0.1:{dead}"),
        ("clock", "fail", f"127.0.0.1:{dead}:"),
    ]
    assert "TCP connects" in results[4].found
    assert "connection refused" in results[7].found


async def test_run_doctor_reports_unreadable_tls_files(tmp_path: Path) -> None:
    with closed_port() as dead:
        config = DoctorConfig(
            weights_dir=tmp_path,
            control_planes=(ControlPlane("127.0.0.1", dead, dead),),
            ca_file=tmp_path / "missing-ca.crt",
        )
        with trio.fail_after(60):
            results = await doctor.run_doctor(config)
    tls = [r for r in results if r.name == "tls"]
    assert len(tls) == 1
    assert tls[0].status == "fail"
    assert "join again" in tls[0].fix
    assert [r.name for r in results][-3:] == ["reach", "reach", "clock"]

"""The cluster CA: files and modes, re-issue on new names, real TLS handshakes."""

from __future__ import annotations

import datetime as dt
import hashlib
import ssl
import stat
from functools import partial
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import errors
from llmgw.control.ca import BadCertificateRequest, ClusterCA, machine_addresses, server_names


def make_csr(cn: str = "whatever") -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .sign(key, hashes.SHA256())
    )
    return key, csr.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def client_context(
    tmp_path: Path, ca_pem: bytes, cert_pem: bytes | None, key: ec.EllipticCurvePrivateKey | None
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    if cert_pem is not None and key is not None:
        (tmp_path / "c.crt").write_bytes(cert_pem)
        (tmp_path / "c.key").write_bytes(key_pem(key))
        ctx.load_cert_chain(tmp_path / "c.crt", tmp_path / "c.key")
    return ctx


def self_signed(cn: str) -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert.public_bytes(serialization.Encoding.PEM)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- files ------------------------------------------------------------------------


def test_the_ca_is_made_once_with_private_files_in_a_private_folder(tmp_path: Path) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", ["cp.example", "10.0.0.1"])
    assert mode(tmp_path / "ca") == 0o700
    for name in ("ca.crt", "ca.key", "server.crt", "server.key"):
        assert mode(tmp_path / "ca" / name) == 0o600, name
    assert sorted(p.name for p in (tmp_path / "ca").iterdir()) == [
        "ca.crt",
        "ca.key",
        "server.crt",
        "server.key",
    ]
    assert ca.ca_path == tmp_path / "ca" / "ca.crt"
    assert ca.ca_pem == ca.ca_path.read_bytes()
    der = x509.load_pem_x509_certificate(ca.ca_pem).public_bytes(serialization.Encoding.DER)
    assert ca.fingerprint == "sha256:" + hashlib.sha256(der).hexdigest()

    cert = x509.load_pem_x509_certificate(ca.ca_pem)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert 3649 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 3651

    again = ClusterCA.load_or_create(tmp_path / "ca", ["cp.example", "10.0.0.1"])
    assert again.fingerprint == ca.fingerprint


def test_a_wider_folder_is_made_private(tmp_path: Path) -> None:
    (tmp_path / "ca").mkdir(mode=0o755)
    (tmp_path / "ca").chmod(0o755)
    ClusterCA.load_or_create(tmp_path / "ca", [])
    assert mode(tmp_path / "ca") == 0o700


def test_the_server_certificate_has_the_names_and_is_reissued_when_they_change(
    tmp_path: Path,
) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", ["cp.example", "10.0.0.1"])
    first = ca.server_cert_path.read_bytes()
    cert = x509.load_pem_x509_certificate(first)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sorted(str(n.value) for n in sans) == sorted(
        ["cp.example", "10.0.0.1", "localhost", "127.0.0.1"]
    )
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert 729 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 731

    # The same names (in another order, another case): kept as it is.
    ClusterCA.load_or_create(tmp_path / "ca", ["10.0.0.1", "CP.example"])
    assert ca.server_cert_path.read_bytes() == first

    # A new address: issued again by the same CA.
    moved = ClusterCA.load_or_create(tmp_path / "ca", ["cp.example", "10.0.0.2"])
    assert moved.fingerprint == ca.fingerprint
    second = x509.load_pem_x509_certificate(moved.server_cert_path.read_bytes())
    sans = second.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "10.0.0.2" in {str(n.value) for n in sans}
    assert "10.0.0.1" not in {str(n.value) for n in sans}
    assert mode(moved.server_key_path) == 0o600


def test_a_name_that_is_neither_address_nor_dns_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidInput, match="neither an IP address nor a DNS name"):
        ClusterCA.load_or_create(tmp_path / "ca", ["10.0.0.1:7444"])


def test_a_ca_folder_with_a_certificate_but_no_key_is_refused(tmp_path: Path) -> None:
    ClusterCA.load_or_create(tmp_path / "ca", [])
    (tmp_path / "ca" / "ca.key").unlink()
    with pytest.raises(errors.StartupError, match=r"ca\.crt is there but ca\.key is not"):
        ClusterCA.load_or_create(tmp_path / "ca", [])


def test_the_default_names_put_advertised_ones_first_and_skip_loopback_addresses() -> None:
    names = server_names(["gw.example"])
    assert names[0] == "gw.example"
    assert names[-2:] == ["localhost", "127.0.0.1"]
    for address in machine_addresses():
        assert not address.startswith("127.")
        assert address != "::1"
        assert address in names


# --- issuing ----------------------------------------------------------------------


def test_a_node_certificate_names_the_node_and_is_for_clients_only(tmp_path: Path) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    _, csr = make_csr("ignored-subject")
    issued = ca.issue(csr, "node-b")
    cert = x509.load_pem_x509_certificate(issued.pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-b"
    assert format(cert.serial_number, "x") == issued.serial
    assert issued.not_after == cert.not_valid_after_utc.timestamp()
    assert 364 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 366
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.ca_pem))


def test_a_request_with_a_broken_signature_is_refused(tmp_path: Path) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    _, csr = make_csr()
    der = bytearray(x509.load_pem_x509_csr(csr).public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # the last byte of the signature
    broken = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM)
    with pytest.raises(BadCertificateRequest, match="signature does not verify"):
        ca.issue(broken, "node-b")


@pytest.mark.parametrize(
    ("csr", "node_id", "message"),
    [
        (b"not a request", "node-b", "not a PEM PKCS#10 request"),
        (b"x" * 20_000, "node-b", "at most 16384"),
        (None, "-bad", "node id '-bad' is not valid"),
        (None, "a/b", "node id 'a/b' is not valid"),
    ],
)
def test_bad_requests_are_refused_saying_what_is_wrong(
    tmp_path: Path, csr: bytes | None, node_id: str, message: str
) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    with pytest.raises(BadCertificateRequest, match=message):
        ca.issue(csr if csr is not None else make_csr()[1], node_id)


# --- TLS over loopback ------------------------------------------------------------


async def _handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str = "127.0.0.1"
) -> tuple[dict[str, object] | BaseException, bytes | BaseException]:
    """One connection: (what the server saw: the peer cert or its error, what the client got)."""
    seen: list[dict[str, object] | BaseException] = []
    served = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def handle(stream: trio.SocketStream) -> None:
                tls = trio.SSLStream(stream, server_ctx, server_side=True)
                try:
                    await tls.do_handshake()
                    peer = tls.getpeercert()
                    seen.append(peer if peer is not None else {})
                    await tls.send_all(b"hello")
                    await trio.aclose_forcefully(tls)
                except (trio.BrokenResourceError, ssl.SSLError) as exc:
                    seen.append(exc)
                    await stream.aclose()
                finally:
                    served.set()

            listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            got: bytes | BaseException
            tcp = await trio.open_tcp_stream("127.0.0.1", port)
            client = trio.SSLStream(tcp, client_ctx, server_hostname=server_hostname)
            try:
                await client.do_handshake()
                got = bytes(await client.receive_some(100))
            except (trio.BrokenResourceError, ssl.SSLError) as exc:
                got = exc
            finally:
                await trio.aclose_forcefully(client)
            await served.wait()
            nursery.cancel_scope.cancel()
    return seen[0], got


def _cn(peer: dict[str, object]) -> str:
    subject = peer["subject"]
    assert isinstance(subject, tuple)
    return dict(item[0] for item in subject)["commonName"]  # type: ignore[no-any-return]


async def test_a_node_with_an_issued_certificate_completes_a_mutual_handshake(
    tmp_path: Path,
) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    key, csr = make_csr()
    issued = ca.issue(csr, "node-b")
    peer, got = await _handshake(
        ca.server_ssl_context(client_certs=True),
        client_context(tmp_path, ca.ca_pem, issued.pem, key),
    )
    assert isinstance(peer, dict)
    assert _cn(peer) == "node-b"
    assert got == b"hello"


async def test_a_self_made_client_certificate_is_refused(tmp_path: Path) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    key, pem = self_signed("node-b")
    peer, got = await _handshake(
        ca.server_ssl_context(client_certs=True), client_context(tmp_path, ca.ca_pem, pem, key)
    )
    assert isinstance(peer, BaseException)
    assert isinstance(got, BaseException)


async def test_a_certificate_from_another_cluster_is_refused(tmp_path: Path) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    other = ClusterCA.load_or_create(tmp_path / "other", [])
    key, csr = make_csr()
    peer, got = await _handshake(
        ca.server_ssl_context(client_certs=True),
        client_context(tmp_path, ca.ca_pem, other.issue(csr, "node-b").pem, key),
    )
    assert isinstance(peer, BaseException)
    assert isinstance(got, BaseException)


async def test_a_client_without_a_certificate_is_refused_only_where_one_is_required(
    tmp_path: Path,
) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    peer, got = await _handshake(
        ca.server_ssl_context(client_certs=True), client_context(tmp_path, ca.ca_pem, None, None)
    )
    assert isinstance(peer, BaseException)
    assert isinstance(got, BaseException)
    # The join port asks for none.
    peer, got = await _handshake(
        ca.server_ssl_context(client_certs=False), client_context(tmp_path, ca.ca_pem, None, None)
    )
    assert peer == {}
    assert got == b"hello"


async def test_clients_check_the_server_names(tmp_path: Path) -> None:
    ca = ClusterCA.load_or_create(tmp_path / "ca", ["cp.example"])
    ctx = client_context(tmp_path, ca.ca_pem, None, None)
    _, got = await _handshake(ca.server_ssl_context(client_certs=False), ctx, "cp.example")
    assert got == b"hello"
    _, got = await _handshake(ca.server_ssl_context(client_certs=False), ctx, "other.example")
    assert isinstance(got, trio.BrokenResourceError)
    assert isinstance(got.__cause__, ssl.SSLCertVerificationError)


async def test_a_node_certificate_cannot_pose_as_the_control_plane(tmp_path: Path) -> None:
    """A node holds a certificate of the same CA; its clientAuth-only purpose keeps it a client."""
    ca = ClusterCA.load_or_create(tmp_path / "ca", [])
    key, csr = make_csr()
    issued = ca.issue(csr, "127.0.0.1")  # a node id that even matches the address dialled
    (tmp_path / "n.crt").write_bytes(issued.pem)
    (tmp_path / "n.key").write_bytes(key_pem(key))
    posing = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    posing.load_cert_chain(tmp_path / "n.crt", tmp_path / "n.key")
    _, got = await _handshake(posing, client_context(tmp_path, ca.ca_pem, None, None))
    assert isinstance(got, trio.BrokenResourceError)
    assert isinstance(got.__cause__, ssl.SSLCertVerificationError)
    assert "unsuitable certificate purpose" in str(got.__cause__)

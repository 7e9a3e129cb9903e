"""The cluster CA: the control plane's own certificate authority.

Made at a control plane's first start under ``DATA_DIR/ca`` (directory
0700, every file 0600) and loaded afterwards:

- ``ca.crt`` / ``ca.key``: the CA (EC P-256, valid 10 years);
- ``server.crt`` / ``server.key``: the control plane's certificate for the
  agents' port (7443) and the join port (7444), valid 2 years, with the
  ``serverAuth`` purpose and the names and addresses it is reached by as
  subject alternative names (always with ``localhost`` and ``127.0.0.1``).
  It is issued again at start when those names changed, when it was not
  signed by this CA, or when it ends within 30 days.

Nodes get certificates from :meth:`ClusterCA.issue`: 1 year, ``CN`` = the
node id, the ``clientAuth`` purpose only, so a node's certificate cannot
pose as the control plane's. See ``docs/cluster.md``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import logging
import os
import re
import socket
import ssl
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
import psutil
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import errors

__all__ = [
    "CA_VALID_DAYS",
    "NODE_VALID_DAYS",
    "SERVER_VALID_DAYS",
    "BadCertificateRequest",
    "ClusterCA",
    "IssuedCertificate",
    "check_node_id",
    "machine_addresses",
    "server_names",
]

log = logging.getLogger("llmgw.control.ca")

CA_VALID_DAYS = 3650
SERVER_VALID_DAYS = 730
NODE_VALID_DAYS = 365
#: A server certificate that ends within this many days is issued again.
RENEW_BEFORE_DAYS = 30
#: Certificates start this long before "now", so a node whose clock is a
#: little behind still accepts them.
BACKDATE = dt.timedelta(minutes=5)
#: The largest certificate request :meth:`ClusterCA.issue` reads.
MAX_CSR_BYTES = 16 * 1024

_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_DNS_NAME = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)"
    r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)
_LOOPBACK_NAMES = ("localhost", "127.0.0.1")


class BadCertificateRequest(errors.InvalidInput):
    """A certificate request (CSR) that cannot be signed: not PEM, a broken
    signature, a key too weak, or a bad node id."""


@attrs.frozen(kw_only=True)
class IssuedCertificate:
    """A node certificate just signed.

    Attributes:
        serial: the serial number, lower-case hex.
        pem: the certificate, PEM bytes.
        not_after: when it ends, UTC epoch seconds.
    """

    serial: str
    pem: bytes
    not_after: float


def check_node_id(node_id: str) -> str:
    """``node_id`` when it is 1 to 63 letters, digits, ``.``, ``_`` or ``-``
    starting with a letter or digit.

    Raises:
        BadCertificateRequest: it is not.
    """
    if not _NODE_ID.match(node_id):
        raise BadCertificateRequest(
            f"node id {node_id!r} is not valid: use 1 to 63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return node_id


def machine_addresses() -> list[str]:
    """This machine's addresses other than loopback and link-local.

    The addresses of the interfaces that are up, IPv4 first, then IPv6, each
    once, in interface order (``psutil.net_if_addrs``).
    """
    stats = psutil.net_if_stats()
    v4: list[str] = []
    v6: list[str] = []
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            text = addr.address.split("%", 1)[0]
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                continue
            if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast:
                continue
            target = v4 if ip.version == 4 else v6
            if str(ip) not in target:
                target.append(str(ip))
    return v4 + v6


def server_names(advertise: Iterable[str] = ()) -> list[str]:
    """The names for the control plane's certificate, in order.

    ``advertise`` first, then the host name, then :func:`machine_addresses`,
    then ``localhost`` and ``127.0.0.1``; each once.
    """
    names: list[str] = []
    for name in [*advertise, socket.gethostname(), *machine_addresses(), *_LOOPBACK_NAMES]:
        text = _normal_name(name)
        if text and text not in names:
            names.append(text)
    return names


class ClusterCA:
    """The cluster CA kept in one directory; see the module docstring.

    Attributes:
        directory: where its files are.
        ca_path, server_cert_path, server_key_path: the PEM files.
        ca_pem: the CA certificate, PEM bytes.
        fingerprint: ``"sha256:"`` + the hex SHA-256 of the CA certificate's DER.
        names: the server certificate's names, as given to :meth:`load_or_create`.
    """

    def __init__(
        self,
        directory: Path,
        ca_cert: x509.Certificate,
        ca_key: ec.EllipticCurvePrivateKey,
        names: Sequence[str],
    ) -> None:
        self.directory = directory
        self.ca_path = directory / "ca.crt"
        self.ca_key_path = directory / "ca.key"
        self.server_cert_path = directory / "server.crt"
        self.server_key_path = directory / "server.key"
        self._cert = ca_cert
        self._key = ca_key
        self.ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
        self.fingerprint = "sha256:" + ca_cert.fingerprint(hashes.SHA256()).hex()
        self.names = tuple(names)

    @classmethod
    def load_or_create(cls, directory: Path, names: Sequence[str]) -> ClusterCA:
        """The CA in ``directory``, made there when it is missing.

        Args:
            directory: the CA's folder (``DATA_DIR/ca``); made 0700 (an
                existing one is set to 0700).
            names: DNS names and IP addresses the control plane is reached
                by (see :func:`server_names`); ``localhost`` and
                ``127.0.0.1`` are always added. The server certificate is
                issued again when they differ from the ones it has.

        Raises:
            errors.InvalidInput: a name is neither an IP address nor a DNS name.
            errors.StartupError: the folder cannot be made or read, or holds
                only one of ``ca.crt`` and ``ca.key``, or a file that is not
                what it should be.
        """
        wanted: list[str] = []
        for name in [*names, *_LOOPBACK_NAMES]:
            text = _normal_name(name)
            if not text:
                continue
            if _parse_name(text) is None:
                raise errors.InvalidInput(
                    f"{name!r} is neither an IP address nor a DNS name: give the names and "
                    "addresses the control plane is reached by (--advertise)"
                )
            if text not in wanted:
                wanted.append(text)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            if stat.S_IMODE(directory.stat().st_mode) != 0o700:
                directory.chmod(0o700)
        except OSError as exc:
            raise errors.StartupError(f"cannot make the CA folder {directory}: {exc}") from exc
        ca_crt, ca_key = directory / "ca.crt", directory / "ca.key"
        if ca_crt.exists() != ca_key.exists():
            have, missing = (ca_crt, ca_key) if ca_crt.exists() else (ca_key, ca_crt)
            raise errors.StartupError(
                f"the cluster CA in {directory} is broken: {have.name} is there but "
                f"{missing.name} is not; restore it from a backup (making a new CA means "
                "every node must join again)"
            )
        if ca_crt.exists():
            cert, key = _load_pair(ca_crt, ca_key)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise errors.StartupError(f"{ca_key} is not an EC private key")
        else:
            cert, key = _make_ca()
            _write_private(ca_key, _key_pem(key))
            _write_private(ca_crt, cert.public_bytes(serialization.Encoding.PEM))
            log.info("made the cluster CA in %s", directory)
        ca = cls(directory, cert, key, wanted)
        ca._ensure_server_certificate()
        return ca

    # --- server side -----------------------------------------------------------
    def server_ssl_context(self, *, client_certs: bool) -> ssl.SSLContext:
        """A TLS server context with the control plane's certificate.

        Args:
            client_certs: ``True`` for the agents' port: a client must present
                a certificate signed by this CA (``CERT_REQUIRED``); ``False``
                for the join port, where nodes have none yet.
        """
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.server_cert_path, self.server_key_path)
        if client_certs:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cadata=self.ca_pem.decode("ascii"))
        return ctx

    def issue(self, csr_pem: bytes, node_id: str) -> IssuedCertificate:
        """Sign a node's certificate request.

        Args:
            csr_pem: the node's PKCS#10 request, PEM (at most
                :data:`MAX_CSR_BYTES`); its subject is ignored.
            node_id: the node's id, the certificate's ``CN``.

        Returns:
            The certificate: valid :data:`NODE_VALID_DAYS` days, ``clientAuth``
            only, not a CA.

        Raises:
            BadCertificateRequest: the request is not PEM, is too large, its
                signature does not verify, its key is weak (RSA under 2048
                bits, an EC curve under 256 bits), or ``node_id`` is not valid.
        """
        check_node_id(node_id)
        if len(csr_pem) > MAX_CSR_BYTES:
            raise BadCertificateRequest(
                f"the certificate request is {len(csr_pem)} bytes; at most {MAX_CSR_BYTES}"
            )
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise BadCertificateRequest(
                f"the certificate request is not a PEM PKCS#10 request: {exc}"
            ) from exc
        try:
            signed = csr.is_signature_valid
        except (ValueError, InvalidSignature, TypeError):
            signed = False
        if not signed:
            raise BadCertificateRequest(
                "the certificate request's signature does not verify: it was altered or not "
                "signed by its own key; make a new one"
            )
        public = _check_key(csr.public_key())
        now = dt.datetime.now(dt.UTC)
        not_after = now + dt.timedelta(days=NODE_VALID_DAYS)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
            .issuer_name(self._cert.subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_leaf_key_usage(), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return IssuedCertificate(
            serial=format(cert.serial_number, "x"),
            pem=cert.public_bytes(serialization.Encoding.PEM),
            not_after=cert.not_valid_after_utc.timestamp(),
        )

    # --- internals -------------------------------------------------------------
    def _ensure_server_certificate(self) -> None:
        reason = self._server_certificate_stale()
        if reason is None:
            return
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        sans: list[x509.GeneralName] = []
        for name in self.names:
            parsed = _parse_name(name)
            assert parsed is not None  # checked in load_or_create
            sans.append(parsed)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.names[0])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + dt.timedelta(days=SERVER_VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_leaf_key_usage(), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        _write_private(self.server_key_path, _key_pem(key))
        _write_private(self.server_cert_path, cert.public_bytes(serialization.Encoding.PEM))
        log.info(
            "issued the control plane's certificate (%s) for %s", reason, ", ".join(self.names)
        )

    def _server_certificate_stale(self) -> str | None:
        """Why the server certificate must be issued again, or ``None``."""
        if not self.server_cert_path.exists() or not self.server_key_path.exists():
            return "there was none"
        try:
            cert, key = _load_pair(self.server_cert_path, self.server_key_path)
        except errors.StartupError as exc:
            return f"the old one is unreadable: {exc}"
        if cert.issuer != self._cert.subject:
            return "the old one was issued by another CA"
        try:
            cert.verify_directly_issued_by(self._cert)
        except (ValueError, TypeError, InvalidSignature):
            return "the old one was issued by another CA"
        if cert.public_key() != key.public_key():
            return "the old key does not match it"
        soon = dt.datetime.now(dt.UTC) + dt.timedelta(days=RENEW_BEFORE_DAYS)
        if cert.not_valid_after_utc <= soon:
            return "the old one ends soon"
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return "the old one has no names"
        have = {_name_text(n) for n in sans}
        if have != set(self.names):
            return "the names changed"
        return None


def _normal_name(name: str) -> str:
    text = name.strip().lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(text))
    return text


def _parse_name(text: str) -> x509.GeneralName | None:
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    if _DNS_NAME.match(text):
        return x509.DNSName(text.rstrip("."))
    return None


def _name_text(name: x509.GeneralName) -> str:
    if isinstance(name, x509.IPAddress):
        return str(name.value)
    return str(name.value).lower()


def _make_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    # A random suffix so two clusters' CAs never share a subject.
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "llmgw"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"llmgw cluster CA {os.urandom(4).hex()}"),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + dt.timedelta(days=CA_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=True,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _check_key(
    public: object,
) -> ec.EllipticCurvePublicKey | rsa.RSAPublicKey | ed25519.Ed25519PublicKey:
    if isinstance(public, ec.EllipticCurvePublicKey):
        if public.curve.key_size < 256:
            raise BadCertificateRequest(
                f"the request's EC key is on {public.curve.name}; use P-256 or stronger"
            )
        return public
    if isinstance(public, rsa.RSAPublicKey):
        if public.key_size < 2048:
            raise BadCertificateRequest(
                f"the request's RSA key has {public.key_size} bits; use at least 2048"
            )
        return public
    if isinstance(public, ed25519.Ed25519PublicKey):
        return public
    raise BadCertificateRequest(
        f"the request's key type ({type(public).__name__}) is not supported; use EC P-256"
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_pair(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, PrivateKeyTypes]:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise errors.StartupError(f"cannot read {cert_path} / {key_path}: {exc}") from exc
    return cert, key


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as a 0600 file, whole or not at all."""
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as exc:
        raise errors.StartupError(f"cannot write {path}: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)

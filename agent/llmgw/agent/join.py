"""Joining a cluster from a new node (``llmgw join CODE``).

:func:`join_cluster` dials out to the join port of the control plane named
by a join code (each address in turn, :data:`CONNECT_TIMEOUT_S` each),
reads its CA without trusting anything and compares it with the code's
fingerprint, then makes an EC P-256 key and certificate request and sends
them with the code's token over a connection that now verifies the control
plane's certificate against that CA. It writes the node's files::

    DIR/agent.yaml      servers, tls paths, node_id, address, labels
    DIR/tls/ca.crt      the cluster CA
    DIR/tls/node.crt    this node's certificate (CN = node id)
    DIR/tls/node.key    its key (0600)

``agent.yaml`` is written last: it is there only once the node joined.
See ``docs/cluster.md``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw import errors

from .joincode import JoinCode, host_port
from .state import StateDir

__all__ = [
    "AGENT_FILE",
    "CONNECT_TIMEOUT_S",
    "REQUEST_TIMEOUT_S",
    "JoinFailed",
    "Joined",
    "join_cluster",
]

#: Seconds to wait for a TCP and TLS connection to one address of the code.
CONNECT_TIMEOUT_S: Final = 3.0
#: Seconds for one whole request to the join port.
REQUEST_TIMEOUT_S: Final = 20.0
#: The node's configuration file, in its data directory.
AGENT_FILE: Final = "agent.yaml"
#: Its certificate files, relative to the data directory.
TLS_CA: Final = "tls/ca.crt"
TLS_CERT: Final = "tls/node.crt"
TLS_KEY: Final = "tls/node.key"


class JoinFailed(errors.AgentError):
    """Joining failed; the message is one line naming the reason."""


@attrs.frozen(kw_only=True)
class Joined:
    """A node that joined.

    Attributes:
        node_id: its id (its certificate's CN), as the control plane set it.
        config_path: its ``agent.yaml``.
        control_plane: the join address that answered (``host:port``).
        servers: the agents' hub URLs written to ``agent.yaml``.
        labels: the labels written to ``agent.yaml``.
        serial: the certificate's serial number (hex).
    """

    node_id: str
    config_path: Path
    control_plane: str
    servers: tuple[str, ...]
    labels: dict[str, str]
    serial: str


def join_cluster(
    code: JoinCode,
    data_dir: Path,
    *,
    node_id: str,
    address: str = "",
    force: bool = False,
    say: Callable[[str], None] = lambda _: None,
) -> Joined:
    """Join the cluster of ``code`` and write the node's files in ``data_dir``.

    Args:
        code: the join code.
        data_dir: the node's data directory (made 0700 when missing).
        node_id: the node id to ask for (the code's own, when it names one, wins).
        address: the address the control plane reaches this node by, written
            to ``agent.yaml`` (``""``: the agent finds it).
        force: join again although ``data_dir`` already holds a joined node.
        say: where progress lines go.

    Raises:
        JoinFailed: ``data_dir`` holds a joined node (without ``force``), no
            address of the code answered, the control plane's CA is not the
            code's, the control plane refused (a code used, expired or
            unknown; a node id taken), or the files cannot be written.
    """
    config_path = data_dir / AGENT_FILE
    if not force and (config_path.exists() or (data_dir / TLS_KEY).exists()):
        raise JoinFailed(
            f"{data_dir} already holds a node that joined ({config_path}): start it with "
            f"`llmgw agent --config {config_path}`, or join again with --force"
        )
    state_dir = _state_dir(config_path)
    try:
        busy = StateDir(state_dir).busy()
    except OSError as exc:
        raise JoinFailed(f"cannot check the agent's lock in {state_dir}: {exc}") from exc
    if busy:
        # Checked before the code is sent: a code used while the old agent
        # holds the node's state would be spent for nothing.
        raise JoinFailed(
            f"an llmgw agent is running on {data_dir} (it holds the lock in {state_dir}): "
            "stop it first (`systemctl stop llmgw-agent`, or Ctrl-C where it runs), then "
            "join again; the join code was not used"
        )
    target, ca_pem = _find_control_plane(code, say)
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .sign(key, hashes.SHA256())
    )
    answer = _post_join(
        target,
        ca_pem,
        {
            "token": code.token,
            "csr_pem": csr.public_bytes(serialization.Encoding.PEM).decode("ascii"),
            "node_id": node_id,
        },
    )
    joined_id, cert_pem, servers, labels = _answer_fields(target, answer)
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    if cert.public_key() != key.public_key():
        raise JoinFailed(f"the control plane at {target} answered a certificate for another key")
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    doc: dict[str, Any] = {
        "servers": list(servers),
        "tls": {"ca": TLS_CA, "cert": TLS_CERT, "key": TLS_KEY},
        "node_id": joined_id,
        "address": address,
        "labels": dict(labels),
    }
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    text = (
        f"# Written by `llmgw join` on {stamp} (control plane {target}).\n"
        "# Run the agent with: llmgw agent --config <this file>. See docs/cluster.md.\n"
        + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
    )
    try:
        _make_private_dir(data_dir)
        _make_private_dir(data_dir / "tls")
        _write(data_dir / TLS_CA, ca_pem, 0o644)
        _write(data_dir / TLS_KEY, key_pem, 0o600)
        _write(data_dir / TLS_CERT, cert_pem.encode(), 0o644)
        _write(config_path, text.encode(), 0o644)
    except OSError as exc:
        raise JoinFailed(f"cannot write the node's files in {data_dir}: {exc}") from exc
    return Joined(
        node_id=joined_id,
        config_path=config_path,
        control_plane=target,
        servers=tuple(servers),
        labels=dict(labels),
        serial=format(cert.serial_number, "x"),
    )


def _state_dir(config_path: Path) -> Path:
    """The agent's state directory for ``config_path``: its ``state_dir``
    when the file is there and names one, else ``agent/`` beside it."""
    folder = config_path.parent
    try:
        doc = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        doc = None
    named = doc.get("state_dir") if isinstance(doc, dict) else None
    if isinstance(named, str) and named:
        path = Path(named)
        return path if path.is_absolute() else folder / path
    return folder / "agent"


def ca_fingerprint(ca_pem: bytes) -> str:
    """``"sha256:"`` + the hex SHA-256 of the DER of the certificate in ``ca_pem``.

    Raises:
        ValueError: ``ca_pem`` is not a PEM certificate.
    """
    cert = x509.load_pem_x509_certificate(ca_pem)
    return "sha256:" + hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _timeout() -> httpx.Timeout:
    return httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)


def _find_control_plane(code: JoinCode, say: Callable[[str], None]) -> tuple[str, bytes]:
    """The first address of ``code`` whose join port has the code's CA, and that CA."""
    # Nothing is trusted yet: the CA read here is checked against the code's
    # fingerprint before anything is sent.
    blind = ssl.create_default_context()
    blind.check_hostname = False
    blind.verify_mode = ssl.CERT_NONE
    tried: list[str] = []
    mismatch = ""
    for target in code.addresses:
        say(f"trying the control plane at {target}")
        try:
            with httpx.Client(verify=blind, timeout=_timeout()) as client:
                response = client.get(f"https://{target}/v1/join/ca")
        except httpx.TimeoutException:
            tried.append(f"{target} (no answer within {CONNECT_TIMEOUT_S:.0f} s)")
            continue
        except httpx.HTTPError as exc:
            tried.append(f"{target} ({_reason(exc)})")
            continue
        try:
            ca_pem = str(response.json()["ca_pem"]).encode("ascii")
            found = ca_fingerprint(ca_pem)
        except (ValueError, KeyError, TypeError):
            tried.append(f"{target} (HTTP {response.status_code}, not an llmgw join port)")
            continue
        if found != code.fingerprint:
            mismatch = (
                f"the control plane at {target} has CA {found} but this code was made for "
                f"{code.fingerprint}: it is not the control plane that made the code "
                "(another cluster's, or another machine answers at that address); run "
                "`llmgw node add` on the control plane this node should join and use the "
                "line it prints"
            )
            tried.append(f"{target} (another CA)")
            continue
        return target, ca_pem
    if mismatch:
        tried_all = f" (tried {', '.join(tried)})" if len(tried) > 1 else ""
        head, _, advice = mismatch.partition("; run ")
        raise JoinFailed(f"{head}{tried_all}; run {advice}")
    raise JoinFailed(
        "cannot reach the control plane at any address of the code: "
        + ", ".join(tried)
        + "; check that `llmgw server` runs there and this machine can reach its join port"
    )


def _post_join(target: str, ca_pem: bytes, body: Mapping[str, str]) -> Any:
    trusted = ssl.create_default_context(cadata=ca_pem.decode("ascii"))
    try:
        with httpx.Client(verify=trusted, timeout=_timeout()) as client:
            response = client.post(f"https://{target}/v1/join", json=dict(body))
    except httpx.ConnectError as exc:
        cause = exc.__cause__ or exc.__context__
        while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            host = host_port(target)[0]
            raise JoinFailed(
                f"the control plane at {target} presents a certificate that does not verify "
                f"for {host} ({cause.verify_message}): start it with --advertise {host}"
            ) from None
        raise JoinFailed(f"the control plane at {target} went away: {_reason(exc)}") from None
    except httpx.HTTPError as exc:
        raise JoinFailed(f"the control plane at {target} did not answer: {_reason(exc)}") from None
    try:
        doc = response.json()
    except ValueError:
        doc = None
    if response.status_code != 200:
        message = ""
        with contextlib.suppress(KeyError, TypeError):
            message = str(doc["error"]["message"])
        raise JoinFailed(
            f"the control plane at {target} refused to join this node "
            f"(HTTP {response.status_code}): {message or response.text[:200]}"
        )
    return doc


def _answer_fields(target: str, doc: Any) -> tuple[str, str, list[str], dict[str, str]]:
    try:
        node_id = doc["node_id"]
        cert_pem = doc["cert_pem"]
        servers = doc["servers"]
        labels = doc.get("labels") or {}
        if not (
            isinstance(node_id, str)
            and isinstance(cert_pem, str)
            and isinstance(servers, list)
            and all(isinstance(s, str) for s in servers)
            and isinstance(labels, dict)
        ):
            raise TypeError
    except (KeyError, TypeError, AttributeError):
        raise JoinFailed(
            f"the control plane at {target} answered something that is not a join answer"
        ) from None
    return node_id, cert_pem, servers, {str(k): str(v) for k, v in labels.items()}


def _reason(exc: BaseException) -> str:
    # httpx wraps the OS error; its innermost cause says it best
    # ("[Errno 111] Connection refused").
    inner: BaseException = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    return errors.describe(inner)


def _make_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode``, whole or not at all."""
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(partial, mode)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)

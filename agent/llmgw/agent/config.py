"""A node's ``agent.yaml``: the control planes it links to and its TLS files
(``docs/cluster.md``, "The agent's file")::

    servers: [wss://10.0.0.1:7443/agent]
    tls: {ca: tls/ca.crt, cert: tls/node.crt, key: tls/node.key}
    node_id: node-b          # optional; default = the certificate's CN
    address: ""              # optional; default = the route's source address
    labels: {}               # optional
    state_dir: ""            # optional; default = agent/ beside the file
    engines: {llamacpp: {bin: ""}, install: [vllm], uv: ""}   # optional

``llmgw join`` writes it; ``llmgw agent --config FILE`` reads it
(:func:`load_agent_yaml`). Unknown keys are refused with their path
(``tls.certfile``); relative paths are relative to the file's folder.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw import errors

from .main import AgentConfig

__all__ = [
    "AgentFile",
    "AgentFileError",
    "EngineFiles",
    "LlamacppFiles",
    "TlsFiles",
    "agent_config",
    "agent_ssl_context",
    "certificate_node_id",
    "load_agent_yaml",
]


class AgentFileError(errors.InvalidInput):
    """An ``agent.yaml`` that cannot be used; the message names the file,
    the key and what to do."""


@attrs.frozen(kw_only=True)
class TlsFiles:
    """The node's TLS files (absolute once loaded).

    Attributes:
        ca: the cluster CA's certificate (PEM): the control plane's
            certificate must be signed by it.
        cert, key: this node's certificate and key (PEM; the key 0600).
    """

    ca: Path
    cert: Path
    key: Path


@attrs.frozen(kw_only=True)
class LlamacppFiles:
    #: A ``llama-server`` binary; "" = the bundled launcher.
    bin: str = ""


@attrs.frozen(kw_only=True)
class EngineFiles:
    llamacpp: LlamacppFiles = attrs.field(factory=LlamacppFiles)
    #: Engine install recipes to install before registering
    #: (:data:`~llmgw.agent.installs.RECIPES`: ``vllm``, ``llamacpp-cu128``).
    install: tuple[str, ...] = ()
    #: The ``uv`` executable installs run; "" = ``uv`` from ``PATH``.
    uv: str = ""


@attrs.frozen(kw_only=True)
class AgentFile:
    """A loaded ``agent.yaml`` (see the module docstring).

    Attributes:
        path: the file read (absolute).
        servers: the control planes' agent hubs, ``wss://host:port/agent``.
        tls: the TLS files, absolute.
        node_id: "" = the certificate's CN.
        address: "" = the source address of the route to the control plane.
        labels: the node's labels, matched by profile selectors.
        state_dir: shard files and engine logs (absolute); ``agent/``
            beside the file when the file leaves it out.
        engines: engine binaries.
    """

    path: Path
    servers: tuple[str, ...]
    tls: TlsFiles
    node_id: str = ""
    address: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    state_dir: Path
    engines: EngineFiles = attrs.field(factory=EngineFiles)


@attrs.frozen(kw_only=True)
class _Doc:
    """The file's shape, before paths are resolved."""

    servers: tuple[str, ...]
    tls: TlsFiles
    node_id: str = ""
    address: str = ""
    labels: dict[str, str] = attrs.field(factory=dict)
    state_dir: str = ""
    engines: EngineFiles = attrs.field(factory=EngineFiles)


_converter = cattrs.Converter(forbid_extra_keys=True)


def _strict_str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


_converter.register_structure_hook(str, _strict_str)
_converter.register_structure_hook(Path, lambda value, _: Path(_strict_str(value, None)))


def load_agent_yaml(path: Path) -> AgentFile:
    """Read ``path`` (see the module docstring).

    Raises:
        AgentFileError: the file cannot be read, is not YAML, has an unknown
            key (named with its path, e.g. ``tls.certfile``), a value of the
            wrong type, no ``servers``, a server that is not
            ``wss://HOST:PORT/PATH``, or a TLS file that is not there.
    """
    path = path.absolute()
    try:
        text = path.read_text()
    except OSError as exc:
        raise AgentFileError(f"cannot read {path}: {errors.describe(exc)}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AgentFileError(f"{path} is not YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise AgentFileError(f"{path} must hold a mapping with 'servers' and 'tls'")
    try:
        doc = _converter.structure(raw, _Doc)
    except cattrs.BaseValidationError as exc:
        problems = "; ".join(_problem(line) for line in cattrs.transform_error(exc, path=""))
        raise AgentFileError(f"{path}: {problems}") from None
    if not doc.servers:
        raise AgentFileError(
            f"{path}: 'servers' is empty; list the control plane's agent hub, "
            "e.g. wss://10.0.0.1:7443/agent ('llmgw join CODE' writes it)"
        )
    for index, url in enumerate(doc.servers):
        if not url.startswith("wss://") or len(url) <= len("wss://"):
            raise AgentFileError(
                f"{path}: servers[{index}] {url!r} is not wss://HOST:PORT/agent "
                "(the agent link is mutual TLS)"
            )
    folder = path.parent

    def resolve(value: Path) -> Path:
        return value if value.is_absolute() else folder / value

    tls = TlsFiles(ca=resolve(doc.tls.ca), cert=resolve(doc.tls.cert), key=resolve(doc.tls.key))
    for name, file in (("tls.ca", tls.ca), ("tls.cert", tls.cert), ("tls.key", tls.key)):
        if not file.is_file():
            raise AgentFileError(
                f"{path}: {name} {file} is not there; 'llmgw join CODE' writes the TLS files"
            )
    return AgentFile(
        path=path,
        servers=doc.servers,
        tls=tls,
        node_id=doc.node_id,
        address=doc.address,
        labels=doc.labels,
        state_dir=resolve(Path(doc.state_dir)) if doc.state_dir else folder / "agent",
        engines=doc.engines,
    )


def _problem(line: str) -> str:
    """cattrs' ``extra fields found (certfile) @ $.tls`` as ``unknown key
    tls.certfile``; other lines with their path without the ``$.``."""
    text, _, where = line.partition(" @ ")
    where = where.removeprefix("$").lstrip(".")
    if text.startswith("extra fields found (") and text.endswith(")"):
        keys = text[len("extra fields found (") : -1].split(", ")
        names = ", ".join(f"{where}.{k}" if where else k for k in keys)
        return f"unknown key {names} (the keys are servers, tls, node_id, address, labels, state_dir, engines)"
    if text == "required field missing":
        return f"{where} is required"
    return f"{where}: {text}" if where else text


def certificate_node_id(cert_path: Path) -> str:
    """The node id a node certificate names (its subject's CN).

    Raises:
        AgentFileError: the file cannot be read or is not a PEM certificate
            with a CN.
    """
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise AgentFileError(
            f"{cert_path} is not a PEM certificate: {errors.describe(exc)}"
        ) from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise AgentFileError(f"{cert_path} names no node (no CN)")
    value = names[0].value
    return value if isinstance(value, str) else value.decode()


def agent_ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """The agent's TLS context: its certificate and key, and the control
    plane's certificate checked against the cluster CA (host name included).

    Raises:
        AgentFileError: a file cannot be read or the key does not match the
            certificate.
    """
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
    except (OSError, ssl.SSLError) as exc:
        raise AgentFileError(
            f"cannot load the TLS files ({tls.ca}, {tls.cert}, {tls.key}): {errors.describe(exc)}"
        ) from None
    return ctx


def agent_config(file: AgentFile) -> AgentConfig:
    """The agent's settings from a loaded ``agent.yaml``: the first server,
    then the others; mutual TLS with its files; no token; the node id from
    the file, else the certificate's CN.

    Raises:
        AgentFileError: the TLS files cannot be loaded, or ``node_id`` is not
            the node the certificate names.
    """
    context = agent_ssl_context(file.tls)
    named = certificate_node_id(file.tls.cert)
    if file.node_id and file.node_id != named:
        raise AgentFileError(
            f"{file.path}: node_id {file.node_id!r} but the certificate {file.tls.cert} is for "
            f"{named!r}; the control plane takes the node id from the certificate: leave "
            "node_id out, or join again with --node-id"
        )
    return AgentConfig(
        server_url=file.servers[0],
        servers=file.servers[1:],
        token="",
        ssl_context=context,
        address=file.address,
        labels=dict(file.labels),
        node_id=file.node_id or named,
        state_dir=file.state_dir,
        llamacpp_bin=file.engines.llamacpp.bin or None,
        engine_installs=file.engines.install,
        uv=file.engines.uv or "uv",
    )

"""The cluster CA shared through the store, so that every control plane of
one store serves the same CA (``docs/ha.md``).

The CA's certificate and private key are kept in the store as the secret
:data:`CA_SECRET` (a JSON document of the two PEMs), beside the cluster
secret for engine keys; they are not sealed: whoever can read the store can
read the CA key, so protect the database as you protect ``DATA_DIR/ca``.
Each control plane keeps a copy in ``DATA_DIR/ca`` (``ca.crt``, ``ca.key``,
0600) and its own server certificate there, issued by that CA for its own
names.

At start (:func:`sync_cluster_ca`):

- the store has a CA: it is written to ``DATA_DIR/ca`` when the copy there
  differs (a second control plane joining the store; a folder whose CA
  differs is replaced, and said so: nodes that joined with that CA join
  again);
- the store has none: the CA in ``DATA_DIR/ca`` (an older control plane's,
  made before the CA was kept in the store) is put there, or a new one when
  the folder has none. Two control planes starting at once agree: the
  first write wins.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives import serialization

from llmgw import errors
from llmgw.store import Store

from .ca import _key_pem, _make_ca, _write_private

__all__ = ["CA_SECRET", "sync_cluster_ca"]

log = logging.getLogger("llmgw.control.ca")

#: The store secret holding the CA: ``{"cert": PEM, "key": PEM}``.
CA_SECRET: Final = "cluster-ca"


def _local(directory: Path) -> bytes | None:
    """The CA in ``directory`` as the secret's bytes, or ``None`` when it
    has not both files."""
    cert, key = directory / "ca.crt", directory / "ca.key"
    if not (cert.exists() and key.exists()):
        return None
    try:
        return _encode(cert.read_bytes(), key.read_bytes())
    except OSError as exc:
        raise errors.StartupError(f"cannot read the cluster CA in {directory}: {exc}") from exc


def _encode(cert_pem: bytes, key_pem: bytes) -> bytes:
    return json.dumps(
        {"cert": cert_pem.decode("ascii"), "key": key_pem.decode("ascii")}, sort_keys=True
    ).encode()


def _new() -> bytes:
    cert, key = _make_ca()
    log.info("made the cluster CA (kept in the store)")
    return _encode(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


async def sync_cluster_ca(store: Store, directory: Path) -> None:
    """Make ``directory``'s ``ca.crt``/``ca.key`` the store's CA; see the
    module docstring.

    Raises:
        StartupError: the store's CA is not readable, or the folder cannot
            be written or read.
        StoreError: the store cannot be reached.
    """
    local = _local(directory)
    shared = await store.get_or_create_secret(CA_SECRET, lambda: local or _new())
    if shared == local:
        return
    try:
        doc = json.loads(shared)
        cert_pem, key_pem = doc["cert"].encode("ascii"), doc["key"].encode("ascii")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise errors.StartupError(
            f"the cluster CA kept in the store (secret {CA_SECRET!r}) cannot be read: {exc}"
        ) from exc
    if local is not None:
        log.warning(
            "the cluster CA in %s differs from the one in the store; using the store's "
            "(nodes that joined with the old one join again)",
            directory,
        )
    _write_local(directory, cert_pem, key_pem)


def _write_local(directory: Path, cert_pem: bytes, key_pem: bytes) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        directory.chmod(0o700)
    except OSError as exc:
        raise errors.StartupError(f"cannot make the CA folder {directory}: {exc}") from exc
    _write_private(directory / "ca.key", key_pem)
    _write_private(directory / "ca.crt", cert_pem)

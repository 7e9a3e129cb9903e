"""The admin token: the one secret that opens the admin API, and nothing else.

It is not a client key: it reads ``llmgw-admin-…`` (a client key reads
``sk-llmgw-…``), it is never in the store, and ``/v1`` refuses it
(:class:`~llmgw.auth.keys.KeyAuthenticator` says it is the admin token). It
lives in a file, ``DATA_DIR/admin-token`` (mode 0600), which ``llmgw up``
writes on its first start, ``llmgw keys rotate-admin`` replaces, and
``llmgw keys`` / ``llmgw ctl`` read (see ``docs/up.md``).

:class:`AdminTokenFile` checks a presented token against the file in
constant time (SHA-256 of each side, then :func:`hmac.compare_digest`). It
looks at the file's identity (inode, size, mtime) on every check and reads it
again when it changed, so a rotation (an atomic rename) refuses the old token
from the very next call.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Final

import attrs

from llmgw import errors

__all__ = [
    "ADMIN_TOKEN_FILE",
    "ADMIN_TOKEN_PREFIX",
    "AdminTokenFile",
    "AdminTokenMissing",
    "fingerprint",
    "is_admin_token",
    "new_admin_token",
    "read_admin_token",
    "rotate_admin_token",
    "write_admin_token",
    "write_secret_file",
]

#: What every admin token begins with; a client key begins with ``sk-llmgw-``.
ADMIN_TOKEN_PREFIX: Final = "llmgw-admin-"
#: The admin token's file, in the data directory.
ADMIN_TOKEN_FILE: Final = "admin-token"
#: Random bytes in a token (43 characters once encoded).
_TOKEN_BYTES: Final = 32
#: The shortest token accepted from a file (the prefix and 16 more characters).
_MIN_LENGTH: Final = len(ADMIN_TOKEN_PREFIX) + 16


class AdminTokenMissing(errors.NotFound):
    """The admin token's file is missing, unreadable, or holds no admin token."""


def new_admin_token() -> str:
    """A fresh ``llmgw-admin-…`` token (43 random URL-safe characters after the prefix)."""
    return ADMIN_TOKEN_PREFIX + secrets.token_urlsafe(_TOKEN_BYTES)


def is_admin_token(secret: str) -> bool:
    """Whether ``secret`` has the admin token's form (``llmgw-admin-`` and 16+ more
    characters, no whitespace); says nothing about whether it is the live one."""
    return (
        secret.startswith(ADMIN_TOKEN_PREFIX)
        and len(secret) >= _MIN_LENGTH
        and not any(c.isspace() for c in secret)
    )


def fingerprint(token: str) -> str:
    """The first 8 hex digits of the token's SHA-256: tells tokens apart in the
    audit trail without showing them."""
    return hashlib.sha256(token.encode()).hexdigest()[:8]


def read_admin_token(path: Path) -> str:
    """The admin token in ``path``.

    Raises:
        AdminTokenMissing: no such file, it cannot be read, or it holds no
            admin token (the message says which, and what to run).
    """
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise AdminTokenMissing(
            f"no admin token at {path}: run 'llmgw up' or 'llmgw server' first, or pass --data-dir"
        ) from None
    except OSError as exc:
        raise AdminTokenMissing(f"cannot read the admin token at {path}: {exc}") from None
    if not is_admin_token(token):
        raise AdminTokenMissing(
            f"{path} holds no admin token (one reads {ADMIN_TOKEN_PREFIX}…); "
            "'llmgw keys rotate-admin' writes a new one"
        )
    return token


def write_admin_token(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` as :func:`write_secret_file` does.

    Raises:
        OSError: the folder cannot be written.
    """
    write_secret_file(path, token)


def write_secret_file(path: Path, secret: str) -> None:
    """Write ``secret`` and a newline to ``path``, mode 0600, atomically: a
    temporary file in the same folder (made 0600), flushed, then renamed over
    ``path``. A reader sees the old secret or the new one, never a part.

    Raises:
        OSError: the folder cannot be written.
    """
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secret + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def rotate_admin_token(path: Path) -> str:
    """Replace the admin token in ``path`` (which must exist: a wrong
    ``--data-dir`` makes nothing) with a new one; the new token.

    A control plane using ``path`` refuses the old token from its next call.

    Raises:
        AdminTokenMissing: there is no ``path`` (``llmgw up`` makes it).
        OSError: it cannot be written.
    """
    if not path.exists():
        raise AdminTokenMissing(
            f"no admin token at {path} to rotate: 'llmgw up' makes one on its first "
            "start; or pass --data-dir"
        )
    token = new_admin_token()
    write_admin_token(path, token)
    return token


@attrs.define
class _Loaded:
    identity: tuple[int, int, int, int]
    digest: bytes | None


class AdminTokenFile:
    """The admin token kept in ``path``, checked on each admin API call.

    ``path`` ``None`` (a control plane with no data directory) refuses every
    token.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._loaded: _Loaded | None = None

    def _digest(self) -> bytes | None:
        """SHA-256 of the token in the file now; ``None`` when there is none."""
        if self.path is None:
            return None
        try:
            status = self.path.stat()
        except OSError:
            self._loaded = None
            return None
        identity = (status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
        if self._loaded is None or self._loaded.identity != identity:
            try:
                token: str | None = read_admin_token(self.path)
            except AdminTokenMissing:
                token = None
            digest = None if token is None else hashlib.sha256(token.encode()).digest()
            self._loaded = _Loaded(identity, digest)
        return self._loaded.digest

    def check(self, presented: str) -> bool:
        """Whether ``presented`` is the token in the file now, compared in
        constant time (of the token's length: both sides are hashed first)."""
        expected = self._digest()
        offered = hashlib.sha256(presented.encode()).digest()
        if expected is None:
            return False
        return hmac.compare_digest(offered, expected)

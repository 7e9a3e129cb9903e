"""The files ``llmgw up`` keeps in its data directory besides the store: the
admin token, the client key, the agent token and ``run.json`` (where it
listens); and the move of an older llmgw's ``admin-key`` (see
``docs/up.md``, Data directory)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs

from llmgw.admin.keys import DEFAULT_PROJECT
from llmgw.auth.admin_token import (
    ADMIN_TOKEN_FILE,
    is_admin_token,
    new_admin_token,
    write_secret_file,
)
from llmgw.auth.keys import KEY_PREFIX, hash_key, new_key
from llmgw.auth.tree import parse_project_path
from llmgw.store import Store

from .control_plane import Addresses

__all__ = [
    "ADMIN_TOKEN_FILE",
    "AGENT_TOKEN_FILE",
    "CLIENT_KEY_FILE",
    "LEGACY_ADMIN_KEY_FILE",
    "RUN_FILE",
    "ensure_admin_token",
    "ensure_client_key",
    "migrate_admin_key",
    "remove_run_file",
    "write_agent_token",
    "write_run_file",
]

#: The client key ``llmgw up`` makes on its first start, for ``/v1``.
CLIENT_KEY_FILE: Final = "client-key"
#: Where an older llmgw kept its admin key (an ``sk-llmgw-…`` key that also
#: opened the admin API); :func:`migrate_admin_key` turns it into the client key.
LEGACY_ADMIN_KEY_FILE: Final = "admin-key"
#: The name of the client key ``llmgw up`` makes (``llmgw keys list``).
CLIENT_KEY_NAME: Final = "client"
#: Where an agent token is kept for agents run apart (``llmgw agent --token-file``).
AGENT_TOKEN_FILE: Final = "agent-token"
#: Where a running ``llmgw up`` listens, and its pid (read by ``llmgw keys`` and ``llmgw ctl``).
RUN_FILE: Final = "run.json"


def _narrow(path: Path, say: Callable[[str], None]) -> None:
    """Make ``path`` mode 0600 if it is wider, saying so."""
    mode = path.stat().st_mode & 0o777
    if mode != 0o600:
        os.chmod(path, 0o600)
        say(f"{path} was mode {mode:04o}; now 0600")


def ensure_admin_token(data_dir: Path, say: Callable[[str], None]) -> Path:
    """The admin token in ``DATA_DIR/admin-token`` (mode 0600): kept when the
    file holds one, else a new one written there. The token itself is never
    printed; ``llmgw keys`` and ``llmgw ctl`` read the file. The path.

    Raises:
        OSError: the data directory cannot be written.
    """
    path = data_dir / ADMIN_TOKEN_FILE
    if path.exists():
        if is_admin_token(path.read_text().strip()):
            _narrow(path, say)
            say(f"admin token: in {path}")
            return path
        say(f"{path} holds no admin token; writing a new one")
    write_secret_file(path, new_admin_token())
    say(
        f"admin token: made, kept in {path} (mode 0600). It opens the admin API only "
        "('llmgw keys' and 'llmgw ctl' read it); 'llmgw keys rotate-admin' replaces it"
    )
    return path


async def migrate_admin_key(store: Store, data_dir: Path, say: Callable[[str], None]) -> None:
    """Turn an older llmgw's ``DATA_DIR/admin-key`` into a client key: its key
    stops being an admin key (it keeps calling ``/v1``; only the admin token
    opens the admin API now) and the file becomes ``client-key`` (or
    ``admin-key.old`` when there is a ``client-key`` already). Nothing when
    there is no ``admin-key``.

    Raises:
        StoreError: the store cannot be reached.
        OSError: the files cannot be moved.
    """
    old = data_dir / LEGACY_ADMIN_KEY_FILE
    if not old.exists():
        return
    secret = old.read_text().strip()
    record = None
    if secret.startswith(KEY_PREFIX):
        record = await store.find_key_by_hash(hash_key(secret))
    if record is not None and record.is_admin:
        await store.update_key(attrs.evolve(record, is_admin=False))
    client = data_dir / CLIENT_KEY_FILE
    target = client if not client.exists() else data_dir / f"{LEGACY_ADMIN_KEY_FILE}.old"
    os.replace(old, target)
    os.chmod(target, 0o600)
    say(
        f"{old} held the admin key of an older llmgw: it is a client key now, moved to "
        f"{target} (it still calls /v1; the admin API takes only the admin token)"
    )


async def ensure_client_key(
    store: Store, data_dir: Path, max_key_ttl_s: float | None, say: Callable[[str], None]
) -> Path:
    """The client key for ``/v1`` in ``DATA_DIR/client-key`` (mode 0600).

    On a first start (no file) a key named ``client`` is made in the project
    ``default/default/default`` (expiring after ``max_key_ttl_s`` when set),
    printed once and written there. A file whose key this store does not know
    (another store's) is replaced the same way. A key revoked or expired is
    left as it is, and said: a key its owner revoked does not come back.
    Returns the path.

    Raises:
        StoreError: the store cannot be reached.
        OSError: the data directory cannot be written.
    """
    path = data_dir / CLIENT_KEY_FILE
    now = time.time()
    if path.exists():
        secret = path.read_text().strip()
        found = await store.find_key_by_hash(hash_key(secret)) if secret else None
        if found is not None:
            _narrow(path, say)
            if found.revoked_at is not None or (
                found.expires_at is not None and found.expires_at <= now
            ):
                say(
                    f"the client key in {path} is revoked or expired; make another with "
                    "'llmgw keys create NAME' and write it there"
                )
            else:
                say(f"client key: in {path}")
            return path
        say(f"{path} holds no key of this store; making a new client key")
    org, team, project = parse_project_path(DEFAULT_PROJECT)
    tree_path, _ = await store.ensure_project(org, team, project, now)
    secret, record = new_key(CLIENT_KEY_NAME, now=now)
    record = attrs.evolve(
        record,
        project_id=tree_path.project.id,
        expires_at=None if max_key_ttl_s is None else now + max_key_ttl_s,
    )
    await store.insert_key(record)
    write_secret_file(path, secret)
    say(f"client key for /v1 (shown once, kept in {path}, mode 0600): {secret}")
    return path


def write_agent_token(data_dir: Path, token: str) -> Path:
    """Write the agent token to ``DATA_DIR/agent-token``, mode 0600, for
    agents run apart (``llmgw agent --token-file``); the path written."""
    path = data_dir / AGENT_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left with a wider mode is narrowed before the write
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return path


def write_run_file(data_dir: Path, addresses: Addresses) -> None:
    """Write ``DATA_DIR/run.json``: ``{"pid", "api", "admin", "metrics",
    "agent_hub"}`` and ``"join"`` when there is a join port (``llmgw
    server``), the addresses as ``host:port``."""
    doc = {
        "pid": os.getpid(),
        "api": addresses.api,
        "admin": addresses.admin,
        "metrics": addresses.metrics,
        "agent_hub": addresses.agent_hub,
    }
    if addresses.join:
        doc["join"] = addresses.join
    (data_dir / RUN_FILE).write_text(json.dumps(doc, indent=2) + "\n")


def remove_run_file(data_dir: Path) -> None:
    (data_dir / RUN_FILE).unlink(missing_ok=True)

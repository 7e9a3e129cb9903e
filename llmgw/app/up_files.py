"""The files ``llmgw up`` keeps in its data directory besides the store: the
admin key, the agent token and ``run.json`` (where it listens)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.store import Store

from .control_plane import Addresses

__all__ = [
    "ADMIN_KEY_FILE",
    "AGENT_TOKEN_FILE",
    "RUN_FILE",
    "ensure_admin_key",
    "remove_run_file",
    "write_agent_token",
    "write_run_file",
]

ADMIN_KEY_FILE: Final = "admin-key"
#: Where the agent token is kept for agents run apart (``llmgw agent --token-file``).
AGENT_TOKEN_FILE: Final = "agent-token"
#: Where a running ``llmgw up`` listens, and its pid (read by ``llmgw keys`` and ``llmgw ctl``).
RUN_FILE: Final = "run.json"


async def ensure_admin_key(store: Store, data_dir: Path, say: Callable[[str], None]) -> str:
    """The admin key in ``DATA_DIR/admin-key`` when it is a live admin key of
    ``store``; otherwise a new one, made, printed once and written there
    (mode 0600). Returns the key's secret."""
    path = data_dir / ADMIN_KEY_FILE
    if path.exists():
        secret = path.read_text().strip()
        key = await KeyAuthenticator(store).authenticate(secret)
        if key is not None and key.is_admin:
            say(f"admin key: in {path}")
            return secret
        say(f"{path} holds no live admin key of this store; making a new one")
    secret, record = new_key("admin", is_admin=True)
    await store.insert_key(record)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    os.chmod(path, 0o600)
    say(f"admin key (shown once, kept in {path}): {secret}")
    return secret


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
    "agent_hub"}``, the addresses as ``host:port``."""
    doc = {
        "pid": os.getpid(),
        "api": addresses.api,
        "admin": addresses.admin,
        "metrics": addresses.metrics,
        "agent_hub": addresses.agent_hub,
    }
    (data_dir / RUN_FILE).write_text(json.dumps(doc, indent=2) + "\n")


def remove_run_file(data_dir: Path) -> None:
    (data_dir / RUN_FILE).unlink(missing_ok=True)

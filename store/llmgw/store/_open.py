"""``open_store``: open the store named by an address."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

from .interface import Store
from .sqlite import open_sqlite_store

__all__ = ["open_store"]

_SQLITE_PREFIX = "sqlite:///"
_POSTGRES_PREFIXES = ("postgresql://", "postgres://", "postgresql+psycopg://")


def open_store(address: str) -> AbstractAsyncContextManager[Store]:
    """Open the store at ``address``; use as ``async with open_store(a) as store:``.

    Accepted addresses:

    - a file path (``/var/lib/llmgw/store.db``, ``~`` expanded): SQLite;
    - ``sqlite:///<path>``: the same, SQLAlchemy style, so
      ``sqlite:///store.db`` is relative and ``sqlite:////var/lib/x.db``
      absolute.

    Args:
        address: the store address.

    Returns:
        An async context manager that opens the store (creating and
        migrating it as needed) and closes it at exit; see
        :func:`llmgw.store.sqlite.open_sqlite_store`.

    Raises:
        ValueError: ``address`` is empty, is a PostgreSQL DSN (not supported
            yet), or has another scheme.
    """
    text = address.strip()
    if text.lower().startswith(_POSTGRES_PREFIXES):
        raise ValueError(
            "PostgreSQL stores are not supported yet; give a SQLite file path "
            "(for example /var/lib/llmgw/store.db) as the store address"
        )
    if text.startswith(_SQLITE_PREFIX):
        text = text[len(_SQLITE_PREFIX) :]
    elif "://" in text or text.startswith("sqlite:"):
        scheme = text.split(":", 1)[0]
        raise ValueError(
            f"store address scheme {scheme!r} is not supported; give a SQLite file path "
            "or sqlite:///<path>"
        )
    if not text:
        raise ValueError(f"store address {address!r} names no file")
    return open_sqlite_store(Path(text).expanduser())

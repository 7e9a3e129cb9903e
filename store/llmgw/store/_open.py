"""``open_store``: open the store named by an address."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

from .interface import Store
from .postgres import is_postgres_address, open_postgres_store
from .sqlite import open_sqlite_store

__all__ = ["open_store"]

_SQLITE_PREFIX = "sqlite:///"


def open_store(address: str) -> AbstractAsyncContextManager[Store]:
    """Open the store at ``address``; use as ``async with open_store(a) as store:``.

    Accepted addresses:

    - a file path (``/var/lib/llmgw/store.db``, ``~`` expanded): SQLite;
    - ``sqlite:///<path>``: the same, SQLAlchemy style, so
      ``sqlite:///store.db`` is relative and ``sqlite:////var/lib/x.db``
      absolute;
    - a libpq URI, ``postgresql://user:pw@a:5432,b:5432/llmgw`` (also
      ``postgres://`` and ``postgresql+psycopg://``), or a ``key=value`` DSN,
      ``host=a,b,c dbname=llmgw user=llmgw target_session_attrs=read-write``:
      PostgreSQL (``docs/store.md``).

    Args:
        address: the store address.

    Returns:
        An async context manager that opens the store (creating and
        migrating it as needed) and closes it at exit; see
        :func:`llmgw.store.sqlite.open_sqlite_store` and
        :func:`llmgw.store.postgres.open_postgres_store`.

    Raises:
        ValueError: ``address`` is empty, names no file, is not a connection
            string PostgreSQL reads, or has another scheme.
    """
    text = address.strip()
    if is_postgres_address(text):
        return open_postgres_store(text)
    if text.startswith(_SQLITE_PREFIX):
        text = text[len(_SQLITE_PREFIX) :]
    elif "://" in text or text.startswith("sqlite:"):
        scheme = text.split(":", 1)[0]
        raise ValueError(
            f"store address scheme {scheme!r} is not supported; give a SQLite file path, "
            "sqlite:///<path>, or a PostgreSQL address (postgresql://…)"
        )
    if not text:
        raise ValueError(f"store address {address!r} names no file")
    return open_sqlite_store(Path(text).expanduser())

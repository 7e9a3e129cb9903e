"""The ``Store`` protocol: every query llmgw makes is a named method here.

Both backends (SQLite now, PostgreSQL later) implement it and pass the same
contract suite (``tests/store/``). Methods are async: implementations run
their blocking database calls in worker threads under their own
``trio.CapacityLimiter`` so the event loop never blocks.

Errors: a method raises :class:`StoreError` (or a subclass) when the database
fails; :class:`Conflict` when a unique value (a key hash, a model name) is
already taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .records import KeyRecord, Lease, ModelRecord, UsageRow

__all__ = ["Conflict", "Store", "StoreError"]


class StoreError(Exception):
    """The database failed or could not be reached; the cause is chained."""


class Conflict(StoreError):
    """A unique value is already taken (a key hash, a model name)."""


class Store(Protocol):
    # --- secrets -------------------------------------------------------------
    async def get_or_create_secret(self, name: str, make: Callable[[], bytes]) -> bytes:
        """The secret named ``name``; made with ``make()`` and kept on first need.

        Two concurrent callers get the same bytes (the first write wins).
        """
        ...

    # --- keys ----------------------------------------------------------------
    async def insert_key(self, key: KeyRecord) -> None:
        """Keep a new key. Raises :class:`Conflict` if its id or hash exists."""
        ...

    async def find_key_by_hash(self, key_hash: str) -> KeyRecord | None:
        """The key with this hash, revoked or not, or ``None``."""
        ...

    async def get_key(self, key_id: str) -> KeyRecord | None: ...

    async def list_keys(self) -> list[KeyRecord]:
        """Every key, oldest first."""
        ...

    async def revoke_key(self, key_id: str, at: float) -> bool:
        """Mark a key revoked at ``at``; ``False`` when there is no such key."""
        ...

    # --- usage ---------------------------------------------------------------
    async def insert_usage(self, rows: Sequence[UsageRow]) -> None:
        """Write a batch of usage rows in one transaction (all or none).

        A row whose ``request_id`` is already stored is skipped, so a batch
        retried after an error it did not see is never counted twice.
        """
        ...

    async def list_usage(self, *, last: int = 20, key_id: str | None = None) -> list[UsageRow]:
        """The ``last`` newest rows, newest first, optionally for one key."""
        ...

    async def get_usage(self, request_id: str) -> UsageRow | None: ...

    # --- catalog -------------------------------------------------------------
    async def put_model(self, model: ModelRecord) -> None:
        """Insert or replace the model with this name."""
        ...

    async def get_model(self, name: str) -> ModelRecord | None: ...

    async def list_models(self) -> list[ModelRecord]:
        """Every model, by name."""
        ...

    async def delete_model(self, name: str) -> bool: ...

    # --- settings ------------------------------------------------------------
    async def get_setting(self, key: str) -> Any | None:
        """A JSON value kept under ``key``, or ``None``."""
        ...

    async def put_setting(self, key: str, value: Any) -> None: ...

    # --- leases --------------------------------------------------------------
    async def acquire_lease(self, name: str, holder: str, ttl_s: float, now: float) -> Lease | None:
        """Take or renew the lease ``name`` for ``holder`` until ``now + ttl_s``.

        Succeeds when the lease is free, expired, or already ``holder``'s
        (a renewal keeps the epoch; a takeover adds one). Returns ``None``
        when someone else holds it and it has not expired. One conditional
        update, so two contenders never both win.
        """
        ...

    async def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up now if ``holder`` has it (a clean stop)."""
        ...

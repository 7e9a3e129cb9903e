"""llmgw's store: the :class:`Store` protocol, its records, and backends."""

from ._open import open_store as open_store
from .interface import Conflict as Conflict
from .interface import Store as Store
from .interface import StoreError as StoreError
from .records import KeyRecord as KeyRecord
from .records import Lease as Lease
from .records import ModelRecord as ModelRecord
from .records import UsageRow as UsageRow
from .sqlite import SqliteStore as SqliteStore
from .sqlite import open_sqlite_store as open_sqlite_store

__all__ = [
    "Conflict",
    "KeyRecord",
    "Lease",
    "ModelRecord",
    "SqliteStore",
    "Store",
    "StoreError",
    "UsageRow",
    "open_sqlite_store",
    "open_store",
]

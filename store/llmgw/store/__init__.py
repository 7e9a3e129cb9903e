"""llmgw's store: the :class:`Store` protocol, its records, and backends."""

from .interface import Conflict as Conflict
from .interface import Store as Store
from .interface import StoreError as StoreError
from .records import KeyRecord as KeyRecord
from .records import Lease as Lease
from .records import ModelRecord as ModelRecord
from .records import UsageRow as UsageRow

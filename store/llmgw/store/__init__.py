"""llmgw's store: the :class:`Store` protocol, its records, and backends."""

from ._open import open_store as open_store
from .interface import Conflict as Conflict
from .interface import Store as Store
from .interface import StoreError as StoreError
from .records import KeyRecord as KeyRecord
from .records import Lease as Lease
from .records import Limits as Limits
from .records import ModelRecord as ModelRecord
from .records import Org as Org
from .records import Project as Project
from .records import ProjectPath as ProjectPath
from .records import Scope as Scope
from .records import SummaryBy as SummaryBy
from .records import Team as Team
from .records import UsageRow as UsageRow
from .records import UsageSummary as UsageSummary
from .sqlite import SqliteStore as SqliteStore
from .sqlite import open_sqlite_store as open_sqlite_store

__all__ = [
    "Conflict",
    "KeyRecord",
    "Lease",
    "Limits",
    "ModelRecord",
    "Org",
    "Project",
    "ProjectPath",
    "Scope",
    "SqliteStore",
    "Store",
    "StoreError",
    "SummaryBy",
    "Team",
    "UsageRow",
    "UsageSummary",
    "open_sqlite_store",
    "open_store",
]

"""llmgw's store: the :class:`Store` protocol, its records, and its two
backends, SQLite and PostgreSQL (``docs/store.md``)."""

from ._catalog_json import model_from_doc as model_from_doc
from ._catalog_json import model_to_doc as model_to_doc
from ._catalog_json import profile_fingerprint as profile_fingerprint
from ._open import open_store as open_store
from .interface import Conflict as Conflict
from .interface import Fenced as Fenced
from .interface import JoinTokenExpired as JoinTokenExpired
from .interface import JoinTokenRefused as JoinTokenRefused
from .interface import JoinTokenUnknown as JoinTokenUnknown
from .interface import JoinTokenUsed as JoinTokenUsed
from .interface import Store as Store
from .interface import StoreError as StoreError
from .postgres import PostgresStore as PostgresStore
from .postgres import open_postgres_store as open_postgres_store
from .records import External as External
from .records import ExternalKey as ExternalKey
from .records import GuardEvent as GuardEvent
from .records import JoinToken as JoinToken
from .records import KeyRecord as KeyRecord
from .records import Lease as Lease
from .records import Limits as Limits
from .records import Membership as Membership
from .records import ModelRecord as ModelRecord
from .records import NodeCertificate as NodeCertificate
from .records import Org as Org
from .records import Origin as Origin
from .records import OriginFile as OriginFile
from .records import Person as Person
from .records import Profile as Profile
from .records import Project as Project
from .records import ProjectPath as ProjectPath
from .records import Scope as Scope
from .records import SessionRecord as SessionRecord
from .records import SummaryBy as SummaryBy
from .records import Team as Team
from .records import UsageRow as UsageRow
from .records import UsageSummary as UsageSummary
from .sqlite import SqliteStore as SqliteStore
from .sqlite import open_sqlite_store as open_sqlite_store

__all__ = [
    "Conflict",
    "External",
    "ExternalKey",
    "Fenced",
    "GuardEvent",
    "JoinToken",
    "JoinTokenExpired",
    "JoinTokenRefused",
    "JoinTokenUnknown",
    "JoinTokenUsed",
    "KeyRecord",
    "Lease",
    "Limits",
    "Membership",
    "ModelRecord",
    "NodeCertificate",
    "Org",
    "Origin",
    "OriginFile",
    "Person",
    "PostgresStore",
    "Profile",
    "Project",
    "ProjectPath",
    "Scope",
    "SessionRecord",
    "SqliteStore",
    "Store",
    "StoreError",
    "SummaryBy",
    "Team",
    "UsageRow",
    "UsageSummary",
    "model_from_doc",
    "model_to_doc",
    "open_postgres_store",
    "open_sqlite_store",
    "open_store",
    "profile_fingerprint",
]

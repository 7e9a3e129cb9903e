"""The ``Store`` protocol: every query llmgw makes is a named method here.

Both backends, SQLite and PostgreSQL (``docs/store.md``), implement it and
pass the same contract suite (``tests/store/``). Methods are async: implementations run
their blocking database calls in worker threads under their own
``trio.CapacityLimiter`` so the event loop never blocks.

Errors: a method raises :class:`StoreError` (or a subclass) when the database
fails; :class:`Conflict` when a unique value (a key hash, a model name) is
already taken; :class:`Fenced` when a write fenced by a lease comes from a
holder that lost it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from llmgw import errors

from .records import (
    GuardEvent,
    JoinToken,
    KeyRecord,
    Lease,
    Limits,
    Membership,
    ModelRecord,
    NodeCertificate,
    Org,
    Person,
    ProjectPath,
    Scope,
    SessionRecord,
    SettingChange,
    SummaryBy,
    Team,
    UsageRow,
    UsageSummary,
)

__all__ = [
    "Conflict",
    "Fenced",
    "JoinTokenExpired",
    "JoinTokenRefused",
    "JoinTokenUnknown",
    "JoinTokenUsed",
    "Store",
    "StoreError",
]

# The database failed or could not be reached; the cause is chained.
# One class, shared with the error tree, so ``except llmgw.errors.StoreError``
# catches the store's errors.
StoreError = errors.StoreError


class Conflict(StoreError):
    """A unique value is already taken (a key hash, a model name)."""


class Fenced(StoreError):
    """A write made under a lease epoch that is no longer the lease's: the
    writer was deposed (another control plane took the lease over, or it
    expired and was taken), so the store refused the write and wrote nothing.

    Attributes:
        lease: the lease the writer believed it held.
        current: the lease's holder and epoch now, ``None`` when there is no
            such lease.
    """

    def __init__(self, message: str, *, lease: Lease, current: tuple[str, int] | None) -> None:
        super().__init__(message)
        self.lease = lease
        self.current = current

    @classmethod
    def deposed(cls, lease: Lease, current: tuple[str, int] | None) -> Fenced:
        """The refusal of a write fenced by ``lease``, saying who holds it now."""
        if current is None:
            now = "there is no such lease"
        else:
            now = f"it is at epoch {current[1]}, held by {current[0]}"
        return cls(
            f"write refused: this control plane no longer holds the {lease.name!r} lease "
            f"(it wrote under epoch {lease.epoch}; {now}); only the leader writes this",
            lease=lease,
            current=current,
        )


class JoinTokenRefused(errors.Refused):
    """A join code's token cannot be used; the subclass says why."""


class JoinTokenUnknown(JoinTokenRefused):
    """No join code of this cluster has this token: a forged code, a typo,
    or a code made by another control plane."""

    status = 403
    code = "join_code_unknown"


class JoinTokenUsed(JoinTokenRefused):
    """The join code was already used; a code works once.

    Attributes:
        used_at: when it was used (UTC epoch s).
    """

    status = 410
    code = "join_code_used"

    def __init__(self, message: str, *, used_at: float) -> None:
        super().__init__(message)
        self.used_at = used_at


class JoinTokenExpired(JoinTokenRefused):
    """The join code expired before it was used.

    Attributes:
        expires_at: when it expired (UTC epoch s).
    """

    status = 410
    code = "join_code_expired"

    def __init__(self, message: str, *, expires_at: float) -> None:
        super().__init__(message)
        self.expires_at = expires_at


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

    async def update_key(self, key: KeyRecord) -> bool:
        """Replace the key with ``key.id`` (rotation, limits, band, last use).

        A revoked key stays revoked (a stored ``revoked_at`` wins) and
        ``last_used_at`` keeps the later time, so a stale copy undoes nothing.
        ``False`` when there is no such key. Raises :class:`Conflict` if the
        hash belongs to another key.
        """
        ...

    async def mark_keys_used(self, used: Mapping[str, float]) -> None:
        """Record last uses (key id → UTC epoch s) in one transaction.

        Earlier times than the stored ones and unknown ids are ignored.
        """
        ...

    # --- tenancy tree --------------------------------------------------------
    async def ensure_project(
        self, org: str, team: str, project: str, now: float
    ) -> tuple[ProjectPath, list[str]]:
        """Make ``org/team/project`` exist; the path and what was created.

        Created levels are listed top down as ``"org Acme"``, ``"team
        Acme/ml"``, ``"project Acme/ml/train"``. Names are unique per parent,
        so nothing existing is ever moved. Raises ``ValueError`` for a name
        that is not 1 to 64 letters, digits, ``-``, ``_`` or ``.``.
        """
        ...

    async def get_project_path(self, project_id: str) -> ProjectPath | None: ...

    async def find_project(self, org: str, team: str, project: str) -> ProjectPath | None:
        """The project at ``org/team/project`` (names), or ``None``."""
        ...

    async def find_org(self, name: str) -> Org | None: ...

    async def find_team(self, org: str, name: str) -> Team | None:
        """The team ``name`` in the org named ``org``, or ``None``."""
        ...

    async def list_orgs(self) -> list[Org]:
        """Every org, by name."""
        ...

    async def list_teams(self) -> list[Team]:
        """Every team, by org name then team name."""
        ...

    async def list_tree(self) -> list[ProjectPath]:
        """Every project with its path, by org, team and project name."""
        ...

    async def set_limits(self, scope: Scope, id: str, limits: Limits) -> bool:
        """Replace the limits at one scope; ``False`` when there is no such id."""
        ...

    # --- usage ---------------------------------------------------------------
    async def insert_usage(self, rows: Sequence[UsageRow]) -> None:
        """Write a batch of usage rows in one transaction (all or none).

        A row whose ``request_id`` is already stored is skipped, so a batch
        retried after an error it did not see is never counted twice. New
        rows are added into the hourly, daily and monthly roll-ups in the same
        transaction. A row older than the pruning horizon
        (:meth:`usage_pruned_before`) is skipped too: it may have been stored
        and pruned already, so its sums may be in the roll-ups.
        When another process holds the write lock, fails with
        :class:`StoreError` within about ten seconds rather than waiting.
        """
        ...

    async def list_usage(self, *, last: int = 20, key_id: str | None = None) -> list[UsageRow]:
        """The ``last`` newest rows, newest first, optionally for one key."""
        ...

    async def get_usage(self, request_id: str) -> UsageRow | None: ...

    async def spend_since_by_scope(self, since: float) -> dict[str, int]:
        """Summed ``cost_micros`` of usage with ``created_at >= since``, exactly.

        Keys are counter names ``key:<id>``, ``project:<id>``, ``team:<id>``,
        ``org:<id>``; every non-empty id seen in that usage is present. Read
        from the roll-ups (raw rows only for the part of the hour of
        ``since`` after it; when those were pruned, that hour counts whole).
        """
        ...

    async def usage_summary(
        self, by: SummaryBy, since: float, until: float | None = None
    ) -> list[UsageSummary]:
        """Usage per group with ``since <= created_at < until``, most expensive first.

        Read from the monthly, daily and hourly roll-ups; raw rows only for the parts
        of an hour at either end. Where those raw rows were pruned, that hour
        counts whole.
        """
        ...

    async def prune_usage(
        self, before: float, *, limit: int = 5000, fence: Lease | None = None
    ) -> int:
        """Delete at most ``limit`` raw rows older than ``before`` (floored to
        its hour), oldest first, in one short transaction; the number
        deleted. The roll-ups keep their sums. Moves the pruning horizon to
        ``before`` (never back) when a row is deleted. ``ValueError`` when
        ``limit`` < 1. With ``fence``, see the leases section: :class:`Fenced`
        when that lease moved on (a call that finds nothing to delete
        returns 0 without looking at the lease).
        """
        ...

    async def usage_pruned_before(self) -> float | None:
        """The pruning horizon: raw rows older than it may be gone (``None``:
        nothing was ever pruned)."""
        ...

    async def export_usage(
        self,
        since: float,
        until: float | None,
        *,
        after_request_id: str = "",
        limit: int = 1000,
    ) -> list[UsageRow]:
        """A page of rows with ``since <= created_at < until``, by (created_at, request_id).

        Pass the last row's ``request_id`` as ``after_request_id`` for the
        next page; a page shorter than ``limit`` is the last.
        """
        ...

    # --- catalog -------------------------------------------------------------
    async def put_model(self, model: ModelRecord, *, fence: Lease | None = None) -> None:
        """Insert or replace the model with this name (:class:`Fenced` when
        ``fence`` moved on)."""
        ...

    async def get_model(self, name: str) -> ModelRecord | None: ...

    async def list_models(self) -> list[ModelRecord]:
        """Every model, by name."""
        ...

    async def delete_model(self, name: str, *, fence: Lease | None = None) -> bool:
        """Remove the model with this name; ``False`` when there was none
        (:class:`Fenced` when ``fence`` moved on)."""
        ...

    # --- settings ------------------------------------------------------------
    async def get_setting(self, key: str) -> Any | None:
        """A JSON value kept under ``key``, or ``None``."""
        ...

    async def put_setting(self, key: str, value: Any, *, fence: Lease | None = None) -> None:
        """Keep ``value`` (JSON) under ``key`` (:class:`Fenced` when ``fence``
        moved on)."""
        ...

    # --- the cluster settings document (versioned) -----------------------------
    async def get_settings_doc(self) -> tuple[int, dict[str, Any]] | None:
        """The live settings document and its version, or ``None`` before the
        first :meth:`put_settings_doc`."""
        ...

    async def put_settings_doc(
        self,
        doc: Mapping[str, Any],
        *,
        expected_version: int | None,
        actor: str,
        note: str = "",
        fence: Lease | None = None,
    ) -> int:
        """Keep ``doc`` (plain JSON types) as the next version; return it.

        Optimistic concurrency: with ``expected_version`` given, the write
        happens only if the live version is still that one (0 = no document
        yet), else :class:`Conflict`; ``None`` writes unconditionally. The
        check and the write are one transaction. The older versions stay as
        history. Raises ``TypeError``/``ValueError`` when ``doc`` is not JSON.
        """
        ...

    async def settings_version(self) -> int:
        """The live document's version; 0 when there is none. Cheap: every
        control plane calls it each second."""
        ...

    async def settings_history(self, last: int = 20) -> list[SettingChange]:
        """The ``last`` newest versions, newest first (``ValueError`` if
        ``last`` < 1)."""
        ...

    # --- leases --------------------------------------------------------------
    # Fencing: a leader-only write may carry ``fence=`` the :class:`Lease` its
    # writer holds. The store then writes only if that lease is still at that
    # epoch with that holder, checked in the write's own transaction (a
    # takeover waits for it or comes first), and raises :class:`Fenced`
    # otherwise, writing nothing. A renewal keeps the epoch, so the lease
    # first returned by :meth:`acquire_lease` fences every write of one
    # leadership.
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

    # --- node identity -------------------------------------------------------
    async def insert_node_certificate(self, cert: NodeCertificate) -> None:
        """Keep a certificate just issued. Raises :class:`Conflict` if its serial exists."""
        ...

    async def get_node_certificate(self, serial: str) -> NodeCertificate | None:
        """The certificate with this serial (lower-case hex), revoked or not, or ``None``."""
        ...

    async def list_node_certificates(self, node_id: str | None = None) -> list[NodeCertificate]:
        """The certificates issued (to ``node_id`` when given), oldest first."""
        ...

    async def revoke_node_certificates(self, node_id: str, at: float) -> int:
        """Revoke every valid certificate of ``node_id`` at ``at`` (UTC epoch s).

        Returns how many were revoked now (already revoked ones keep their time).
        """
        ...

    async def insert_join_token(self, token: JoinToken) -> None:
        """Keep a join code's token (by hash). Raises :class:`Conflict` if the hash exists."""
        ...

    async def get_join_token(self, token_hash: str) -> JoinToken | None:
        """The token with this hash, used or not, or ``None`` (nothing changes)."""
        ...

    async def use_join_token(self, token_hash: str, now: float) -> JoinToken:
        """Use the token with this hash, once: it is marked used at ``now``.

        One conditional update, so two concurrent uses never both succeed.

        Returns:
            The token as stored now (``used_at`` = ``now``).

        Raises:
            JoinTokenUnknown: no token has this hash.
            JoinTokenUsed: it was used before (``used_at`` says when).
            JoinTokenExpired: ``now`` is at or past its ``expires_at``.
        """
        ...

    async def list_guard_events(
        self,
        *,
        last: int = 50,
        request_id: str | None = None,
        rule: str | None = None,
        since: float | None = None,
    ) -> list[GuardEvent]:
        """The ``last`` newest guard events (written with their usage rows by
        :meth:`insert_usage` from :attr:`UsageRow.guard_events`), newest
        first, those of one request, of one rule id, or from ``since``
        (UTC epoch s) on when given. Pruned with the usage rows.

        Raises:
            ValueError: ``last`` is negative.
        """
        ...

    # --- people, memberships, sessions (docs/portal.md) ----------------------
    async def insert_person(self, person: Person) -> None:
        """Keep a new person (``email`` lower-cased). Raises :class:`Conflict`
        if the id or the address is taken."""
        ...

    async def get_person(self, person_id: str) -> Person | None: ...

    async def find_person(self, email: str) -> Person | None:
        """The person with this sign-in address (any case), or ``None``."""
        ...

    async def list_people(self) -> list[Person]:
        """Every person, by address."""
        ...

    async def update_person(self, person: Person) -> bool:
        """Replace the person with ``person.id``; ``False`` when there is none.
        Raises :class:`Conflict` if the address belongs to another person."""
        ...

    async def delete_person(self, person_id: str) -> bool:
        """Remove a person with their memberships and sessions (their keys
        stay); ``False`` when there is none."""
        ...

    async def forget_person(self, person_id: str, anonymous: str, at: float) -> bool:
        """Erase a person's personal data in one transaction: their row,
        memberships and sessions go; the keys they own are revoked at ``at``
        (if live) and owned by ``anonymous`` instead of their address, so
        usage sums stay (per key) under that anonymous id. ``False`` when
        there is no such person."""
        ...

    async def put_membership(self, membership: Membership) -> None:
        """Add a membership, or change its role when it exists."""
        ...

    async def delete_membership(self, person_id: str, scope: str, scope_id: str) -> bool: ...

    async def list_memberships(self, person_id: str | None = None) -> list[Membership]:
        """Every membership (of ``person_id`` when given)."""
        ...

    async def insert_session(self, session: SessionRecord) -> None:
        """Keep a new session. Raises :class:`Conflict` if the hash exists."""
        ...

    async def get_session(self, token_hash: str) -> SessionRecord | None:
        """The session with this token hash (expired or not), or ``None``."""
        ...

    async def delete_session(self, token_hash: str) -> bool:
        """End one session; ``False`` when there was none."""
        ...

    async def delete_sessions(self, person_id: str, *, before: float | None = None) -> int:
        """End every session of ``person_id`` (how many); with ``before``,
        also drop anyone's sessions that expired before it."""
        ...

    async def usage_of(
        self,
        since: float,
        *,
        key_ids: Sequence[str] | None = None,
        project_id: str | None = None,
        limit: int = 50_000,
    ) -> list[UsageRow]:
        """The raw usage rows since ``since`` of the keys ``key_ids`` (or of
        the project ``project_id``), the newest ``limit``, oldest first, with
        the fields a page sums (ids, times, model, status, tokens, cost).
        ``ValueError`` when neither is named."""
        ...

    async def keys_last_used(self) -> dict[str, float]:
        """Each key's last use, ``{key id: UTC epoch s}``: the later of the
        stored ``last_used_at`` and its newest usage row (found through the
        ``(key_id, created_at)`` index, one seek per key); keys never used
        are left out."""
        ...

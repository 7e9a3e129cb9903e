"""The typed records the store takes and returns.

Times are UTC seconds since the epoch (``*_at``, floats); durations are in
milliseconds where the name says ``_ms``. No record ever holds prompt or
answer text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

__all__ = [
    "External",
    "ExternalKey",
    "GuardEvent",
    "JoinToken",
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
    "Profile",
    "Project",
    "ProjectPath",
    "Scope",
    "SessionRecord",
    "SettingChange",
    "SummaryBy",
    "Team",
    "UsageRow",
    "UsageSummary",
]

Scope = Literal["org", "team", "project", "key"]
"""A level that carries :class:`Limits`: the three tree levels and a key."""

SummaryBy = Literal["key", "project", "team", "org", "model"]
"""What :meth:`~llmgw.store.Store.usage_summary` groups by."""


def _models_tuple(value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"models must be a sequence of model names, not the string {value!r}")
    return tuple(value)


_optional_count = attrs.validators.optional(
    [attrs.validators.instance_of(int), attrs.validators.ge(0)]
)


@attrs.frozen(kw_only=True)
class Limits:
    """What one level of the tree (or one key) allows; ``None`` = not limited here.

    A level can only tighten what its parents allow: the caller applies the
    strictest value along the path.
    The store only keeps these.

    Attributes:
        rpm: requests per minute.
        tpm: tokens per minute.
        budget_day_micros: money per UTC day, in micro-units.
        budget_month_micros: money per UTC month, in micro-units.
        models: the models allowed here; ``None`` inherits the parent's
            list, ``()`` allows none. Any iterable of names is accepted and
            kept as a tuple.
    """

    rpm: int | None = attrs.field(default=None, validator=_optional_count)
    tpm: int | None = attrs.field(default=None, validator=_optional_count)
    budget_day_micros: int | None = attrs.field(default=None, validator=_optional_count)
    budget_month_micros: int | None = attrs.field(default=None, validator=_optional_count)
    models: tuple[str, ...] | None = attrs.field(default=None, converter=_models_tuple)


@attrs.frozen(kw_only=True)
class Org:
    """An organization, the top of the tree. ``name`` is unique."""

    id: str
    name: str
    limits: Limits = Limits()
    created_at: float


@attrs.frozen(kw_only=True)
class Team:
    """A team inside an organization. ``name`` is unique within the org."""

    id: str
    org_id: str
    name: str
    limits: Limits = Limits()
    created_at: float


@attrs.frozen(kw_only=True)
class Project:
    """A project inside a team; keys belong to projects. ``name`` is unique within the team."""

    id: str
    team_id: str
    name: str
    limits: Limits = Limits()
    created_at: float


@attrs.frozen(kw_only=True)
class ProjectPath:
    """A project with the team and org above it."""

    org: Org
    team: Team
    project: Project

    @property
    def path(self) -> str:
        """``"Org/team/project"``, the names joined with ``/``."""
        return f"{self.org.name}/{self.team.name}/{self.project.name}"


@attrs.frozen(kw_only=True)
class KeyRecord:
    """A client API key. Only its SHA-256 hash is stored.

    Attributes:
        id: stable id (``key_…``), shown in usage rows and listings.
        name: the name given at creation.
        key_hash: hex SHA-256 of the whole ``sk-llmgw-…`` secret.
        prefix: the first characters of the secret, for people to recognise it.
        created_at: UTC epoch seconds.
        is_admin: an older llmgw's admin key (which also opened the admin
            API); the admin API now takes only the admin token, and ``llmgw
            up`` clears this on the key it kept in ``admin-key``.
        revoked_at: UTC epoch seconds, or ``None`` while the key is live.
        expires_at: UTC epoch seconds, or ``None`` for no expiry.
        project_id: the project the key belongs to (and spends in), or
            ``None`` for keys made before the tree existed and personal keys.
        band: the admission band (empty = the default).
        limits: the key's own limits, on top of its project's path.
        last_used_at: UTC epoch seconds of the last use known to the store,
            or ``None`` when never used.
    """

    id: str
    name: str
    key_hash: str
    prefix: str
    created_at: float
    is_admin: bool = False
    revoked_at: float | None = None
    expires_at: float | None = None
    project_id: str | None = None
    band: str = ""
    limits: Limits = Limits()
    last_used_at: float | None = None
    #: For a personal key, the person's sign-in address (then no project).
    owner: str = ""


def _guard_events(value: Iterable[Sequence[str]]) -> tuple[tuple[str, str, str], ...]:
    return tuple((str(d), str(r), str(a)) for d, r, a in value)


@attrs.frozen(kw_only=True)
class UsageRow:
    """One finished (or failed) client request.

    Token counts follow OpenAI: ``cached_tokens`` is counted inside
    ``prompt_tokens``. ``project_id``, ``team_id`` and ``org_id`` are the
    key's place in the tree when the request ran (empty for a key without a
    project); ``model`` is the model asked for and ``served_model`` the one
    that answered (empty = the same). ``cost_micros`` is the money charged,
    in micro-units.
    """

    request_id: str
    created_at: float
    key_id: str
    model: str
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    duration_ms: float = 0.0
    ttft_ms: float | None = None
    replica_id: str = ""
    stream: bool = False
    endpoint: str = ""
    project_id: str = ""
    team_id: str = ""
    org_id: str = ""
    served_model: str = ""
    images: int = 0
    meshes: int = 0
    cost_micros: int = 0
    #: Answered from the exact answer cache (no tokens, no cost).
    cache_hit: bool = False
    #: The guardrails' rule ids that matched, comma separated (never the text).
    guard_rules: str = ""
    #: The strictest guard action taken: ``flag``, ``mask``, ``redact``,
    #: ``block``, or ``""``.
    guard_action: str = ""
    #: Milliseconds spent guarding, both directions.
    guard_ms: float = 0.0
    #: Each rule that matched: ``(direction, rule id, action)``, direction
    #: ``input`` or ``output``; stored as the request's guard events
    #: (:class:`GuardEvent`), not in the usage table.
    guard_events: tuple[tuple[str, str, str], ...] = attrs.field(
        default=(), converter=_guard_events
    )


@attrs.frozen(kw_only=True)
class UsageSummary:
    """Usage summed over one group (a key, project, team, org or model id).

    ``requests`` counts every request, failed ones too; ``errors`` those
    with a status of 400 or more.
    """

    group: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0
    errors: int = 0


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(f"expected a sequence of strings, not the string {value!r}")
    return tuple(value)


def _env_dict(value: Mapping[str, str]) -> dict[str, str]:
    return dict(value)


@attrs.frozen(kw_only=True)
class Profile:
    """One way to run a model (``docs/catalog.md``, profiles).

    Attributes:
        name: unique within the model.
        engine: the engine adapter (``llamacpp``, ``sim``, ``vllm``, …).
        gpu_class: the GPU class asked for (``h100-80g``, …); empty = CPU.
        gpus: cards per replica (0 on CPU).
        tp: tensor-parallel width (1 = none).
        cpu_cores: cores reserved per replica, also the engine's threads;
            0 = none reserved and the engine decides.
        min_memory_gb: host memory reserved per replica, in GB (10^9 bytes).
        context_tokens: the engine's whole context (llama.cpp ``--ctx-size``).
        slots: parallel sequences per replica (llama.cpp ``--parallel``).
        args, env: extra engine arguments and environment, vetted on entry.
        priority: among profiles that fit, the highest is used.
        replicas: how many replicas of this profile are wanted; 0 disables it.
        startup_timeout_s: a start with no progress this long is failed.
        selector: node labels a node must carry (``{"llmgw.role": "judge"}``).
    """

    name: str = "default"
    engine: str
    gpu_class: str = ""
    gpus: int = 0
    tp: int = 1
    cpu_cores: int = 0
    min_memory_gb: float = 0.0
    context_tokens: int = 4096
    slots: int = 4
    args: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    env: dict[str, str] = attrs.field(factory=dict, converter=_env_dict)
    priority: int = 0
    replicas: int = 1
    startup_timeout_s: float = 1200.0
    selector: dict[str, str] = attrs.field(factory=dict, converter=_env_dict)


def _profiles_tuple(value: Iterable[Profile]) -> tuple[Profile, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class ExternalKey:
    """One key of an outside provider: a file on the control planes holding
    it, and its share of the traffic relative to the others (0 counts as 1)."""

    file: str
    weight: int = 1


@attrs.frozen(kw_only=True)
class External:
    """An outside OpenAI-compatible provider (``docs/api.md``, outside providers).

    Attributes:
        url: the provider's base URL, without ``/v1``.
        model: the model's name at the provider.
        api_key_files: the keys, each its own endpoint ``external:<model>#<n>``.
    """

    url: str
    model: str
    api_key_files: tuple[ExternalKey, ...] = ()


@attrs.frozen(kw_only=True)
class OriginFile:
    """One file of a model's pinned origin: its path in the repository,
    its size in bytes and its sha256 (lowercase hex, the hub's LFS digest)."""

    path: str
    size_bytes: int
    sha256: str


@attrs.frozen(kw_only=True)
class Origin:
    """Where a model's weights come from, pinned (``docs/models-from-hf.md``).

    Attributes:
        kind: ``hf`` (a Hugging Face repository, or a mirror of one).
        repo: ``ORG/REPO``.
        revision: the commit, 40 hex digits.
        files: every file nodes fetch, with size and digest.
        main_file: the file the engine loads ("" = the whole directory).
    """

    kind: str = "hf"
    repo: str
    revision: str
    files: tuple[OriginFile, ...] = ()
    main_file: str = ""


@attrs.frozen(kw_only=True)
class ModelRecord:
    """A catalog entry: one model and the ways to run it.

    Attributes:
        name: the name clients ask for.
        source: the weights (a local path for llama.cpp); empty for sim and
            outside models.
        sha256: the weights' expected digest, when known.
        aliases: other names clients may use; one namespace with names.
        description: free text.
        allow_pickle: a pickle-format source was accepted deliberately.
        profiles: the ways to run it, highest ``priority`` first when placing.
        on_demand: replicas run only while the model is asked for; loaded by
            the first request, evicted after ``on_demand.evict_after_idle``.
        stopped: stopped by an administrator: nothing runs, the profiles'
            replica counts are kept for ``start``.
        external: set for a model served by an outside provider.
        context_length: the model's trained context in tokens (0 = unknown).
        max_output: the most tokens one answer may ask for; 0 tracks the
            context (:attr:`max_output_tokens`).
        fallbacks: models to use when this one has no room (``docs/api.md``, routing).
        routing: the scoring profile: ``chat``, ``batch`` or ``long-context``.
        capabilities: e.g. ``("embeddings",)``.
        owner: free text.
        created_at: UTC epoch seconds.
        origin: the pinned repository, commit and files the weights come
            from (:class:`Origin`), or None.
    """

    name: str
    source: str = ""
    sha256: str = ""
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    description: str = ""
    allow_pickle: bool = False
    profiles: tuple[Profile, ...] = attrs.field(default=(), converter=_profiles_tuple)
    on_demand: bool = False
    stopped: bool = False
    external: External | None = None
    context_length: int = 0
    max_output: int = 0
    fallbacks: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    routing: str = "chat"
    capabilities: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    owner: str = ""
    created_at: float = 0.0
    #: The pinned origin set by ``ctl model serve hf:…`` (None = none).
    origin: Origin | None = None

    @classmethod
    def simple(
        cls,
        name: str,
        engine: str,
        *,
        replicas: int = 1,
        context_tokens: int = 4096,
        slots: int = 4,
        cpu_cores: int = 0,
        min_memory_gb: float = 0.0,
        args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> ModelRecord:
        """A model with one profile named ``default``; ``fields`` are the
        model's own (``source``, ``sha256``, ``aliases``, …)."""
        profile = Profile(
            engine=engine,
            replicas=replicas,
            context_tokens=context_tokens,
            slots=slots,
            cpu_cores=cpu_cores,
            min_memory_gb=min_memory_gb,
            args=tuple(args),
            env=dict(env or {}),
        )
        return cls(name=name, profiles=(profile,), **fields)

    @property
    def profile(self) -> Profile | None:
        """The profile of highest priority with replicas wanted, else the first."""
        wanted = [p for p in self.profiles if p.replicas > 0]
        if wanted:
            return max(wanted, key=lambda p: p.priority)
        return self.profiles[0] if self.profiles else None

    @property
    def replicas(self) -> int:
        """Replicas wanted when running: the sum over the profiles."""
        return sum(p.replicas for p in self.profiles)

    @property
    def is_external(self) -> bool:
        return self.external is not None

    @property
    def max_output_tokens(self) -> int:
        """``max_output`` when set, else the context: the trained one, else
        the context of the first profile, per slot."""
        if self.max_output:
            return self.max_output
        if self.context_length:
            return self.context_length
        profile = self.profile
        if profile is None:
            return 0
        return profile.context_tokens // max(profile.slots, 1)


@attrs.frozen(kw_only=True)
class Lease:
    """A named lease held by ``holder`` until ``expires_at`` (UTC epoch s).

    ``epoch`` grows by one each time the lease changes hands; writes made by
    the holder are fenced by it.
    """

    name: str
    holder: str
    epoch: int
    expires_at: float


@attrs.frozen(kw_only=True)
class SettingChange:
    """One version of the cluster settings document (``settings_history``).

    Attributes:
        version: 1 for the first document, one more for each change.
        document: the whole settings document of this version (plain JSON
            types, the unstructured ``ServerSettings``).
        changed_at: UTC epoch seconds.
        actor: who changed it (``admin token (FINGERPRINT)``, ``server.yaml``
            for the seed).
        note: why, free text (may be empty).
    """

    version: int
    document: dict[str, Any]
    changed_at: float
    actor: str = ""
    note: str = ""


@attrs.frozen
class NodeCertificate:
    """A certificate the cluster CA issued to a node.

    Attributes:
        serial: its serial number, lower-case hex.
        node_id: the node it names (its ``CN``).
        issued_at: when it was issued (UTC epoch s).
        not_after: when it ends (UTC epoch s).
        revoked_at: when it was revoked (UTC epoch s), ``None`` while valid.
    """

    serial: str
    node_id: str
    issued_at: float
    not_after: float
    revoked_at: float | None = None


@attrs.frozen(kw_only=True)
class JoinToken:
    """The one-time token of a join code, kept only as its hash.

    Attributes:
        token_hash: the hex SHA-256 of the token.
        created_at: when the code was made (UTC epoch s).
        expires_at: when it stops working (UTC epoch s).
        node_id: the node id the code is for; ``""`` lets the node choose.
        labels: labels the joining node gets.
        used_at: when it was used (UTC epoch s), ``None`` until then.
    """

    token_hash: str
    created_at: float
    expires_at: float
    node_id: str = ""
    labels: dict[str, str] = attrs.field(factory=dict, converter=_env_dict)
    used_at: float | None = None


@attrs.frozen(kw_only=True)
class GuardEvent:
    """One rule that matched in one request (``docs/guardrails.md``, Records).

    Attributes:
        request_id: the request (its usage row).
        created_at: when the request came (UTC epoch s).
        key_id, model: who asked, for what (the model asked for).
        direction: ``input`` (the prompt) or ``output`` (the answer).
        rule: the rule id (``secret:aws_access_key``, ``pii:card``,
            ``judge:violent``, ``deny:<policy>:<n>``, ``max_chars``).
        action: ``flag``, ``mask``, ``redact`` or ``block``.
    """

    request_id: str
    created_at: float
    key_id: str
    model: str
    direction: str
    rule: str
    action: str


PersonState = Literal["awaiting", "active", "suspended"]
"""An account's state: awaiting approval, active, suspended."""

StaffRole = Literal["", "viewer", "operator", "billing", "admin"]
"""A person's staff role on ``/admin`` ("" = none)."""

MemberRole = Literal["member", "manager"]
"""A person's role in an org, team or project."""


@attrs.frozen(kw_only=True)
class Person:
    """A person who signs in (the portal, ``docs/portal.md``).

    Attributes:
        id: stable id (``person_…``).
        email: the sign-in address, lower-cased; unique.
        name: a display name (may be empty).
        password_hash: an argon2id PHC string, or a text beginning with
            ``!`` when the account has no local password.
        state: ``awaiting``, ``active`` or ``suspended``.
        staff_role: ``""``, ``viewer``, ``operator``, ``billing`` or ``admin``.
        created_at: UTC epoch seconds.
    """

    id: str
    email: str
    name: str = ""
    password_hash: str = "!"
    state: PersonState = "active"
    staff_role: StaffRole = ""
    created_at: float = 0.0


@attrs.frozen(kw_only=True)
class Membership:
    """A person's place in the tenancy tree: a member or manager of one
    org, team or project (``scope_id`` is that level's id)."""

    person_id: str
    scope: Literal["org", "team", "project"]
    scope_id: str
    role: MemberRole = "member"


@attrs.frozen(kw_only=True)
class SessionRecord:
    """A signed-in session, kept by the SHA-256 hex of its token only.

    ``client`` is the address it was made from; times are UTC epoch seconds.
    """

    token_hash: str
    person_id: str
    created_at: float
    expires_at: float
    client: str = ""

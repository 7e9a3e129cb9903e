"""The typed records the store takes and returns.

Times are UTC seconds since the epoch (``*_at``, floats); durations are in
milliseconds where the name says ``_ms``. No record ever holds prompt or
answer text (``shared/spec/store.md``, Data policy).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs

__all__ = [
    "KeyRecord",
    "Lease",
    "Limits",
    "ModelRecord",
    "Org",
    "Project",
    "ProjectPath",
    "Scope",
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
    strictest value along the path (``shared/spec/tenancy-and-keys.md``).
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
        is_admin: whether the key may also call the admin API.
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


@attrs.frozen(kw_only=True)
class UsageSummary:
    """Usage summed over one group (a key, project, team, org or model id).

    ``requests`` counts every request, failed ones too.
    """

    group: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0


@attrs.frozen(kw_only=True)
class ModelRecord:
    """A catalog entry: one model and how to run it.

    Attributes:
        name: the name clients ask for.
        engine: the engine adapter name (``llamacpp``, ``sim``, …).
        source: the weights (a local path for llama.cpp); empty for sim.
        replicas: how many replicas are wanted.
        context_tokens: ``--ctx-size`` for the engine.
        slots: parallel sequences per replica.
        cpu_cores: threads for CPU engines, 0 = the engine decides.
        args: extra engine arguments (already vetted).
        env: extra engine environment (already vetted).
        sha256: the weights' expected digest, when known.
    """

    name: str
    engine: str
    source: str = ""
    replicas: int = 1
    context_tokens: int = 4096
    slots: int = 4
    cpu_cores: int = 0
    args: tuple[str, ...] = ()
    env: dict[str, str] = attrs.field(factory=dict)
    sha256: str = ""
    created_at: float = 0.0


@attrs.frozen(kw_only=True)
class Lease:
    """A named lease held by ``holder`` until ``expires_at`` (UTC epoch s).

    ``epoch`` grows by one each time the lease changes hands; writes made by
    the holder are fenced by it (``shared/spec/ha-and-leader.md``).
    """

    name: str
    holder: str
    epoch: int
    expires_at: float

"""The typed records the store takes and returns.

Times are UTC seconds since the epoch (``*_at``, floats); durations are in
milliseconds where the name says ``_ms``. No record ever holds prompt or
answer text (``shared/spec/store.md``, Data policy).
"""

from __future__ import annotations

import attrs

__all__ = ["KeyRecord", "Lease", "ModelRecord", "UsageRow"]


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
    """

    id: str
    name: str
    key_hash: str
    prefix: str
    created_at: float
    is_admin: bool = False
    revoked_at: float | None = None
    expires_at: float | None = None


@attrs.frozen(kw_only=True)
class UsageRow:
    """One finished (or failed) client request.

    Token counts follow OpenAI: ``cached_tokens`` is counted inside
    ``prompt_tokens``.
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

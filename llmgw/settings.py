"""The control plane's settings: one attrs tree (``ServerSettings``) and its
one cattrs converter, both ways (:func:`settings_from_doc`,
:func:`settings_to_doc`), which refuses unknown keys naming their path.

This is the bottom layer: every package may import it, it imports nothing of
llmgw but the error tree. ``server.yaml`` seeds the settings; the control
plane then keeps them in the store (``llmgw.control.live``).

The tree, with its defaults, is ``ServerSettings`` below; the ``auth`` block
for example::

    auth:
      default_rpm: 60            # requests a minute for keys with no limit on their path
      default_tpm: 200000        # tokens a minute, likewise
      max_key_ttl: 90d           # longest key life and the expiry of keys made without one
      default_price: {prompt_per_1k: 0, completion_per_1k: 0}
      pricing:                   # per model, integer micro-units per 1,000 tokens
        gemma-3-270m: {prompt_per_1k: 100, cached_per_1k: 10, completion_per_1k: 400}
      flush_interval: 1s         # usage writer
      batch_size: 500
      buffer_size: 10000
      cache_ttl: 5s              # key lookups trusted this long
      usage_sync_interval: 0.2s  # usage journal fdatasync at most this often; 0 = before each answer's end
      usage_retain_days: 90      # raw usage rows kept this long; hourly and daily sums kept for good
      session_ttl: 12h           # a portal session's life (docs/portal.md)
      signup_open: false         # the portal's sign-up page makes accounts awaiting approval

Durations are numbers of seconds or strings like ``45s``, ``30m``, ``12h``,
``90d``. ``llmgw up`` reads ``DATA_DIR/server.yaml`` when it exists (or
``--config FILE``).
"""

from __future__ import annotations

import copy
import math
import re
import typing
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Optional

import attrs
import cattrs
import hyperscan
import yaml

from llmgw.errors import InvalidInput

__all__ = [
    "DEFAULT_BANDS",
    "GUARD_ACTIONS",
    "GUARD_BUILTIN_POLICIES",
    "GUARD_JUDGE_CATEGORIES",
    "GUARD_JUDGE_FORMATS",
    "GUARD_PII_KINDS",
    "ROUTING_PROFILES",
    "AdmissionSettings",
    "AuthSettings",
    "BandSettings",
    "CacheSettings",
    "GuardJudge",
    "GuardPolicy",
    "GuardRules",
    "GuardSettings",
    "GuardStream",
    "HaSettings",
    "NodesSettings",
    "OnDemandSettings",
    "PortalSettings",
    "Price",
    "RouterSettings",
    "ServerSettings",
    "ServingSettings",
    "SettingsError",
    "TimeoutSettings",
    "changed_keys",
    "check_doc_keys",
    "check_key_path",
    "div_up",
    "load_settings",
    "parse_duration_s",
    "settings_from_doc",
    "settings_to_doc",
    "with_key",
]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def div_up(a: int, b: int) -> int:
    """Integer ceiling of ``a / b`` (``b > 0``), so a single token still costs something."""
    return -(-a // b)


def _micros(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be a whole number of micro-units, got {value!r}")
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


@attrs.frozen
class Price:
    """A model's price; every field in integer micro-units.

    Attributes:
        prompt_per_1k: micro-units per 1,000 prompt tokens (= units per million).
        completion_per_1k: micro-units per 1,000 completion tokens.
        cached_per_1k: micro-units per 1,000 cached prompt tokens; 0 means
            "same as ``prompt_per_1k``".
        per_image: micro-units per image produced.
        per_mesh: micro-units per 3D model produced.
    """

    prompt_per_1k: int = attrs.field(default=0, validator=_micros)
    completion_per_1k: int = attrs.field(default=0, validator=_micros)
    cached_per_1k: int = attrs.field(default=0, validator=_micros)
    per_image: int = attrs.field(default=0, validator=_micros)
    per_mesh: int = attrs.field(default=0, validator=_micros)

    def is_zero(self) -> bool:
        """True when every field is 0: such a model never trips a budget."""
        return not (
            self.prompt_per_1k
            or self.completion_per_1k
            or self.cached_per_1k
            or self.per_image
            or self.per_mesh
        )

    def zero(self) -> bool:
        """The spec's name for :meth:`is_zero`."""
        return self.is_zero()

    def cost(
        self, prompt: int, cached: int, completion: int, images: int = 0, meshes: int = 0
    ) -> int:
        """``cost_micros`` of a request, exactly as the spec's formula::

            cached      = clamp(cached, 0, max(prompt, 0))
            cached_rate = cached_per_1k if cached_per_1k != 0 else prompt_per_1k
            cost = div_up((prompt - cached) * prompt_per_1k + cached * cached_rate, 1000)
                 + div_up(completion * completion_per_1k, 1000)
                 + max(images, 0) * per_image
                 + max(meshes, 0) * per_mesh

        ``prompt`` counts every prompt token, the ``cached`` ones included.
        """
        cached = min(max(cached, 0), max(prompt, 0))
        cached_rate = self.cached_per_1k if self.cached_per_1k != 0 else self.prompt_per_1k
        return (
            div_up((prompt - cached) * self.prompt_per_1k + cached * cached_rate, 1000)
            + div_up(completion * self.completion_per_1k, 1000)
            + max(images, 0) * self.per_image
            + max(meshes, 0) * self.per_mesh
        )

    def max_cost(self, tokens: int, images: int = 0, meshes: int = 0) -> int:
        """The most ``tokens`` tokens (plus images and meshes) can cost in
        micro-units, whichever of prompt, cached or completion they turn out
        to be: each token at the highest of the three rates. The accountant
        reserves this against budgets before a request runs.
        """
        rate = max(self.prompt_per_1k, self.cached_per_1k, self.completion_per_1k)
        return (
            div_up(max(tokens, 0) * rate, 1000)
            + max(images, 0) * self.per_image
            + max(meshes, 0) * self.per_mesh
        )


class SettingsError(InvalidInput):
    """A settings file is not valid; the message names the key's path."""


def parse_duration_s(value: object) -> float:
    """Seconds in ``value``: a number, or ``"45s"``, ``"30m"``, ``"12h"``, ``"90d"``.

    Raises:
        ValueError: anything else, or a negative duration.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ValueError(f"{value!r} is not a duration like 45s, 30m, 12h or 90d")
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration")
    if seconds < 0:
        raise ValueError(f"{value!r} is negative")
    return seconds


def _duration_field(default: float | None) -> Any:
    return attrs.field(default=default, converter=attrs.converters.optional(parse_duration_s))


#: The routing profiles (``router.scoring``, a model's ``routing``,
#: ``x-llmgw-profile``); each has its scorer in ``llmgw.router.scoring``.
ROUTING_PROFILES: Final = ("chat", "batch", "long-context")


def _scoring_profile(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in ROUTING_PROFILES:
        named = f"{', '.join(ROUTING_PROFILES[:-1])} or {ROUTING_PROFILES[-1]}"
        raise ValueError(f"{attribute.name}: {value!r} is not {named}")


def _longer_than_zero(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:  # also refuses NaN
        raise ValueError(f"{attribute.name} must be longer than 0 s")


def _positive(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must not be negative")


@attrs.frozen(kw_only=True)
class AuthSettings:
    """The ``auth`` block; see the module docstring for each key. Durations
    (``max_key_ttl``, ``flush_interval``, ``cache_ttl``,
    ``usage_sync_interval``) are in seconds; the
    names are the spec's setting names."""

    default_rpm: int | None = attrs.field(default=60, validator=_positive)
    default_tpm: int | None = attrs.field(default=200_000, validator=_positive)
    max_key_ttl: float | None = _duration_field(None)
    default_price: Price = attrs.field(factory=Price)
    pricing: Mapping[str, Price] = attrs.field(factory=dict)
    flush_interval: float = _duration_field(1.0)
    batch_size: int = attrs.field(default=500, validator=attrs.validators.ge(1))
    buffer_size: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    cache_ttl: float = _duration_field(5.0)
    usage_sync_interval: float = _duration_field(0.2)
    usage_retain_days: int = attrs.field(default=90, validator=attrs.validators.ge(1))
    #: How long a portal session lasts (docs/portal.md).
    session_ttl: float = attrs.field(
        default=12 * 3600.0, converter=parse_duration_s, validator=_longer_than_zero
    )
    #: Anyone may ask for an account on the portal's sign-up page; it then
    #: awaits approval (``llmgw users approve``).
    signup_open: bool = False


@attrs.frozen(kw_only=True)
class ServingSettings:
    """``serving``: ``stopped`` true = every model to zero, ``/v1`` POSTs
    answered 503 ``system_stopped`` (``llmgw stop`` / ``llmgw start``)."""

    stopped: bool = False


@attrs.frozen(kw_only=True)
class OnDemandSettings:
    """``on_demand``, seconds:
    an idle on-demand replica is evicted after ``evict_after_idle`` unless
    younger than ``min_lifetime``; a request for an unloaded model waits at
    most ``load_wait`` for it."""

    evict_after_idle: float = _duration_field(120.0)
    min_lifetime: float = _duration_field(300.0)
    load_wait: float = _duration_field(600.0)


@attrs.frozen(kw_only=True)
class BandSettings:
    """One admission band: requests of higher ``priority`` go first; a band
    may fill ``saturation`` (0 to 1) of a model's slots; a request that waited
    ``queue_ttl`` seconds is answered 504."""

    name: str
    priority: int
    saturation: float = attrs.field(
        default=1.0, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)]
    )
    queue_ttl: float = _duration_field(30.0)


#: Our defaults: people's questions first, bulk jobs within half the slots.
DEFAULT_BANDS: Final = (
    BandSettings(name="interactive", priority=100, saturation=1.0, queue_ttl=30.0),
    BandSettings(name="bulk", priority=10, saturation=0.5, queue_ttl=300.0),
)


@attrs.frozen(kw_only=True)
class AdmissionSettings:
    """``router.admission``: the bands; a key with no band is in ``default_band``."""

    bands: tuple[BandSettings, ...] = attrs.field(default=DEFAULT_BANDS)
    #: A band no longer defined (bands replaced by others) falls back to the
    #: band of highest priority, as a key's unknown band does.
    default_band: str = "interactive"

    @bands.validator
    def _check_bands(self, _: attrs.Attribute[Any], bands: tuple[BandSettings, ...]) -> None:
        if not bands:
            raise ValueError("bands: at least one band is needed")
        names = [band.name for band in bands]
        if len(set(names)) != len(names):
            raise ValueError(f"bands: two bands share a name ({', '.join(names)})")


@attrs.frozen(kw_only=True)
class CacheSettings:
    """``router.cache``: the exact answer cache's bounds, in bytes, and the
    projects it is on for."""

    max_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=attrs.validators.ge(0))
    max_entry_bytes: int = attrs.field(default=1024 * 1024, validator=attrs.validators.ge(0))
    #: Projects whose answers are cached: project id → time to live, in
    #: seconds (``llmgw keys cache --project P --ttl 24h``; off when absent).
    projects: Mapping[str, float] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class TimeoutSettings:
    """``router.timeouts``, seconds, our choices (``docs/api.md``)."""

    connect: float = attrs.field(default=5.0, validator=_longer_than_zero)
    first_byte: float = attrs.field(default=600.0, validator=_longer_than_zero)
    generation: float = attrs.field(default=600.0, validator=_longer_than_zero)


@attrs.frozen(kw_only=True)
class RouterSettings:
    """``router``: admission bands, the answer cache, timeouts, and the
    scoring profile for models that name none."""

    admission: AdmissionSettings = attrs.field(factory=AdmissionSettings)
    cache: CacheSettings = attrs.field(factory=CacheSettings)
    timeouts: TimeoutSettings = attrs.field(factory=TimeoutSettings)
    scoring: str = attrs.field(default="chat", validator=_scoring_profile)


@attrs.frozen(kw_only=True)
class NodesSettings:
    """``nodes``: cordoned nodes take no new replicas; draining ones also
    have theirs moved, each kept serving up to ``drain_grace`` seconds when
    it has nowhere to go."""

    cordoned: tuple[str, ...] = ()
    draining: tuple[str, ...] = ()
    drain_grace: float = _duration_field(300.0)


#: What a rule does with what it finds (``docs/guardrails.md``): ``off``,
#: ``flag`` (recorded only), ``mask`` (cards: all but the last four digits
#: starred), ``redact`` (a placeholder ``[KIND_n]``), ``block`` (400
#: ``content_filter``), from the mildest to the strictest.
GUARD_ACTIONS: Final = ("off", "flag", "mask", "redact", "block")
#: The PII kinds a policy's ``pii`` may name.
GUARD_PII_KINDS: Final = ("email", "phone", "card", "iban", "ssn", "ip", "person")
_INJECTION_ACTIONS: Final = ("off", "flag", "block")


def _guard_action(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in GUARD_ACTIONS:
        raise ValueError(f"{attribute.name}: {value!r} is not one of {', '.join(GUARD_ACTIONS)}")


def _pii_actions(_: object, attribute: attrs.Attribute[Any], value: Mapping[str, str]) -> None:
    for kind, action in value.items():
        if kind not in GUARD_PII_KINDS:
            raise ValueError(
                f"pii.{kind}: no such kind; the kinds are {', '.join(GUARD_PII_KINDS)}"
            )
        if action not in GUARD_ACTIONS:
            raise ValueError(f"pii.{kind}: {action!r} is not one of {', '.join(GUARD_ACTIONS)}")
        if action == "mask" and kind != "card":
            raise ValueError(f"pii.{kind}: only card numbers are masked; redact or block it")


def _injection_action(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in _INJECTION_ACTIONS:
        raise ValueError(f"injection: {value!r} is not one of {', '.join(_INJECTION_ACTIONS)}")


def _deny_patterns(_: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for at, pattern in enumerate(value):
        try:
            re.compile(pattern)
            # The guard's one-pass matcher takes no look-arounds or back-references.
            hyperscan.Database().compile(expressions=[pattern.encode()])
        except (re.error, hyperscan.error) as exc:
            raise ValueError(
                f"deny[{at}]: {pattern!r} is not a regular expression the guard can run: {exc}"
            ) from None


@attrs.frozen(kw_only=True)
class GuardRules:
    """One direction's rules of a policy (``input`` or ``output``).

    Attributes:
        pii: PII kind (:data:`GUARD_PII_KINDS`) → action (:data:`GUARD_ACTIONS`).
        secrets: what to do with secrets (cloud keys, provider tokens,
            private key blocks, JWTs, connection strings with a password).
        injection: ``off``, ``flag`` (recorded) or ``block``; input only.
        deny: regular expressions refused wherever they match.
        max_chars: the most characters of text; 0 = unlimited.
        restore: put the redacted values back into the answer (input only).
    """

    pii: Mapping[str, str] = attrs.field(factory=dict, validator=_pii_actions)
    secrets: str = attrs.field(default="off", validator=_guard_action)
    injection: str = attrs.field(default="off", validator=_injection_action)
    deny: tuple[str, ...] = attrs.field(default=(), validator=_deny_patterns)
    max_chars: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    restore: bool = False


#: How a judge's reply is read: ``qwen3guard`` (``Safety: Safe|Unsafe|
#: Controversial`` and ``Categories: …`` lines), ``llamaguard`` (``safe``,
#: or ``unsafe`` then category codes), ``instructed`` (a general model told
#: by a system prompt to answer as Qwen3Guard does).
GUARD_JUDGE_FORMATS: Final = ("qwen3guard", "llamaguard", "instructed")
#: The categories ``baseline``'s judge refuses, in Qwen3Guard's words.
GUARD_JUDGE_CATEGORIES: Final = (
    "Violent",
    "Non-violent Illegal Acts",
    "Sexual Content or Sexual Acts",
    "PII",
    "Suicide & Self-Harm",
    "Unethical Acts",
    "Jailbreak",
)


def _one_of(*options: str) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in options:
            raise ValueError(f"{attribute.name}: {value!r} is not one of {', '.join(options)}")

    return check


@attrs.frozen(kw_only=True)
class GuardJudge:
    """A policy's judge: a catalog model asked whether a text is safe.

    Attributes:
        model: the catalog model (or alias) that judges; "" = no judge.
        format: how its reply is read (:data:`GUARD_JUDGE_FORMATS`).
        latency_budget: seconds a verdict may take (default 5).
        fail: ``closed`` (503 ``judge_unavailable``) or ``open`` (served,
            recorded as flagged) when no verdict came in time.
        categories: the unsafe categories refused (matched without regard
            to case); empty = any unsafe verdict.
        on: ``input``, ``output`` or ``both``.
        controversial: what ``Safety: Controversial`` counts as: ``flag``
            or ``block``.
    """

    model: str = ""
    format: str = attrs.field(default="qwen3guard", validator=_one_of(*GUARD_JUDGE_FORMATS))
    latency_budget: float = attrs.field(
        default=5.0,
        converter=parse_duration_s,
        validator=attrs.validators.gt(0.0),
    )
    fail: str = attrs.field(default="closed", validator=_one_of("open", "closed"))
    categories: tuple[str, ...] = GUARD_JUDGE_CATEGORIES
    on: str = attrs.field(default="input", validator=_one_of("input", "output", "both"))
    controversial: str = attrs.field(default="flag", validator=_one_of("flag", "block"))


@attrs.frozen(kw_only=True)
class GuardStream:
    """How a policy's judge treats streamed answers.

    Attributes:
        buffer_all: send nothing of a stream before the judge's verdict on
            the whole answer (otherwise text goes out as it comes and is
            judged in windows of 600 characters).
    """

    buffer_all: bool = False


@attrs.frozen(kw_only=True)
class GuardPolicy:
    """A named policy: its ``input`` and ``output`` rules; ``no_store``
    keeps the request out of the answer cache; ``judge`` a model asked
    whether the text is safe (none by default); ``stream`` how the judge
    treats streamed answers."""

    input: GuardRules = attrs.field(factory=GuardRules)
    output: GuardRules = attrs.field(factory=GuardRules)
    no_store: bool = False
    judge: GuardJudge = attrs.field(factory=GuardJudge)
    stream: GuardStream = attrs.field(factory=GuardStream)


#: The built-in policies, always defined (a policy of the same name in
#: ``guard.policies`` replaces it). ``baseline``: secrets refused both ways,
#: card numbers masked, injection attempts recorded. ``observe``: every
#: pattern rule records and none acts.
GUARD_BUILTIN_POLICIES: Final[Mapping[str, GuardPolicy]] = {
    "baseline": GuardPolicy(
        input=GuardRules(pii={"card": "mask"}, secrets="block", injection="flag"),
        output=GuardRules(pii={"card": "mask"}, secrets="block"),
    ),
    "observe": GuardPolicy(
        input=GuardRules(
            pii=dict.fromkeys(GUARD_PII_KINDS, "flag"), secrets="flag", injection="flag"
        ),
        output=GuardRules(pii=dict.fromkeys(GUARD_PII_KINDS, "flag"), secrets="flag"),
    ),
}

_ATTACH_LEVELS: Final = ("org", "team", "project", "key")


@attrs.frozen(kw_only=True)
class GuardSettings:
    """``guard``: the guardrails (``docs/guardrails.md``).

    Attributes:
        enabled: off = no policy applies anywhere.
        default: the policies every request gets.
        policies: name → policy, beside the built-in ``baseline`` and ``observe``.
        attach: ``org:ID``, ``team:ID``, ``project:ID`` or ``key:ID`` → the
            policies the requests of that part of the tree get on top of
            the defaults (a project's add to its org's); a level may also be
            named by its path (``org:Acme``, ``team:Acme/ml``,
            ``project:Acme/ml/train``).
    """

    enabled: bool = True
    default: tuple[str, ...] = ("baseline",)
    policies: Mapping[str, GuardPolicy] = attrs.field(factory=dict)
    attach: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)

    def policy(self, name: str) -> GuardPolicy:
        """The policy called ``name`` (``KeyError`` when there is none)."""
        found = self.policies.get(name)
        return found if found is not None else GUARD_BUILTIN_POLICIES[name]

    def __attrs_post_init__(self) -> None:
        known = set(GUARD_BUILTIN_POLICIES) | set(self.policies)
        named = sorted(known)
        for name in self.default:
            if name not in known:
                raise ValueError(
                    f"default: no policy {name!r}; the policies are {', '.join(named)}"
                )
        for where, names in self.attach.items():
            level, _, ident = where.partition(":")
            if level not in _ATTACH_LEVELS or not ident:
                raise ValueError(f"attach.{where}: not org:ID, team:ID, project:ID or key:ID")
            for name in names:
                if name not in known:
                    raise ValueError(
                        f"attach.{where}: no policy {name!r}; the policies are {', '.join(named)}"
                    )


def http_url_problem(url: object) -> str | None:
    """Why ``url`` is not a usable http:// or https:// URL (a scheme, a host,
    a valid port if any), or ``None`` when it is."""
    if not isinstance(url, str):
        return "is not an http:// or https:// URL"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https") or not url.lower().startswith(parts.scheme + "://"):
        return "is not an http:// or https:// URL"
    if not parts.hostname or any(c.isspace() for c in url):
        return "is not a valid URL (no host, or a space in it)"
    if port == 0:
        return "is not a valid URL (port 0)"
    return None


def _http_urls(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    urls = (value,) if isinstance(value, str) else value
    seen: set[str] = set()
    for i, url in enumerate(urls):
        where = attribute.name if isinstance(value, str) else f"{attribute.name}[{i}]"
        problem = http_url_problem(url)
        if problem is not None:
            raise ValueError(f"{where}: {url!r} {problem}")
        if url.rstrip("/") in seen:
            raise ValueError(f"{where}: {url!r} is listed twice")
        seen.add(url.rstrip("/"))


def _http_url_or_empty(obj: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value:
        _http_urls(obj, attribute, value)


@attrs.frozen(kw_only=True)
class WeightsSettings:
    """Where the control plane resolves models from Hugging Face, and where
    nodes fetch them from (``docs/models-from-hf.md``).

    Attributes:
        hf_endpoint: the hub (``https://huggingface.co`` when empty; the
            ``HF_ENDPOINT`` variable of the control plane when set).
        token_file: a file on the control planes holding a Hugging Face
            token, for gated repositories ("" = none; ``HF_TOKEN`` is not read).
    """

    hf_endpoint: str = attrs.field(default="", validator=_http_url_or_empty)
    token_file: str = ""


def _external_url(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if value and not re.match(r"^https?://[^/\s?#]+(/[^\s?#]*)?$", value):
        raise ValueError(
            f"{attribute.name}: {value!r} is not an http:// or https:// address like "
            "https://llm.example.com"
        )


@attrs.frozen(kw_only=True)
class PortalSettings:
    """``portal``: the web pages on the client port (``docs/portal.md``).

    Attributes:
        enabled: serve the portal on the client port (the admin listener's
            ``/admin`` pages stay either way).
        external_url: the gateway's address as people reach it, for the
            "Connect your editor" page; ``""`` = the address the browser used.
    """

    enabled: bool = True
    external_url: str = attrs.field(default="", validator=_external_url)


#: The shortest leader lease accepted, in seconds: a third of it is the
#: renewal interval, and the leader stops half a second before expiry.
MIN_LEASE_TTL_S: Final = 2.0


def _lease_ttl(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= MIN_LEASE_TTL_S:  # also refuses NaN
        raise ValueError(f"{attribute.name} must be at least {MIN_LEASE_TTL_S:g} s")


@attrs.frozen(kw_only=True)
class HaSettings:
    """``ha``: the leader lease (``docs/ha.md``). ``lease_ttl_s`` (seconds,
    at least :data:`MIN_LEASE_TTL_S`) is how long a taken or renewed lease
    holds; it is renewed every third of that. Read at start (``llmgw
    server --lease-ttl`` wins); a change takes effect at the next start."""

    lease_ttl_s: float = attrs.field(default=10.0, converter=parse_duration_s, validator=_lease_ttl)


@attrs.frozen(kw_only=True)
class ServerSettings:
    """The whole settings document: ``server.yaml`` seeds it, the store
    keeps it live (``llmgw ctl config``)."""

    auth: AuthSettings = attrs.field(factory=AuthSettings)
    serving: ServingSettings = attrs.field(factory=ServingSettings)
    on_demand: OnDemandSettings = attrs.field(factory=OnDemandSettings)
    router: RouterSettings = attrs.field(factory=RouterSettings)
    nodes: NodesSettings = attrs.field(factory=NodesSettings)
    guard: GuardSettings = attrs.field(factory=GuardSettings)
    #: Model mirrors (``llmgw mirror serve``), the first that answers is used
    #: before ``weights.hf_endpoint`` (``docs/models-from-hf.md``).
    mirrors: tuple[str, ...] = attrs.field(default=(), validator=_http_urls)
    weights: WeightsSettings = attrs.field(factory=WeightsSettings)
    portal: PortalSettings = attrs.field(factory=PortalSettings)
    ha: HaSettings = attrs.field(factory=HaSettings)


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict_number(int))
    # Every float in the settings is a duration: a number or "45s", "90d".
    converter.register_structure_hook_func(
        lambda t: t in (float, float | None, Optional[float]),  # noqa: UP045
        lambda value, _: None if value is None else parse_duration_s(value),
    )
    converter.register_structure_hook(float, lambda value, _: parse_duration_s(value))
    converter.register_structure_hook(bool, _strict_bool)
    # An empty YAML value (``key:`` or ``ctl config set key ''``) is "" for text.
    converter.register_structure_hook(str, _text)
    # A list of texts must be a list: a bare "Violent" is not ["V", "i", …].
    converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _texts)
    judge_hook = converter.get_structure_hook(GuardJudge)
    converter.register_structure_hook(
        GuardJudge,
        lambda value, kind: judge_hook(
            {_judge_key(key): v for key, v in value.items()} if isinstance(value, dict) else value,
            kind,
        ),
    )
    return converter


def _judge_key(key: Any) -> Any:
    """A judge's key as written: YAML 1.1 reads an unquoted ``on:`` as true
    (sent on as JSON, "true"), which can only mean the judge's ``on``."""
    return "on" if key is True or key == "true" else key


def _text(value: Any, _: Any) -> str:
    """Text: a YAML number is read as its digits, an empty value as ""; a
    list, a mapping or true/false is refused."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise TypeError(f"expected text, got {value!r}")
    return str(value)


def _texts(value: Any, _: Any) -> tuple[str, ...]:
    """A list of texts (numbers read as their digits); a single text, a
    mapping or a number instead of the list is refused, as is an item that
    is a list, a mapping, true/false or empty."""
    if not isinstance(value, list | tuple):
        raise TypeError(f"expected a list of texts, like [{value!r}], got {value!r}")
    for at, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise TypeError(f"item {at}: expected text, got {item!r}")
    return tuple(str(item) for item in value)


def _say_error(exc: BaseException, kind: type | None) -> str:
    if isinstance(exc, KeyError):
        return "required field missing"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        # cattrs' own text sorts the keys and fails on one that is not text (a YAML number).
        unknown = ", ".join(sorted(str(key) for key in exc.extra_fields))
        return f"Extra fields in constructor for {exc.cl.__name__}: {unknown}"
    text = str(exc)
    if (isinstance(exc, AttributeError) and "attribute 'keys'" in text) or (
        isinstance(exc, TypeError) and "'NoneType' is not iterable" in text
    ):
        # cattrs asked a text, a list or an empty value for a block's keys.
        return "expected a block of settings (a mapping)"
    return text or cattrs.v.format_exception(exc, kind)


def _strict_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _strict_number(kind: type[Any]) -> Any:
    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"expected a number, got {value!r}")
        if kind is int and not isinstance(value, int):
            raise TypeError(f"expected a whole number, got {value!r}")
        return kind(value)

    return structure


_converter = _make_converter()


def load_settings(path: Path | None) -> ServerSettings:
    """The settings in ``path``, or the defaults when ``path`` is None.

    Raises:
        SettingsError: unreadable YAML (or not UTF-8), an unknown key or a bad value, with
            the key's path (``auth.pricing.gemma.prompt_per_1k: …``).
    """
    if path is None:
        return ServerSettings()
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text: {exc}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"{path}: {exc}") from exc
    if not isinstance(doc, dict):
        raise SettingsError(f"{path}: the file must be a mapping of blocks, like 'auth: {{…}}'")
    try:
        return settings_from_doc(doc)
    except SettingsError as exc:
        raise SettingsError(f"{path}: {exc}") from None


def settings_from_doc(doc: Mapping[str, Any]) -> ServerSettings:
    """Settings from a document of plain types (YAML or the store's JSON).

    Raises:
        SettingsError: an unknown key or a bad value, with the key's path.
    """
    for key, value in doc.items():
        if key == "mirrors":  # the one top-level list (model mirrors' URLs)
            if not isinstance(value, list | tuple):
                raise SettingsError("mirrors: must be a list of URLs, like ['http://host:8090']")
            continue
        if not (isinstance(value, dict) or value is None):
            raise SettingsError(f"{key!r} must be a block of settings (a mapping)")
    try:
        return _converter.structure(dict(doc), ServerSettings)
    except cattrs.BaseValidationError as exc:
        said = cattrs.transform_error(exc, path="", format_exception=_say_error)
        raise SettingsError("; ".join(_with_where(one) for one in said)) from exc
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc)) from exc


def _with_where(said: str) -> str:
    # cattrs ends each message with " @ PATH"; PATH is "" for a top-level key.
    text, _, where = said.rpartition(" @ ")
    if not text:
        return said
    return f"{text} at {where}" if where else text


_unstructurer = cattrs.Converter()


def settings_to_doc(settings: ServerSettings) -> dict[str, Any]:
    """``settings`` as plain JSON types, every key present (durations in
    seconds, tuples as lists); :func:`settings_from_doc` reads it back equal."""
    doc: dict[str, Any] = _unstructurer.unstructure(settings)
    return doc


def check_key_path(key: str) -> None:
    """Check that the dotted ``key`` names a setting (``router.admission.bands``,
    ``auth.pricing.gemma-3-270m``, ``on_demand``).

    Blocks may be named whole; inside a mapping of names (``auth.pricing``)
    any name is accepted. A path cannot go into a list (``router.admission.bands.0``).

    Raises:
        SettingsError: an empty part, an unknown name (the message lists the
            names the block has), or a path below a single value.
    """
    parts = key.split(".")
    if not key or any(not part for part in parts):
        raise SettingsError(f"{key!r} is not a dotted key like router.admission.bands")
    kind: Any = ServerSettings
    for at, part in enumerate(parts):
        above = ".".join(parts[:at]) or "the top level"
        if isinstance(kind, type) and attrs.has(kind):
            hints = typing.get_type_hints(kind)
            if part not in hints:
                raise SettingsError(
                    f"{'.'.join(parts[: at + 1])}: no such setting; {above} has "
                    f"{', '.join(sorted(hints))}"
                )
            kind = hints[part]
        elif typing.get_origin(kind) in (Mapping, dict):
            kind = typing.get_args(kind)[1]
        else:
            what = (
                "a list: set it whole"
                if typing.get_origin(kind) in (tuple, list)
                else "a single value"
            )
            raise SettingsError(f"{'.'.join(parts[: at + 1])}: no such setting; {above} is {what}")


def check_doc_keys(doc: Mapping[str, Any]) -> None:
    """Refuse a key the settings do not have anywhere in ``doc``, naming its
    whole path and what its block has (``serving.paused: no such setting;
    serving has stopped``). Values are left to :func:`settings_from_doc`.

    Raises:
        SettingsError: the first unknown key found.
    """
    _check_keys(doc, ServerSettings, "")


def _check_keys(value: Any, kind: Any, path: str) -> None:
    if isinstance(kind, type) and attrs.has(kind):
        if not isinstance(value, Mapping):
            return
        hints = typing.get_type_hints(kind)
        for name, below in value.items():
            if kind is GuardJudge:
                name = _judge_key(name)
            here = f"{path}{name}"
            if name not in hints:
                block = path.rstrip(".") or "the top level"
                raise SettingsError(
                    f"{here}: no such setting; {block} has {', '.join(sorted(hints))}"
                )
            _check_keys(below, hints[name], f"{here}.")
    elif typing.get_origin(kind) in (Mapping, dict) and isinstance(value, Mapping):
        inner = typing.get_args(kind)[1]
        for name, below in value.items():
            _check_keys(below, inner, f"{path}{name}.")
    elif typing.get_origin(kind) is tuple and isinstance(value, list | tuple):
        inner = typing.get_args(kind)[0]
        for at, below in enumerate(value):
            _check_keys(below, inner, f"{path.rstrip('.')}[{at}].")


def with_key(doc: Mapping[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of ``doc`` with the dotted ``key`` set to ``value`` (blocks on
    the way made when missing). Not validated: pass the result through
    :func:`settings_from_doc`.

    Raises:
        SettingsError: ``key`` names no setting (:func:`check_key_path`).
    """
    check_key_path(key)
    out = copy.deepcopy(dict(doc))
    parts = key.split(".")
    here = out
    for part in parts[:-1]:
        below = here.get(part)
        if not isinstance(below, dict):
            below = {}
            here[part] = below
        here = below
    here[parts[-1]] = value
    return out


def changed_keys(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The dotted keys whose values differ between two documents, sorted
    (lists compare whole)."""

    def flatten(doc: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> dict[str, Any]:
        for name, value in doc.items():
            if isinstance(value, Mapping):
                flatten(value, f"{prefix}{name}.", out)
            else:
                out[f"{prefix}{name}"] = value
        return out

    old, new = flatten(before, "", {}), flatten(after, "", {})
    return sorted(
        k for k in old.keys() | new.keys() if old.get(k, _MISSING) != new.get(k, _MISSING)
    )


_MISSING: Final = object()

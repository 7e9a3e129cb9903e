"""Policies combined along a key's path, compiled once.

A request gets ``guard.default`` plus every policy attached to its org,
team, project and key (``guard.attach``), in that order, each name once.
Combined, each rule takes the strictest action any of them gives (``off`` <
``flag`` < ``mask`` < ``redact`` < ``block``), ``deny`` patterns add up,
``max_chars`` is the smallest set, ``restore`` and ``no_store`` hold when any
asks. The result (:class:`Guard`) is cached per settings and list of names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Final

import attrs
import trio

from llmgw.settings import GUARD_ACTIONS, GuardJudge, GuardPolicy, GuardRules, GuardSettings

from .matcher import Matcher, Rule
from .patterns import INJECTION, SECRETS, Kind, pii_kinds

__all__ = ["Direction", "Guard", "Guards", "policy_names"]

_STRENGTH: Final = {action: at for at, action in enumerate(GUARD_ACTIONS)}


def _stricter(a: str, b: str) -> str:
    return a if _STRENGTH[a] >= _STRENGTH[b] else b


def policy_names(
    guard: GuardSettings,
    key_id: str,
    scope_ids: tuple[str, str, str],
    scope_names: tuple[str, str, str] = ("", "", ""),
) -> tuple[str, ...]:
    """The policies a request gets: the defaults, then those attached to its
    org, team, project and key (by id, or by name: ``org:Acme``,
    ``team:Acme/ml``, ``project:Acme/ml/train``), each once."""
    if not guard.enabled:
        return ()
    names = list(guard.default)
    if guard.attach:
        levels = ("project", "team", "org")
        places = [
            f"{level}:{ident}"
            for at in (2, 1, 0)
            for ident in (scope_ids[at], scope_names[at])
            if ident
            for level in (levels[at],)
        ]
        places.append(f"key:{key_id}")
        for where in places:
            for name in guard.attach.get(where, ()):
                if name not in names:
                    names.append(name)
    return tuple(names)


@attrs.frozen
class Direction:
    """One direction's combined rules, compiled.

    Attributes:
        matcher: every pattern rule that acts, in one database.
        max_chars: the most characters of text, 0 = unlimited.
        restore: put redacted values back into the answer (input only).
    """

    matcher: Matcher
    max_chars: int = 0
    restore: bool = False

    @property
    def active(self) -> bool:
        """Whether anything is checked in this direction."""
        return bool(self.matcher.rules) or self.max_chars > 0


def _combine(rules: Sequence[tuple[str, GuardRules]], *, input: bool) -> Direction:
    pii: dict[str, str] = {}
    secrets = injection = "off"
    deny: list[Kind] = []
    max_chars = 0
    restore = False
    for name, each in rules:
        for kind, action in each.pii.items():
            pii[kind] = _stricter(pii.get(kind, "off"), action)
        secrets = _stricter(secrets, each.secrets)
        if input:
            injection = _stricter(injection, each.injection)
        for at, pattern in enumerate(each.deny):
            deny.append(Kind(f"deny:{name}:{at}", "DENIED", pattern.encode()))
        if each.max_chars and (not max_chars or each.max_chars < max_chars):
            max_chars = each.max_chars
        restore = restore or (input and each.restore)
    chosen: list[Rule] = []
    if secrets != "off":
        chosen += [Rule(kind, secrets) for kind in SECRETS]
    chosen += [
        Rule(each, action)
        for kind, action in pii.items()
        if action != "off"
        for each in pii_kinds(kind)
    ]
    if injection != "off":
        chosen += [Rule(kind, injection) for kind in INJECTION]
    chosen += [Rule(kind, "block") for kind in deny]
    return Direction(matcher=Matcher(chosen), max_chars=max_chars, restore=restore)


@attrs.frozen
class Guard:
    """A request's combined policies.

    Attributes:
        names: the policies, in the order applied.
        input, output: each direction's rules.
        no_store: keep the request out of the answer cache.
        judge: the first judge the policies name (None: no judge).
        buffer_all: a streamed answer is judged whole before any of it is
            sent (``stream: {buffer_all: true}`` in any policy).
    """

    names: tuple[str, ...]
    input: Direction
    output: Direction
    no_store: bool = False
    judge: GuardJudge | None = None
    buffer_all: bool = False

    @property
    def active(self) -> bool:
        """Whether anything is checked either way."""
        return self.input.active or self.output.active or self.judge is not None

    @property
    def judges_input(self) -> bool:
        """Whether prompts go to the judge."""
        return self.judge is not None and self.judge.on in ("input", "both")

    @property
    def judges_output(self) -> bool:
        """Whether answers go to the judge."""
        return self.judge is not None and self.judge.on in ("output", "both")

    @property
    def cacheable(self) -> bool:
        """Whether the answer may go to, or come from, the answer cache."""
        return not (self.no_store or self.input.restore)


def build_guard(names: tuple[str, ...], policies: Sequence[GuardPolicy]) -> Guard:
    """The :class:`Guard` of ``policies`` (called ``names``), combined."""
    return Guard(
        names=names,
        input=_combine(
            [(name, p.input) for name, p in zip(names, policies, strict=True)], input=True
        ),
        output=_combine(
            [(name, p.output) for name, p in zip(names, policies, strict=True)], input=False
        ),
        no_store=any(p.no_store for p in policies),
        judge=next((p.judge for p in policies if p.judge.model), None),
        buffer_all=any(p.stream.buffer_all for p in policies),
    )


class Guards:
    """Compiled guards by list of policy names, for one ``guard`` settings
    block; a changed block (a live settings change) starts a fresh cache.
    Every :class:`Guards` of the process that sees the same block shares
    its guards (each compiled once)."""

    def __init__(self) -> None:
        self._settings: GuardSettings | None = None
        self._built: dict[tuple[str, ...], Guard] = {}
        self._building: dict[tuple[str, ...], trio.Event] = {}

    def for_request(
        self,
        guard: GuardSettings,
        key_id: str,
        scope_ids: tuple[str, str, str],
        scope_names: tuple[str, str, str] = ("", "", ""),
    ) -> Guard | None:
        """The guard of a request by that key at that place in the tree, or
        None when no policy checks anything."""
        if guard is not self._settings:
            self._settings = guard
            self._built = _shared_builds(guard)
        names = policy_names(guard, key_id, scope_ids, scope_names)
        if not names:
            return None
        built = self._built.get(names)
        if built is None:
            built = build_guard(names, [guard.policy(name) for name in names])
            self._keep(names, built)
        return built if built.active else None

    def _keep(self, names: tuple[str, ...], built: Guard) -> None:
        if len(self._built) > 10_000:
            self._built.clear()
        self._built[names] = built

    async def for_request_async(
        self,
        guard: GuardSettings,
        key_id: str,
        scope_ids: tuple[str, str, str],
        scope_names: tuple[str, str, str] = ("", "", ""),
    ) -> Guard | None:
        """:meth:`for_request`, a guard not built yet compiled in a worker
        thread (reading person names' lists and compiling hyperscan
        databases take up to seconds: the event loop goes on serving other
        requests meanwhile); requests needing the same one wait for it."""
        while True:
            if guard is not self._settings:
                self._settings = guard
                self._built = _shared_builds(guard)
            names = policy_names(guard, key_id, scope_ids, scope_names)
            if not names:
                return None
            built = self._built.get(names)
            if built is not None:
                return built if built.active else None
            pending = self._building.get(names)
            if pending is not None:
                await pending.wait()
                continue
            pending = self._building[names] = trio.Event()
            try:
                built = await trio.to_thread.run_sync(
                    build_guard, names, [guard.policy(name) for name in names]
                )
            finally:
                del self._building[names]
                pending.set()
            if guard is self._settings:
                self._keep(names, built)
            return built if built.active else None


class _Shared:
    """The guards built in this process for the last ``guard`` settings
    block any :class:`Guards` saw."""

    settings: ClassVar[GuardSettings | None] = None
    built: ClassVar[dict[tuple[str, ...], Guard]] = {}


def _shared_builds(guard: GuardSettings) -> dict[tuple[str, ...], Guard]:
    """The guards built for the block ``guard`` (the same object), shared."""
    if guard is not _Shared.settings:
        _Shared.settings = guard
        _Shared.built = {}
    return _Shared.built

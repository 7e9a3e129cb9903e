"""The one-pass matcher: every pattern of a set of rules compiled into one
hyperscan database, run once over a text (``docs/guardrails.md``).

Hyperscan reports every end of every match; with ``SOM_LEFTMOST`` each
report also carries the leftmost start. For each (pattern, start) the
longest end that passes the kind's check wins; overlapping hits go to the
longer one (ties to the earlier rule).
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Sequence
from typing import Any, Final

import attrs
import hyperscan

from .patterns import Kind

__all__ = ["Hit", "Matcher", "Rule", "min_match_bytes"]

_BASE_FLAGS: Final = hyperscan.HS_FLAG_SOM_LEFTMOST
#: Python's own regular expression parser (``re._parser``), for the
#: shortest match of a built-in kind's pattern.
_RE_PARSER: Final[Any] = importlib.import_module("re._parser")


def min_match_bytes(kind: Kind) -> int:
    """The fewest bytes a match of ``kind`` can have; 0 when not known.

    Only the built-in kinds (``llmgw/guard/patterns.py``, written in the
    syntax Python's ``re`` and hyperscan read alike) are measured; a
    policy's own ``deny`` pattern (hyperscan's syntax, e.g. POSIX classes
    Python reads otherwise) counts as possibly empty."""
    if kind.rule.startswith("deny:"):
        return 0
    try:
        low, _ = _RE_PARSER.parse(kind.pattern).getwidth()
    except (re.error, OverflowError, RecursionError):  # Python cannot read it: not known
        return 0
    return int(low)


@attrs.frozen
class Rule:
    """A kind with the action a policy gives it (``flag``, ``mask``, ``redact``, ``block``)."""

    kind: Kind
    action: str


@attrs.frozen
class Hit:
    """A rule's match over ``data[start:end]``."""

    rule: Rule
    start: int
    end: int


def compile_database(patterns: Sequence[bytes], flags: Sequence[int]) -> hyperscan.Database:
    """A block-mode hyperscan database of ``patterns`` (ids = their index).

    Raises:
        hyperscan.error: a pattern hyperscan cannot compile.
    """
    database = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    database.compile(
        expressions=list(patterns),
        ids=list(range(len(patterns))),
        elements=len(patterns),
        flags=list(flags),
    )
    return database


def _collect(ident: int, start: int, end: int, _flags: int, found: object) -> None:
    """Hyperscan's match callback: each report into ``found`` (the scan's
    context, a ``list[tuple[int, int, int]]``)."""
    found.append((ident, start, end))  # type: ignore[attr-defined]


class Matcher:
    """``rules`` in one database; :meth:`scan` finds their hits in one pass."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        self._database = (
            compile_database(
                [rule.kind.pattern for rule in self.rules],
                [
                    _BASE_FLAGS | (hyperscan.HS_FLAG_CASELESS if rule.kind.caseless else 0)
                    for rule in self.rules
                ],
            )
            if self.rules
            else None
        )
        self._scratch = hyperscan.Scratch(self._database) if self._database is not None else None
        #: No rule matches text shorter than this many bytes (so it need
        #: not be scanned): the least of :func:`min_match_bytes`; 0 with no rules.
        self.min_bytes = min((min_match_bytes(rule.kind) for rule in self.rules), default=0)

    @functools.cached_property
    def acts(self) -> bool:
        """Some rule changes or stops text (its action is not ``flag``)."""
        return any(rule.action != "flag" for rule in self.rules)

    @functools.cached_property
    def denies(self) -> bool:
        """Some rule is a policy's own ``deny`` pattern (which may span words)."""
        return any(rule.kind.rule.startswith("deny:") for rule in self.rules)

    @functools.cached_property
    def acts_on_names(self) -> bool:
        """Person names are redacted or blocked (a name may go on with a surname)."""
        return any(rule.kind.rule == "pii:person" and rule.action != "flag" for rule in self.rules)

    def scan(self, data: bytes) -> list[Hit]:
        """The hits in ``data``, in order, none overlapping."""
        if self._database is None or not data:
            return []
        found: list[tuple[int, int, int]] = []
        # Positional arguments: hyperscan's keyword parsing costs more than
        # a short scan itself.
        self._database.scan(data, _collect, 0, found, self._scratch)
        if not found:
            return []
        ends: dict[tuple[int, int], list[int]] = {}
        for ident, start, end in found:
            known = ends.get((ident, start))
            if known is None:
                ends[(ident, start)] = [end]
            else:
                known.append(end)
        candidates: list[tuple[int, int, int, int]] = []
        rules = self.rules
        for (ident, start), stops in ends.items():
            check = rules[ident].kind.check
            if check is None:
                end = max(stops)
                candidates.append((start, start - end, ident, end))
                continue
            for end in sorted(stops, reverse=True):
                if check(data, start, end):
                    candidates.append((start, start - end, ident, end))
                    break
        candidates.sort()
        hits: list[Hit] = []
        reach = 0
        for start, _, ident, end in candidates:
            if start >= reach:
                hits.append(Hit(rules[ident], start, end))
                reach = end
        return hits

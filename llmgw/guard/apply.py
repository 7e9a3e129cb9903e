"""Applying a direction's rules to text: the verdict, redaction with stable
placeholders, card masking, refusal.

One :class:`Verdict` and one :class:`Redactor` live for one request: the same
value gets the same placeholder in every message of it, and the mapping
(kept only for ``restore``) never leaves the request's memory.
"""

from __future__ import annotations

import time
from typing import Any, Final

from llmgw.errors import Refused

from .matcher import Hit
from .policy import Direction

__all__ = [
    "ContentFiltered",
    "Redactor",
    "Verdict",
    "guard_chat_doc",
    "guard_text",
]

_STRENGTH: Final = {"off": 0, "flag": 1, "mask": 2, "redact": 3, "block": 4}


class ContentFiltered(Refused):
    """A request refused by a guard policy: 400 ``content_filter``, the
    rule ids named (never the matched text)."""

    status = 400
    code = "content_filter"
    type = "invalid_request_error"

    def __init__(self, direction: str, rules: list[str]) -> None:
        super().__init__(
            f"The {direction} was refused by the gateway's content policy ({', '.join(rules)})."
        )
        self.rules = rules


class Verdict:
    """What the guard found in one request, both directions.

    Attributes:
        rules: the rule ids that matched, each once, in order.
        actions: each rule id → the strictest action it took.
        action: the strictest action taken (``""`` when nothing matched).
        seconds: time spent guarding.
        stopped: the answer was cut (``content_filter``).
        events: ``(direction, rule id)`` → the strictest action it took
            there, direction ``input`` or ``output`` (the guard events).
    """

    __slots__ = ("action", "actions", "events", "rules", "seconds", "stopped")

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.actions: dict[str, str] = {}
        self.action = ""
        self.seconds = 0.0
        self.stopped = False
        self.events: dict[tuple[str, str], str] = {}

    def note(self, rule: str, action: str, direction: str = "input") -> None:
        """Record that ``rule`` matched in ``direction`` (``input`` or
        ``output``) and ``action`` was taken."""
        place = (direction, rule)
        there = self.events.get(place)
        if there is None or _STRENGTH[action] > _STRENGTH[there]:
            self.events[place] = action
        known = self.actions.get(rule)
        if known is None:
            self.rules.append(rule)
            self.actions[rule] = action
        elif _STRENGTH[action] > _STRENGTH[known]:
            self.actions[rule] = action
        if _STRENGTH[action] > _STRENGTH.get(self.action, 0):
            self.action = action


class Redactor:
    """Placeholders for one request: the same value → the same ``[KIND_n]``."""

    __slots__ = ("_count", "_placeholders", "values")

    def __init__(self) -> None:
        self._placeholders: dict[bytes, bytes] = {}
        self._count: dict[str, int] = {}
        #: placeholder → value, for restore.
        self.values: dict[str, str] = {}

    def placeholder(self, label: str, value: bytes) -> bytes:
        """The placeholder for ``value`` of kind ``label``."""
        found = self._placeholders.get(value)
        if found is None:
            n = self._count.get(label, 0) + 1
            self._count[label] = n
            found = f"[{label}_{n}]".encode()
            self._placeholders[value] = found
            self.values[found.decode()] = value.decode("utf-8", "replace")
        return found


def mask_card(value: bytes) -> bytes:
    """All the digits of a card number starred but the last four, separators kept."""
    digits = sum(1 for c in value if 48 <= c <= 57)
    out = bytearray()
    seen = 0
    for c in value:
        if 48 <= c <= 57:
            seen += 1
            out.append(c if seen > digits - 4 else 42)
        else:
            out.append(c)
    return bytes(out)


def apply_hits(
    data: bytes, hits: list[Hit], verdict: Verdict, redactor: Redactor, *, what: str
) -> bytes:
    """``data`` with the hits' actions applied.

    Raises:
        ContentFiltered: a hit's action is ``block``.
    """
    blocked = [hit.rule.kind.rule for hit in hits if hit.rule.action == "block"]
    direction = "output" if what == "answer" else "input"
    for hit in hits:
        verdict.note(hit.rule.kind.rule, hit.rule.action, direction)
    if blocked:
        raise ContentFiltered(what, list(dict.fromkeys(blocked)))
    if not any(hit.rule.action in ("mask", "redact") for hit in hits):
        return data
    out = bytearray()
    at = 0
    for hit in hits:
        if hit.rule.action not in ("mask", "redact"):
            continue
        out += data[at : hit.start]
        value = data[hit.start : hit.end]
        if hit.rule.action == "mask":
            out += mask_card(value)
        else:
            out += redactor.placeholder(hit.rule.kind.label, value)
        at = hit.end
    out += data[at:]
    return bytes(out)


def guard_text(
    text: str, rules: Direction, verdict: Verdict, redactor: Redactor, *, what: str
) -> str:
    """``text`` through ``rules``: masked and redacted as they say.

    Raises:
        ContentFiltered: a rule that blocks matched, or the text is longer
            than ``max_chars``.
    """
    if rules.max_chars and len(text) > rules.max_chars:
        verdict.note("max_chars", "block")
        raise ContentFiltered(what, ["max_chars"])
    data = text.encode("utf-8", "surrogatepass")
    hits = rules.matcher.scan(data)
    if not hits:
        return text
    out = apply_hits(data, hits, verdict, redactor, what=what)
    return text if out is data else out.decode("utf-8", "surrogatepass")


def guard_chat_doc(
    doc: dict[str, Any], rules: Direction, verdict: Verdict, redactor: Redactor
) -> bool:
    """Guard every text of a chat, completions or embeddings body in place
    (messages' contents and text parts, their tool calls' arguments,
    ``prompt``, ``input``); ``max_chars`` counts them all together.

    Returns:
        Whether anything was changed.

    Raises:
        ContentFiltered: as :func:`guard_text`.
    """
    started = time.perf_counter()
    changed = False
    total = 0

    def one(text: str) -> str:
        nonlocal changed, total
        total += len(text)
        if rules.max_chars and total > rules.max_chars:
            verdict.note("max_chars", "block")
            raise ContentFiltered("prompt", ["max_chars"])
        out = guard_text(text, rules, verdict, redactor, what="prompt")
        if out is not text:
            changed = True
        return out

    try:
        messages = doc.get("messages")
        if isinstance(messages, list):
            for message in messages:
                if not isinstance(message, dict):
                    continue
                content = message.get("content")
                if isinstance(content, str):
                    message["content"] = one(content)
                elif isinstance(content, list):
                    for part in content:
                        if isinstance(part, dict) and isinstance(part.get("text"), str):
                            part["text"] = one(part["text"])
                # Tool calls' arguments (a JSON text) are read by tools and models too.
                calls = message.get("tool_calls")
                for call in calls if isinstance(calls, list) else ():
                    function = call.get("function") if isinstance(call, dict) else None
                    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                        function["arguments"] = one(function["arguments"])
        for field in ("prompt", "input"):
            value = doc.get(field)
            if isinstance(value, str):
                doc[field] = one(value)
            elif isinstance(value, list):
                doc[field] = [one(v) if isinstance(v, str) else v for v in value]
    finally:
        verdict.seconds += time.perf_counter() - started
    return changed

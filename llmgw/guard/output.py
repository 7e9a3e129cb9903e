"""The output rules over an answer: whole, or as it streams.

A stream's text is guarded per choice through a sliding window: the last
:data:`HOLD_BYTES` bytes are held back until more text (or the end) comes,
so a value split over two events is still seen whole; a match that reaches
into the held part holds back from its start. With ``restore`` the
placeholders of the request's prompt are put back first (a placeholder cut
by a chunk boundary is held until complete), so the output rules see what
the client will see. A rule that blocks stops the choice: what came before
the match is sent, then ``finish_reason: content_filter``.
"""

from __future__ import annotations

import re
import time
from typing import Final

from .apply import ContentFiltered, Redactor, Verdict, apply_hits
from .policy import Direction

__all__ = ["FLAG_SCAN_BYTES", "HOLD_BYTES", "OutputGuard"]

#: The most bytes held back at the end of a stream's text when a rule may
#: change or stop it: longer than the shortest text each built-in kind is
#: recognised by (a token's prefix, a key block's header), so a value split
#: over chunks is caught whole. With the built-in kinds only the unfinished
#: last word is held, and the words before it that may continue a value of
#: several words (card or phone groups); with ``deny`` patterns, which may
#: span words, the whole window. Rules that only flag hold nothing back:
#: they scan the last :data:`HOLD_BYTES` sent with the new text, in
#: batches (:data:`FLAG_SCAN_BYTES`).
HOLD_BYTES: Final = 96
#: Rules that only flag scan a stream's text once this many bytes of it
#: have come (and at its end), not once per event.
FLAG_SCAN_BYTES: Final = 1024
#: The bytes of a word that may be part of a value of several words (card,
#: phone and IBAN groups, a private key block's header): its tail that may
#: go on starts with one of :data:`_FIRST` and goes on with :data:`_NEXT`.
_FIRST: Final = rb"A-Z0-9+().\-"
_NEXT: Final = _FIRST
#: With person names redacted or blocked: also a capitalised word (a name
#: may go on with a surname: ``Maria`` before `` Lopez`` comes).
_NEXT_NAMES: Final = rb"A-Za-z0-9+().'\-\x80-\xff"
_SPACE: Final = b" \t\r\n"
_PLACEHOLDER: Final = re.compile(r"\[[A-Z][A-Z_]*_\d+\]")
_OPEN_PLACEHOLDER: Final = re.compile(r"\[[A-Z_0-9]{0,40}\Z")


def _held_tail(first: bytes, following: bytes) -> re.Pattern[bytes]:
    """What :func:`_word_release` holds back, matched at the start of the
    text reversed: the unfinished last word, then each whole word before it
    (spaces or tabs between) that may go on a value (its first byte in
    ``first``, the rest in ``following``), then at most the tail of one
    more word that may go on, unless that tail is glued to a letter or
    digit. Possessive and atomic, so no shorter tail is tried (with
    ``first`` the same as ``following``: the whole run, possessive, which
    Python's ``re`` matches about a quarter faster)."""
    if first == following:
        tail = rb"[" + first + rb"]++"
    else:
        tail = rb"(?>[" + following + rb"]*[" + first + rb"])"
    return re.compile(
        rb"[^ \t\r\n]*+"
        rb"(?:[ \t]*+" + tail + rb"(?=[ \t\r\n]|\Z))*+"
        rb"(?:[ \t]*+" + tail + rb"(?=[^ \t\r\nA-Za-z0-9]))?"
    )


_CONTINUABLE: Final = _held_tail(_FIRST, _NEXT)
_CONTINUABLE_NAMES: Final = _held_tail(_FIRST, _NEXT_NAMES)


def _word_release(held: bytes, continuable: re.Pattern[bytes] = _CONTINUABLE) -> int:
    """How much of ``held`` may be sent now when the rules are the built-in
    kinds: everything but an unfinished last word and the words before it
    that may continue a value of several words (digits, capitals,
    separators), never holding more than :data:`HOLD_BYTES`. A word glued
    to punctuation (``{"to":"4111``, JSON arguments) holds back from where
    its continuable tail starts. One match over the text reversed
    (``continuable``: :data:`_CONTINUABLE` or :data:`_CONTINUABLE_NAMES`)."""
    size = len(held)
    match = continuable.match(held[::-1])
    hold = match.end() if match is not None else 0
    return size - (hold if hold < HOLD_BYTES else HOLD_BYTES) if size else 0


class _Choice:
    __slots__ = ("held", "pending", "queued", "queued_bytes", "sent_chars", "stopped")

    def __init__(self) -> None:
        self.pending = ""  # text not yet restored (a placeholder may be cut)
        self.held = b""  # restored text not yet released (flags only: the scanned tail)
        self.queued: list[bytes] = []  # flags only: text sent, not yet scanned
        self.queued_bytes = 0
        self.sent_chars = 0
        self.stopped = False


class OutputGuard:
    """One request's output rules and their state.

    Args:
        rules: the output direction of the request's guard.
        verdict: where what is found is recorded.
        redactor: the request's placeholders.
        restore: put the prompt's redacted values back into the answer.
    """

    def __init__(
        self, rules: Direction, verdict: Verdict, redactor: Redactor, *, restore: bool
    ) -> None:
        self._rules = rules
        self._verdict = verdict
        self._redactor = redactor
        self._restore = restore and bool(redactor.values)
        self._checks = rules.active
        matcher = rules.matcher
        #: Some rule may change or stop the text (else: flags only, nothing held).
        self._acts = rules.max_chars > 0 or matcher.acts
        #: No deny pattern (which may span words): hold back by words.
        self._word_hold = not matcher.denies
        #: Text shorter than this cannot hold a match: not scanned.
        self._min_bytes = matcher.min_bytes
        self._choices: dict[int, _Choice] = {}
        self._continuable = _CONTINUABLE_NAMES if matcher.acts_on_names else _CONTINUABLE
        #: :meth:`feed_plain` may take its short way: rules that change or
        #: stop text, held back by words, no ``max_chars``.
        self._quick = self._checks and self._acts and self._word_hold and not rules.max_chars

    @property
    def active(self) -> bool:
        """Whether an answer's text can change or be stopped."""
        return self._checks or self._restore

    @property
    def changes_text(self) -> bool:
        """Whether some rule may change or stop the text, or restore puts
        values back (else: flags only, the text goes on as it came)."""
        return self._restore or (self._checks and self._acts)

    def stopped(self, index: int) -> bool:
        """Whether choice ``index`` was stopped by a rule."""
        choice = self._choices.get(index)
        return choice is not None and choice.stopped

    def _restored(self, text: str) -> str:
        values = self._redactor.values
        return _PLACEHOLDER.sub(lambda m: values.get(m.group(0), m.group(0)), text)

    def feed(self, index: int, text: str) -> tuple[str, bool]:
        """Take a piece of choice ``index``'s text; return what may be sent
        now, and whether the choice is stopped (``content_filter``) now."""
        started = time.perf_counter()
        try:
            return self._feed(index, text, end=False)
        finally:
            self._verdict.seconds += time.perf_counter() - started

    def close(self, index: int) -> tuple[str, bool]:
        """The end of choice ``index``: everything held, guarded whole."""
        started = time.perf_counter()
        try:
            return self._feed(index, "", end=True)
        finally:
            self._verdict.seconds += time.perf_counter() - started

    def whole(self, text: str) -> tuple[str, bool]:
        """A whole answer's text: what to send, and whether it was stopped
        (then cut before the first match of a rule that blocks)."""
        started = time.perf_counter()
        try:
            return self._feed(-1, text, end=True)
        finally:
            self._verdict.seconds += time.perf_counter() - started
            self._choices.pop(-1, None)

    @property
    def plain_bytes(self) -> bool:
        """Whether :meth:`feed_plain` and :meth:`note_plain` may stand for
        :meth:`feed` (no placeholders to restore)."""
        return not self._restore

    @property
    def verdict(self) -> Verdict:
        """Where what is found is recorded (its ``seconds`` included)."""
        return self._verdict

    def feed_plain(self, index: int, data: bytes) -> tuple[bytes, bool]:
        """:meth:`feed` for a piece of text in UTF-8 when nothing is
        restored (:attr:`plain_bytes`); not timed (the caller adds to
        ``verdict.seconds``). Returns the UTF-8 bytes that may be sent now
        (``data`` itself when it all goes as it came) and whether the
        choice is stopped now."""
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        if choice.stopped:
            return b"", True
        if not self._quick:
            if not self._checks:
                return data, False
            if not self._acts:
                self._flags(choice, data)
                return data, False
            return self._act(choice, data, end=False)
        # _act's usual case, inline (once per event): built-in kinds only
        # (held back by words), no max_chars, no hit.
        old = choice.held
        held = old + data if old else data
        size = len(held)
        match = self._continuable.match(held[::-1])
        hold = match.end() if match is not None else 0
        release = size - (hold if hold < HOLD_BYTES else HOLD_BYTES)
        while 0 < release < size and (held[release] & 0xC0) == 0x80:
            release -= 1  # not inside a character
        if size >= self._min_bytes and self._rules.matcher.scan(held):
            return self._act(choice, data, end=False)
        if release >= size:
            choice.held = b""
            return held, False
        if release <= 0:
            choice.held = held
            return b"", False
        choice.held = held[release:]
        return held[:release], False

    def note_plain(self, index: int, data: bytes) -> None:
        """:meth:`feed` for a piece of text in UTF-8 when the rules only
        flag (not :attr:`changes_text`): record what the window shows, send
        the text as it came; not timed."""
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        if self._checks and not choice.stopped:
            self._flags(choice, data)

    def _feed(self, index: int, text: str, *, end: bool) -> tuple[str, bool]:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        if choice.stopped:
            return "", True
        if self._restore:
            pending = choice.pending + text
            cut = None if end else _OPEN_PLACEHOLDER.search(pending)
            if cut is not None:
                pending, choice.pending = pending[: cut.start()], pending[cut.start() :]
            else:
                choice.pending = ""
            text = self._restored(pending)
        if not self._checks:
            return text, False
        if not self._acts:
            self._flags(choice, text.encode("utf-8", "surrogatepass"), end=end)
            return text, False
        out, stopped = self._act(choice, text.encode("utf-8", "surrogatepass"), end=end)
        return out.decode("utf-8", "surrogatepass"), stopped

    def _flags(self, choice: _Choice, data: bytes, *, end: bool = False) -> None:
        """Flags only: the text goes on as it came, so it is scanned in
        batches of :data:`FLAG_SCAN_BYTES` (and what is left at the end),
        each with the last :data:`HOLD_BYTES` scanned before it: a value
        split over events is still seen whole, and what it flags is
        recorded by the answer's end."""
        if data:
            choice.queued.append(data)
            choice.queued_bytes += len(data)
        if choice.queued_bytes < FLAG_SCAN_BYTES and not (end and choice.queued_bytes):
            return
        held = len(choice.held)
        window = b"".join((choice.held, *choice.queued))
        choice.queued = []
        choice.queued_bytes = 0
        for hit in self._rules.matcher.scan(window):
            if hit.end > held:
                self._verdict.note(hit.rule.kind.rule, hit.rule.action, "output")
        choice.held = window[-HOLD_BYTES:]

    def _act(self, choice: _Choice, data: bytes, *, end: bool) -> tuple[bytes, bool]:
        """Some rule may change or stop the text: release what no rule can
        still reach, guarded (``data`` itself when it all goes unchanged)."""
        old = choice.held
        held = old + data if old else data
        size = len(held)
        if end:
            release = size
        elif self._word_hold:
            # _word_release, inline (once per event).
            match = self._continuable.match(held[::-1])
            hold = match.end() if match is not None else 0
            release = size - (hold if hold < HOLD_BYTES else HOLD_BYTES)
        else:
            release = size - HOLD_BYTES
        while 0 < release < size and (held[release] & 0xC0) == 0x80:
            release -= 1  # not inside a character
        max_chars = self._rules.max_chars
        # Most events' text (with what is held) is shorter than any match.
        hits = self._rules.matcher.scan(held) if size >= self._min_bytes else []
        if not hits:
            if release <= 0:
                choice.held = held
                return b"", False
            out = held if release >= size else held[:release]
            choice.held = held[release:] if release < size else b""
            if not max_chars:
                return out, False
            chars = len(out) if out.isascii() else len(out.decode("utf-8", "surrogatepass"))
            if choice.sent_chars + chars <= max_chars:
                choice.sent_chars += chars
                return out, False
            return self._stopped(choice, out, "max_chars"), True
        blocking = next((hit for hit in hits if hit.rule.action == "block"), None)
        if blocking is not None:
            release = blocking.start
        else:
            for hit in hits:
                if hit.start < release < hit.end:
                    release = hit.start
                    break
        if release <= 0 and blocking is None:
            choice.held = held
            return b"", False
        done = [hit for hit in hits if hit.end <= release]
        try:
            out = apply_hits(held[:release], done, self._verdict, self._redactor, what="answer")
        except ContentFiltered:  # pragma: no cover - blocking hits end after release
            out = b""
        choice.held = held[release:]
        if max_chars:
            chars = len(out) if out.isascii() else len(out.decode("utf-8", "surrogatepass"))
            if choice.sent_chars + chars > max_chars:
                return self._stopped(choice, out, "max_chars"), True
            choice.sent_chars += chars
        if blocking is None:
            return out, False
        return self._stopped(choice, out, blocking.rule.kind.rule), True

    def _stopped(self, choice: _Choice, out: bytes, rule: str) -> bytes:
        """Stop the choice by ``rule``; what of ``out`` is still sent
        (cut to ``max_chars`` characters)."""
        max_chars = self._rules.max_chars
        if max_chars and rule == "max_chars":
            keep = max(0, max_chars - choice.sent_chars)
            out = out.decode("utf-8", "surrogatepass")[:keep].encode("utf-8", "surrogatepass")
        choice.stopped = True
        choice.held = b""
        self._verdict.note(rule, "block", "output")
        self._verdict.stopped = True
        return out

    # -- observe's batches (llmgw/gateway/guarded_fast.py ObserveStream) --------------

    def note_plain_many(self, index: int, pieces: list[bytes]) -> None:
        """:meth:`note_plain` for each of ``pieces`` (UTF-8 texts, empty
        ones allowed) in turn, in one call: the same text queued and the
        same batches of :data:`FLAG_SCAN_BYTES` scanned, so the same
        values are recorded; not timed."""
        # Imported here: this block is observe's own (one call per batch).
        from bisect import bisect_left
        from itertools import accumulate

        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        if not self._checks or choice.stopped or not pieces:
            return
        total = choice.queued_bytes + sum(map(len, pieces))
        if total < FLAG_SCAN_BYTES:  # the common case: no scan yet
            choice.queued += pieces
            choice.queued_bytes = total
            return
        # sums[i]: the bytes queued once pieces[:i] are, counted from the
        # last scan before them; each scan starts the count again.
        sums = list(accumulate(map(len, pieces), initial=choice.queued_bytes))
        count = len(pieces)
        at = 0
        scanned = 0
        while True:
            cut = bisect_left(sums, scanned + FLAG_SCAN_BYTES, at + 1)
            if cut > count:
                choice.queued.extend(pieces[at:])
                choice.queued_bytes = sums[count] - scanned
                return
            choice.queued.extend(pieces[at:cut])
            choice.queued_bytes = sums[cut] - scanned
            self._flags(choice, b"")
            scanned = sums[cut]
            at = cut

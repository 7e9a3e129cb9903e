"""The guarded stream's fast path: plain content events guarded in bytes.

Most events of a streamed chat or completions answer differ only in their
text: the same ``id``, ``created``, ``model`` and choice around a new
``delta.content`` (or ``text``). :class:`FastStream` learns that envelope
from an event the ordinary path parsed (``GuardedStream``: one JSON parse
per event, the output rules, the event written again) and, for each later
event that has exactly the same bytes around its text, finds the text in
the bytes, guards it (:meth:`~llmgw.guard.output.OutputGuard.feed_plain`)
and sends the event on unchanged when the rules release exactly what came,
or with the released text put in its place otherwise. Every other event
(the first, with its ``role``; the last, with its ``finish_reason``; usage;
``[DONE]``; tool calls; anything not valid JSON) goes the ordinary way, in
order, through the same guard state, so what the client gets means the same
(the same documents; only the engine's own JSON spacing may be kept where
the ordinary path writes it compact). Only in front of the OpenAI relay
(:class:`~llmgw.gateway.sse.SseRelay`), without ``restore``; once a rule
has stopped a choice, every event goes the ordinary way.

Under rules that only flag (``observe``), nothing the client gets can
change: :class:`ObserveStream` sends the engine's bytes through the relay
exactly as with the guard off, and reads what it sent in batches of 16
KiB, each run of plain content events in the learned envelope at once (its
texts sliced out, checked in one pass over them all), anything else the
ordinary way.

Sans-IO and pure but for the clock (the guard's time, once per read).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Final

import orjson

from llmgw.guard.output import OutputGuard

from .chat_stream import parse_event
from .sse import SseRelay, normalize_line_ends, usage_from

__all__ = ["OBSERVE_BATCH_BYTES", "FastStream", "ObserveStream"]

#: A JSON string's body that needs no decoding: no quote, backslash or
#: control character (UTF-8 checked apart).
_PLAIN: Final = re.compile(rb'[^"\\\x00-\x1f]*')
_EVENT_END: Final = b"\n\n"
_CONTENT_FILTER: Final = "content_filter"
#: The keys a learnable chunk's choice may have (chat; completions).
_CHAT_CHOICE: Final = frozenset(("index", "delta", "logprobs", "finish_reason"))
_TEXT_CHOICE: Final = frozenset(("index", "text", "logprobs", "finish_reason"))
_DELTA: Final = frozenset(("content", "role"))
_clock: Final = time.perf_counter
#: How many events of one stream may be looked at to learn the envelope
#: (an engine that changes it in every event gets no fast path).
_LEARN_TRIES: Final = 16
#: Under rules that only flag, what the relay sent is read once this many
#: bytes of it are kept (and at the stream's end): some 100 events, a few
#: hundred bytes of their text (the rules scan it by the KiB:
#: :data:`~llmgw.guard.output.FLAG_SCAN_BYTES`).
OBSERVE_BATCH_BYTES: Final = 16 * 1024
_NEWLINE: Final = b"\n"
#: A chat stream's first event's head ends so (its role), the next ones' so.
_ROLE_HEAD: Final = b'"delta":{"role":"assistant","content":"'
_CONTENT_HEAD: Final = b'"delta":{"content":"'


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index", 0)
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def _text(body: bytes) -> bytes | None:
    """A JSON string's body as the UTF-8 of its text, or None when it is
    not a valid one (the ordinary path then drops the event)."""
    if _PLAIN.fullmatch(body) is not None:
        if body.isascii():
            return body
        try:
            body.decode()
        except UnicodeDecodeError:
            return None
        return body
    try:
        text = orjson.loads(b'"' + body + b'"')
    except orjson.JSONDecodeError:
        return None
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else None


def _body(data: bytes) -> bytes:
    """The UTF-8 text ``data`` as a JSON string's body, escaped as
    ``orjson`` escapes it.

    Raises:
        UnicodeDecodeError: ``data`` is not UTF-8 (as the ordinary path).
    """
    if data.isascii() and _PLAIN.fullmatch(data) is not None:
        return data
    return orjson.dumps(data.decode("utf-8", "surrogatepass"))[1:-1]


class FastStream:
    """The fast path of one guarded stream (module docstring).

    Args:
        relay: the stream's shape.
        guard: the request's output rules.
        guarded: the ordinary path over parsed events (``GuardedStream._guarded``).
        flush: appends what is still held for open choices (``GuardedStream._flush``).
        opened: the choices with text seen (``GuardedStream._open``).
    """

    __slots__ = (
        "_after_cr",
        "_buffer",
        "_delta",
        "_flush",
        "_guard",
        "_guarded",
        "_head",
        "_index",
        "_opened",
        "_relay",
        "_tail",
        "_tries",
        "_verdict",
    )

    def __init__(
        self,
        relay: SseRelay,
        guard: OutputGuard,
        guarded: Callable[[list[Any]], list[Any]],
        flush: Callable[[list[Any]], None],
        opened: set[int],
    ) -> None:
        self._relay = relay
        self._guard = guard
        self._verdict = guard.verdict
        self._guarded = guarded
        self._flush = flush
        self._opened = opened
        self._buffer = b""
        self._after_cr = False
        #: The learned envelope: an event's bytes through its text's opening
        #: quote, and from its closing quote on (``b""``: none yet).
        self._head = b""
        self._tail = b""
        self._index = 0
        #: The text is ``delta.content`` (chat), else the choice's ``text``.
        self._delta = True
        self._tries = _LEARN_TRIES

    @staticmethod
    def build(
        shape: object,
        guard: OutputGuard,
        guarded: Callable[[list[Any]], list[Any]],
        flush: Callable[[list[Any]], None],
        opened: set[int],
    ) -> FastStream | ObserveStream | None:
        """The fast path for a stream of ``shape`` under ``guard``
        (:class:`ObserveStream` when its rules only flag), or None where
        there is none (another shape than the OpenAI relay; ``restore``)."""
        if type(shape) is not SseRelay or not guard.plain_bytes:
            return None
        if not guard.changes_text:
            return ObserveStream(shape, guard, guarded, opened)
        return FastStream(shape, guard, guarded, flush, opened)

    def feed(self, data: bytes) -> bytes:
        """``GuardedStream.feed``: take engine bytes; return what the client gets now."""
        if self._after_cr or b"\r" in data:
            data, self._after_cr = normalize_line_ends(data, self._after_cr)
        pending = self._buffer
        buffer = pending + data if pending else data
        cut = buffer.rfind(_EVENT_END)
        if cut < 0:
            self._buffer = buffer
            return b""
        self._buffer = buffer[cut + 2 :]
        verdict = self._verdict
        spent = verdict.seconds
        started = _clock()
        out = self._events(buffer, cut)
        # The ordinary path's own timing is part of this read's.
        verdict.seconds = spent + (_clock() - started)
        return out

    def finish(self) -> bytes:
        """``GuardedStream.finish``: the last event, anything held, the end."""
        rest, self._buffer = self._buffer, b""
        doc = parse_event(rest.rstrip(b"\n"))
        docs = self._guarded([] if doc is None else [doc])
        self._flush(docs)
        out = self._relay.feed_docs(docs) if docs else b""
        return out + self._relay.finish()

    def _events(self, buffer: bytes, cut: int) -> bytes:
        """The events of ``buffer[:cut]`` (cut at their blank lines), each
        the fast way or the ordinary way, in order: what the client gets
        for them (``buffer`` itself when that is all of it as it came)."""
        guard = self._guard
        head, tail = self._head, self._tail
        parts: list[bytes] = []
        slow: list[Any] = []
        #: Where the run of events sent as they came starts.
        run = 0
        count = 0
        at = 0
        while at <= cut:
            end = buffer.find(_EVENT_END, at)
            if head and buffer.startswith(head, at) and buffer.endswith(tail, at, end):
                body = buffer[at + len(head) : end - len(tail)]
                if end - len(tail) < at + len(head):
                    data = None
                elif body.isascii() and _PLAIN.fullmatch(body) is not None:
                    data = body
                else:
                    data = _text(body)
                if data is not None:
                    if slow:
                        parts.append(self._ordinary(slow))
                        slow = []
                        head = self._head
                        if not head:  # a rule stopped a choice
                            parts.append(self._ordinary_event(buffer[at:end]))
                            at = run = end + 2
                            continue
                    index = self._index
                    count += 1
                    if not data:
                        at = end + 2
                        continue
                    self._opened.add(index)
                    sent, stopped = guard.feed_plain(index, data)
                    if sent is data and not stopped:
                        at = end + 2
                        continue
                    parts.append(buffer[run:at])
                    if stopped:
                        count -= 1
                        parts.append(self._stopped(buffer[at:end], sent))
                        head = b""
                    else:
                        parts.append(buffer[at : at + len(head)] + _body(sent) + tail + _EVENT_END)
                    at = run = end + 2
                    continue
            parts.append(buffer[run:at])
            event = buffer[at:end]
            at = run = end + 2
            doc = parse_event(event)
            if doc is None:
                continue
            if self._tries > 0:
                self._learn(event, doc)
                head, tail = self._head, self._tail
            slow.append(doc)
        if slow:
            parts.append(self._ordinary(slow))
        self._relay.content_chunks += count
        if not parts and cut + 2 == len(buffer):
            return buffer
        parts.append(buffer[run : cut + 2])
        return b"".join(parts)

    def _ordinary(self, docs: list[Any]) -> bytes:
        """Parsed events the ordinary way (``GuardedStream``); after a
        stop, no more fast path."""
        guarded = self._guarded(docs)
        if self._guard.verdict.stopped:
            self._head = b""
            self._tries = 0
        return self._relay.feed_docs(guarded)

    def _ordinary_event(self, event: bytes) -> bytes:
        doc = parse_event(event)
        return b"" if doc is None else self._ordinary([doc])

    def _stopped(self, event: bytes, sent: bytes) -> bytes:
        """A fast event whose choice a rule stopped: as the ordinary path
        writes it (the text released before the match, ``content_filter``)."""
        self._head = b""
        self._tries = 0
        doc = parse_event(event)
        choice = doc["choices"][0]
        holder = choice["delta"] if self._delta else choice
        holder["content" if self._delta else "text"] = sent.decode("utf-8", "surrogatepass")
        choice["finish_reason"] = _CONTENT_FILTER
        self._opened.discard(self._index)
        return self._relay.feed_docs([doc])

    def _learn(self, event: bytes, doc: Any) -> None:
        """Take ``event``'s envelope when it is a plain content chunk
        (:func:`_envelope`)."""
        self._tries -= 1
        found = _envelope(event, doc)
        if found is not None:
            self._head, self._tail, self._index, self._delta = found


def _envelope(event: bytes, doc: Any) -> tuple[bytes, bytes, int, bool] | None:
    """``event``'s envelope when it is a plain content chunk: one choice,
    its text only (chat: ``delta`` with ``content``, perhaps ``role``), no
    ``finish_reason``, ``logprobs``, usage or error, one line, the text
    written without escapes. Returns its bytes through the text's opening
    quote and from its closing quote on, the choice's index, and whether
    the text is ``delta.content`` (else the choice's ``text``); None for
    any other event."""
    if type(doc) is not dict or "error" in doc or usage_from(doc) is not None:
        return None
    choices = doc.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    if type(choice) is not dict or choice.get("finish_reason") or choice.get("logprobs"):
        return None
    delta = choice.get("delta")
    if type(delta) is dict:
        if not (delta.keys() <= _DELTA and choice.keys() <= _CHAT_CHOICE):
            return None
        holder: dict[str, Any] = delta
        field, key = "content", b'"content":'
    elif "delta" not in choice and choice.keys() <= _TEXT_CHOICE:
        holder = choice
        field, key = "text", b'"text":'
    else:
        return None
    text = holder.get(field)
    if type(text) is not str or b"\n" in event or event.count(key) != 1:
        return None
    at = event.index(key) + len(key)
    while event[at : at + 1] in (b" ", b"\t"):
        at += 1
    body = text.encode()
    start = at + 1
    stop = start + len(body)
    if event[at:start] != b'"' or event[start:stop] != body or event[stop : stop + 1] != b'"':
        return None
    return event[:start], event[stop:], _index(choice), field == "content"


class ObserveStream:
    """A stream under rules that only flag (``observe``), in front of the
    OpenAI relay: the client gets exactly what the relay alone sends (the
    engine's bytes go through :meth:`SseRelay.feed`, as with the guard
    off), and what the relay sent is kept and read in batches of
    :data:`OBSERVE_BATCH_BYTES`: each run of plain content events in the
    learned envelope (as :class:`FastStream` learns it) at once, their
    texts sliced out and checked in one pass over them all, then queued
    in one call (:meth:`OutputGuard.note_plain_many`); every other event
    (the first, the last, usage, ``[DONE]``, tool calls, reasoning, other
    choices, anything unusual) the ordinary way, in order. So the rules
    see the same texts in the same pieces and record the same as on the
    ordinary path, by the answer's end (``[DONE]`` reads what is kept at
    once: the usage row is written as it is sent).

    Args:
        relay: the stream's shape.
        guard: the request's output rules (only flag).
        guarded: the ordinary path over parsed events (``GuardedStream._guarded``).
        opened: the choices with text seen (``GuardedStream._open``).
    """

    __slots__ = (
        "_guard",
        "_guarded",
        "_head",
        "_index",
        "_opened",
        "_pending",
        "_relay",
        "_size",
        "_tail",
        "_tries",
        "_verdict",
    )

    def __init__(
        self,
        relay: SseRelay,
        guard: OutputGuard,
        guarded: Callable[[list[Any]], list[Any]],
        opened: set[int],
    ) -> None:
        self._relay = relay
        self._guard = guard
        self._verdict = guard.verdict
        self._guarded = guarded
        self._opened = opened
        #: What the relay sent, not yet read (whole events), and its size.
        self._pending: list[bytes] = []
        self._size = 0
        #: The learned envelope (``b""``: none yet) and its choice.
        self._head = b""
        self._tail = b""
        self._index = 0
        self._tries = _LEARN_TRIES

    def feed(self, data: bytes) -> bytes:
        """``GuardedStream.feed``: take engine bytes; return what the client gets now."""
        out = self._relay.feed(data)
        if out:
            self._pending.append(out)
            self._size += len(out)
            # Read at once when the stream is done: its usage row, which
            # says what was flagged, is written as that end is sent.
            if self._size >= OBSERVE_BATCH_BYTES or self._relay.done:
                self._read()
        return out

    def finish(self) -> bytes:
        """``GuardedStream.finish``: the relay's end; everything kept read,
        and the last event the engine did not end with a blank line."""
        rest = self._relay.finish()
        if self._pending:
            self._read()
        doc = parse_event(rest.rstrip(b"\n"))
        if doc is not None:
            verdict = self._verdict
            spent = verdict.seconds
            started = _clock()
            self._guarded([doc])
            # The ordinary path's own timing is part of this one.
            verdict.seconds = spent + (_clock() - started)
        return rest

    def _read(self) -> None:
        """Read the kept reads (timed as the guard's): the first ones until
        the envelope is learned, then, when each read from there is one
        plain content event, all of them at once up to the last such (no
        split); the others as :meth:`_events` reads them."""
        verdict = self._verdict
        spent = verdict.seconds
        started = _clock()
        reads, self._pending = self._pending, []
        self._size = 0
        count = len(reads)
        at = 0
        while at < count and not self._head:
            self._events(reads[at])
            at += 1
        head, tail = self._head, self._tail
        if head and at < count and reads[at].startswith(head):
            read = reads[at]
            end = tail + _EVENT_END
            stop = count
            while stop > at and not reads[stop - 1].endswith(end):
                stop -= 1
            if stop > at and read.find(_EVENT_END) == len(read) - 2:
                texts = _plain(reads[at:stop], head, end)
                if texts is not None:
                    self._note(texts)
                    at = stop
        if at < count:
            self._events(reads[at] if at == count - 1 else b"".join(reads[at:]))
        # The ordinary path's own timing is part of this one.
        verdict.seconds = spent + (_clock() - started)

    def _events(self, batch: bytes) -> None:
        """The whole events of ``batch``, in order, split at their blank
        lines: from the first that starts with the learned head through
        the last that ends with its tail, all at once when each is plain;
        when not, each stretch of plain-looking ones at once, each other
        event the ordinary way (parsed, guarded)."""
        # Events of one line each (as engines write them): split at every
        # line end (a one-byte split), each event followed by an empty line.
        lines = batch.split(_NEWLINE)
        events = lines[::2]
        if any(lines[1::2]):
            events = batch.split(_EVENT_END)
        events.pop()  # what follows the last blank line: nothing
        count = len(events)
        whole = True
        at = 0
        while at < count:
            head = self._head
            if not (head and events[at].startswith(head)):
                self._ordinary(events[at])
                at += 1
                continue
            tail = self._tail
            texts = None
            if whole:
                # Once a batch: through the last event that ends like a
                # plain one (the events after it end the stream).
                whole = False
                stop = count
                while stop > at and not events[stop - 1].endswith(tail):
                    stop -= 1
                texts = _plain(events[at:stop], head, tail)
            if texts is None:
                # Something odd among them: the plain-looking ones before it.
                stop = at
                while stop < count and events[stop].startswith(head):
                    if not events[stop].endswith(tail):
                        break
                    stop += 1
                texts = _plain(events[at:stop], head, tail)
            if texts is not None:
                self._note(texts)
                at = stop
                continue
            for event in events[at : max(stop, at + 1)]:
                self._one(event)
            at = max(stop, at + 1)

    def _one(self, event: bytes) -> None:
        """One event that starts with the learned head: the fast way when
        it is a plain content event, else the ordinary way."""
        head, tail = self._head, self._tail
        if event.startswith(head) and event.endswith(tail) and len(event) >= len(head) + len(tail):
            data = _text(event[len(head) : len(event) - len(tail)])
            if data is not None:
                self._note([data])
                return
        self._ordinary(event)

    def _ordinary(self, event: bytes) -> None:
        """One event the ordinary way (parsed, guarded); the envelope
        learned from it when it is a plain content event."""
        doc = parse_event(event)
        if doc is None:
            return
        if self._tries > 0:
            found = _envelope(event, doc)
            if found is None:
                # Only events with text use up the tries (a thinking
                # model's many reasoning events before its answer do not).
                if b'"content":"' in event or b'"text":"' in event:
                    self._tries -= 1
            else:
                head, tail, index, _ = found
                self._tail, self._index = tail, index
                if head.endswith(_ROLE_HEAD):
                    # The first event, with the role: the next ones are
                    # the same without it (checked whole when they come).
                    head = head[: -len(_ROLE_HEAD)] + _CONTENT_HEAD
                self._head = head
                # A plain content event: its text as the fast way queues it.
                self._tries -= 1
                text = event[len(found[0]) : len(event) - len(tail)]
                if text:
                    self._opened.add(index)
                self._guard.note_plain_many(index, [text])
                return
        self._guarded([doc])

    def _note(self, texts: list[bytes]) -> None:
        """Queue plain events' texts; the envelope is known (learn no more)."""
        self._tries = 0
        index = self._index
        if any(texts):
            self._opened.add(index)
        self._guard.note_plain_many(index, texts)


def _plain(events: list[bytes], head: bytes, tail: bytes) -> list[bytes] | None:
    """The texts of ``events`` (UTF-8, as the ordinary path reads them)
    when each is ``head``, a JSON string's body and ``tail``; else None
    (also for none). One slice each and one comparison of them all put
    back together, no search."""
    if not events:
        return None
    start, stop = len(head), -len(tail)
    bodies = [event[start:stop] for event in events]
    if head + (tail + head).join(bodies) + tail != b"".join(events):
        return None
    return _texts(bodies)


def _texts(bodies: list[bytes]) -> list[bytes] | None:
    """JSON string bodies as the UTF-8 of their texts (as the ordinary
    path reads them), or None when one is not a valid one on its own (a
    quote not escaped, a control character, a bad escape, bad UTF-8). Text
    without escapes is checked in one regex pass over them all (and one
    decode when not ASCII); text with escapes body by body."""
    joined = b"".join(bodies)
    if _PLAIN.fullmatch(joined) is not None:
        if not joined.isascii():
            try:
                # "\n" between them: a character cut between two bodies is
                # not UTF-8 (each event is read on its own).
                _NEWLINE.join(bodies).decode()
            except UnicodeDecodeError:
                return None
        return bodies
    texts = [_text(body) for body in bodies]
    return None if None in texts else texts  # type: ignore[return-value]

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

__all__ = ["FastStream"]

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
        "_count",
        "_delta",
        "_flush",
        "_guard",
        "_guarded",
        "_head",
        "_index",
        "_opened",
        "_passthrough",
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
        #: Rules that only flag: the engine's bytes go on as they came.
        self._passthrough = not guard.changes_text
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
        #: The plain content events of the last read.
        self._count = 0

    @staticmethod
    def build(
        shape: object,
        guard: OutputGuard,
        guarded: Callable[[list[Any]], list[Any]],
        flush: Callable[[list[Any]], None],
        opened: set[int],
    ) -> FastStream | None:
        """The fast path for a stream of ``shape`` under ``guard``, or None
        where there is none (another shape than the OpenAI relay; ``restore``)."""
        if type(shape) is not SseRelay or not guard.plain_bytes:
            return None
        return FastStream(shape, guard, guarded, flush, opened)

    def feed(self, data: bytes) -> bytes:
        """``GuardedStream.feed``: take engine bytes; return what the client gets now."""
        raw = data
        if self._after_cr or b"\r" in data:
            data, self._after_cr = normalize_line_ends(data, self._after_cr)
        pending = self._buffer
        buffer = pending + data if pending else data
        cut = buffer.rfind(_EVENT_END)
        if cut < 0:
            self._buffer = buffer
            return self._relay.feed(raw) if self._passthrough else b""
        self._buffer = buffer[cut + 2 :]
        verdict = self._verdict
        spent = verdict.seconds
        started = _clock()
        out = self._events(buffer, cut)
        # The ordinary path's own timing is part of this read's.
        verdict.seconds = spent + (_clock() - started)
        if not self._passthrough:
            return out
        if self._count >= 0 and b"[DONE]" not in out:
            # Whole events, each plain content: the relay, which splits as
            # we do, would send them as they are and keep what we keep.
            return self._relay.feed_split(out, self._count, self._buffer, self._after_cr)
        return self._relay.feed(raw)

    def finish(self) -> bytes:
        """``GuardedStream.finish``: the last event, anything held, the end."""
        rest, self._buffer = self._buffer, b""
        doc = parse_event(rest.rstrip(b"\n"))
        docs = [] if doc is None else [doc]
        if self._passthrough:
            self._guarded(docs)
            return self._relay.finish()
        docs = self._guarded(docs)
        self._flush(docs)
        out = self._relay.feed_docs(docs) if docs else b""
        return out + self._relay.finish()

    def _events(self, buffer: bytes, cut: int) -> bytes:
        """The events of ``buffer[:cut]`` (cut at their blank lines), each
        the fast way or the ordinary way, in order: what the client gets
        for them (``buffer`` itself when that is all of it as it came, the
        events counted in ``_count``)."""
        guard = self._guard
        passthrough = self._passthrough
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
                    if passthrough:
                        if data:
                            self._opened.add(index)
                            guard.note_plain(index, data)
                        at = end + 2
                        continue
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
        if passthrough:
            # -1: some event was not plain content (the relay must see them).
            self._count = -1 if parts or slow else count
        else:
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
        return b"" if self._passthrough else self._relay.feed_docs(guarded)

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
        """Take ``event``'s envelope when it is a plain content chunk: one
        choice, its text only (chat: ``delta`` with ``content``, perhaps
        ``role``), no ``finish_reason``, ``logprobs``, usage or error, one
        line, the text written without escapes."""
        self._tries -= 1
        if type(doc) is not dict or "error" in doc or usage_from(doc) is not None:
            return
        choices = doc.get("choices")
        if type(choices) is not list or len(choices) != 1:
            return
        choice = choices[0]
        if type(choice) is not dict or choice.get("finish_reason") or choice.get("logprobs"):
            return
        delta = choice.get("delta")
        if type(delta) is dict:
            if not (delta.keys() <= _DELTA and choice.keys() <= _CHAT_CHOICE):
                return
            holder: dict[str, Any] = delta
            field, key = "content", b'"content":'
        elif "delta" not in choice and choice.keys() <= _TEXT_CHOICE:
            holder = choice
            field, key = "text", b'"text":'
        else:
            return
        text = holder.get(field)
        if type(text) is not str or b"\n" in event or event.count(key) != 1:
            return
        at = event.index(key) + len(key)
        while event[at : at + 1] in (b" ", b"\t"):
            at += 1
        body = text.encode()
        start = at + 1
        stop = start + len(body)
        if event[at:start] != b'"' or event[start:stop] != body or event[stop : stop + 1] != b'"':
            return
        self._head, self._tail = event[:start], event[stop:]
        self._index = _index(choice)
        self._delta = field == "content"

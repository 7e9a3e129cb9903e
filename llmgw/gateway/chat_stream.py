"""Reading an engine's OpenAI chat output, and the walk over its stream that
the translators to other APIs share.

Sans-IO and pure: nothing here reads a socket or a clock.

- :class:`ChatChunkReader` splits the engine's SSE bytes into parsed
  ``data:`` documents (:data:`DONE` for ``data: [DONE]``);
- :func:`engine_error`, :func:`first_choice`, :func:`answer_choice` and
  :func:`reasoning_text` read its chunks and whole answers;
- :class:`ChatStreamTranslator` walks the chunks (usage, choice 0, its
  delta's reasoning, text and tool calls, ``finish_reason``) and leaves the
  events to say to a subclass: :class:`~llmgw.gateway.anthropic.MessagesStream`
  (Anthropic Messages), :class:`~llmgw.gateway.responses.ResponsesStream`
  (OpenAI Responses).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Final, Generic, Literal, TypeVar

import orjson

from .sse import Usage, normalize_line_ends, usage_from

__all__ = [
    "DONE",
    "ChatChunkReader",
    "ChatStreamTranslator",
    "TextKind",
    "answer_choice",
    "engine_error",
    "first_choice",
    "parse_event",
    "reasoning_text",
]

#: What :meth:`ChatChunkReader.feed` yields for ``data: [DONE]``.
DONE: Final = "[DONE]"

#: The kinds of text a chat delta carries: the engine's reasoning, or the answer.
TextKind = Literal["reasoning", "text"]

#: What a :class:`ChatStreamTranslator` subclass keeps for a tool call it opened.
_Call = TypeVar("_Call")


class ChatChunkReader:
    """Splits an OpenAI SSE byte stream into its parsed ``data:`` documents.

    Bytes may arrive cut anywhere; ``\\r\\n`` and lone ``\\r`` line ends are
    accepted (``docs/api.md``).
    Comments, ``event:`` lines and data that is not JSON are skipped.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._after_cr = False

    def feed(self, data: bytes) -> list[Any]:
        """The documents completed by ``data``: parsed JSON values, and
        :data:`DONE` (the string ``"[DONE]"``) for ``data: [DONE]``."""
        if self._after_cr or b"\r" in data:
            data, self._after_cr = normalize_line_ends(data, self._after_cr)
        buffer = self._buffer + data if self._buffer else data
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self._buffer = buffer
            return []
        complete, self._buffer = buffer[:cut], buffer[cut + 2 :]
        return [doc for event in complete.split(b"\n\n") if (doc := parse_event(event)) is not None]

    def close(self) -> list[Any]:
        """The documents in a last event the stream did not end with a blank line."""
        rest, self._buffer = self._buffer, b""
        doc = parse_event(rest.rstrip(b"\n"))
        return [] if doc is None else [doc]


def parse_event(event: bytes) -> Any:
    """One SSE event (its lines, without the blank line that ends it) as
    :meth:`ChatChunkReader.feed` yields it: its ``data:`` lines' JSON,
    :data:`DONE`, or None (no data, or data that is not JSON)."""
    if event.startswith(b"data:") and b"\n" not in event:
        payload = event[5:].strip()  # the common case: one data line
    else:
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if not data:
            return None
        payload = b"\n".join(data)
    if payload == b"[DONE]":
        return DONE
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def engine_error(doc: Any) -> str | None:
    """The message of an error an engine sent in its stream (vLLM's
    ``{"error": {...}}`` or ``{"object": "error", "message"}``), else None."""
    if not isinstance(doc, dict):
        return None
    error = doc.get("error")
    if isinstance(error, dict):
        message = error.get("message")
        return message if isinstance(message, str) else "the engine failed"
    if isinstance(error, str):
        return error
    if doc.get("object") == "error":
        message = doc.get("message")
        return message if isinstance(message, str) else "the engine failed"
    return None


def first_choice(doc: dict[str, Any]) -> dict[str, Any] | None:
    """Choice 0 of a chunk (Anthropic and Responses have no ``n``), or None."""
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return None


def answer_choice(chat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The first choice of a whole ``chat.completion`` and its ``message``
    (each ``{}`` when missing or malformed)."""
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    choice = choice if isinstance(choice, dict) else {}
    message = choice.get("message")
    return choice, message if isinstance(message, dict) else {}


def reasoning_text(message: dict[str, Any]) -> str:
    """The reasoning in a message or delta (``reasoning_content``, as
    llama.cpp and vLLM send it, or ``reasoning``), else ``""``."""
    for name in ("reasoning_content", "reasoning"):
        text = message.get(name)
        if isinstance(text, str) and text:
            return text
    return ""


class ChatStreamTranslator(ABC, Generic[_Call]):
    """Translates an engine's OpenAI chat stream into another API's events.

    Sans-IO: :meth:`feed` takes the engine's SSE bytes (cut anywhere) and
    returns the events they complete as SSE bytes (every event in hand
    joined, possibly empty). Only choice 0 is read. Per delta, reasoning
    goes to :meth:`_text` (``"reasoning"``), then content (``"text"``), then
    each tool call: a call index's first delta, or one with a new id, opens
    a call (:meth:`_call_start`; a missing id gets :meth:`_new_call_id`),
    and its ``arguments`` pieces go to that call (:meth:`_call_arguments`),
    also after another block or item has closed it (engines that interleave
    calls). ``[DONE]`` or :meth:`finish` ends the stream with :meth:`_end`;
    an error the engine sends mid-stream ends it with :meth:`_engine_failed`.

    Attributes:
        usage: the engine's last OpenAI usage, or None (for accounting).
        content_chunks: chunks that carried reasoning, text or tool call
            deltas (the output count when the engine sends no usage).
        saw_first_content: a first such delta arrived (for TTFT).
        done: the stream is complete; further bytes are ignored.
        finish_reason: the engine's OpenAI ``finish_reason``, once sent
            (still None at :meth:`finish` means the engine broke off).
        engine_error: the message of an error the engine sent, or None.
    """

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self.content_chunks = 0
        self.saw_first_content = False
        self.done = False
        self.finish_reason: str | None = None
        self.engine_error: str | None = None
        self._reader = ChatChunkReader()
        self._started = False
        #: vLLM's ``stop_reason`` with the ``finish_reason``: the stop string matched.
        self._stop_string: str | None = None
        #: OpenAI tool call index → (the call's id, what the subclass keeps for it).
        self._calls: dict[int, tuple[str, _Call]] = {}

    def start(self) -> bytes:
        """The events that open the stream, if not yet sent (:meth:`feed`
        sends them first anyway; call this to send them before the engine's
        first byte)."""
        if self._started or self.done:
            return b""
        self._started = True
        out: list[bytes] = []
        self._start_events(out)
        return b"".join(out)

    def feed(self, data: bytes) -> bytes:
        """Take engine bytes; return the events they complete."""
        if self.done:
            return b""
        return self.feed_docs(self._reader.feed(data))

    def feed_docs(self, docs: list[Any]) -> bytes:
        """Take events already parsed (as :class:`ChatChunkReader` gives
        them; the guarded path parses each once and hands it on); return
        the events they complete."""
        if self.done:
            return b""
        out = [self.start()]
        for doc in docs:
            self._on_doc(doc, out)
            if self.done:
                break
        return b"".join(out)

    def finish(self) -> bytes:
        """Close the stream when the engine's bytes end: a last event left
        without its blank line is read, then the closing events are sent.
        ``b""`` when already done.

        A stream the engine broke off (no ``finish_reason`` seen) still ends
        well-formed; a caller that wants to say it broke can send the
        subclass's ``error_event`` instead of calling this.
        """
        if self.done:
            return b""
        out = [self.start()]
        for doc in self._reader.close():
            self._on_doc(doc, out)
            if self.done:
                return b"".join(out)
        self._complete(out)
        return b"".join(out)

    # -- what a subclass says

    @abstractmethod
    def _start_events(self, out: list[bytes]) -> None:
        """Append the events that open the stream."""

    @abstractmethod
    def _text(self, kind: TextKind, text: str, out: list[bytes]) -> None:
        """Append the events for a piece of reasoning or answer text."""

    @abstractmethod
    def _new_call_id(self) -> str:
        """An id for a tool call the engine sent without one."""

    @abstractmethod
    def _call_start(self, call_id: str, name: str, out: list[bytes]) -> _Call:
        """Append the events that open a tool call; return what to keep for
        it (given back to :meth:`_call_arguments`)."""

    @abstractmethod
    def _call_arguments(self, call: _Call, arguments: str, out: list[bytes]) -> None:
        """Append the events for a piece of a tool call's arguments."""

    @abstractmethod
    def _engine_failed(self, message: str) -> bytes:
        """The event that ends the stream on an engine's error; marks it done."""

    @abstractmethod
    def _end(self, out: list[bytes]) -> None:
        """Append the events that close the stream."""

    # -- the walk

    def _complete(self, out: list[bytes]) -> None:
        self._end(out)
        self.done = True

    def _on_doc(self, doc: Any, out: list[bytes]) -> None:
        if doc == DONE:
            self._complete(out)
            return
        if not isinstance(doc, dict):
            return
        error = engine_error(doc)
        if error is not None and not doc.get("choices"):
            self.engine_error = error
            out.append(self._engine_failed(error))
            return
        if doc.get("usage"):
            self.usage = usage_from(doc)
        choice = first_choice(doc)
        if choice is None:
            return
        delta = choice.get("delta")
        if isinstance(delta, dict) and self._on_delta(delta, out):
            self.content_chunks += 1
            self.saw_first_content = True
        finish = choice.get("finish_reason")
        if isinstance(finish, str) and finish:
            self.finish_reason = finish
            stop = choice.get("stop_reason")
            self._stop_string = stop if isinstance(stop, str) else None

    def _on_delta(self, delta: dict[str, Any], out: list[bytes]) -> bool:
        got = False
        reasoning = reasoning_text(delta)
        if reasoning:
            self._text("reasoning", reasoning, out)
            got = True
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._text("text", content, out)
            got = True
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, dict) and self._tool_call(call, out):
                    got = True
        return got

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> bool:
        number = call.get("index", 0)
        if not isinstance(number, int) or isinstance(number, bool):
            number = 0
        ident = call.get("id")
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        known = self._calls.get(number)
        started = False
        if known is None or (isinstance(ident, str) and ident and ident != known[0]):
            name = function.get("name")
            call_id = ident if isinstance(ident, str) and ident else self._new_call_id()
            known = call_id, self._call_start(call_id, name if isinstance(name, str) else "", out)
            self._calls[number] = known
            started = True
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            self._call_arguments(known[1], arguments, out)
            return True
        return started

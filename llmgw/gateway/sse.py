"""Relaying an engine's server-sent events while reading usage out of them.

:class:`SseRelay` is sans-IO: feed it the engine's bytes as they arrive,
get back the bytes to send the client (every complete event in hand, joined
into one write), and read the usage and timing it saw. It

- keeps the engine's final ``usage`` (also when that chunk still carries
  ``choices``, ``docs/api.md``);
- drops the usage-only chunk when the client did not ask for usage (the
  gateway always asks the engine for it);
- counts content chunks, the fallback when an engine sends no usage.

Events end at a blank line, whichever line end the engine uses: ``\n``,
``\r\n`` or a lone ``\r`` (the SSE format allows all three; so
``\n\n``, ``\r\n\r\n`` and ``\r\r`` each end an event). An engine's
``\r\n`` or ``\r`` line ends reach the client as ``\n``.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["SseRelay", "Usage", "normalize_line_ends", "usage_from"]

_EVENT_END = b"\n\n"


def normalize_line_ends(data: bytes, after_cr: bool) -> tuple[bytes, bool]:
    """``data`` with its ``\r\n`` and lone ``\r`` line ends made ``\n``.

    Args:
        data: the next bytes of a stream.
        after_cr: the bytes before ``data`` ended with ``\r`` (so a ``\n``
            that ``data`` starts with is the second half of a ``\r\n``,
            already counted).

    Returns:
        The normalized bytes, and whether ``data`` ended with ``\r`` (the
        ``after_cr`` of the next call).
    """
    if not data:
        return data, after_cr
    if after_cr and data[0] == 0x0A:
        data = data[1:]
    if b"\r" not in data:
        return data, False
    return data.replace(b"\r\n", b"\n").replace(b"\r", b"\n"), data.endswith(b"\r")


class Usage:
    """Token counts in OpenAI's sense (cached tokens inside prompt tokens)."""

    __slots__ = ("cached_tokens", "completion_tokens", "prompt_tokens")

    def __init__(
        self, prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens


def usage_from(doc: Any) -> Usage | None:
    """The usage in an OpenAI response or chunk document, or ``None``."""
    if not isinstance(doc, dict):
        return None
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    return Usage(
        prompt_tokens=_int(usage.get("prompt_tokens")),
        completion_tokens=_int(usage.get("completion_tokens")),
        cached_tokens=_int(cached),
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


class SseRelay:
    """Splits an SSE byte stream into events, inspecting each once.

    Args:
        pass_usage: whether the client asked for ``stream_options.include_usage``.
    """

    def __init__(self, *, pass_usage: bool) -> None:
        self._pass_usage = pass_usage
        self._buffer = b""
        self._after_cr = False
        self.usage: Usage | None = None
        self.content_chunks = 0
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Take engine bytes; return what the client should get now (may be empty)."""
        if self._after_cr or b"\r" in data:
            data, self._after_cr = normalize_line_ends(data, self._after_cr)
        buffer = self._buffer + data if self._buffer else data
        end = buffer.rfind(_EVENT_END)
        if end < 0:
            self._buffer = buffer
            return b""
        complete, self._buffer = buffer[: end + 2], buffer[end + 2 :]
        if b'"usage"' not in complete and b'"error"' not in complete:
            # The common case: content chunks only. Count them without parsing
            # (a raw line end is only ever a line's end: JSON escapes its own).
            chunks = complete.count(b"\ndata:") + complete.startswith(b"data:")
            if b"[DONE]" in complete:
                done = complete.count(b"data: [DONE]") + complete.count(b"data:[DONE]")
                chunks -= done
                self.done = self.done or done > 0
            self.content_chunks += chunks
            return complete
        out: list[bytes] = []
        for event in complete.split(_EVENT_END):
            if not event:
                continue
            kept = self._inspect(event)
            if kept is not None:
                out.append(kept + _EVENT_END)
        return b"".join(out)

    def feed_docs(self, docs: list[Any]) -> bytes:
        """Take events already parsed (``"[DONE]"`` for ``data: [DONE]``,
        else their JSON), as the guarded path hands them on; return them as
        the client should get them, usage kept or dropped as :meth:`feed` does."""
        out: list[bytes] = []
        for doc in docs:
            if doc == "[DONE]":
                self.done = True
                out.append(b"data: [DONE]\n\n")
                continue
            if not isinstance(doc, dict):
                continue
            choices = doc.get("choices")
            if choices or "usage" not in doc:
                self.content_chunks += 1
            usage = usage_from(doc)
            if usage is not None:
                self.usage = usage
                if not self._pass_usage:
                    if not choices:
                        continue
                    del doc["usage"]
            out.append(b"data: " + orjson.dumps(doc) + _EVENT_END)
        return b"".join(out)

    def finish(self) -> bytes:
        """Whatever is left when the engine closes the stream (the same
        contract as the Anthropic and Responses translators' ``finish``)."""
        rest, self._buffer = self._buffer, b""
        return rest

    def _inspect(self, event: bytes) -> bytes | None:
        """The event to send on (possibly rewritten), or ``None`` to drop it."""
        data = _data_of(event)
        if data is None:
            return event
        if data == b"[DONE]":
            self.done = True
            return event
        if b'"usage"' not in data and b'"error"' not in data:
            self.content_chunks += 1
            return event
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event
        usage = usage_from(doc)
        choices = doc.get("choices") if isinstance(doc, dict) else None
        if choices or (usage is None and not (isinstance(doc, dict) and "error" in doc)):
            # Content (an engine's error event is none: it is passed on as is).
            self.content_chunks += 1
        if usage is None or self._pass_usage:
            if usage is not None:
                self.usage = usage
            return event
        self.usage = usage
        if not choices:
            return None  # the usage-only chunk the client did not ask for
        # A content chunk that also carries usage: send it without the usage.
        del doc["usage"]
        return b"data: " + orjson.dumps(doc)


def _data_of(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None

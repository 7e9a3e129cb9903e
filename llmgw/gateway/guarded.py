"""Answers through the guard's output rules (``docs/guardrails.md``).

:func:`guard_answer` guards a whole chat or completions answer in place.
:class:`GuardedStream` stands in front of a stream's shape (the SSE relay
or a translator): it parses each engine event once, guards the text of its
choices (:class:`llmgw.guard.output.OutputGuard`, a sliding window), and
hands the parsed events on to the shape, which reads the usage from them:
one parse per event for the guard and accounting together. A choice a rule
stops ends with ``finish_reason: content_filter`` (Anthropic's
``stop_reason: refusal``, Responses' ``incomplete`` for ``content_filter``);
the engine's later text for it is dropped, its usage still counted.
"""

from __future__ import annotations

from typing import Any, Protocol

from llmgw.guard.output import OutputGuard

from .chat_stream import DONE, ChatChunkReader
from .sse import Usage

__all__ = ["DocShape", "GuardedStream", "guard_answer"]

CONTENT_FILTER = "content_filter"


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index", 0)
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def guard_answer(whole: dict[str, Any], guard: OutputGuard) -> bool:
    """Guard a whole ``chat.completion`` or ``text_completion`` in place
    (each choice's ``message.content`` or ``text``); whether it changed."""
    changed = False
    choices = whole.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        holder, field = (message, "content") if isinstance(message, dict) else (choice, "text")
        text = holder.get(field)
        if not isinstance(text, str) or not text:
            continue
        out, stopped = guard.whole(text)
        if out != text:
            holder[field] = out
            changed = True
        if stopped:
            choice["finish_reason"] = CONTENT_FILTER
            changed = True
    return changed


class DocShape(Protocol):
    """A stream's shape that also takes parsed events (:class:`SseRelay`,
    the translators)."""

    usage: Usage | None
    content_chunks: int
    done: bool

    def feed_docs(self, docs: list[Any]) -> bytes: ...
    def finish(self) -> bytes: ...


class GuardedStream:
    """A stream's shape behind the output rules (module docstring); the
    relay's ``_StreamShape``."""

    def __init__(self, shape: DocShape, guard: OutputGuard) -> None:
        self._shape = shape
        self._guard = guard
        self._reader = ChatChunkReader()
        self._open: set[int] = set()

    @property
    def usage(self) -> Usage | None:
        return self._shape.usage

    @property
    def content_chunks(self) -> int:
        return self._shape.content_chunks

    @property
    def done(self) -> bool:
        return self._shape.done

    def feed(self, data: bytes) -> bytes:
        """Take engine bytes; return what the client gets now."""
        docs = self._reader.feed(data)
        if not docs:
            return b""
        return self._shape.feed_docs(self._guarded(docs))

    def finish(self) -> bytes:
        """The engine closed the stream: the last event, anything held, the end."""
        docs = self._guarded(self._reader.close())
        self._flush(docs)
        out = self._shape.feed_docs(docs) if docs else b""
        return out + self._shape.finish()

    def _flush(self, docs: list[Any]) -> None:
        """Append what is still held for choices the engine never finished."""
        for index in sorted(self._open):
            rest, stopped = self._guard.close(index)
            if rest or stopped:
                choice = {
                    "index": index,
                    "delta": {"content": rest},
                    "finish_reason": CONTENT_FILTER if stopped else None,
                }
                docs.append({"choices": [choice]})
        self._open.clear()

    def _guarded(self, docs: list[Any]) -> list[Any]:
        guard = self._guard
        out: list[Any] = []
        for doc in docs:
            if doc == DONE:
                self._flush(out)
            out.append(doc)
            if doc == DONE or not isinstance(doc, dict):
                continue
            choices = doc.get("choices")
            if not isinstance(choices, list):
                continue
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                index = _index(choice)
                delta = choice.get("delta")
                holder, field = (delta, "content") if isinstance(delta, dict) else (choice, "text")
                finish = choice.get("finish_reason")
                if guard.stopped(index):
                    holder.pop(field, None)
                    choice["finish_reason"] = None
                    continue
                text = holder.get(field)
                stopped = False
                if isinstance(text, str) and text:
                    self._open.add(index)
                    text, stopped = guard.feed(index, text)
                else:
                    text = ""
                if finish and not stopped:
                    rest, stopped = guard.close(index)
                    text += rest
                    self._open.discard(index)
                if text or field in holder:
                    holder[field] = text
                if stopped:
                    choice["finish_reason"] = CONTENT_FILTER
                    self._open.discard(index)
        return out

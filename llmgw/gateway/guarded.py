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

import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, Protocol, TypeVar

import orjson
import trio

from llmgw import errors
from llmgw.errors import LlmgwError
from llmgw.guard import ContentFiltered, Guard, Verdict
from llmgw.guard.judge import STREAM_WINDOW_CHARS, Judge, JudgeUnavailable, JudgeVerdict
from llmgw.guard.output import OutputGuard
from llmgw.router.router import Router
from llmgw.settings import GuardJudge
from llmgw.store import ModelRecord

from .chat_stream import DONE, ChatChunkReader
from .guarded_fast import FastStream, ObserveStream
from .sse import SseRelay, Usage
from .upstream import UpstreamError

_R = TypeVar("_R")

__all__ = [
    "UNAVAILABLE",
    "DocShape",
    "GuardedStream",
    "JudgeAsk",
    "JudgedStream",
    "PromptJudge",
    "guard_answer",
    "record_verdict",
]

CONTENT_FILTER = "content_filter"


def _index(choice: dict[str, Any]) -> int:
    index = choice.get("index", 0)
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def guard_answer(whole: dict[str, Any], guard: OutputGuard) -> bool:
    """Guard a whole ``chat.completion`` or ``text_completion`` in place
    (each choice's ``message.content`` or ``text``, and its tool calls'
    arguments: a call a rule blocks is dropped, the choice ends in
    ``content_filter``); whether it changed."""
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
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict) or choice.get("finish_reason") == CONTENT_FILTER:
            continue
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if not isinstance(arguments, str) or not arguments:
                continue
            out, stopped = guard.whole(arguments)
            if stopped:
                # A call refused is not made: no tool call at all.
                message.pop("tool_calls", None)
                choice["finish_reason"] = CONTENT_FILTER
                changed = True
                break
            if out != arguments:
                function["arguments"] = out
                changed = True
    return changed


class DocShape(Protocol):
    """A stream's shape that also takes parsed events (:class:`SseRelay`,
    the translators)."""

    @property
    def usage(self) -> Usage | None: ...
    @property
    def content_chunks(self) -> int: ...
    @property
    def done(self) -> bool: ...

    def feed(self, data: bytes) -> bytes: ...
    def feed_docs(self, docs: list[Any]) -> bytes: ...
    def finish(self) -> bytes: ...


class _InFront:
    """A stream's shape in front of another: the usage, the content chunks
    counted and the end are the inner shape's."""

    _shape: DocShape

    @property
    def usage(self) -> Usage | None:
        return self._shape.usage

    @property
    def content_chunks(self) -> int:
        return self._shape.content_chunks

    @property
    def done(self) -> bool:
        return self._shape.done


def _weakly(method: Callable[[list[Any]], _R]) -> Callable[[list[Any]], _R]:
    """``method`` called through a weak reference to its object."""
    ref = weakref.WeakMethod(method)

    def call(docs: list[Any]) -> _R:
        bound = ref()
        if bound is None:  # the stream is gone: nothing calls this then
            raise RuntimeError("the guarded stream is gone")
        return bound(docs)

    return call


class GuardedStream(_InFront):
    """A stream's shape behind the output rules (module docstring); the
    relay's ``_StreamShape``."""

    def __init__(self, shape: DocShape, guard: OutputGuard) -> None:
        self._shape = shape
        self._guard = guard
        self._reader = ChatChunkReader()
        self._open: set[int] = set()
        #: Choice → its tool calls (by index) whose arguments are open.
        self._calls: dict[int, set[int]] = {}
        #: Choices stopped by a rule over a tool call's arguments.
        self._cut: set[int] = set()
        #: Rules that only flag, in front of the OpenAI relay: the engine's
        #: bytes go on as they came (read, not written again).
        self._passthrough = not guard.changes_text and isinstance(shape, SseRelay)

    #: The fast path (:class:`~llmgw.gateway.guarded_fast.FastStream`, or
    #: :class:`~llmgw.gateway.guarded_fast.ObserveStream` under rules that
    #: only flag), built on the first :meth:`feed`; False where there is none.
    _fast: FastStream | ObserveStream | Literal[False] | None = None

    def feed(self, data: bytes) -> bytes:
        """Take engine bytes; return what the client gets now."""
        # -- the fast path (guarded_fast.py): plain content events in bytes
        fast = self._fast
        if fast is None:
            # Handed weakly: the fast path held by this stream holding this
            # stream's methods would make a reference cycle per request,
            # left to the cyclic collector (pauses of 10 ms and more under
            # load, docs/performance.md).
            built = FastStream.build(
                self._shape, self._guard, _weakly(self._guarded), _weakly(self._flush), self._open
            )
            fast = self._fast = built if built is not None else False
            if fast:
                # Later reads go straight to it (no call through this one).
                self.feed = fast.feed  # type: ignore[method-assign]
        if fast:
            return fast.feed(data)
        # --
        docs = self._reader.feed(data)
        if self._passthrough:
            self._guarded(docs)
            return self._shape.feed(data)
        if not docs:
            return b""
        return self._shape.feed_docs(self._guarded(docs))

    def finish(self) -> bytes:
        """The engine closed the stream: the last event, anything held, the end."""
        # -- the fast path (guarded_fast.py)
        if self._fast:
            return self._fast.finish()
        # --
        if self._passthrough:
            self._guarded(self._reader.close())
            return self._shape.finish()
        docs = self._guarded(self._reader.close())
        self._flush(docs)
        out = self._shape.feed_docs(docs) if docs else b""
        return out + self._shape.finish()

    def _flush(self, docs: list[Any]) -> None:
        """Append what is still held for choices the engine never finished."""
        for index in sorted(self._calls):
            delta: dict[str, Any] = {}
            stopped = self._tool_args(index, delta, True)
            if delta or stopped:
                docs.append(
                    {
                        "choices": [
                            {
                                "index": index,
                                "delta": delta,
                                "finish_reason": CONTENT_FILTER if stopped else None,
                            }
                        ]
                    }
                )
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
            #: The choices sent on: not those a rule stopped before this event.
            kept: list[Any] = []
            for choice in choices:
                if not isinstance(choice, dict):
                    kept.append(choice)
                    continue
                index = _index(choice)
                delta = choice.get("delta")
                holder, field = (delta, "content") if isinstance(delta, dict) else (choice, "text")
                finish = choice.get("finish_reason")
                if guard.stopped(index) or index in self._cut:
                    continue
                kept.append(choice)
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
                if (
                    not stopped
                    and isinstance(delta, dict)
                    and self._tool_args(index, delta, bool(finish))
                ):
                    stopped = True
                    self._cut.add(index)
                if stopped:
                    choice["finish_reason"] = CONTENT_FILTER
                    self._open.discard(index)
            if len(kept) < len(choices):
                # A stopped choice's event after its content_filter one is
                # not sent (its last event stays the one with that reason);
                # an event left with no choice goes only if it has usage.
                if kept or "usage" in doc:
                    doc["choices"] = kept
                else:
                    out.pop()
        return out

    def _tool_args(self, index: int, delta: dict[str, Any], finish: bool) -> bool:
        """Guard the tool calls' argument pieces in ``delta`` in place (each
        call's arguments a text of their own); with ``finish``, what is held
        of them is added. Whether a rule stopped the choice (its tool calls
        then dropped from ``delta``)."""
        guard = self._guard
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(function, dict) or not isinstance(arguments, str) or not arguments:
                continue
            at = _index(call)
            self._calls.setdefault(index, set()).add(at)
            text, stopped = guard.feed(_tool_key(index, at), arguments)
            if stopped:
                delta.pop("tool_calls", None)
                self._calls.pop(index, None)
                return True
            function["arguments"] = text
        if not finish:
            return False
        rests: list[dict[str, Any]] = []
        for at in sorted(self._calls.pop(index, ())):
            rest, stopped = guard.close(_tool_key(index, at))
            if stopped:
                delta.pop("tool_calls", None)
                return True
            if rest:
                rests.append({"index": at, "function": {"arguments": rest}})
        if rests:
            if isinstance(calls, list):
                calls.extend(rests)
            else:
                delta["tool_calls"] = rests
        return False


def _tool_key(index: int, call: int) -> int:
    """The output guard's key for choice ``index``'s tool call ``call``
    (negative: apart from the choices and from whole answers' -1)."""
    return -2 - index * 1024 - call


# --- the judge (docs/guardrails.md, The judge) ------------------------------------------


class _HasPool(Protocol):
    def pool(self, endpoint: Any) -> Any: ...


def _context_tokens(model: ModelRecord | None) -> int:
    """The judge's context in tokens: the trained one, else its first
    profile's, else 4096."""
    if model is None:
        return 4096
    if model.context_length:
        return model.context_length
    profile = model.profile
    return profile.context_tokens if profile is not None else 4096


class JudgeAsk:
    """Asks a judge model over the gateway's pooled connections, on the
    gateway's own account (no client key, no usage row, no limits): each
    call to the least busy ready replica not yet ``tried`` (the hedge to
    another one than the first call), equals taken in turn.

    Raises (when called):
        LlmgwError: no such model, no (other) ready replica, the replica
            did not answer or answered other than 200 with a chat answer.
    """

    def __init__(self, router: Router, relay: _HasPool) -> None:
        self._router = router
        self._relay = relay
        self._turn = 0

    async def __call__(self, name: str, body: dict[str, Any], tried: list[str]) -> str:
        model = self._router.resolve(name)
        if model is None:
            raise errors.NotFound(f"the judge model {name!r} is not in the catalog")
        endpoints = [e for e in self._router.endpoints(model) if e.label not in tried]
        if not endpoints:
            raise UpstreamError(f"no other replica of {name} to ask", before_response=True)
        # The least busy; among equals, each in turn (judgments spread over
        # the replicas, so a hedge finds another one warm).
        self._turn += 1
        turn = self._turn % len(endpoints)
        endpoint = min(endpoints[turn:] + endpoints[:turn], key=lambda e: e.in_flight)
        tried.append(endpoint.label)
        external = model.external
        doc = {**body, "model": external.model if external is not None else model.name}
        headers = [*endpoint.auth_headers, (b"content-type", b"application/json")]
        endpoint.in_flight += 1
        try:
            response = await self._relay.pool(endpoint).request(
                b"POST",
                endpoint.path_prefix.encode() + b"/v1/chat/completions",
                headers,
                orjson.dumps(doc),
            )
            async with response:
                data = await response.read()
                status = response.status
        finally:
            endpoint.in_flight -= 1
        if status != 200:
            raise UpstreamError(f"judge {name} answered {status}", before_response=False)
        try:
            content = orjson.loads(data)["choices"][0]["message"]["content"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise UpstreamError(
                f"judge {name} sent no chat answer", before_response=False
            ) from None
        if not isinstance(content, str):
            raise UpstreamError(f"judge {name} sent no text", before_response=False)
        return content


def _latest_user_text(doc: dict[str, Any]) -> str:
    """The text a prompt's judge reads: the latest user turn (earlier ones
    were judged when they were sent, and their verdicts are cached), else
    a completions ``prompt``."""
    messages = doc.get("messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if not isinstance(message, dict) or message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n".join(
                    part["text"]
                    for part in content
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                )
            return ""
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""


class PromptJudge:
    """The judge on prompts and answers, for the ``/v1`` routes: one
    :class:`Judge` (its verdict cache) per gateway."""

    def __init__(self, router: Router, relay: _HasPool) -> None:
        self._router = router
        self.judge = Judge(JudgeAsk(router, relay))

    async def check(self, guard: Guard, doc: dict[str, Any], verdict: Verdict) -> None:
        """Judge the prompt of ``doc`` (after the pattern rules) and record
        the verdict: ``judge:<category>`` blocks, ``judge:controversial``
        flags (or blocks), ``judge:unavailable`` flags under ``fail: open``.

        Raises:
            ContentFiltered: the judge found the prompt unsafe (400
                ``content_filter``).
            JudgeUnavailable: no verdict in time under ``fail: closed``
                (503 ``judge_unavailable``).
        """
        judge = guard.judge
        if judge is None:
            return
        text = _latest_user_text(doc)
        if not text.strip():
            return
        started = time.perf_counter()
        try:
            found = await self.judge.judge(judge, text, context_tokens=self.context_tokens(judge))
        finally:
            verdict.seconds += time.perf_counter() - started
        refused = record_verdict(judge, found, verdict, "input")
        if refused == UNAVAILABLE:
            raise JudgeUnavailable(judge.model)
        if refused:
            raise ContentFiltered("prompt", list(refused))

    async def answer(self, guard: Guard, whole: dict[str, Any], verdict: Verdict) -> None:
        """Judge a whole answer (each choice's text and its tool calls'
        arguments) before it is returned, and record the verdict (direction
        ``output``).

        Raises:
            ContentFiltered: the judge found the answer unsafe (400
                ``content_filter``).
            JudgeUnavailable: no verdict in time under ``fail: closed``
                (503 ``judge_unavailable``).
        """
        judge = guard.judge
        if judge is None:
            return
        texts = [t for t in _answer_texts(whole) if t.strip()]
        if not texts:
            return
        started = time.perf_counter()
        try:
            found = await self.judge.judge_all(
                judge, texts, context_tokens=self.context_tokens(judge), answer=True
            )
        finally:
            verdict.seconds += time.perf_counter() - started
        refused = record_verdict(judge, found, verdict, "output")
        if refused == UNAVAILABLE:
            raise JudgeUnavailable(judge.model)
        if refused:
            raise ContentFiltered("answer", list(refused))

    def context_tokens(self, judge: GuardJudge) -> int:
        """The context of ``judge``'s model, in tokens."""
        return _context_tokens(self._router.resolve(judge.model))


#: What :func:`record_verdict` gives when no verdict came under ``fail: closed``.
UNAVAILABLE: Final = ("judge:unavailable",)


def record_verdict(
    judge: GuardJudge, found: JudgeVerdict | None, verdict: Verdict, direction: str
) -> tuple[str, ...]:
    """Record the judge's verdict ``found`` (None: none in time) on the
    text of ``direction`` (``input`` or ``output``); the rule ids that
    refuse it (empty: it passes; :data:`UNAVAILABLE` under ``fail:
    closed`` without a verdict)."""
    if found is None:
        if judge.fail == "closed":
            verdict.note("judge:unavailable", "block", direction)
            return UNAVAILABLE
        verdict.note("judge:unavailable", "flag", direction)
        return ()
    refused = found.refused(judge)
    for rule in refused:
        verdict.note(rule, "block", direction)
    if not refused and found.safety == "controversial":
        verdict.note("judge:controversial", "flag", direction)
    return refused


def _answer_texts(whole: dict[str, Any]) -> list[str]:
    """A whole chat or completions answer's texts to judge: per choice, its
    ``message.content`` (or ``text``) and its tool calls' arguments."""
    out: list[str] = []
    choices = whole.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        parts: list[str] = []
        message = choice.get("message")
        holder, field = (message, "content") if isinstance(message, dict) else (choice, "text")
        text = holder.get(field)
        if isinstance(text, str):
            parts.append(text)
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                parts.append(arguments)
        out.append("\n".join(parts))
    return out


def _delta_text(choice: dict[str, Any]) -> str:
    """The text a stream event's choice adds: its content (or ``text``)
    and its tool calls' argument pieces."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    text = delta.get("content")
    out = text if isinstance(text, str) else ""
    calls = delta.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            out += arguments
    return out


#: Sends what the callable gives, at once, between the relay's own writes
#: (the callable runs under the relay's send lock).
Emit = Callable[[Callable[[], bytes]], Awaitable[None]]


class JudgedStream(_InFront):
    """The judge on a streamed answer (``docs/guardrails.md``, The judge:
    streams): a :class:`DocShape` in front of the stream's shape (behind
    :class:`GuardedStream` when pattern rules apply, so it reads the text
    they released).

    The text goes on at once; each choice's text is cut into windows of
    :data:`STREAM_WINDOW_CHARS` characters, each judged in the background
    (:meth:`attach` gives the nursery, and the way to send the stop at
    once). The stream's end (every event from the first one carrying a
    ``finish_reason``, the usage, ``[DONE]``) is held until the last
    partial windows are judged (:meth:`settle`, each judgment within the
    budget), then :meth:`release` gives it. An unsafe verdict (or none
    under ``fail: closed``) stops every choice: ``finish_reason:
    content_filter`` sent at once, the engine's later text dropped (its
    usage still read). With ``buffer_all`` every event is held until the
    verdict on the whole answer: :attr:`refusal` then says what to answer
    instead.

    Attributes:
        buffer_all: nothing is sent before the verdict.
        stopped: the rule ids that stopped the stream (empty: none).
    """

    def __init__(
        self,
        shape: DocShape,
        judging: PromptJudge,
        judge: GuardJudge,
        verdict: Verdict,
        *,
        buffer_all: bool,
    ) -> None:
        self._shape = shape
        self._judging = judging
        self._judge = judge
        self._verdict = verdict
        self._context_tokens = judging.context_tokens(judge)
        self.buffer_all = buffer_all
        self.stopped: tuple[str, ...] = ()
        self._reader: ChatChunkReader | None = None
        self._windows: dict[int, str] = {}
        #: Choices seen whose end has not gone to the shape.
        self._open: set[int] = set()
        self._held: list[Any] | None = [] if buffer_all else None
        #: The first event with choices: the stop's events copy its fields.
        self._template: dict[str, Any] | None = None
        self._nursery: trio.Nursery | None = None
        self._emit: Emit | None = None
        self._pending = 0
        self._idle = trio.Event()
        self._idle.set()

    def attach(self, nursery: trio.Nursery, emit: Emit) -> None:
        """Where judgments run, and how bytes are sent outside :meth:`feed`
        (the stop, once a verdict refuses the answer)."""
        self._nursery = nursery
        self._emit = emit

    def feed(self, data: bytes) -> bytes:
        """Engine bytes (when no pattern rule parsed them first)."""
        if self._reader is None:
            self._reader = ChatChunkReader()
        return self.feed_docs(self._reader.feed(data))

    def feed_docs(self, docs: list[Any]) -> bytes:
        """Parsed events in; what the client gets now."""
        passed: list[Any] = []
        for doc in docs:
            ends = doc == DONE
            choices = doc.get("choices") if isinstance(doc, dict) else None
            if isinstance(choices, list):
                if self.stopped and choices:
                    # Stopped: the engine's later text and ends are dropped
                    # (its usage still read).
                    if "usage" not in doc:
                        continue
                    doc["choices"] = choices = []
                if not choices and "usage" in doc:
                    ends = True
                if self._template is None and choices:
                    self._template = doc
                for choice in choices:
                    if not isinstance(choice, dict):
                        continue
                    index = _index(choice)
                    text = _delta_text(choice)
                    self._open.add(index)
                    if text:
                        self._window(index, text)
                    if choice.get("finish_reason"):
                        ends = True
            if self._held is None and ends:
                self._held = []
            (passed if self._held is None else self._held).append(doc)
        return self._shape.feed_docs(passed) if passed else b""

    def finish(self) -> bytes:
        """Nothing yet: the end waits for :meth:`settle` and :meth:`release`."""
        if self._reader is not None:
            self.feed_docs(self._reader.close())
        if self._held is None:
            self._held = []
        return b""

    def ending(self) -> None:
        """The engine's stream is over: what comes next (a pattern rule's
        last held text) is held with the end."""
        if self._held is None:
            self._held = []

    async def settle(self) -> None:
        """Judge what is left of each choice's window and wait for every
        judgment (each within the judge's budget)."""
        for index in sorted(self._windows):
            rest = self._windows.pop(index)
            if rest.strip():
                self._submit(rest)
        await self._idle.wait()

    def release(self) -> bytes:
        """The held end, as the client gets it (for a stopped stream: the
        stop for choices still open, their later text dropped), and the
        shape's own end."""
        held, self._held = self._held or [], None
        docs = self._stops() if self.stopped else []
        for doc in held:
            choices = doc.get("choices") if isinstance(doc, dict) else None
            if self.stopped and isinstance(choices, list) and choices:
                if "usage" not in doc:
                    continue
                doc["choices"] = []
            docs.append(doc)
        out = self._shape.feed_docs(docs) if docs else b""
        return out + self._shape.finish()

    @property
    def refusal(self) -> LlmgwError | None:
        """For ``buffer_all``: the error to answer instead of the stream
        (400 ``content_filter``, or 503 ``judge_unavailable``), or None."""
        if not self.stopped:
            return None
        if self.stopped == UNAVAILABLE:
            return JudgeUnavailable(self._judge.model)
        return ContentFiltered("answer", list(self.stopped))

    def _window(self, index: int, text: str) -> None:
        window = self._windows.get(index, "") + text
        while len(window) >= STREAM_WINDOW_CHARS:
            self._submit(window[:STREAM_WINDOW_CHARS])
            window = window[STREAM_WINDOW_CHARS:]
        self._windows[index] = window

    def _submit(self, text: str) -> None:
        if self._nursery is None:  # pragma: no cover - attached before the first event
            raise RuntimeError("JudgedStream used before attach()")
        if not self._pending:
            self._idle = trio.Event()
        self._pending += 1
        self._nursery.start_soon(self._judged, text)

    async def _judged(self, text: str) -> None:
        try:
            found = await self._judging.judge.judge(
                self._judge, text, context_tokens=self._context_tokens, answer=True
            )
            refused = record_verdict(self._judge, found, self._verdict, "output")
            if refused and not self.stopped:
                self.stopped = refused
                self._verdict.stopped = True
                if self._held is None and self._emit is not None:
                    await self._emit(self._stop_now)
        finally:
            self._pending -= 1
            if not self._pending:
                self._idle.set()

    def _stop_now(self) -> bytes:
        """The stop of every open choice, as the client gets it (b"" once
        the end is held: :meth:`release` sends it then)."""
        if self._held is not None:
            return b""
        stops = self._stops()
        return self._shape.feed_docs(stops) if stops else b""

    def _stops(self) -> list[Any]:
        """The events that end every open choice with ``content_filter``."""
        open_, self._open = sorted(self._open), set()
        template = self._template or {}
        fields = {
            key: template[key]
            for key in ("id", "object", "created", "model", "system_fingerprint")
            if key in template
        }
        first = (template.get("choices") or [{}])[0]
        # A completions stream's choices carry ``text``, a chat stream's ``delta``.
        text = isinstance(first, dict) and "delta" not in first and "text" in first
        return [
            {
                **fields,
                "choices": [
                    {"index": i, "text": "", "finish_reason": CONTENT_FILTER}
                    if text
                    else {"index": i, "delta": {}, "finish_reason": CONTENT_FILTER}
                ],
            }
            for i in open_
        ]

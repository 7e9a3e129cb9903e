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
from typing import Any, Literal, Protocol

import orjson

from llmgw import errors
from llmgw.guard import ContentFiltered, Guard, Verdict
from llmgw.guard.judge import Judge, JudgeUnavailable
from llmgw.guard.output import OutputGuard
from llmgw.router.router import Router
from llmgw.store import ModelRecord

from .chat_stream import DONE, ChatChunkReader
from .guarded_fast import FastStream
from .sse import SseRelay, Usage
from .upstream import UpstreamError

__all__ = ["DocShape", "GuardedStream", "JudgeAsk", "PromptJudge", "guard_answer"]

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

    usage: Usage | None
    content_chunks: int
    done: bool

    def feed(self, data: bytes) -> bytes: ...
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
        #: Choice → its tool calls (by index) whose arguments are open.
        self._calls: dict[int, set[int]] = {}
        #: Choices stopped by a rule over a tool call's arguments.
        self._cut: set[int] = set()
        #: Rules that only flag, in front of the OpenAI relay: the engine's
        #: bytes go on as they came (read, not written again).
        self._passthrough = not guard.changes_text and isinstance(shape, SseRelay)

    @property
    def usage(self) -> Usage | None:
        return self._shape.usage

    @property
    def content_chunks(self) -> int:
        return self._shape.content_chunks

    @property
    def done(self) -> bool:
        return self._shape.done

    #: The fast path (:class:`~llmgw.gateway.guarded_fast.FastStream`),
    #: built on the first :meth:`feed`; False where there is none.
    _fast: FastStream | Literal[False] | None = None

    def feed(self, data: bytes) -> bytes:
        """Take engine bytes; return what the client gets now."""
        # -- the fast path (guarded_fast.py): plain content events in bytes
        fast = self._fast
        if fast is None:
            built = FastStream.build(
                self._shape, self._guard, self._guarded, self._flush, self._open
            )
            fast = self._fast = built if built is not None else False
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
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                index = _index(choice)
                delta = choice.get("delta")
                holder, field = (delta, "content") if isinstance(delta, dict) else (choice, "text")
                finish = choice.get("finish_reason")
                if guard.stopped(index) or index in self._cut:
                    holder.pop(field, None)
                    if isinstance(delta, dict):
                        delta.pop("tool_calls", None)
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
    another one than the first call).

    Raises (when called):
        LlmgwError: no such model, no (other) ready replica, the replica
            did not answer or answered other than 200 with a chat answer.
    """

    def __init__(self, router: Router, relay: _HasPool) -> None:
        self._router = router
        self._relay = relay

    async def __call__(self, name: str, body: dict[str, Any], tried: list[str]) -> str:
        model = self._router.resolve(name)
        if model is None:
            raise errors.NotFound(f"the judge model {name!r} is not in the catalog")
        endpoints = [e for e in self._router.endpoints(model) if e.label not in tried]
        if not endpoints:
            raise UpstreamError(f"no other replica of {name} to ask", before_response=True)
        endpoint = min(endpoints, key=lambda e: e.in_flight)
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
    """The judge on prompts, for the ``/v1`` routes: one :class:`Judge`
    (its verdict cache) per gateway."""

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
            found = await self.judge.judge(
                judge, text, context_tokens=_context_tokens(self._router.resolve(judge.model))
            )
        finally:
            verdict.seconds += time.perf_counter() - started
        if found is None:
            if judge.fail == "closed":
                verdict.note("judge:unavailable", "block")
                raise JudgeUnavailable(judge.model)
            verdict.note("judge:unavailable", "flag")
            return
        refused = found.refused(judge)
        if refused:
            for rule in refused:
                verdict.note(rule, "block")
            raise ContentFiltered("prompt", list(refused))
        if found.safety == "controversial":
            verdict.note("judge:controversial", "flag")

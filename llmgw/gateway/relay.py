"""Sending a routed request to its endpoint and the answer back to the
client (``docs/api.md``; ``docs/performance.md`` for why it is built so).

:meth:`Relay.forward` takes the attempts a :class:`~llmgw.router.router.Route`
hands out and tells it each one's outcome: the router decides whether to
try again. Each attempt goes out over a pooled keep-alive connection
(:class:`~llmgw.gateway.upstream.UpstreamPool`) with the endpoint's own key
(the client's ``Authorization`` never reaches an engine). The answer comes
back as it came (the client's bytes sent on unchanged while they name the
model served), translated for the Anthropic and Responses routes; a stream
is relayed as it arrives, the events in hand joined into one write, and its
usage read on the way (the engine is always asked for it). A request with
guard output rules (or ``restore``) has its answer guarded: whole, or each
stream event parsed once by :class:`~llmgw.gateway.guarded.GuardedStream`
and handed to the shape (``docs/guardrails.md``). Deadlines:
``router.timeouts.first_byte`` for the answer's head (cut sooner, and
tried elsewhere, when the replica leaves routing meanwhile), ``generation``
for the whole answer (then cut, 504).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

import orjson
import trio

from llmgw.asgi import Message, Send
from llmgw.errors import LlmgwError, describe
from llmgw.guard.output import OutputGuard
from llmgw.router.endpoint import Endpoint
from llmgw.router.router import Attempt, EndpointLost, Route
from llmgw.settings import ServerSettings

from . import anthropic, responses
from .caching import CacheSlot, Caching
from .errors import ApiError, api_error, engine_error, error_body_for
from .guarded import GuardedStream, JudgedStream, PromptJudge, guard_answer
from .http import JSON, NO_CACHE, SSE, answer
from .request import Outcome, Request
from .sse import SseRelay, Usage, usage_from
from .upstream import UpstreamError, UpstreamPool, UpstreamResponse, default_ssl_context

__all__ = ["CUT_ANSWER_S", "UPSTREAM_PATH", "HasSettings", "Relay"]

log = logging.getLogger("llmgw.gateway")

#: Kind → the engine route it is sent to (Anthropic and Responses requests
#: are translated to chat).
UPSTREAM_PATH: Final = {
    "chat": b"/v1/chat/completions",
    "completions": b"/v1/completions",
    "embeddings": b"/v1/embeddings",
    "messages": b"/v1/chat/completions",
    "responses": b"/v1/chat/completions",
}

#: The longest the last words to a client cut by the stop's grace (a
#: stream's error event, a 503) may take to send, seconds.
CUT_ANSWER_S: Final = 1.0

_BROKEN_STREAM_EVENT: Final = (
    b'data: {"error":{"message":"The replica answering broke off mid-answer; retry.",'
    b'"type":"server_error","code":"upstream_error","param":null}}\n\n'
)

_CUT_STREAM_EVENT: Final = (
    b'data: {"error":{"message":"The gateway is stopping; the answer was cut short. Retry.",'
    b'"type":"server_error","code":"server_shutting_down","param":null}}\n\n'
)


class HasSettings(Protocol):
    """Where the live settings are read (``router.timeouts``, per attempt)."""

    @property
    def settings(self) -> ServerSettings: ...


class _StreamShape(Protocol):
    """A streamed answer's relay or translator: engine SSE bytes in, client
    bytes out (:class:`SseRelay`, :class:`anthropic.MessagesStream`,
    :class:`responses.ResponsesStream`), or a :class:`GuardedStream` in front of one."""

    @property
    def usage(self) -> Usage | None: ...
    @property
    def content_chunks(self) -> int: ...
    @property
    def done(self) -> bool:
        """The answer's end is in hand (``[DONE]``, or the translated end)."""

    def feed(self, data: bytes) -> bytes: ...
    def finish(self) -> bytes: ...


class Relay:
    """Forwards requests to endpoints and relays their answers.

    Args:
        cluster: the live settings (timeouts).
        caching: where 200 answers are kept, for requests with a cache slot.
    """

    def __init__(self, cluster: HasSettings, caching: Caching) -> None:
        self._cluster = cluster
        self._caching = caching
        self._pools: dict[tuple[str, int, bool], UpstreamPool] = {}
        #: The judge on answers (and its verdict cache, shared with the
        #: prompts'), set by the ``/v1`` handler; None: answers not judged.
        self.judging: PromptJudge | None = None

    def set_connect_timeout(self, seconds: float) -> None:
        """A new ``router.timeouts.connect`` for every pool."""
        for pool in self._pools.values():
            pool.connect_timeout_s = seconds

    async def aclose(self) -> None:
        """Close the pooled connections."""
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            await pool.aclose()

    async def forward(
        self,
        send: Send,
        request: Request,
        route: Route,
        outcome: Outcome,
        keep: CacheSlot | None,
    ) -> None:
        """Send ``request`` on the attempts of ``route`` until one answers the
        client (good or not), filling in ``outcome``; a 200 answer is kept in
        ``keep`` when given.

        Raises:
            NotReady: the route found nothing to send to.
            ApiError: 502 ``upstream_error``: the last endpoint did not answer.
        """
        doc = request.doc
        body = request.body
        if request.stream and not request.pass_usage:
            # Always ask the engine for the final usage; the relay keeps it
            # from a client that did not ask.
            options = doc.get("stream_options")
            doc["stream_options"] = {**(options or {}), "include_usage": True}
            body = None
        # The client's own bytes go on while they name the model served.
        body_for = doc["model"] if body is not None else None
        while True:
            attempt = await route.next()
            upstream_model = attempt.upstream_model
            if body is None or body_for != upstream_model:
                doc["model"] = upstream_model
                body, body_for = orjson.dumps(doc), upstream_model
            outcome.served = attempt.model.name
            if await self._attempt(send, request, route, attempt, outcome, body, keep):
                return

    def pool(self, endpoint: Endpoint) -> UpstreamPool:
        """The pooled connections to ``endpoint`` (made on first use)."""
        key = (endpoint.host, endpoint.port, endpoint.tls)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = UpstreamPool(
                endpoint.host,
                endpoint.port,
                ssl_context=default_ssl_context() if endpoint.tls else None,
                connect_timeout_s=self._cluster.settings.router.timeouts.connect,
            )
        return pool

    async def _attempt(
        self,
        send: Send,
        request: Request,
        route: Route,
        attempt: Attempt,
        outcome: Outcome,
        body: bytes,
        keep: CacheSlot | None,
    ) -> bool:
        """One attempt. ``True`` when the client got an answer (good or
        not); ``False`` when it failed before any byte was sent and the
        route wants another attempt."""
        endpoint = attempt.endpoint
        path = endpoint.path_prefix.encode() + UPSTREAM_PATH[request.kind]
        headers = [
            *endpoint.auth_headers,
            (b"content-type", b"application/json"),
            (b"x-request-id", request.request_id.encode()),
        ]
        pool = self.pool(endpoint)
        outcome.replica = endpoint.label
        with attempt:
            sent_at = time.perf_counter()
            overhead_s = max(0.0, sent_at - request.started - route.waited_s)
            timeouts = self._cluster.settings.router.timeouts
            response: UpstreamResponse | None = None
            head_s = 0.0
            # One deadline for the attempt (a cancel scope costs several µs):
            # the first byte's, then, once the head came, the generation's.
            with trio.CancelScope(deadline=trio.current_time() + timeouts.first_byte) as deadline:
                try:
                    with attempt.waiting_first_byte():
                        response = await pool.request(b"POST", path, headers, body)
                except (UpstreamError, EndpointLost) as exc:
                    if route.unreachable(attempt, exc):
                        return False
                    raise _unanswered(request) from exc
                head_s = time.perf_counter() - sent_at
                async with response:
                    status = response.status
                    if status != 200 and route.turned_away(
                        attempt, status, response.header(b"retry-after")
                    ):
                        return False
                    deadline.deadline = trio.current_time() + timeouts.generation
                    await self._relay(send, request, outcome, endpoint, response, overhead_s, keep)
            if response is None:
                # No head within the first byte's deadline.
                slow = trio.TooSlowError()
                if route.unreachable(attempt, slow):
                    return False
                raise _unanswered(request) from slow
            status = response.status
            if deadline.cancelled_caught:
                log.warning("%s: generation over %.0f s; cut", endpoint.label, timeouts.generation)
                outcome.finish(504)
            ttft_s = outcome.ttft_s
            if ttft_s is None and not request.stream and status == 200:
                # A whole answer's head comes after its generation: the
                # replicas of one model see the same mix of requests, so
                # this still ranks them by speed.
                ttft_s = head_s
            route.answered(attempt, status, ttft_s)
            return True

    async def _relay(
        self,
        send: Send,
        request: Request,
        outcome: Outcome,
        endpoint: Endpoint,
        response: UpstreamResponse,
        overhead_s: float,
        keep: CacheSlot | None,
    ) -> None:
        status = response.status
        extra = [
            (b"x-request-id", request.request_id.encode()),
            (b"x-llmgw-replica", endpoint.label.encode()),
            (b"x-llmgw-overhead-ms", b"%.3f" % (overhead_s * 1000)),
            *request.rate_headers,
        ]
        try:
            if request.stream and status == 200:
                await self._relay_stream(send, request, outcome, response, extra, keep)
                return
            data = await response.read()
            content_type = (
                b"content-type",
                response.header(b"content-type") or b"application/json",
            )
            usage = None
            kind = request.kind
            if status == 200:
                try:
                    whole = orjson.loads(data)
                except orjson.JSONDecodeError:
                    whole = None
                usage = usage_from(whole)
                guard = _output_guard(request, outcome)
                if guard is not None and isinstance(whole, dict) and guard_answer(whole, guard):
                    data = orjson.dumps(whole)
                refusal = None
                if request.guard is not None and request.guard.judges_output:
                    refusal = await self._judge_answer(request, outcome, whole)
                if refusal is not None:
                    status = refusal.status
                    data = error_body_for(refusal, kind)
                    content_type = JSON
                    extra += refusal.headers
                elif kind == "messages" and isinstance(whole, dict):
                    data = orjson.dumps(anthropic.chat_to_message(whole, request.client_model))
                    content_type = JSON
                elif kind == "responses" and isinstance(whole, dict):
                    data = orjson.dumps(
                        responses.chat_to_response(
                            whole, request.client_model, request=request.client_doc
                        )
                    )
                    content_type = JSON
            elif status in (401, 403) and not endpoint.external:
                # The engine refused the gateway's engine key: not the
                # client's fault, and not to be shown as theirs.
                log.error("replica %s refused the engine key", endpoint.label)
                status = 502
                data = error_body_for(
                    ApiError(
                        502,
                        "The replica refused the gateway; retry.",
                        type="server_error",
                        code="upstream_error",
                    ),
                    kind,
                )
                content_type = JSON
            elif status in (401, 403):
                # The provider refused the key llmgw holds, and no other key
                # was left to try: the 401 goes back, said so the caller does
                # not take it for their own key.
                message = (
                    f"The outside provider of '{request.model}' refused the key llmgw holds "
                    f"for it ({endpoint.label}); your own key is fine. Tell the administrator."
                )
                data = error_body_for(
                    ApiError(
                        status, message, type="upstream_auth_error", code="external_key_refused"
                    ),
                    kind,
                )
                content_type = JSON
            else:
                data = error_body_for(engine_error(status, data), kind)
                content_type = JSON
            outcome.finish(status)
            outcome.usage = usage
            await answer(send, status, data, extra, content_type=content_type)
            if status == 200 and keep is not None and not _unjudged(outcome):
                self._caching.keep(keep, content_type[1], data, stream=False)
        except UpstreamError as exc:
            log.warning("answer from %s broke off: %s", endpoint.label, describe(exc))
            outcome.finish(502)

    async def _judge_answer(
        self, request: Request, outcome: Outcome, whole: object
    ) -> ApiError | None:
        """Judge a whole answer when the request's policies judge answers:
        the error to answer instead of it (400 ``content_filter``, 503
        ``judge_unavailable``), or None when it goes out."""
        guard, judging, verdict = request.guard, self.judging, outcome.verdict
        if (
            guard is None
            or not guard.judges_output
            or judging is None
            or verdict is None
            or not isinstance(whole, dict)
        ):
            return None
        try:
            await judging.answer(guard, whole, verdict)
        except LlmgwError as exc:
            return api_error(exc)
        return None

    async def _relay_stream(
        self,
        send: Send,
        request: Request,
        outcome: Outcome,
        response: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        keep: CacheSlot | None,
    ) -> None:
        shape, judged = _stream_shape(request, outcome, self.judging)
        outcome.progress = functools.partial(_stream_usage, request, shape)
        if judged is not None:
            await self._relay_judged_stream(
                send, request, outcome, response, headers, keep, shape, judged
            )
            return
        await send(_stream_head(headers))
        kept = _Kept(self._caching.max_entry_bytes) if keep is not None else None
        try:
            while chunk := await response.receive():
                out = shape.feed(chunk)
                if out:
                    if outcome.ttft_s is None and shape.content_chunks:
                        outcome.ttft_s = time.perf_counter() - request.started
                    if shape.done:
                        # The answer is complete once its end is on its way:
                        # a client may close right after it got everything.
                        # Its usage is known now: the send of this end waits
                        # for the usage row to be durable (completion.py).
                        outcome.finish(200)
                        outcome.usage = _stream_usage(request, shape)
                    if kept is not None:
                        kept.add(out)
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            ended = shape.done
            rest = shape.finish()
            outcome.finish(200)
            outcome.usage = _stream_usage(request, shape)
            await send({"type": "http.response.body", "body": rest, "more_body": False})
            body = kept.body(rest) if kept is not None and ended else None
            if keep is not None and body is not None:
                self._caching.keep(keep, SSE[1], body, stream=True)
        except UpstreamError:
            # The engine broke off mid-answer. Say so in the stream (the openai
            # client raises it as an APIError) and end the answer cleanly.
            if not shape.done:
                await send(
                    {"type": "http.response.body", "body": _broken(request), "more_body": False}
                )
            outcome.finish(502)
            raise
        except trio.Cancelled:
            # Cut short: the client left (then this is dropped), or the stop's
            # grace ran out (then the client is told, not left with a torn stream).
            if not shape.done:
                with trio.CancelScope(shield=True), trio.move_on_after(CUT_ANSWER_S):
                    await send(
                        {"type": "http.response.body", "body": _cut(request), "more_body": False}
                    )
            raise
        finally:
            # Counted even when the answer was cut short: the client is charged
            # for what was generated, and for its prompt as estimated when the
            # engine's own count never came.
            outcome.usage = _stream_usage(request, shape)

    async def _relay_judged_stream(
        self,
        send: Send,
        request: Request,
        outcome: Outcome,
        response: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        keep: CacheSlot | None,
        shape: _StreamShape,
        judged: JudgedStream,
    ) -> None:
        """:meth:`_relay_stream` with the judge on the answer
        (:class:`JudgedStream`): its judgments run beside the relay, whose
        writes and the judge's stop share one lock; the end goes once the
        last windows are judged. Under ``buffer_all`` nothing (not even the
        head) goes before the verdict, and a refusal is answered as an
        error (400 ``content_filter``, 503 ``judge_unavailable``)."""
        lock = trio.Lock()
        begun = False
        kept = _Kept(self._caching.max_entry_bytes) if keep is not None else None

        async def write(out: bytes, more: bool = True) -> None:
            nonlocal begun
            if not begun:
                begun = True
                await send(_stream_head(headers))
            if not out and more:
                return
            if outcome.ttft_s is None and shape.content_chunks:
                outcome.ttft_s = time.perf_counter() - request.started
            if kept is not None:
                kept.add(out)
            await send({"type": "http.response.body", "body": out, "more_body": more})

        async def emit(make: Callable[[], bytes]) -> None:
            async with lock:
                out = make()
                if out:
                    await write(out)

        verdict = outcome.verdict
        broke: UpstreamError | None = None
        rest = b""
        try:
            async with trio.open_nursery() as nursery:
                judged.attach(nursery, emit)
                try:
                    if not judged.buffer_all:
                        async with lock:
                            await write(b"")
                    while chunk := await response.receive():
                        await emit(functools.partial(shape.feed, chunk))
                    judged.ending()
                    async with lock:
                        rest = shape.finish()
                    waited = time.perf_counter()
                    await judged.settle()
                    if verdict is not None:
                        verdict.seconds += time.perf_counter() - waited
                except UpstreamError as exc:
                    # Raised out of the nursery below, not in a group.
                    broke = exc
                    nursery.cancel_scope.cancel()
                except trio.Cancelled:
                    # Cut short: the client left, or the stop's grace ran out.
                    if begun and not shape.done:
                        with trio.CancelScope(shield=True), trio.move_on_after(CUT_ANSWER_S):
                            await send(
                                {
                                    "type": "http.response.body",
                                    "body": _cut(request),
                                    "more_body": False,
                                }
                            )
                    raise
            if broke is not None:
                # The engine broke off mid-answer: said in the stream (or as
                # a 502 when nothing was sent yet).
                if not begun:
                    error = ApiError(
                        502,
                        "The replica answering broke off mid-answer; retry.",
                        type="server_error",
                        code="upstream_error",
                    )
                    await answer(send, 502, error_body_for(error, request.kind), headers)
                elif not shape.done:
                    await send(
                        {"type": "http.response.body", "body": _broken(request), "more_body": False}
                    )
                outcome.finish(502)
                raise broke
            refusal = judged.refusal if judged.buffer_all else None
            if refusal is not None:
                error = api_error(refusal)
                outcome.finish(error.status)
                outcome.usage = _stream_usage(request, shape)
                await answer(
                    send,
                    error.status,
                    error_body_for(error, request.kind),
                    [*error.headers, *headers],
                )
                return
            tail = rest + judged.release()
            outcome.finish(200)
            outcome.usage = _stream_usage(request, shape)
            async with lock:
                await write(tail, more=False)
            body = kept.body() if kept is not None and not judged.stopped else None
            if keep is not None and body is not None and not _unjudged(outcome):
                self._caching.keep(keep, SSE[1], body, stream=True)
        finally:
            # Counted even when the answer was cut short or refused.
            outcome.usage = _stream_usage(request, shape)


def _stream_head(headers: list[tuple[bytes, bytes]]) -> Message:
    """The start of a streamed 200 answer with ``headers``."""
    return {"type": "http.response.start", "status": 200, "headers": [SSE, NO_CACHE, *headers]}


class _Kept:
    """A streamed answer's bytes kept for the answer cache while they fit
    in ``limit_bytes``; past it none are."""

    __slots__ = ("_limit", "_parts", "_size")

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._parts: list[bytes] | None = []
        self._size = 0

    def add(self, out: bytes) -> None:
        """Keep ``out`` too, or give up when the answer no longer fits."""
        if self._parts is None:
            return
        self._size += len(out)
        if self._size > self._limit:
            self._parts = None
        else:
            self._parts.append(out)

    def body(self, last: bytes = b"") -> bytes | None:
        """What was kept and then ``last``; None when it did not fit."""
        return None if self._parts is None else b"".join((*self._parts, last))


def _unjudged(outcome: Outcome) -> bool:
    """The judge gave no verdict (served under ``fail: open``): such an
    answer is not kept in the answer cache."""
    verdict = outcome.verdict
    return verdict is not None and "judge:unavailable" in verdict.actions


def _stream_usage(request: Request, shape: _StreamShape) -> Usage | None:
    """The engine's usage, or the prompt as estimated and the content
    chunks seen when its own count never came."""
    usage = shape.usage
    if usage is None and shape.content_chunks:
        usage = Usage(prompt_tokens=request.prompt_estimate, completion_tokens=shape.content_chunks)
    return usage


def _output_guard(request: Request, outcome: Outcome) -> OutputGuard | None:
    """The request's output rules, when they may look at or change its answer."""
    guard, verdict, redactor = request.guard, outcome.verdict, request.redactor
    if guard is None or verdict is None or redactor is None:
        return None
    output = OutputGuard(guard.output, verdict, redactor, restore=guard.input.restore)
    return output if output.active else None


def _stream_shape(
    request: Request, outcome: Outcome, judging: PromptJudge | None
) -> tuple[_StreamShape, JudgedStream | None]:
    """The stream's shape, behind the output rules when they apply; the
    judge's part of it when the request's policies judge answers."""
    shape: anthropic.MessagesStream | responses.ResponsesStream | SseRelay | JudgedStream
    if request.kind == "messages":
        shape = anthropic.MessagesStream(
            request.client_model,
            anthropic.new_message_id(),
            input_tokens=request.prompt_estimate,
        )
    elif request.kind == "responses":
        shape = responses.ResponsesStream(
            request.client_model, responses.new_response_id(), request=request.client_doc
        )
    else:
        shape = SseRelay(pass_usage=request.pass_usage)
    judged = None
    policies, verdict = request.guard, outcome.verdict
    if (
        policies is not None
        and policies.judges_output
        and policies.judge is not None
        and judging is not None
        and verdict is not None
    ):
        shape = judged = JudgedStream(
            shape, judging, policies.judge, verdict, buffer_all=policies.buffer_all
        )
    guard = _output_guard(request, outcome)
    return (shape if guard is None else GuardedStream(shape, guard)), judged


def _unanswered(request: Request) -> ApiError:
    """502 ``upstream_error``: the last replica tried did not answer."""
    return ApiError(
        502,
        f"The replica serving '{request.model}' did not answer; retry.",
        type="server_error",
        code="upstream_error",
    )


def _broken(request: Request) -> bytes:
    if request.kind == "messages":
        return anthropic.error_event(
            "api_error", "The replica answering broke off mid-answer; retry."
        )
    return _BROKEN_STREAM_EVENT


def _cut(request: Request) -> bytes:
    if request.kind == "messages":
        return anthropic.error_event(
            "overloaded_error", "The gateway is stopping; the answer was cut short. Retry."
        )
    return _CUT_STREAM_EVENT

"""``llmgw bench load``: streamed chat completions against any OpenAI server.

The load generator must not be the bottleneck: it shares one core with the
engine it measures and still drives several hundred 64-token streams a
second. So nothing heavy is on its hot path:

- keep-alive connections opened with :func:`trio.open_tcp_stream`, written
  with pre-built HTTP/1.1 request bytes (only a 10-digit request number
  changes, so the body length never does);
- one task runs them all (:class:`_Reactor`): it waits on a private
  :mod:`selectors` selector and reads every ready socket with
  :func:`os.read`, since waking a trio task per read costs more than all the
  parsing of that read;
- the answers are parsed by hand, in pieces, by :mod:`llmgw.bench.response`;
  the outcomes are tallied and summed up by :mod:`llmgw.bench.results`.

Two shapes of load:

- **closed loop** (``concurrency``): N clients, each sending its next request
  as soon as the previous one ended; a request's clock starts when it is
  sent (or when its connection is dialled, for a client reconnecting).
- **open loop** (``rate_per_s``): requests start on a fixed, uniformly spaced
  schedule whatever the answers do; a request's clock starts at its
  scheduled time (so a late start counts against the server, no coordinated
  omission). At most :data:`MAX_IN_FLIGHT` run at once; a start beyond that
  is an ``overloaded`` error.

Requests that start during the warm-up are not counted, errors included.
Every user message starts with a unique word (``r0000000042``) so an
answer cache in front of the engine never answers from memory.
"""

from __future__ import annotations

import heapq
import math
import os
import selectors
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import attrs
import orjson
import trio

from .response import HttpProtocolError, ResponseParser
from .results import LoadResult, Percentiles, Tally

if TYPE_CHECKING:
    pass

__all__ = [
    "MAX_IN_FLIGHT",
    "MAX_RATE_PER_S",
    "LoadConfig",
    "run_load",
]

#: Open loop: the most requests in flight at once; later starts are errors.
#: Also the most closed-loop clients.
MAX_IN_FLIGHT: Final = 4096

#: What a refusal most likely means for someone running a load test.
_STATUS_HINTS: Final = {
    401: " (wrong or missing --key?)",
    404: " (no such model: see --model)",
    429: " (rate limited: the key's limits)",
}
#: The highest open-loop rate accepted, in requests per second.
MAX_RATE_PER_S: Final = 100_000.0
#: Bytes asked of the socket per read.
READ_SIZE: Final = 65536
#: Seconds the run may take beyond warm-up + duration + one request deadline.
RUN_SLACK_S: Final = 10.0
#: How often requests are checked against their deadline, in seconds.
SWEEP_S: Final = 0.05
#: Back-off after a failed connect, first and largest, in seconds.
CONNECT_BACKOFF_S: Final = 0.01
CONNECT_BACKOFF_MAX_S: Final = 0.5
#: Closed loop: how long a client waits after a 429 or 503 before its next
#: request when the answer has no ``Retry-After``, in seconds.
REFUSED_BACKOFF_S: Final = 1.0

_PATH: Final = "/v1/chat/completions"
#: The user message's words after the request number, repeated as needed.
_PROMPT_TEXT: Final = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch "
    "from an old oak tree near the quiet river bank at dusk"
)
_ID_PLACEHOLDER: Final = "r0000000000"


# -- configuration -------------------------------------------------------------------


def _positive(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be positive and finite, not {value!r}")


def _non_negative(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be non-negative and finite, not {value!r}")


@attrs.frozen(kw_only=True)
class LoadConfig:
    """One load run. Give exactly one of ``concurrency`` and ``rate_per_s``.

    Attributes:
        url: the server's base URL, ``http://HOST:PORT`` (a trailing ``/v1``
            is fine); requests go to ``/v1/chat/completions``. Plain HTTP only.
        api_key: sent as ``Authorization: Bearer …``; empty sends no header.
        model: the model asked for.
        concurrency: closed loop: this many clients (1 to
            :data:`MAX_IN_FLIGHT`), each sending its next request as soon as
            the previous one ended.
        rate_per_s: open loop: requests started per second (at most
            :data:`MAX_RATE_PER_S`), uniformly spaced, whatever the answers do.
        duration_s: the measured window, in seconds (after the warm-up).
        warmup_s: seconds of load first whose requests are not counted.
        prompt_words: words in the user message (one of them is the request
            number).
        max_tokens: the request's ``max_tokens``.
        include_usage: ask for ``stream_options.include_usage``.
        extra_body: more fields of each request's JSON body (e.g.
            ``{"ignore_eos": true}`` for an engine that takes it, so every
            answer is ``max_tokens`` long); they may not replace ``model``,
            ``messages``, ``stream`` or ``max_tokens`` (its own option).
        request_timeout_s: each request's deadline, in seconds; a request
            past it is a ``timeout`` error.

    Raises:
        ValueError: both or neither of ``concurrency`` and ``rate_per_s``,
            a value out of range, a URL that is not ``http://``, or an
            ``extra_body`` field that would replace ``model``, ``messages``,
            ``stream`` or ``max_tokens``.
    """

    url: str
    api_key: str = ""
    model: str
    concurrency: int | None = None
    rate_per_s: float | None = None
    duration_s: float = attrs.field(default=10.0, validator=_positive)
    warmup_s: float = attrs.field(default=1.0, validator=_non_negative)
    prompt_words: int = attrs.field(default=16, validator=_positive)
    max_tokens: int = attrs.field(default=64, validator=_positive)
    include_usage: bool = True
    extra_body: Mapping[str, Any] = attrs.field(factory=dict)
    request_timeout_s: float = attrs.field(default=30.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_per_s is None):
            raise ValueError("give exactly one of concurrency and rate_per_s")
        if self.concurrency is not None and not 1 <= self.concurrency <= MAX_IN_FLIGHT:
            raise ValueError(f"concurrency must be 1 to {MAX_IN_FLIGHT}, not {self.concurrency}")
        if self.rate_per_s is not None and not 0 < self.rate_per_s <= MAX_RATE_PER_S:
            raise ValueError(f"rate_per_s must be over 0 and at most {MAX_RATE_PER_S:g}")
        _Target.parse(self.url)
        kept = sorted({"model", "messages", "stream", "max_tokens"} & set(self.extra_body))
        if kept:
            raise ValueError(f"extra_body may not set {', '.join(kept)}")


# -- the requests -------------------------------------------------------------------


@attrs.frozen
class _Target:
    host: str
    port: int
    path: str
    host_header: str

    @classmethod
    def parse(cls, url: str) -> _Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r} is not an http://HOST:PORT URL")
        try:
            port = parts.port or 80
        except ValueError:
            raise ValueError(f"{url!r} has a bad port") from None
        base = parts.path.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        return cls(parts.hostname, port, base + _PATH, parts.netloc)


class _RequestMaker:
    """Request bytes for request number ``n``: pre-built around the number."""

    __slots__ = ("_head", "_tail")

    def __init__(self, config: LoadConfig, target: _Target) -> None:
        vocabulary = _PROMPT_TEXT.split()
        words = [_ID_PLACEHOLDER]
        words += (vocabulary[i % len(vocabulary)] for i in range(config.prompt_words - 1))
        doc: dict[str, Any] = {
            "model": config.model,
            "messages": [{"role": "user", "content": " ".join(words)}],
            "max_tokens": config.max_tokens,
            "stream": True,
        }
        if config.include_usage:
            doc["stream_options"] = {"include_usage": True}
        doc.update(config.extra_body)
        body = orjson.dumps(doc)
        at = body.index(b'"content":"' + _ID_PLACEHOLDER.encode()) + len(b'"content":"')
        lines = [
            f"POST {target.path} HTTP/1.1",
            f"Host: {target.host_header}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
        ]
        if config.api_key:
            lines.append(f"Authorization: Bearer {config.api_key}")
        lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        self._head = head + body[:at]
        self._tail = body[at + len(_ID_PLACEHOLDER) :]

    def make(self, number: int) -> bytes:
        return b"%sr%010d%s" % (self._head, number % 10_000_000_000, self._tail)


def _connect_error(exc: OSError) -> str:
    """A short string for a failed connect."""
    seen: list[BaseException] = []
    todo: list[BaseException] = [exc]
    while todo:
        error = todo.pop()
        seen.append(error)
        if isinstance(error, BaseExceptionGroup):
            todo.extend(error.exceptions)
        for linked in (error.__cause__, error.__context__):
            if linked is not None and linked not in seen:
                todo.append(linked)
    if any(isinstance(error, ConnectionRefusedError) for error in seen):
        return "connection refused"
    if any(isinstance(error, TimeoutError) for error in seen):
        return "connect timed out"
    for error in seen:
        if isinstance(error, OSError) and error.strerror:
            return f"connect failed: {error.strerror.lower()}"
    return "connect failed"


# -- the run -------------------------------------------------------------------------


class _Connection:
    """A keep-alive connection and the request on it, if any."""

    __slots__ = (
        "deadline",
        "fd",
        "out",
        "parser",
        "retried",
        "started",
        "stream",
        "used",
        "writing",
    )

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.fd = stream.socket.fileno()
        self.parser: ResponseParser | None = None  # None between requests
        self.started = 0.0  # the request's start (its clock's zero)
        self.deadline = 0.0
        self.retried = False  # the request is already on its second connection
        self.out = b""  # request bytes the socket did not take yet
        self.writing = False  # registered for EVENT_WRITE, to send `out`
        self.used = 0  # answers read on it


class _Reactor:
    """Runs every connection of a load run from one task.

    Waking a trio task per socket read costs more than all the HTTP and
    event parsing of that read, so the connections are registered with a
    private :mod:`selectors` selector; one task waits until the selector's
    own descriptor is readable (:func:`trio.lowlevel.wait_readable`), then
    reads and parses every ready connection synchronously, and writes the
    next requests. Connecting (and the back-off after a failed connect) runs
    in short tasks that hand the new connection over.
    """

    def __init__(self, config: LoadConfig, stats: Tally, began: float) -> None:
        self.config = config
        self.stats = stats
        self.target = _Target.parse(config.url)
        self.maker = _RequestMaker(config, self.target)
        self.timeout = config.request_timeout_s
        self.selector = selectors.DefaultSelector()
        self.connections: set[_Connection] = set()
        self.idle: list[_Connection] = []  # open loop: kept between requests
        self.busy = 0  # connections with a request on them
        self.connecting = 0  # connect tasks running
        self.number = 0  # requests made
        self.nursery: trio.Nursery | None = None
        rate = config.rate_per_s
        self.interval = 1.0 / rate if rate else 0.0
        self.first = began
        self.index = 0
        self.next_at = began if rate else math.inf  # the open loop's next start
        #: Closed loop: clients told to wait (429, 503), by when they send again.
        self.waiting: list[tuple[float, int, _Connection]] = []

    # -- the loop

    async def run(self, nursery: trio.Nursery) -> None:
        """Run the load until its window ended and every request finished."""
        self.nursery = nursery
        if self.config.concurrency is not None:
            for _ in range(self.config.concurrency):
                self._spawn_connect(None, retried=False)
        end = self.stats.end
        selector = self.selector
        next_sweep = trio.current_time() + SWEEP_S
        while True:
            # One cancel scope serves many waits (its deadline moves); a new
            # one is needed only after its deadline fired.
            with trio.CancelScope() as wake:
                while True:
                    now = trio.current_time()
                    if self.next_at <= now:
                        self._start_due(now)
                    if self.waiting and self.waiting[0][0] <= now:
                        self._resume(now)
                    if now >= next_sweep:
                        self._sweep(now)
                        next_sweep = now + SWEEP_S
                    if now >= end and not (self.busy or self.connecting) and self.next_at >= end:
                        return
                    wake_at = min(next_sweep, self.next_at)
                    if self.waiting:
                        wake_at = min(wake_at, self.waiting[0][0])
                    if wake.deadline != wake_at:
                        wake.deadline = wake_at
                    await _wait_readable(selector)
                    ready = selector.select(0)
                    if ready:
                        self._ready(ready, trio.current_time())

    def _ready(self, ready: list[tuple[selectors.SelectorKey, int]], now: float) -> None:
        """Read, parse and answer every connection the selector found ready."""
        read = os.read
        for key, events in ready:
            connection: _Connection = key.data
            if events & selectors.EVENT_WRITE:
                self._write(connection, now)
                if connection.fd < 0:
                    continue
            if not events & selectors.EVENT_READ:
                continue
            try:
                data = read(connection.fd, READ_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                self._broken(connection, "connection reset", now)
                continue
            parser = connection.parser
            if parser is None:  # idle: the server closed it (or talks out of turn)
                self._close(connection)
                continue
            if not data:
                if parser.ends_at_close:
                    self._finish(connection, parser, now)
                else:
                    self._broken(connection, "connection closed", now)
                continue
            try:
                done = parser.feed(data, now)
            except HttpProtocolError as exc:
                self._fail(connection, f"bad response: {exc}"[:80], now)
                continue
            if done:
                self._finish(connection, parser, now)

    def close_all(self) -> None:
        """Close every connection and the selector."""
        for connection in list(self.connections):
            self._close(connection)
        self.idle.clear()
        self.selector.close()

    # -- starting requests

    def _start_due(self, now: float) -> None:
        """Open loop: start every request whose time has come."""
        end = self.stats.end
        while self.next_at <= now:
            at = self.next_at
            self.index += 1
            self.next_at = self.first + self.index * self.interval
            if self.next_at >= end:
                self.next_at = math.inf
            if at >= end:
                break
            if self.busy + self.connecting >= MAX_IN_FLIGHT:
                self.stats.error(at, "overloaded")
            elif self.idle:
                self._send(self.idle.pop(), at, now, retried=False)
            else:
                self._spawn_connect(at, retried=False)

    def _send(self, connection: _Connection, started: float, now: float, *, retried: bool) -> None:
        self.number += 1
        connection.parser = ResponseParser()
        connection.started = started
        connection.deadline = started + self.timeout
        connection.retried = retried
        self.busy += 1
        connection.out = self.maker.make(self.number)
        self._write(connection, now)

    def _write(self, connection: _Connection, now: float) -> None:
        data = connection.out
        try:
            sent = os.write(connection.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._broken(connection, "connection reset", now)
            return
        connection.out = data[sent:]
        if connection.out and not connection.writing:
            self.selector.modify(
                connection.fd, selectors.EVENT_READ | selectors.EVENT_WRITE, connection
            )
            connection.writing = True
        elif connection.writing and not connection.out:
            self.selector.modify(connection.fd, selectors.EVENT_READ, connection)
            connection.writing = False

    # -- ending requests

    def _finish(self, connection: _Connection, parser: ResponseParser, now: float) -> None:
        """The answer was read to its end."""
        self.busy -= 1
        connection.parser = None
        connection.used += 1
        scanner = parser.scanner
        if scanner is None:
            hint = _STATUS_HINTS.get(parser.status, "")
            self.stats.error(connection.started, f"HTTP {parser.status}{hint}")
        elif scanner.error:
            self.stats.error(connection.started, "error event in stream")
        else:
            self.stats.ok(connection.started, now, scanner)
        if not parser.keep_alive or parser.rest:
            self._close(connection)
            self._replace(now)
        elif self.config.concurrency is None:
            self.idle.append(connection)
        elif parser.status in (429, 503) and now < self.stats.end:
            # Told to wait: asking again at once would only flood the server
            # with refusals (and count each as an error).
            wait_s = parser.retry_after_s
            due = now + (REFUSED_BACKOFF_S if wait_s is None else wait_s)
            if due < self.stats.end:
                heapq.heappush(self.waiting, (due, id(connection), connection))
            else:
                self._close(connection)
        elif now < self.stats.end:
            self._send(connection, now, now, retried=False)
        else:
            self._close(connection)

    def _resume(self, now: float) -> None:
        """Closed loop: the clients whose wait after a 429 or 503 is over send again."""
        waiting = self.waiting
        while waiting and waiting[0][0] <= now:
            _, _, connection = heapq.heappop(waiting)
            if now >= self.stats.end:
                self._close(connection)
            elif connection.fd >= 0:
                self._send(connection, now, now, retried=False)
            else:  # the server closed it while it waited
                self._spawn_connect(None, retried=False)

    def _broken(self, connection: _Connection, what: str, now: float) -> None:
        """The connection closed or broke: a stale keep-alive connection
        (nothing of the answer yet) gets its request once more on a new one."""
        parser = connection.parser
        if parser is None:
            self._close(connection)
            return
        if not parser.received and connection.used and not connection.retried:
            self.busy -= 1
            self._close(connection)
            self._spawn_connect(connection.started, retried=True)
            return
        self._fail(connection, what, now)

    def _fail(self, connection: _Connection, what: str, now: float) -> None:
        if connection.parser is not None:
            self.busy -= 1
            connection.parser = None
            self.stats.error(connection.started, what)
        self._close(connection)
        self._replace(now)

    def _sweep(self, now: float) -> None:
        """Fail the requests past their deadline."""
        for connection in [c for c in self.connections if c.parser is not None]:
            if now >= connection.deadline:
                self._fail(connection, "timeout", now)

    def _close(self, connection: _Connection) -> None:
        if connection.fd < 0:
            return
        self.selector.unregister(connection.fd)
        connection.fd = -1
        connection.stream.socket.close()
        self.connections.discard(connection)
        if connection.parser is None and connection in self.idle:
            self.idle.remove(connection)

    def _replace(self, now: float) -> None:
        """Closed loop: a client whose connection closed connects again."""
        if self.config.concurrency is not None and now < self.stats.end:
            self._spawn_connect(None, retried=False)

    # -- connecting

    def _spawn_connect(self, started: float | None, *, retried: bool) -> None:
        assert self.nursery is not None
        self.connecting += 1
        self.nursery.start_soon(self._connect, started, retried)

    async def _connect(self, started: float | None, retried: bool) -> None:
        """Connect, then send a request starting at ``started`` (now when
        None). A closed-loop client whose connect failed tries again after a
        back-off; an open-loop request is then over."""
        backoff = CONNECT_BACKOFF_S
        end = self.stats.end
        try:
            while True:
                start = trio.current_time() if started is None else started
                if started is None and start >= end:
                    return
                stream: trio.SocketStream | None = None
                error = "timeout"
                with trio.move_on_at(start + self.timeout):
                    try:
                        stream = await trio.open_tcp_stream(self.target.host, self.target.port)
                    except OSError as exc:
                        error = _connect_error(exc)
                if stream is not None:
                    connection = _Connection(stream)
                    self.connections.add(connection)
                    self.selector.register(connection.fd, selectors.EVENT_READ, connection)
                    self._send(connection, start, trio.current_time(), retried=retried)
                    return
                self.stats.error(start, error)
                if self.config.concurrency is None:
                    return
                started = None
                retried = False
                await trio.sleep(max(0.0, min(backoff, end - trio.current_time())))
                backoff = min(2 * backoff, CONNECT_BACKOFF_MAX_S)
        finally:
            self.connecting -= 1


_wait_readable: Final = trio.lowlevel.wait_readable


async def run_load(config: LoadConfig) -> LoadResult:
    """Run the load ``config`` describes, and measure it.

    The run takes ``warmup_s + duration_s`` seconds plus the longest request
    in flight at the end; it is bounded as a whole by
    ``trio.fail_after(warmup_s + duration_s + request_timeout_s + RUN_SLACK_S)``.
    Every connection it opens is closed before it returns. Failed requests
    are counted and sampled, never raised; a closed-loop client whose
    connection broke connects again and goes on (after a failed connect,
    with a back-off from 10 ms to 0.5 s). Needs a POSIX system (it reads
    and writes sockets with :func:`os.read` and :func:`os.write`).

    Raises:
        trio.TooSlowError: the run overran its bound.
    """
    bound = config.warmup_s + config.duration_s + config.request_timeout_s + RUN_SLACK_S
    cpu_before = time.process_time()
    with trio.fail_after(bound):
        began = trio.current_time()
        start = began + config.warmup_s
        stats = Tally(start, start + config.duration_s)
        reactor = _Reactor(config, stats, began)
        try:
            async with trio.open_nursery() as nursery:
                await reactor.run(nursery)
        finally:
            reactor.close_all()
        wall_s = trio.current_time() - began
    cpu_s = time.process_time() - cpu_before
    duration = config.duration_s
    return LoadResult(
        requests=stats.requests,
        errors=stats.errors,
        error_samples=tuple(stats.samples),
        duration_s=duration,
        requests_per_s=stats.requests / duration,
        tokens_per_s=stats.tokens / duration,
        ttft_ms=Percentiles.of(stats.ttfts),
        total_ms=Percentiles.of(stats.totals),
        itl_ms=Percentiles.of(stats.itls),
        concurrency=config.concurrency,
        rate_per_s=config.rate_per_s,
        tokens=stats.tokens,
        cpu_s=cpu_s,
        wall_s=wall_s,
        ttfts_ms=tuple(stats.ttfts),
        totals_ms=tuple(stats.totals),
        itls_ms=tuple(stats.itls),
    )

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
- the answer's status line and the headers that frame its body are parsed
  by hand (:class:`ResponseParser`), the body is de-chunked
  (:class:`ChunkedDecoder`) or cut at ``Content-Length``;
- server-sent events are counted by scanning bytes
  (:class:`StreamScanner`); JSON is parsed only for the final ``usage`` chunk
  (or for a server that puts spaces in its JSON).

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

import math
import os
import selectors
import time
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import click
import orjson
import trio

__all__ = [
    "MAX_IN_FLIGHT",
    "MAX_RATE_PER_S",
    "ChunkedDecoder",
    "LoadConfig",
    "LoadResult",
    "Percentiles",
    "ProtocolError",
    "ResponseParser",
    "StreamScanner",
    "format_result",
    "load_command",
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
#: The largest response head accepted, in bytes.
MAX_HEAD_BYTES: Final = 64 * 1024
#: The longest chunk-size or trailer line accepted, in bytes.
MAX_CHUNK_LINE_BYTES: Final = 4096
#: The largest single server-sent event accepted, in bytes.
MAX_EVENT_BYTES: Final = 1024 * 1024
#: The stretch at the end of each batch of events searched for the usage
#: chunk and error events, in bytes.
TAIL_BYTES: Final = 4096
#: Distinct error strings kept in :attr:`LoadResult.error_samples`.
MAX_ERROR_SAMPLES: Final = 5
#: Seconds the run may take beyond warm-up + duration + one request deadline.
RUN_SLACK_S: Final = 10.0
#: How often requests are checked against their deadline, in seconds.
SWEEP_S: Final = 0.05
#: Back-off after a failed connect, first and largest, in seconds.
CONNECT_BACKOFF_S: Final = 0.01
CONNECT_BACKOFF_MAX_S: Final = 0.5

_PATH: Final = "/v1/chat/completions"
#: The user message's words after the request number, repeated as needed.
_PROMPT_TEXT: Final = (
    "the quick brown fox jumps over a lazy dog while seven wise owls watch "
    "from an old oak tree near the quiet river bank at dusk"
)
_ID_PLACEHOLDER: Final = "r0000000000"


# -- configuration and results ---------------------------------------------------------


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
        request_timeout_s: each request's deadline, in seconds; a request
            past it is a ``timeout`` error.

    Raises:
        ValueError: both or neither of ``concurrency`` and ``rate_per_s``,
            a value out of range, or a URL that is not ``http://``.
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
    request_timeout_s: float = attrs.field(default=30.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate_per_s is None):
            raise ValueError("give exactly one of concurrency and rate_per_s")
        if self.concurrency is not None and not 1 <= self.concurrency <= MAX_IN_FLIGHT:
            raise ValueError(f"concurrency must be 1 to {MAX_IN_FLIGHT}, not {self.concurrency}")
        if self.rate_per_s is not None and not 0 < self.rate_per_s <= MAX_RATE_PER_S:
            raise ValueError(f"rate_per_s must be over 0 and at most {MAX_RATE_PER_S:g}")
        _Target.parse(self.url)


@attrs.frozen
class Percentiles:
    """Percentiles and mean of some durations, in milliseconds (all 0.0 when
    there were none)."""

    p50: float
    p95: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        """Percentiles of ``values`` (linear interpolation between ranks)."""
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0)
        ordered = sorted(values)
        return cls(
            _percentile(ordered, 0.50),
            _percentile(ordered, 0.95),
            _percentile(ordered, 0.99),
            math.fsum(ordered) / len(ordered),
        )

    def to_json(self) -> dict[str, float]:
        """``{"p50": …, "p95": …, "p99": …, "mean": …}`` in ms."""
        return {"p50": self.p50, "p95": self.p95, "p99": self.p99, "mean": self.mean}


def _percentile(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@attrs.frozen(kw_only=True)
class LoadResult:
    """What a load run measured. Durations are in milliseconds unless named ``_s``.

    Attributes:
        requests: requests started in the measured window that ended well.
        errors: requests started in the window that failed (and open-loop
            starts skipped as ``overloaded``).
        error_samples: up to :data:`MAX_ERROR_SAMPLES` distinct short error
            strings, e.g. ``HTTP 429``, ``timeout``, ``connection refused``.
        duration_s: the measured window, in seconds.
        requests_per_s: ``requests / duration_s``.
        tokens_per_s: streamed tokens of those requests per second: the
            ``usage.completion_tokens`` when sent, else one per content chunk.
        ttft_ms: time to the first content chunk.
        total_ms: time to the end of the answer.
        itl_ms: per request ``(last token time - first token time) / (tokens - 1)``
            (requests with two tokens or more), then percentiles over requests.
        concurrency: the closed loop's clients, or None.
        rate_per_s: the open loop's offered rate, or None.
        tokens: streamed tokens counted (see ``tokens_per_s``).
        cpu_s: CPU seconds this process used during the whole run (warm-up
            and tail included).
        wall_s: wall-clock seconds of the whole run.
        ttfts_ms, totals_ms, itls_ms: the per-request values behind the
            percentiles, in the order the requests ended.
    """

    requests: int
    errors: int
    error_samples: tuple[str, ...]
    duration_s: float
    requests_per_s: float
    tokens_per_s: float
    ttft_ms: Percentiles
    total_ms: Percentiles
    itl_ms: Percentiles
    concurrency: int | None
    rate_per_s: float | None
    tokens: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    ttfts_ms: tuple[float, ...] = ()
    totals_ms: tuple[float, ...] = ()
    itls_ms: tuple[float, ...] = ()

    @property
    def cpu_share(self) -> float:
        """``cpu_s / wall_s``: the fraction of one core this process used."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self, *, samples: bool = False) -> dict[str, Any]:
        """A plain JSON-able dict of the fields (the per-request lists only
        with ``samples=True``)."""
        doc: dict[str, Any] = {
            "requests": self.requests,
            "errors": self.errors,
            "error_samples": list(self.error_samples),
            "duration_s": self.duration_s,
            "requests_per_s": self.requests_per_s,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "ttft_ms": self.ttft_ms.to_json(),
            "total_ms": self.total_ms.to_json(),
            "itl_ms": self.itl_ms.to_json(),
            "concurrency": self.concurrency,
            "rate_per_s": self.rate_per_s,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "cpu_share": self.cpu_share,
        }
        if samples:
            doc["ttfts_ms"] = list(self.ttfts_ms)
            doc["totals_ms"] = list(self.totals_ms)
            doc["itls_ms"] = list(self.itls_ms)
        return doc


# -- the wire ------------------------------------------------------------------------


class ProtocolError(Exception):
    """The server broke HTTP/1.1 or the event stream (message says how)."""


class ChunkedDecoder:
    """Removes ``Transfer-Encoding: chunked`` framing from bytes fed in any
    pieces.

    :meth:`feed` returns the payload bytes complete so far; once the last
    (zero) chunk and the trailers have been read, :attr:`done` is true and
    :attr:`rest` holds any bytes fed past the end.
    """

    __slots__ = ("_crlf", "_pending", "_remaining", "_trailer", "done", "rest")

    def __init__(self) -> None:
        self._pending = b""
        self._remaining = 0  # payload bytes left in the current chunk
        self._crlf = False  # the CRLF after a chunk's payload is due
        self._trailer = False  # past the last chunk, reading trailer lines
        self.done = False
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        """The payload in ``data`` (and what was held back from before).

        Raises:
            ProtocolError: a bad chunk-size line or missing CRLF.
        """
        if self.done:
            self.rest += data
            return b""
        if not (self._pending or self._remaining or self._crlf or self._trailer):
            # The common case: a read holding exactly one whole chunk.
            eol = data.find(b"\r\n", 0, 18)
            if eol > 0:
                try:
                    chunk = int(data[:eol], 16)
                except ValueError:
                    chunk = 0
                end = eol + 2 + chunk
                if chunk > 0 and len(data) == end + 2 and data.endswith(b"\r\n"):
                    return data[eol + 2 : end]
        if self._pending:
            data = self._pending + data
            self._pending = b""
        out: list[bytes] = []
        pos = 0
        size = len(data)
        while pos < size:
            remaining = self._remaining
            if remaining:
                if size - pos > remaining:
                    out.append(data[pos : pos + remaining])
                    pos += remaining
                    self._remaining = 0
                    self._crlf = True
                else:
                    out.append(data[pos:] if pos else data)
                    self._remaining = remaining - (size - pos)
                    self._crlf = self._remaining == 0
                    pos = size
                continue
            if self._crlf:
                if size - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                pos += 2
                self._crlf = False
                continue
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                break
            if self._trailer:
                if eol == pos:
                    self.done = True
                    self.rest = data[pos + 2 :]
                    pos = size
                    break
                pos = eol + 2  # a trailer field: ignored
                continue
            line = data[pos:eol].split(b";", 1)[0].strip()
            try:
                chunk = int(line, 16)
            except ValueError:
                chunk = -1
            if chunk < 0 or not line.isalnum():
                raise ProtocolError(f"bad chunk size line {data[pos:eol][:40]!r}")
            pos = eol + 2
            if chunk:
                self._remaining = chunk
            else:
                self._trailer = True
        if pos < size:
            self._pending = data[pos:]
            if len(self._pending) > MAX_CHUNK_LINE_BYTES:
                raise ProtocolError("chunk size or trailer line too long")
        if len(out) == 1:
            return out[0]
        return b"".join(out)


_CONTENT: Final = b'"content":"'
_CONTENT_EMPTY: Final = b'"content":""'
_USAGE: Final = b'"usage":{'
_ERROR: Final = b'{"error"'


class StreamScanner:
    """Counts an OpenAI chat stream's content chunks in server-sent event
    bytes fed in any pieces, by scanning bytes.

    Only whole events (ended by a blank line) are looked at; the rest waits
    for the next :meth:`feed`. A chunk with non-empty ``delta.content`` is a
    token; the ``usage`` chunk's ``completion_tokens``, when sent, is kept in
    :attr:`usage_tokens`. Compact JSON (no spaces, as engines write it) is
    scanned; an event stream with spaces after colons is parsed event by
    event instead.

    Attributes:
        chunks: content chunks seen.
        first_at, last_at: the ``now`` given with the first and the last
            content chunk (0.0 before one).
        usage_tokens: ``usage.completion_tokens``, or None.
        error: the stream carried an ``{"error": …}`` event.
    """

    __slots__ = ("_pending", "chunks", "error", "first_at", "last_at", "usage_tokens")

    def __init__(self) -> None:
        self._pending = b""
        self.chunks = 0
        self.first_at = 0.0
        self.last_at = 0.0
        self.usage_tokens: int | None = None
        self.error = False

    @property
    def tokens(self) -> int:
        """``usage_tokens`` when sent, else ``chunks``."""
        return self.chunks if self.usage_tokens is None else self.usage_tokens

    def feed(self, data: bytes, now: float) -> None:
        """Scan the events completed by ``data``; ``now`` stamps the tokens found.

        Raises:
            ProtocolError: an event over :data:`MAX_EVENT_BYTES`.
        """
        if self._pending:
            data = self._pending + data
        cut = data.rfind(b"\n\n") + 2
        if cut == 1:  # no "\n\n": maybe "\r\n\r\n" line ends, maybe no whole event yet
            cut = data.rfind(b"\n\r\n") + 3
            if cut == 2:
                if len(data) > MAX_EVENT_BYTES:
                    raise ProtocolError("server-sent event too large")
                self._pending = data
                return
        if cut == len(data):
            events = data
            self._pending = b""
        else:
            events = data[:cut]
            self._pending = data[cut:]
        count = events.count(_CONTENT)
        if count:
            count -= events.count(_CONTENT_EMPTY)
            if count:
                if not self.chunks:
                    self.first_at = now
                self.last_at = now
                self.chunks += count
        elif b'"content": ' in events:
            self._parse_events(events, now)
            return
        # The usage chunk (and an error event) ends a stream: look near the end only.
        tail = max(0, len(events) - TAIL_BYTES)
        at = events.rfind(_USAGE, tail)
        if at >= 0:
            self._read_usage(events, at)
        if events.find(_ERROR, tail) >= 0:
            self.error = True

    def _read_usage(self, events: bytes, at: int) -> None:
        start = events.rfind(b"data:", 0, at)
        end = events.find(b"\n", at)
        try:
            doc = orjson.loads(events[start + 5 : end if end >= 0 else None])
            tokens = doc["usage"]["completion_tokens"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            self.usage_tokens = tokens

    def _parse_events(self, events: bytes, now: float) -> None:
        """The slow path: JSON with spaces, parsed event by event."""
        for line in events.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload.startswith(b"{"):
                continue
            try:
                doc = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(doc, dict):
                continue
            if "error" in doc:
                self.error = True
            usage = doc.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self.usage_tokens = usage["completion_tokens"]
            choices = doc.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                delta = choice.get("delta") if isinstance(choice, dict) else None
                content = delta.get("content") if isinstance(delta, dict) else None
                if isinstance(content, str) and content:
                    if not self.chunks:
                        self.first_at = now
                    self.last_at = now
                    self.chunks += 1


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


def _header(lower: bytes, name: bytes) -> bytes | None:
    """The value of a header in a lower-cased head; ``name`` is the header's
    name with the line break before it and the colon after it."""
    at = lower.find(name)
    if at < 0:
        return None
    at += len(name)
    end = lower.find(b"\r\n", at)
    return lower[at : end if end >= 0 else None].strip()


def _parse_head(head: bytes) -> tuple[int, bool, int, bool]:
    """``(status, chunked, content_length or -1, keep_alive)`` of a response head
    (without its blank line). Only the three headers that frame the body are read."""
    status = -1
    if head.startswith(b"HTTP/1.") and head[12:13] in (b" ", b"\r", b"") and head[9:12].isdigit():
        status = int(head[9:12])
    if status < 100:
        line = head.split(b"\r\n", 1)[0]
        raise ProtocolError(f"bad status line {line[:40]!r}")
    lower = head.lower()
    chunked = False
    length = -1
    keep_alive = head[7:8] == b"1"  # HTTP/1.1 keeps alive unless told
    value = _header(lower, b"\r\ntransfer-encoding:")
    if value is not None:
        chunked = value.endswith(b"chunked")
    value = _header(lower, b"\r\ncontent-length:")
    if value is not None and not chunked:
        if not value.isdigit():
            raise ProtocolError(f"bad content-length {value[:40]!r}")
        length = int(value)
    value = _header(lower, b"\r\nconnection:")
    if value is not None:
        if b"close" in value:
            keep_alive = False
        elif b"keep-alive" in value:
            keep_alive = True
    if 100 <= status < 200 or status in (204, 304):
        length = 0  # no body (a 1xx answer is not expected: none was asked for)
        chunked = False
    return status, chunked, length, keep_alive


_HEAD: Final = 0
_CHUNKED: Final = 1
_LENGTH: Final = 2
_UNTIL_CLOSE: Final = 3
_DONE: Final = 4


class ResponseParser:
    """One HTTP/1.1 response, fed in pieces as they are read.

    The head is parsed by hand; the body is de-chunked
    (``Transfer-Encoding: chunked``), cut at ``Content-Length``, or runs until
    the connection closes. A 200 answer's body goes through a
    :class:`StreamScanner` (:attr:`scanner`); other bodies are dropped.

    Attributes:
        status: the status code (0 until the head is read).
        keep_alive: the connection may carry another request afterwards.
        scanner: the 200 answer's event scanner, else None.
        received: some byte of the answer has arrived.
        rest: bytes fed past the end of the answer.
    """

    __slots__ = (
        "_buf",
        "_decoder",
        "_length",
        "_phase",
        "keep_alive",
        "received",
        "rest",
        "scanner",
        "status",
    )

    def __init__(self) -> None:
        self._phase = _HEAD
        self._buf = b""
        self._decoder: ChunkedDecoder | None = None
        self._length = 0
        self.status = 0
        self.keep_alive = True
        self.scanner: StreamScanner | None = None
        self.received = False
        self.rest = b""

    @property
    def ends_at_close(self) -> bool:
        """The body runs until the connection closes (no length, not chunked)."""
        return self._phase == _UNTIL_CLOSE

    def feed(self, data: bytes, now: float) -> bool:
        """Take the next bytes read (``now`` stamps the tokens in them).

        Returns:
            True once the whole answer has been read.

        Raises:
            ProtocolError: the bytes are not an HTTP/1.1 answer or a sane
                event stream.
        """
        if data:
            self.received = True
        phase = self._phase
        if phase == _HEAD:
            buf = self._buf + data if self._buf else data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise ProtocolError("response head too large")
                self._buf = buf
                return False
            self._buf = b""
            self.status, chunked, length, self.keep_alive = _parse_head(buf[:end])
            if self.status == 200:
                self.scanner = StreamScanner()
            data = buf[end + 4 :]
            if chunked:
                phase = self._phase = _CHUNKED
                self._decoder = ChunkedDecoder()
            elif length >= 0:
                phase = self._phase = _LENGTH
                self._length = length
                if not length:
                    self._phase = _DONE
                    self.rest = data
                    return True
            else:
                phase = self._phase = _UNTIL_CLOSE
                self.keep_alive = False
            if not data:
                return False
        scanner = self.scanner
        if phase == _CHUNKED:
            decoder = self._decoder
            assert decoder is not None
            piece = decoder.feed(data)
            if piece and scanner is not None:
                scanner.feed(piece, now)
            if decoder.done:
                self._phase = _DONE
                self.rest = decoder.rest
                return True
            return False
        if phase == _LENGTH:
            length = self._length
            if len(data) < length:
                self._length = length - len(data)
                if scanner is not None:
                    scanner.feed(data, now)
                return False
            if scanner is not None:
                scanner.feed(data[:length] if len(data) > length else data, now)
            self._phase = _DONE
            self.rest = data[length:]
            return True
        if phase == _UNTIL_CLOSE:
            if scanner is not None:
                scanner.feed(data, now)
            return False
        self.rest += data
        return True


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


class _Stats:
    """Collects outcomes of requests started in ``[start, end)``."""

    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.end = end
        self.requests = 0
        self.errors = 0
        self.samples: list[str] = []
        self.tokens = 0
        self.ttfts: list[float] = []
        self.totals: list[float] = []
        self.itls: list[float] = []

    def ok(self, started: float, ended: float, scanner: StreamScanner) -> None:
        if not self.start <= started < self.end:
            return
        self.requests += 1
        tokens = scanner.tokens
        self.tokens += tokens
        self.totals.append((ended - started) * 1000.0)
        if scanner.chunks:
            self.ttfts.append((scanner.first_at - started) * 1000.0)
            if tokens > 1:
                self.itls.append((scanner.last_at - scanner.first_at) * 1000.0 / (tokens - 1))

    def error(self, started: float, what: str) -> None:
        if not self.start <= started < self.end:
            return
        self.errors += 1
        if len(self.samples) < MAX_ERROR_SAMPLES and what not in self.samples:
            self.samples.append(what)


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

    def __init__(self, config: LoadConfig, stats: _Stats, began: float) -> None:
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
                    if now >= next_sweep:
                        self._sweep(now)
                        next_sweep = now + SWEEP_S
                    if now >= end and not (self.busy or self.connecting) and self.next_at >= end:
                        return
                    wake_at = min(next_sweep, self.next_at)
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
            except ProtocolError as exc:
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
        elif now < self.stats.end:
            self._send(connection, now, now, retried=False)
        else:
            self._close(connection)

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
        stats = _Stats(start, start + config.duration_s)
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


# -- the command ---------------------------------------------------------------------


def format_result(result: LoadResult) -> str:
    """A short plain-text table of ``result``."""
    shape = (
        f"{result.concurrency} clients (closed loop)"
        if result.concurrency is not None
        else f"{result.rate_per_s:g} requests/s offered (open loop)"
    )
    lines = [
        f"load       {shape}, {result.duration_s:g} s measured",
        f"requests   {result.requests} ok, {result.errors} errors"
        + (f" ({', '.join(result.error_samples)})" if result.error_samples else ""),
        f"rate       {result.requests_per_s:.1f} requests/s, {result.tokens_per_s:.0f} tokens/s",
        f"{'':10} {'p50':>9} {'p95':>9} {'p99':>9} {'mean':>9}",
    ]
    for name, p in (("TTFT", result.ttft_ms), ("total", result.total_ms), ("ITL", result.itl_ms)):
        lines.append(f"{name + ' ms':10} {p.p50:9.2f} {p.p95:9.2f} {p.p99:9.2f} {p.mean:9.2f}")
    lines.append(f"client CPU {100 * result.cpu_share:.0f} % of one core")
    return "\n".join(lines)


@click.command("load")
@click.option("--url", required=True, help="The server, http://HOST:PORT.")
@click.option("--key", default="", help="API key (Bearer); none when empty.")
@click.option("--model", default="gemma-3-270m", show_default=True, help="The model asked for.")
@click.option("--concurrency", type=click.IntRange(min=1), help="Closed loop: this many clients.")
@click.option(
    "--rate", type=click.FloatRange(min=0, min_open=True), help="Open loop: requests/s offered."
)
@click.option("--duration-s", default=10.0, show_default=True, help="Measured seconds.")
@click.option("--warmup-s", default=1.0, show_default=True, help="Unmeasured seconds first.")
@click.option("--prompt-words", default=16, show_default=True, help="Words per user message.")
@click.option("--max-tokens", default=64, show_default=True, help="max_tokens of each request.")
@click.option(
    "--timeout-s", default=30.0, show_default=True, help="Deadline of each request, in seconds."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def load_command(
    url: str,
    key: str,
    model: str,
    concurrency: int | None,
    rate: float | None,
    duration_s: float,
    warmup_s: float,
    prompt_words: int,
    max_tokens: int,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Streamed chat completions against an OpenAI-compatible server.

    Give --concurrency N (closed loop: N clients back to back) or --rate R
    (open loop: R requests/s on a fixed schedule). Exits 1 when no request
    succeeded.
    """
    if (concurrency is None) == (rate is None):
        raise click.UsageError("give one of --concurrency and --rate")
    try:
        config = LoadConfig(
            url=url,
            api_key=key,
            model=model,
            concurrency=concurrency,
            rate_per_s=rate,
            duration_s=duration_s,
            warmup_s=warmup_s,
            prompt_words=prompt_words,
            max_tokens=max_tokens,
            request_timeout_s=timeout_s,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = trio.run(run_load, config)
    if as_json:
        click.echo(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(format_result(result))
    if result.requests == 0:
        raise SystemExit(1)

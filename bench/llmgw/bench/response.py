"""Reading a streamed chat answer off an HTTP/1.1 connection, in pieces.

The load generator's response side, built for speed (see :mod:`llmgw.bench.load`):
the status line and the headers that frame the body are parsed by hand
(:class:`ResponseParser`), the body is de-chunked (:class:`ChunkedDecoder`)
or cut at ``Content-Length``, and the server-sent events of a 200 answer are
counted by scanning bytes (:class:`StreamScanner`); JSON is parsed only for
the final ``usage`` chunk (or for a server that puts spaces in its JSON).
Every parser takes bytes split anywhere and raises :class:`HttpProtocolError`
for bytes that are not a sane answer.
"""

from __future__ import annotations

from typing import Final

import orjson

from llmgw.errors import UpstreamError

__all__ = [
    "MAX_CHUNK_LINE_BYTES",
    "MAX_EVENT_BYTES",
    "MAX_HEAD_BYTES",
    "TAIL_BYTES",
    "ChunkedDecoder",
    "HttpProtocolError",
    "ResponseParser",
    "StreamScanner",
]

#: The largest response head accepted, in bytes.
MAX_HEAD_BYTES: Final = 64 * 1024
#: The longest chunk-size or trailer line accepted, in bytes.
MAX_CHUNK_LINE_BYTES: Final = 4096
#: The largest single server-sent event accepted, in bytes.
MAX_EVENT_BYTES: Final = 1024 * 1024
#: The stretch at the end of each batch of events searched for the usage
#: chunk and error events, in bytes.
TAIL_BYTES: Final = 4096


class HttpProtocolError(UpstreamError):
    """The server under load broke HTTP/1.1 or the event stream (the message
    says how)."""


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
            HttpProtocolError: a bad chunk-size line or missing CRLF.
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
                    raise HttpProtocolError("chunk not followed by CRLF")
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
                raise HttpProtocolError(f"bad chunk size line {data[pos:eol][:40]!r}")
            pos = eol + 2
            if chunk:
                self._remaining = chunk
            else:
                self._trailer = True
        if pos < size:
            self._pending = data[pos:]
            if len(self._pending) > MAX_CHUNK_LINE_BYTES:
                raise HttpProtocolError("chunk size or trailer line too long")
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
            HttpProtocolError: an event over :data:`MAX_EVENT_BYTES`.
        """
        if self._pending:
            data = self._pending + data
        cut = data.rfind(b"\n\n") + 2
        if cut == 1:  # no "\n\n": maybe "\r\n\r\n" line ends, maybe no whole event yet
            cut = data.rfind(b"\n\r\n") + 3
            if cut == 2:
                if len(data) > MAX_EVENT_BYTES:
                    raise HttpProtocolError("server-sent event too large")
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
        raise HttpProtocolError(f"bad status line {line[:40]!r}")
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
            raise HttpProtocolError(f"bad content-length {value[:40]!r}")
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
        retry_after_s: a 429 or 503 answer's ``Retry-After`` in seconds
            (whole seconds only; an HTTP date is not read), else None.
    """

    __slots__ = (
        "_buf",
        "_decoder",
        "_length",
        "_phase",
        "keep_alive",
        "received",
        "rest",
        "retry_after_s",
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
        self.retry_after_s: float | None = None

    @property
    def ends_at_close(self) -> bool:
        """The body runs until the connection closes (no length, not chunked)."""
        return self._phase == _UNTIL_CLOSE

    def feed(self, data: bytes, now: float) -> bool:
        """Take the next bytes read (``now`` stamps the tokens in them).

        Returns:
            True once the whole answer has been read.

        Raises:
            HttpProtocolError: the bytes are not an HTTP/1.1 answer or a sane
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
                    raise HttpProtocolError("response head too large")
                self._buf = buf
                return False
            self._buf = b""
            self.status, chunked, length, self.keep_alive = _parse_head(buf[:end])
            if self.status == 200:
                self.scanner = StreamScanner()
            elif self.status in (429, 503):
                value = _header(buf[:end].lower(), b"\r\nretry-after:")
                if value is not None and value.isdigit():
                    self.retry_after_s = float(value)
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

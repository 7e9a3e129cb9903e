"""Pooled keep-alive HTTP/1.1 connections to engines, O(1) per request.

A relay through httpx's shared pool spent 55 % of its CPU in the pool, which
scans every pooled connection on each request (``docs/performance.md``). Here each endpoint has its own
:class:`UpstreamPool`: idle connections wait in a deque; a request takes the
most recently used one (or dials a new one) and gives it back when the
answer has been read to its end. Nothing is ever scanned.

The wire is spoken here, not by h11 (which cost about a sixth of the
gateway's CPU: ``docs/performance.md``): a request is written as one
piece, an answer's head parsed by :func:`parse_head` (RFC 9112: a status
line, fields, ``Content-Length`` checked, no folding), its body read by
:class:`BodyReader` in a few byte searches per read. On a plain
connection bytes are read and written straight on the socket, waiting
(through trio) only when it is not ready. A request that fails on a *reused* connection
before any byte of the answer arrived is tried once more on a fresh one (the
engine closed an idle connection under us); after that, errors propagate as
:class:`UpstreamError`.

Deadlines are the caller's (``trio.fail_after`` / ``move_on_after``), as
everywhere in llmgw; a pool may also be given its own ``connect_timeout_s``
for dialing (TCP connect and TLS handshake).

Outside providers speak HTTPS: a pool given an ``ssl_context`` wraps each new
connection in a :class:`trio.SSLStream` and completes the handshake while
dialing; a reused connection costs nothing more than a plain one.
"""

from __future__ import annotations

import functools
import os
import re
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Final, Protocol, cast

import trio

from llmgw import errors

__all__ = [
    "BodyReader",
    "FramingError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "default_ssl_context",
    "parse_head",
]

#: Idle connections kept per endpoint; more are closed when given back.
MAX_IDLE_PER_ENDPOINT: Final = 512
#: Bytes read from the socket at a time.
READ_SIZE: Final = 65536
#: Largest response head accepted, in bytes.
MAX_HEAD_BYTES: Final = 64 * 1024
#: Longest chunk-size line or trailer field of a chunked body, in bytes.
MAX_CHUNK_LINE_BYTES: Final = 4096
#: Reads that found data at once before the reader yields to the scheduler
#: anyway (so a fast engine cannot starve the other tasks).
READS_BEFORE_YIELD: Final = 16


class UpstreamError(errors.UpstreamError):
    """The engine could not be reached, or broke the HTTP exchange.

    Attributes:
        before_response: ``True`` when nothing of the answer had arrived
            (so the request may be tried on another replica).
    """

    def __init__(self, message: str, *, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """The client TLS context for outside providers: the system's trusted
    CAs, hostname checks on, HTTP/1.1 offered by ALPN. One per process."""
    context = ssl.create_default_context()
    context.set_alpn_protocols(["http/1.1"])
    return context


class _Stream(Protocol):
    """What a connection uses of its stream. ``receive_some`` of a TLS stream
    gives a ``bytearray`` (made ``bytes`` on reading)."""

    async def send_all(self, data: bytes) -> None: ...
    async def receive_some(self, max_bytes: int | None = None) -> bytes: ...
    async def aclose(self) -> None: ...


class _Connection:
    __slots__ = ("fd", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = cast(_Stream, stream)
        #: A plain socket's descriptor, read and written directly; ``-1``: TLS.
        self.fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1

    async def read(self, *, wait: bool = False) -> bytes:
        """The next bytes (``b""`` at the peer's close): at once when the
        socket has some, else after waiting for them (a checkpoint).

        Args:
            wait: wait until the socket is readable before reading, for a
                socket that was found empty a moment ago (the last read
                took all it had): a read that finds nothing costs a system
                call and an exception, and a streamed answer's next event
                has almost never arrived yet (``docs/performance.md``).

        Raises:
            trio.BrokenResourceError, OSError: the connection broke.
        """
        fd = self.fd
        if fd < 0:
            return bytes(await self.stream.receive_some(READ_SIZE))
        if wait:
            await trio.lowlevel.wait_readable(fd)
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return os.read(fd, READ_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)

    async def write(self, data: bytes) -> None:
        """All of ``data``, straight to the socket when it takes it at once.

        Raises:
            trio.BrokenResourceError, OSError: the connection broke.
        """
        fd = self.fd
        if fd >= 0:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                sent = os.write(fd, data)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        await self.stream.send_all(data)


class Head:
    """An answer's head: ``status``, ``http_version`` (``b"1.1"``), and
    ``headers`` as (lower-case name, value) pairs in order."""

    __slots__ = ("headers", "http_version", "status")

    def __init__(
        self, status: int, http_version: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.status = status
        self.http_version = http_version
        self.headers = headers


_STATUS_LINE = re.compile(rb"HTTP/(1\.[01]) ([0-9]{3})(?: [^\x00\r\n]*)?")
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(rb"[^\x00\r\n]*")


def parse_head(block: bytes) -> Head:
    """The head in ``block`` (the bytes before the blank line; ``\r\n`` or
    bare ``\n`` line ends).

    Raises:
        FramingError: a malformed status line or field, a folded line,
            a bad or ambiguous ``Content-Length``.
    """
    lines = block.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    match = _STATUS_LINE.fullmatch(status_line)
    if match is None:
        raise FramingError(f"bad status line {status_line[:60]!r}")
    headers: list[tuple[bytes, bytes]] = []
    length: bytes | None = None
    for raw in lines[1:]:
        line = raw[:-1] if raw.endswith(b"\r") else raw
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise FramingError(f"bad header line {line[:60]!r}")
        value = value.strip(b" \t")
        if _FIELD_VALUE.fullmatch(value) is None:
            raise FramingError(f"bad header value for {name[:40]!r}")
        name = name.lower()
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18 or (length is not None and value != length):
                raise FramingError(f"bad Content-Length {value[:40]!r}")
            if length is not None:
                continue  # equal repeats are one
            length = value
        headers.append((name, value))
    return Head(int(match.group(2)), match.group(1), headers)


_HEX_DIGITS: Final = b"0123456789abcdefABCDEF"


class FramingError(ValueError):
    """An answer's body is not framed as its head said (a bad chunk)."""


class BodyReader:
    """Sans-IO: an HTTP/1.1 answer's body out of the bytes after its head.

    Args:
        chunked: ``Transfer-Encoding: chunked`` (else ``length`` or until close).
        length: ``Content-Length`` in bytes, or ``None``: the body ends when
            the connection closes (an HTTP/1.0-style answer).

    :meth:`feed` takes bytes as they come and returns the body bytes they
    hold; :attr:`done` once the body ended; :attr:`rest` what came after it.

    Raises:
        FramingError: from :meth:`feed`, for a malformed chunk.
    """

    __slots__ = ("_buffer", "_chunked", "_left", "_state", "done", "rest")

    #: Chunked states: the size line, its data, the CRLF after it, trailers.
    _SIZE, _DATA, _CRLF, _TRAILER = range(4)

    def __init__(self, *, chunked: bool, length: int | None) -> None:
        self._chunked = chunked
        self._left = 0 if chunked else (-1 if length is None else length)
        self._state = self._SIZE
        self._buffer = b""
        self.done = not chunked and length == 0
        self.rest = b""

    @property
    def until_close(self) -> bool:
        """The body ends when the connection closes (no length, not chunked)."""
        return not self._chunked and self._left < 0

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.rest += data
            return b""
        if not self._chunked:
            if self._left < 0:
                return data
            if len(data) < self._left:
                self._left -= len(data)
                return data
            body, self.rest = data[: self._left], data[self._left :]
            self._left = 0
            self.done = True
            return body
        if self._state == self._SIZE and not self._buffer:
            # The usual read of a streamed answer: exactly one whole chunk.
            eol = data.find(b"\r\n", 0, 18)
            if eol > 0:
                text = data[:eol]
                if len(text) <= 16 and not text.strip(_HEX_DIGITS):
                    end = eol + 2 + int(text, 16)
                    if end > eol + 2 and len(data) == end + 2 and data.endswith(b"\r\n"):
                        return data[eol + 2 : end]
        buffer = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        at = 0
        size = len(buffer)
        while at < size:
            state = self._state
            if state == self._DATA:
                end = at + self._left
                if end > size:
                    out.append(buffer[at:])
                    self._left = end - size
                    at = size
                    break
                out.append(buffer[at:end])
                at = end
                self._state = self._CRLF
            elif state == self._CRLF:
                if size - at < 2:
                    break
                if buffer[at : at + 2] != b"\r\n":
                    raise FramingError("a chunk's data is not followed by CRLF")
                at += 2
                self._state = self._SIZE
            else:
                eol = buffer.find(b"\r\n", at, at + MAX_CHUNK_LINE_BYTES)
                if eol < 0:
                    if size - at >= MAX_CHUNK_LINE_BYTES:
                        raise FramingError("a chunk line is too long")
                    break
                line = buffer[at:eol]
                at = eol + 2
                if state == self._TRAILER:
                    if not line:
                        self.done = True
                        self.rest = buffer[at:]
                        at = size
                        break
                    continue
                text = line.split(b";", 1)[0].strip(b" \t")
                if not text or len(text) > 16 or text.strip(_HEX_DIGITS):
                    raise FramingError(f"bad chunk size {line[:40]!r}")
                self._left = int(text, 16)
                self._state = self._DATA if self._left else self._TRAILER
        self._buffer = buffer[at:] if at < size else b""
        if len(out) == 1:
            return out[0]
        return b"".join(out)


class UpstreamResponse:
    """An answer being read: :meth:`receive` its body as it arrives; always
    :meth:`aclose` it (``async with``)."""

    def __init__(
        self, pool: UpstreamPool, connection: _Connection, head: Head, pending: bytes
    ) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self.status = head.status
        self.headers = head.headers
        self._complete = False
        chunked = False
        length: int | None = None
        keep_alive = head.http_version == b"1.1"
        for key, value in self.headers:
            if key == b"transfer-encoding":
                codings = [c.strip(b" \t") for c in value.lower().split(b",")]
                if codings[-1:] != [b"chunked"] and codings != [b""]:
                    keep_alive = False  # some other coding: read to the close
                chunked = codings[-1:] == [b"chunked"]
            elif key == b"content-length":
                length = int(value)  # parse_head checked it
            elif key == b"connection" and b"close" in value.lower():
                keep_alive = False
        if chunked:
            length = None  # Transfer-Encoding wins (RFC 9112 section 6.3)
        if self.status in (204, 304):
            chunked, length = False, 0
        self._keep_alive = keep_alive and (chunked or length is not None)
        self._body = BodyReader(chunked=chunked, length=length)
        # What was read past the head: the body's first bytes.
        self._pending = pending
        self._reads = 0
        #: The last read took all the socket had (less than READ_SIZE): the
        #: next one waits for more first. Not so for the body's first read
        #: (the first token may have come just after the head: taken at
        #: once, as before, not after a trip through the scheduler).
        self._drained = False

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or ``None``."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def receive(self) -> bytes:
        """The next piece of the (de-chunked) body; ``b""`` once it has ended.

        A method, not an async generator, so abandoning an answer half read
        (a client gone) leaves nothing for the garbage collector to finish.
        A checkpoint when it waits for the engine (and at least every
        :data:`READS_BEFORE_YIELD` calls).

        Raises:
            UpstreamError: the connection broke mid-answer, or the body's
                framing is broken.
        """
        connection = self._connection
        body = self._body
        if connection is None or self._complete:
            return b""
        while True:
            if body.done:
                self._complete = True
                return b""
            if self._pending:
                data, self._pending = self._pending, b""
            else:
                fd = connection.fd
                if fd >= 0 and self._drained:
                    # The streamed answer's usual step, inline (one coroutine
                    # fewer per event): wait for the engine, then read.
                    self._reads = 0
                    try:
                        await trio.lowlevel.wait_readable(fd)
                        data = os.read(fd, READ_SIZE)
                        self._drained = len(data) < READ_SIZE
                    except BlockingIOError:
                        self._drained = False  # woken for nothing: the slow way
                        data = await self._read(connection)
                    except (trio.ClosedResourceError, OSError) as exc:
                        raise UpstreamError(
                            f"engine connection broke: {errors.describe(exc)}",
                            before_response=False,
                        ) from exc
                else:
                    data = await self._read(connection)
                if not data:
                    if body.until_close:
                        self._complete = True  # the body ran to the close
                        return b""
                    raise UpstreamError(
                        "engine closed the connection mid-answer", before_response=False
                    )
            try:
                out = body.feed(data)
            except FramingError as exc:
                raise UpstreamError(
                    f"bad answer from engine: {exc}", before_response=False
                ) from exc
            if body.done:
                self._complete = True
            if out:
                return out

    async def _read(self, connection: _Connection) -> bytes:
        """The next bytes from the engine (``b""`` at its close)."""
        drained = self._drained
        if drained:
            self._reads = 0  # the wait is a trip through the scheduler
        else:
            self._reads += 1
            if self._reads >= READS_BEFORE_YIELD:
                # Data came at once many times in a row: let the others run.
                self._reads = 0
                await trio.lowlevel.checkpoint()
        try:
            data = await connection.read(wait=drained)
            self._drained = len(data) < READ_SIZE
            return data
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamError(
                f"engine connection broke: {errors.describe(exc)}", before_response=False
            ) from exc

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while chunk := await self.receive():
            parts.append(chunk)
        return b"".join(parts)

    def _give_back(self) -> bool:
        """Give the connection back to the pool if the answer was read to
        its end, nothing came after it, and both sides keep it alive;
        whether it was (else it is still to be closed)."""
        connection = self._connection
        if connection is None:
            return True
        if self._complete and self._keep_alive and not self._body.rest and not self._pending:
            self._connection = None
            self._pool._give_back(connection)
            return True
        return False

    async def aclose(self) -> None:
        """Give the connection back to the pool if the answer was read to its
        end, nothing came after it, and both sides keep it alive; close it
        otherwise."""
        if self._give_back():
            return
        connection, self._connection = self._connection, None
        if connection is not None:
            await _close(connection)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Given back without waiting (the usual end): no shielded scope,
        # which costs more than the rest of this.
        if not self._give_back():
            with trio.CancelScope(shield=True):
                await self.aclose()


class UpstreamPool:
    """Keep-alive connections to one engine (or provider) at ``host:port``.

    Args:
        max_idle: idle connections kept; more are closed when given back.
        ssl_context: speak HTTPS with this context
            (:func:`default_ssl_context` for public providers); ``None``:
            plain HTTP.
        server_hostname: the name the certificate must carry, sent by SNI and
            in ``Host``; ``host`` when not given.
        connect_timeout_s: dialing a new connection (TCP connect, then the
            TLS handshake) must finish within this many seconds, else
            :class:`UpstreamError`; ``None``: the caller's deadlines only.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_idle: int = MAX_IDLE_PER_ENDPOINT,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._idle: deque[_Connection] = deque()
        self._max_idle = max_idle
        self._ssl_context = ssl_context
        self._server_hostname = server_hostname or host
        self._connect_timeout_s = connect_timeout_s
        name = self._server_hostname if ssl_context is not None else host
        if ":" in name:
            name = f"[{name}]"  # an IPv6 address
        default_port = 443 if ssl_context is not None else None
        self._host_header = (name if port == default_port else f"{name}:{port}").encode()
        self.connections_opened = 0

    @property
    def tls(self) -> bool:
        return self._ssl_context is not None

    @property
    def connect_timeout_s(self) -> float | None:
        """The deadline for dialing a new connection, seconds; settable (live
        settings change it for the pool's next connection)."""
        return self._connect_timeout_s

    @connect_timeout_s.setter
    def connect_timeout_s(self, value: float | None) -> None:
        self._connect_timeout_s = value

    def statistics(self) -> dict[str, int]:
        return {"idle": len(self._idle), "opened": self.connections_opened}

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send a request and return once the answer's head has arrived.

        Raises:
            UpstreamError: the engine could not be reached or answered
                nonsense (``before_response`` is ``True`` here).
        """
        request = _request_bytes(method, target, self._host_header, headers, body)
        while self._idle:
            connection = self._idle.pop()
            try:
                return await self._exchange(connection, request)
            except _Stale:
                await _close(connection)
                continue  # the engine closed it while idle; try the next one
        connection = await self._dial()
        try:
            return await self._exchange(connection, request)
        except _Stale as exc:
            await _close(connection)
            raise UpstreamError(str(exc), before_response=True) from exc

    async def aclose(self) -> None:
        idle, self._idle = self._idle, deque()
        for connection in idle:
            await _close(connection)

    async def _dial(self) -> _Connection:
        if self._connect_timeout_s is None:
            stream = await self._open()
        else:
            opened: trio.abc.Stream | None = None
            with trio.move_on_after(self._connect_timeout_s):
                opened = await self._open()
            if opened is None:
                raise UpstreamError(
                    f"cannot connect to {self.host}:{self.port}: "
                    f"no connection within {self._connect_timeout_s:g} s",
                    before_response=True,
                )
            stream = opened
        self.connections_opened += 1
        return _Connection(stream)

    async def _open(self) -> trio.abc.Stream:
        try:
            tcp = await trio.open_tcp_stream(self.host, self.port)
        except OSError as exc:
            raise UpstreamError(
                f"cannot connect to {self.host}:{self.port}: {errors.describe(exc)}",
                before_response=True,
            ) from exc
        if self._ssl_context is None:
            return tcp
        stream = trio.SSLStream(
            tcp, self._ssl_context, server_hostname=self._server_hostname, https_compatible=True
        )
        try:
            await stream.do_handshake()
        except (trio.BrokenResourceError, OSError) as exc:
            await trio.aclose_forcefully(tcp)
            reason = exc.__cause__ or exc
            raise UpstreamError(
                f"TLS handshake with {self._server_hostname}:{self.port} failed: {reason}",
                before_response=True,
            ) from exc
        except BaseException:
            await trio.aclose_forcefully(tcp)
            raise
        return stream

    async def _exchange(self, connection: _Connection, request: bytes) -> UpstreamResponse:
        try:
            await connection.write(request)
            buffer = b""
            while True:
                end = buffer.find(b"\r\n\r\n")
                cut = 4
                if end < 0:
                    end, cut = buffer.find(b"\n\n"), 2
                if end < 0:
                    if len(buffer) > MAX_HEAD_BYTES:
                        raise FramingError(f"an answer head over {MAX_HEAD_BYTES} bytes")
                    # The request was just written: the answer is not there yet.
                    chunk = await connection.read(wait=True)
                    if not chunk:
                        if buffer:
                            raise FramingError("the engine closed the connection mid-head")
                        raise _Stale("engine closed the connection before answering")
                    buffer += chunk
                    continue
                head = parse_head(buffer[:end])
                buffer = buffer[end + cut :]
                if head.status >= 200:
                    return UpstreamResponse(self, connection, head, buffer)
                if head.status == 101:
                    raise FramingError("the engine switched protocols")
                # 100 Continue and other interim answers: read on.
        except (trio.BrokenResourceError, OSError) as exc:
            raise _Stale(
                f"engine connection broke before answering: {errors.describe(exc)}"
            ) from exc
        except FramingError as exc:
            await _close(connection)
            raise UpstreamError(f"bad answer from engine: {exc}", before_response=True) from exc
        except BaseException:
            await _close(connection)
            raise

    def _give_back(self, connection: _Connection) -> None:
        if len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            trio.lowlevel.spawn_system_task(_close, connection)


def _request_bytes(
    method: bytes,
    target: bytes,
    host: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    body: bytes,
) -> bytes:
    """The whole request, head and body, in one piece.

    Raises:
        UpstreamError: a header name or value that would break the head
            (``before_response``).
    """
    parts = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\ncontent-length: "]
    parts.append(b"%d\r\n" % len(body))
    for name, value in headers:
        if _TOKEN.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
            raise UpstreamError(
                f"a header that cannot be sent: {name[:40]!r}", before_response=True
            )
        parts += (name, b": ", value, b"\r\n")
    parts += (b"\r\n", body)
    return b"".join(parts)


class _Stale(errors.UpstreamError):
    """A connection failed before any answer arrived."""


async def _close(connection: _Connection) -> None:
    stream = connection.stream
    with trio.CancelScope(shield=True):
        try:
            if type(stream) is trio.SocketStream:
                await stream.aclose()
            else:
                # TLS: no waiting on a close_notify a peer may never read.
                await trio.aclose_forcefully(cast(trio.abc.Stream, stream))
        except (trio.BrokenResourceError, OSError):
            pass

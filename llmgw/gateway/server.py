"""A lean HTTP/1.1 server for the client port, speaking the ASGI subset the
gateway uses.

Why not hypercorn here: under 128 streams hypercorn's layers (protocol
wrapper, stream objects, event classes, a task group per request) took about
half of the gateway's CPU, most of it per streamed chunk (profile in
``docs/performance.md``). This server keeps one task per connection, reads
a plain request head itself (:func:`_plain_head`) and hands any other
request to h11, and writes answers straight to the socket. The admin API
and metrics listeners stay on hypercorn.

ASGI subset: ``http`` scopes (``method``, ``path``, ``raw_path``,
``query_string``, ``headers``, ``client``, ``server``); ``receive`` yields
``http.request`` messages, then ``http.disconnect`` once the client has
gone; ``send`` takes ``http.response.start`` and ``http.response.body``.
For a HEAD request the app answers as for GET and the server sends the
status and headers (Content-Length included) without the body.
Sending after the client has gone is silently dropped, as hypercorn does.
On a socket the scope's ``extensions`` carry the server's disconnect watch
(:data:`llmgw.asgi.WATCH_DISCONNECT`): an app that has read the whole body
hands it a cancel scope to cancel when the client goes away, instead of a
task waiting on ``receive()`` (one ``epoll`` and one task per server,
:class:`_Hangups`).
An app that raises before it began its answer gets 500 ``internal_error``
in the path's error shape (:func:`llmgw.gateway.errors.error_body_on`).

Limits and framing (the constants below; ``docs/api.md``, HTTP limits): a
request whose framing cannot be trusted (``Content-Length`` with
``Transfer-Encoding``, conflicting lengths, a bad chunk) is refused and the
connection closed, so nothing hidden in a body is read as a request; heads
are bounded in bytes, fields and time, bodies in time and rate
(:data:`BODY_READ_TIMEOUT_S`, :data:`MIN_BODY_RATE_BYTES_PER_S`: 408); a
body left unread is drained only when small, else the connection closes
after a lingering close; a client that does not read its answer is cut
off after :data:`SEND_TIMEOUT_S`.

Stop: when ``stop`` is set the listeners close at once, idle keep-alive
connections are closed, and requests in flight get ``grace_s`` to finish;
then whatever is left is cancelled.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import select
from collections.abc import Awaitable, Callable
from typing import Any, Final

import h11
import orjson
import trio

from llmgw.asgi import WATCH_DISCONNECT, Message, Receive, Scope, Send

from .errors import error_body_on, internal_error

__all__ = ["serve_http1"]

log = logging.getLogger("llmgw.http")

App = Callable[[Scope, Receive, Send], Awaitable[None]]

READ_SIZE: Final = 65536
#: Writes the socket took at once before the connection yields to the
#: scheduler anyway (so a fast answer cannot starve the other tasks).
WRITES_BEFORE_YIELD: Final = 16
#: Largest request head (request line and header fields), in bytes; a
#: larger one is refused 431 and the connection closed.
MAX_HEAD_BYTES: Final = 64 * 1024
#: Most header fields in one request; more are refused 431.
MAX_HEADERS: Final = 128
#: A new connection must send its whole request head within this, in seconds;
#: so must a kept-alive one, counted from the first byte of its next request.
FIRST_REQUEST_TIMEOUT_S: Final = 30.0
#: A request body that stops arriving for this long is refused 408, in seconds.
BODY_READ_TIMEOUT_S: Final = 30.0
#: A request body must keep up this average rate, in bytes per second, after
#: :data:`BODY_GRACE_S`: the whole body is due :data:`BODY_GRACE_S` plus its
#: bytes so far over this rate after the app first reads it, else 408 and
#: the connection closes (a client trickling a body holds no connection).
MIN_BODY_RATE_BYTES_PER_S: Final = 16 * 1024
#: The time any body gets before :data:`MIN_BODY_RATE_BYTES_PER_S` counts, in seconds.
BODY_GRACE_S: Final = 10.0
#: An idle keep-alive connection is closed after this, in seconds.
KEEP_ALIVE_TIMEOUT_S: Final = 75.0
#: A client that takes none of a 64 KiB piece of its answer for this long
#: is cut off (and the app sees ``http.disconnect``), in seconds.
SEND_TIMEOUT_S: Final = 60.0
#: Unread body the server reads and drops after an answer that did not read
#: it (a 401, a 413), to keep the connection; past this it closes instead.
DRAIN_LIMIT_BYTES: Final = 64 * 1024
#: Pipelined bytes held while a request is answered; past this the server
#: stops reading until the answer is done.
MAX_PIPELINED_BYTES: Final = 64 * 1024
#: Before a close that leaves a request body unread, the server stops
#: sending and discards what still comes for this long, in seconds, so the
#: client reads its answer instead of a reset (a lingering close).
LINGER_S: Final = 2.0
#: What the disconnect watch waits for on a client's socket: its side
#: closed (``EPOLLRDHUP``; errors and hang-ups come always), reported once
#: per arming.
_HANGUP_EVENTS: Final = select.EPOLLRDHUP | select.EPOLLONESHOT if hasattr(select, "epoll") else 0
#: The cyclic garbage collector's thresholds once a server listens
#: (CPython's are 700, 10, 10): a streamed request makes thousands of
#: short-lived objects, and at 700 the youngest generation was collected
#: every few requests, promoting requests still in flight (``docs/performance.md``).
GC_THRESHOLDS: Final = (20_000, 10, 10)


class _Refusal(Exception):
    """A request the server answers itself, then closes the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _check_head(request: h11.Request) -> None:
    """Refuse what h11 lets through but llmgw will not take.

    Raises:
        _Refusal: 505 for an HTTP version other than 1.0 and 1.1; 501 for
            ``CONNECT`` (no tunnels); 431 for a head over
            :data:`MAX_HEAD_BYTES` (h11 bounds only a head still incomplete)
            or over :data:`MAX_HEADERS` fields; 400 for ``Content-Length``
            with ``Transfer-Encoding`` (RFC 9112 section 6.1: a smuggling
            attempt, refused and closed).
    """
    if request.http_version not in (b"1.1", b"1.0"):
        raise _Refusal(505, "HTTP version not supported; send HTTP/1.1")
    if request.method == b"CONNECT":
        raise _Refusal(501, "CONNECT is not supported")
    size = len(request.method) + len(request.target) + 11
    names = set()
    for name, value in request.headers:
        size += len(name) + len(value) + 4
        names.add(bytes(name))
    if size > MAX_HEAD_BYTES:
        raise _Refusal(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
    if len(request.headers) > MAX_HEADERS:
        raise _Refusal(431, f"the request has more than {MAX_HEADERS} header fields")
    if b"content-length" in names and b"transfer-encoding" in names:
        raise _Refusal(400, "Content-Length and Transfer-Encoding together")


def _error_body(message: str) -> bytes:
    """OpenAI's error shape, as the server's own refusals are sent."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": None,
                "param": None,
            }
        }
    )


#: A request line the fast path takes: a token method, a target of visible
#: ASCII characters, HTTP/1.1 (anything else goes to h11).
_REQUEST_LINE: Final = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/1\.1")
#: A header field line as h11 takes it (token, colon, optional white space,
#: visible characters with inner spaces, optional white space).
_FIELD: Final = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*"
    rb"((?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?)[ \t]*"
)
#: Fields that send a request to h11 (framing, expectations, connection
#: options other than ``keep-alive``).
_SLOW_FIELDS: Final = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"connection"})
#: Longest ``Content-Length`` value the fast path reads, in digits.
_MAX_LENGTH_DIGITS: Final = 18


class _Head:
    """A plain request head read by :func:`_plain_head` (lower-case names)."""

    __slots__ = ("headers", "length", "method", "target")

    def __init__(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], length: int
    ) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.length = length


def _plain_head(head: bytes) -> _Head | None:
    """The request head ``head`` (without its blank line) when it is plain,
    else ``None`` and h11 reads it.

    Plain: CRLF line ends only (no bare CR or LF, no folding), an HTTP/1.1
    request line that is not ``HEAD`` or ``CONNECT``, header fields as h11
    takes them, one ``Host``, at most one ``Content-Length`` of digits, none
    of :data:`_SLOW_FIELDS` (but ``Connection: keep-alive``), within
    :data:`MAX_HEAD_BYTES` and :data:`MAX_HEADERS`. Such a head is read here
    as h11 would read it (names lower case); whatever h11 might refuse or
    read differently goes to h11, so the limits and refusals stay h11's
    and :func:`_check_head`'s.
    """
    lines = head.split(b"\r\n")
    if len(lines) > MAX_HEADERS + 1:
        return None
    match = _REQUEST_LINE.fullmatch(lines[0])
    if match is None:
        return None
    method, target = match.groups()
    if method == b"HEAD" or method == b"CONNECT":
        return None
    size = len(method) + len(target) + 11
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    length = -1
    for line in lines[1:]:
        field = _FIELD.fullmatch(line)
        if field is None:
            return None
        name, value = field.groups()
        name = name.lower()
        size += len(name) + len(value) + 4
        if name in _SLOW_FIELDS:
            if name != b"connection" or value.lower() != b"keep-alive":
                return None
        elif name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
                return None
            length = int(value)
        elif name == b"host":
            hosts += 1
        headers.append((name, value))
    if hosts != 1 or size > MAX_HEAD_BYTES:
        return None
    return _Head(method, target, headers, max(length, 0))


class _Connection:
    """One client connection: reads requests, runs the app for each in turn.

    A plain request head (:func:`_plain_head`) is read here and its answer
    framed here; any other request is handed to an h11 connection made for
    it, fed the bytes held so far, for that request and its answer; what
    h11 holds after it (a pipelined next request) comes back here.
    """

    def __init__(
        self,
        stream: trio.abc.HalfCloseableStream,
        app: App,
        server: tuple[str, int],
        client: tuple[str, int] | None,
    ) -> None:
        self.stream = stream
        self.app = app
        #: The h11 connection of the request in hand when it was not plain.
        self.h11: h11.Connection | None = None
        #: Bytes read and not yet taken (between requests, or a plain
        #: request's body and what follows it).
        self.buf = bytearray()
        #: The client closed its side (no more bytes will come).
        self.eof = False
        #: Body bytes of the plain request in hand not yet read.
        self.body_left = 0
        #: A plain request's answer has begun (its head was written).
        self.answering = False
        #: Body bytes a plain request's answer still owes its
        #: ``Content-Length`` (``-1``: chunked or none).
        self.length_left = -1
        self.server = server
        self.client = client
        self.busy = False
        self.idle_scope: trio.CancelScope | None = None
        self.gone = False
        #: A request body left unread when the connection closes: linger first.
        self.unread_body = False
        #: The socket's descriptor, written to directly (``-1``: through
        #: the stream only, as for the fuzz target's in-memory stream).
        self.fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        #: Writes done at once since the last trip through the scheduler.
        self.writes = 0
        #: Reads done at once since the last trip through the scheduler.
        self.reads = 0
        #: The answer being sent is chunked (its body framed here, not by h11).
        self.chunked = False
        #: The server's watch for clients gone (``None``: no ``epoll`` here,
        #: or no socket), and the cancel scope an app asked it to cancel.
        self.hangups: _Hangups | None = None
        self.watched: trio.CancelScope | None = None
        #: The scope's ``extensions`` (:data:`WATCH_DISCONNECT`), made once.
        self.extensions: dict[str, Any] | None = None

    def watch_disconnect(self, cancel_scope: trio.CancelScope | None) -> None:
        """Cancel ``cancel_scope`` if the client goes away (closes or resets
        its side) from now until this is called with ``None``; at once when
        it has gone already. For an app that has read the whole request body,
        instead of a task waiting on ``receive()`` for ``http.disconnect``
        (:data:`WATCH_DISCONNECT`). Pipelined bytes do not count: they are
        read after the answer, as before."""
        if cancel_scope is None:
            self.watched = None
            return
        if self.gone or self.eof:
            self.gone = True
            cancel_scope.cancel()
            return
        hangups = self.hangups
        if hangups is not None:
            self.watched = cancel_scope
            hangups.arm(self)

    def hung_up(self) -> None:
        """The client went away (or its socket broke): the connection is
        gone and the watched cancel scope, if any, cancelled."""
        self.gone = True
        scope = self.watched
        if scope is not None:
            self.watched = None
            scope.cancel()

    def _h11(self) -> h11.Connection:
        """The h11 connection of the request in hand (one not plain)."""
        connection = self.h11
        assert connection is not None
        return connection

    async def _read_event(self) -> Any:
        connection = self._h11()
        while True:
            event = connection.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.stream.receive_some(READ_SIZE)
            connection.receive_data(bytes(data))

    async def _receive(self) -> bool:
        """Read more bytes into :attr:`buf`; False at the client's EOF."""
        if self.eof:
            return False
        fd = self.fd
        if fd < 0 or self.gone:
            data = await self.stream.receive_some(READ_SIZE)
        else:
            # Straight from the socket, waiting only when it has nothing (as
            # the engine side reads): trio's receive_some costs more. Yet a
            # trip through the scheduler at least every WRITES_BEFORE_YIELD
            # reads, so a client sending fast cannot starve the others.
            self.reads += 1
            if self.reads >= WRITES_BEFORE_YIELD:
                self.reads = 0
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.checkpoint_if_cancelled()
            while True:
                try:
                    data = os.read(fd, READ_SIZE)
                    break
                except BlockingIOError:
                    self.reads = 0
                    await trio.lowlevel.wait_readable(fd)
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def _read_head(self) -> h11.Request | _Head | Any:
        """The next request's head: a :class:`_Head` when plain, else what
        a new h11 connection fed the held bytes reads (an ``h11.Request``,
        ``ConnectionClosed``; ``h11.RemoteProtocolError`` raised)."""
        buf = self.buf
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head = _plain_head(bytes(buf[:end]))
                if head is not None:
                    del buf[: end + 4]
                    return head
                break
            if b"\n\n" in buf or b"\n\r\n" in buf or len(buf) > MAX_HEAD_BYTES:
                break  # a bare LF's end of head, or too long: h11's to judge
            if not await self._receive():
                break
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        connection.receive_data(bytes(buf))
        buf.clear()
        if self.eof:
            connection.receive_data(b"")
        self.h11 = connection
        return await self._read_event()

    async def _send(self, event: Any) -> None:
        if self.gone:
            # The connection is done for: nothing more goes out, but this
            # stays a checkpoint, so an app sending in a loop can be cancelled.
            await trio.lowlevel.checkpoint()
            return
        data = self._h11().send(event)
        if data:
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        """Send ``data``: straight to the socket when it takes it all at once
        (no trip through the scheduler, which a streamed answer would make
        per event; yet at least every :data:`WRITES_BEFORE_YIELD` writes),
        else through the stream with :data:`SEND_TIMEOUT_S` per piece."""
        if self.gone:
            await trio.lowlevel.checkpoint()
            return
        fd = self.fd
        if fd >= 0:
            self.writes += 1
            if self.writes >= WRITES_BEFORE_YIELD:
                self.writes = 0
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.checkpoint_if_cancelled()
            try:
                sent = os.write(fd, data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.hung_up()
                return
            if sent == len(data):
                return
            self.writes = 0
            data = data[sent:]
        view = memoryview(data)
        try:
            for at in range(0, len(view), READ_SIZE):
                with trio.move_on_after(SEND_TIMEOUT_S) as stalled:
                    await self.stream.send_all(view[at : at + READ_SIZE])
                if stalled.cancelled_caught:
                    # A client that reads nothing: close, which also wakes a
                    # receive() waiting on the socket, so the app is told.
                    self.hung_up()
                    await self.stream.aclose()
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.hung_up()

    async def _wait_for_data(self) -> bool:
        """Wait for the first byte of the next request; False on EOF."""
        if self.buf:
            return True
        return await self._receive()

    async def serve(self, draining: trio.Event, on_idle: Callable[[], None]) -> None:
        try:
            await self._serve(draining, on_idle)
        finally:
            if self.unread_body:
                await self._linger()

    async def _linger(self) -> None:
        """Stop sending and drop what the client still sends, for a while,
        so that closing does not reset its answer away."""
        with trio.move_on_after(LINGER_S):
            try:
                await self.stream.send_eof()
                while await self.stream.receive_some(READ_SIZE):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def _serve(self, draining: trio.Event, on_idle: Callable[[], None]) -> None:
        first = True
        while not draining.is_set():
            event: Any = None
            try:
                # One cancel scope for the idle wait and the head: the keep-
                # alive timeout until the next request's first byte, then the
                # head's own from there (a stop cuts only the idle wait, or a
                # new connection's first head).
                with trio.move_on_after(
                    FIRST_REQUEST_TIMEOUT_S if first else KEEP_ALIVE_TIMEOUT_S
                ) as self.idle_scope:
                    if not first:
                        if not await self._wait_for_data():
                            return  # closed, or closed while idle for a stop
                        self.idle_scope.deadline = trio.current_time() + FIRST_REQUEST_TIMEOUT_S
                        self.idle_scope = None
                    event = await self._read_head()
                self.idle_scope = None
                if isinstance(event, h11.Request):
                    _check_head(event)
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc.error_status_hint, "malformed HTTP request")
                return
            except _Refusal as refusal:
                await self._refuse(refusal.status, refusal.message)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not isinstance(event, (h11.Request, _Head)):
                return  # closed, timed out, or closed while idle for a stop
            first = False
            self.busy = True
            try:
                await self._run_request(event)
            finally:
                self.busy = False
                on_idle()
            if self.gone:
                return
            connection = self.h11
            if connection is None:
                continue  # a plain request answered whole: keep alive
            if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
                return
            # What h11 read past this request is the next one's.
            rest, self.eof = connection.trailing_data
            self.buf = bytearray(rest)
            self.h11 = None

    async def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with an error body, then close (a request whose
        framing cannot be trusted leaves nothing on the connection to read)."""
        self.unread_body = True
        body = _error_body(message)
        connection = self.h11
        if connection is None:
            if self.answering:
                self.gone = True
                return
            self.answering = True
            await self._write(
                b"HTTP/1.1 %d \r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%b" % (status, len(body), body)
            )
            self.gone = True
            return
        if connection.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.gone = True
            return
        try:
            await self._send(
                h11.Response(
                    status_code=status,
                    headers=[
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close"),
                    ],
                )
            )
            await self._send(h11.Data(data=body))
            await self._send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            pass
        self.gone = True

    def _start_plain(self, status: int, headers: Any) -> bytes:
        """A plain request's answer head, framed as h11 frames it: by the
        app's ``Content-Length``, else chunked (``Transfer-Encoding``
        replaced); none for 204 and 304."""
        parts = [b"HTTP/1.1 %d \r\n" % status]
        length = -1
        framed = status in (204, 304)
        if not framed:
            for name, value in headers:
                low = name.lower()
                if low == b"transfer-encoding":
                    length = -2
                elif low == b"content-length" and length == -1:
                    length = int(value)
        if framed or length >= 0:
            parts.extend(b"%s: %s\r\n" % (name, value) for name, value in headers)
            self.chunked = False
            self.length_left = length if not framed else 0
        else:
            for name, value in headers:
                low = name.lower()
                if low != b"transfer-encoding" and low != b"content-length":
                    parts.append(b"%s: %s\r\n" % (name, value))
            parts.append(b"Transfer-Encoding: chunked\r\n")
            self.chunked = True
            self.length_left = -1
        parts.append(b"\r\n")
        return b"".join(parts)

    async def _run_request(self, request: h11.Request | _Head) -> None:
        plain = isinstance(request, _Head)
        if isinstance(request, _Head):
            target = request.target
            method = request.method.decode()
            version = "1.1"
            headers = request.headers
            self.body_left = request.length
            self.answering = False
        else:
            target = bytes(request.target)
            method = request.method.decode()
            version = request.http_version.decode()
            headers = [(bytes(k), bytes(v)) for k, v in request.headers]
        path, _, query = target.partition(b"?")
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "method": method,
            "scheme": "http",
            "path": path.decode("latin-1"),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": self.server,
        }
        if self.extensions is not None:
            scope["extensions"] = self.extensions
        head = method == "HEAD"
        body_done = False
        body_started: float | None = None
        body_bytes = 0
        response_started = False
        response_done = False

        async def receive_plain() -> Message:
            """The next piece of a plain request's body (Content-Length)."""
            nonlocal body_done, body_started, body_bytes
            if self.gone:
                return {"type": "http.disconnect"}
            if not self.buf and self.body_left:
                now = trio.current_time()
                if body_started is None:
                    body_started = now
                due = body_started + BODY_GRACE_S + body_bytes / MIN_BODY_RATE_BYTES_PER_S
                more = False
                with trio.move_on_at(min(now + BODY_READ_TIMEOUT_S, due)) as waited:
                    try:
                        more = await self._receive()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        more = False
                if not more:  # broken, closed, or too slow
                    if not response_started and not self.gone:
                        if waited.cancelled_caught:
                            await self._refuse(408, "the request body came too slowly")
                        elif self.eof:  # closed before the whole body, as h11 refuses it
                            await self._refuse(400, "malformed HTTP request")
                    self.gone = True
                    return {"type": "http.disconnect"}
            take = min(self.body_left, len(self.buf))
            body = bytes(self.buf[:take])
            del self.buf[:take]
            self.body_left -= take
            body_bytes += take
            body_done = not self.body_left
            return {"type": "http.request", "body": body, "more_body": not body_done}

        async def receive() -> Message:
            nonlocal body_done, body_started, body_bytes
            if not body_done:
                if plain:
                    return await receive_plain()
                if self.gone:
                    return {"type": "http.disconnect"}
                connection = self._h11()
                if connection.they_are_waiting_for_100_continue and not response_started:
                    await self._send(h11.InformationalResponse(status_code=100, headers=[]))
                event = None
                now = trio.current_time()
                if body_started is None:
                    body_started = now
                due = body_started + BODY_GRACE_S + body_bytes / MIN_BODY_RATE_BYTES_PER_S
                with trio.move_on_at(min(now + BODY_READ_TIMEOUT_S, due)) as waited:
                    try:
                        event = await self._read_event()
                    except h11.RemoteProtocolError as exc:
                        # A malformed body (a bad chunk): refused here, so the
                        # client hears why; the app sees the client gone.
                        if not response_started:
                            await self._refuse(exc.error_status_hint, "malformed HTTP request")
                        event = None
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        event = None
                if event is None:  # broken, malformed, or too slow
                    if waited.cancelled_caught and not response_started and not self.gone:
                        await self._refuse(408, "the request body came too slowly")
                    self.gone = True
                    return {"type": "http.disconnect"}
                if type(event) is h11.Data:
                    body_bytes += len(event.data)
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                if type(event) is h11.EndOfMessage:
                    body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                self.gone = True
                return {"type": "http.disconnect"}
            # The request is read: wait for the client to go away.
            while not self.gone:
                held = len(self.buf) if plain else len(self._h11().trailing_data[0])
                if held > MAX_PIPELINED_BYTES:
                    # Enough pipelined for now: read no more until this
                    # answer is done (a gone client shows when sending fails).
                    await trio.sleep_forever()
                try:
                    data = await self.stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    break
                if not data:
                    break
                # A pipelined next request: kept for the next cycle.
                if plain:
                    self.buf += data
                else:
                    self._h11().receive_data(bytes(data))
            self.gone = True
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal response_started, response_done
            kind = message["type"]
            if kind == "http.response.start":
                response_started = True
                if self.gone:
                    await trio.lowlevel.checkpoint()
                    return
                if plain:
                    self.answering = True
                    await self._write(self._start_plain(message["status"], message["headers"]))
                    return
                data = self._h11().send(
                    h11.Response(status_code=message["status"], headers=message.get("headers", []))
                )
                # h11 chose the framing; a chunked body is framed here.
                self.chunked = b"\r\ntransfer-encoding: chunked\r\n" in data.lower()
                await self._write(data)
            elif kind == "http.response.body":
                body = message.get("body", b"")
                more = message.get("more_body", False)
                # HEAD: the app answers as for GET (its status, headers and
                # Content-Length); the body is dropped here, as HTTP asks.
                if head:
                    body = b""
                if not more:
                    response_done = True
                if self.chunked and not self.gone:
                    # Framed here (h11's chunked framing keeps no state); the
                    # last piece and the end go out in one write.
                    data = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
                    if not more:
                        data += b"0\r\n\r\n" if plain else self._h11().send(h11.EndOfMessage())
                    if data:
                        await self._write(data)
                    return
                if plain:
                    over = len(body) > self.length_left
                    if over:
                        body = body[: self.length_left]
                    self.length_left -= len(body)
                    if body:
                        await self._write(body)
                    else:
                        await trio.lowlevel.checkpoint()
                    if over or (not more and self.length_left):
                        # Not the declared length: the connection cannot go on.
                        self.gone = True
                    return
                if body:
                    await self._send(h11.Data(data=body))
                if not more:
                    await self._send(h11.EndOfMessage())

        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            if not response_started and not self.gone:
                body = error_body_on(scope["path"], internal_error())
                await send(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
            self.gone = True  # a half-sent answer: the connection cannot be reused
            return
        if not response_done:
            self.gone = True
        elif not body_done and not self.gone:
            if plain:
                await self._drain_plain()
            else:
                await self._drain(self._h11(), headers)

    async def _drain_plain(self) -> None:
        """:meth:`_drain` for a plain request: its body's rest by its length."""
        if self.body_left > DRAIN_LIMIT_BYTES:
            self.gone = self.unread_body = True
            return
        with trio.move_on_after(LINGER_S):
            while self.body_left:
                if not self.buf:
                    try:
                        if not await self._receive():
                            break
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        break
                take = min(self.body_left, len(self.buf))
                del self.buf[:take]
                self.body_left -= take
            if not self.body_left:
                return
        self.gone = self.unread_body = True

    async def _drain(self, connection: h11.Connection, headers: list[tuple[bytes, bytes]]) -> None:
        """The app answered without reading the whole body: read and drop a
        small rest that comes at once, so the connection carries the next
        request; a larger or slower one (a 413) closes the connection."""
        declared = dict(headers).get(b"content-length")
        if declared is not None and int(declared) > DRAIN_LIMIT_BYTES:
            self.gone = self.unread_body = True
            return
        dropped = 0
        with trio.move_on_after(LINGER_S):
            while dropped <= DRAIN_LIMIT_BYTES:
                try:
                    event = await self._read_event()
                except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError):
                    break
                if type(event) is not h11.Data:
                    return
                dropped += len(event.data)
        self.gone = self.unread_body = True


async def serve_http1(
    app: App,
    bind: str,
    stop: trio.Event,
    grace_s: float,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``bind`` (``host:port``; port 0 = any) until ``stop``.

    Returns:
        Once ``stop`` is set and every request in flight has finished, or
        ``grace_s`` seconds have passed (the rest are then cancelled).
        ``task_status.started`` gets the bound ``host:port``.
    """
    host, _, port_text = bind.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    listeners = await trio.open_tcp_listeners(int(port_text), host=host)
    _settle_heap()
    sockname = listeners[0].socket.getsockname()
    server = (str(sockname[0]), int(sockname[1]))
    connections: set[_Connection] = set()
    draining = trio.Event()
    quiet = trio.Event()

    def on_idle() -> None:
        if draining.is_set() and not any(c.busy for c in connections):
            quiet.set()

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
            client: tuple[str, int] | None = (str(peer[0]), int(peer[1]))
        except OSError:
            client = None
        connection = _Connection(stream, app, server, client)
        if hangups is not None and connection.fd >= 0:
            connection.hangups = hangups
            connection.extensions = {WATCH_DISCONNECT: connection.watch_disconnect}
        connections.add(connection)
        try:
            async with stream:
                try:
                    await connection.serve(draining, on_idle)
                finally:
                    if connection.hangups is not None:
                        connection.hangups.forget(connection)
        finally:
            connections.discard(connection)

    hangups = _Hangups() if hasattr(select, "epoll") else None
    async with trio.open_nursery() as handler_nursery:
        if hangups is not None:
            handler_nursery.start_soon(hangups.serve)
        accepting = trio.CancelScope()

        async def accept() -> None:
            with accepting:
                await trio.serve_listeners(handle, listeners, handler_nursery=handler_nursery)

        handler_nursery.start_soon(accept)
        task_status.started(f"{server[0]}:{server[1]}")
        await stop.wait()
        accepting.cancel()
        draining.set()
        for connection in list(connections):
            if not connection.busy and connection.idle_scope is not None:
                connection.idle_scope.cancel()
        on_idle()
        with trio.move_on_after(grace_s):
            await quiet.wait()
        handler_nursery.cancel_scope.cancel()
    if hangups is not None:
        hangups.close()
    for listener in listeners:
        await listener.aclose()


_heap_settled = False


def _settle_heap() -> None:
    """Once per process, as its first server listens: collect, then move
    every object loaded so far (modules, settings, the guard's lists) out of
    the cyclic collector's generations (:func:`gc.freeze`), so a full
    collection walks only what came later, and set :data:`GC_THRESHOLDS`.
    Frozen objects are still freed by their reference counts."""
    global _heap_settled
    if _heap_settled:
        return
    _heap_settled = True
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class _Hangups:
    """The server's one watch for clients that go away while their request
    is answered: an ``epoll`` of its own over the watched sockets
    (``EPOLLRDHUP``, one-shot, armed per request by
    :meth:`_Connection.watch_disconnect`), waited on by one task. Costs a
    request one ``epoll_ctl`` instead of a task reading its socket."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        #: Watched sockets' descriptors → their connection.
        self.connections: dict[int, _Connection] = {}

    def arm(self, connection: _Connection) -> None:
        """Report ``connection``'s hang-up once (at once when it has happened)."""
        fd = connection.fd
        if self.connections.get(fd) is connection:
            try:
                self.epoll.modify(fd, _HANGUP_EVENTS)
                return
            except FileNotFoundError:
                pass  # its socket was closed meanwhile (and the fd reused)
        try:
            self.epoll.register(fd, _HANGUP_EVENTS)
        except FileExistsError:
            self.epoll.modify(fd, _HANGUP_EVENTS)
        self.connections[fd] = connection

    def forget(self, connection: _Connection) -> None:
        """Stop watching ``connection`` (before its socket closes)."""
        fd = connection.fd
        if self.connections.get(fd) is connection:
            del self.connections[fd]
            try:
                self.epoll.unregister(fd)
            except OSError:
                pass  # closed already: the kernel dropped it

    async def serve(self) -> None:
        """Tell each connection that hangs up, until cancelled."""
        fileno = self.epoll.fileno()
        while True:
            await trio.lowlevel.wait_readable(fileno)
            for fd, _events in self.epoll.poll(0):
                connection = self.connections.get(fd)
                if connection is not None and connection.watched is not None:
                    connection.hung_up()
                # Else its request had ended: the connection's own read of
                # its next request sees the close.

    def close(self) -> None:
        self.epoll.close()

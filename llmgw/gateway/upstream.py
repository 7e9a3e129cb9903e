"""Pooled keep-alive HTTP/1.1 connections to engines, O(1) per request.

A relay through httpx's shared pool spent 55 % of its CPU in the pool, which
scans every pooled connection on each request (``docs/performance.md``). Here each endpoint has its own
:class:`UpstreamPool`: idle connections wait in a deque; a request takes the
most recently used one (or dials a new one) and gives it back when the
answer has been read to its end. Nothing is ever scanned.

The wire is spoken by h11. A request that fails on a *reused* connection
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
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Final, Protocol, cast

import h11
import trio

from llmgw import errors

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse", "default_ssl_context"]

#: Idle connections kept per endpoint; more are closed when given back.
MAX_IDLE_PER_ENDPOINT: Final = 512
#: Bytes read from the socket at a time.
READ_SIZE: Final = 65536
#: Largest response head accepted, in bytes.
MAX_HEAD_BYTES: Final = 64 * 1024


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
    gives a ``bytearray``, which h11 takes as the bytes-like it documents."""

    async def send_all(self, data: bytes) -> None: ...
    async def receive_some(self, max_bytes: int | None = None) -> bytes: ...
    async def aclose(self) -> None: ...


class _Connection:
    __slots__ = ("h11", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = cast(_Stream, stream)
        self.h11 = h11.Connection(our_role=h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)


class UpstreamResponse:
    """An answer being read: :meth:`receive` its body as it arrives; always
    :meth:`aclose` it (``async with``)."""

    def __init__(self, pool: UpstreamPool, connection: _Connection, response: h11.Response) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self.status = response.status_code
        self.headers: list[tuple[bytes, bytes]] = list(response.headers)
        self._complete = False

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

        Raises:
            UpstreamError: the connection broke mid-answer.
        """
        connection = self._connection
        if connection is None or self._complete:
            return b""
        conn = connection.h11
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamError(
                    f"bad answer from engine: {errors.describe(exc)}", before_response=False
                ) from exc
            if event is h11.NEED_DATA:
                try:
                    data = await connection.stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, OSError) as exc:
                    raise UpstreamError(
                        f"engine connection broke: {errors.describe(exc)}", before_response=False
                    ) from exc
                conn.receive_data(data)
                continue
            if type(event) is h11.Data:
                if event.data:
                    return bytes(event.data)
            elif type(event) is h11.EndOfMessage:
                self._complete = True
                return b""
            elif type(event) is h11.ConnectionClosed:
                raise UpstreamError(
                    "engine closed the connection mid-answer", before_response=False
                )

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        parts = []
        while chunk := await self.receive():
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        """Give the connection back to the pool if the answer was read to its
        end and both sides keep it alive; close it otherwise."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        conn = connection.h11
        if self._complete and conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                pass
            else:
                self._pool._give_back(connection)
                return
        await _close(connection)

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
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
        all_headers = [
            (b"host", self._host_header),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ]
        request = h11.Request(method=method, target=target, headers=all_headers)
        while self._idle:
            connection = self._idle.pop()
            try:
                return await self._exchange(connection, request, body)
            except _Stale:
                await _close(connection)
                continue  # the engine closed it while idle; try the next one
        connection = await self._dial()
        try:
            return await self._exchange(connection, request, body)
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

    async def _exchange(
        self, connection: _Connection, request: h11.Request, body: bytes
    ) -> UpstreamResponse:
        conn = connection.h11
        try:
            data = conn.send(request) or b""
            if body:
                data += conn.send(h11.Data(data=body)) or b""
            data += conn.send(h11.EndOfMessage()) or b""
            await connection.stream.send_all(data)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    chunk = await connection.stream.receive_some(READ_SIZE)
                    conn.receive_data(chunk)
                    if not chunk and conn.their_state is h11.SEND_RESPONSE:
                        raise _Stale("engine closed the connection before answering")
                    continue
                if type(event) is h11.Response:
                    return UpstreamResponse(self, connection, event)
                if type(event) is h11.ConnectionClosed:
                    raise _Stale("engine closed the connection before answering")
                # h11.InformationalResponse (100 Continue …): keep reading.
        except (trio.BrokenResourceError, OSError) as exc:
            raise _Stale(
                f"engine connection broke before answering: {errors.describe(exc)}"
            ) from exc
        except (h11.RemoteProtocolError, h11.LocalProtocolError) as exc:
            await _close(connection)
            raise UpstreamError(
                f"bad answer from engine: {errors.describe(exc)}", before_response=True
            ) from exc
        except BaseException:
            await _close(connection)
            raise

    def _give_back(self, connection: _Connection) -> None:
        if len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            trio.lowlevel.spawn_system_task(_close, connection)


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

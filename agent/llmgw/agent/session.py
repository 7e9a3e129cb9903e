"""The rules of an agent link, for both of its ends.

An agent keeps one websocket to its control plane's agent hub
(``ws://host:port/agent``, ``wss://`` across machines) carrying the frames
of :mod:`llmgw.agent.protocol`. The agent's end (:func:`connect`, used by
:mod:`llmgw.agent.link`) and the control plane's (:func:`serve_links`, used
by :mod:`llmgw.control.hub`) follow these rules, written here once:

Handshake
    Across machines (``llmgw server``) the link is ``wss://`` with mutual
    TLS: the agent presents its node certificate and checks the control
    plane's against the cluster CA; the control plane admits a certificate
    its CA signed only when it issued it and has not revoked it, and takes
    the node id from it (its ``admit``) before it answers anything. A
    certificate it refuses gets HTTP 403 with the reason as the body
    ("certificate revoked at …"), whatever the request (a plain ``GET``
    too), which the agent raises as :class:`CertificateRefused`; one it
    cannot check now (its store does not answer) gets 503 and the agent
    :class:`PeerRefused`, trying again later; one its CA did not sign
    fails the TLS handshake, which the agent reports as "the control plane
    refused this node's certificate". On one machine (``llmgw up``) the link
    is ``ws://`` on loopback with the agent token in ``Authorization:
    Bearer`` (a wrong or missing token: HTTP 401). Another path: HTTP 404.
    The handshake has :data:`CONNECT_TIMEOUT_S`; the agent speaks first: its first frame is
    ``Register`` with its whole state. The control plane waits
    :data:`REGISTER_TIMEOUT_S` for it (:func:`await_register`), answering
    any other frame with ``Error`` meanwhile, then answers ``Registered``,
    or refuses with ``Error`` and closes with :data:`POLICY_VIOLATION`.
Version
    A frame of another protocol version is answered with ``Error`` naming
    both versions ("agent speaks protocol 2, this control plane speaks 1"),
    the link is closed with :data:`PROTOCOL_ERROR`, and
    :class:`~llmgw.agent.protocol.VersionMismatch` is raised.
Frames
    Sent whole and one at a time (a lock per link). A frame that cannot be
    read (an unknown type, a bad shape) is answered with ``Error`` and the
    link stays. Every ``Error`` frame is made by :func:`error_frame`.
Keepalive
    After :data:`PING_AFTER_IDLE_S` without a frame or a pong from the peer,
    ping; no pong within :data:`PONG_TIMEOUT_S` ends the link (a dead peer is
    noticed in about 8 s, not the kernel's minutes).
Closing
    The control plane closes the links it still holds with
    :data:`GOING_AWAY` when it stops, so that agents reconnect without
    taking it for a failure.
Errors
    Every failure of the socket (closed, reset, refused, timed out) surfaces
    as :class:`llmgw.errors.LinkClosed` (:class:`PeerStopping` when the peer
    closed with :data:`GOING_AWAY`); a frame that breaks the protocol as
    :class:`llmgw.errors.ProtocolError`. Callers catch
    :class:`llmgw.errors.LinkError` and never see trio-websocket's errors.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Final, NoReturn, cast
from urllib.parse import urlsplit

import trio
import trio_websocket

from llmgw import errors

from . import protocol

__all__ = [
    "CLOSE_TIMEOUT_S",
    "CONNECT_TIMEOUT_S",
    "DISCONNECT_TIMEOUT_S",
    "GOING_AWAY",
    "PATH",
    "PING_AFTER_IDLE_S",
    "POLICY_VIOLATION",
    "PONG_TIMEOUT_S",
    "PROTOCOL_ERROR",
    "REGISTER_TIMEOUT_S",
    "STANDBY_REASON",
    "Admit",
    "CertificateRefused",
    "CertificateUnchecked",
    "Link",
    "PeerIsStandby",
    "PeerRefused",
    "PeerStopping",
    "await_register",
    "connect",
    "error_frame",
    "first_leaf",
    "serve_links",
]

log = logging.getLogger("llmgw.agent.session")

#: The websocket path of the control plane's agent hub.
PATH: Final = "/agent"
#: Seconds for the websocket handshake (TCP connect and HTTP upgrade).
CONNECT_TIMEOUT_S: Final = 10.0
#: Seconds for the closing handshake when trio-websocket closes a link.
DISCONNECT_TIMEOUT_S: Final = 2.0
#: Seconds the control plane waits for an agent's ``Register``.
REGISTER_TIMEOUT_S: Final = 10.0
#: Seconds of silence from the peer before a ping.
PING_AFTER_IDLE_S: Final = 5.0
#: Seconds to wait for the pong before the link is taken as dead.
PONG_TIMEOUT_S: Final = 3.0
#: Seconds an end waits for its closing handshake when it closes a link.
CLOSE_TIMEOUT_S: Final = 1.0

#: Websocket close codes: stopping, a broken protocol rule, a refusal.
GOING_AWAY: Final = 1001
PROTOCOL_ERROR: Final = 1002
POLICY_VIOLATION: Final = 1008

#: What a failing socket raises inside trio-websocket; turned into LinkClosed.
_SOCKET_ERRORS: Final = (
    trio_websocket.HandshakeError,
    trio_websocket.ConnectionClosed,
    OSError,
    trio.BrokenResourceError,
)


class PeerStopping(errors.LinkClosed):
    """The peer closed the link with :data:`GOING_AWAY`: it is stopping."""


class PeerRefused(errors.LinkClosed):
    """The control plane refused this agent: it closed the link with
    :data:`POLICY_VIOLATION` (its reason says why: a revoked certificate,
    a node id already connected …), or its TLS handshake refused this
    node's certificate."""


class CertificateRefused(PeerRefused):
    """The control plane refused this node's certificate for good (HTTP 403
    before the websocket handshake): revoked (the node was removed), not
    issued by this cluster, or naming another node. Joining again is the
    only way back."""


class CertificateUnchecked(errors.Refused):
    """The control plane could not check a certificate now (its store did not
    answer): the agent is answered HTTP 503 and tries again later."""


#: The most bytes of a refused connection's request head read before answering.
_MAX_REQUEST_HEAD_BYTES: Final = 16384


class PeerIsStandby(PeerRefused):
    """The control plane is a standby: only the leader takes agents; its
    close reason (:data:`STANDBY_REASON`) names where the leader is."""


#: The close reason's start when a standby refuses an agent.
STANDBY_REASON: Final = "standby"


#: The control plane's check of an agent's certificate (DER bytes): the
#: node id it names, or :class:`llmgw.errors.Refused` saying why not.
Admit = Callable[[bytes], Awaitable[str]]

#: A websocket close reason's limit, in bytes.
_MAX_CLOSE_REASON_BYTES: Final = 123


def error_frame(exc: errors.LlmgwError | LookupError, correlation_id: str = "") -> protocol.Error:
    """The ``Error`` frame answering ``exc``: ``message`` is ``str(exc)``, and
    ``correlation_id`` echoes the command's (empty when the error answers no
    command). The one place an error becomes a frame."""
    return protocol.Error(message=str(exc), correlation_id=correlation_id)


@contextmanager
def _translating(peer: str) -> Iterator[None]:
    """Turn a socket failure inside into :class:`~llmgw.errors.LinkClosed`."""
    try:
        yield
    except _SOCKET_ERRORS as exc:
        raise _closed(exc, peer) from exc


def _closed(exc: BaseException, peer: str) -> errors.LinkClosed:
    """The :class:`~llmgw.errors.LinkClosed` for a socket failure ``exc``."""
    tls = _tls_failure(exc)
    if tls is not None:
        return tls
    if isinstance(exc, trio_websocket.ConnectionClosed):
        reason = exc.reason
        if reason is not None and reason.code == GOING_AWAY:
            return PeerStopping(f"the {peer} is stopping ({reason})")
        if reason is not None and reason.code == POLICY_VIOLATION and peer == "control plane":
            if (reason.reason or "").startswith(STANDBY_REASON):
                return PeerIsStandby(f"the control plane is a {reason.reason}")
            return PeerRefused(f"the control plane refused this node: {reason.reason}")
        return errors.LinkClosed(f"closed ({reason})")
    if isinstance(exc, trio_websocket.ConnectionRejected):
        body = (exc.body or b"").decode(errors="replace").strip()
        if peer == "control plane" and exc.status_code in (403, 503) and body:
            refused = CertificateRefused if exc.status_code == 403 else PeerRefused
            return refused(f"the control plane refused this node: {body}")
        return errors.LinkClosed(f"rejected with HTTP {exc.status_code}")
    if isinstance(exc, trio_websocket.ConnectionTimeout):
        return errors.LinkClosed(f"no websocket handshake within {CONNECT_TIMEOUT_S:g} s")
    if isinstance(exc, trio_websocket.DisconnectionTimeout):
        return errors.LinkClosed(f"no closing handshake within {DISCONNECT_TIMEOUT_S:g} s")
    if isinstance(exc, trio_websocket.HandshakeError):
        # Raised without text; the socket's own error is its cause.
        return errors.LinkClosed(f"cannot connect: {errors.describe(exc.__cause__ or exc)}")
    text = errors.describe(exc)
    return errors.LinkClosed(
        text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"
    )


def _tls_failure(exc: BaseException) -> errors.LinkClosed | None:
    """What a TLS failure somewhere in ``exc``'s causes means, or ``None``
    when there is none: the control plane's certificate not signed by this
    node's CA, or the control plane refusing this node's certificate (a TLS
    alert: unknown CA, bad or revoked certificate)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, ssl.SSLCertVerificationError):
            return errors.LinkClosed(
                "the control plane's certificate is not from this node's cluster CA "
                f"({cause.verify_message}): was this node joined to another control plane? "
                "Join again with a code from this one ('llmgw node add')"
            )
        if isinstance(cause, _ClosedAfterHandshake):
            return PeerRefused(
                "the control plane refused this node's certificate (it closed the connection "
                "after the TLS handshake): a self-made certificate, or one not issued by this "
                "cluster's CA; join again with a new code ('llmgw node add' on the control plane)"
            )
        if isinstance(cause, ssl.SSLError) and "ALERT" in (cause.reason or ""):
            return PeerRefused(
                f"the control plane refused this node's certificate ({cause.reason}): "
                "it was not issued by this cluster's CA; join again with a new code "
                "('llmgw node add' on the control plane)"
            )
        cause = cause.__cause__ or cause.__context__
    return None


class Link:
    """One open link, seen from one end.

    Attributes:
        me, peer: what this end and the other are ("agent", "control
            plane"), for the messages of errors the link raises.
        name: who is at the other end, for logs ("node node-a").
    """

    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        *,
        me: str,
        peer: str,
        name: str = "",
        certified_node_id: str = "",
    ) -> None:
        self.me = me
        self.peer = peer
        self.name = name or peer
        #: The node id the agent's certificate names (mutual TLS); "" on a
        #: link without one (``llmgw up``'s loopback agent).
        self.certified_node_id = certified_node_id
        self._ws = ws
        self._send_lock = trio.Lock()
        self._last_heard = trio.current_time()

    async def send(self, message: protocol.Message) -> None:
        """Send ``message`` as one frame, after any frame already going out.

        Raises:
            FrameTooLarge: the frame would exceed ``MAX_FRAME_BYTES``.
            LinkClosed: the link is closed or broke.
        """
        frame = protocol.encode(message)
        async with self._send_lock:
            with _translating(self.peer):
                await self._ws.send_message(frame)

    async def answer(self, exc: errors.LlmgwError | LookupError, correlation_id: str = "") -> None:
        """Send :func:`error_frame` for ``exc``.

        Raises:
            LinkClosed: the link is closed or broke.
        """
        await self.send(error_frame(exc, correlation_id))

    async def receive(self) -> protocol.Message:
        """The next message from the peer. Frames that cannot be read are
        answered with ``Error`` and skipped.

        Raises:
            VersionMismatch: a frame of another protocol version; it was
                answered with ``Error`` and the link is closed.
            LinkClosed: the link is closed or broke.
        """
        while True:
            with _translating(self.peer):
                frame = await self._ws.get_message()
            self._last_heard = trio.current_time()
            try:
                return protocol.decode(frame)
            except protocol.VersionMismatch as exc:
                mismatch = protocol.VersionMismatch(
                    exc.theirs, peer=self.peer, me=f"this {self.me}"
                )
                await self.refuse(mismatch, PROTOCOL_ERROR, "protocol version mismatch")
                raise mismatch from exc
            except errors.ProtocolError as exc:
                log.warning("bad frame from %s: %s", self.name, exc)
                await self.answer(exc)

    async def refuse(self, exc: errors.LlmgwError, code: int, reason: str) -> None:
        """Answer ``exc`` with ``Error`` if the link still carries it, then
        close with ``code`` and ``reason`` (see :meth:`close`)."""
        try:
            await self.answer(exc)
        except errors.LinkClosed:
            pass
        await self.close(code, reason)

    async def keepalive(self) -> NoReturn:
        """Ping the peer after :data:`PING_AFTER_IDLE_S` of silence, forever.

        Raises:
            LinkClosed: no pong within :data:`PONG_TIMEOUT_S`, or the link
                closed.
        """
        while True:
            idle_s = trio.current_time() - self._last_heard
            if idle_s < PING_AFTER_IDLE_S:
                await trio.sleep(PING_AFTER_IDLE_S - idle_s)
                continue
            with trio.move_on_after(PONG_TIMEOUT_S) as waited:
                with _translating(self.peer):
                    await self._ws.ping()
            if waited.cancelled_caught:
                raise errors.LinkClosed(
                    f"the {self.peer} did not answer a ping within {PONG_TIMEOUT_S:g} s"
                )
            self._last_heard = trio.current_time()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close the link with ``code``; a no-op when it is closed already.
        Shielded from cancellation and bounded by :data:`CLOSE_TIMEOUT_S`."""
        if self._ws.closed is not None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
            await self._ws.aclose(code, reason)


# --- the agent's end ------------------------------------------------------------------


@asynccontextmanager
async def connect(
    url: str,
    token: str,
    register: Callable[[], Awaitable[protocol.Register]],
    *,
    ssl_context: ssl.SSLContext | None = None,
) -> AsyncIterator[Link]:
    """Open a link to the control plane at ``url`` and send the ``Register``
    that ``register`` builds; closed on exit.

    Args:
        url: ``ws://host:port/agent`` (``wss://`` across machines).
        token: the agent token ("" with mutual TLS: none is sent).
        register: builds the agent's ``Register`` (its whole state).
        ssl_context: for ``wss://``: the node's certificate and the cluster
            CA (:func:`llmgw.agent.config.agent_ssl_context`).

    Raises:
        PeerRefused: the control plane refused this node's certificate.
        LinkClosed: the control plane cannot be reached, refuses the
            handshake, or the link breaks while it opens or closes. Errors
            from the body pass through as they are, even when closing the
            link fails after them.
    """
    body_error: BaseException | None = None
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    # Not trio-websocket's open_websocket_url: it leaves the socket open when
    # the control plane refuses the handshake (HTTP 401, 403).
    opening = _open_tls(url, ssl_context, headers)
    opened: trio_websocket.WebSocketConnection | None = None
    try:
        try:
            async with opening as ws:
                opened = ws
                link = Link(
                    ws, me="agent", peer="control plane", name=f"the control plane at {url}"
                )
                try:
                    await link.send(await register())
                    yield link
                except BaseException as exc:
                    body_error = exc
                    raise
        finally:
            if opened is not None:
                await _close_transport(opened)
    except _SOCKET_ERRORS as exc:
        if body_error is not None:
            # The body's own error says more than a failure to close after it
            # (a dead peer does not answer the closing handshake either).
            raise body_error from None
        raise _closed(exc, "control plane") from exc


async def _close_transport(ws: trio_websocket.WebSocketConnection) -> None:
    """Close the TCP (or TLS) stream under a client link that trio-websocket
    has closed.

    trio-websocket 0.12 never closes a client's stream when the control plane
    closed the link first: its reader stops at the server's TCP close, and
    ``aclose`` returns at once because the link already has a close reason.
    The socket was then left to the garbage collector (an open file for as
    long as the agent lives, and a ``ResourceWarning``). Closing a closed
    stream again does nothing.
    """
    with trio.CancelScope(shield=True):
        await trio.aclose_forcefully(ws._stream)


class _ClosedAfterHandshake(trio.BrokenResourceError):
    """The control plane closed the connection right after the TLS
    handshake, before answering the websocket handshake."""


class _WatchedStream(trio.abc.Stream):
    """A stream that sets :attr:`broke` when a send or a receive fails,
    keeping the error: trio-websocket waits out its whole timeout when the peer breaks
    the link during the websocket handshake (a TLS 1.3 server refusing the
    client's certificate does so after its own handshake)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.failure: BaseException | None = None
        self.broke = trio.Event()
        self.heard = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.inner.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._failed(exc)
            raise

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self.inner.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._failed(exc)
            raise
        if not data and not self.heard:
            # Closed before it answered the websocket handshake: a control
            # plane that refuses a certificate closes the connection after
            # its TLS handshake (trio sends no alert then).
            self._failed(_ClosedAfterHandshake())
        self.heard = True
        return data

    def _failed(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self.broke.set()

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def _open_tls(
    url: str, ssl_context: ssl.SSLContext | None, headers: list[tuple[bytes, bytes]]
) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A websocket over TLS run here (not by trio-websocket), so that a TLS
    failure during the handshake surfaces at once with its cause.

    Raises:
        trio.BrokenResourceError: the TLS handshake failed, or the control
            plane broke the link during the websocket handshake (the
            :class:`ssl.SSLError` as the cause).
        OSError: the control plane cannot be reached.
        trio_websocket.HandshakeError: no websocket handshake in time.
    """
    parts = urlsplit(url)
    scheme = "ws" if ssl_context is None else "wss"
    if parts.scheme != scheme or not parts.hostname:
        raise trio_websocket.HandshakeError(f"{url!r} is not {scheme}://HOST:PORT/PATH")
    port = parts.port or (80 if ssl_context is None else 443)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = parts.netloc.rsplit("@", 1)[-1]
    failure: BaseException | None = None
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            ws: trio_websocket.WebSocketConnection | None = None
            watched: _WatchedStream | None = None
            with trio.move_on_after(CONNECT_TIMEOUT_S) as waited:
                stream: trio.SSLStream[trio.SocketStream] | trio.SocketStream
                try:
                    if ssl_context is None:
                        stream = await trio.open_tcp_stream(parts.hostname, port)
                    else:
                        stream = await trio.open_ssl_over_tcp_stream(
                            parts.hostname, port, ssl_context=ssl_context, https_compatible=True
                        )
                except OSError as exc:
                    if ssl_context is None:
                        # As trio-websocket reports it: "cannot connect: <the error>".
                        failure = trio_websocket.HandshakeError()
                        failure.__cause__ = exc
                    else:
                        failure = exc
                else:
                    try:
                        if isinstance(stream, trio.SSLStream):
                            await stream.do_handshake()
                    except trio.BrokenResourceError as exc:
                        await trio.aclose_forcefully(stream)
                        failure = exc
                    except BaseException:
                        # Out of time (or cancelled): the socket is closed here too.
                        await trio.aclose_forcefully(stream)
                        raise
                    else:
                        watched = _WatchedStream(stream)
                        async with trio.open_nursery() as racing:

                            async def open_ws(watched: _WatchedStream) -> None:
                                nonlocal ws
                                ws = await trio_websocket.wrap_client_stream(
                                    nursery,
                                    cast(trio.SSLStream[trio.SocketStream], watched),
                                    host_header,
                                    resource,
                                    extra_headers=headers,
                                    max_message_size=protocol.MAX_FRAME_BYTES,
                                )
                                racing.cancel_scope.cancel()

                            async def watch(watched: _WatchedStream) -> None:
                                await watched.broke.wait()
                                racing.cancel_scope.cancel()

                            racing.start_soon(open_ws, watched)
                            racing.start_soon(watch, watched)
            if ws is None:
                nursery.cancel_scope.cancel()
                if failure is None and watched is not None:
                    failure = watched.failure
                if failure is None:
                    failure = (
                        trio_websocket.ConnectionTimeout()
                        if waited.cancelled_caught
                        else trio.BrokenResourceError("the control plane closed the link")
                    )
            else:
                try:
                    yield ws
                except BaseException as exc:
                    # Raised again outside the nursery, not in a group.
                    body_error = exc
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(DISCONNECT_TIMEOUT_S):
                        await ws.aclose()
                    # Not closed by trio-websocket when the peer closed first.
                    await _close_transport(ws)
                    nursery.cancel_scope.cancel()
    except* trio_websocket.ConnectionRejected as group:
        # The control plane answered the websocket handshake with an HTTP
        # status (403: this node's certificate refused), raised by
        # trio-websocket's reader in the nursery.
        failure = first_leaf(group)
    if body_error is not None:
        raise body_error
    if failure is not None:
        if watched is not None:
            await trio.aclose_forcefully(watched.inner)
        raise failure


# --- the control plane's end --------------------------------------------------------


async def serve_links(
    host: str,
    port: int,
    token: str,
    on_link: Callable[[Link], Awaitable[None]],
    *,
    tls: ssl.SSLContext | None = None,
    admit: Admit | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Accept agent links on ``host:port`` and run ``on_link`` for each, until
    cancelled.

    A link whose request has another path than :data:`PATH` is refused with
    HTTP 404. Without ``tls``, one without ``token`` is refused with HTTP
    401. With ``tls`` (a server context that requires client certificates)
    the TLS handshake is run first (:data:`CONNECT_TIMEOUT_S`); ``admit``
    gets the agent's certificate and names its node
    (:attr:`Link.certified_node_id`), or refuses it: the link is then closed
    with :data:`POLICY_VIOLATION` and the reason, before ``on_link``. Once
    ``on_link`` returns or raises, a link still open is closed with
    :data:`GOING_AWAY`; a :class:`~llmgw.errors.LinkError` it raises ends
    that link alone (logged).

    Args:
        host, port: where to listen (port 0 picks a free one).
        token: the agent token links must present (``Authorization:
            Bearer``) when there is no ``tls``.
        on_link: the control plane's side of one link.
        tls, admit: mutual TLS (both or neither).

    Returns:
        Never returns unless cancelled; ``task_status.started`` gets the
        bound port.
    """
    if tls is not None:
        if admit is None:
            raise ValueError("mutual TLS needs admit")
        await _serve_tls_links(host, port, tls, admit, on_link, task_status=task_status)

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        await _serve_one(request, token, on_link)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: trio_websocket.serve_websocket(
                handler,
                host,
                port,
                None,
                max_message_size=protocol.MAX_FRAME_BYTES,
                connect_timeout=CONNECT_TIMEOUT_S,
                disconnect_timeout=DISCONNECT_TIMEOUT_S,
                task_status=task_status,
            )
        )
        task_status.started(server.port)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


async def _serve_tls_links(
    host: str,
    port: int,
    tls: ssl.SSLContext,
    admit: Admit,
    on_link: Callable[[Link], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[int],
) -> NoReturn:
    listeners = await trio.open_ssl_over_tcp_listeners(port, tls, host=host, https_compatible=True)

    async def handler(stream: trio.SSLStream[trio.SocketStream]) -> None:
        await _serve_tls_one(stream, admit, on_link)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        transport = listeners[0].transport_listener
        assert isinstance(transport, trio.SocketListener)
        task_status.started(transport.socket.getsockname()[1])
        await trio.sleep_forever()
    raise AssertionError("unreachable")


async def _serve_tls_one(
    stream: trio.SSLStream[trio.SocketStream],
    admit: Admit,
    on_link: Callable[[Link], Awaitable[None]],
) -> None:
    """One TLS connection: the handshake, the certificate's admission, the
    websocket handshake, then the link."""
    try:
        host, port = stream.transport_stream.socket.getpeername()[:2]
        peer = f"{host}:{port}"
    except OSError:
        peer = "an agent"
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            await stream.do_handshake()
    except (trio.BrokenResourceError, trio.TooSlowError) as exc:
        cause = exc.__cause__ or exc
        log.warning(
            "agent link from %s refused: TLS handshake failed (%s)", peer, errors.describe(cause)
        )
        await trio.aclose_forcefully(stream)
        return
    der = stream.getpeercert(binary_form=True)
    refusal: errors.LlmgwError | None = None
    node_id = ""
    if der is None:
        refusal = errors.Refused("no client certificate")
    else:
        try:
            node_id = await admit(der)
        except errors.Refused as exc:
            refusal = exc
        except errors.LlmgwError as exc:
            # The store cannot be asked now (a StoreError): the agent retries.
            log.warning("agent link from %s: certificate not checked: %s", peer, exc)
            refusal = CertificateUnchecked(
                "the control plane cannot check this node's certificate now; trying again later"
            )
    if refusal is not None:
        try:
            await _refuse_http(stream, refusal, peer)
        finally:
            await trio.aclose_forcefully(stream)
        return
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(CONNECT_TIMEOUT_S), _translating("agent"):
                    request = await trio_websocket.wrap_server_stream(
                        nursery, stream, max_message_size=protocol.MAX_FRAME_BYTES
                    )
            except (trio.TooSlowError, errors.LinkError) as exc:
                log.warning(
                    "agent link from %s: no websocket handshake (%s)", peer, errors.describe(exc)
                )
                nursery.cancel_scope.cancel()
                return
            await _serve_one(
                request, "", on_link, certified_node_id=node_id, refusal=refusal, peer=peer
            )
            nursery.cancel_scope.cancel()
    finally:
        # Its socket is closed here, not left to the garbage collector.
        await trio.aclose_forcefully(stream)


async def _refuse_http(
    stream: trio.SSLStream[trio.SocketStream], refusal: errors.LlmgwError, peer: str
) -> None:
    """Answer a connection whose certificate was refused, before any
    websocket handshake and whatever it asks (a plain ``GET`` too): HTTP 403
    with the reason as the body, or 503 when the certificate could not be
    checked now (:class:`CertificateUnchecked`)."""
    log.warning("agent link from %s refused: %s", peer, refusal)
    unchecked = isinstance(refusal, CertificateUnchecked)
    status = "503 Service Unavailable" if unchecked else "403 Forbidden"
    body = f"{refusal}\n".encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    with trio.move_on_after(CONNECT_TIMEOUT_S):
        try:
            # The request's head is read first: a socket closed with unread
            # data resets, and the client might lose the answer.
            received = b""
            while b"\r\n\r\n" not in received and len(received) < _MAX_REQUEST_HEAD_BYTES:
                data = await stream.receive_some(4096)
                if not data:
                    return
                received += data
            await stream.send_all(head + body)
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _token_of(request: trio_websocket.WebSocketRequest) -> str:
    for name, value in request.headers:
        if name.lower() == b"authorization" and value.startswith(b"Bearer "):
            return value[7:].decode("latin-1")
    return ""


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf exception of a (possibly nested) group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _close_reason(text: str) -> str:
    """``text`` cut to fit a websocket close reason."""
    data = text.encode()
    if len(data) <= _MAX_CLOSE_REASON_BYTES:
        return text
    return data[: _MAX_CLOSE_REASON_BYTES - 3].decode(errors="ignore") + "..."


async def _serve_one(
    request: trio_websocket.WebSocketRequest,
    token: str,
    on_link: Callable[[Link], Awaitable[None]],
    *,
    certified_node_id: str = "",
    refusal: errors.LlmgwError | None = None,
    peer: str = "",
) -> None:
    name = f"node {certified_node_id}" if certified_node_id else "an agent not registered yet"
    try:
        with _translating("agent"):
            if request.path != PATH:
                await request.reject(404)
                return
            if token and not hmac.compare_digest(_token_of(request).encode(), token.encode()):
                log.warning("agent link refused: wrong or missing token")
                await request.reject(401)
                return
            with trio.fail_after(CONNECT_TIMEOUT_S):
                ws = await request.accept()
        link = Link(
            ws, me="control plane", peer="agent", name=name, certified_node_id=certified_node_id
        )
        if refusal is not None:
            log.warning("agent link from %s refused: %s", peer or name, refusal)
            await link.refuse(refusal, POLICY_VIOLATION, _close_reason(str(refusal)))
            return
        try:
            await on_link(link)
        finally:
            name = link.name
            # Still open: the control plane is stopping. Say so, so that the
            # agent does not take it for a broken link.
            await link.close(GOING_AWAY, "control plane stopping")
    except* errors.LinkError as group:
        cause = first_leaf(group)
        if isinstance(cause, PeerStopping):
            log.info("link to %s closed: the agent is stopping", name)
        else:
            log.warning("link to %s closed: %s", name, cause)
    except* trio.TooSlowError:
        log.warning("link to %s: no websocket handshake within %g s", name, CONNECT_TIMEOUT_S)


async def await_register(link: Link) -> protocol.Register:
    """The agent's first message, which must be ``Register``; other frames
    are answered with ``Error`` until it comes.

    Raises:
        ProtocolError: no ``Register`` within :data:`REGISTER_TIMEOUT_S`.
        VersionMismatch: a frame of another protocol version (link closed).
        LinkClosed: the link closed or broke.
    """
    with trio.move_on_after(REGISTER_TIMEOUT_S):
        while True:
            message = await link.receive()
            if isinstance(message, protocol.Register):
                return message
            await link.answer(errors.ProtocolError("the first message must be Register"))
    raise errors.ProtocolError(f"no Register within {REGISTER_TIMEOUT_S:g} s")

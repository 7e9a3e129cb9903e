"""A lean HTTP/1.1 server for the client port, speaking the ASGI subset the
gateway uses.

Why not hypercorn here: under 128 streams hypercorn's layers (protocol
wrapper, stream objects, event classes, a task group per request) took about
half of the gateway's CPU, most of it per streamed chunk (profile in
``docs/performance.md``). This server keeps one task per connection, parses
requests with h11, and writes responses with h11 straight to the socket.
The admin API and metrics listeners stay on hypercorn.

ASGI subset: ``http`` scopes (``method``, ``path``, ``raw_path``,
``query_string``, ``headers``, ``client``, ``server``); ``receive`` yields
``http.request`` messages, then ``http.disconnect`` once the client has
gone; ``send`` takes ``http.response.start`` and ``http.response.body``.
For a HEAD request the app answers as for GET and the server sends the
status and headers (Content-Length included) without the body.
Sending after the client has gone is silently dropped, as hypercorn does.
An app that raises before it began its answer gets 500 ``internal_error``
in the path's error shape (:func:`llmgw.gateway.errors.error_body_on`).

Stop: when ``stop`` is set the listeners close at once, idle keep-alive
connections are closed, and requests in flight get ``grace_s`` to finish;
then whatever is left is cancelled.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import h11
import trio

from llmgw.asgi import Message, Receive, Scope, Send

from .errors import error_body_on, internal_error

__all__ = ["serve_http1"]

log = logging.getLogger("llmgw.http")

App = Callable[[Scope, Receive, Send], Awaitable[None]]

READ_SIZE: Final = 65536
#: Largest request head, in bytes; a larger one gets 431-ish refusal (h11: 400).
MAX_HEAD_BYTES: Final = 64 * 1024
#: A new connection must send its request head within this, in seconds.
FIRST_REQUEST_TIMEOUT_S: Final = 30.0
#: A request body that stops arriving for this long is given up, in seconds.
BODY_READ_TIMEOUT_S: Final = 30.0
#: An idle keep-alive connection is closed after this, in seconds.
KEEP_ALIVE_TIMEOUT_S: Final = 75.0


class _Connection:
    """One client connection: reads requests, runs the app for each in turn."""

    def __init__(self, stream: trio.SocketStream, app: App, server: tuple[str, int]) -> None:
        self.stream = stream
        self.app = app
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.server = server
        try:
            peer = stream.socket.getpeername()
            self.client: tuple[str, int] | None = (str(peer[0]), int(peer[1]))
        except OSError:
            self.client = None
        self.busy = False
        self.idle_scope: trio.CancelScope | None = None
        self.gone = False

    async def _read_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.stream.receive_some(READ_SIZE)
            self.h11.receive_data(data)

    async def _send(self, event: Any) -> None:
        data = self.h11.send(event)
        if data and not self.gone:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.gone = True

    async def serve(self, draining: trio.Event, on_idle: Callable[[], None]) -> None:
        first = True
        while not draining.is_set():
            event: Any = None
            with trio.move_on_after(
                FIRST_REQUEST_TIMEOUT_S if first else KEEP_ALIVE_TIMEOUT_S
            ) as self.idle_scope:
                try:
                    event = await self._read_event()
                except h11.RemoteProtocolError as exc:
                    await self._refuse(exc)
                    return
                except (trio.BrokenResourceError, OSError):
                    return
            self.idle_scope = None
            if not isinstance(event, h11.Request):
                return  # closed, timed out, or closed while idle for a stop
            first = False
            self.busy = True
            try:
                await self._run_request(event)
            finally:
                self.busy = False
                on_idle()
            if (
                self.gone
                or self.h11.our_state is not h11.DONE
                or self.h11.their_state is not h11.DONE
            ):
                return
            try:
                self.h11.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _refuse(self, exc: h11.RemoteProtocolError) -> None:
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = b'{"error":{"message":"malformed HTTP request","type":"invalid_request_error","code":null,"param":null}}'
        try:
            await self._send(
                h11.Response(
                    status_code=exc.error_status_hint,
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

    async def _run_request(self, request: h11.Request) -> None:
        target = bytes(request.target)
        path, _, query = target.partition(b"?")
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(),
            "method": request.method.decode(),
            "scheme": "http",
            "path": path.decode("latin-1"),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": [(bytes(k), bytes(v)) for k, v in request.headers],
            "client": self.client,
            "server": self.server,
        }
        head = request.method == b"HEAD"
        body_done = False
        response_started = False
        response_done = False

        async def receive() -> Message:
            nonlocal body_done
            if not body_done:
                event = None
                with trio.move_on_after(BODY_READ_TIMEOUT_S):
                    try:
                        event = await self._read_event()
                    except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError):
                        event = None
                if event is None:  # broken, malformed, or too slow
                    self.gone = True
                    return {"type": "http.disconnect"}
                if type(event) is h11.Data:
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                if type(event) is h11.EndOfMessage:
                    body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                self.gone = True
                return {"type": "http.disconnect"}
            # The request is read: wait for the client to go away.
            while not self.gone:
                try:
                    data = await self.stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    break
                if not data:
                    break
                # A pipelined next request: h11 keeps it for the next cycle.
                self.h11.receive_data(data)
            self.gone = True
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal response_started, response_done
            kind = message["type"]
            if kind == "http.response.start":
                response_started = True
                await self._send(
                    h11.Response(status_code=message["status"], headers=message.get("headers", []))
                )
            elif kind == "http.response.body":
                body = message.get("body", b"")
                # HEAD: the app answers as for GET (its status, headers and
                # Content-Length); the body is dropped here, as HTTP asks.
                if body and not head:
                    await self._send(h11.Data(data=body))
                if not message.get("more_body", False):
                    response_done = True
                    await self._send(h11.EndOfMessage())

        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            if not response_started:
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
        elif not body_done:
            # The app answered without reading the whole body: drain it, so
            # the connection can carry the next request.
            while True:
                try:
                    event = await self._read_event()
                except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError):
                    self.gone = True
                    return
                if type(event) is not h11.Data:
                    return


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
    sockname = listeners[0].socket.getsockname()
    server = (str(sockname[0]), int(sockname[1]))
    connections: set[_Connection] = set()
    draining = trio.Event()
    quiet = trio.Event()

    def on_idle() -> None:
        if draining.is_set() and not any(c.busy for c in connections):
            quiet.set()

    async def handle(stream: trio.SocketStream) -> None:
        connection = _Connection(stream, app, server)
        connections.add(connection)
        try:
            async with stream:
                await connection.serve(draining, on_idle)
        finally:
            connections.discard(connection)

    async with trio.open_nursery() as handler_nursery:
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
    for listener in listeners:
        await listener.aclose()

"""The agent's side of the link: connect, register, heartbeat, obey, reconnect.

One websocket to the control plane's agent hub. On every connect the agent
sends :class:`~llmgw.agent.protocol.Register` with its whole state (hardware
and running shards), then heartbeats every :data:`HEARTBEAT_INTERVAL_S` and
the supervisor's shard status changes as they happen. Commands
(``StartShard``, ``StopShard``, ``LogsRequest``) are carried out as they come.

A dead peer is noticed by the keepalive: after :data:`PING_AFTER_IDLE_S` of
silence the agent pings and waits :data:`PONG_TIMEOUT_S` for the pong
(about 8 s in all, not the kernel's minutes). Then it reconnects with
exponential back-off and jitter (0.5 s doubling to 15 s), reset once a
session has heard from its control plane (``shared/spec/agent.md``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Final, NoReturn

import attrs
import trio
import trio_websocket

from . import protocol
from .protocol import (
    Error,
    Heartbeat,
    LogsReply,
    LogsRequest,
    Message,
    Register,
    Registered,
    ShardStatus,
    StartShard,
    StopShard,
)

__all__ = ["HEARTBEAT_INTERVAL_S", "AgentHandlers", "serve_link"]

log = logging.getLogger("llmgw.agent.link")

HEARTBEAT_INTERVAL_S: Final = 5.0
PING_AFTER_IDLE_S: Final = 5.0
PONG_TIMEOUT_S: Final = 3.0
BACKOFF_FIRST_S: Final = 0.5
BACKOFF_MAX_S: Final = 15.0
CONNECT_TIMEOUT_S: Final = 10.0
#: Frames waiting to go out on one link; a full queue makes the sender wait.
OUTBOX_SIZE: Final = 256

#: What ends one session and starts a reconnect. Anything else is a bug and
#: propagates.
LINK_ERRORS: Final = (
    trio_websocket.HandshakeError,
    trio_websocket.ConnectionClosed,
    OSError,
    trio.TooSlowError,
    trio.BrokenResourceError,
)


@attrs.define(kw_only=True)
class AgentHandlers:
    """What the link needs from the rest of the agent.

    Attributes:
        register: builds the ``Register`` (whole state) for a new session.
        heartbeat: builds the next ``Heartbeat``.
        start_shard, stop_shard: carry out those commands.
        logs: the last N lines of a source (shard id, or "" for the agent);
            raises LookupError for a shard it does not know.
        status_events: the supervisor's shard status changes, relayed to the
            control plane while a session is up (dropped while it is down:
            the next ``Register`` carries the whole state).
        on_registered: called once per session when the control plane accepts.
    """

    register: Callable[[], Awaitable[Register]]
    heartbeat: Callable[[], Awaitable[Heartbeat]]
    start_shard: Callable[[StartShard], Awaitable[None]]
    stop_shard: Callable[[str], Awaitable[None]]
    logs: Callable[[str, int], list[str]]
    status_events: trio.MemoryReceiveChannel[ShardStatus]
    on_registered: Callable[[Registered], None] = lambda _: None


async def serve_link(
    url: str,
    token: str,
    handlers: AgentHandlers,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Keep a link to the control plane at ``url`` for as long as this runs.

    Args:
        url: ``ws://host:port/agent`` (``wss://`` across machines).
        token: the agent token, sent as ``Authorization: Bearer``.
        handlers: the agent's side (see :class:`AgentHandlers`).

    Returns:
        Never returns unless cancelled. ``task_status.started()`` is called
        at once: the link retries on its own and never fails its caller.
    """
    task_status.started()
    backoff_s = BACKOFF_FIRST_S
    while True:
        heard = False

        def mark_heard() -> None:
            nonlocal heard
            heard = True

        try:
            await _one_session(url, token, handlers, mark_heard)
        except* LINK_ERRORS as group:
            cause = _first(group)
            if (
                isinstance(cause, trio_websocket.ConnectionClosed)
                and cause.reason is not None
                and cause.reason.code == 1001
            ):
                log.info("the control plane at %s is stopping; will reconnect", url)
            else:
                log.warning("link to %s lost: %s", url, _describe(cause))
        if heard:
            backoff_s = BACKOFF_FIRST_S
        delay_s = backoff_s * random.uniform(0.5, 1.0)
        backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
        with trio.move_on_after(delay_s):
            # Status changes while no session is up are dropped: the next
            # Register carries the whole state.
            async for _ in handlers.status_events:
                pass


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf exception of a (possibly nested) group."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio_websocket.ConnectionClosed):
        return f"closed ({exc.reason})"
    if isinstance(exc, trio_websocket.ConnectionRejected):
        return f"rejected with HTTP {exc.status_code}"
    return f"{type(exc).__name__}: {exc}"


async def _one_session(
    url: str, token: str, handlers: AgentHandlers, mark_heard: Callable[[], None]
) -> None:
    headers = [(b"authorization", f"Bearer {token}".encode())]
    async with trio_websocket.open_websocket_url(
        url,
        extra_headers=headers,
        max_message_size=protocol.MAX_FRAME_BYTES,
        connect_timeout=CONNECT_TIMEOUT_S,
        disconnect_timeout=2,
    ) as ws:
        await _Session(ws, handlers, mark_heard).run()


class _Session:
    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        handlers: AgentHandlers,
        mark_heard: Callable[[], None],
    ) -> None:
        self._ws = ws
        self._h = handlers
        self._mark_heard = mark_heard
        self._last_heard = trio.current_time()
        self._send_lock = trio.Lock()

    async def send(self, message: Message) -> None:
        frame = protocol.encode(message)
        async with self._send_lock:
            await self._ws.send_message(frame)

    async def run(self) -> None:
        await self.send(await self._h.register())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats)
            nursery.start_soon(self._keepalive)
            nursery.start_soon(self._relay_status)
            await self._read(nursery)

    async def _read(self, nursery: trio.Nursery) -> None:
        while True:
            frame = await self._ws.get_message()
            self._last_heard = trio.current_time()
            try:
                message = protocol.decode(frame)
            except protocol.UnknownMessage as exc:
                log.warning("control plane sent %s; ignored", exc)
                await self.send(Error(message=str(exc)))
                continue
            except protocol.ProtocolError as exc:
                log.warning("bad frame from control plane: %s", exc)
                await self.send(Error(message=str(exc)))
                continue
            if isinstance(message, Registered):
                # Only an accepted registration resets the back-off: a control
                # plane refusing this agent (its node is connected through
                # another) must not be asked again several times a second.
                self._mark_heard()
            nursery.start_soon(self._obey, message)

    async def _obey(self, message: Message) -> None:
        match message:
            case Registered():
                log.info("registered with the control plane as %s", message.node_id)
                self._h.on_registered(message)
            case StartShard():
                await self._h.start_shard(message)
            case StopShard():
                await self._h.stop_shard(message.shard_id)
            case LogsRequest():
                try:
                    lines = self._h.logs(message.source, message.lines)
                except LookupError as exc:
                    await self.send(Error(message=str(exc), correlation_id=message.correlation_id))
                    return
                await self.send(
                    LogsReply(
                        correlation_id=message.correlation_id,
                        lines=tuple(lines),
                        source=message.source,
                    )
                )
            case Error():
                log.warning("control plane reports an error: %s", message.message)
            case _:
                await self.send(Error(message=f"{type(message).__name__} is not for an agent"))

    async def _heartbeats(self) -> None:
        while True:
            await trio.sleep(HEARTBEAT_INTERVAL_S)
            await self.send(await self._h.heartbeat())

    async def _keepalive(self) -> None:
        while True:
            idle_s = trio.current_time() - self._last_heard
            if idle_s < PING_AFTER_IDLE_S:
                await trio.sleep(PING_AFTER_IDLE_S - idle_s)
                continue
            with trio.fail_after(PONG_TIMEOUT_S):
                await self._ws.ping()
            self._last_heard = trio.current_time()

    async def _relay_status(self) -> None:
        async for status in self._h.status_events:
            await self.send(status)

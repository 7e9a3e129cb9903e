"""The agent's side of the link: connect, register, heartbeat, obey, reconnect.

One websocket to the control plane's agent hub, under the rules of
:mod:`llmgw.agent.session` (handshake, version check, keepalive, errors). On
every connect the agent sends :class:`~llmgw.agent.protocol.Register` with
its whole state (hardware and running shards), then heartbeats every
:data:`HEARTBEAT_INTERVAL_S` and the supervisor's shard status changes as
they happen. Commands (``StartShard``, ``StopShard``, ``LogsRequest``) are
carried out as they come; one that fails with an :class:`llmgw.errors.LlmgwError`
is answered with ``Error``.

When the link fails (the keepalive notices a dead peer in about 8 s) the
agent reconnects with exponential back-off and jitter (0.5 s doubling to
15 s), reset once a session has been accepted by its control plane.

A link given a ``stop`` event closes with "going away" once it is set (the
control plane then logs a stop, not a lost link) and :func:`serve_link`
returns.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Final

import attrs
import trio

from llmgw import errors

from . import session
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
BACKOFF_FIRST_S: Final = 0.5
BACKOFF_MAX_S: Final = 15.0

#: What ends one session and starts a reconnect: the link failing, or an
#: OSError from the agent's own side while it serves the session (a state
#: file it cannot write). Anything else is a bug and propagates.
SESSION_ENDERS: Final = (errors.LinkError, OSError)


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
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep a link to the control plane at ``url`` until cancelled or ``stop``.

    Args:
        url: ``ws://host:port/agent`` (``wss://`` across machines).
        token: the agent token, sent as ``Authorization: Bearer``.
        handlers: the agent's side (see :class:`AgentHandlers`).
        stop: once set, the link closes with ``GOING_AWAY`` ("agent
            stopping", bounded by :data:`~llmgw.agent.session.CLOSE_TIMEOUT_S`)
            and this returns.

    Returns:
        Once ``stop`` is set and the link is closed; never otherwise unless
        cancelled. ``task_status.started()`` is called at once: the link
        retries on its own and never fails its caller.
    """
    task_status.started()
    if stop is None:
        stop = trio.Event()  # never set
    backoff_s = BACKOFF_FIRST_S
    # The control plane said it was stopping: until it is back, failing to
    # reach it is expected, not a warning.
    peer_stopped = False
    while not stop.is_set():
        heard = False
        connected = False

        def mark_heard() -> None:
            nonlocal heard
            heard = True

        cause: BaseException | None = None
        try:
            async with session.connect(url, token, handlers.register) as link:
                connected = True
                peer_stopped = False
                await _Session(link, handlers, mark_heard, stop).run()
        except* SESSION_ENDERS as group:
            cause = session.first_leaf(group)
        if heard:
            backoff_s = BACKOFF_FIRST_S
        delay_s = backoff_s * random.uniform(0.5, 1.0)
        backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
        if isinstance(cause, session.PeerStopping):
            peer_stopped = True
            log.info("the control plane at %s is stopping; will reconnect", url)
        elif cause is not None and not connected:
            log.log(
                logging.INFO if peer_stopped else logging.WARNING,
                "cannot reach the control plane at %s (%s); trying again in %.1f s",
                url,
                _describe(cause),
                delay_s,
            )
        elif cause is not None:
            log.warning("link to %s lost: %s", url, _describe(cause))
        async with trio.open_nursery() as waiting:
            waiting.start_soon(_cancel_on, stop, waiting.cancel_scope)
            with trio.move_on_after(delay_s):
                # Status changes while no session is up are dropped: the next
                # Register carries the whole state.
                async for _ in handlers.status_events:
                    pass
            waiting.cancel_scope.cancel()


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _describe(exc: BaseException) -> str:
    """Never empty: a link error's text, or another error's class and text."""
    if isinstance(exc, errors.LinkError):
        return errors.describe(exc)
    text = errors.describe(exc)
    return text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"


class _Session:
    def __init__(
        self,
        link: session.Link,
        handlers: AgentHandlers,
        mark_heard: Callable[[], None],
        stop: trio.Event,
    ) -> None:
        self._link = link
        self._h = handlers
        self._mark_heard = mark_heard
        self._stop = stop

    async def run(self) -> None:
        """Until the link fails (raises) or ``stop`` is set (returns, the
        link closed as a stop)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._heartbeats)
            nursery.start_soon(self._link.keepalive)
            nursery.start_soon(self._relay_status)
            nursery.start_soon(self._read, nursery)
            await self._stop.wait()
            nursery.cancel_scope.cancel()
        await self._link.close(session.GOING_AWAY, "agent stopping")

    async def _read(self, nursery: trio.Nursery) -> None:
        while True:
            message = await self._link.receive()
            if isinstance(message, Registered):
                # Only an accepted registration resets the back-off: a control
                # plane refusing this agent (its node is connected through
                # another) must not be asked again several times a second.
                self._mark_heard()
            nursery.start_soon(self._obey, message)

    async def _obey(self, message: Message) -> None:
        try:
            await self._carry_out(message)
        except errors.LinkError:
            raise
        except errors.LlmgwError as exc:
            log.warning("%s failed: %s", type(message).__name__, exc)
            await self._link.answer(exc, getattr(message, "correlation_id", ""))

    async def _carry_out(self, message: Message) -> None:
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
                    await self._link.answer(exc, message.correlation_id)
                    return
                await self._link.send(
                    LogsReply(
                        correlation_id=message.correlation_id,
                        lines=tuple(lines),
                        source=message.source,
                    )
                )
            case Error():
                log.warning("control plane reports an error: %s", message.message)
            case _:
                await self._link.answer(
                    errors.ProtocolError(f"{type(message).__name__} is not for an agent")
                )

    async def _heartbeats(self) -> None:
        while True:
            await trio.sleep(HEARTBEAT_INTERVAL_S)
            await self._link.send(await self._h.heartbeat())

    async def _relay_status(self) -> None:
        async for status in self._h.status_events:
            await self._link.send(status)

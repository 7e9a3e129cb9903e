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

When the control plane refuses this node's certificate for good
(:class:`~llmgw.agent.session.CertificateRefused`: revoked by ``ctl nodes
remove``, or not issued by this cluster) the agent stops every engine it
runs (``stop_engines``), logs it, and keeps trying only every 15 s (the
back-off's maximum): the node is back only by joining again.

The agent knows every control plane it may link to (:class:`ServerList`):
those it was given (agent.yaml's ``servers``, ``--server``) and those the
leader sent (``ControlPlanes``, kept in ``STATE_DIR/control-planes.json``
across restarts). A connect that fails moves on to the next at once; the
back-off applies once every one has failed in a row. A standby refuses an
agent (only the leader takes agents), naming where the leader is: the agent
tries the next at once, and the whole list again after
:data:`STANDBY_RETRY_S`, without growing the back-off.

A link given a ``stop`` event closes with "going away" once it is set (the
control plane then logs a stop, not a lost link) and :func:`serve_link`
returns.
"""

from __future__ import annotations

import json
import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Final

import attrs
import trio

from llmgw import errors

from . import session
from .protocol import (
    ControlPlanes,
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
    WeightsReply,
    WeightsRequest,
)

__all__ = [
    "CONTROL_PLANES_FILE",
    "HEARTBEAT_INTERVAL_S",
    "AgentHandlers",
    "ServerList",
    "serve_link",
]

log = logging.getLogger("llmgw.agent.link")

HEARTBEAT_INTERVAL_S: Final = 5.0
BACKOFF_FIRST_S: Final = 0.5
BACKOFF_MAX_S: Final = 15.0

#: What ends one session and starts a reconnect: the link failing, or an
#: OSError from the agent's own side while it serves the session (a state
#: file it cannot write). Anything else is a bug and propagates.
SESSION_ENDERS: Final = (errors.LinkError, OSError)
#: After every control plane refused as a standby (or failed), the wait
#: before the list is tried again, in seconds.
STANDBY_RETRY_S: Final = 0.5
#: Where the control planes the leader sent are kept, in the state directory.
CONTROL_PLANES_FILE: Final = "control-planes.json"


class ServerList:
    """The control planes' agent hubs an agent may link to, tried in turn.

    The URLs given (agent.yaml's ``servers``, or ``--server``) come first,
    then those the leader sent (:meth:`learn`) that are not among them,
    each once. The list learned is kept in ``path`` (JSON ``{"urls": [...]}``)
    and read back at start; a file that cannot be read counts as none.
    """

    def __init__(self, given: Sequence[str], path: Path | None = None) -> None:
        if not given:
            raise ValueError("at least one control plane URL is needed")
        self._given = list(dict.fromkeys(given))
        self._path = path
        self._learned = self._read()
        self._index = 0

    def _read(self) -> list[str]:
        if self._path is None:
            return []
        try:
            doc = json.loads(self._path.read_text())
            urls = doc["urls"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        if not isinstance(urls, list):
            return []
        return [u for u in urls if isinstance(u, str) and u.startswith(("ws://", "wss://"))]

    def urls(self) -> list[str]:
        """Every URL, in the order they are tried."""
        return list(dict.fromkeys([*self._given, *self._learned]))

    @property
    def current(self) -> str:
        """The URL the next connect goes to."""
        urls = self.urls()
        return urls[self._index % len(urls)]

    def advance(self) -> bool:
        """Move to the next URL; ``True`` when that starts the list again
        (every one has been tried)."""
        self._index = (self._index + 1) % len(self.urls())
        return self._index == 0

    def learn(self, urls: Sequence[str]) -> None:
        """Take the leader's list: kept (in the file too) and tried after
        those given; the URL in use stays current.

        Raises:
            OSError: the file cannot be written.
        """
        current = self.current
        learned = [u for u in dict.fromkeys(urls) if u.startswith(("ws://", "wss://"))]
        if learned == self._learned:
            return
        self._learned = learned
        self._index = self.urls().index(current)
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            partial = self._path.with_suffix(".partial")
            partial.write_text(json.dumps({"urls": learned}, indent=2) + "\n")
            os.replace(partial, self._path)
        log.info("control planes: %s", ", ".join(self.urls()))


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
        stop_engines: stops every engine of this node and says how many it
            stopped; called when the control plane refused this node's
            certificate for good (the node was removed: revoked).
        weights: answers a ``WeightsRequest`` (``docs/models-from-hf.md``).
    """

    register: Callable[[], Awaitable[Register]]
    heartbeat: Callable[[], Awaitable[Heartbeat]]
    start_shard: Callable[[StartShard], Awaitable[None]]
    stop_shard: Callable[[str], Awaitable[None]]
    logs: Callable[[str, int], list[str]]
    status_events: trio.MemoryReceiveChannel[ShardStatus]
    on_registered: Callable[[Registered], None] = lambda _: None
    stop_engines: Callable[[], Awaitable[int]] | None = None
    #: Answers a ``WeightsRequest`` (lists, and removes, fetched weights);
    #: ``None``: the request is answered with an error.
    weights: Callable[[WeightsRequest], Awaitable[WeightsReply]] | None = None


async def serve_link(
    url: str | ServerList,
    token: str,
    handlers: AgentHandlers,
    *,
    stop: trio.Event | None = None,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep a link to a control plane until cancelled or ``stop``.

    Args:
        url: ``ws://host:port/agent`` (``wss://`` across machines), or the
            :class:`ServerList` to try in turn.
        token: the agent token, sent as ``Authorization: Bearer`` ("" with
            mutual TLS).
        handlers: the agent's side (see :class:`AgentHandlers`).
        ssl_context: for ``wss://``: the node's certificate and the cluster CA.
        stop: once set, the link closes with ``GOING_AWAY`` ("agent
            stopping", bounded by :data:`~llmgw.agent.session.CLOSE_TIMEOUT_S`)
            and this returns.

    Returns:
        Once ``stop`` is set and the link is closed; never otherwise unless
        cancelled. ``task_status.started()`` is called at once: the link
        retries on its own and never fails its caller.
    """
    task_status.started()
    servers = url if isinstance(url, ServerList) else ServerList([url])
    if stop is None:
        stop = trio.Event()  # never set
    backoff_s = BACKOFF_FIRST_S
    # The control plane said it was stopping: until it is back, failing to
    # reach it is expected, not a warning.
    peer_stopped = False
    while not stop.is_set():
        url = servers.current
        heard = False
        connected = False

        def mark_heard() -> None:
            nonlocal heard
            heard = True

        cause: BaseException | None = None
        try:
            async with session.connect(
                url, token, handlers.register, ssl_context=ssl_context
            ) as link:
                connected = True
                peer_stopped = False
                await _Session(link, handlers, mark_heard, stop, servers).run()
        except* SESSION_ENDERS as group:
            cause = session.first_leaf(group)
        if heard:
            backoff_s = BACKOFF_FIRST_S
        if isinstance(cause, session.PeerIsStandby):
            # Only the leader takes agents: the next control plane at once,
            # and, once every one refused or failed, again after a short
            # wait (a standby about to lead), without growing the back-off.
            wrapped = servers.advance()
            log.info("%s (at %s); trying %s", _describe(cause), url, servers.current)
            if not wrapped:
                continue
            async with trio.open_nursery() as waiting:
                waiting.start_soon(_cancel_on, stop, waiting.cancel_scope)
                with trio.move_on_after(STANDBY_RETRY_S):
                    async for _ in handlers.status_events:
                        pass
                waiting.cancel_scope.cancel()
            continue
        if cause is not None and not connected and not servers.advance():
            # The next control plane at once; the back-off once each failed.
            log.log(
                logging.INFO if peer_stopped else logging.WARNING,
                "cannot reach the control plane at %s (%s); trying %s",
                url,
                _describe(cause),
                servers.current,
            )
            continue
        delay_s = backoff_s * random.uniform(0.5, 1.0)
        backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
        if isinstance(cause, session.CertificateRefused):
            # Revoked (the node was removed), or unknown to the cluster: the
            # engines would hold their ports and memory for nothing.
            delay_s = BACKOFF_MAX_S
            stopped = await handlers.stop_engines() if handlers.stop_engines else 0
            log.error(
                "%s (at %s); %sthis node is not in the cluster: join it again with a new "
                "code ('llmgw node add' on the control plane); trying again in %.0f s",
                _describe(cause),
                url,
                f"stopped its {stopped} engine(s); " if stopped else "",
                delay_s,
            )
        elif isinstance(cause, session.PeerRefused):
            log.error("%s (at %s); trying again in %.1f s", _describe(cause), url, delay_s)
        elif isinstance(cause, session.PeerStopping):
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
        servers: ServerList,
    ) -> None:
        self._link = link
        self._h = handlers
        self._mark_heard = mark_heard
        self._stop = stop
        self._servers = servers

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
            case ControlPlanes():
                try:
                    self._servers.learn(message.urls)
                except OSError as exc:
                    log.warning("cannot keep the control planes' list: %s", exc)
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
            case WeightsRequest():
                if self._h.weights is None:
                    await self._link.answer(
                        errors.AgentError("this agent keeps no fetched weights"),
                        message.correlation_id,
                    )
                    return
                await self._link.send(await self._h.weights(message))
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

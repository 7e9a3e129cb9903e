"""A standby's ``/v1``: every request forwarded to the leader as it is
(``docs/ha.md``).

A standby's router knows no replicas (only the leader's agents are linked
to it), so it passes ``/v1/*`` on to the leader's client API, found by
``leader_api()`` (the leader's record in the store). The request body is
read whole (it is bounded) and sent on; the answer is relayed piece by
piece as it arrives, so a stream stays a stream. Keys, limits, budgets and
usage are the leader's business: the standby checks nothing.

- No leader known, or the leader unreachable before it answered: the
  request is held (up to :data:`HOLD_S`) while the standby looks again
  every :data:`HOLD_POLL_S`; if this control plane comes to lead meanwhile
  it answers the request itself; else 503 ``no_leader`` with
  ``Retry-After: 1`` (nothing was done; a client may send it again, here or
  elsewhere).
- A request that was already forwarded once (``x-llmgw-forwarded``) is not
  forwarded again: two standbys that each think the other leads answer 503
  instead of passing it round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

import trio

from llmgw.asgi import Receive, Scope, Send

from .errors import ApiError, error_body_on
from .http import answer, header
from .parse import MAX_BODY_BYTES, read_body
from .upstream import UpstreamError, UpstreamPool, UpstreamResponse

__all__ = ["FORWARDED_HEADER", "LeaderForward"]

log = logging.getLogger("llmgw.gateway")

#: Marks a request a standby forwarded.
FORWARDED_HEADER: Final = b"x-llmgw-forwarded"
#: How long a request waits for a reachable leader, in seconds: a clean
#: handover takes about a second, a killed leader's lease up to its TTL (10 s).
HOLD_S: Final = 12.0
#: How often a held request looks for the leader again, in seconds.
HOLD_POLL_S: Final = 0.2
#: Dialing the leader must finish within this, in seconds.
CONNECT_TIMEOUT_S: Final = 3.0
#: Headers that belong to one hop, never passed on (either way).
_HOP: Final = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"host",
        b"content-length",
    }
)


class LeaderForward:
    """Forwards a request to the leader's client API (an ASGI callable for
    one HTTP request).

    Args:
        leader_api: the leader's ``host:port``, or ``None`` when none is known.
        is_leader: whether this control plane leads now (a request held
            while no leader could be reached is then answered here).
        max_body_bytes: the largest request body passed on.
        hold_s: how long a request waits for a leader to be reachable before
            503 ``no_leader`` (a handover's gap, without the client retrying).
    """

    def __init__(
        self,
        leader_api: Callable[[], str | None],
        *,
        is_leader: Callable[[], bool] = lambda: False,
        max_body_bytes: int = MAX_BODY_BYTES,
        hold_s: float = HOLD_S,
    ) -> None:
        self._leader_api = leader_api
        self._is_leader = is_leader
        self._hold_s = hold_s
        self._max_body_bytes = max_body_bytes
        self._pools: dict[str, UpstreamPool] = {}

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            await pool.aclose()

    def _pool(self, address: str) -> UpstreamPool:
        pool = self._pools.get(address)
        if pool is None:
            host, _, port = address.rpartition(":")
            pool = UpstreamPool(
                host.strip("[]"), int(port), max_idle=64, connect_timeout_s=CONNECT_TIMEOUT_S
            )
            # One leader at a time: the old leader's connections go.
            for old in list(self._pools):
                if old != address:
                    self._pools.pop(old)
            self._pools[address] = pool
        return pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Forward one request, holding it while no leader can be reached
        (up to ``hold_s``).

        Returns:
            ``None`` once answered; a ``Receive`` for the request when this
            control plane came to lead while it was held: the caller
            answers it itself, reading its body from that.
        """
        path: str = scope["path"]
        if header(scope, FORWARDED_HEADER) is not None:
            await _no_leader(send, path, "this control plane is a standby and knows no leader yet")
            return None
        body: bytes | None = None
        deadline = trio.current_time() + self._hold_s
        why = "this control plane is a standby and knows no leader yet"
        while True:
            if self._is_leader():
                return receive if body is None else _replay(body)
            address = self._leader_api()
            if address is not None:
                if body is None:
                    try:
                        body = await read_body(scope, receive, self._max_body_bytes)
                    except ApiError as exc:
                        await answer(send, exc.status, exc.body(), exc.headers)
                        return None
                response = await self._send_on(scope, address, body)
                if response is not None:
                    break
                why = f"the leader at {address} cannot be reached"
            if trio.current_time() >= deadline:
                await _no_leader(send, path, why)
                return None
            await trio.sleep(HOLD_POLL_S)
        async with response:
            out = [(k, v) for k, v in response.headers if k.lower() not in _HOP]
            length = response.header(b"content-length")
            if length is not None:
                out.append((b"content-length", length))
            await send({"type": "http.response.start", "status": response.status, "headers": out})
            while True:
                try:
                    chunk = await response.receive()
                except UpstreamError as exc:
                    # The leader went away mid-answer: the answer is left
                    # unfinished, so the client sees the connection end as
                    # it would have from the leader.
                    log.warning("the leader's answer to %s broke off: %s", path, exc)
                    return None
                if not chunk:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return None

    async def _send_on(self, scope: Scope, address: str, body: bytes) -> UpstreamResponse | None:
        """The leader's answer's head, or ``None`` when it could not be
        reached (nothing of its answer came)."""
        path: str = scope["path"]
        target = scope.get("raw_path") or path.encode()
        if scope.get("query_string"):
            target = bytes(target) + b"?" + bytes(scope["query_string"])
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        headers.append((FORWARDED_HEADER, b"1"))
        try:
            return await self._pool(address).request(
                scope["method"].encode(), bytes(target), headers, body
            )
        except UpstreamError as exc:
            log.warning("cannot forward %s to the leader at %s: %s", path, address, exc)
            return None


def _replay(body: bytes) -> Receive:
    """A ``Receive`` giving ``body`` (already read) once, then a disconnect."""
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    return receive


async def _no_leader(send: Send, path: str, message: str) -> None:
    error = ApiError(
        503,
        f"{message}; try again",
        type="server_error",
        code="no_leader",
        headers=[(b"retry-after", b"1")],
    )
    await answer(send, 503, error_body_on(path, error), error.headers)

"""When the sim engine's answers go out: the first token ``--ttft-ms`` after
the request (or after it got a slot), then ``--tokens-per-second`` per
stream however many streams run, and at most ``--slots`` requests
generating at once.

Streams wake at most every ``--tick-ms`` and send every step due since the
last wake in one write, so hundreds of streams fit on one core.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from llmgw.asgi import Send
from llmgw.engines.sim.config import SimConfig

__all__ = ["Pacer"]


class Pacer:
    """The clock and the slots of one sim engine (``config``'s
    ``tokens_per_second``, ``ttft_ms``, ``tick_ms`` and ``slots``).

    Attributes:
        running: requests generating now (holding a slot).
        waiting: requests waiting for a slot.
    """

    def __init__(self, config: SimConfig) -> None:
        self._rate = config.tokens_per_second
        self._ttft = config.ttft_ms / 1000.0
        self._tick = config.tick_ms / 1000.0
        self._slots = trio.Semaphore(config.slots) if config.slots else None
        self.running = 0
        self.waiting = 0

    @asynccontextmanager
    async def slot(self, started: float) -> AsyncIterator[float]:
        """Hold a slot (waiting for one when all are taken) while the block
        runs; yields when the request's clock starts: ``started`` (trio time,
        s), or the moment it got its slot if it had to wait for one."""
        if self._slots is not None:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            # A request that waited for a slot starts its clock now.
            started = trio.current_time()
        self.running += 1
        try:
            yield started
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()

    def _first_token_at(self, started: float) -> float:
        return started + self._ttft

    async def until_done(self, started: float, steps: int) -> None:
        """Sleep until a whole (not streamed) answer of ``steps`` steps
        begun at ``started`` is done: its first step after ``ttft_ms``, the
        others at ``tokens_per_second``."""
        done_at = self._first_token_at(started)
        if self._rate and steps > 1:
            done_at += (steps - 1) / self._rate
        await trio.sleep_until(done_at)

    async def stream(
        self,
        send: Send,
        started: float,
        steps: int,
        render: Callable[[int, int], list[bytes]],
        closing: list[bytes],
        *,
        sent: Callable[[int], None],
        finishing: Callable[[], None],
    ) -> None:
        """Answer 200 ``text/event-stream``, then stream ``steps`` steps (the
        bytes of steps [a, b) from ``render(a, b)``) at ``tokens_per_second``
        from ``ttft_ms`` after ``started``, every step due in one write, and
        ``closing`` in the last write.

        ``sent(k)`` is told each time ``k`` more steps are rendered;
        ``finishing()`` is called just before the last write.
        """
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                ],
            }
        )
        rate = self._rate
        tick = self._tick
        first_at = self._first_token_at(started)
        await trio.sleep_until(first_at)
        done = 0
        while True:
            now = trio.current_time()
            due = steps if not rate else min(steps, 1 + int((now - first_at) * rate + 1e-9))
            parts = render(done, due)
            sent(due - done)
            done = due
            if done == steps:
                parts += closing
                finishing()
                await send({"type": "http.response.body", "body": b"".join(parts)})
                return
            if parts:
                await send(
                    {"type": "http.response.body", "body": b"".join(parts), "more_body": True}
                )
            # Step `done` is due at first_at + done / rate; wake no sooner than a tick.
            await trio.sleep_until(max(first_at + done / rate, now + tick))

"""Admission control: priority bands per model (``docs/api.md``,
Admission bands).

Each key belongs to a **band** (``KeyRecord.band``; "" = the default band).
A band is the setting's :class:`~llmgw.settings.BandSettings`
(``router.admission.bands``): a priority and a **saturation** threshold,
the share of the model's slots it may fill. Our defaults
(:data:`llmgw.settings.DEFAULT_BANDS`):

=============  ========  ==========  =========
band           priority  saturation  queue_ttl
=============  ========  ==========  =========
interactive    100       1.0         30 s
bulk           10        0.5         5 min
=============  ========  ==========  =========

so bulk traffic never holds more than half of a model's slots and
interactive traffic always finds room ahead of it.

The rule, per model, with ``capacity`` its total slots across Ready
replicas and ``in_use`` the requests admitted and not yet released (all
bands together):

- a request is admitted at once when ``in_use < capacity * saturation`` of
  its band and no waiting request of higher or equal priority could take
  that slot (FIFO within a band; a waiter whose own lower threshold bars
  it does not hold back a request whose band may go);
- otherwise it waits in its band's FIFO queue. Whenever ``in_use`` drops
  or the capacity or the bands change, the best waiter — highest priority,
  then earliest arrival — whose band's threshold allows it is admitted,
  repeatedly while one is;
- a request that waited its band's ``queue_ttl`` gets
  :class:`AdmissionTimeout` (the gateway answers 504 with ``Retry-After``).

``capacity`` 0 means unknown or unbounded: admitted at once. Outside
models pass 0 — the spec forbids squeezing them to a few concurrent
requests. The capacity is whatever the latest :meth:`Admission.admit`
caller passed, or :meth:`Admission.set_capacity`; replicas come and go,
and the newest figure is the truest. A capacity that shrinks below
``in_use`` admits nothing until enough slots are released.

Costs: a band's queue is a deque (cancelled waiters are dropped lazily
when they reach its head), so admitting, releasing and queueing are O(1)
amortized per request plus O(bands) to find the best queue head; bands are
a handful. Runs on the trio thread; nothing here locks.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from itertools import count
from typing import Final

import trio

from llmgw import errors
from llmgw.settings import DEFAULT_BANDS, BandSettings

__all__ = [
    "DEFAULT_BAND_NAME",
    "Admission",
    "AdmissionTimeout",
    "Ticket",
]

log = logging.getLogger("llmgw.router")

#: Bounds on the ``Retry-After`` given with :class:`AdmissionTimeout`, in seconds.
RETRY_AFTER_MIN_S: Final = 1.0
RETRY_AFTER_MAX_S: Final = 60.0

#: The band of keys whose band is "" (or names a band no longer defined).
DEFAULT_BAND_NAME: Final = "interactive"


class AdmissionTimeout(errors.Refused):
    """A request waited its band's ``queue_ttl`` for a slot: 504
    ``queue_timeout``; the message is for the client.

    Attributes:
        retry_after_s: whole seconds for ``Retry-After``: the band's
            ``queue_ttl`` bounded to 1 … 60 s.
        model, band: where it waited.
    """

    status = 504
    code = "queue_timeout"
    type = "server_error"

    def __init__(self, retry_after_s: float, *, model: str = "", band: str = "") -> None:
        super().__init__(f"'{model}' is busy and this request waited its band's limit; retry.")
        self.retry_after_s = max(1, round(retry_after_s))
        self.model = model
        self.band = band


class _Waiter:
    __slots__ = ("admitted", "band", "event", "gone", "seq")

    def __init__(self, band: BandSettings, seq: int) -> None:
        self.band = band
        self.seq = seq
        self.event = trio.Event()
        self.admitted = False
        #: Admitted, timed out or cancelled: no longer waiting in its queue.
        self.gone = False


class _Model:
    __slots__ = ("capacity", "in_use", "queues", "waiting")

    def __init__(self) -> None:
        self.capacity = 0
        self.in_use = 0
        self.waiting = 0
        #: BandSettings name → its waiters in arrival order.
        self.queues: dict[str, deque[_Waiter]] = {}


class Ticket:
    """One admitted request's slot. :meth:`release` it on every path (or use
    it as a context manager, or :meth:`Admission.slot`); releasing twice is
    harmless."""

    __slots__ = ("_admission", "_state", "model", "released")

    def __init__(self, admission: Admission, state: _Model, model: str) -> None:
        self._admission = admission
        self._state = state
        self.model = model
        self.released = False

    def release(self) -> None:
        """Give the slot back; the best waiter that fits is admitted."""
        if self.released:
            return
        self.released = True
        self._state.in_use -= 1
        self._admission._dispatch(self._state)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """Admission queues for every model (module docstring).

    Args:
        bands: the bands (``router.admission.bands``); their order does
            not matter.

    Raises:
        ValueError: as :meth:`set_bands`.
    """

    def __init__(self, bands: Sequence[BandSettings] = DEFAULT_BANDS) -> None:
        self._models: dict[str, _Model] = {}
        self._seq = count()
        self._bands: dict[str, BandSettings] = {}
        self._default = DEFAULT_BANDS[0]
        self._warned: set[str] = set()
        self.set_bands(bands)

    # --- settings ------------------------------------------------------------------

    def set_bands(self, bands: Sequence[BandSettings]) -> None:
        """Replace the bands. Requests already waiting keep their place; their
        threshold is their band's new one (or the old one, if the band is
        gone), and anyone the change lets in is admitted now.

        Raises:
            ValueError: no bands, two with one name, or a ``queue_ttl`` that
                is not a positive duration (the settings allow 0).
        """
        if not bands:
            raise ValueError("admission needs at least one band")
        for band in bands:
            if not band.queue_ttl > 0:
                raise ValueError(
                    f"band {band.name!r}: queue_ttl must be a positive duration, "
                    f"got {band.queue_ttl!r}"
                )
        by_name = {band.name: band for band in bands}
        if len(by_name) != len(bands):
            raise ValueError("two admission bands share a name")
        self._bands = by_name
        self._default = by_name.get(DEFAULT_BAND_NAME) or max(bands, key=lambda b: b.priority)
        self._warned.clear()
        for state in self._models.values():
            self._dispatch(state)

    def band(self, name: str) -> BandSettings:
        """The band called ``name``; "" and names not defined give the
        default band (``interactive``, or the highest priority if the
        settings define no such band). An unknown name is logged once."""
        band = self._bands.get(name)
        if band is not None:
            return band
        if name and name not in self._warned:
            self._warned.add(name)
            log.warning(
                "admission band %r is not defined; its keys get band %r",
                name,
                self._default.name,
            )
        return self._default

    def set_capacity(self, model: str, capacity: int) -> None:
        """The model's total slots across Ready replicas (0: unbounded).

        Raises:
            ValueError: a negative capacity.
        """
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        state = self._state(model)
        if state.capacity != capacity:
            state.capacity = capacity
            self._dispatch(state)

    # --- requests --------------------------------------------------------------------

    async def admit(self, model: str, band: str, capacity: int) -> Ticket:
        """Wait for a slot of ``model`` for a request of band ``band`` (a key's
        band name; "" = default), ``capacity`` being the model's total slots
        now (0 = unbounded, admitted at once).

        Returns at once, without a checkpoint, when a slot is free; the
        caller must :meth:`Ticket.release` it on every path.

        Raises:
            AdmissionTimeout: no slot within the band's ``queue_ttl``.
            trio.Cancelled: cancelled while waiting (nothing is held then).
            ValueError: a negative capacity.
        """
        self.set_capacity(model, capacity)
        state = self._models[model]
        chosen = self.band(band)
        # After every dispatch no waiter fits, so none of higher or equal
        # priority could take this slot instead (FIFO within a band holds:
        # a band's waiters and newcomers share one threshold).
        if self._fits(state, chosen):
            state.in_use += 1
            return Ticket(self, state, model)
        waiter = _Waiter(chosen, next(self._seq))
        queue = state.queues.get(chosen.name)
        if queue is None:
            queue = state.queues[chosen.name] = deque()
        queue.append(waiter)
        state.waiting += 1
        try:
            with trio.move_on_after(chosen.queue_ttl):
                await waiter.event.wait()
        except BaseException:
            if waiter.admitted:
                Ticket(self, state, model).release()
            else:
                self._leave(state, waiter)
            raise
        if waiter.admitted:
            return Ticket(self, state, model)
        self._leave(state, waiter)
        retry_after_s = min(max(chosen.queue_ttl, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
        raise AdmissionTimeout(retry_after_s, model=model, band=chosen.name)

    @asynccontextmanager
    async def slot(self, model: str, band: str, capacity: int) -> AsyncIterator[Ticket]:
        """:meth:`admit` as ``async with``: the slot is released when the
        block ends, however it ends. Raises as :meth:`admit`."""
        ticket = await self.admit(model, band, capacity)
        try:
            yield ticket
        finally:
            ticket.release()

    # --- metrics ---------------------------------------------------------------------

    def waiting(self, model: str) -> int:
        """Requests of ``model`` waiting for a slot now."""
        state = self._models.get(model)
        return 0 if state is None else state.waiting

    def in_use(self, model: str) -> int:
        """Requests of ``model`` admitted and not yet released."""
        state = self._models.get(model)
        return 0 if state is None else state.in_use

    # --- internals -------------------------------------------------------------------

    def _state(self, model: str) -> _Model:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _Model()
        return state

    @staticmethod
    def _fits(state: _Model, band: BandSettings) -> bool:
        return state.capacity == 0 or state.in_use < state.capacity * band.saturation

    def _leave(self, state: _Model, waiter: _Waiter) -> None:
        """A waiter gives up (timeout, cancellation): no longer counted; it
        stays in its deque until it reaches the head (dropped lazily)."""
        if not waiter.gone:
            waiter.gone = True
            state.waiting -= 1
            if not state.waiting:
                for queue in state.queues.values():
                    queue.clear()

    def _dispatch(self, state: _Model) -> None:
        """Admit the best fitting waiter (priority, then arrival) while one fits."""
        while state.waiting:
            best: _Waiter | None = None
            best_band: BandSettings | None = None
            for name, queue in state.queues.items():
                while queue and queue[0].gone:
                    queue.popleft()
                if not queue:
                    continue
                head = queue[0]
                band = self._bands.get(name, head.band)
                if not self._fits(state, band):
                    continue
                if (
                    best is None
                    or best_band is None
                    or band.priority > best_band.priority
                    or (band.priority == best_band.priority and head.seq < best.seq)
                ):
                    best, best_band = head, band
            if best is None:
                return
            state.queues[best.band.name].popleft()
            best.gone = True
            best.admitted = True
            state.waiting -= 1
            state.in_use += 1
            best.event.set()

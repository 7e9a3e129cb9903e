"""Routing one request: which model and endpoint answer it, and what to do
when an endpoint fails (``docs/api.md``, Which replica answers).

The gateway hands the router a resolved request — the catalog model, the
key's band, the routing profile, the body and headers (for the session
key) — and gets a :class:`Route`. The route

1. admits the request by band (:meth:`Route.admit`, :mod:`llmgw.router.admission`),
   the model's capacity being its ready replicas' slots;
2. hands out attempts (:meth:`Route.next`): the model asked, or else one
   of its fallbacks the key may use, and one of its endpoints chosen by
   the profile (:func:`llmgw.router.scoring.choose`); it waits for a model
   that is loading (at most ``on_demand.load_wait``) and for an endpoint
   cooling down (at most :data:`MAX_RECOVERY_WAIT_S`);
3. takes back each attempt's outcome — no answer (:meth:`Route.unreachable`),
   an answer's status before any byte went to the client
   (:meth:`Route.turned_away`), or the answer relayed with its time to
   first token (:meth:`Route.answered`) — keeping the breakers and the
   TTFT figures, and says whether to try again: up to :data:`MAX_ATTEMPTS`
   endpoints per request, only while nothing reached the client and another
   endpoint could take it.

The router reads the cluster through :class:`ClusterView` only (the control
plane's ``Cluster`` is one), so it runs without HTTP and without the
control plane. Everything runs on the trio thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Protocol

import attrs
import trio

from llmgw import errors
from llmgw.agent.protocol import ShardState
from llmgw.settings import ServerSettings
from llmgw.store import ModelRecord

from . import scoring
from .admission import Admission, Ticket
from .breaker import counts_as_failure, earliest_recovery, parse_retry_after_s
from .endpoint import Endpoint, EndpointLost
from .external import ProviderKeys

__all__ = [
    "MAX_ATTEMPTS",
    "MAX_RECOVERY_WAIT_S",
    "RETRY_AFTER_S",
    "Attempt",
    "ClusterView",
    "EndpointLost",
    "NotReady",
    "Route",
    "Router",
    "ShardView",
]

log = logging.getLogger("llmgw.router")

#: Endpoints one request may be tried on (the first and the retries), when
#: each fails before any byte reached the client.
MAX_ATTEMPTS: Final = 3
#: Longest wait for a cooling-down endpoint to recover, in seconds.
MAX_RECOVERY_WAIT_S: Final = 30.0
#: Seconds a client is told to wait when no replica is ready.
RETRY_AFTER_S: Final = 5


class ShardView(Protocol):
    """What the router reads of a shard: whether its model is loading."""

    @property
    def model(self) -> str: ...
    @property
    def wanted(self) -> bool: ...
    @property
    def state(self) -> ShardState: ...


class ClusterView(Protocol):
    """What the router reads of the cluster (the control plane's ``Cluster``
    is one).

    Attributes:
        models: the catalog by model name, replaced whole on every change
            (never changed in place: the alias map is cached by its identity).
        shards: every shard by id (a model with one starting is loading).
        settings: the live settings (``router.*``, ``on_demand.load_wait``).
    """

    @property
    def models(self) -> Mapping[str, ModelRecord]: ...
    @property
    def shards(self) -> Mapping[str, ShardView]: ...
    @property
    def settings(self) -> ServerSettings: ...

    def ready_endpoints(self, model: str) -> Sequence[Endpoint]:
        """The model's READY, not retiring replicas."""
        ...

    def touch(self, model: str, *, at: float | None = None) -> None:
        """Record a use of ``model`` now (idle on-demand replicas are evicted)."""
        ...

    async def wait_ready(self, model: str) -> None:
        """Demand ``model`` and wait until it has a READY endpoint; the
        caller bounds the wait. Raises ``LookupError`` when it is not in the
        catalog."""
        ...

    def settling_s(self) -> float:
        """Seconds left in which a new leader's nodes are still linking to
        it (0 when settled): a model with no ready replica counts as loading
        meanwhile."""
        ...


class NotReady(errors.Refused):
    """No endpoint of the model (or of its fallbacks) can take the request:
    503 ``model_not_ready``, ``Retry-After`` :data:`RETRY_AFTER_S`."""

    status = 503
    code = "model_not_ready"
    type = "server_error"
    retry_after_s = RETRY_AFTER_S

    def __init__(self, model: str) -> None:
        super().__init__(f"No replica of '{model}' is ready yet; retry shortly.")
        self.model = model


@attrs.frozen
class Attempt:
    """One try of a request on one endpoint.

    Use it as a context manager around the exchange with the endpoint: the
    endpoint counts it in flight meanwhile (its queue depth for scoring).

    Attributes:
        model: the model sent to: the one asked, or a fallback.
        endpoint: where it goes.
        number: 0 for the first try, then 1, 2 (< :data:`MAX_ATTEMPTS`).
    """

    model: ModelRecord
    endpoint: Endpoint
    number: int

    @property
    def upstream_model(self) -> str:
        """The model name the endpoint knows: an outside provider's own
        name, else the catalog name."""
        external = self.model.external
        return external.model if external is not None else self.model.name

    def __enter__(self) -> Attempt:
        self.endpoint.in_flight += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.endpoint.in_flight -= 1
        if exc[0] is not None:
            # Ended by an exception with no outcome reported (the client
            # left: 499; the gateway stopping): a half-open probe gives way
            # to the next request, and nothing counts against the endpoint.
            self.endpoint.breaker.abandon()

    def waiting_first_byte(self) -> _WaitingFirstByte:
        """Around the wait for the endpoint's first byte: when the endpoint
        leaves routing meanwhile (:meth:`Endpoint.lose`, or it had already
        left), the wait is cancelled and :class:`EndpointLost` raised, for
        :meth:`Route.unreachable` to retry elsewhere.

        Raises:
            EndpointLost: the endpoint left routing before its first byte.
        """
        return _WaitingFirstByte(self.endpoint)


class _WaitingFirstByte:
    """:meth:`Attempt.waiting_first_byte`'s context manager (a class: a
    generator-based one cost more than the cancel scope it holds, per request)."""

    __slots__ = ("_endpoint", "_scope")

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._scope = trio.CancelScope()

    def __enter__(self) -> None:
        scope, endpoint = self._scope, self._endpoint
        scope.__enter__()
        if endpoint.lost:
            scope.cancel()
        endpoint.waiting.add(scope)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        scope, endpoint = self._scope, self._endpoint
        endpoint.waiting.discard(scope)
        # The scope swallows only its own cancellation (its __exit__ is true
        # then, and also when nothing was raised): that is the loss.
        scope.__exit__(exc_type, exc, traceback)
        if scope.cancelled_caught:
            raise EndpointLost(endpoint.label) from None


class Router:
    """Routes requests over the endpoints of ``cluster``.

    Args:
        cluster: the catalog, the ready endpoints, the live settings.
        clock: monotonic seconds, for the breakers and the key files
            (tests pass ``trio.current_time``).

    Raises:
        ValueError: the live admission bands are not usable (a ``queue_ttl``
            of 0).
    """

    def __init__(
        self, cluster: ClusterView, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._cluster = cluster
        self.clock = clock
        self._names: dict[str, ModelRecord] = {}
        self._names_of: object = None
        #: Outside models' keys, with the (url, key files) they were made from.
        self._providers: dict[str, tuple[object, ProviderKeys]] = {}
        self.admission = Admission(cluster.settings.router.admission.bands)

    def settings_changed(self, settings: ServerSettings) -> None:
        """Take the admission bands of ``settings`` (requests waiting keep
        their place). Bands admission cannot use are logged and the last
        ones kept."""
        try:
            self.admission.set_bands(settings.router.admission.bands)
        except ValueError as exc:
            log.error("admission bands not applied, keeping the last ones: %s", exc)

    # --- the model namespace ---------------------------------------------------------

    def resolve(self, name: str) -> ModelRecord | None:
        """The catalog model called ``name`` or having it as an alias (a
        model's own name wins over another's alias)."""
        models = self._cluster.models
        if models is not self._names_of:
            names: dict[str, ModelRecord] = {}
            for model in models.values():
                for alias in model.aliases:
                    names.setdefault(alias, model)
            names.update(models)
            self._names, self._names_of = names, models
        return self._names.get(name)

    # --- routes ----------------------------------------------------------------------

    def route(
        self,
        model: ModelRecord,
        *,
        profile: str,
        band: str,
        doc: dict[str, Any],
        headers: Iterable[tuple[bytes, bytes]],
        permits: Callable[[str], bool] | None = None,
    ) -> Route:
        """The route of one request for ``model``; a use of an on-demand
        model is recorded (:meth:`ClusterView.touch`).

        Args:
            profile: one of :data:`llmgw.router.scoring.PROFILES`.
            band: the key's admission band ("" = ``router.admission.default_band``).
            doc: the request body as the engines get it (chat for translated
                kinds), read for the ``chat`` session key.
            headers: the request headers, ASGI style (read for the session key).
            permits: whether the key may send to a model (by name), asked of
                fallbacks; ``None``: any.
        """
        if model.on_demand:
            self._cluster.touch(model.name)
        session = scoring.session_key(doc, headers) if profile == "chat" else None
        return Route(
            self,
            model,
            profile=profile,
            session=session,
            band=band or self._cluster.settings.router.admission.default_band,
            permits=permits,
        )

    # --- for routes --------------------------------------------------------------------

    def endpoints(self, model: ModelRecord) -> Sequence[Endpoint]:
        """The model's endpoints now: its ready replicas, or its outside keys
        that can be read."""
        external = model.external
        if external is None:
            return self._cluster.ready_endpoints(model.name)
        source = (external.url, tuple((k.file, k.weight) for k in external.api_key_files))
        found = self._providers.get(model.name)
        if found is None or found[0] != source:
            found = self._providers[model.name] = (
                source,
                ProviderKeys(model.name, external.url, list(source[1])),
            )
        return found[1].refresh(self.clock())

    def candidates(
        self, model: ModelRecord, permits: Callable[[str], bool] | None
    ) -> Iterator[ModelRecord]:
        """``model``, then its fallbacks the key may use, each looked up only
        when the ones before could not take the request."""
        yield model
        for name in model.fallbacks:
            fallback = self.resolve(name)
            if fallback is None or fallback.stopped or fallback.name == model.name:
                continue
            if permits is not None and not permits(fallback.name):
                continue  # prompts go only where the key may send them
            yield fallback

    def loading(self, model: ModelRecord) -> bool:
        """The model has replicas starting, or loads on demand, or this
        control plane has just come to lead and its nodes are still linking
        (:meth:`ClusterView.settling_s`)."""
        return self._starting(model) or self._cluster.settling_s() > 0

    def _starting(self, model: ModelRecord) -> bool:
        if model.on_demand:
            return True
        return any(
            s.model == model.name and s.wanted and s.state is ShardState.STARTING
            for s in self._cluster.shards.values()
        )

    async def wait_loaded(self, model: ModelRecord) -> None:
        """Wait, at most ``on_demand.load_wait``, for the model to have a
        ready replica (an on-demand model is loaded by this wait); only for
        the rest of the settling window when that is all that makes it
        loading."""
        wait_s = self._cluster.settings.on_demand.load_wait
        if not self._starting(model):
            wait_s = min(wait_s, self._cluster.settling_s())
        with trio.move_on_after(wait_s):
            try:
                await self._cluster.wait_ready(model.name)
            except LookupError:
                return  # removed from the catalog meanwhile


class Route:
    """One request's way through the router (module docstring).

    Attributes:
        model: the model asked for.
        profile: the routing profile.
        session: the ``chat`` session key, or ``None``.
        band: the admission band asked for.
        waited_s: seconds spent waiting for a slot or for the model to load.
    """

    __slots__ = (
        "_permits",
        "_router",
        "_tried",
        "band",
        "model",
        "profile",
        "session",
        "waited_s",
    )

    def __init__(
        self,
        router: Router,
        model: ModelRecord,
        *,
        profile: str,
        session: str | None,
        band: str,
        permits: Callable[[str], bool] | None,
    ) -> None:
        self._router = router
        self.model = model
        self.profile = profile
        self.session = session
        self.band = band
        self._permits = permits
        #: Replica ids tried and failed; ``()`` until the first failure.
        self._tried: Container[str] = ()
        self.waited_s = 0.0

    async def admit(self) -> Ticket:
        """Wait for a slot of the model in the request's band; release the
        ticket (a context manager) when the request is done.

        Raises:
            AdmissionTimeout: the band's ``queue_ttl`` passed.
        """
        model = self.model
        capacity = (
            0 if model.external is not None else _capacity(self._router.endpoints(model), model)
        )
        queued_at = time.perf_counter()
        ticket = await self._router.admission.admit(model.name, self.band, capacity)
        self.waited_s += time.perf_counter() - queued_at
        return ticket

    async def next(self) -> Attempt:
        """The next attempt: the model asked or a fallback, and an endpoint
        not tried yet. Waits for a loading model (once, before the first
        attempt) and for an endpoint cooling down.

        Raises:
            NotReady: nothing can take the request.
        """
        router, model, tried = self._router, self.model, self._tried
        number = len(tried) if isinstance(tried, set) else 0
        waited_for_load = False
        while True:
            for target in router.candidates(model, self._permits):
                chosen = scoring.choose(
                    router.endpoints(target),
                    self.profile,
                    session=self.session,
                    exclude=tried,
                    now=router.clock(),
                )
                if chosen is not None:
                    return Attempt(target, chosen, number)
            if not waited_for_load and not number and router.loading(model):
                waited_for_load = True
                started = time.perf_counter()
                await router.wait_loaded(model)
                self.waited_s += time.perf_counter() - started
                continue
            recovery = earliest_recovery(
                e for e in router.endpoints(model) if e.replica_id not in tried
            )
            if recovery is not None:
                delay_s = recovery - router.clock()
                if 0 < delay_s <= MAX_RECOVERY_WAIT_S:
                    await trio.sleep(delay_s)
                    continue
            raise NotReady(model.name)

    def unreachable(self, attempt: Attempt, exc: BaseException) -> bool:
        """The endpoint did not answer (``exc``: a connect error, a broken
        exchange, the first-byte deadline, :class:`EndpointLost`). Counted
        against its breaker unless it left routing meanwhile.

        Returns:
            Whether to try another endpoint (:meth:`next`); if not, the
            request fails.
        """
        endpoint = attempt.endpoint
        if endpoint.lost:
            # It left routing (not answering its health check, failed):
            # its breaker goes with it.
            log.warning(
                "endpoint %s did not answer and left routing (not counted): %s",
                endpoint.label,
                errors.describe(exc),
            )
        else:
            endpoint.breaker.failure(self._router.clock())
            log.warning("endpoint %s did not answer: %s", endpoint.label, errors.describe(exc))
        return self._retry(attempt)

    def turned_away(self, attempt: Attempt, status: int, retry_after: bytes | None) -> bool:
        """The endpoint answered ``status`` (not 200), nothing sent to the
        client yet. An answer worth another endpoint (502, 503, 504 and
        other 5xx but 500 and 501; an outside key's 401, 403, 429) is tried
        elsewhere when another endpoint could take it; the endpoint's
        breaker then counts it (with its ``Retry-After``, the header's raw
        value; a refused outside key sits out as one at its limit).

        Returns:
            Whether to try another endpoint; if not, relay this answer and
            report it with :meth:`answered`.
        """
        endpoint = attempt.endpoint
        if not _retryable(endpoint, status) or not self._retry(attempt):
            return False
        if endpoint.external and status in (401, 403):
            endpoint.breaker.failure(self._router.clock(), status=429)
            log.error("external_key_refused: %s answered %d", endpoint.label, status)
        else:
            endpoint.breaker.failure(
                self._router.clock(),
                status=status,
                retry_after_s=parse_retry_after_s(retry_after, time.time()),
            )
            log.warning("endpoint %s answered %d; trying another", endpoint.label, status)
        return True

    def answered(self, attempt: Attempt, status: int, ttft_s: float | None) -> None:
        """The endpoint's answer went to the client: ``status`` as the
        endpoint gave it, ``ttft_s`` its time to first token (or of the
        whole answer's head, for one not streamed), ``None`` when not known.
        Keeps the endpoint's TTFT figure and its breaker: closed by an
        answer under 500 but 429, counted against by 429 and the 5xx that
        say the endpoint cannot serve."""
        endpoint = attempt.endpoint
        if ttft_s is not None:
            endpoint.observe_ttft(ttft_s)
        if endpoint.external and status in (401, 403):
            # Its only key left was refused: the 401 goes back to the client,
            # and the key stays in service (the answer closes the breaker).
            log.error("external_key_refused: %s answered %d", endpoint.label, status)
        if status < 500 and status != 429:
            endpoint.breaker.success()
        elif counts_as_failure(status):
            endpoint.breaker.failure(self._router.clock(), status=status)

    def _retry(self, attempt: Attempt) -> bool:
        """Whether another attempt may follow ``attempt`` (which failed): the
        attempts are not used up and another endpoint is available; then
        ``attempt``'s endpoint is not tried again."""
        if attempt.number >= MAX_ATTEMPTS - 1:
            return False
        failed = attempt.endpoint.replica_id
        tried = self._tried
        router = self._router
        now = router.clock()
        for target in router.candidates(self.model, self._permits):
            for other in router.endpoints(target):
                if (
                    other.replica_id != failed
                    and other.replica_id not in tried
                    and other.breaker.available(now)
                ):
                    if isinstance(tried, set):
                        tried.add(failed)
                    else:
                        self._tried = {failed}
                    return True
        return False


def _capacity(endpoints: Sequence[Endpoint], model: ModelRecord) -> int:
    """The model's slots across its ready replicas (0 = not known: unbounded)."""
    if not endpoints:
        return 0
    profile = model.profile
    per_replica = profile.slots if profile is not None else 0
    total = 0
    for endpoint in endpoints:
        slots = endpoint.slots or per_replica
        if not slots:
            return 0
        total += slots
    return total


def _retryable(endpoint: Endpoint, status: int) -> bool:
    """An answer worth another endpoint: the engine is unreachable behind a
    proxy, overloaded or loading (502, 503, 504), or an outside key is at
    its limit or refused. A 500 or 501 is the engine answering this request
    badly; another replica of the model would answer it alike."""
    if status >= 500:
        return status not in (500, 501)
    return endpoint.external and status in (401, 403, 429)

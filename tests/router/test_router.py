"""The router alone: a fake cluster behind its ClusterView, no HTTP.

Waits run under trio's MockClock (autojump: they cost no real time).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from llmgw import errors
from llmgw.agent.protocol import ShardState
from llmgw.router.admission import AdmissionTimeout
from llmgw.router.breaker import OPEN_FOR_S, BreakerState
from llmgw.router.endpoint import Endpoint
from llmgw.router.router import (
    MAX_ATTEMPTS,
    ClusterView,
    EndpointLost,
    NotReady,
    Route,
    Router,
)
from llmgw.settings import (
    AdmissionSettings,
    BandSettings,
    OnDemandSettings,
    RouterSettings,
    ServerSettings,
)
from llmgw.store import External, ExternalKey, ModelRecord


@attrs.define
class FakeShard:
    model: str
    state: ShardState = ShardState.STARTING
    wanted: bool = True


class FakeCluster:
    """The router's view of a cluster, kept by hand."""

    def __init__(self, *models: ModelRecord) -> None:
        self.models: dict[str, ModelRecord] = {m.name: m for m in models}
        self.shards: dict[str, FakeShard] = {}
        self.settings = ServerSettings()
        self.endpoints: dict[str, list[Endpoint]] = {}
        self.touched: list[str] = []
        self.changed = trio.Event()
        self.settling = 0.0

    def ready_endpoints(self, model: str) -> list[Endpoint]:
        return self.endpoints.get(model, [])

    def touch(self, model: str, *, at: float | None = None) -> None:
        self.touched.append(model)

    async def wait_ready(self, model: str) -> None:
        if model not in self.models:
            raise LookupError(model)
        while not self.ready_endpoints(model):
            await self.changed.wait()

    def settling_s(self) -> float:
        return self.settling

    def add(self, model: str, *replica_ids: str, slots: int = 0) -> list[Endpoint]:
        """Ready endpoints for ``model``; the cluster's waiters are woken."""
        added = [
            Endpoint(
                replica_id=rid, model=model, host="127.0.0.1", port=1, api_key="k", slots=slots
            )
            for rid in replica_ids
        ]
        self.endpoints.setdefault(model, []).extend(added)
        self.changed.set()
        self.changed = trio.Event()
        return added


def model(name: str, **fields: Any) -> ModelRecord:
    return ModelRecord.simple(name, "sim", slots=fields.pop("slots", 4), **fields)


def state_of(endpoint: Endpoint) -> BreakerState:
    return endpoint.breaker.state


def route(
    router: Router,
    model: ModelRecord,
    *,
    profile: str = "batch",
    band: str = "",
    doc: dict[str, Any] | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    permits: Any = None,
) -> Route:
    return router.route(
        model,
        profile=profile,
        band=band,
        doc=doc or {"model": model.name, "messages": [{"role": "user", "content": "hi"}]},
        headers=headers or [],
        permits=permits,
    )


def test_the_fake_is_a_cluster_view() -> None:
    view: ClusterView = FakeCluster()
    assert view.settings == ServerSettings()


# --- retries -------------------------------------------------------------------------


async def test_an_attempt_that_fails_before_the_first_byte_is_tried_elsewhere_up_to_three_times() -> (
    None
):
    m = model("m")
    cluster = FakeCluster(m)
    a, b, c, d = cluster.add("m", "m-0", "m-1", "m-2", "m-3")
    router = Router(cluster)
    r = route(router, m)
    tried: list[Endpoint] = []
    first = await r.next()
    tried.append(first.endpoint)
    assert first.number == 0
    assert first.model is m
    assert r.unreachable(first, OSError("refused"))
    second = await r.next()
    tried.append(second.endpoint)
    assert second.number == 1
    assert r.turned_away(second, 503, b"2")
    third = await r.next()
    tried.append(third.endpoint)
    assert third.number == MAX_ATTEMPTS - 1
    assert len({e.replica_id for e in tried}) == 3  # never the same endpoint twice
    # The third failure is the last: the request fails, though one is left.
    assert not r.unreachable(third, OSError("refused"))
    assert [e.breaker.consecutive_failures for e in tried] == [1, 1, 1]
    assert {e.replica_id for e in (a, b, c, d)} - {e.replica_id for e in tried}


async def test_no_retry_without_another_endpoint_nor_for_an_answer_another_would_give_alike() -> (
    None
):
    m = model("m")
    cluster = FakeCluster(m)
    (only,) = cluster.add("m", "m-0")
    router = Router(cluster)
    r = route(router, m)
    attempt = await r.next()
    assert not r.unreachable(attempt, OSError("refused"))
    assert only.breaker.consecutive_failures == 1
    cluster.add("m", "m-1")
    r = route(router, m)
    attempt = await r.next()
    before = attempt.endpoint.breaker.consecutive_failures
    # 500 and 501 are this request's fault; a 4xx from a replica of ours too.
    for status in (500, 501, 400, 401, 429):
        assert not r.turned_away(attempt, status, None)
    assert attempt.endpoint.breaker.consecutive_failures == before


async def test_a_turned_away_answer_opens_the_breaker_for_its_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m")
    cluster = FakeCluster(m)
    cluster.add("m", "m-0", "m-1")
    router = Router(cluster, clock=trio.current_time)
    r = route(router, m)
    attempt = await r.next()
    assert r.turned_away(attempt, 503, b"120")
    breaker = attempt.endpoint.breaker
    assert breaker.consecutive_failures == 1
    assert breaker.state is BreakerState.CLOSED  # one 503 does not open it
    for _ in range(3):
        breaker.failure(trio.current_time())
    r = route(router, m)
    attempt = await r.next()
    while attempt.endpoint.breaker is not breaker:
        r = route(router, m)
        attempt = await r.next()
    assert r.turned_away(attempt, 502, b"120")  # the fifth: open for its Retry-After
    assert breaker.open_until == pytest.approx(trio.current_time() + 120)


async def test_an_answer_relayed_keeps_the_ttft_and_the_breaker() -> None:
    m = model("m")
    cluster = FakeCluster(m)
    (e,) = cluster.add("m", "m-0")
    router = Router(cluster)
    r = route(router, m)
    attempt = await r.next()
    with attempt:
        assert e.in_flight == 1
    assert e.in_flight == 0
    e.breaker.failure(0.0)
    r.answered(attempt, 200, 0.25)
    assert e.ttft_ewma_s == 0.25
    assert e.breaker.consecutive_failures == 0
    r.answered(attempt, 429, None)
    assert e.breaker.state is BreakerState.OPEN
    assert e.ttft_ewma_s == 0.25


# --- fallbacks -----------------------------------------------------------------------


async def test_a_model_without_room_falls_back_to_the_next_the_key_may_use() -> None:
    primary = model("primary", fallbacks=("stopped", "secret", "spare"))
    cluster = FakeCluster(primary, model("stopped", stopped=True), model("secret"), model("spare"))
    for name in ("stopped", "secret", "spare"):
        cluster.add(name, f"{name}-0")
    router = Router(cluster)
    asked: list[str] = []

    def permits(name: str) -> bool:
        asked.append(name)
        return name != "secret"

    r = route(router, primary, permits=permits)
    attempt = await r.next()
    assert (attempt.model.name, attempt.endpoint.replica_id) == ("spare", "spare-0")
    assert asked == ["secret", "spare"]  # a stopped model is not even asked about
    assert attempt.upstream_model == "spare"
    # Once the primary has a replica, it is its own again.
    cluster.add("primary", "primary-0")
    attempt = await route(router, primary, permits=permits).next()
    assert attempt.model is primary


async def test_nothing_to_send_to_is_not_ready_503_with_retry_after() -> None:
    primary = model("primary", fallbacks=("other",))
    cluster = FakeCluster(primary, model("other"))
    router = Router(cluster)
    with pytest.raises(NotReady) as caught:
        await route(router, primary).next()
    refused = caught.value
    assert isinstance(refused, errors.Refused)
    assert (refused.status, refused.code, refused.retry_after_s) == (503, "model_not_ready", 5)
    assert "primary" in str(refused)


async def test_a_retry_may_go_to_a_fallback() -> None:
    primary = model("primary", fallbacks=("spare",))
    cluster = FakeCluster(primary, model("spare"))
    cluster.add("primary", "primary-0")
    cluster.add("spare", "spare-0")
    router = Router(cluster)
    r = route(router, primary)
    attempt = await r.next()
    assert attempt.model is primary
    assert r.unreachable(attempt, OSError("gone"))
    attempt = await r.next()
    assert attempt.model.name == "spare"


async def test_an_outside_models_keys_are_its_endpoints_and_it_is_never_queued(
    tmp_path: Path,
) -> None:
    keys = []
    for n in (1, 2):
        path = tmp_path / f"key{n}"
        path.write_text(f"secret-{n}\n")
        keys.append(ExternalKey(file=str(path)))
    ext = ModelRecord(
        name="ext",
        external=External(
            url="https://api.example.com/v2/", model="their-model", api_key_files=tuple(keys)
        ),
    )
    cluster = FakeCluster(ext)
    router = Router(cluster)
    r = route(router, ext)
    with await r.admit():
        assert router.admission.in_use("ext") == 1
    attempt = await r.next()
    assert attempt.endpoint.replica_id in ("external:ext#1", "external:ext#2")
    assert attempt.endpoint.path_prefix == "/v2"
    assert attempt.endpoint.tls
    assert attempt.upstream_model == "their-model"
    # A refused key sits out as one at its limit while the other takes the retry.
    assert r.turned_away(attempt, 401, None)
    assert attempt.endpoint.breaker.state is BreakerState.OPEN
    other = await r.next()
    assert other.endpoint is not attempt.endpoint


async def test_an_outside_key_refused_with_no_other_left_goes_back_and_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key"
    path.write_text("secret\n")
    ext = ModelRecord(
        name="ext",
        external=External(
            url="http://127.0.0.1:9", model="m", api_key_files=(ExternalKey(file=str(path)),)
        ),
    )
    router = Router(FakeCluster(ext))
    r = route(router, ext)
    attempt = await r.next()
    with caplog.at_level(logging.ERROR, logger="llmgw.router"):
        assert not r.turned_away(attempt, 401, None)
        r.answered(attempt, 401, None)
    assert "external_key_refused: external:ext#1 answered 401" in caplog.text
    assert "secret" not in caplog.text


# --- breakers ---------------------------------------------------------------------------


async def test_an_open_breaker_is_waited_for_then_probed_once_and_closed_by_the_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m")
    cluster = FakeCluster(m)
    (e,) = cluster.add("m", "m-0")
    router = Router(cluster, clock=trio.current_time)
    e.breaker.failure(trio.current_time(), status=429, retry_after_s=7.0)
    assert state_of(e) is BreakerState.OPEN
    start = trio.current_time()
    r = route(router, m)
    attempt = await r.next()
    assert trio.current_time() - start == pytest.approx(7.0, abs=0.01)
    assert attempt.endpoint is e
    assert state_of(e) is BreakerState.HALF_OPEN  # this request is the probe
    other = route(router, m)
    with pytest.raises(NotReady):
        # The probe is out: a second request has nothing to wait for by time.
        await other.next()
    r.answered(attempt, 200, 0.1)
    assert state_of(e) is BreakerState.CLOSED


async def test_a_breaker_open_longer_than_the_recovery_wait_is_not_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m")
    cluster = FakeCluster(m)
    (e,) = cluster.add("m", "m-0")
    e.breaker.failure(trio.current_time(), status=429, retry_after_s=OPEN_FOR_S + 60)
    start = trio.current_time()
    with pytest.raises(NotReady):
        await route(Router(cluster, clock=trio.current_time), m).next()
    assert trio.current_time() == start


# --- loading -----------------------------------------------------------------------------


async def test_a_model_loading_is_waited_for_and_the_wait_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m", on_demand=True)
    cluster = FakeCluster(m)
    router = Router(cluster)
    r = route(router, m)
    assert cluster.touched == ["m"]  # a use of an on-demand model is recorded

    async def load() -> None:
        await trio.sleep(12)
        cluster.add("m", "m-0")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(load)
        attempt = await r.next()
    assert attempt.endpoint.replica_id == "m-0"
    assert r.waited_s > 0


async def test_the_load_wait_is_bounded_and_a_starting_replica_counts_as_loading(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m")
    cluster = FakeCluster(m)
    cluster.settings = ServerSettings(on_demand=OnDemandSettings(load_wait=20))
    cluster.shards["m-0"] = FakeShard("m")
    router = Router(cluster)
    start = trio.current_time()
    with pytest.raises(NotReady):
        await route(router, m).next()
    assert trio.current_time() - start == pytest.approx(20.0)
    cluster.shards["m-0"] = FakeShard("m", wanted=False)  # retiring: not loading
    start = trio.current_time()
    with pytest.raises(NotReady):
        await route(router, m).next()
    assert trio.current_time() == start


# --- session affinity -------------------------------------------------------------------


async def test_a_chat_session_sticks_to_one_endpoint_and_sessions_spread() -> None:
    m = model("m")
    cluster = FakeCluster(m)
    cluster.add("m", *(f"m-{i}" for i in range(4)))
    router = Router(cluster)

    async def endpoint_of(user: str) -> str:
        doc = {"model": "m", "user": user, "messages": [{"role": "user", "content": "hi"}]}
        r = route(router, m, profile="chat", doc=doc)
        assert r.session == f"u:{user}"
        return (await r.next()).endpoint.replica_id

    first = await endpoint_of("alice")
    assert {await endpoint_of("alice") for _ in range(20)} == {first}
    spread = Counter([await endpoint_of(f"user-{i}") for i in range(200)])
    assert len(spread) == 4
    # A header names the session as well; other profiles have none.
    r = route(router, m, profile="chat", headers=[(b"x-llmgw-session", b"s1")])
    assert r.session == "h:s1"
    assert route(router, m, profile="batch", doc={"model": "m", "user": "alice"}).session is None


# --- admission ------------------------------------------------------------------------


async def test_admission_by_band_queues_beyond_the_capacity_and_times_out_as_a_refusal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m", slots=1)
    cluster = FakeCluster(m)
    cluster.add("m", "m-0", "m-1")  # capacity 2 (the profile's slots)
    router = Router(cluster)
    first = await route(router, m).admit()
    second = await route(router, m, band="interactive").admit()
    assert router.admission.in_use("m") == 2
    start = trio.current_time()
    with pytest.raises(AdmissionTimeout) as caught:
        await route(router, m).admit()
    assert trio.current_time() - start == pytest.approx(30.0)  # interactive's queue_ttl
    refused = caught.value
    assert isinstance(refused, errors.Refused)
    assert (refused.status, refused.code, refused.type) == (504, "queue_timeout", "server_error")
    assert refused.retry_after_s == 30
    assert str(refused) == "'m' is busy and this request waited its band's limit; retry."
    # A slot freed admits the waiter; its wait is counted.
    r = route(router, m)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_release_later, first, 3.0)
        with await r.admit():
            assert r.waited_s > 0  # real seconds: the mock clock jumped the 3 s
    second.release()
    assert router.admission.in_use("m") == 0


async def _release_later(ticket: Any, delay_s: float) -> None:
    await trio.sleep(delay_s)
    ticket.release()


async def test_bulk_fills_half_and_the_default_band_and_new_bands_come_from_the_settings(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m", slots=4)
    cluster = FakeCluster(m)
    cluster.add("m", "m-0")
    router = Router(cluster)
    held = [await route(router, m, band="bulk").admit() for _ in range(2)]
    with pytest.raises(AdmissionTimeout) as caught:
        await route(router, m, band="bulk").admit()
    assert caught.value.band == "bulk"
    gold = BandSettings(name="gold", priority=300, saturation=1.0, queue_ttl=1.0)
    settings = ServerSettings(
        router=RouterSettings(admission=AdmissionSettings(bands=(gold,), default_band="gold"))
    )
    cluster.settings = settings
    router.settings_changed(settings)
    # "" is the settings' default band now; bulk no longer exists (highest priority).
    assert route(router, m).band == "gold"
    more = [await route(router, m, band="bulk").admit() for _ in range(2)]
    assert router.admission.in_use("m") == 4
    for ticket in held + more:
        ticket.release()


def test_unusable_bands_are_logged_and_the_last_ones_kept(caplog: pytest.LogCaptureFixture) -> None:
    cluster = FakeCluster()
    router = Router(cluster)
    zero = BandSettings(name="now", priority=1, queue_ttl=0.0)
    with caplog.at_level(logging.ERROR, logger="llmgw.router"):
        router.settings_changed(
            ServerSettings(router=RouterSettings(admission=AdmissionSettings(bands=(zero,))))
        )
    assert "admission bands not applied" in caplog.text
    assert router.admission.band("bulk").name == "bulk"


# --- the model namespace ----------------------------------------------------------------


def test_aliases_resolve_and_a_name_wins_over_an_alias() -> None:
    a = model("a", aliases=("b", "shared"))
    b = model("b", aliases=("shared",))
    cluster = FakeCluster(a, b)
    router = Router(cluster)
    assert router.resolve("a") is a
    assert router.resolve("b") is b  # its own name, not a's alias
    assert router.resolve("shared") is a  # the first to claim it
    assert router.resolve("nope") is None
    c = model("c", aliases=("b2",))
    cluster.models = {**cluster.models, "c": c}  # the catalog is replaced whole
    assert router.resolve("b2") is c


# --- replicas leaving routing ----------------------------------------------------------


async def test_an_attempt_waiting_on_a_replica_that_leaves_routing_is_retried_elsewhere() -> None:
    """A replica taken out of routing (its engine stopped answering) cancels
    the attempts waiting for its first byte: EndpointLost, retried on
    another replica, nothing counted against the lost one's breaker."""
    m = model("m")
    cluster = FakeCluster(m)
    a, b = cluster.add("m", "m-0", "m-1")
    router = Router(cluster)
    r = route(router, m)
    first = await r.next()
    lost = first.endpoint
    caught: list[BaseException] = []

    async def wait_for_first_byte(task_status: trio.TaskStatus[None]) -> None:
        with first:
            try:
                with first.waiting_first_byte():
                    task_status.started()
                    await trio.sleep_forever()
            except EndpointLost as exc:
                caught.append(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(wait_for_first_byte)
        assert lost.in_flight == 1
        cluster.endpoints["m"].remove(lost)
        lost.lose()
    (exc,) = caught
    assert lost.replica_id in str(exc)
    assert lost.in_flight == 0
    assert r.unreachable(first, exc)
    assert lost.breaker.consecutive_failures == 0
    second = await r.next()
    assert second.endpoint is not lost
    assert second.number == 1
    # A request sent to it after it left (chosen just before) ends at once.
    with pytest.raises(EndpointLost), first.waiting_first_byte():
        await trio.sleep_forever()
    assert {a.replica_id, b.replica_id} == {lost.replica_id, second.endpoint.replica_id}


async def test_a_client_leaving_counts_nothing_against_the_replica_and_frees_the_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request cancelled while it waits on a replica (the client left:
    499) is no failure of the replica; when it was the half-open probe, the
    next request may probe."""
    m = model("m")
    cluster = FakeCluster(m)
    (e,) = cluster.add("m", "m-0")
    router = Router(cluster, clock=trio.current_time)
    e.breaker.failure(trio.current_time(), status=429, retry_after_s=2.0)
    attempt = await route(router, m).next()
    assert state_of(e) is BreakerState.HALF_OPEN  # this request is the probe
    with trio.move_on_after(1), attempt, attempt.waiting_first_byte():
        await trio.sleep_forever()  # the client leaves
    assert e.breaker.consecutive_failures == 1  # the 429 only
    again = await route(router, m).next()  # no NotReady: the probe is free
    assert again.endpoint is e
    e.lose()  # found dead later: still nothing counted for the 499
    assert e.breaker.consecutive_failures == 1


async def test_a_new_leader_holds_a_request_while_its_nodes_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m")
    cluster = FakeCluster(m)
    cluster.settling = 5.0  # a new leader whose nodes are still linking
    router = Router(cluster, clock=trio.current_time)
    start = trio.current_time()

    async def link_later() -> None:
        await trio.sleep(1.5)
        cluster.add("m", "m-0")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link_later)
        attempt = await route(router, m).next()
    assert attempt.endpoint.replica_id == "m-0"
    assert trio.current_time() - start == pytest.approx(1.5, abs=0.01)


async def test_a_new_leader_refuses_once_the_settling_window_is_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    m = model("m")
    cluster = FakeCluster(m)
    cluster.settling = 2.0
    router = Router(cluster, clock=trio.current_time)
    start = trio.current_time()
    with pytest.raises(NotReady):
        await route(router, m).next()
    # Held for the window's rest only, not on_demand.load_wait.
    assert trio.current_time() - start == pytest.approx(2.0, abs=0.01)
    cluster.settling = 0.0
    start = trio.current_time()
    with pytest.raises(NotReady):
        await route(router, m).next()
    assert trio.current_time() - start == 0

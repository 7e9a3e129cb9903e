"""The leader lease between control planes of one store, on both stores:
one leads and says where in the store; a killed leader is replaced within
the lease's time, a stopped one within a round; a leader that cannot renew
stops at once; after a store outage a standby skips one round."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.app.leadership import (
    LEASE_NAME,
    STANDBY_POLL_S,
    release_leadership,
    serve_leadership,
)
from llmgw.control.cluster import Cluster
from llmgw.control.leader_record import LEADER_KEY, LeaderRecord, LeaderView, serve_leader_view
from llmgw.store import Fenced, ModelRecord, Profile, Store, StoreError, open_store

TTL_S = 1.5


@pytest.fixture(params=["sqlite", "postgres"])
def store_address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return str(request.getfixturevalue("postgres_db"))


@pytest.fixture
async def store(store_address: str) -> AsyncIterator[Store]:
    opened: AbstractAsyncContextManager[Store] = open_store(store_address)
    async with opened as s:
        yield s


class _Flaky:
    """A store whose lease calls fail (``down``) or hang (``hang``) on demand,
    recording when each ``acquire_lease`` was made."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.down = False
        self.hang = False
        self.acquired_at: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def acquire_lease(self, *args: Any) -> Any:
        self.acquired_at.append(trio.current_time())
        if self.hang:
            await trio.sleep_forever()
        if self.down:
            raise StoreError("connection refused")
        return await self._store.acquire_lease(*args)

    async def get_setting(self, key: str) -> Any:
        if self.down:
            raise StoreError("connection refused")
        return await self._store.get_setting(key)


async def _run(nursery: trio.Nursery, store: Any, name: str) -> tuple[Cluster, LeaderView]:
    cluster = Cluster()
    view = LeaderView(name)
    view.set_own(f"{name}.example:8080", (f"wss://{name}.example:7443/agent",))
    await nursery.start(
        partial(serve_leadership, store, cluster, name, (0, 0), view=view, ttl_s=TTL_S)
    )
    await nursery.start(serve_leader_view, store, cluster, view)
    return cluster, view


async def _until(predicate: Any, timeout_s: float) -> float:
    started = trio.current_time()
    with trio.fail_after(timeout_s):
        while not predicate():  # noqa: ASYNC110 (a state of other tasks, polled)
            await trio.sleep(0.02)
    return trio.current_time() - started


async def test_one_leads_and_the_standby_finds_it_then_takes_over_from_a_killed_one(
    store: Store,
) -> None:
    async with trio.open_nursery() as nursery:
        a_scope = trio.CancelScope()
        a_nursery_holder: list[tuple[Cluster, LeaderView]] = []

        async def run_a(*, task_status: trio.TaskStatus[None]) -> None:
            with a_scope:
                async with trio.open_nursery() as inner:
                    a_nursery_holder.append(await _run(inner, store, "a"))
                    task_status.started()
                    await trio.sleep_forever()

        await nursery.start(run_a)
        a, a_view = a_nursery_holder[0]
        assert a.is_leader
        b, b_view = await _run(nursery, store, "b")
        await _until(lambda: b_view.record is not None and b_view.record.holder == "a", 3)
        assert not b.is_leader
        assert b_view.leader_api() == "a.example:8080"
        assert b_view.hint() == "the leader is at wss://a.example:7443/agent"
        assert a_view.leader_api() is None  # the leader forwards to nobody
        # "Kill" a: its tasks end, the lease is not given up.
        a_scope.cancel()
        took_s = await _until(lambda: b.is_leader, TTL_S * 3)
        assert took_s <= TTL_S + STANDBY_POLL_S + 1
        await _until(lambda: b_view.record is not None and b_view.record.holder == "b", 3)
        record = LeaderRecord.from_json(await store.get_setting(LEADER_KEY))
        assert record is not None
        assert record.holder == "b"
        assert record.api == "b.example:8080"
        nursery.cancel_scope.cancel()


async def test_a_clean_stop_hands_over_within_a_round(store: Store) -> None:
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        holder: list[Cluster] = []

        async def run_a(*, task_status: trio.TaskStatus[None]) -> None:
            with scope:
                async with trio.open_nursery() as inner:
                    holder.append((await _run(inner, store, "a"))[0])
                    task_status.started()
                    await trio.sleep_forever()

        await nursery.start(run_a)
        b, _ = await _run(nursery, store, "b")
        assert holder[0].is_leader
        assert not b.is_leader
        scope.cancel()
        await release_leadership(store, "a")
        took_s = await _until(lambda: b.is_leader, TTL_S * 2)
        assert took_s <= min(STANDBY_POLL_S, TTL_S / 3) + 0.5
        nursery.cancel_scope.cancel()


async def test_a_leader_that_cannot_renew_stops_at_the_expiry_even_while_the_call_hangs(
    store: Store,
) -> None:
    flaky = _Flaky(store)
    async with trio.open_nursery() as nursery:
        cluster, _ = await _run(nursery, flaky, "a")
        assert cluster.is_leader
        flaky.hang = True
        hung_at = trio.current_time()
        await _until(lambda: not cluster.is_leader, TTL_S * 2)
        # By the lease's expiry (half a second early), not when the call ends.
        assert trio.current_time() - hung_at <= TTL_S
        nursery.cancel_scope.cancel()


async def test_after_a_store_outage_a_standby_skips_one_round(store: Store) -> None:
    # A lease held by nobody running: the standby could take it at once.
    flaky = _Flaky(store)
    flaky.down = True
    async with trio.open_nursery() as nursery:
        cluster, _ = await _run(nursery, flaky, "b")
        assert not cluster.is_leader
        await trio.sleep(1.2)
        flaky.down = False
        back_at = trio.current_time()
        tries = len(flaky.acquired_at)
        await _until(lambda: cluster.is_leader, TTL_S * 3)
        first_try = flaky.acquired_at[tries]
        assert first_try - back_at >= TTL_S / 3 - 0.05
        nursery.cancel_scope.cancel()


async def test_a_deposed_leaders_record_is_refused(store: Store) -> None:
    old = await store.acquire_lease(LEASE_NAME, "a", 0.2, time.time())
    assert old is not None
    await trio.sleep(0.3)
    new = await store.acquire_lease(LEASE_NAME, "b", 10, time.time())
    assert new is not None
    assert new.epoch == old.epoch + 1
    view = LeaderView("a")
    view.set_own("a.example:8080", ())
    with pytest.raises(Fenced):
        await view.publish(store, old)
    assert await store.get_setting(LEADER_KEY) is None


async def test_a_leader_cut_off_from_the_store_keeps_routing_until_it_answers(
    store: Store,
) -> None:
    flaky = _Flaky(store)
    async with trio.open_nursery() as nursery:
        cluster, _ = await _run(nursery, flaky, "a")
        assert cluster.is_leader
        assert cluster.routes_itself
        assert not cluster.cut_off
        flaky.down = True
        await _until(lambda: not cluster.is_leader, TTL_S * 2)
        # Leader-only work stopped, /v1 still answered here, all the outage.
        assert cluster.cut_off
        assert cluster.routes_itself
        await trio.sleep(TTL_S)
        assert cluster.cut_off
        assert not cluster.is_leader
        flaky.down = False
        # It contends at once when the store is back and leads again.
        await _until(lambda: cluster.is_leader, TTL_S * 3)
        assert not cluster.cut_off
        assert cluster.routes_itself
        nursery.cancel_scope.cancel()


async def test_a_cut_off_leader_stops_routing_once_another_leads(store: Store) -> None:
    flaky = _Flaky(store)
    async with trio.open_nursery() as nursery:
        cluster, _ = await _run(nursery, flaky, "a")
        flaky.down = True
        await _until(lambda: cluster.cut_off, TTL_S * 2)
        # Another control plane took the expired lease meanwhile.
        await trio.sleep(0.6)
        assert await store.acquire_lease(LEASE_NAME, "b", 30, time.time()) is not None
        flaky.down = False
        await _until(lambda: not cluster.routes_itself, TTL_S * 3)
        assert not cluster.is_leader
        nursery.cancel_scope.cancel()


async def test_coming_to_lead_runs_on_lead_each_time(store: Store) -> None:
    flaky = _Flaky(store)
    led: list[float] = []

    async def on_lead() -> None:
        led.append(trio.current_time())

    cluster = Cluster()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                serve_leadership, flaky, cluster, "a", (0, 0), ttl_s=TTL_S, on_lead=on_lead,
                settle_s=5.0,
            )
        )  # fmt: skip
        await _until(lambda: len(led) == 1, 2)
        assert 4 < cluster.settling_s() <= 5
        flaky.down = True
        await _until(lambda: not cluster.is_leader, TTL_S * 2)
        assert cluster.settling_s() == 0
        flaky.down = False
        await _until(lambda: len(led) == 2, TTL_S * 3)
        nursery.cancel_scope.cancel()


async def test_a_standby_knows_the_catalog_before_it_leads(store: Store) -> None:
    await store.put_model(ModelRecord(name="m", profiles=(Profile(engine="sim"),)))
    holder = await store.acquire_lease(LEASE_NAME, "elsewhere", 60, time.time())
    assert holder is not None
    async with trio.open_nursery() as nursery:
        cluster, _ = await _run(nursery, store, "b")
        assert not cluster.is_leader
        await _until(lambda: "m" in cluster.models, 5)
        assert cluster.catalog_loaded
        nursery.cancel_scope.cancel()

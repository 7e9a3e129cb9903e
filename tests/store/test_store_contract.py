"""The store contract: what every backend of :class:`llmgw.store.Store` does.

Every test here takes the parametrised ``store`` (or ``open_test_store``)
fixture from ``conftest.py``, so it runs once per backend.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import pytest
import trio

from llmgw import errors
from llmgw.store import (
    Conflict,
    External,
    ExternalKey,
    Fenced,
    GuardEvent,
    KeyRecord,
    Lease,
    ModelRecord,
    Origin,
    OriginFile,
    Profile,
    Store,
    UsageRow,
)

OpenStore = Callable[[], AbstractAsyncContextManager[Store]]


def make_key(n: int, *, created_at: float = 1_000.0, is_admin: bool = False) -> KeyRecord:
    return KeyRecord(
        id=f"key_{n}",
        name=f"key number {n}",
        key_hash=f"{n:064x}",
        prefix=f"sk-llmgw-{n:04d}",
        created_at=created_at,
        is_admin=is_admin,
    )


def make_usage(request_id: str, *, created_at: float, key_id: str = "key_1") -> UsageRow:
    return UsageRow(
        request_id=request_id,
        created_at=created_at,
        key_id=key_id,
        model="gemma",
        status=200,
        prompt_tokens=12,
        cached_tokens=4,
        completion_tokens=30,
        duration_ms=812.5,
        ttft_ms=41.25,
        replica_id="gemma/0",
        stream=True,
        endpoint="/v1/chat/completions",
    )


# --- secrets -----------------------------------------------------------------


async def test_a_secret_is_made_once_and_then_always_returned(store: Store) -> None:
    made: list[bytes] = []

    def make() -> bytes:
        made.append(b"first secret")
        return b"first secret"

    assert await store.get_or_create_secret("cluster", make) == b"first secret"
    assert await store.get_or_create_secret("cluster", lambda: b"another") == b"first secret"
    assert made == [b"first secret"]


async def test_a_secret_is_the_same_after_the_store_is_reopened(open_test_store: OpenStore) -> None:
    async with open_test_store() as store:
        first = await store.get_or_create_secret("cluster", lambda: b"\x00\xff secret bytes")
    async with open_test_store() as store:
        again = await store.get_or_create_secret("cluster", lambda: b"a different one")
    assert first == again == b"\x00\xff secret bytes"


async def test_concurrent_callers_all_get_the_same_secret(store: Store) -> None:
    counter = itertools.count()
    results: list[bytes] = []

    async def ask() -> None:
        results.append(await store.get_or_create_secret("s", lambda: b"v%d" % next(counter)))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(ask)
    assert len(results) == 10
    assert len(set(results)) == 1


async def test_secrets_with_different_names_are_kept_apart(store: Store) -> None:
    assert await store.get_or_create_secret("a", lambda: b"A") == b"A"
    assert await store.get_or_create_secret("b", lambda: b"B") == b"B"


# --- keys --------------------------------------------------------------------


async def test_a_key_is_found_by_its_hash_and_by_its_id(store: Store) -> None:
    key = make_key(1, is_admin=True)
    await store.insert_key(key)
    assert await store.find_key_by_hash(key.key_hash) == key
    assert await store.get_key(key.id) == key


async def test_an_unknown_key_is_none(store: Store) -> None:
    assert await store.find_key_by_hash("0" * 64) is None
    assert await store.get_key("key_missing") is None


async def test_keys_are_listed_oldest_first(store: Store) -> None:
    await store.insert_key(make_key(1, created_at=300.0))
    await store.insert_key(make_key(2, created_at=100.0))
    await store.insert_key(make_key(3, created_at=200.0))
    assert [k.id for k in await store.list_keys()] == ["key_2", "key_3", "key_1"]


async def test_a_key_with_a_hash_already_kept_is_a_conflict(store: Store) -> None:
    await store.insert_key(make_key(1))
    same_hash = KeyRecord(
        id="key_other", name="other", key_hash=make_key(1).key_hash, prefix="x", created_at=2.0
    )
    with pytest.raises(Conflict):
        await store.insert_key(same_hash)
    assert [k.id for k in await store.list_keys()] == ["key_1"]


async def test_a_key_with_an_id_already_kept_is_a_conflict(store: Store) -> None:
    await store.insert_key(make_key(1))
    same_id = KeyRecord(id="key_1", name="other", key_hash="f" * 64, prefix="x", created_at=2.0)
    with pytest.raises(Conflict):
        await store.insert_key(same_id)


async def test_a_revoked_key_is_still_found_by_hash_with_its_revocation_time(
    store: Store,
) -> None:
    key = make_key(1)
    await store.insert_key(key)
    assert await store.revoke_key(key.id, at=5_000.5) is True
    found = await store.find_key_by_hash(key.key_hash)
    assert found is not None
    assert found.revoked_at == 5_000.5


async def test_revoking_twice_keeps_the_first_revocation_time(store: Store) -> None:
    await store.insert_key(make_key(1))
    assert await store.revoke_key("key_1", at=10.0) is True
    assert await store.revoke_key("key_1", at=20.0) is True
    found = await store.get_key("key_1")
    assert found is not None
    assert found.revoked_at == 10.0


async def test_revoking_an_unknown_key_says_false(store: Store) -> None:
    assert await store.revoke_key("key_missing", at=1.0) is False


async def test_a_key_expiry_round_trips(store: Store) -> None:
    key = KeyRecord(
        id="key_e", name="e", key_hash="e" * 64, prefix="sk", created_at=1.0, expires_at=99.5
    )
    await store.insert_key(key)
    assert await store.get_key("key_e") == key


# --- usage -------------------------------------------------------------------


async def test_a_usage_batch_is_kept_and_each_row_found_by_request_id(store: Store) -> None:
    rows = [make_usage(f"req_{i}", created_at=100.0 + i) for i in range(5)]
    await store.insert_usage(rows)
    for row in rows:
        assert await store.get_usage(row.request_id) == row
    assert await store.get_usage("req_missing") is None


async def test_a_usage_row_with_defaults_round_trips(store: Store) -> None:
    row = UsageRow(request_id="r", created_at=1.0, key_id="k", model="m", status=502)
    await store.insert_usage([row])
    assert await store.get_usage("r") == row


async def test_a_usage_rows_guard_verdict_round_trips(store: Store) -> None:
    row = UsageRow(
        request_id="g",
        created_at=1.0,
        key_id="k",
        model="m",
        status=400,
        guard_rules="secret:aws_access_key,pii:card",
        guard_action="block",
        guard_ms=0.125,
    )
    await store.insert_usage([row])
    assert await store.get_usage("g") == row


async def test_guard_events_are_written_with_their_usage_rows_once_and_pruned_with_them(
    store: Store,
) -> None:
    events = (
        ("input", "secret:aws_access_key", "block"),
        ("input", "pii:card", "mask"),
    )
    first = UsageRow(
        request_id="g1", created_at=10.0, key_id="k", model="m", status=400, guard_events=events
    )
    second = UsageRow(
        request_id="g2",
        created_at=7_300.0,
        key_id="k2",
        model="m2",
        status=200,
        guard_events=(("output", "judge:violent", "block"),),
    )
    await store.insert_usage([first, second])
    await store.insert_usage([first])  # a retried batch adds no event twice
    found = await store.list_guard_events()
    assert found == [
        GuardEvent(
            request_id="g2",
            created_at=7_300.0,
            key_id="k2",
            model="m2",
            direction="output",
            rule="judge:violent",
            action="block",
        ),
        GuardEvent(
            request_id="g1",
            created_at=10.0,
            key_id="k",
            model="m",
            direction="input",
            rule="pii:card",
            action="mask",
        ),
        GuardEvent(
            request_id="g1",
            created_at=10.0,
            key_id="k",
            model="m",
            direction="input",
            rule="secret:aws_access_key",
            action="block",
        ),
    ]
    assert [e.rule for e in await store.list_guard_events(request_id="g1")] == [
        "pii:card",
        "secret:aws_access_key",
    ]
    assert [e.request_id for e in await store.list_guard_events(rule="judge:violent")] == ["g2"]
    assert [e.request_id for e in await store.list_guard_events(since=15.0)] == ["g2"]
    assert len(await store.list_guard_events(last=1)) == 1
    assert await store.list_guard_events(last=0) == []
    with pytest.raises(ValueError, match="last"):
        await store.list_guard_events(last=-1)
    await store.prune_usage(7_200.0)  # floored to its hour
    assert [e.request_id for e in await store.list_guard_events()] == ["g2"]


async def test_usage_rows_already_kept_are_skipped_when_a_batch_is_retried(store: Store) -> None:
    first = make_usage("req_1", created_at=1.0)
    await store.insert_usage([first])
    changed_copy = UsageRow(
        request_id="req_1", created_at=2.0, key_id="key_9", model="other", status=500
    )
    await store.insert_usage([changed_copy, make_usage("req_2", created_at=3.0)])
    assert await store.get_usage("req_1") == first
    assert [r.request_id for r in await store.list_usage()] == ["req_2", "req_1"]


async def test_a_request_id_repeated_inside_one_batch_is_kept_once(store: Store) -> None:
    await store.insert_usage([make_usage("req_1", created_at=1.0)] * 3)
    assert len(await store.list_usage()) == 1


async def test_an_empty_usage_batch_does_nothing(store: Store) -> None:
    await store.insert_usage([])
    assert await store.list_usage() == []


async def test_usage_is_listed_newest_first_and_limited_by_last(store: Store) -> None:
    await store.insert_usage([make_usage(f"req_{i}", created_at=float(i)) for i in (3, 1, 4, 2)])
    assert [r.request_id for r in await store.list_usage(last=3)] == ["req_4", "req_3", "req_2"]
    assert await store.list_usage(last=0) == []


async def test_usage_is_listed_twenty_rows_by_default(store: Store) -> None:
    await store.insert_usage([make_usage(f"req_{i}", created_at=float(i)) for i in range(25)])
    listed = await store.list_usage()
    assert len(listed) == 20
    assert listed[0].request_id == "req_24"


async def test_usage_can_be_listed_for_one_key(store: Store) -> None:
    await store.insert_usage(
        [
            make_usage("a1", created_at=1.0, key_id="key_a"),
            make_usage("b1", created_at=2.0, key_id="key_b"),
            make_usage("a2", created_at=3.0, key_id="key_a"),
            make_usage("b2", created_at=4.0, key_id="key_b"),
        ]
    )
    assert [r.request_id for r in await store.list_usage(key_id="key_a")] == ["a2", "a1"]
    assert [r.request_id for r in await store.list_usage(key_id="key_b", last=1)] == ["b2"]
    assert await store.list_usage(key_id="key_none") == []


# --- models ------------------------------------------------------------------


def make_model(name: str, **changes: Any) -> ModelRecord:
    model = ModelRecord.simple(
        name,
        "llamacpp",
        source="/var/lib/llmgw/models/gemma.gguf",
        replicas=2,
        context_tokens=8192,
        slots=8,
        cpu_cores=4,
        args=("--flash-attn", "on", "--jinja"),
        env={"LLAMA_ARG_THREADS": "4", "ÜNICODE": "ok ✓"},
        sha256="ab" * 32,
        created_at=1_700_000_000.25,
    )
    return attrs.evolve(model, **changes)


async def test_a_model_round_trips_with_its_args_and_env(store: Store) -> None:
    model = make_model("gemma")
    await store.put_model(model)
    assert await store.get_model("gemma") == model


async def test_a_model_with_defaults_round_trips(store: Store) -> None:
    model = ModelRecord.simple("sim", "sim")
    await store.put_model(model)
    assert await store.get_model("sim") == model


async def test_a_whole_catalog_entry_round_trips(store: Store) -> None:
    model = ModelRecord(
        name="big",
        aliases=("big-latest",),
        profiles=(
            Profile(name="gpu", engine="vllm", gpu_class="h100-80g", gpus=2, tp=2, replicas=3),
            Profile(name="cpu", engine="llamacpp", cpu_cores=8, min_memory_gb=12.5, priority=-1),
        ),
        on_demand=True,
        fallbacks=("small",),
        routing="batch",
        max_output=2048,
        context_length=32768,
    )
    await store.put_model(model)
    assert await store.get_model("big") == model
    assert model.replicas == 4
    outside = ModelRecord(
        name="ext",
        external=External(
            url="https://api.example.com",
            model="gpt-x",
            api_key_files=(ExternalKey(file="/etc/llmgw/a.key", weight=2),),
        ),
    )
    await store.put_model(outside)
    assert await store.get_model("ext") == outside


async def test_putting_a_model_again_replaces_it(store: Store) -> None:
    await store.put_model(make_model("gemma"))
    replacement = make_model("gemma", aliases=("g",), max_output=100)
    await store.put_model(replacement)
    assert await store.get_model("gemma") == replacement
    assert await store.list_models() == [replacement]


async def test_models_are_listed_by_name(store: Store) -> None:
    for name in ("qwen", "gemma", "llama"):
        await store.put_model(make_model(name))
    assert [m.name for m in await store.list_models()] == ["gemma", "llama", "qwen"]


async def test_a_deleted_model_is_gone_and_deleting_again_says_false(store: Store) -> None:
    await store.put_model(make_model("gemma"))
    assert await store.delete_model("gemma") is True
    assert await store.get_model("gemma") is None
    assert await store.delete_model("gemma") is False


# --- settings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"control": {"lease_ttl": 10.5, "names": ["a", "b"], "on": True, "off": None}},
        [1, 2.5, "three", False],
        "plain text",
        42,
        0.125,
        True,
    ],
)
async def test_a_setting_round_trips_as_json(store: Store, value: object) -> None:
    await store.put_setting("some.setting", value)
    assert await store.get_setting("some.setting") == value


async def test_a_missing_setting_is_none(store: Store) -> None:
    assert await store.get_setting("not.there") is None


async def test_putting_a_setting_again_replaces_it(store: Store) -> None:
    await store.put_setting("x", {"v": 1})
    await store.put_setting("x", {"v": 2})
    assert await store.get_setting("x") == {"v": 2}


async def test_a_setting_that_is_not_json_is_refused(store: Store) -> None:
    with pytest.raises(TypeError):
        await store.put_setting("x", {1, 2})
    with pytest.raises(ValueError, match="JSON"):
        await store.put_setting("x", float("nan"))
    assert await store.get_setting("x") is None


# --- leases ------------------------------------------------------------------


async def test_a_free_lease_is_taken_with_epoch_one(store: Store) -> None:
    lease = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    assert lease is not None
    assert (lease.name, lease.holder, lease.epoch, lease.expires_at) == (
        "leader",
        "cp-a",
        1,
        1_010.0,
    )


async def test_renewing_a_lease_keeps_its_epoch_and_moves_its_expiry(store: Store) -> None:
    await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    renewed = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_003.0)
    assert renewed is not None
    assert (renewed.holder, renewed.epoch, renewed.expires_at) == ("cp-a", 1, 1_013.0)


async def test_another_holder_is_refused_until_the_lease_expires(store: Store) -> None:
    await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    assert await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=1_009.9) is None
    taken = await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=1_010.0)
    assert taken is not None
    assert (taken.holder, taken.epoch, taken.expires_at) == ("cp-b", 2, 1_020.0)


async def test_the_old_holder_cannot_renew_after_a_takeover(store: Store) -> None:
    await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=1_011.0)
    assert await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_012.0) is None


async def test_each_takeover_adds_one_to_the_epoch(store: Store) -> None:
    holders = ["cp-a", "cp-b", "cp-a", "cp-c"]
    epochs = []
    for i, holder in enumerate(holders):
        lease = await store.acquire_lease("leader", holder, ttl_s=1.0, now=100.0 * i)
        assert lease is not None
        epochs.append(lease.epoch)
    assert epochs == [1, 2, 3, 4]


async def test_a_released_lease_is_free_at_once_and_its_epoch_still_grows(store: Store) -> None:
    await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    await store.release_lease("leader", "cp-a")
    taken = await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=1_001.0)
    assert taken is not None
    assert (taken.holder, taken.epoch) == ("cp-b", 2)


async def test_releasing_a_lease_someone_else_holds_does_nothing(store: Store) -> None:
    await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    await store.release_lease("leader", "cp-b")
    await store.release_lease("never-taken", "cp-b")
    assert await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=1_001.0) is None


async def test_leases_with_different_names_are_independent(store: Store) -> None:
    a = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=0.0)
    b = await store.acquire_lease("job:7", "cp-b", ttl_s=10.0, now=0.0)
    assert a is not None
    assert b is not None
    assert (a.holder, b.holder) == ("cp-a", "cp-b")


async def test_of_many_contenders_for_a_free_lease_exactly_one_wins(store: Store) -> None:
    winners: list[str] = []

    async def contend(holder: str) -> None:
        lease = await store.acquire_lease("leader", holder, ttl_s=10.0, now=1_000.0)
        if lease is not None:
            winners.append(lease.holder)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(contend, f"cp-{i}")
    assert len(winners) == 1


async def test_a_lease_with_a_ttl_that_is_not_positive_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        await store.acquire_lease("leader", "cp-a", ttl_s=0.0, now=1.0)


# --- fencing: a deposed leader's writes are refused ----------------------------


async def _deposed(store: Store) -> tuple[Lease, Lease]:
    """cp-a led (epoch 1) and was deposed by cp-b (epoch 2) after its lease expired."""
    old = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    new = await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=1_011.0)
    assert old is not None
    assert new is not None
    assert (old.epoch, new.epoch) == (1, 2)
    return old, new


async def test_a_write_fenced_by_the_lease_held_lands(store: Store) -> None:
    lease = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
    assert lease is not None
    # A renewal keeps the epoch: the first lease still fences the writes.
    assert await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_005.0) is not None
    await store.put_model(ModelRecord.simple("m", "sim"), fence=lease)
    await store.put_setting("k", 1, fence=lease)
    assert await store.put_settings_doc({"a": 1}, expected_version=0, actor="t", fence=lease) == 1
    assert await store.delete_model("m", fence=lease) is True
    assert await store.get_setting("k") == 1


async def test_a_deposed_leaders_writes_are_refused_and_write_nothing(store: Store) -> None:
    old, new = await _deposed(store)
    await store.put_model(ModelRecord.simple("kept", "sim"), fence=new)
    await store.insert_usage([make_usage("r1", created_at=0.0)])

    with pytest.raises(Fenced, match="no longer holds the 'leader' lease") as refused:
        await store.put_model(ModelRecord.simple("m", "sim"), fence=old)
    assert isinstance(refused.value, errors.StoreError)
    assert refused.value.lease == old
    assert refused.value.current == ("cp-b", 2)
    assert "epoch 1" in str(refused.value)
    assert "epoch 2" in str(refused.value)
    with pytest.raises(Fenced):
        await store.delete_model("kept", fence=old)
    with pytest.raises(Fenced):
        await store.put_setting("k", 1, fence=old)
    with pytest.raises(Fenced):
        await store.put_settings_doc({"a": 1}, expected_version=None, actor="t", fence=old)
    with pytest.raises(Fenced):
        await store.prune_usage(7_200.0, fence=old)

    assert await store.get_model("m") is None
    assert await store.get_model("kept") is not None
    assert await store.get_setting("k") is None
    assert await store.settings_version() == 0
    assert await store.get_usage("r1") is not None
    assert await store.usage_pruned_before() is None


async def test_the_old_holder_is_fenced_even_when_it_takes_the_lease_back(store: Store) -> None:
    old, _ = await _deposed(store)
    again = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_022.0)
    assert again is not None
    assert again.epoch == 3
    with pytest.raises(Fenced):
        await store.put_setting("k", 1, fence=old)
    await store.put_setting("k", 2, fence=again)
    assert await store.get_setting("k") == 2


async def test_a_write_fenced_by_a_lease_that_does_not_exist_is_refused(store: Store) -> None:
    ghost = Lease(name="leader", holder="cp-a", epoch=1, expires_at=2_000.0)
    with pytest.raises(Fenced, match="there is no such lease"):
        await store.put_model(ModelRecord.simple("m", "sim"), fence=ghost)
    assert await store.list_models() == []


# --- concurrency -------------------------------------------------------------


async def test_concurrent_writes_from_many_tasks_all_land(store: Store) -> None:
    async def write(n: int) -> None:
        await store.insert_key(make_key(n, created_at=float(n)))
        await store.insert_usage(
            [make_usage(f"req_{n}_{i}", created_at=float(n), key_id=f"key_{n}") for i in range(5)]
        )
        await store.put_setting(f"task.{n}", n)

    async with trio.open_nursery() as nursery:
        for n in range(50):
            nursery.start_soon(write, n)

    assert len(await store.list_keys()) == 50
    assert len(await store.list_usage(last=1_000)) == 250
    for n in range(50):
        assert await store.get_setting(f"task.{n}") == n


async def test_the_data_is_still_there_after_the_store_is_reopened(
    open_test_store: OpenStore,
) -> None:
    async with open_test_store() as store:
        await store.insert_key(make_key(1))
        await store.insert_usage([make_usage("req_1", created_at=1.0)])
        await store.put_model(make_model("gemma"))
        await store.put_setting("x", [1])
        await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=0.0)
    async with open_test_store() as store:
        assert await store.get_key("key_1") == make_key(1)
        assert await store.get_usage("req_1") == make_usage("req_1", created_at=1.0)
        assert await store.get_model("gemma") == make_model("gemma")
        assert await store.get_setting("x") == [1]
        assert await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=5.0) is None


# --- the cluster settings document (versioned) -----------------------------------


async def test_there_is_no_settings_document_before_the_first_put(store: Store) -> None:
    assert await store.get_settings_doc() is None
    assert await store.settings_version() == 0
    assert await store.settings_history(10) == []


async def test_each_put_of_the_settings_document_is_a_new_version(store: Store) -> None:
    first = await store.put_settings_doc(
        {"serving": {"stopped": False}}, expected_version=0, actor="server.yaml", note="seed"
    )
    second = await store.put_settings_doc(
        {"serving": {"stopped": True}}, expected_version=first, actor="admin (key_1)"
    )
    assert (first, second) == (1, 2)
    assert await store.settings_version() == 2
    assert await store.get_settings_doc() == (2, {"serving": {"stopped": True}})


async def test_a_put_with_a_stale_expected_version_is_a_conflict_and_changes_nothing(
    store: Store,
) -> None:
    await store.put_settings_doc({"a": 1}, expected_version=0, actor="x")
    await store.put_settings_doc({"a": 2}, expected_version=1, actor="y")
    with pytest.raises(Conflict, match="version 2"):
        await store.put_settings_doc({"a": 3}, expected_version=1, actor="z")
    with pytest.raises(Conflict):
        await store.put_settings_doc({"a": 3}, expected_version=0, actor="seed again")
    assert await store.get_settings_doc() == (2, {"a": 2})


async def test_a_put_without_an_expected_version_always_lands(store: Store) -> None:
    assert await store.put_settings_doc({"a": 1}, expected_version=None, actor="x") == 1
    assert await store.put_settings_doc({"a": 2}, expected_version=None, actor="x") == 2


async def test_of_many_writers_expecting_one_version_exactly_one_wins(store: Store) -> None:
    await store.put_settings_doc({"n": -1}, expected_version=0, actor="seed")
    won: list[int] = []

    async def write(n: int) -> None:
        try:
            await store.put_settings_doc({"n": n}, expected_version=1, actor=f"w{n}")
        except Conflict:
            return
        won.append(n)

    async with trio.open_nursery() as nursery:
        for n in range(10):
            nursery.start_soon(write, n)
    assert len(won) == 1
    assert await store.get_settings_doc() == (2, {"n": won[0]})


async def test_the_settings_history_is_newest_first_with_actor_and_note(store: Store) -> None:
    for n in range(5):
        await store.put_settings_doc(
            {"n": n}, expected_version=None, actor=f"actor {n}", note=f"note {n}"
        )
    history = await store.settings_history(3)
    assert [c.version for c in history] == [5, 4, 3]
    assert [c.document for c in history] == [{"n": 4}, {"n": 3}, {"n": 2}]
    assert [(c.actor, c.note) for c in history] == [
        ("actor 4", "note 4"),
        ("actor 3", "note 3"),
        ("actor 2", "note 2"),
    ]
    assert history[0].changed_at >= history[-1].changed_at > 0
    assert len(await store.settings_history(100)) == 5
    with pytest.raises(ValueError, match="at least 1"):
        await store.settings_history(0)


async def test_a_settings_document_that_is_not_json_is_refused(store: Store) -> None:
    with pytest.raises(TypeError):
        await store.put_settings_doc({"a": {1, 2}}, expected_version=None, actor="x")
    with pytest.raises(ValueError, match=r"JSON|NaN|nan|range"):
        await store.put_settings_doc({"a": float("inf")}, expected_version=None, actor="x")
    assert await store.settings_version() == 0


async def test_the_settings_document_survives_a_reopen(open_test_store: OpenStore) -> None:
    async with open_test_store() as store:
        await store.put_settings_doc({"nodes": {"cordoned": ["n1"]}}, expected_version=0, actor="x")
    async with open_test_store() as store:
        assert await store.get_settings_doc() == (1, {"nodes": {"cordoned": ["n1"]}})
        assert await store.settings_version() == 1


async def test_a_model_with_its_pinned_origin_round_trips(store: Store) -> None:
    origin = Origin(
        repo="llmgw/gemma-3-270m-gguf",
        revision="c" * 40,
        files=(
            OriginFile(path="m.gguf", size_bytes=253_113_024, sha256="ab" * 32),
            OriginFile(path="sub/config.json", size_bytes=12, sha256="cd" * 32),
        ),
        main_file="m.gguf",
    )
    model = attrs.evolve(
        ModelRecord.simple("pinned", "llamacpp"),
        source=f"hf:llmgw/gemma-3-270m-gguf@{'c' * 40}/m.gguf",
        origin=origin,
    )
    await store.put_model(model)
    assert await store.get_model("pinned") == model

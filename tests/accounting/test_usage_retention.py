"""Usage retention: raw rows past ``auth.usage_retain_days`` pruned in short
batches by the leader's task while the roll-ups keep every sum, and a
journal replayed after pruning counted once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import trio

from llmgw.accounting.journal import UsageJournal
from llmgw.accounting.retention import prune_usage_past, serve_usage_retention
from llmgw.accounting.usage import UsageWriter
from llmgw.errors import StoreError
from llmgw.settings import SettingsError, settings_from_doc
from llmgw.store import Fenced, Lease, Store, UsageRow, UsageSummary, open_sqlite_store

DAY = 86_400.0
HOUR = 3_600.0
#: "Now" for the tests: 2026-06-01 12:34:56 UTC.
NOW = 1_780_317_296.0


def row(n: int, at: float, *, key: str = "key_a", status: int = 200) -> UsageRow:
    return UsageRow(
        request_id=f"req_{n:05d}",
        created_at=at,
        key_id=key,
        model="gemma",
        status=status,
        prompt_tokens=100 + n,
        cached_tokens=n % 7,
        completion_tokens=20 + n % 13,
        cost_micros=1_000 + n,
        project_id="proj_a",
        team_id="team_a",
        org_id="org_a",
    )


def year_of_rows() -> list[UsageRow]:
    """A row every 6 h 7 min over 400 days back from NOW, two keys, some errors."""
    rows = []
    n = 0
    at = NOW - 400 * DAY
    while at < NOW:
        rows.append(row(n, at, key=("key_a", "key_b")[n % 2], status=(200, 200, 502)[n % 3]))
        n += 1
        at += 6 * HOUR + 420.0
    return rows


def expected(rows: Sequence[UsageRow], since: float) -> list[UsageSummary]:
    sums: dict[str, list[int]] = {}
    for r in rows:
        if r.created_at < since:
            continue
        s = sums.setdefault(r.key_id, [0] * 6)
        for i, v in enumerate(
            (
                1,
                r.prompt_tokens,
                r.cached_tokens,
                r.completion_tokens,
                r.cost_micros,
                int(r.status >= 400),
            )
        ):
            s[i] += v
    out = [
        UsageSummary(
            group=group,
            requests=s[0],
            prompt_tokens=s[1],
            cached_tokens=s[2],
            completion_tokens=s[3],
            cost_micros=s[4],
            errors=s[5],
        )
        for group, s in sums.items()
    ]
    return sorted(out, key=lambda u: (-u.cost_micros, u.group))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_sqlite_store(tmp_path / "llmgw.db") as opened:
        yield opened


class CountingStore:
    """A store that records each prune call's limit and result."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int]] = []
        self.fail_next = 0

    async def prune_usage(
        self, before: float, *, limit: int = 5000, fence: Lease | None = None
    ) -> int:
        if self.fail_next:
            self.fail_next -= 1
            raise StoreError("database is locked")
        deleted = await self.inner.prune_usage(before, limit=limit, fence=fence)
        self.calls.append((limit, deleted))
        return deleted


async def raw_ids(store: Store) -> set[str]:
    return {r.request_id for r in await store.export_usage(0.0, None, limit=100_000)}


def test_raw_rows_are_kept_90_days_unless_set_otherwise() -> None:
    assert settings_from_doc({}).auth.usage_retain_days == 90
    assert settings_from_doc({"auth": {"usage_retain_days": 400}}).auth.usage_retain_days == 400
    for bad in (0, -1, 1.5, "30d"):
        with pytest.raises(SettingsError, match="usage_retain_days"):
            settings_from_doc({"auth": {"usage_retain_days": bad}})


async def test_pruning_past_90_days_in_small_batches_keeps_a_years_sums_exact(
    store: Store,
) -> None:
    rows = year_of_rows()
    await store.insert_usage(rows)
    sinces = [NOW - 365 * DAY, NOW - 400 * DAY, NOW - 120 * DAY, NOW - 30 * DAY]
    before = [await store.usage_summary("key", s) for s in sinces]
    assert before[0] == expected(rows, NOW - 365 * DAY)
    spend_month = await store.spend_since_by_scope(NOW - 20 * DAY)

    counting = CountingStore(store)
    deleted = await prune_usage_past(counting, 90, NOW, batch=50, pause_s=0)  # type: ignore[arg-type]

    cut = (NOW - 90 * DAY) // HOUR * HOUR
    old = {r.request_id for r in rows if r.created_at < cut}
    assert deleted == len(old) > 50
    assert await raw_ids(store) == {r.request_id for r in rows} - old
    # Never one large delete: every transaction deleted at most one batch.
    assert all(limit == 50 and count <= 50 for limit, count in counting.calls)
    assert len(counting.calls) == len(old) // 50 + 1
    # The sums are what they were, over a year and over any part of it.
    assert [await store.usage_summary("key", s) for s in sinces] == before
    assert await store.spend_since_by_scope(NOW - 20 * DAY) == spend_month
    assert await prune_usage_past(store, 90, NOW) == 0


async def test_a_journal_replayed_after_pruning_adds_nothing_to_the_roll_ups(
    tmp_path: Path, store: Store
) -> None:
    rows = year_of_rows()
    # A process journaled every row and crashed; the store had them all.
    crashed = UsageJournal(tmp_path / "j")
    for r in rows:
        crashed.append(r)
    await crashed.commit()
    crashed.close()
    await store.insert_usage(rows)
    await prune_usage_past(store, 90, NOW, batch=100, pause_s=0)
    before = await store.usage_summary("key", 0.0)
    kept = await raw_ids(store)

    journal = UsageJournal(tmp_path / "j")
    assert len(journal.crashed_segments()) == 1
    await UsageWriter(journal=journal, batch_size=37).flush(store)
    journal.close()

    assert await store.usage_summary("key", 0.0) == before == expected(rows, 0.0)
    assert await raw_ids(store) == kept


async def test_the_task_prunes_at_once_then_each_pass_with_the_live_setting(
    store: Store,
) -> None:
    now = time.time()
    rows = [row(n, now - days * DAY) for n, days in enumerate([200, 100, 50, 10, 0.01])]
    await store.insert_usage(rows)
    before = await store.usage_summary("key", 0.0)
    retain = {"days": 90}
    counting = CountingStore(store)
    counting.fail_next = 1  # the first pass fails: logged, tried again

    async def wait_for(ids: set[str]) -> None:
        with trio.fail_after(10):
            while await raw_ids(store) != ids:  # noqa: ASYNC110 -- the store is watched
                await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_usage_retention(
                counting,  # type: ignore[arg-type]
                lambda: retain["days"],
                every_s=0.02,
                batch=1,
                pause_s=0,
                task_status=task_status,
            )
        )
        await wait_for({r.request_id for r in rows[2:]})
        retain["days"] = 30  # changed live: the next pass keeps less
        await wait_for({r.request_id for r in rows[3:]})
        nursery.cancel_scope.cancel()
    assert await store.usage_summary("key", 0.0) == before


async def test_a_deposed_leaders_pruning_is_refused_and_deletes_nothing(store: Store) -> None:
    rows = year_of_rows()
    await store.insert_usage(rows)
    old = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=NOW)
    new = await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=NOW + 11)
    assert old is not None
    assert new is not None
    with pytest.raises(Fenced, match="no longer holds the 'leader' lease"):
        await prune_usage_past(store, 90, NOW, fence=old)
    assert await raw_ids(store) == {r.request_id for r in rows}
    assert await prune_usage_past(store, 90, NOW, fence=new) > 0


async def test_the_retention_task_carries_its_fence_and_logs_a_refusal(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    rows = year_of_rows()
    await store.insert_usage(rows)
    stale = Lease(name="leader", holder="cp-gone", epoch=7, expires_at=NOW)
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_usage_retention(
                store, lambda: 90, every_s=0.02, fence=stale, task_status=task_status
            )
        )
        with trio.fail_after(10):
            while "no longer holds the 'leader' lease" not in caplog.text:  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert await raw_ids(store) == {r.request_id for r in rows}

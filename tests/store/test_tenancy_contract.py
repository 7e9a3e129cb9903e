"""The store contract for the tenancy tree, keys in projects, and accounting.

Like ``test_store_contract.py``, every test takes the parametrised ``store``
(or ``open_test_store``) fixture from ``conftest.py``, so it runs once per
backend.
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, get_args

import attrs
import pytest

from llmgw.store import (
    Conflict,
    KeyRecord,
    Limits,
    Scope,
    Store,
    StoreError,
    SummaryBy,
    UsageRow,
    UsageSummary,
)

HOUR = 3600.0
DAY = 86_400.0
#: 2026-01-01 00:00 UTC, a day and month start.
T0 = 1_767_225_600.0

# --- the tree ------------------------------------------------------------------


async def test_creating_a_path_makes_each_missing_level_and_says_which(store: Store) -> None:
    path, created = await store.ensure_project("Acme", "ml", "train", now=10.0)
    assert created == ["org Acme", "team Acme/ml", "project Acme/ml/train"]
    assert path.path == "Acme/ml/train"
    assert (path.org.name, path.team.name, path.project.name) == ("Acme", "ml", "train")
    assert path.team.org_id == path.org.id
    assert path.project.team_id == path.team.id
    assert path.org.created_at == path.team.created_at == path.project.created_at == 10.0
    assert path.org.limits == path.team.limits == path.project.limits == Limits()
    assert len({path.org.id, path.team.id, path.project.id}) == 3

    _, created = await store.ensure_project("Acme", "ml", "serve", now=20.0)
    assert created == ["project Acme/ml/serve"]
    _, created = await store.ensure_project("Acme", "web", "serve", now=30.0)
    assert created == ["team Acme/web", "project Acme/web/serve"]


async def test_creating_an_existing_path_again_changes_nothing_and_says_so(store: Store) -> None:
    first, _ = await store.ensure_project("Acme", "ml", "train", now=10.0)
    again, created = await store.ensure_project("Acme", "ml", "train", now=99.0)
    assert created == []
    assert again == first
    assert await store.list_tree() == [first]


async def test_names_are_unique_per_parent_so_nothing_is_ever_re_parented(store: Store) -> None:
    acme, _ = await store.ensure_project("Acme", "ml", "train", now=1.0)
    other, created = await store.ensure_project("Other", "ml", "train", now=2.0)
    assert created == ["org Other", "team Other/ml", "project Other/ml/train"]
    assert other.team.id != acme.team.id
    assert other.project.id != acme.project.id
    # Acme's team and project are where they were.
    assert await store.get_project_path(acme.project.id) == acme
    assert await store.find_project("Acme", "ml", "train") == acme
    assert await store.find_project("Other", "ml", "train") == other
    # The same project name in another team of one org is another project too.
    web, _ = await store.ensure_project("Acme", "web", "train", now=3.0)
    assert web.org == acme.org
    assert web.project.id != acme.project.id
    assert await store.get_project_path(acme.project.id) == acme


async def test_names_are_compared_exactly(store: Store) -> None:
    upper, _ = await store.ensure_project("Acme", "ML", "train", now=1.0)
    lower, created = await store.ensure_project("Acme", "ml", "train", now=2.0)
    assert created == ["team Acme/ml", "project Acme/ml/train"]
    assert upper.team.id != lower.team.id


@pytest.mark.parametrize(
    "names",
    [
        ("", "ml", "train"),
        ("Acme", "", "train"),
        ("Acme", "ml", ""),
        ("a" * 65, "ml", "train"),
        ("Acme/x", "ml", "train"),
        ("Acme", "m l", "train"),
        ("Acme", "ml", "trän"),
        ("Acme", "ml", "train\n"),
    ],
)
async def test_a_name_that_is_not_1_to_64_plain_characters_is_refused(
    store: Store, names: tuple[str, str, str]
) -> None:
    with pytest.raises(ValueError, match="1 to 64 letters"):
        await store.ensure_project(*names, now=1.0)
    assert await store.list_orgs() == []


async def test_a_name_of_64_letters_digits_dashes_underscores_and_dots_is_accepted(
    store: Store,
) -> None:
    long = "A" * 64
    path, _ = await store.ensure_project(long, "team-1_x.y", "0.9", now=1.0)
    assert path.path == f"{long}/team-1_x.y/0.9"


async def test_an_unknown_project_is_none(store: Store) -> None:
    await store.ensure_project("Acme", "ml", "train", now=1.0)
    assert await store.get_project_path("proj_missing") is None
    assert await store.find_project("Acme", "ml", "serve") is None
    assert await store.find_project("Acme", "web", "train") is None
    assert await store.find_project("Other", "ml", "train") is None


async def test_orgs_and_teams_are_found_by_name_for_resolving_paths(store: Store) -> None:
    path, _ = await store.ensure_project("Acme", "ml", "train", now=1.0)
    await store.ensure_project("Other", "ml", "train", now=1.0)
    assert await store.find_org("Acme") == path.org
    assert await store.find_org("Nobody") is None
    assert await store.find_team("Acme", "ml") == path.team
    assert await store.find_team("Acme", "web") is None
    assert await store.find_team("Nobody", "ml") is None


async def test_the_tree_is_listed_by_org_team_and_project_name(store: Store) -> None:
    for org, team, project in [
        ("Zeta", "a", "p"),
        ("Acme", "web", "site"),
        ("Acme", "ml", "train"),
        ("Acme", "ml", "eval"),
    ]:
        await store.ensure_project(org, team, project, now=1.0)
    assert [p.path for p in await store.list_tree()] == [
        "Acme/ml/eval",
        "Acme/ml/train",
        "Acme/web/site",
        "Zeta/a/p",
    ]
    assert [o.name for o in await store.list_orgs()] == ["Acme", "Zeta"]
    teams = await store.list_teams()
    assert [t.name for t in teams] == ["ml", "web", "a"]
    acme = await store.find_org("Acme")
    assert acme is not None
    assert [t.org_id == acme.id for t in teams] == [True, True, False]


async def test_a_new_store_has_an_empty_tree(store: Store) -> None:
    assert await store.list_tree() == []
    assert await store.list_orgs() == []
    assert await store.list_teams() == []


# --- limits --------------------------------------------------------------------

FULL_LIMITS = Limits(
    rpm=60,
    tpm=200_000,
    budget_day_micros=5_000_000,
    budget_month_micros=100_000_000,
    models=("gemma", "qwen"),
)


async def tree_and_key(store: Store) -> dict[Scope, str]:
    """Acme/ml/train and key_1 in it: the id at each scope."""
    path, _ = await store.ensure_project("Acme", "ml", "train", now=1.0)
    await store.insert_key(make_key(1, project_id=path.project.id))
    return {"org": path.org.id, "team": path.team.id, "project": path.project.id, "key": "key_1"}


async def limits_at(store: Store, scope: Scope) -> Limits:
    """The limits stored at ``scope`` for the tree made by :func:`tree_and_key`."""
    if scope == "key":
        key = await store.get_key("key_1")
        assert key is not None
        return key.limits
    found = await store.find_project("Acme", "ml", "train")
    assert found is not None
    if scope == "org":
        return found.org.limits
    if scope == "team":
        return found.team.limits
    return found.project.limits


@pytest.mark.parametrize("scope", get_args(Scope))
@pytest.mark.parametrize(
    "limits",
    [
        FULL_LIMITS,
        Limits(rpm=10),
        Limits(budget_month_micros=0, models=()),
        Limits(),
    ],
    ids=["all", "rpm-only", "zero-budget-no-models", "none"],
)
async def test_limits_round_trip_at_each_scope(store: Store, scope: Scope, limits: Limits) -> None:
    ids = await tree_and_key(store)
    assert await store.set_limits(scope, ids[scope], FULL_LIMITS) is True
    assert await limits_at(store, scope) == FULL_LIMITS
    assert await store.set_limits(scope, ids[scope], limits) is True
    assert await limits_at(store, scope) == limits


@pytest.mark.parametrize("scope", get_args(Scope))
async def test_limits_set_at_one_scope_leave_the_others_alone(store: Store, scope: Scope) -> None:
    ids = await tree_and_key(store)
    await store.set_limits(scope, ids[scope], FULL_LIMITS)
    for other in get_args(Scope):
        assert await limits_at(store, other) == (FULL_LIMITS if other == scope else Limits())


@pytest.mark.parametrize("scope", get_args(Scope))
async def test_setting_limits_on_an_unknown_id_says_false(store: Store, scope: Scope) -> None:
    assert await store.set_limits(scope, "missing", Limits(rpm=1)) is False


def test_no_models_allowed_and_models_inherited_are_different_limits() -> None:
    assert Limits(models=()) != Limits()
    assert Limits(models=["a", "b"]).models == ("a", "b")


@pytest.mark.parametrize(
    "changes", [{"rpm": -1}, {"tpm": -5}, {"budget_day_micros": -1}, {"budget_month_micros": -1}]
)
def test_negative_limits_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        Limits(**changes)


def test_a_bare_string_is_not_a_list_of_models() -> None:
    with pytest.raises(TypeError, match="not the string"):
        Limits(models="gemma")


# --- keys --------------------------------------------------------------------


def make_key(n: int, **changes: Any) -> KeyRecord:
    key = KeyRecord(
        id=f"key_{n}",
        name=f"key number {n}",
        key_hash=f"{n:064x}",
        prefix=f"sk-llmgw-{n:04d}",
        created_at=1_000.0 + n,
    )
    return attrs.evolve(key, **changes)


async def test_a_key_in_a_project_with_a_band_limits_and_last_use_round_trips(
    store: Store,
) -> None:
    path, _ = await store.ensure_project("Acme", "ml", "train", now=1.0)
    key = make_key(
        1,
        project_id=path.project.id,
        band="batch",
        limits=Limits(rpm=5, models=("gemma",)),
        last_used_at=1_234.5,
        expires_at=9_999.0,
    )
    await store.insert_key(key)
    assert await store.get_key("key_1") == key
    assert await store.find_key_by_hash(key.key_hash) == key
    assert await store.list_keys() == [key]


async def test_a_key_without_the_new_fields_has_no_project_band_limits_or_use(
    store: Store,
) -> None:
    await store.insert_key(make_key(1))
    found = await store.get_key("key_1")
    assert found is not None
    assert (found.project_id, found.band, found.limits, found.last_used_at) == (
        None,
        "",
        Limits(),
        None,
    )


async def test_a_key_in_a_project_that_does_not_exist_is_refused(store: Store) -> None:
    with pytest.raises(StoreError):
        await store.insert_key(make_key(1, project_id="proj_missing"))
    assert await store.list_keys() == []


async def test_updating_a_key_replaces_it_by_id(store: Store) -> None:
    path, _ = await store.ensure_project("Acme", "ml", "train", now=1.0)
    await store.insert_key(make_key(1))
    rotated = make_key(
        1,
        name="renamed",
        key_hash="f" * 64,
        prefix="sk-llmgw-ffff",
        expires_at=50_000.0,
        project_id=path.project.id,
        band="interactive",
        limits=Limits(tpm=1_000),
        last_used_at=2_000.0,
    )
    assert await store.update_key(rotated) is True
    assert await store.get_key("key_1") == rotated
    assert await store.find_key_by_hash("f" * 64) == rotated
    assert await store.find_key_by_hash(make_key(1).key_hash) is None


async def test_updating_an_unknown_key_says_false_and_keeps_nothing(store: Store) -> None:
    assert await store.update_key(make_key(1)) is False
    assert await store.list_keys() == []


async def test_updating_a_key_to_another_keys_hash_is_a_conflict(store: Store) -> None:
    await store.insert_key(make_key(1))
    await store.insert_key(make_key(2))
    with pytest.raises(Conflict):
        await store.update_key(make_key(1, key_hash=make_key(2).key_hash))
    assert await store.get_key("key_1") == make_key(1)


async def test_a_stale_copy_cannot_unrevoke_a_key_or_move_its_last_use_back(
    store: Store,
) -> None:
    stale = make_key(1, last_used_at=100.0)
    await store.insert_key(stale)
    await store.revoke_key("key_1", at=500.0)
    await store.update_key(attrs.evolve(stale, last_used_at=50.0, band="b"))
    found = await store.get_key("key_1")
    assert found is not None
    assert (found.revoked_at, found.last_used_at, found.band) == (500.0, 100.0, "b")
    await store.update_key(attrs.evolve(stale, last_used_at=None))
    found = await store.get_key("key_1")
    assert found is not None
    assert found.last_used_at == 100.0


async def test_last_uses_are_marked_in_one_batch_and_never_go_back(store: Store) -> None:
    await store.insert_key(make_key(1))
    await store.insert_key(make_key(2, last_used_at=900.0))
    await store.mark_keys_used({"key_1": 700.0, "key_2": 800.0, "key_missing": 1.0})
    await store.mark_keys_used({})
    assert [(k.id, k.last_used_at) for k in await store.list_keys()] == [
        ("key_1", 700.0),
        ("key_2", 900.0),
    ]
    await store.mark_keys_used({"key_1": 750.0})
    found = await store.get_key("key_1")
    assert found is not None
    assert found.last_used_at == 750.0


# --- usage rows ----------------------------------------------------------------


def usage(
    request_id: str,
    at: float,
    *,
    key: str = "key_a",
    project: str = "proj_a",
    team: str = "team_a",
    org: str = "org_a",
    model: str = "gemma",
    served: str = "",
    prompt: int = 10,
    cached: int = 2,
    completion: int = 5,
    cost: int = 100,
    status: int = 200,
) -> UsageRow:
    return UsageRow(
        request_id=request_id,
        created_at=at,
        key_id=key,
        model=model,
        status=status,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        project_id=project,
        team_id=team,
        org_id=org,
        served_model=served,
        cost_micros=cost,
    )


async def test_a_usage_row_with_its_tree_place_served_model_media_and_cost_round_trips(
    store: Store,
) -> None:
    row = attrs.evolve(
        usage("req_1", T0 + 1.5, model="gemma", served="qwen", cost=150_020),
        images=3,
        meshes=1,
        duration_ms=12.5,
        ttft_ms=3.25,
        replica_id="qwen/0",
        stream=True,
        endpoint="/v1/images/generations",
    )
    await store.insert_usage([row])
    assert await store.get_usage("req_1") == row
    assert await store.list_usage() == [row]


def random_rows(
    rng: random.Random, count: int, *, start: float = T0, hours: int = 48
) -> list[UsageRow]:
    """Rows over ``hours`` hours (two days), several keys, tree places and (served) models."""
    places = [
        ("key_a", "proj_a", "team_a", "org_a"),
        ("key_b", "proj_a", "team_a", "org_a"),
        ("key_c", "proj_b", "team_a", "org_a"),
        ("key_d", "proj_c", "team_c", "org_c"),
        ("key_old", "", "", ""),
    ]
    rows = []
    for i in range(count):
        key, project, team, org = rng.choice(places)
        model = rng.choice(["gemma", "qwen", "llama"])
        rows.append(
            usage(
                f"req_{i:05d}",
                start
                + rng.choice(
                    [0.0, 0.25, rng.uniform(0, hours * HOUR), float(rng.randrange(hours)) * HOUR]
                ),
                key=key,
                project=project,
                team=team,
                org=org,
                model=model,
                served=rng.choice(["", "", model, "gemma-small"]),
                prompt=rng.randrange(0, 5_000),
                cached=rng.randrange(0, 100),
                completion=rng.randrange(0, 2_000),
                cost=rng.randrange(0, 50_000),
                status=rng.choice([200, 200, 200, 429, 502]),
            )
        )
    return rows


def expected_spend(rows: Iterable[UsageRow], since: float) -> dict[str, int]:
    spend: dict[str, int] = defaultdict(int)
    for r in rows:
        if r.created_at < since:
            continue
        for scope, id in (
            ("key", r.key_id),
            ("project", r.project_id),
            ("team", r.team_id),
            ("org", r.org_id),
        ):
            if id:
                spend[f"{scope}:{id}"] += r.cost_micros
    return dict(spend)


def group_of(row: UsageRow, by: SummaryBy) -> str:
    if by == "key":
        return row.key_id
    if by == "project":
        return row.project_id
    if by == "team":
        return row.team_id
    if by == "org":
        return row.org_id
    return row.served_model or row.model


def expected_summary(rows: Iterable[UsageRow], by: SummaryBy) -> list[UsageSummary]:
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    for r in rows:
        s = sums[group_of(r, by)]
        s[0] += 1
        s[1] += r.prompt_tokens
        s[2] += r.cached_tokens
        s[3] += r.completion_tokens
        s[4] += r.cost_micros
        s[5] += r.status >= 400
    summaries = [
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
    return sorted(summaries, key=lambda u: (-u.cost_micros, u.group))


async def insert_in_batches_with_retries(
    store: Store, rows: list[UsageRow], rng: random.Random
) -> None:
    """Write ``rows`` in batches, re-sending some batches and repeating some ids."""
    sent = 0
    while sent < len(rows):
        size = rng.randrange(1, 60)
        batch = rows[sent : sent + size]
        if sent and rng.random() < 0.3:
            # A retried batch overlapping what was already written, with a
            # changed copy of an old row: neither may count twice.
            old = rows[rng.randrange(sent)]
            batch = [*rows[max(0, sent - 5) : sent], attrs.evolve(old, cost_micros=999_999), *batch]
        if rng.random() < 0.2:
            batch = batch + batch[:2]
        await store.insert_usage(batch)
        sent += size


async def test_roll_ups_match_the_raw_rows_after_batches_with_repeated_request_ids(
    store: Store,
) -> None:
    rng = random.Random(20260101)
    rows = random_rows(rng, 600)
    await insert_in_batches_with_retries(store, rows, rng)
    await store.insert_usage(rows[:100])  # a whole batch sent again
    for by in get_args(SummaryBy):
        assert await store.usage_summary(by, since=0.0) == expected_summary(rows, by), by
    assert await store.spend_since_by_scope(0.0) == expected_spend(rows, 0.0)


async def test_spend_since_is_exact_per_scope_wherever_since_falls(store: Store) -> None:
    rng = random.Random(7)
    rows = random_rows(rng, 400)
    # Rows right at and around an hour boundary and a mid-hour since.
    for i, offset in enumerate([-0.001, 0.0, 0.001, 1799.999, 1800.0, 1800.001, 3599.999]):
        rows.append(usage(f"edge_{i}", T0 + 5 * HOUR + offset, cost=1_000 + i))
    await insert_in_batches_with_retries(store, rows, rng)
    sinces = [
        0.0,
        T0,
        T0 + 5 * HOUR,  # a whole hour
        T0 + 5 * HOUR + 1800.0,  # mid-hour, on a row's time
        T0 + 5 * HOUR + 0.0005,  # between two rows just after the hour
        T0 + 5 * HOUR - 0.0005,
        T0 + 24 * HOUR + 123.456,
        T0 + 72 * HOUR,  # after everything
        *(T0 + rng.uniform(0, 48 * HOUR) for _ in range(20)),
    ]
    for since in sinces:
        assert await store.spend_since_by_scope(since) == expected_spend(rows, since), since


async def test_spend_counts_keys_without_a_project_under_their_key_only(store: Store) -> None:
    await store.insert_usage(
        [
            usage("r1", T0, key="key_old", project="", team="", org="", cost=70),
            usage("r2", T0 + 1, cost=30),
        ]
    )
    assert await store.spend_since_by_scope(T0) == {
        "key:key_old": 70,
        "key:key_a": 30,
        "project:proj_a": 30,
        "team:team_a": 30,
        "org:org_a": 30,
    }


async def test_spend_since_with_no_usage_is_empty(store: Store) -> None:
    assert await store.spend_since_by_scope(T0) == {}


@pytest.mark.parametrize("by", get_args(SummaryBy))
async def test_usage_is_summed_by_each_dimension_over_the_hours_asked(
    store: Store, by: SummaryBy
) -> None:
    rng = random.Random(3)
    rows = random_rows(rng, 300)
    await store.insert_usage(rows)
    since, until = T0 + 6 * HOUR, T0 + 30 * HOUR
    inside = [r for r in rows if since <= r.created_at < until]
    assert await store.usage_summary(by, since, until) == expected_summary(inside, by)
    after = [r for r in rows if r.created_at >= since]
    assert await store.usage_summary(by, since) == expected_summary(after, by)


async def test_a_summary_is_exact_wherever_the_range_begins_and_ends(store: Store) -> None:
    await store.insert_usage(
        [
            usage("a", T0 + 10.0, cost=1),
            usage("b", T0 + 3599.0, cost=2),
            usage("c", T0 + HOUR, cost=4),
            usage("d", T0 + 2 * HOUR + 1800.0, cost=8),
            usage("e", T0 + 26 * HOUR + 5.0, cost=16),
        ]
    )

    async def cost(since: float, until: float | None) -> int:
        return sum(s.cost_micros for s in await store.usage_summary("key", since, until))

    assert await cost(T0 + 1800.0, None) == 30  # the part of an hour after since
    assert await cost(T0, T0 + HOUR) == 3
    assert await cost(T0, T0 + 2 * HOUR) == 7
    assert await cost(T0, T0 + 2 * HOUR + 1.0) == 7  # the part of the last hour before until
    assert await cost(T0, T0 + 2 * HOUR + 1800.5) == 15
    assert await cost(T0 + 20.0, T0 + 3599.0) == 0  # both ends in one hour
    assert await cost(T0 + 5.0, T0 + 3599.5) == 3
    assert await cost(T0 + 3 * HOUR, None) == 16
    assert await cost(T0 + 27 * HOUR, None) == 0
    assert await cost(T0 + HOUR, T0 + HOUR) == 0  # an empty range


async def test_sums_over_many_months_are_exact_for_any_range(store: Store) -> None:
    """Whole months, days and hours (roll-ups) and partial hours (raw rows) meet exactly."""
    rng = random.Random(13)
    rows = random_rows(rng, 700, start=T0 - 40 * DAY, hours=24 * 120)
    await store.insert_usage(rows)
    feb, mar = T0 + 31 * DAY, T0 + 59 * DAY  # 2026-02-01, 2026-03-01
    bounds = [T0 - 40 * DAY, T0, feb, mar, mar - 0.5, feb + 7 * HOUR + 0.25, T0 + 75 * DAY]
    bounds += [T0 + rng.uniform(-40 * DAY, 80 * DAY) for _ in range(6)]
    for since in bounds:
        for until in [None, *bounds]:
            if until is not None and until < since:
                continue
            inside = [
                r for r in rows if since <= r.created_at and (until is None or r.created_at < until)
            ]
            assert await store.usage_summary("team", since, until) == expected_summary(
                inside, "team"
            ), (since, until)
        assert await store.spend_since_by_scope(since) == expected_spend(rows, since), since


async def test_sums_over_many_days_are_exact_for_any_range(store: Store) -> None:
    """Whole days (daily roll-ups), whole hours and partial hours (raw rows) meet exactly."""
    rng = random.Random(11)
    rows = random_rows(rng, 800, hours=24 * 9)
    await insert_in_batches_with_retries(store, rows, rng)
    bounds = [T0, T0 + 1.0, T0 + DAY, T0 + DAY - 0.5, T0 + 3 * DAY + 7 * HOUR]
    bounds += [T0 + rng.uniform(0, 10 * DAY) for _ in range(12)]
    for since in bounds:
        for until in [None, *bounds]:
            if until is not None and until < since:
                continue
            inside = [
                r for r in rows if since <= r.created_at and (until is None or r.created_at < until)
            ]
            for by in ("key", "model"):
                got = await store.usage_summary(by, since, until)
                assert got == expected_summary(inside, by), (since, until, by)
        assert await store.spend_since_by_scope(since) == expected_spend(rows, since), since


async def test_summary_groups_come_most_expensive_first_then_by_name(store: Store) -> None:
    await store.insert_usage(
        [
            usage("1", T0, key="key_b", cost=5),
            usage("2", T0, key="key_c", cost=9),
            usage("3", T0, key="key_a", cost=5),
            usage("4", T0 + 1, key="key_c", cost=0, status=502),
        ]
    )
    summary = await store.usage_summary("key", T0)
    assert [(s.group, s.cost_micros, s.requests) for s in summary] == [
        ("key_c", 9, 2),
        ("key_a", 5, 1),
        ("key_b", 5, 1),
    ]


async def test_a_summary_by_model_counts_the_model_that_answered(store: Store) -> None:
    await store.insert_usage(
        [
            usage("1", T0, model="big", served="small", cost=3),
            usage("2", T0, model="big", served="", cost=4),
            usage("3", T0, model="small", cost=5),
        ]
    )
    summary = await store.usage_summary("model", T0)
    assert [(s.group, s.requests, s.cost_micros) for s in summary] == [
        ("small", 2, 8),
        ("big", 1, 4),
    ]


async def test_a_summary_with_no_usage_is_empty(store: Store) -> None:
    assert await store.usage_summary("project", T0) == []


# --- retention ---------------------------------------------------------------


async def prune_all(store: Store, before: float, *, limit: int) -> int:
    """Prune in batches of ``limit`` until a batch comes back short; the rows deleted."""
    deleted = 0
    while True:
        batch = await store.prune_usage(before, limit=limit)
        assert 0 <= batch <= limit
        deleted += batch
        if batch < limit:
            return deleted


async def all_sums(store: Store, ranges: list[tuple[float, float | None]]) -> list[Any]:
    return [
        (
            [await store.usage_summary(by, since, until) for by in get_args(SummaryBy)],
            await store.spend_since_by_scope(since),
        )
        for since, until in ranges
    ]


async def test_pruning_rows_past_retention_keeps_the_sums_exact(store: Store) -> None:
    rng = random.Random(2027)
    rows = random_rows(rng, 900, hours=24 * 10)
    await insert_in_batches_with_retries(store, rows, rng)
    horizon = T0 + 4 * DAY + 5 * HOUR
    # Ranges whose ends are hour boundaries, or after the horizon: sums the
    # roll-ups and the kept raw rows can give exactly.
    ranges: list[tuple[float, float | None]] = [
        (0.0, None),
        (T0, T0 + 10 * DAY),
        (T0 + DAY, T0 + 4 * DAY + 2 * HOUR),
        (T0 + 3 * HOUR, horizon + 1800.5),
        (horizon + 0.25, None),
        (horizon + 2 * DAY + 99.0, horizon + 3 * DAY + 3 * HOUR + 7.0),
    ]
    before = await all_sums(store, ranges)
    for (since, until), (summaries, _) in zip(ranges, before, strict=True):
        inside = [
            r for r in rows if since <= r.created_at and (until is None or r.created_at < until)
        ]
        assert summaries[0] == expected_summary(inside, "key")

    # Mid-hour: floored to the hour. Small batches: many short transactions.
    deleted = await prune_all(store, horizon + 1234.5, limit=37)

    old = [r for r in rows if r.created_at < horizon]
    assert deleted == len({r.request_id for r in old}) > 37
    assert await store.usage_pruned_before() == horizon
    kept = await store.export_usage(0.0, None, limit=10_000)
    assert {r.request_id for r in kept} == {r.request_id for r in rows if r.created_at >= horizon}
    assert await all_sums(store, ranges) == before
    # Nothing is left to prune: nothing changes, the horizon stays.
    assert await store.prune_usage(horizon, limit=37) == 0
    assert await all_sums(store, ranges) == before


async def test_a_range_starting_mid_hour_before_the_horizon_counts_that_hour_whole(
    store: Store,
) -> None:
    await store.insert_usage(
        [
            usage("a", T0 + 10.0, cost=1),
            usage("b", T0 + 1900.0, cost=2),
            usage("c", T0 + 3 * HOUR + 10.0, cost=4),
            usage("d", T0 + 3 * HOUR + 1900.0, cost=8),
        ]
    )
    assert await store.prune_usage(T0 + 2 * HOUR) == 2

    async def cost(since: float, until: float | None) -> int:
        return sum(s.cost_micros for s in await store.usage_summary("key", since, until))

    # The raw rows of the first hour are gone: its roll-up counts whole.
    assert await cost(T0 + 1800.0, None) == 15
    assert await cost(T0, T0 + 1800.0) == 3
    assert await store.spend_since_by_scope(T0 + 1800.0) == expected_spend(
        [usage("x", T0, cost=15)], 0.0
    )
    # Past the horizon the raw rows are there: exact.
    assert await cost(T0 + 3 * HOUR + 1800.0, None) == 8
    assert await cost(T0 + 3 * HOUR, T0 + 3 * HOUR + 1800.0) == 4


async def test_a_batch_replayed_after_pruning_is_not_counted_twice(store: Store) -> None:
    """The journal may replay rows already stored, some of them since pruned."""
    rng = random.Random(5)
    rows = random_rows(rng, 400, hours=24 * 4)
    await insert_in_batches_with_retries(store, rows, rng)
    horizon = T0 + 2 * DAY
    await prune_all(store, horizon, limit=50)
    ranges: list[tuple[float, float | None]] = [(0.0, None), (T0 + DAY, T0 + 3 * DAY)]
    before = await all_sums(store, ranges)

    await store.insert_usage(rows)  # every row again, pruned ones included
    await insert_in_batches_with_retries(store, rows, rng)

    assert await all_sums(store, ranges) == before
    kept = await store.export_usage(0.0, None, limit=10_000)
    assert {r.request_id for r in kept} == {r.request_id for r in rows if r.created_at >= horizon}
    # A new row older than the horizon is refused as well (it cannot be told
    # from a pruned one); a new row after it is counted.
    late_new = usage("late_new", T0 + 3 * DAY)
    await store.insert_usage([usage("late_old", T0 + 5.0, cost=7), late_new])
    assert await store.get_usage("late_old") is None
    assert await store.get_usage("late_new") == late_new
    assert await store.usage_summary("key", 0.0) == expected_summary([*rows, late_new], "key")


async def test_a_batch_wholly_older_than_the_horizon_writes_nothing_and_says_so(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    await store.insert_usage([usage("old", T0 + 5.0), usage("new", T0 + 2 * DAY)])
    await prune_all(store, T0 + DAY, limit=50)
    with caplog.at_level(logging.WARNING, logger="llmgw.store"):
        await store.insert_usage([usage("late_old", T0 + 6.0, cost=7)])
    assert await store.get_usage("late_old") is None
    assert "1 usage row(s) older than the pruning horizon" in caplog.text


async def test_the_pruning_horizon_only_moves_forward(store: Store) -> None:
    assert await store.usage_pruned_before() is None
    assert await store.prune_usage(T0 + DAY) == 0  # nothing that old: nothing written
    assert await store.usage_pruned_before() is None
    await store.insert_usage([usage("a", T0 + 10.0), usage("b", T0 + 2 * DAY)])
    assert await store.prune_usage(T0 + DAY + 0.5) == 1
    assert await store.usage_pruned_before() == T0 + DAY
    await store.insert_usage([usage("c", T0 + DAY + 10.0)])
    assert await store.prune_usage(T0 + 20.0) == 0  # an earlier time
    assert await store.usage_pruned_before() == T0 + DAY
    assert await store.get_usage("c") is not None


async def test_pruning_with_a_batch_below_one_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="limit"):
        await store.prune_usage(T0, limit=0)


# --- export ------------------------------------------------------------------


async def export_all(
    store: Store, since: float, until: float | None, *, limit: int
) -> list[UsageRow]:
    exported: list[UsageRow] = []
    after = ""
    while True:
        page = await store.export_usage(since, until, after_request_id=after, limit=limit)
        assert len(page) <= limit
        exported.extend(page)
        if len(page) < limit:
            return exported
        after = page[-1].request_id


@pytest.mark.parametrize("limit", [1, 7, 100, 1000])
async def test_exporting_page_by_page_returns_every_row_once_in_order(
    store: Store, limit: int
) -> None:
    rng = random.Random(limit)
    rows = random_rows(rng, 250)  # many share a time: ties go by request id
    shuffled = rows[:]
    rng.shuffle(shuffled)
    await store.insert_usage(shuffled)
    ordered = sorted(rows, key=lambda r: (r.created_at, r.request_id))
    assert await export_all(store, 0.0, None, limit=limit) == ordered
    since, until = T0 + 3 * HOUR, T0 + 20 * HOUR
    assert await export_all(store, since, until, limit=limit) == [
        r for r in ordered if since <= r.created_at < until
    ]


async def test_an_export_page_is_limited_and_resumes_after_the_given_row(store: Store) -> None:
    rows = [usage(f"r{i}", T0 + i // 2) for i in range(6)]
    await store.insert_usage(rows)
    first = await store.export_usage(T0, None, limit=3)
    assert [r.request_id for r in first] == ["r0", "r1", "r2"]
    second = await store.export_usage(T0, None, after_request_id="r2", limit=3)
    assert [r.request_id for r in second] == ["r3", "r4", "r5"]
    assert await store.export_usage(T0, None, after_request_id="r5", limit=3) == []
    assert await store.export_usage(T0, None, limit=0) == []


async def test_exporting_after_an_unknown_request_id_is_refused(store: Store) -> None:
    await store.insert_usage([usage("r1", T0)])
    with pytest.raises(ValueError, match="names no stored usage row"):
        await store.export_usage(T0, None, after_request_id="r_missing")


# --- a store that cannot write ------------------------------------------------


async def test_a_usage_write_blocked_by_another_process_fails_in_bounded_time_then_works(
    store: Store, hold_write_lock: Callable[[], AbstractContextManager[None]]
) -> None:
    await store.insert_usage([usage("before", T0, cost=1)])
    with hold_write_lock():
        started = time.monotonic()
        with pytest.raises(StoreError):
            await store.insert_usage([usage("during", T0 + 1, cost=2)])
        assert time.monotonic() - started <= 10.0
        # Reads go on meanwhile (the gateway still looks keys up).
        assert await store.get_usage("before") is not None
    # The lock is gone: the same batch, sent again, lands once.
    await store.insert_usage([usage("during", T0 + 1, cost=2)])
    await store.insert_usage([usage("during", T0 + 1, cost=2)])
    assert await store.spend_since_by_scope(T0) == {
        "key:key_a": 3,
        "project:proj_a": 3,
        "team:team_a": 3,
        "org:org_a": 3,
    }


async def test_keys_last_used_is_the_later_of_the_stored_use_and_the_newest_row(
    store: Store,
) -> None:
    await store.insert_key(make_key(1))
    await store.insert_key(make_key(2, last_used_at=T0 + 900.0))
    await store.insert_key(make_key(3))
    await store.insert_key(make_key(4, last_used_at=T0 + 50.0))
    await store.insert_usage(
        [
            usage("r1", T0 + 100.0, key="key_1"),
            usage("r2", T0 + 300.0, key="key_1"),
            usage("r3", T0 + 200.0, key="key_1"),
            usage("r4", T0 + 500.0, key="key_2"),
            usage("r5", T0 + 400.0, key="key_4"),
            usage("r6", T0 + 999.0, key="key_unknown"),
        ]
    )
    assert await store.keys_last_used() == {
        "key_1": T0 + 300.0,
        "key_2": T0 + 900.0,
        "key_4": T0 + 400.0,
    }

"""The store contract for people, memberships and sessions (docs/portal.md).

Every test takes the parametrised ``store`` fixture, so it runs on SQLite
and PostgreSQL.
"""

from __future__ import annotations

import attrs
import pytest

from llmgw.store import Conflict, KeyRecord, Membership, Person, SessionRecord, Store, UsageRow


def _person(email: str = "Ada@Example.com", id: str = "person_1") -> Person:
    return Person(id=id, email=email, name="Ada", password_hash="$argon2id$x", created_at=5.0)


async def test_a_person_is_kept_with_a_lower_cased_address_and_found_in_any_case(
    store: Store,
) -> None:
    await store.insert_person(_person())
    found = await store.find_person("ADA@example.COM")
    assert found == attrs.evolve(_person(), email="ada@example.com")
    assert await store.get_person("person_1") == found
    assert await store.find_person("bob@example.com") is None
    assert await store.get_person("person_2") is None


async def test_an_address_or_id_taken_is_a_conflict(store: Store) -> None:
    await store.insert_person(_person())
    with pytest.raises(Conflict):
        await store.insert_person(_person(id="person_2", email="ada@example.com"))
    with pytest.raises(Conflict):
        await store.insert_person(_person(email="bob@example.com"))
    assert [p.email for p in await store.list_people()] == ["ada@example.com"]


async def test_updating_a_person_changes_state_role_and_password(store: Store) -> None:
    await store.insert_person(_person())
    changed = attrs.evolve(
        _person(email="ada@example.com"),
        state="suspended",
        staff_role="viewer",
        password_hash="$argon2id$y",
    )
    assert await store.update_person(changed)
    assert await store.get_person("person_1") == changed
    assert not await store.update_person(attrs.evolve(changed, id="person_9"))


async def test_memberships_are_added_changed_listed_and_removed(store: Store) -> None:
    await store.insert_person(_person())
    await store.insert_person(_person(id="person_2", email="bob@example.com"))
    path, _ = await store.ensure_project("Acme", "ml", "train", now=1.0)
    await store.put_membership(
        Membership(person_id="person_1", scope="project", scope_id=path.project.id)
    )
    await store.put_membership(Membership(person_id="person_2", scope="org", scope_id=path.org.id))
    await store.put_membership(
        Membership(person_id="person_1", scope="project", scope_id=path.project.id, role="manager")
    )
    assert await store.list_memberships("person_1") == [
        Membership(person_id="person_1", scope="project", scope_id=path.project.id, role="manager")
    ]
    assert len(await store.list_memberships()) == 2
    assert await store.delete_membership("person_1", "project", path.project.id)
    assert not await store.delete_membership("person_1", "project", path.project.id)
    assert await store.list_memberships("person_1") == []


async def test_sessions_are_kept_by_hash_and_end_one_or_all(store: Store) -> None:
    await store.insert_person(_person())
    one = SessionRecord(token_hash="h1", person_id="person_1", created_at=1.0, expires_at=9.0)
    two = attrs.evolve(one, token_hash="h2", client="10.0.0.2")
    await store.insert_session(one)
    await store.insert_session(two)
    with pytest.raises(Conflict):
        await store.insert_session(one)
    assert await store.get_session("h2") == two
    assert await store.delete_session("h1")
    assert not await store.delete_session("h1")
    assert await store.get_session("h1") is None
    assert await store.delete_sessions("person_1") == 1
    assert await store.get_session("h2") is None


async def test_deleting_a_person_ends_their_sessions_and_memberships_but_keeps_keys(
    store: Store,
) -> None:
    await store.insert_person(_person())
    path, _ = await store.ensure_project("Acme", "ml", "train", now=1.0)
    await store.put_membership(
        Membership(person_id="person_1", scope="project", scope_id=path.project.id)
    )
    await store.insert_session(
        SessionRecord(token_hash="h1", person_id="person_1", created_at=1.0, expires_at=9.0)
    )
    key = KeyRecord(
        id="key_1", name="k", key_hash="kh", prefix="sk", created_at=1.0, owner="ada@example.com"
    )
    await store.insert_key(key)
    assert await store.delete_person("person_1")
    assert not await store.delete_person("person_1")
    assert await store.get_session("h1") is None
    assert await store.list_memberships() == []
    assert await store.get_key("key_1") == key


async def test_forgetting_a_person_erases_them_and_hands_their_keys_to_an_anonymous_id(
    store: Store,
) -> None:
    await store.insert_person(_person())
    await store.insert_session(
        SessionRecord(token_hash="h1", person_id="person_1", created_at=1.0, expires_at=9.0)
    )
    live = KeyRecord(
        id="key_1", name="k", key_hash="kh1", prefix="sk", created_at=1.0, owner="ada@example.com"
    )
    revoked = attrs.evolve(live, id="key_2", key_hash="kh2", revoked_at=2.0)
    other = attrs.evolve(live, id="key_3", key_hash="kh3", owner="bob@example.com")
    for key in (live, revoked, other):
        await store.insert_key(key)
    assert await store.forget_person("person_1", "forgotten-1", at=7.0)
    assert not await store.forget_person("person_1", "forgotten-1", at=7.0)
    assert await store.find_person("ada@example.com") is None
    assert await store.get_session("h1") is None
    assert await store.get_key("key_1") == attrs.evolve(live, owner="forgotten-1", revoked_at=7.0)
    assert await store.get_key("key_2") == attrs.evolve(revoked, owner="forgotten-1")
    assert await store.get_key("key_3") == other
    assert all("ada" not in k.owner for k in await store.list_keys())


async def test_usage_of_some_keys_or_one_project_newest_first_cut_then_oldest_first(
    store: Store,
) -> None:
    def row(n: int, key: str, project: str, at: float) -> UsageRow:
        return UsageRow(
            request_id=f"req_{n}",
            created_at=at,
            key_id=key,
            model="m",
            status=200,
            prompt_tokens=n,
            completion_tokens=2 * n,
            project_id=project,
            cost_micros=10 * n,
        )

    await store.insert_usage(
        [
            row(1, "key_a", "p1", 1000.0),
            row(2, "key_b", "p1", 2000.0),
            row(3, "key_a", "p2", 3000.0),
            row(4, "key_c", "p2", 4000.0),
            row(5, "key_a", "p1", 500.0),
        ]
    )
    mine = await store.usage_of(900.0, key_ids=["key_a", "key_c"])
    assert [r.request_id for r in mine] == ["req_1", "req_3", "req_4"]
    assert (mine[0].prompt_tokens, mine[0].completion_tokens, mine[0].cost_micros) == (1, 2, 10)
    assert mine[0].project_id == "p1"
    assert mine[0].created_at == 1000.0
    assert [r.request_id for r in await store.usage_of(0.0, project_id="p1")] == [
        "req_5",
        "req_1",
        "req_2",
    ]
    assert [r.request_id for r in await store.usage_of(0.0, key_ids=["key_a"], limit=2)] == [
        "req_1",
        "req_3",
    ]
    assert await store.usage_of(0.0, key_ids=[]) == []
    with pytest.raises(ValueError, match="key_ids or a project_id"):
        await store.usage_of(0.0)

"""People on the admin API and the sign-in rules behind them
(:mod:`llmgw.admin.people`, :mod:`llmgw.auth.people`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import trio

from llmgw.auth.keys import hash_key
from llmgw.auth.people import (
    CLIENT_FAILURES,
    PAIR_FAILURES,
    People,
    SignInRefused,
    TooManyAttempts,
)
from llmgw.cli.options import path_part

if TYPE_CHECKING:
    from tests.admin.conftest import Admin


async def test_join_makes_an_account_in_a_project_with_a_password_shown_once(admin: Admin) -> None:
    status, doc = await admin.call(
        "POST", "/api/v1/people", {"email": "Ada@Example.com", "project": "Acme/ml/train"}
    )
    assert status == 201, doc
    assert doc["email"] == "ada@example.com"
    assert doc["state"] == "active"
    assert doc["role"] == ""
    assert doc["memberships"] == [
        {
            "scope": "project",
            "id": doc["memberships"][0]["id"],
            "path": "Acme/ml/train",
            "role": "member",
        }
    ]
    assert len(doc["password"]) >= 10
    person = await admin.store.find_person("ada@example.com")
    assert person is not None
    assert person.password_hash.startswith("$argon2id$")
    assert doc["password"] not in person.password_hash
    status, listed = await admin.call("GET", "/api/v1/people")
    assert status == 200
    assert [p["email"] for p in listed["data"]] == ["ada@example.com"]
    assert "password" not in listed["data"][0]
    assert "password_hash" not in listed["data"][0]


async def test_bad_input_is_refused_in_the_api_shape(admin: Admin) -> None:
    status, doc = await admin.call("POST", "/api/v1/people", {"email": "nobody"})
    assert status == 400
    assert "sign-in address" in doc["error"]["message"]
    status, doc = await admin.call("POST", "/api/v1/people", {"email": "a@b.c", "role": "king"})
    assert status == 400
    assert "viewer" in doc["error"]["message"]
    status, doc = await admin.call(
        "POST", "/api/v1/people", {"email": "a@b.c", "password": "short"}
    )
    assert status == 400
    assert await admin.store.list_people() == []
    await admin.call("POST", "/api/v1/people", {"email": "a@b.c"})
    status, doc = await admin.call("POST", "/api/v1/people", {"email": "A@b.c"})
    assert status == 409
    assert doc["error"]["code"] == "person_exists"
    status, doc = await admin.call("POST", "/api/v1/people/nobody@x.y/suspend")
    assert status == 404


async def test_role_suspend_reinstate_password_delete_and_forget(admin: Admin) -> None:
    await admin.call("POST", "/api/v1/people", {"email": "ada@example.com", "password": "p" * 12})
    status, doc = await admin.call(
        "POST", "/api/v1/people/ada@example.com/role", {"role": "viewer"}
    )
    assert (status, doc["role"]) == (200, "viewer")
    status, doc = await admin.call("POST", "/api/v1/people/ada@example.com/suspend")
    assert doc["state"] == "suspended"
    status, doc = await admin.call("POST", "/api/v1/people/ada@example.com/reinstate")
    assert doc["state"] == "active"
    status, doc = await admin.call("POST", "/api/v1/people/ada@example.com/password", {})
    assert status == 200
    assert len(doc["password"]) >= 10
    status, doc = await admin.call(
        "POST", "/api/v1/keys", {"name": "mine", "person": "ada@example.com"}
    )
    assert status == 201
    key_id = doc["id"]
    status, doc = await admin.call("POST", "/api/v1/people/ada@example.com/forget")
    assert status == 200
    assert doc["anonymous_id"].startswith("forgotten-")
    key = await admin.store.get_key(key_id)
    assert key is not None
    assert key.owner == doc["anonymous_id"]
    assert key.revoked_at is not None
    assert await admin.store.list_people() == []
    await admin.call("POST", "/api/v1/people", {"email": "bob@example.com"})
    status, doc = await admin.call("DELETE", "/api/v1/people/bob@example.com")
    assert (status, doc["deleted"]) == (200, True)


async def test_sign_in_sessions_and_their_end(admin: Admin) -> None:
    people = People(admin.store, b"k" * 32)
    person, password = await people.join("ada@example.com")
    _, token = await people.sign_in("ADA@example.com", password, "10.0.0.1")
    signed = await people.session(token)
    assert signed is not None
    assert signed.person.id == person.id
    assert people.check_csrf(token, people.csrf_token(token))
    assert not people.check_csrf(token, "")
    assert not people.check_csrf(token, people.csrf_token(token + "x"))
    chat, _ = await people.ensure_chat_key(signed, token)
    await people.set_state(person.id, "suspended")
    assert await people.session(token) is None
    chat_key = await admin.store.find_key_by_hash(hash_key(chat))
    assert chat_key is not None
    assert chat_key.revoked_at is not None
    await people.set_state(person.id, "active")
    assert await people.session(token) is None  # reinstating does not revive a session
    _, token = await people.sign_in("ada@example.com", password, "10.0.0.1")
    await people.set_password(person.id, "q" * 12)
    assert await people.session(token) is None
    _, token = await people.sign_in("ada@example.com", "q" * 12, "10.0.0.1")
    await people.sign_out(token)
    assert await people.session(token) is None


async def test_failures_lock_the_client_out_not_the_owner_elsewhere(admin: Admin) -> None:
    people = People(admin.store, b"k" * 32)
    _, password = await people.join("ada@example.com")
    refusals = []
    for _ in range(10):
        with pytest.raises((SignInRefused, TooManyAttempts)) as info:
            await people.sign_in("ada@example.com", "wrong password", "203.0.113.9")
        refusals.append(type(info.value))
    assert TooManyAttempts in refusals
    with pytest.raises(TooManyAttempts):
        await people.sign_in("ada@example.com", password, "203.0.113.9")
    _, token = await people.sign_in("ada@example.com", password, "10.0.0.1")
    assert await people.session(token) is not None
    with pytest.raises(SignInRefused):
        await people.sign_in("nobody@example.com", password, "10.0.0.1")


class _CountingPeople(People):
    """Counts the password verifications that really run (a unit seam)."""

    verified = 0

    async def _verify(self, stored: str, password: str) -> bool:
        self.verified += 1
        return await super()._verify(stored, password)


@pytest.mark.parametrize(
    ("addresses", "limit"), [(1, PAIR_FAILURES), (40, CLIENT_FAILURES)], ids=["pair", "client"]
)
async def test_parallel_wrong_sign_ins_verify_at_most_the_limit(
    admin: Admin, addresses: int, limit: int
) -> None:
    people = _CountingPeople(admin.store, b"k" * 32)
    await people.join("ada@example.com")
    outcomes: list[type[BaseException]] = []

    async def attempt(i: int) -> None:
        email = "ada@example.com" if addresses == 1 else f"u{i}@example.com"
        try:
            await people.sign_in(email, "wrong password", "203.0.113.9")
        except (SignInRefused, TooManyAttempts) as refusal:
            outcomes.append(type(refusal))

    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(attempt, i)
    assert len(outcomes) == 40
    assert people.verified <= limit
    assert outcomes.count(SignInRefused) == limit
    assert outcomes.count(TooManyAttempts) == 40 - limit


async def test_an_address_that_cannot_name_a_path_segment_is_refused_at_join(
    admin: Admin,
) -> None:
    for bad in ("a/b@x.io", "a\\b@x.io", "a\x01b@x.io"):
        status, doc = await admin.call("POST", "/api/v1/people", {"email": bad})
        assert status == 400, (bad, doc)
        assert "cannot hold '/'" in doc["error"]["message"]
    assert await admin.store.list_people() == []


@pytest.mark.parametrize("who", ["a?b@x.io", "a#b@x.io", "<a>@x.io", "a%b@x.io", "a+b@x.io"])
async def test_an_address_with_url_characters_is_managed_through_the_quoted_path(
    admin: Admin, who: str
) -> None:
    status, doc = await admin.call("POST", "/api/v1/people", {"email": who})
    assert status == 201, doc
    status, doc = await admin.call(
        "POST", f"/api/v1/people/{path_part(who)}/role", {"role": "viewer"}
    )
    assert (status, doc.get("email"), doc.get("role")) == (200, who, "viewer"), doc
    status, doc = await admin.call("DELETE", f"/api/v1/people/{path_part(who)}")
    assert (status, doc.get("deleted")) == (200, True), doc


async def test_approve_refuses_a_suspended_account_and_says_reinstate(admin: Admin) -> None:
    await admin.call("POST", "/api/v1/people", {"email": "ada@example.com"})
    await admin.call("POST", "/api/v1/people", {"email": "bob@example.com", "state": "awaiting"})
    status, doc = await admin.call("POST", "/api/v1/people/bob@example.com/approve")
    assert (status, doc["state"]) == (200, "active")
    await admin.call("POST", "/api/v1/people/ada@example.com/suspend")
    status, doc = await admin.call("POST", "/api/v1/people/ada@example.com/approve")
    assert status == 409, doc
    assert doc["error"]["code"] == "wrong_state"
    assert "reinstate" in doc["error"]["message"]
    person = await admin.store.find_person("ada@example.com")
    assert person is not None
    assert person.state == "suspended"


async def test_the_last_active_admin_cannot_be_suspended_demoted_deleted_or_forgotten(
    admin: Admin,
) -> None:
    await admin.call("POST", "/api/v1/people", {"email": "root@example.com", "role": "admin"})
    for method, path, body in [
        ("POST", "/api/v1/people/root@example.com/suspend", None),
        ("POST", "/api/v1/people/root@example.com/role", {"role": "viewer"}),
        ("DELETE", "/api/v1/people/root@example.com", None),
        ("POST", "/api/v1/people/root@example.com/forget", None),
    ]:
        status, doc = await admin.call(method, path, body)
        assert status == 409, (path, doc)
        assert doc["error"]["code"] == "last_admin"
        assert "the last admin" in doc["error"]["message"]
    person = await admin.store.find_person("root@example.com")
    assert person is not None
    assert (person.state, person.staff_role) == ("active", "admin")
    # A suspended admin does not count: with another active one, it may go.
    await admin.call("POST", "/api/v1/people", {"email": "two@example.com", "role": "admin"})
    await admin.call("POST", "/api/v1/people/two@example.com/suspend")
    status, _ = await admin.call("POST", "/api/v1/people/root@example.com/suspend")
    assert status == 409
    await admin.call("POST", "/api/v1/people/two@example.com/reinstate")
    status, doc = await admin.call("POST", "/api/v1/people/root@example.com/role", {"role": ""})
    assert (status, doc["role"]) == (200, "")
    status, doc = await admin.call("DELETE", "/api/v1/people/two@example.com")
    assert status == 409, doc

"""The portal app in-process (quart's test client, a real SQLite store):
sign-in, CSRF, sessions ending, ids of others refused, forms by staff role,
hashed static files (:mod:`llmgw.portal.app`). The same rules against a
running ``llmgw up`` are in ``tests/e2e/test_portal_security.py``."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from quart_trio import QuartTrio

from llmgw.accounting.accountant import Accountant, ModelNotAllowed
from llmgw.accounting.prices import PriceBook
from llmgw.admin.keys import KeysService
from llmgw.auth.keys import KeyAuthenticator, hash_key
from llmgw.auth.people import People
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster
from llmgw.portal.app import make_portal_app
from llmgw.portal.assets import ASSETS, asset_url
from llmgw.settings import AuthSettings
from llmgw.store import Membership, ModelRecord, Store, UsageRow, open_sqlite_store
from llmgw.store.records import Limits


@attrs.define
class Site:
    app: QuartTrio
    store: Store
    people: People
    cluster: Cluster

    def client(self) -> Any:
        return self.app.test_client()


@pytest.fixture
async def site(tmp_path: Path) -> AsyncIterator[Site]:
    async with open_sqlite_store(tmp_path / "llmgw.db") as store:
        cluster = Cluster()
        cluster.set_secret(b"s" * 32)
        authenticator = KeyAuthenticator(store)
        keys = KeysService(
            store,
            authenticator,
            ScopeResolver(store),
            AuthSettings(),
            bands=lambda: [band.name for band in cluster.settings.router.admission.bands],
        )
        people = People(store, b"p" * 32, authenticator)
        app = make_portal_app(
            store,
            cluster,
            people,
            keys,
            resolver=ScopeResolver(store, cache_ttl_s=0.0),
            accountant=Accountant(PriceBook({})),
        )
        yield Site(app, store, people, cluster)


def _hidden(text: str, name: str = "csrf") -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', text)
    assert found is not None, text
    return found.group(1)


async def _sign_in(client: Any, email: str, password: str) -> Any:
    page = await client.get("/portal/sign-in")
    token = _hidden(await page.get_data(as_text=True))
    return await client.post(
        "/portal/sign-in", form={"csrf": token, "email": email, "password": password}
    )


async def test_pages_need_a_session_and_sign_in_sets_a_safe_cookie(site: Site) -> None:
    client = site.client()
    first = await client.get("/portal/keys")
    assert first.status_code == 303
    assert first.headers["location"] == "/portal/sign-in?next=/portal/keys"
    await site.people.join("ada@example.com", password="ada password")
    signed = await _sign_in(client, "ada@example.com", "ada password")
    assert signed.status_code == 303
    cookie = signed.headers["set-cookie"]
    assert "llmgw_session=" in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=Lax" in cookie
    page = await client.get("/portal/keys")
    assert page.status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["cache-control"] == "no-store"


async def test_a_wrong_password_and_an_unknown_address_get_the_same_answer(site: Site) -> None:
    await site.people.join("ada@example.com", password="ada password")
    wrong = await _sign_in(site.client(), "ada@example.com", "not it at all")
    unknown = await _sign_in(site.client(), "zed@example.com", "not it at all")
    assert wrong.status_code == unknown.status_code == 401
    assert "Wrong address or password." in await wrong.get_data(as_text=True)
    assert "Wrong address or password." in await unknown.get_data(as_text=True)


async def test_a_post_without_the_sessions_csrf_token_changes_nothing(site: Site) -> None:
    await site.people.join("ada@example.com", password="ada password")
    client = site.client()
    await _sign_in(client, "ada@example.com", "ada password")
    refused = await client.post("/portal/keys", form={"name": "k"})
    assert refused.status_code == 403
    refused = await client.post("/portal/keys", form={"name": "k", "csrf": "forged"})
    assert refused.status_code == 403
    assert await site.store.list_keys() == []
    token = _hidden(await (await client.get("/portal/keys")).get_data(as_text=True))
    made = await client.post("/portal/keys", form={"name": "k", "csrf": token})
    assert made.status_code == 200
    assert [k.owner for k in await site.store.list_keys()] == ["ada@example.com"]


async def test_another_persons_key_is_not_found_and_a_sign_out_ends_the_cookie(site: Site) -> None:
    await site.people.join("ada@example.com", password="ada password")
    await site.people.join("bob@example.com", password="bob password")
    ada, bob = site.client(), site.client()
    await _sign_in(ada, "ada@example.com", "ada password")
    await _sign_in(bob, "bob@example.com", "bob password")
    token = _hidden(await (await bob.get("/portal/keys")).get_data(as_text=True))
    await bob.post("/portal/keys", form={"name": "bob's", "csrf": token})
    [bobs] = await site.store.list_keys()
    ada_token = _hidden(await (await ada.get("/portal/keys")).get_data(as_text=True))
    assert (
        await ada.post(f"/portal/keys/{bobs.id}/revoke", form={"csrf": ada_token})
    ).status_code == 404
    assert (await site.store.list_keys())[0].revoked_at is None
    out = await ada.post("/portal/sign-out", form={"csrf": ada_token})
    assert out.status_code == 303
    assert (await ada.get("/portal/keys")).status_code == 303


async def test_admin_pages_render_only_the_forms_the_role_may_submit(site: Site) -> None:
    for email, role in (
        ("v@example.com", "viewer"),
        ("b@example.com", "billing"),
        ("a@example.com", "admin"),
    ):
        await site.people.join(email, password="a password", staff_role=role)
    await site.store.ensure_project("Acme", "ml", "train", now=1.0)

    async def forms(email: str, path: str) -> list[str]:
        client = site.client()
        await _sign_in(client, email, "a password")
        page = await client.get(path)
        assert page.status_code == 200, path
        actions = re.findall(r'<form[^>]*action="([^"]+)"', await page.get_data(as_text=True))
        return [a for a in actions if a != "/portal/sign-out"]

    for path in (
        "/admin",
        "/admin/people",
        "/admin/tree",
        "/admin/models",
        "/admin/nodes",
        "/admin/usage",
    ):
        assert await forms("v@example.com", path) == [], path
    assert await forms("b@example.com", "/admin/people") == []
    assert any(a.startswith("/admin/tree/") for a in await forms("b@example.com", "/admin/tree"))
    assert "/admin/people" in await forms("a@example.com", "/admin/people")
    viewer = site.client()
    await _sign_in(viewer, "v@example.com", "a password")
    token = _hidden(await (await viewer.get("/portal/keys")).get_data(as_text=True))
    refused = await viewer.post("/admin/people", form={"csrf": token, "email": "x@example.com"})
    assert refused.status_code == 403
    assert await site.store.find_person("x@example.com") is None


async def test_static_files_have_content_hash_names_and_a_long_life(site: Site) -> None:
    client = site.client()
    for name, found in ASSETS.items():
        url = asset_url(name)
        assert re.fullmatch(r"/static/portal\.[0-9a-f]{12}\.(css|js)", url)
        answer = await client.get(url)
        assert answer.status_code == 200
        assert await answer.get_data() == found.body
        assert "immutable" in answer.headers["cache-control"]
    assert (await client.get("/static/portal.css")).status_code == 404


@pytest.mark.parametrize(
    "target", ["https://evil.example/", "//evil.example/", "/\\evil", "javascript:x"]
)
async def test_sign_in_never_sends_the_browser_to_another_site(site: Site, target: str) -> None:
    await site.people.join("ada@example.com", password="ada password")
    client = site.client()
    page = await client.get("/portal/sign-in")
    token = _hidden(await page.get_data(as_text=True))
    signed = await client.post(
        "/portal/sign-in",
        form={
            "csrf": token,
            "email": "ada@example.com",
            "password": "ada password",
            "next": target,
        },
    )
    assert signed.status_code == 303
    assert signed.headers["location"] == "/portal/chat"


async def test_chat_and_models_list_only_the_models_the_chat_key_may_call(site: Site) -> None:
    """The project's models list (set at the org here) leaves ``other`` out:
    the pages do not list it and the session's chat key (in that project)
    is refused it by the gateway's own check."""
    site.cluster.replace_catalog(
        {n: ModelRecord.simple(n, "sim") for n in ("allowed-model", "other-model")}
    )
    path, _ = await site.store.ensure_project("Acme", "ml", "train", now=1.0)
    assert await site.store.set_limits("org", path.org.id, Limits(models=("allowed-model",)))
    person, _ = await site.people.join("ada@example.com", password="ada password")
    client = site.client()
    await _sign_in(client, "ada@example.com", "ada password")

    # Not yet a member: the chat key is personal, with no models list.
    # (A fresh sign-in below gives a fresh session and chat key.)
    before = await (await client.get("/portal/models")).get_data(as_text=True)
    assert "allowed-model" in before
    assert "other-model" in before

    await site.store.put_membership(
        Membership(person_id=person.id, scope="project", scope_id=path.project.id)
    )
    client = site.client()
    await _sign_in(client, "ada@example.com", "ada password")
    for page in ("/portal/chat", "/portal/models", "/portal/connect"):
        text = await (await client.get(page)).get_data(as_text=True)
        assert "allowed-model" in text, page
        assert "other-model" not in text, page
    chat = await (await client.get("/portal/chat")).get_data(as_text=True)
    found = re.search(r'data-key="([^"]+)"', chat)
    assert found is not None
    record = await site.store.find_key_by_hash(hash_key(found.group(1)))
    assert record is not None
    assert record.project_id == path.project.id
    levels, _ = await ScopeResolver(site.store).path(record)
    accountant = Accountant(PriceBook({}))
    assert accountant.allowed(levels, "allowed-model")
    with pytest.raises(ModelNotAllowed):
        accountant.check(levels, "other-model", 10, now=1.0)


async def test_tree_limits_form_refuses_bad_numbers_as_the_admin_api_does(site: Site) -> None:
    await site.people.join("b@example.com", password="a password", staff_role="billing")
    await site.store.ensure_project("Acme", "ml", "train", now=1.0)
    client = site.client()
    await _sign_in(client, "b@example.com", "a password")
    page = await (await client.get("/admin/tree")).get_data(as_text=True)
    token = _hidden(page)
    action = next(a for a in re.findall(r'action="([^"]+)"', page) if a.startswith("/admin/tree/"))
    for field, value in (("rpm", "abc"), ("tpm", "1e99"), ("rpm", "1" + "0" * 20), ("rpm", "-1")):
        answer = await client.post(action, form={"csrf": token, field: value})
        text = await answer.get_data(as_text=True)
        assert answer.status_code == 200, (field, value)
        assert "must be a whole number from 0 to 1,000,000,000,000" in text, (field, value)
        assert "invalid literal" not in text
    assert all(
        limits.rpm is None and limits.tpm is None
        for limits in [o.limits for o in await site.store.list_orgs()]
    )
    answer = await client.post(action, form={"csrf": token, "rpm": "60"})
    assert answer.status_code in (302, 303), await answer.get_data(as_text=True)


async def test_a_used_key_shows_its_last_use_like_the_admin_api(site: Site) -> None:
    """Regression: the Keys page read only the stored last use (never set),
    so a used key always said "never"."""
    client = site.app.test_client()
    await site.people.join("ada@example.com", password="ada password")
    await _sign_in(client, "ada@example.com", "ada password")
    token = _hidden(await (await client.get("/portal/keys")).get_data(as_text=True))
    await client.post("/portal/keys", form={"name": "used", "csrf": token})
    [key] = await site.store.list_keys()
    before = await (await client.get("/portal/keys")).get_data(as_text=True)
    assert "<td>never</td>" in before
    used_at = 1_700_000_000.0
    await site.store.insert_usage(
        [UsageRow(request_id="req_1", created_at=used_at, key_id=key.id, model="m", status=200)]
    )
    after = await (await client.get("/portal/keys")).get_data(as_text=True)
    assert "<td>never</td>" not in after
    assert time.strftime("%Y-%m-%d %H:%M", time.gmtime(used_at)) in after
    assert (await site.store.keys_last_used())[key.id] == used_at

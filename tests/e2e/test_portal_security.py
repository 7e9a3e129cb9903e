"""The portal's security rules against a real ``llmgw up --engine sim``,
through httpx from several client addresses (127.0.0.x): CSRF, sign-out,
ids of other projects, lockout per client, sign-in timing, suspension, and a
key made on the Keys page working through the ``openai`` client
(``docs/portal.md``)."""

from __future__ import annotations

import html
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from tests.e2e.portal_helpers import (
        ADMIN,
        ADMIN_PASSWORD,
        MODEL,
        Portal,
        hidden,
        running_portal,
        wait,
    )
else:  # tests is no package: pytest puts this folder on sys.path
    from portal_helpers import ADMIN, ADMIN_PASSWORD, MODEL, Portal, hidden, running_portal, wait

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def portal(
    tmp_path_factory: pytest.TempPathFactory, up_argv: Callable[..., list[str]]
) -> Iterator[Portal]:
    data_dir = tmp_path_factory.mktemp("portal") / "data"
    with running_portal(
        data_dir, up_argv(data_dir, "--engine", "sim", "--model-name", MODEL)
    ) as up:
        yield up


@pytest.fixture(autouse=True)
def _close_browsers(portal: Portal) -> Iterator[None]:
    yield
    portal.close_browsers()


def _join(portal: Portal, email: str, project: str, role: str = "member") -> str:
    response = portal.admin_api(
        "POST",
        "/api/v1/people",
        {"email": email, "project": project, "member_role": role, "password": "pw of " + email},
    )
    assert response.status_code in (201, 409), response.text
    return "pw of " + email


def test_the_first_admin_signs_in_and_sees_admin_pages(portal: Portal) -> None:
    browser = portal.browser()
    assert browser.http.get("/portal/keys").headers["location"].startswith("/portal/sign-in")
    signed = browser.sign_in(ADMIN, ADMIN_PASSWORD)
    assert signed.status_code == 303, signed.text
    cookie = signed.headers["set-cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=Lax" in cookie
    assert "Secure" not in cookie  # plain http on loopback
    page = browser.http.get("/admin/people")
    assert page.status_code == 200
    assert 'id="invite"' in page.text


def test_forms_without_or_with_a_wrong_csrf_token_are_refused(portal: Portal) -> None:
    password = _join(portal, "csrf@example.com", "Acme/ml/csrf")
    browser = portal.browser()
    assert browser.sign_in("csrf@example.com", password).status_code == 303
    before = len(portal.admin_api("GET", "/api/v1/keys").json()["data"])
    missing = browser.http.post("/portal/keys", data={"name": "no token"})
    wrong = browser.http.post("/portal/keys", data={"name": "bad token", "csrf": "x" * 43})
    other = portal.browser()
    other.sign_in(ADMIN, ADMIN_PASSWORD)
    foreign = browser.http.post(
        "/portal/keys", data={"name": "someone else's", "csrf": other.csrf()}
    )
    assert (missing.status_code, wrong.status_code, foreign.status_code) == (403, 403, 403)
    assert len(portal.admin_api("GET", "/api/v1/keys").json()["data"]) == before
    stale_sign_in = portal.browser().http.post(
        "/portal/sign-in", data={"email": ADMIN, "password": ADMIN_PASSWORD, "csrf": "x"}
    )
    assert stale_sign_in.status_code == 403
    assert "llmgw_session" not in stale_sign_in.headers.get("set-cookie", "")
    key_id, _ = browser.make_key("with token")
    assert key_id.startswith("key_")


def test_a_session_cookie_is_refused_after_sign_out(portal: Portal) -> None:
    password = _join(portal, "out@example.com", "Acme/ml/out")
    browser = portal.browser()
    browser.sign_in("out@example.com", password)
    cookie = browser.http.cookies["llmgw_session"]
    assert browser.http.get("/portal/keys").status_code == 200
    out = browser.http.post("/portal/sign-out", data={"csrf": browser.csrf()})
    assert out.status_code == 303
    replay = httpx.get(f"{portal.base}/portal/keys", cookies={"llmgw_session": cookie}, timeout=30)
    assert replay.status_code == 303
    assert replay.headers["location"].startswith("/portal/sign-in")


def test_a_person_cannot_read_or_revoke_another_projects_keys_or_usage(portal: Portal) -> None:
    ada_pw = _join(portal, "ada@example.com", "Acme/ml/ada-proj", role="manager")
    bob_pw = _join(portal, "bob@example.com", "Acme/ml/bob-proj", role="manager")
    ada, bob = portal.browser(), portal.browser()
    ada.sign_in("ada@example.com", ada_pw)
    bob.sign_in("bob@example.com", bob_pw)
    tree = {p["path"]: p for p in portal.admin_api("GET", "/api/v1/tree").json()["data"]}
    bob_project = tree["Acme/ml/bob-proj"]["project_id"]
    ada_project = tree["Acme/ml/ada-proj"]["project_id"]
    bob_key, _ = bob.make_key("bob's", where=bob_project)
    keys_page = ada.http.get("/portal/keys")
    assert bob_key not in keys_page.text
    revoke = ada.http.post(f"/portal/keys/{bob_key}/revoke", data={"csrf": ada.csrf()})
    assert revoke.status_code == 404
    keys = {k["id"]: k for k in portal.admin_api("GET", "/api/v1/keys").json()["data"]}
    assert keys[bob_key]["revoked_at"] is None
    assert ada.http.get(f"/portal/usage?project={bob_project}").status_code == 404
    assert ada.http.get(f"/portal/usage.csv?project={bob_project}").status_code == 404
    assert ada.http.get(f"/portal/usage?project={ada_project}").status_code == 200
    assert ada.http.get("/admin/people").status_code == 403  # no staff role
    # The owner can.
    mine = bob.http.post(f"/portal/keys/{bob_key}/revoke", data={"csrf": bob.csrf()})
    assert mine.status_code == 303


def test_ten_wrong_passwords_from_one_client_do_not_lock_out_another(portal: Portal) -> None:
    password = _join(portal, "owner@example.com", "Acme/ml/owner")
    attacker = portal.browser("127.0.0.2")
    statuses = [
        attacker.sign_in("owner@example.com", "not the password").status_code for _ in range(10)
    ]
    assert statuses[0] == 401
    assert statuses[-1] == 429
    assert attacker.sign_in("owner@example.com", password).status_code == 429
    owner = portal.browser("127.0.0.3")
    assert owner.sign_in("owner@example.com", password).status_code == 303
    assert owner.http.get("/portal/chat").status_code == 200


def test_sign_in_time_does_not_tell_whether_an_address_exists(portal: Portal) -> None:
    _join(portal, "timed@example.com", "Acme/ml/timed")
    known: list[float] = []
    unknown: list[float] = []
    for round_ in range(12):
        # A fresh client address per pair of tries, so no lockout interferes.
        browser = portal.browser(f"127.0.1.{round_ + 1}")
        for email, into in (("timed@example.com", known), ("nobody@example.com", unknown)):
            page = browser.http.get("/portal/sign-in")
            token = hidden(page.text, "csrf")
            started = time.perf_counter()
            answer = browser.http.post(
                "/portal/sign-in", data={"csrf": token, "email": email, "password": "wrong pw!"}
            )
            into.append(time.perf_counter() - started)
            assert answer.status_code == 401
            assert "Wrong address or password." in answer.text
    print(
        f"\nsign-in timing over {len(known)} tries each: known address median "
        f"{statistics.median(known) * 1000:.1f} ms (min {min(known) * 1000:.1f}, max "
        f"{max(known) * 1000:.1f}); unknown address median "
        f"{statistics.median(unknown) * 1000:.1f} ms (min {min(unknown) * 1000:.1f}, max "
        f"{max(unknown) * 1000:.1f})"
    )


def test_a_suspended_persons_session_and_chat_key_stop_at_once(portal: Portal) -> None:
    password = _join(portal, "sus@example.com", "Acme/ml/sus")
    browser = portal.browser()
    browser.sign_in("sus@example.com", password)
    chat = browser.http.get("/portal/chat")
    chat_key = html.unescape(re.search(r'data-key="([^"]+)"', chat.text).group(1))  # type: ignore[union-attr]
    client = openai.OpenAI(base_url=f"{portal.base}/v1", api_key=chat_key, max_retries=0)
    portal.closing.append(client)
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
    ).choices
    assert portal.admin_api("POST", "/api/v1/people/sus@example.com/suspend").status_code == 200
    after = browser.http.get("/portal/chat")
    assert after.status_code == 303
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
    portal.admin_api("POST", "/api/v1/people/sus@example.com/reinstate")
    assert browser.http.get("/portal/chat").status_code == 303  # the old session stays ended


def test_a_key_made_on_the_keys_page_works_and_its_request_shows_in_usage(portal: Portal) -> None:
    password = _join(portal, "use@example.com", "Acme/ml/use")
    browser = portal.browser()
    browser.sign_in("use@example.com", password)
    tree = {p["path"]: p for p in portal.admin_api("GET", "/api/v1/tree").json()["data"]}
    _, secret = browser.make_key("laptop", where=tree["Acme/ml/use"]["project_id"])
    client = openai.OpenAI(base_url=f"{portal.base}/v1", api_key=secret, max_retries=0)
    portal.closing.append(client)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert raw.parse().choices
    request_id = raw.headers["x-request-id"]
    wait(
        lambda: request_id in browser.http.get("/portal/usage").text,
        30,
        "the request on the usage page",
    )
    exported = browser.http.get("/portal/usage.csv")
    assert exported.headers["content-type"].startswith("text/csv")
    assert request_id in exported.text
    assert browser.http.get("/portal/models").text.count(MODEL) >= 1
    connect = browser.http.get("/portal/connect").text
    assert f"{portal.base}/v1" in connect


def _users(portal: Portal, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cli", "users", *args, "--data-dir", str(portal.data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_llmgw_users_joins_sets_roles_suspends_and_forgets(portal: Portal) -> None:
    joined = _users(
        portal, "join", "cli@example.com", "--project", "Acme/cli/p", "--member-role", "manager"
    )
    assert joined.returncode == 0, joined.stderr
    lines = joined.stdout.splitlines()
    assert "manager of project Acme/cli/p" in lines[0]
    password = lines[1]
    assert "shown only this once" in joined.stderr
    browser = portal.browser()
    assert browser.sign_in("cli@example.com", password).status_code == 303
    role = _users(portal, "role", "cli@example.com", "operator", "--json")
    assert json.loads(role.stdout)["role"] == "operator"
    assert _users(portal, "suspend", "cli@example.com").returncode == 0
    assert browser.http.get("/portal/keys").status_code == 303
    assert browser.sign_in("cli@example.com", password).status_code == 403
    assert _users(portal, "reinstate", "cli@example.com").returncode == 0
    changed = _users(portal, "password", "cli@example.com", "--password", "a new password")
    assert changed.returncode == 0, changed.stderr
    assert browser.sign_in("cli@example.com", password).status_code == 401
    assert browser.sign_in("cli@example.com", "a new password").status_code == 303
    key_id, _ = browser.make_key("to forget")
    forgotten = _users(portal, "forget", "cli@example.com", "--json")
    anonymous = json.loads(forgotten.stdout)["anonymous_id"]
    keys = {k["id"]: k for k in portal.admin_api("GET", "/api/v1/keys").json()["data"]}
    assert keys[key_id]["person"] == anonymous
    assert keys[key_id]["revoked_at"] is not None
    listed = _users(portal, "list", "--json")
    assert "cli@example.com" not in listed.stdout
    missing = _users(portal, "suspend", "cli@example.com")
    assert missing.returncode == 1
    assert "no person" in missing.stderr


def _setting(portal: Portal, key: str, value: object) -> None:
    response = portal.admin_api("PATCH", "/api/v1/config", {"key": key, "value": value})
    assert response.status_code == 200, response.text


def test_sign_up_external_url_and_the_portal_switch_follow_the_live_settings(
    portal: Portal,
) -> None:
    browser = portal.browser("127.0.0.4")
    assert browser.http.get("/portal/sign-up").status_code == 404
    _setting(portal, "auth.signup_open", True)
    page = wait(
        lambda: (r := browser.http.get("/portal/sign-up")).status_code == 200 and r,
        30,
        "sign-up open",
    )
    token = hidden(page.text, "csrf")
    asked = browser.http.post(
        "/portal/sign-up",
        data={"csrf": token, "email": "new@example.com", "password": "a long password"},
    )
    assert asked.status_code == 200
    assert "awaits approval" in asked.text
    assert browser.sign_in("new@example.com", "a long password").status_code == 403
    assert portal.admin_api("POST", "/api/v1/people/new@example.com/approve").status_code == 200
    assert browser.sign_in("new@example.com", "a long password").status_code == 303
    _setting(portal, "auth.signup_open", False)

    _setting(portal, "portal.external_url", "https://llm.example.com")
    wait(
        lambda: "https://llm.example.com/v1" in browser.http.get("/portal/connect").text,
        30,
        "the external address on the connect page",
    )
    bad = portal.admin_api("PATCH", "/api/v1/config", {"key": "portal.external_url", "value": "x"})
    assert bad.status_code == 400
    assert "external_url" in bad.text

    _setting(portal, "portal.enabled", False)
    wait(lambda: browser.http.get("/").status_code == 404, 30, "the portal off")
    assert httpx.get(f"{portal.base}/health", timeout=30).status_code == 200
    _setting(portal, "portal.enabled", True)
    wait(lambda: browser.http.get("/").status_code == 303, 30, "the portal on")


def test_llmgw_users_manages_addresses_with_url_characters_and_refuses_a_slash(
    portal: Portal,
) -> None:
    slash = _users(portal, "join", "a/b@x.io")
    assert slash.returncode == 1
    assert "cannot hold '/'" in slash.stderr
    assert "a/b@x.io" not in _users(portal, "list", "--json").stdout
    odd = "q?r#s<t>%u@x.io"
    joined = _users(portal, "join", odd)
    assert joined.returncode == 0, joined.stderr
    role = _users(portal, "role", odd, "viewer", "--json")
    assert role.returncode == 0, role.stderr
    assert (json.loads(role.stdout)["email"], json.loads(role.stdout)["role"]) == (odd, "viewer")
    assert _users(portal, "suspend", odd).returncode == 0
    deleted = _users(portal, "delete", odd)
    assert deleted.returncode == 0, deleted.stderr

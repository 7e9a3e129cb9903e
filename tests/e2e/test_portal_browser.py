"""The portal in a real headless browser (Debian's ``chromium`` driven by its
``chromedriver`` through selenium; nothing downloaded) against ``llmgw up
--engine sim``: an admin invites a person into a project; the person signs
in, gets a streamed chat answer, makes a key that works through the
``openai`` client, and sees the request on the usage page; a ``viewer``
sees no forms on ``/admin``; a suspended person's session stops at once.

With ``LLMGW_PORTAL_SCREENSHOTS=DIR`` the chat, keys and usage pages are
saved there as PNG files (``docs/images/`` holds the ones in
``docs/portal.md``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import openai
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select

if TYPE_CHECKING:
    from tests.e2e.portal_helpers import ADMIN, ADMIN_PASSWORD, MODEL, Portal, running_portal, wait
else:  # tests is no package: pytest puts this folder on sys.path
    from portal_helpers import ADMIN, ADMIN_PASSWORD, MODEL, Portal, running_portal, wait

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        (CHROMIUM is None or CHROMEDRIVER is None) and os.environ.get("CI") != "true",
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
    ),
]

#: Deadline for a page condition (an answer streamed, a row shown), s.
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def portal(
    tmp_path_factory: pytest.TempPathFactory, up_argv: Callable[..., list[str]]
) -> Iterator[Portal]:
    data_dir = tmp_path_factory.mktemp("portal-browser") / "data"
    with running_portal(
        data_dir, up_argv(data_dir, "--engine", "sim", "--model-name", MODEL)
    ) as up:
        yield up


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    # Selenium Manager never runs: the driver and the browser are named.
    os.environ["SE_OFFLINE"] = "true"
    options = webdriver.ChromeOptions()
    assert CHROMIUM is not None
    assert CHROMEDRIVER is not None
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    options.add_argument("--disable-dev-shm-usage")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(DEADLINE_S)
    try:
        yield driver
    finally:
        driver.quit()


def _sign_in(driver: webdriver.Chrome, base: str, email: str, password: str) -> None:
    driver.delete_all_cookies()
    driver.get(f"{base}/portal/sign-in")
    driver.find_element(By.ID, "email").send_keys(email)
    driver.find_element(By.ID, "password").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait(lambda: "/portal/sign-in" not in driver.current_url, DEADLINE_S, f"{email} signed in")


def _forms(driver: webdriver.Chrome) -> list[str]:
    """The actions of the page's forms, but the sign-out one."""
    actions = [f.get_attribute("action") or "" for f in driver.find_elements(By.TAG_NAME, "form")]
    return [a for a in actions if not a.endswith("/portal/sign-out")]


def _shot(driver: webdriver.Chrome, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path))
    folder = os.environ.get("LLMGW_PORTAL_SCREENSHOTS")
    if folder:
        shutil.copy(path, Path(folder) / path.name)


def test_invite_chat_key_usage_viewer_and_suspension(
    portal: Portal, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    base = portal.base
    # An admin signs in and invites a person into a project.
    _sign_in(browser, base, ADMIN, ADMIN_PASSWORD)
    browser.get(f"{base}/admin/people")
    browser.find_element(By.ID, "email").send_keys("carol@example.com")
    browser.find_element(By.ID, "project").send_keys("Acme/web/app")
    browser.find_element(By.CSS_SELECTOR, "#invite button").click()
    password = wait(
        lambda: browser.find_elements(By.ID, "invite-password"), DEADLINE_S, "the invitation"
    )[0].text.strip()
    assert len(password) >= 10
    row = browser.find_element(By.CSS_SELECTOR, '[data-person="carol@example.com"]')
    assert "Acme/web/app" in row.text

    # The person signs in and gets a streamed chat answer.
    _sign_in(browser, base, "carol@example.com", password)
    browser.get(f"{base}/portal/chat")
    browser.find_element(By.ID, "prompt").send_keys("Say hello to the portal.")
    browser.find_element(By.CSS_SELECTOR, "form.chat-form button").click()
    answer = wait(
        lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"),
        DEADLINE_S,
        "a streamed answer",
    )[0]
    assert answer.text.strip(), browser.page_source
    _shot(browser, tmp_path, "portal-chat")

    # A key made on the Keys page works through the openai client.
    browser.get(f"{base}/portal/keys")
    browser.find_element(By.ID, "name").send_keys("my editor")
    Select(browser.find_element(By.ID, "where")).select_by_visible_text("project Acme/web/app")
    browser.find_element(By.CSS_SELECTOR, "form.row button").click()
    secret = wait(lambda: browser.find_elements(By.ID, "secret"), DEADLINE_S, "the new key")[
        0
    ].text.strip()
    assert secret.startswith("sk-llmgw-")
    _shot(browser, tmp_path, "portal-keys")
    with openai.OpenAI(base_url=f"{base}/v1", api_key=secret, max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16
        )
        assert raw.parse().choices[0].message.content
        request_id = raw.headers["x-request-id"]

    # The usage page shows that request within seconds.
    def shown() -> bool:
        browser.get(f"{base}/portal/usage")
        return request_id in browser.page_source

    wait(shown, DEADLINE_S, "the request on the usage page")
    _shot(browser, tmp_path, "portal-usage")

    # A suspended person's session stops at once.
    assert portal.admin_api("POST", "/api/v1/people/carol@example.com/suspend").status_code == 200
    browser.get(f"{base}/portal/keys")
    assert "/portal/sign-in" in browser.current_url

    # A viewer sees no forms on /admin; an admin sees them.
    viewer = portal.join("vera@example.com", "Acme/web/app", staff="viewer")
    _sign_in(browser, base, "vera@example.com", viewer)
    pages = ("/admin", "/admin/people", "/admin/tree", "/admin/models", "/admin/nodes")
    for path in (*pages, "/admin/usage"):
        browser.get(f"{base}{path}")
        assert browser.find_elements(By.TAG_NAME, "h1"), path
        assert _forms(browser) == [], path
    _sign_in(browser, base, ADMIN, ADMIN_PASSWORD)
    browser.get(f"{base}/admin/people")
    assert any(a.endswith("/admin/people") for a in _forms(browser))
    browser.get(f"{base}/admin/tree")
    assert any("/admin/tree/" in a for a in _forms(browser))

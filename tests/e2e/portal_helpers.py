"""What the portal's end-to-end tests share: a running ``llmgw up`` with
the first admin's password set, and an httpx "browser" that keeps cookies
and can come from any loopback address (``test_portal_*.py``)."""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

ADMIN = "admin@localhost"
ADMIN_PASSWORD = "admin password 1"
MODEL = "sim-portal"
STARTUP_S = 120.0


class Portal:
    """A running ``llmgw up`` with its addresses."""

    def __init__(self, data_dir: Path, process: subprocess.Popen[bytes], log: Path) -> None:
        self.data_dir = data_dir
        self.process = process
        self.log = log
        self.api = ""
        self.admin = ""
        self.browsers: list[Browser] = []
        self.closing: list[openai.OpenAI] = []

    @property
    def base(self) -> str:
        return f"http://{self.api}"

    def admin_api(self, method: str, path: str, body: object = None) -> httpx.Response:
        token = (self.data_dir / "admin-token").read_text().strip()
        return httpx.request(
            method,
            f"http://{self.admin}{path}",
            json=body,
            headers={"authorization": f"Bearer {token}"},
            timeout=30,
        )

    def browser(self, client_ip: str = "127.0.0.1") -> Browser:
        made = Browser(self.base, client_ip)
        self.browsers.append(made)
        return made

    def join(self, email: str, project: str, role: str = "member", staff: str = "") -> str:
        """Make ``email`` a person in ``project`` (as ``role``); their password."""
        body = {
            "email": email,
            "project": project,
            "member_role": role,
            "password": "pw of " + email,
        }
        if staff:
            body["role"] = staff
        response = self.admin_api("POST", "/api/v1/people", body)
        assert response.status_code in (201, 409), response.text
        return "pw of " + email

    def close_browsers(self) -> None:
        for browser in self.browsers:
            browser.http.close()
        self.browsers.clear()
        for client in self.closing:
            client.close()
        self.closing.clear()


class Browser:
    """An httpx client that keeps cookies, from one loopback address."""

    def __init__(self, base: str, client_ip: str) -> None:
        self.http = httpx.Client(
            base_url=base,
            transport=httpx.HTTPTransport(local_address=client_ip),
            timeout=30,
            follow_redirects=False,
        )

    def sign_in(self, email: str, password: str) -> httpx.Response:
        page = self.http.get("/portal/sign-in")
        token = hidden(page.text, "csrf")
        return self.http.post(
            "/portal/sign-in", data={"csrf": token, "email": email, "password": password}
        )

    def csrf(self, path: str = "/portal/keys") -> str:
        page = self.http.get(path)
        assert page.status_code == 200, page.text
        return hidden(page.text, "csrf")

    def make_key(self, name: str, where: str = "") -> tuple[str, str]:
        page = self.http.post(
            "/portal/keys", data={"csrf": self.csrf(), "name": name, "where": where}
        )
        assert page.status_code == 200, page.text
        secret = re.search(r'<p class="secret" id="secret">([^<]+)</p>', page.text)
        assert secret is not None, page.text
        key_id = re.findall(r'data-key-id="(key_[0-9a-f]+)"', page.text)[0]
        return key_id, html.unescape(secret.group(1))


def hidden(text: str, name: str) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', text)
    assert found is not None, text
    return html.unescape(found.group(1))


def wait(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def running_portal(data_dir: Path, argv: list[str]) -> Iterator[Portal]:
    """``llmgw up`` (``argv``) with the first admin's password set, until the block ends."""
    log = data_dir.parent / "up.log"
    env = {**os.environ, "LLMGW_ADMIN_PASSWORD": ADMIN_PASSWORD}
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    found = Portal(data_dir, process, log)
    try:

        def ready() -> bool:
            assert process.poll() is None, log.read_text()
            run = data_dir / "run.json"
            if not run.exists():
                return False
            doc = json.loads(run.read_text() or "{}")
            found.api, found.admin = doc.get("api", ""), doc.get("admin", "")
            try:
                return httpx.get(f"{found.base}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait(ready, STARTUP_S, "llmgw up")
        yield found
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

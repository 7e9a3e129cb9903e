"""Admin changes on several control planes of one store (``docs/ha.md``):
a standby refuses them naming the leader and still answers reads; a
deposed leader's change is refused by the store (the lease fences it) and
nothing is written."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import trio

from llmgw.admin.app import make_admin_app
from llmgw.admin.keys import KeysService
from llmgw.auth.admin_token import ADMIN_TOKEN_FILE, AdminTokenFile
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.settings import AuthSettings
from llmgw.store import Lease

if TYPE_CHECKING:
    from tests.admin.conftest import Admin

LEASE = "leader"
HINT = "the leader is cp-b:1:x, its client API at 10.0.0.2:8080"


def entry(name: str) -> dict[str, Any]:
    return {"name": name, "engine": "sim", "min_memory_gb": 0.5}


class _Several:
    """``admin``'s app again, as under ``llmgw server`` (a leader hint given)."""

    def __init__(self, admin: Admin) -> None:
        keys = KeysService(
            admin.store,
            KeyAuthenticator(admin.store),
            ScopeResolver(admin.store),
            AuthSettings(),
            bands=lambda: ["interactive"],
        )
        app = make_admin_app(
            admin.store,
            admin.cluster,
            AdminTokenFile(admin.data_dir / ADMIN_TOKEN_FILE),
            keys,
            live=admin.live,
            data_dir=admin.data_dir,
            leader_hint=lambda: HINT,
        )
        self.client = app.test_client()
        self.secret = admin.secret

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        kwargs: dict[str, Any] = {
            "method": method,
            "headers": {"authorization": f"Bearer {self.secret}"},
        }
        if body is not None:
            kwargs["json"] = body
        response = await self.client.open(path, **kwargs)
        return response.status_code, await response.get_json()


async def test_a_standby_refuses_changes_naming_the_leader_and_answers_reads(
    admin: Admin,
) -> None:
    standby = _Several(admin)
    assert not admin.cluster.is_leader
    for method, path, body in (
        ("POST", "/api/v1/models", entry("m")),
        ("PATCH", "/api/v1/config", {"key": "auth.default_rpm", "value": 5}),
        ("POST", "/api/v1/keys", {"project": "p"}),
        ("DELETE", "/api/v1/models/m", None),
    ):
        status, body = await standby.call(method, path, body)
        assert status == 503, (method, path, body)
        assert body["error"]["code"] == "not_leader"
        assert HINT in body["error"]["message"]
    assert await admin.store.list_models() == []
    status, body = await standby.call("GET", "/api/v1/models")
    assert status == 200
    # Leading, it takes them.
    admin.cluster.set_leader(True)
    status, _ = await standby.call("POST", "/api/v1/models", entry("m"))
    assert status == 201


async def test_a_deposed_leaders_change_is_refused_by_the_store(admin: Admin) -> None:
    leader = _Several(admin)
    old = await admin.store.acquire_lease(LEASE, "cp-a", 0.2, time.time())
    assert old is not None
    admin.cluster.set_leader(True, lease=old)
    status, _ = await leader.call("POST", "/api/v1/models", entry("kept"))
    assert status == 201
    # cp-b takes the lease over; cp-a has not noticed yet (no renewal since).
    await trio.sleep(0.3)
    new = await admin.store.acquire_lease(LEASE, "cp-b", 10, time.time())
    assert isinstance(new, Lease)
    status, body = await leader.call("POST", "/api/v1/models", entry("late"))
    assert status == 503, body
    assert body["error"]["code"] == "not_leader"
    assert "cp-b" in body["error"]["message"]
    status, body = await leader.call(
        "PATCH", "/api/v1/config", {"key": "auth.default_rpm", "value": 5}
    )
    assert status == 503, body
    assert body["error"]["code"] == "not_leader"
    status, body = await leader.call("DELETE", "/api/v1/models/kept")
    assert status == 503, body
    assert [m.name for m in await admin.store.list_models()] == ["kept"]
    assert admin.cluster.settings.auth.default_rpm != 5

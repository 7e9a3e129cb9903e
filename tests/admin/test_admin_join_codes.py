"""``POST /api/v1/nodes/join-codes``: join codes from the admin API."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import attrs
import pytest

from llmgw.admin.app import make_admin_app
from llmgw.admin.keys import KeysService
from llmgw.agent.joincode import JoinCode
from llmgw.auth.admin_token import ADMIN_TOKEN_FILE, AdminTokenFile
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.control.ca import ClusterCA
from llmgw.control.join import JoinService
from llmgw.settings import AuthSettings

if TYPE_CHECKING:
    from tests.admin.conftest import Admin


@pytest.fixture
async def joining(admin: Admin) -> tuple[Admin, JoinService]:
    """``admin`` whose app can make join codes (a join port at 10.0.0.1:7444)."""
    ca = ClusterCA.load_or_create(admin.data_dir / "ca", [])
    join = JoinService(
        ca, admin.store, admin.cluster, servers=[], addresses=["10.0.0.1:7444", "[fd00::1]:7444"]
    )
    keys = KeysService(
        admin.store,
        KeyAuthenticator(admin.store),
        ScopeResolver(admin.store),
        AuthSettings(),
        bands=lambda: [],
    )
    app = make_admin_app(
        admin.store,
        admin.cluster,
        AdminTokenFile(admin.data_dir / ADMIN_TOKEN_FILE),
        keys,
        live=admin.live,
        join=join,
    )
    return attrs.evolve(admin, app=app, client=app.test_client()), join


async def test_a_join_code_carries_the_addresses_a_token_kept_hashed_and_the_ca(
    joining: tuple[Admin, JoinService],
) -> None:
    admin, join = joining
    status, doc = await admin.call(
        "POST",
        "/api/v1/nodes/join-codes",
        {"expires_s": 120, "labels": {"rack": "r1"}, "node_id": "gpu-1"},
    )
    assert status == 200, doc
    assert doc["command"] == f"llmgw join {doc['code']}"
    code = JoinCode.decode(doc["code"])
    assert code.addresses == ("10.0.0.1:7444", "[fd00::1]:7444")
    assert code.fingerprint == join.ca.fingerprint
    assert (doc["node_id"], doc["labels"]) == ("gpu-1", {"rack": "r1"})
    stored = await admin.store.get_join_token(hashlib.sha256(code.token.encode()).hexdigest())
    assert stored is not None
    assert (stored.node_id, stored.labels, stored.expires_at) == (
        "gpu-1",
        {"rack": "r1"},
        doc["expires_at"],
    )
    assert stored.expires_at - stored.created_at == 120


async def test_each_code_has_its_own_token_and_an_hour_by_default(
    joining: tuple[Admin, JoinService],
) -> None:
    admin, _ = joining
    _, first = await admin.call("POST", "/api/v1/nodes/join-codes", {})
    _, second = await admin.call("POST", "/api/v1/nodes/join-codes", {})
    assert JoinCode.decode(first["code"]).token != JoinCode.decode(second["code"]).token
    token = JoinCode.decode(first["code"]).token
    stored = await admin.store.get_join_token(hashlib.sha256(token.encode()).hexdigest())
    assert stored is not None
    assert stored.expires_at - stored.created_at == 3600


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"expires_s": 0}, "'expires_s' must be a number of seconds from 1"),
        ({"expires_s": "1h"}, "'expires_s' must be a number"),
        ({"node_id": 5}, "'node_id' must be a string"),
        ({"node_id": "a b"}, "node id 'a b' is not valid"),
        ({"labels": ["x"]}, "labels must be an object"),
        ({"labels": {"k": 1}}, "label 'k' must be a string"),
        ({"color": "red"}, "Unknown field(s) ['color']"),
    ],
)
async def test_a_bad_request_is_refused_naming_the_field(
    joining: tuple[Admin, JoinService], body: dict[str, Any], message: str
) -> None:
    admin, _ = joining
    status, doc = await admin.call("POST", "/api/v1/nodes/join-codes", body)
    assert status == 400
    assert message in doc["error"]["message"]


async def test_a_control_plane_without_a_join_port_says_so(admin: Admin) -> None:
    status, doc = await admin.call("POST", "/api/v1/nodes/join-codes", {"expires_s": 60})
    assert status == 409
    assert doc["error"]["code"] == "join_disabled"
    assert "llmgw server" in doc["error"]["message"]


async def test_join_codes_need_the_admin_token(joining: tuple[Admin, JoinService]) -> None:
    admin, _ = joining
    status, _ = await admin.call("POST", "/api/v1/nodes/join-codes", {}, key="nope")
    assert status == 401

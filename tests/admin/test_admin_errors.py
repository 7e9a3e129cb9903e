"""The admin API's one error shape: every error of :mod:`llmgw.errors` a
route raises, and quart's own 404, 405 and 500, answer
``{"error": {"message", "type", "code", "param"}}`` with the status the tree
gives it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from llmgw import errors
from llmgw.admin.errors import BadRequest, Clash, NoSuch, answer_for
from llmgw.auth.keys import KeyRefused
from llmgw.control.catalog import CatalogError
from llmgw.control.model_ops import ModelChangeError
from llmgw.settings import SettingsError
from llmgw.store import Conflict

if TYPE_CHECKING:
    from tests.admin.conftest import Admin


def _error(message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": "invalid_request_error", "code": code, "param": param}


def _server_error(message: str, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": "server_error", "code": code, "param": None}


@pytest.mark.parametrize(
    ("exc", "status", "error"),
    [
        (
            SettingsError("router.nope: no such setting"),
            400,
            _error("Settings not valid: router.nope: no such setting", "invalid_settings"),
        ),
        (CatalogError(["engine: unknown", "slots: 0"]), 400, _error("engine: unknown; slots: 0", "invalid_model")),
        (errors.InvalidInput("'last' is bad"), 400, _error("'last' is bad")),
        (BadRequest("ttl: soon", code="invalid_ttl", param="ttl"), 400, _error("ttl: soon", "invalid_ttl", "ttl")),
        (ModelChangeError("too long", param="tokens"), 400, _error("too long", param="tokens")),
        (errors.NotFound("No key 'k'."), 404, _error("No key 'k'.", "not_found")),
        (NoSuch("No model 'm'.", code="model_not_found"), 404, _error("No model 'm'.", "model_not_found")),
        (
            Conflict("the settings are at version 3, not 2"),
            409,
            _error("the settings are at version 3, not 2; read it again and retry.", "conflict"),
        ),
        (Clash("A model 'm' is already in the catalog.", code="model_exists"), 409, _error("A model 'm' is already in the catalog.", "model_exists")),
        (errors.Refused("not allowed"), 403, _error("not allowed", "refused")),
        (KeyRefused("Incorrect API key provided."), 401, _error("Incorrect API key provided.", "invalid_api_key")),
        (
            errors.StoreError("database is locked"),
            503,
            _server_error("The store cannot be reached: database is locked", "store_unavailable"),
        ),
        (errors.UpstreamError("Node 'n1' did not answer within 10 s."), 504, _server_error("Node 'n1' did not answer within 10 s.")),
        (errors.LlmgwError("m removed, but its weights could not be deleted"), 500, _server_error("m removed, but its weights could not be deleted")),
    ],
)  # fmt: skip
def test_each_error_of_the_tree_has_its_status_code_and_param(
    exc: errors.LlmgwError, status: int, error: dict[str, Any]
) -> None:
    assert answer_for(exc) == (status, error)


async def _raw(admin: Admin, method: str, path: str, key: str | None = None) -> tuple[int, Any]:
    """The status and whole body of a call (with the admin token, unless ``key``)."""
    secret = admin.secret if key is None else key
    response = await admin.client.open(
        path, method=method, headers={"authorization": f"Bearer {secret}"}
    )
    return response.status_code, await response.get_json()


async def test_an_error_a_route_raises_is_answered_in_the_one_shape(admin: Admin) -> None:
    assert await _raw(admin, "GET", "/api/v1/models/nope") == (
        404,
        {
            "error": _error(
                "No model 'nope' in the catalog; there are no models.", "model_not_found"
            )
        },
    )
    assert await _raw(admin, "GET", "/api/v1/usage?last=0") == (
        400,
        {"error": _error("'last' must be between 1 and 10000.")},
    )


async def test_the_key_check_answers_in_the_one_shape(admin: Admin) -> None:
    assert await _raw(admin, "GET", "/api/v1/keys", key="") == (
        401,
        {"error": _error("The admin API needs 'Authorization: Bearer <admin token>'.", "invalid_api_key")},
    )  # fmt: skip
    assert await _raw(admin, "GET", "/api/v1/keys", key="llmgw-admin-nope") == (
        401,
        {"error": _error("Incorrect admin token provided.", "invalid_api_key")},
    )


async def test_an_unknown_route_a_wrong_method_and_a_bug_answer_in_the_one_shape(
    admin: Admin,
) -> None:
    assert await _raw(admin, "GET", "/api/v1/nothing") == (
        404,
        {"error": _error("No route GET /api/v1/nothing.", "unknown_url")},
    )
    assert await _raw(admin, "DELETE", "/api/v1/status") == (
        405,
        {"error": _error("/api/v1/status does not take DELETE.", "method_not_allowed")},
    )

    @admin.app.get("/api/v1/broken")
    async def broken() -> Any:
        raise RuntimeError("a bug")

    assert await _raw(admin, "GET", "/api/v1/broken") == (
        500,
        {
            "error": _server_error(
                "Internal error; the control plane's log says more.", "internal_error"
            )
        },
    )


async def test_a_wrong_method_names_the_allowed_ones(admin: Admin) -> None:
    # Found by schemathesis (tests/e2e/test_openapi.py): RFC 9110 section
    # 15.5.6 asks a 405 to carry Allow; it had none.
    response = await admin.client.open(
        "/api/v1/status", method="TRACE", headers={"authorization": f"Bearer {admin.secret}"}
    )
    assert response.status_code == 405
    allowed = {m.strip() for m in response.headers["allow"].split(",")}
    assert {"GET", "HEAD"} <= allowed
    assert "TRACE" not in allowed


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/api/v1/models"),
        ("PATCH", "/api/v1/config"),
        ("POST", "/api/v1/keys"),
        ("POST", "/api/v1/tree"),
        ("PUT", "/api/v1/limits/org/default"),
    ],
)
@pytest.mark.parametrize("body", [b"\xff", b'{"name": "\xc3"}', b"{", b""])
async def test_a_body_that_is_not_json_text_is_a_400(
    admin: Admin, method: str, path: str, body: bytes
) -> None:
    # Invalid UTF-8 once made quart's get_json(silent=True) raise: a 500
    # (found by schemathesis on POST /api/v1/models).
    status, made = await admin.call(
        "POST",
        "/api/v1/tree",
        {"orgs": [{"name": "default", "teams": [{"name": "t", "projects": [{"name": "p"}]}]}]},
    )
    assert status == 200, made
    response = await admin.client.open(
        path,
        method=method,
        data=body,
        headers={
            "authorization": f"Bearer {admin.secret}",
            "content-type": "application/json",
        },
    )
    assert response.status_code == 400, await response.get_data()
    error = (await response.get_json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]

"""The admin API's key, tree, limits and usage routes through quart's test
client."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import attrs
import pytest

from llmgw.admin.usage import parse_since
from llmgw.errors import InvalidInput
from llmgw.store import ModelRecord, UsageRow

if TYPE_CHECKING:
    from tests.admin.conftest import Admin


KEY_FIELDS = {
    "id", "name", "prefix", "project", "person", "band", "created_at", "is_admin",
    "revoked_at", "expires_at", "limits", "last_used_at",
}  # fmt: skip


async def test_a_key_is_made_in_a_project_listed_rotated_and_revoked(admin: Admin) -> None:
    status, made = await admin.call("POST", "/api/v1/keys", {"name": "ci", "project": "A/b/c"})
    assert status == 201, made
    assert set(made) == KEY_FIELDS | {"key", "created"}
    assert made["key"].startswith("sk-llmgw-")
    assert (made["project"], made["person"], made["is_admin"]) == ("A/b/c", None, False)
    assert made["created"] == ["org A", "team A/b", "project A/b/c"]
    assert made["limits"] == {
        "rpm": None,
        "tpm": None,
        "budget_day": None,
        "budget_month": None,
        "models": None,
    }

    _, listing = await admin.call("GET", "/api/v1/keys")
    shown = {k["name"]: k for k in listing["data"]}
    assert set(shown) == {"ci"}
    assert "key" not in shown["ci"]
    assert shown["ci"]["project"] == "A/b/c"

    status, rotated = await admin.call("POST", f"/api/v1/keys/{made['id']}/rotate")
    assert status == 200
    assert rotated["key"] != made["key"]
    status, body = await admin.call("POST", f"/api/v1/keys/{made['id']}/revoke")
    assert (status, body) == (200, {"id": made["id"], "revoked": True})
    status, body = await admin.call("POST", f"/api/v1/keys/{made['id']}/revoke")
    assert (status, body["error"]["code"]) == (409, "already_revoked")
    status, body = await admin.call("POST", f"/api/v1/keys/{made['id']}/rotate")
    assert (status, body["error"]["code"]) == (409, "key_revoked")
    status, body = await admin.call("POST", "/api/v1/keys/key_nope/rotate")
    assert (status, body["error"]["code"]) == (404, "not_found")


async def test_a_personal_key_has_a_person_and_no_project(admin: Admin) -> None:
    status, made = await admin.call("POST", "/api/v1/keys", {"name": "ada", "person": "a@x.io"})
    assert status == 201
    assert (made["person"], made["project"], made["created"]) == ("a@x.io", None, [])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (None, "Send a JSON object with 'name'"),
        ({"name": "a", "colour": "red"}, "Unknown field(s) ['colour']."),
        ({"name": " "}, "'name' is required"),
        ({"name": "a", "project": "not a path"}, "is not ORG/TEAM/PROJECT"),
        ({"name": "a", "project": "A/b/c", "person": "a@x.io"}, "not both"),
        ({"name": "a", "person": "nobody"}, "'person' must be a sign-in address"),
        ({"name": "a", "expires": "never"}, "'expires'"),
    ],
)
async def test_a_bad_key_request_is_400_and_makes_nothing(
    admin: Admin, body: dict[str, Any] | None, says: str
) -> None:
    status, doc = await admin.call("POST", "/api/v1/keys", body)
    assert status == 400
    assert says in doc["error"]["message"]
    assert await admin.store.list_keys() == []


async def test_the_tree_is_provisioned_once_and_limits_narrow_a_level(admin: Admin) -> None:
    tree = {
        "orgs": [
            {
                "name": "Acme",
                "limits": {"rpm": 600, "budget_month": "25.50"},
                "teams": [
                    {"name": "ml", "projects": [{"name": "train", "keys": [{"name": "bot"}]}]}
                ],
            }
        ]
    }
    status, first = await admin.call("POST", "/api/v1/tree", tree)
    assert status == 200, first
    assert first["created"] == ["org Acme", "team Acme/ml", "project Acme/ml/train"]
    assert [(k["name"], k["project"]) for k in first["keys"]] == [("bot", "Acme/ml/train")]
    _, again = await admin.call("POST", "/api/v1/tree", tree)
    assert again == {"created": [], "keys": []}

    _, listing = await admin.call("GET", "/api/v1/tree")
    [path] = listing["data"]
    assert path["path"] == "Acme/ml/train"
    assert path["limits"]["org"]["budget_month"] == "25.5"
    assert path["limits"]["org"]["rpm"] == 600

    await admin.store.put_model(ModelRecord.simple("m", "sim"))
    status, body = await admin.call(
        "PUT", "/api/v1/limits/project/Acme/ml/train", {"tpm": 1000, "models": ["m"]}
    )
    assert status == 200, body
    assert body["scope"] == "project"
    assert body["limits"]["tpm"] == 1000
    assert body["limits"]["models"] == ["m"]
    status, body = await admin.call("PUT", "/api/v1/limits/team/Acme/nope", {"rpm": 1})
    assert (status, body["error"]["code"]) == (404, "not_found")
    status, body = await admin.call("PUT", "/api/v1/limits/org/Acme", {"rpm": -1})
    assert status == 400
    assert "'rpm' must be a whole number" in body["error"]["message"]
    status, body = await admin.call("PUT", "/api/v1/limits/org/Acme", {"tpm": 10**13})
    assert status == 400, body
    assert "'tpm' must be a whole number from 0 to 1,000,000,000,000" in body["error"]["message"]
    status, body = await admin.call("POST", "/api/v1/tree", {"orgz": []})
    assert status == 400


def _row(request_id: str, created_at: float, **fields: Any) -> UsageRow:
    return UsageRow(
        request_id=request_id,
        created_at=created_at,
        key_id="k1",
        model="m",
        status=200,
        prompt_tokens=10,
        completion_tokens=5,
        cost_micros=1500,
        **fields,
    )


async def test_usage_rows_one_request_and_sums(admin: Admin) -> None:
    await admin.store.insert_usage([_row("req_1", 1.7e9), _row("req_2", 1.7e9 + 1, ttft_ms=9.5)])
    status, body = await admin.call("GET", "/api/v1/usage?last=1")
    assert status == 200
    [newest] = body["data"]
    assert newest["request_id"] == "req_2"
    assert newest["ttft_ms"] == 9.5
    status, one = await admin.call("GET", "/api/v1/requests/req_1")
    assert (status, one["request_id"], one["cost_micros"]) == (200, "req_1", 1500)
    status, body = await admin.call("GET", "/api/v1/requests/req_9")
    assert status == 404
    status, body = await admin.call("GET", "/api/v1/requests/nope")
    assert status == 400

    status, summary = await admin.call("GET", "/api/v1/usage/summary?by=model&since=2020-01-01")
    assert status == 200, summary
    assert summary["by"] == "model"
    [group] = summary["data"]
    assert (group["name"], group["requests"], group["prompt_tokens"]) == ("m", 2, 20)
    status, body = await admin.call("GET", "/api/v1/usage/summary?by=galaxy")
    assert status == 400


async def test_usage_exports_as_json_lines_and_csv(admin: Admin) -> None:
    await admin.store.insert_usage([_row("req_1", 1.7e9), _row("req_2", 1.7e9 + 1)])
    headers = {"authorization": f"Bearer {admin.secret}"}
    response = await admin.client.get("/api/v1/usage/export?since=2020-01-01", headers=headers)
    lines = (await response.get_data()).decode().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["req_1", "req_2"]
    response = await admin.client.get(
        "/api/v1/usage/export?format=csv&since=2020-01-01", headers=headers
    )
    assert response.content_type == "text/csv"
    header, *rows = (await response.get_data()).decode().splitlines()
    assert header.startswith("request_id,created_at,key_id,model,status,")
    assert [r.split(",")[0] for r in rows] == ["req_1", "req_2"]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("24h", 1_000_000 - 86400),
        ("3600", 1_000_000 - 3600),  # a bare number is a duration in seconds
        ("2026-01-01", 1767225600.0),
        ("2026-01-01T01:00+01:00", 1767225600.0),
    ],
)
def test_parse_since_reads_durations_and_dates(text: str, seconds: float) -> None:
    assert parse_since(text, 1_000_000) == seconds


def test_parse_since_refuses_anything_else_as_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="is not a time"):
        parse_since("whenever", 0)


# --- names that do not exist are refused with those that do -------------------------


async def test_a_key_in_a_band_that_does_not_exist_is_refused_naming_the_bands(
    admin: Admin,
) -> None:
    status, body = await admin.call("POST", "/api/v1/keys", {"name": "k", "band": "nosuchband"})
    assert status == 400
    assert body["error"] == {
        "message": "No band 'nosuchband'; the bands are: bulk, interactive "
        "(router.admission.bands).",
        "type": "invalid_request_error",
        "code": "unknown_band",
        "param": "band",
    }
    assert not [k for k in await admin.store.list_keys() if k.name == "k"]
    status, made = await admin.call("POST", "/api/v1/keys", {"name": "k", "band": "bulk"})
    assert (status, made["band"]) == (201, "bulk")
    # The live bands decide: a band added by `ctl config set` is taken at once.
    await admin.call(
        "PATCH",
        "/api/v1/config",
        {"key": "router.admission.bands", "value": [{"name": "gold", "priority": 300}]},
    )
    status, _ = await admin.call("POST", "/api/v1/keys", {"name": "g", "band": "gold"})
    assert status == 201
    tree = {
        "orgs": [
            {
                "name": "Acme",
                "teams": [
                    {
                        "name": "ml",
                        "projects": [{"name": "t", "keys": [{"name": "b", "band": "bulk"}]}],
                    }
                ],
            }
        ]
    }
    status, body = await admin.call("POST", "/api/v1/tree", tree)
    assert (status, body["error"]["code"]) == (400, "unknown_band")
    assert body["error"]["message"].startswith("key 'b': No band 'bulk'; the bands are: gold")
    _, listing = await admin.call("GET", "/api/v1/tree")
    assert "Acme/ml/t" not in [p["path"] for p in listing["data"]]  # nothing made


async def test_limits_naming_a_model_not_in_the_catalog_are_refused_naming_the_models(
    admin: Admin,
) -> None:
    await admin.store.put_model(ModelRecord.simple("m", "sim", aliases=("m-alias",)))
    await admin.store.put_model(ModelRecord.simple("n", "sim"))
    status, made = await admin.call("POST", "/api/v1/keys", {"name": "k"})
    assert status == 201
    path = f"/api/v1/limits/key/{made['id']}"
    status, body = await admin.call("PUT", path, {"models": ["m", "nosuch"]})
    assert status == 400
    assert body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "models"
    assert body["error"]["message"] == ("No model 'nosuch' in the catalog; the models are: m, n.")
    status, body = await admin.call("PUT", path, {"models": ["m-alias"]})
    assert status == 400
    assert "'m-alias' is an alias of 'm'" in body["error"]["message"]
    status, body = await admin.call("PUT", path, {"models": ["m"]})
    assert (status, body["limits"]["models"]) == (200, ["m"])
    tree = {
        "orgs": [
            {
                "name": "Acme",
                "limits": {"models": ["gone"]},
                "teams": [{"name": "ml", "projects": [{"name": "t"}]}],
            }
        ]
    }
    status, body = await admin.call("POST", "/api/v1/tree", tree)
    assert status == 400
    assert body["error"]["message"] == (
        "Acme: No model 'gone' in the catalog; the models are: m, n."
    )


async def test_an_unknown_scope_level_or_key_is_refused_naming_those_there_are(
    admin: Admin,
) -> None:
    tree = {
        "orgs": [
            {"name": "Acme", "teams": [{"name": "ml", "projects": [{"name": "train"}]}]},
            {"name": "Beta", "teams": [{"name": "ops", "projects": [{"name": "web"}]}]},
        ]
    }
    assert (await admin.call("POST", "/api/v1/tree", tree))[0] == 200
    status, body = await admin.call("PUT", "/api/v1/limits/org/Gamma", {"rpm": 1})
    assert status == 404
    assert body["error"]["message"] == "No org 'Gamma'; the orgs are: Acme, Beta."
    status, body = await admin.call("PUT", "/api/v1/limits/team/Acme/nope", {"rpm": 1})
    assert body["error"]["message"] == "No team 'Acme/nope'; the teams are: Acme/ml, Beta/ops."
    status, body = await admin.call("PUT", "/api/v1/limits/project/Acme/ml/x", {"rpm": 1})
    assert body["error"]["message"] == (
        "No project 'Acme/ml/x'; the projects are: Acme/ml/train, Beta/ops/web."
    )
    status, body = await admin.call("PUT", "/api/v1/limits/planet/Acme", {"rpm": 1})
    assert (status, body["error"]["code"]) == (400, "unknown_scope")
    assert body["error"]["message"] == (
        "No scope 'planet'; the scopes are: org, team, project, key."
    )
    status, made = await admin.call("POST", "/api/v1/keys", {"name": "only"})
    assert status == 201, made
    key_id = made["id"]
    status, body = await admin.call("GET", "/api/v1/usage?key_id=nokey")
    assert status == 404
    assert body["error"]["message"] == f"No key 'nokey'; the keys are: {key_id}."
    assert (await admin.call("GET", f"/api/v1/usage?key_id={key_id}"))[0] == 200
    for method, path in (
        ("PUT", "/api/v1/limits/key/nokey"),
        ("POST", "/api/v1/keys/nokey/rotate"),
        ("POST", "/api/v1/keys/nokey/revoke"),
    ):
        status, body = await admin.call(method, path, {"rpm": 1} if method == "PUT" else None)
        assert status == 404, path
        assert body["error"]["message"] == (f"No key 'nokey'; the live keys are: {key_id}."), path


async def test_a_default_band_that_names_no_band_is_refused_naming_the_bands(
    admin: Admin,
) -> None:
    status, body = await admin.call(
        "PATCH", "/api/v1/config", {"key": "router.admission.default_band", "value": "gold"}
    )
    assert status == 400
    assert body["error"]["code"] == "invalid_settings"
    assert body["error"]["message"] == (
        "Settings not valid: router.admission.default_band: no band 'gold'; the bands are: "
        "bulk, interactive (router.admission.bands)"
    )
    assert admin.live.version == 1
    status, _ = await admin.call(
        "PATCH", "/api/v1/config", {"key": "router.admission.default_band", "value": "bulk"}
    )
    assert status == 200
    # Bands replaced without the default band are taken (its keys fall back).
    status, _ = await admin.call(
        "PATCH",
        "/api/v1/config",
        {"key": "router.admission.bands", "value": [{"name": "gold", "priority": 300}]},
    )
    assert status == 200


async def test_each_key_shows_its_last_use_from_its_newest_usage_row(admin: Admin) -> None:
    _, used = await admin.call("POST", "/api/v1/keys", {"name": "used"})
    _, idle = await admin.call("POST", "/api/v1/keys", {"name": "idle"})
    await admin.store.insert_usage(
        [
            attrs.evolve(_row("req_1", 1.7e9), key_id=used["id"]),
            attrs.evolve(_row("req_2", 1.7e9 + 5), key_id=used["id"]),
        ]
    )
    status, body = await admin.call("GET", "/api/v1/keys")
    assert status == 200
    last = {k["id"]: k["last_used_at"] for k in body["data"]}
    assert last[used["id"]] == 1.7e9 + 5
    assert last[idle["id"]] is None

"""The admin API's client: where it finds the API and its key, and the errors
of the tree it raises."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from llmgw import errors
from llmgw.admin.client import AdminClient, AdminRefused, AdminUnreachable
from llmgw.auth.admin_token import AdminTokenMissing


def test_the_client_reads_the_token_and_the_address_from_the_data_dir(tmp_path: Path) -> None:
    token = "llmgw-admin-abcdefghijklmnopqrstuvwxyz"
    (tmp_path / "admin-token").write_text(token + "\n")
    client = AdminClient.from_data_dir(tmp_path)
    assert (client.base_url, client.key) == ("http://127.0.0.1:9090", token)
    (tmp_path / "run.json").write_text(json.dumps({"admin": "127.0.0.1:19090"}))
    assert AdminClient.from_data_dir(tmp_path).base_url == "http://127.0.0.1:19090"


def test_no_admin_token_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(AdminTokenMissing, match="run 'llmgw up' or 'llmgw server' first") as caught:
        AdminClient.from_data_dir(tmp_path)
    assert isinstance(caught.value, errors.NotFound)


def test_an_error_answer_is_refused_with_its_status_code_and_message() -> None:
    response = httpx.Response(
        404, json={"error": {"message": "No model 'm'.", "type": "x", "code": "model_not_found"}}
    )
    refused = AdminRefused.from_response(response)
    assert isinstance(refused, errors.Refused)
    assert (refused.status, refused.code, refused.detail) == (
        404,
        "model_not_found",
        "No model 'm'.",
    )
    assert str(refused) == "404: No model 'm'."
    other = AdminRefused.from_response(httpx.Response(502, text="Bad Gateway"))
    assert (str(other), other.code) == ("502: Bad Gateway", "")


def test_nothing_listening_is_unreachable() -> None:
    client = AdminClient("http://127.0.0.1:1", "sk-llmgw-x")
    with pytest.raises(AdminUnreachable, match="is llmgw running") as caught:
        client.call("GET", "/api/v1/status")
    assert isinstance(caught.value, errors.UpstreamError)

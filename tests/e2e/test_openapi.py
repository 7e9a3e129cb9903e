"""The OpenAPI documents in ``docs/openapi/`` checked against a running
``llmgw up --engine sim`` by schemathesis: requests generated from each
document, valid and invalid (a bounded number an operation), and every
answer is no 500 and matches its documented status, content type, headers
and schema; a method a documented client route does not take is 405 with
``Allow``; every route that needs a key refuses a request without one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "openapi"
#: admin.yaml describes every route of the admin API; the reads are checked
#: on one ``llmgw up`` shared with the client API's checks, the writes on one
#: of their own (they really stop serving, remove models, revoke keys).
ADMIN = schemathesis.openapi.from_path(DOCS / "admin.yaml")
ADMIN_READS = ADMIN.include(method="GET")
ADMIN_WRITES = ADMIN.exclude(method="GET")
CLIENT = schemathesis.openapi.from_path(DOCS / "client.yaml")
#: Examples an operation: enough to reach every documented status here,
#: few enough for CI.
EXAMPLES = 30
BOUNDED = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
#: What the issue asks of every answer. Not run: schemathesis' checks that
#: an API refuses whatever its document does not allow (llmgw ignores
#: unknown query parameters and headers, and takes more forms of ``since``
#: than a schema can say), and ``ignored_auth`` (the key is given here, not
#: through the security scheme; the key check has its own test below).
ANSWERS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def up(start_module_up: Callable[..., Any]) -> Any:
    return start_module_up("--engine", "sim", "--model-name", "sim-model")


@ADMIN_READS.parametrize()
@BOUNDED
def test_the_admin_api_answers_as_its_document_says(case: schemathesis.Case[Any], up: Any) -> None:
    case.call_and_validate(
        base_url=f"http://{up.run['admin']}",
        headers={"authorization": f"Bearer {up.admin_token}"},
        checks=[*ANSWERS, unsupported_method],
    )


@pytest.fixture(scope="module")
def up_for_writes(start_module_up: Callable[..., Any]) -> Any:
    # The hub for `POST /api/v1/models/serve` is a closed local port: this
    # machine has no internet, and a refusal answers at once.
    return start_module_up(
        "--engine",
        "sim",
        "--model-name",
        "sim-model",
        settings={
            "auth": {"default_rpm": 1_000_000, "default_tpm": 10**10},
            "weights": {"hf_endpoint": "http://127.0.0.1:9"},
        },
    )


@ADMIN_WRITES.parametrize()
@BOUNDED
def test_the_admin_api_writes_answer_as_their_document_says(
    case: schemathesis.Case[Any], up_for_writes: Any
) -> None:
    case.call_and_validate(
        base_url=f"http://{up_for_writes.run['admin']}",
        headers={"authorization": f"Bearer {up_for_writes.admin_token}"},
        checks=[*ANSWERS, unsupported_method],
    )


@CLIENT.parametrize()
@BOUNDED
def test_the_client_api_answers_as_its_document_says(case: schemathesis.Case[Any], up: Any) -> None:
    case.call_and_validate(
        base_url=up.base_url,
        headers={"authorization": f"Bearer {up.client_key}"},
        checks=[*ANSWERS, unsupported_method],
    )


def test_every_documented_route_that_needs_a_key_refuses_none(up: Any) -> None:
    for schema, base in ((ADMIN, f"http://{up.run['admin']}"), (CLIENT, up.base_url)):
        raw = schema.raw_schema
        for path, operations in raw["paths"].items():
            for method, operation in operations.items():
                if operation.get("security", raw.get("security")) in (None, []):
                    continue  # open routes: /health, /ready, /leader
                url = base + path.replace("{name}", "sim-model").replace(
                    "{request_id}", "req_" + "0" * 24
                )
                answer = httpx.request(method.upper(), url, json={}, timeout=10)
                assert answer.status_code == 401, (method, path, answer.text)
                assert answer.json()["error"]["code"] == "invalid_api_key"


def test_the_answers_about_things_that_exist_are_as_documented(up: Any) -> None:
    # Generated path parts rarely name a model or a request that exists, so
    # the documented 200 shapes of these are checked with ones that do.
    chat = httpx.post(
        f"{up.base_url}/v1/chat/completions",
        json={
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        },
        headers={"authorization": f"Bearer {up.client_key}"},
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
    request_id = chat.headers["x-request-id"]
    admin = f"http://{up.run['admin']}"
    token = {"authorization": f"Bearer {up.admin_token}"}
    for path, parameters in (
        ("/api/v1/models/{name}", {"name": "sim-model"}),
        ("/api/v1/requests/{request_id}", {"request_id": request_id}),
    ):
        case = ADMIN[path]["GET"].Case(path_parameters=parameters)
        got = up.wait_for(
            lambda case=case: (
                answer
                if (answer := case.call(base_url=admin, headers=token)).status_code == 200
                else None
            ),
            30,
            f"{path} answering 200",
        )
        case.validate_response(got, checks=ANSWERS)

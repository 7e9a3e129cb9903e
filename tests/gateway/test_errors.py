"""Errors reach clients in one shape: OpenAI's, or Anthropic's on /v1/messages
(engine errors, llmgw's refusals and failures)."""

from __future__ import annotations

import orjson
import pytest

from llmgw import errors
from llmgw.accounting.accountant import BudgetSpent, ModelNotAllowed, RateLimited
from llmgw.auth.keys import KeyRefused
from llmgw.gateway.errors import (
    anthropic_error_type,
    api_error,
    bad_request,
    engine_error,
    error_body_for,
    error_body_on,
    internal_error,
    is_anthropic_path,
    unauthorized,
)
from llmgw.gateway.upstream import UpstreamError
from llmgw.router.admission import AdmissionTimeout
from llmgw.router.router import NotReady


def test_a_llama_cpp_error_keeps_its_message_and_type_with_a_string_code() -> None:
    body = orjson.dumps(
        {
            "error": {
                "code": 400,
                "message": "request exceeds the context",
                "type": "exceed_context_size_error",
            }
        }
    )
    error = orjson.loads(engine_error(400, body).body())["error"]
    assert error == {
        "message": "request exceeds the context",
        "type": "exceed_context_size_error",
        "code": "400",
        "param": None,
    }


def test_a_body_that_is_not_json_still_gets_the_openai_shape() -> None:
    error = orjson.loads(engine_error(503, b"<html>busy</html>").body())["error"]
    assert error["type"] == "server_error"
    assert error["message"] == "The engine answered HTTP 503."
    assert set(error) == {"message", "type", "code", "param"}


# --- every llmgw error, in the client API's shapes ------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code", "retry_after"),
    [
        (
            KeyRefused("This API key has been revoked."),
            401,
            "invalid_request_error",
            "invalid_api_key",
            None,
        ),
        (
            ModelNotAllowed("m", "project web"),
            403,
            "invalid_request_error",
            "model_not_allowed",
            None,
        ),
        (
            RateLimited("key k", "requests", 10, 10, 1, 7),
            429,
            "requests",
            "rate_limit_exceeded",
            b"7",
        ),
        (
            BudgetSpent("org acme", "day", 100, 100, 0, 5, 3600),
            429,
            "insufficient_quota",
            "insufficient_quota",
            b"3600",
        ),
        (
            AdmissionTimeout(0.25, model="m", band="bulk"),
            504,
            "server_error",
            "queue_timeout",
            b"1",
        ),
        (NotReady("m"), 503, "server_error", "model_not_ready", b"5"),
        (unauthorized("No key."), 401, "invalid_request_error", "invalid_api_key", None),
    ],
)
def test_refusals_keep_their_status_type_code_message_and_retry_after(
    exc: errors.LlmgwError, status: int, kind: str, code: str, retry_after: bytes | None
) -> None:
    error = api_error(exc)
    assert (error.status, error.type, error.code) == (status, kind, code)
    assert dict(error.headers).get(b"retry-after") == retry_after
    assert orjson.loads(error_body_for(error, "chat")) == {
        "error": {"message": str(exc), "type": kind, "code": code, "param": None}
    }
    assert orjson.loads(error_body_for(error, "messages")) == {
        "type": "error",
        "error": {"type": anthropic_error_type(status), "message": str(exc)},
    }


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code", "message"),
    [
        (
            errors.StoreError("database is locked"),
            503,
            "server_error",
            "store_unavailable",
            "The gateway cannot reach its store just now; retry shortly.",
        ),
        (
            UpstreamError("connection reset", before_response=False),
            502,
            "server_error",
            "upstream_error",
            "The replica answering failed; retry.",
        ),
        (
            errors.NotFound("no request r1"),
            404,
            "invalid_request_error",
            "not_found",
            "no request r1",
        ),
        (errors.InvalidInput("bad"), 400, "invalid_request_error", "invalid_request", "bad"),
        (errors.LinkClosed("gone"), 500, "server_error", "internal_error", "internal error"),
    ],
)
def test_other_errors_get_a_status_of_their_family_and_never_their_inner_message(
    exc: errors.LlmgwError, status: int, kind: str, code: str, message: str
) -> None:
    error = api_error(exc)
    assert orjson.loads(error.body()) == {
        "error": {"message": message, "type": kind, "code": code, "param": None}
    }
    assert error.status == status
    retry_after = dict(error.headers).get(b"retry-after")
    assert retry_after == (b"5" if status == 503 else None)


def test_an_api_error_is_answered_as_it_is_with_its_param() -> None:
    error = bad_request("'n' must be a whole number from 1 to 128.", param="n")
    assert api_error(error) is error
    assert isinstance(error, errors.LlmgwError)
    assert orjson.loads(error_body_for(error, "responses"))["error"]["param"] == "n"
    assert orjson.loads(error_body_for(error, "messages"))["error"]["type"] == (
        "invalid_request_error"
    )


@pytest.mark.parametrize(
    ("path", "anthropic_shaped"),
    [
        ("/v1/messages", True),
        ("/v1/messages/count_tokens", True),
        ("/v1/messages/batches/msgbatch_1", True),
        ("/v1/messagesx", False),
        ("/v1/chat/completions", False),
        ("/v1/models", False),
        ("/nowhere", False),
    ],
)
def test_anthropics_paths_are_its_own_and_every_one_below_it(
    path: str, anthropic_shaped: bool
) -> None:
    assert is_anthropic_path(path) is anthropic_shaped
    doc = orjson.loads(error_body_on(path, internal_error()))
    if anthropic_shaped:
        assert doc == {"type": "error", "error": {"type": "api_error", "message": "internal error"}}
    else:
        assert doc["error"]["code"] == "internal_error"
    assert orjson.loads(error_body_for(internal_error(), "count_tokens"))["type"] == "error"


def test_an_api_error_answered_holds_no_traceback() -> None:
    # The handler keeps the error in a local while it answers: a traceback
    # holding that frame made a reference cycle per error answered.
    try:
        raise unauthorized("No key.")
    except errors.LlmgwError as exc:
        error = api_error(exc)
    assert error.__traceback__ is None
    assert (error.status, error.code) == (401, "invalid_api_key")

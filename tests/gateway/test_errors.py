"""Engine errors reach clients in OpenAI's error shape."""

from __future__ import annotations

import orjson

from llmgw.gateway.errors import engine_error


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

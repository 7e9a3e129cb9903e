"""Guardrails on the gateway's request path, in process (``docs/guardrails.md``):
prompts refused in each API's shape, redacted before the engine sees them."""

from __future__ import annotations

import importlib
from typing import Any

from llmgw.settings import ServerSettings, settings_from_doc

# The in-process rig (gateway, sim engine, store) of test_gateway_inprocess.py.
_inprocess = importlib.import_module("test_gateway_inprocess")
rig = _inprocess.rig
Rig = Any

CHAT = "/v1/chat/completions"
AWS = "AKIAIOSFODNN7EXAMPLE"


def _apply(rig: Rig, guard: dict[str, Any]) -> None:
    rig.cluster.apply_settings(settings_from_doc({"guard": guard}))


def _chat(text: str, **more: Any) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": text}], **more}


async def test_baseline_refuses_a_secret_in_a_prompt_in_each_apis_shape(rig: Rig) -> None:
    rig.cluster.apply_settings(ServerSettings())
    got = await rig.call("POST", CHAT, _chat(f"my key is {AWS}"))
    assert got.status == 400, got.body
    error = got.json()["error"]
    assert error["code"] == "content_filter"
    assert error["type"] == "invalid_request_error"
    assert "secret:aws_access_key" in error["message"]
    assert AWS not in got.body.decode()
    row = await rig.row(got.headers[b"x-request-id"])
    assert row.status == 400

    got = await rig.call(
        "POST",
        "/v1/messages",
        {"model": "sim", "max_tokens": 5, "messages": [{"role": "user", "content": AWS}]},
    )
    assert got.status == 400, got.body
    doc = got.json()
    assert doc["type"] == "error"
    assert doc["error"]["type"] == "invalid_request_error"
    assert "content policy" in doc["error"]["message"]

    got = await rig.call("POST", "/v1/responses", {"model": "sim", "input": f"key {AWS}"})
    assert got.status == 400, got.body
    assert got.json()["error"]["code"] == "content_filter"


async def test_a_redacted_prompt_reaches_the_engine_with_its_placeholder(rig: Rig) -> None:
    """The sim counts a prompt's whitespace-separated words: the phone (four
    words) redacted to ``[PHONE_1]`` counts as one, as the placeholder does."""
    _apply(rig, {"default": ["p"], "policies": {"p": {"input": {"pii": {"phone": "redact"}}}}})
    redacted = await rig.call("POST", CHAT, _chat("call +44 20 7946 0958 now", max_tokens=2))
    plain = await rig.call("POST", CHAT, _chat("call [PHONE_1] now", max_tokens=2))
    assert redacted.status == plain.status == 200
    assert redacted.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    unguarded = await rig.call("POST", CHAT, _chat("call +44 20 7946 0958 now", max_tokens=2))
    assert unguarded.status == 200
    _apply(rig, {"enabled": False})
    unguarded = await rig.call("POST", CHAT, _chat("call +44 20 7946 0958 now", max_tokens=2))
    assert unguarded.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + 3


async def test_a_policy_attached_to_the_project_by_path_adds_to_the_defaults(rig: Rig) -> None:
    _apply(
        rig,
        {
            "policies": {"no-zeus": {"input": {"deny": ["(?i)zeus"]}}},
            "attach": {"project:acme/search/web": ["no-zeus"]},
        },
    )
    got = await rig.call("POST", CHAT, _chat("tell me about Zeus"))
    assert got.status == 400, got.body
    assert "deny:no-zeus:0" in got.json()["error"]["message"]
    _apply(rig, {"attach": {"project:acme/search/other": ["baseline"]}})
    assert (await rig.call("POST", CHAT, _chat("tell me about Zeus"))).status == 200

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
    assert (row.guard_rules, row.guard_action) == ("secret:aws_access_key", "block")
    assert row.guard_ms > 0

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


def _saying(text: str, **more: Any) -> dict[str, Any]:
    """A chat request the sim answers with ``{"say": text}`` (a schema's
    ``const``), streamed in pieces of 8 characters."""
    schema = {"type": "object", "properties": {"say": {"const": text}}, "required": ["say"]}
    return _chat(
        "answer",
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        **more,
    )


def _stream_text(body: bytes) -> tuple[str, list[str]]:
    import orjson

    text, finishes = [], []
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        doc = orjson.loads(line[6:])
        for choice in doc.get("choices") or []:
            text.append(choice.get("delta", {}).get("content") or "")
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    return "".join(text), finishes


async def test_a_secret_in_an_answer_stops_it_with_content_filter(rig: Rig) -> None:
    rig.cluster.apply_settings(ServerSettings())
    got = await rig.call("POST", CHAT, _saying(f"the key is {AWS} ok"))
    assert got.status == 200, got.body
    choice = got.json()["choices"][0]
    assert choice["finish_reason"] == "content_filter"
    assert choice["message"]["content"] == '{"say":"the key is '
    assert AWS not in got.body.decode()
    # The guard events: the rule, its direction and action; never the text.
    row = await rig.row(got.headers[b"x-request-id"])
    events = await rig.store.list_guard_events(request_id=row.request_id)
    assert [(e.direction, e.rule, e.action) for e in events] == [
        ("output", "secret:aws_access_key", "block")
    ]
    assert (events[0].key_id, events[0].model) == (row.key_id, row.model)

    # Streamed: the sim sends it in pieces of 8 characters, so the key is
    # split over events; it is still caught and never sent.
    got = await rig.call(
        "POST",
        CHAT,
        _saying(f"the key is {AWS} ok", stream=True, stream_options={"include_usage": True}),
    )
    assert got.status == 200
    text, finishes = _stream_text(got.body)
    assert AWS[:8] not in text
    assert text == '{"say":"the key is '
    assert finishes == ["content_filter"]
    assert b'"usage"' in got.body
    assert got.body.rstrip().endswith(b"data: [DONE]")


async def test_an_anthropic_stream_with_a_secret_ends_in_refusal(rig: Rig) -> None:
    rig.cluster.apply_settings(ServerSettings())
    _apply(rig, {"policies": {"p": {"output": {"deny": ["tok1"]}}}, "default": ["p"]})
    got = await rig.call(
        "POST",
        "/v1/messages",
        {
            "model": "sim",
            "max_tokens": 5,
            "stream": True,
            "messages": [{"role": "user", "content": "answer"}],
        },
    )
    assert got.status == 200, got.body
    assert b'"stop_reason":"refusal"' in got.body
    assert b"tok1" not in got.body
    assert b"tok0" in got.body
    whole = await rig.call(
        "POST",
        "/v1/messages",
        {"model": "sim", "max_tokens": 5, "messages": [{"role": "user", "content": "answer"}]},
    )
    assert whole.json()["stop_reason"] == "refusal"
    assert whole.json()["content"][0]["text"] == "tok0 "
    responses = await rig.call(
        "POST", "/v1/responses", {"model": "sim", "input": "answer", "max_output_tokens": 5}
    )
    assert responses.json()["status"] == "incomplete"
    assert responses.json()["incomplete_details"] == {"reason": "content_filter"}


async def test_a_card_number_in_an_answer_is_masked_streamed_or_not(rig: Rig) -> None:
    rig.cluster.apply_settings(ServerSettings())
    got = await rig.call("POST", CHAT, _saying("card 4111 1111 1111 1111 thanks"))
    assert got.json()["choices"][0]["message"]["content"] == (
        '{"say":"card **** **** **** 1111 thanks"}'
    )
    got = await rig.call("POST", CHAT, _saying("card 4111 1111 1111 1111 thanks", stream=True))
    text, finishes = _stream_text(got.body)
    assert text == '{"say":"card **** **** **** 1111 thanks"}'
    assert finishes == ["stop"]


async def test_placeholders_are_restored_in_the_answer_streamed_or_not(rig: Rig) -> None:
    _apply(
        rig,
        {
            "default": ["p"],
            "policies": {"p": {"input": {"pii": {"email": "redact"}, "restore": True}}},
        },
    )
    body = _saying("write to [EMAIL_1] or [EMAIL_2]")
    body["messages"][0]["content"] = "mail jane@example.com and bob@example.org"
    got = await rig.call("POST", CHAT, body)
    assert got.json()["choices"][0]["message"]["content"] == (
        '{"say":"write to jane@example.com or bob@example.org"}'
    )
    body["stream"] = True  # placeholders cut over the sim's 8-character pieces
    got = await rig.call("POST", CHAT, body)
    text, finishes = _stream_text(got.body)
    assert text == '{"say":"write to jane@example.com or bob@example.org"}'
    assert finishes == ["stop"]


async def test_answers_are_cached_per_policies_and_never_with_restore(rig: Rig) -> None:
    path = await rig.store.find_project("acme", "search", "web")
    assert path is not None
    cache = {"projects": {path.project.id: 600}}
    body = _chat("cache me", max_tokens=3)

    rig.cluster.apply_settings(settings_from_doc({"router": {"cache": cache}}))
    first = await rig.call("POST", CHAT, body)
    again = await rig.call("POST", CHAT, body)
    assert b"x-llmgw-cache" not in first.headers
    assert again.headers.get(b"x-llmgw-cache") == b"hit"

    # Other policies: not the answer kept under baseline.
    rig.cluster.apply_settings(
        settings_from_doc({"router": {"cache": cache}, "guard": {"default": ["observe"]}})
    )
    assert b"x-llmgw-cache" not in (await rig.call("POST", CHAT, body)).headers

    restoring = {
        "default": ["p"],
        "policies": {"p": {"input": {"pii": {"email": "redact"}, "restore": True}}},
    }
    rig.cluster.apply_settings(settings_from_doc({"router": {"cache": cache}, "guard": restoring}))
    for _ in range(2):
        got = await rig.call("POST", CHAT, body)
        assert got.status == 200
        assert b"x-llmgw-cache" not in got.headers


def test_text_held_when_the_engine_ends_without_a_finish_reason_comes_before_done() -> None:
    from llmgw.gateway.guarded import GuardedStream
    from llmgw.gateway.sse import SseRelay
    from llmgw.guard import Guards, Redactor, Verdict
    from llmgw.guard.output import OutputGuard

    guard = Guards().for_request(ServerSettings().guard, "k", ("", "", ""))
    assert guard is not None
    output = OutputGuard(guard.output, Verdict(), Redactor(), restore=False)
    stream = GuardedStream(SseRelay(pass_usage=False), output)
    out = stream.feed(
        b'data: {"choices":[{"index":0,"delta":{"content":"card 4111 1111 1111 1111"}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    out += stream.finish()
    assert out.index(b"**** **** **** 1111") < out.index(b"[DONE]")
    assert b"4111" not in out


def _calling(value: str, **more: Any) -> dict[str, Any]:
    """A chat request the sim answers with a call ``send({"to": value})``,
    the arguments streamed in pieces of 8 characters."""
    tool = {
        "type": "function",
        "function": {
            "name": "send",
            "parameters": {
                "type": "object",
                "properties": {"to": {"const": value}},
                "required": ["to"],
            },
        },
    }
    return _chat("call it", tools=[tool], **more)


def _stream_calls(body: bytes) -> tuple[str, list[str]]:
    """The streamed tool calls' arguments joined, and the finish reasons."""
    import orjson

    arguments, finishes = [], []
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        for choice in orjson.loads(line[6:]).get("choices") or []:
            for call in choice.get("delta", {}).get("tool_calls") or []:
                arguments.append(call.get("function", {}).get("arguments") or "")
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    return "".join(arguments), finishes


async def test_tool_call_arguments_are_guarded_in_prompts_and_in_answers(rig: Rig) -> None:
    rig.cluster.apply_settings(ServerSettings())
    # In a prompt: an earlier call's arguments carry a key.
    asked = _chat("go on")
    asked["messages"] = [
        {"role": "user", "content": "store it"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "send", "arguments": f'{{"key": "{AWS}"}}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    got = await rig.call("POST", CHAT, asked)
    assert got.status == 400, got.body
    assert "secret:aws_access_key" in got.json()["error"]["message"]

    # In an answer, whole: the call is dropped, the choice ends in content_filter.
    got = await rig.call("POST", CHAT, _calling(f"key {AWS}"))
    assert got.status == 200, got.body
    choice = got.json()["choices"][0]
    assert choice["finish_reason"] == "content_filter"
    assert "tool_calls" not in choice["message"]
    assert AWS not in got.body.decode()
    row = await rig.row(got.headers[b"x-request-id"])
    events = await rig.store.list_guard_events(request_id=row.request_id)
    assert [(e.direction, e.rule) for e in events] == [("output", "secret:aws_access_key")]

    # Streamed, split over pieces: a card number masked, the JSON whole.
    card = "4111 1111 1111 1111"
    got = await rig.call("POST", CHAT, _calling(card, stream=True))
    assert got.status == 200, got.body
    arguments, finishes = _stream_calls(got.body)
    assert arguments == '{"to":"**** **** **** 1111"}'
    assert finishes == ["tool_calls"]

    # Streamed with a key: stopped, never sent.
    got = await rig.call("POST", CHAT, _calling(f"key {AWS}", stream=True))
    arguments, finishes = _stream_calls(got.body)
    assert AWS[:8] not in arguments
    assert finishes == ["content_filter"]
    assert got.body.rstrip().endswith(b"data: [DONE]")

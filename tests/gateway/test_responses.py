"""OpenAI Responses over chat completions: the request, the answer and the
stream, checked against the official ``openai`` SDK's types."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pydantic
import pytest
import trio
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from llmgw.engines.testing import open_sim
from llmgw.gateway.errors import ApiError
from llmgw.gateway.responses import ResponsesStream, chat_to_response, request_to_chat

EVENTS: pydantic.TypeAdapter[ResponseStreamEvent] = pydantic.TypeAdapter(ResponseStreamEvent)
USAGE = {
    "prompt_tokens": 20,
    "completion_tokens": 9,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 16},
}
RESPONSE_USAGE = {
    "input_tokens": 20,
    "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
    "output_tokens": 9,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 29,
}


def _chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    *,
    usage: dict[str, Any] | None = None,
    choices: bool = True,
) -> bytes:
    doc: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "choices": []}
    if choices:
        doc["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _events(data: bytes) -> list[dict[str, Any]]:
    """SSE bytes as event documents; names match types, sequence numbers count up."""
    docs = []
    for frame in data.decode().split("\n\n")[:-1]:
        name_line, data_line = frame.split("\n")
        doc = orjson.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {doc['type']}"
        docs.append(doc)
    return docs


def _sdk_final(docs: list[dict[str, Any]]) -> Response:
    """Each event validated by the SDK's types and fed to its stream state;
    the final response it built (also validated)."""
    assert [d["sequence_number"] for d in docs] == list(range(len(docs)))
    state: ResponseStreamState[object] = ResponseStreamState(input_tools=omit, text_format=omit)
    for doc in docs:
        state.handle_event(EVENTS.validate_python(doc))
    last = docs[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    return Response.model_validate(last["response"])


def _kinds(docs: list[dict[str, Any]]) -> list[str]:
    return [d["type"].removeprefix("response.") for d in docs]


# -- the request ------------------------------------------------------------------------


def test_a_full_request_becomes_a_chat_request() -> None:
    doc = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city":"Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "And this?"},
                    {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"},
                ],
            },
        ],
        "max_output_tokens": 100,
        "temperature": 0.2,
        "top_p": 0.5,
        "stream": True,
        "tools": [
            {
                "type": "function",
                "name": "weather",
                "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True,
            }
        ],
        "tool_choice": {"type": "function", "name": "weather"},
        "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "user": "u1",
        "store": False,
        "metadata": {"k": "v"},
    }
    assert request_to_chat(doc) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use metric units."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "And this?"},
                    {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
                ],
            },
        ],
        "max_tokens": 100,
        "temperature": 0.2,
        "top_p": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "Weather now",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}},
        },
        "user": "u1",
    }


def test_a_string_input_is_one_user_message_and_function_calls_alone_make_an_assistant_turn() -> (
    None
):
    assert request_to_chat({"model": "m", "input": "hi"}) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    }
    chat = request_to_chat(
        {
            "model": "m",
            "input": [
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "1"},
                {
                    "type": "function_call_output",
                    "call_id": "b",
                    "output": [{"type": "input_text", "text": "2"}],
                },
            ],
            "text": {"format": {"type": "json_object"}},
        }
    )
    assert chat["messages"] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
    ]
    assert chat["response_format"] == {"type": "json_object"}


def _request(**fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": "m", "input": "x", **fields}
    return {k: v for k, v in doc.items() if v is not None}


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        (_request(model=None), "model"),
        (_request(input=None), "input"),
        (_request(input=[]), "input"),
        (_request(input=[{"type": "reasoning", "summary": []}]), "input"),
        (_request(input=[{"role": "tool", "content": "x"}]), "input.0.role"),
        (_request(input=[{"role": "user", "content": 5}]), "input.0.content"),
        (
            _request(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]),
            "input.0.content.0.type",
        ),
        (
            _request(
                input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]
            ),
            "input.0.content.0.image_url",
        ),
        (
            _request(
                input=[
                    {
                        "role": "assistant",
                        "content": [{"type": "input_image", "image_url": "https://x"}],
                    }
                ]
            ),
            "input.0.content",
        ),
        (_request(input=[{"type": "item_reference", "id": "x"}]), "input.0.type"),
        (_request(input=[{"type": "function_call", "name": "f"}]), "input.0.call_id"),
        (_request(input=[{"type": "function_call_output", "output": "x"}]), "input.0.call_id"),
        (_request(previous_response_id="resp_1"), "previous_response_id"),
        (_request(instructions=3), "instructions"),
        (_request(max_output_tokens=0), "max_output_tokens"),
        (_request(temperature=5), "temperature"),
        (_request(top_p="x"), "top_p"),
        (_request(stream=1), "stream"),
        (_request(tools=[{"type": "web_search"}]), "tools.0.type"),
        (_request(tools=[{"type": "function"}]), "tools.0.name"),
        (_request(tools=[{"type": "function", "name": "f"}], tool_choice="any"), "tool_choice"),
        (_request(text={"format": {"type": "xml"}}), "text.format.type"),
        (_request(text={"format": {"type": "json_schema"}}), "text.format.schema"),
        (_request(user=7), "user"),
    ],
)
def test_bad_requests_are_refused_with_400_naming_the_field(
    doc: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as caught:
        request_to_chat(doc)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert caught.value.type == "invalid_request_error"


# -- the answer -------------------------------------------------------------------------


def _completion(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "engine",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": USAGE,
    }


def test_a_text_answer_becomes_a_completed_response() -> None:
    request = {"model": "m", "input": "hi", "temperature": 0.3, "instructions": "Be brief."}
    doc = chat_to_response(
        _completion({"role": "assistant", "content": "Hello."}, "stop"),
        "m",
        response_id="resp_1",
        request=request,
    )
    response = Response.model_validate(doc)
    assert response.id == "resp_1"
    assert response.object == "response"
    assert response.created_at == 1700000000
    assert response.status == "completed"
    assert response.incomplete_details is None
    assert response.output_text == "Hello."
    assert response.temperature == 0.3
    assert response.instructions == "Be brief."
    assert doc["output"][0]["type"] == "message"
    assert doc["output"][0]["id"].startswith("msg_")
    assert doc["output"][0]["status"] == "completed"
    assert doc["output"][0]["content"] == [
        {"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}
    ]
    assert doc["usage"] == RESPONSE_USAGE


def test_reasoning_and_tool_calls_become_reasoning_and_function_call_items() -> None:
    doc = chat_to_response(
        _completion(
            {
                "role": "assistant",
                "reasoning_content": "Need weather.",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
                    }
                ],
            },
            "tool_calls",
        ),
        "m",
    )
    response = Response.model_validate(doc)
    assert response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    call = doc["output"][1]
    assert call["id"].startswith("fc_")
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "call_1",
        "weather",
        '{"city":"Oslo"}',
        "completed",
    )
    assert doc["output"][0]["content"] == [{"type": "reasoning_text", "text": "Need weather."}]
    assert response.status == "completed"


def test_a_length_stop_is_an_incomplete_response() -> None:
    doc = chat_to_response(_completion({"role": "assistant", "content": "Hel"}, "length"), "m")
    response = Response.model_validate(doc)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert doc["output"][0]["status"] == "incomplete"


def test_an_empty_answer_is_still_a_valid_response_with_one_empty_message() -> None:
    doc = chat_to_response({"choices": []}, "m", created_at=5)
    response = Response.model_validate(doc)
    assert response.output_text == ""
    assert response.usage is None
    assert response.created_at == 5


# -- the stream -------------------------------------------------------------------------

TEXT_STREAM = (
    _chunk({"role": "assistant", "content": ""})
    + _chunk({"content": "Hello"})
    + _chunk({"content": " world"})
    + _chunk(finish="stop")
    + _chunk(usage=USAGE, choices=False)
    + DONE
)

MIXED_STREAM = (
    _chunk({"role": "assistant", "reasoning_content": "Let me "})
    + _chunk({"reasoning_content": "think."})
    + _chunk({"content": "Checking."})
    + _chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        }
    )
    + _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]})
    + _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Oslo"}'}}]})
    + _chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "time"}}]})
    # The finish chunk also carries the usage.
    + _chunk({}, "tool_calls", usage=USAGE)
    + DONE
)


def test_a_text_stream_follows_the_responses_event_sequence() -> None:
    stream = ResponsesStream("m", "resp_1", request={"model": "m", "input": "x"}, created_at=7)
    docs = _events(stream.feed(TEXT_STREAM))
    assert _kinds(docs) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    item_id = docs[2]["item"]["id"]
    assert docs[2]["item"] == {
        "id": item_id,
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    assert docs[4] == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        "item_id": item_id,
        "output_index": 0,
        "content_index": 0,
        "delta": "Hello",
        "logprobs": [],
    }
    assert docs[6]["text"] == "Hello world"
    assert docs[0]["response"]["status"] == "in_progress"
    final = _sdk_final(docs)
    assert final.id == "resp_1"
    assert final.status == "completed"
    assert final.output_text == "Hello world"
    assert final.usage is not None
    assert final.usage.input_tokens == 20
    assert final.usage.input_tokens_details.cached_tokens == 16
    assert final.usage.output_tokens == 9
    assert stream.done
    assert stream.saw_first_content
    assert stream.content_chunks == 2
    assert stream.usage is not None
    assert stream.usage.prompt_tokens == 20
    assert stream.finish() == b""
    assert stream.feed(TEXT_STREAM) == b""


def test_reasoning_text_and_function_calls_stream_as_their_own_items() -> None:
    stream = ResponsesStream("m", "resp_2")
    docs = _events(stream.feed(MIXED_STREAM))
    assert _kinds(docs) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "output_item.added",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    assert [d["output_index"] for d in docs if d["type"] == "response.output_item.added"] == [
        0,
        1,
        2,
        3,
    ]
    assert docs[18]["arguments"] == '{"city": "Oslo"}'
    assert docs[18]["name"] == "weather"
    final = _sdk_final(docs)
    assert [item.type for item in final.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    calls = docs[-1]["response"]["output"][2:]
    assert [(c["call_id"], c["name"], c["arguments"]) for c in calls] == [
        ("call_a", "weather", '{"city": "Oslo"}'),
        ("call_b", "time", ""),
    ]
    assert docs[-1]["response"]["output"][0]["content"] == [
        {"type": "reasoning_text", "text": "Let me think."}
    ]
    assert stream.content_chunks == 7


@pytest.mark.parametrize("sample", [TEXT_STREAM, MIXED_STREAM])
def test_the_stream_cut_at_every_byte_gives_the_same_events(sample: bytes) -> None:
    def ids_masked(data: bytes) -> list[dict[str, Any]]:
        # Item ids are random per stream; compare the rest.
        text = data.decode()
        for prefix in ("msg_", "rs_", "fc_"):
            while (start := text.find(f'"{prefix}')) >= 0:
                end = text.index('"', start + 1)
                text = text[:start] + '"ID' + text[end:]
        return _events(text.encode())

    whole = ids_masked(ResponsesStream("m", "resp_s", created_at=1).feed(sample))
    for cut in range(0, len(sample) + 1, 3):
        stream = ResponsesStream("m", "resp_s", created_at=1)
        assert ids_masked(stream.feed(sample[:cut]) + stream.feed(sample[cut:])) == whole, cut


def test_a_length_stop_ends_with_response_incomplete() -> None:
    stream = ResponsesStream("m", "resp_3")
    docs = _events(stream.feed(_chunk({"content": "Hel"}) + _chunk({}, "length") + DONE))
    assert docs[-1]["type"] == "response.incomplete"
    assert docs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert docs[-2]["item"]["status"] == "incomplete"
    # No usage from the engine: the content chunks stand in for output tokens.
    assert docs[-1]["response"]["usage"]["output_tokens"] == 1
    for doc in docs:
        EVENTS.validate_python(doc)
    assert Response.model_validate(docs[-1]["response"]).status == "incomplete"


def test_finish_closes_a_stream_cut_short_and_an_engine_error_fails_it() -> None:
    stream = ResponsesStream("m", "resp_4")
    docs = _events(stream.feed(_chunk({"content": "a"})) + stream.finish())
    assert _kinds(docs)[-4:] == [
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    _sdk_final(docs)
    assert stream.finish() == b""

    failing = ResponsesStream("m", "resp_5")
    error = b'data: {"error": {"message": "boom"}}\n\n'
    docs = _events(failing.feed(_chunk({"content": "a"}) + error))
    assert docs[-1]["type"] == "response.failed"
    assert docs[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert failing.engine_error == "boom"
    assert failing.done
    for doc in docs:
        EVENTS.validate_python(doc)
    assert failing.error_event("again") == b""


# -- against the sim engine -------------------------------------------------------------


async def test_a_request_through_the_sim_engine_comes_back_as_responses() -> None:
    doc: dict[str, Any] = {
        "model": "sim-model",
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]}],
        "max_output_tokens": 50,
        "tools": [
            {
                "type": "function",
                "name": "weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            }
        ],
    }
    with trio.fail_after(30):
        async with (
            open_sim("--tokens", "5") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            whole = await client.post("/v1/chat/completions", json=request_to_chat(doc))
            response = Response.model_validate(chat_to_response(whole.json(), "m", request=doc))
            assert [item.type for item in response.output] == ["function_call"]
            call = response.output[0]
            assert call.type == "function_call"
            assert (call.name, orjson.loads(call.arguments)) == ("weather", {"city": "sim"})
            assert response.tools[0].type == "function"

            chat = request_to_chat({**doc, "stream": True, "tools": None})
            stream = ResponsesStream("m", "resp_sim")
            out = b""
            async with client.stream("POST", "/v1/chat/completions", json=chat) as answer:
                async for piece in answer.aiter_raw():
                    out += stream.feed(piece)
            out += stream.finish()
            final = _sdk_final(_events(out))
            assert final.output_text == "tok0 tok1 tok2 tok3 tok4 "
            assert final.usage is not None
            assert final.usage.output_tokens == 5


@pytest.mark.parametrize("calls", [3, "call", {"id": "c"}, None])
def test_an_engine_s_tool_calls_that_are_not_a_list_make_no_function_call_items(
    calls: object,
) -> None:
    """Found by fuzzing (``fuzz/corpus/answers``): an int raised TypeError."""
    doc = chat_to_response(
        _completion({"role": "assistant", "content": "Hi.", "tool_calls": calls}, "stop"),
        "m",
        request={"model": "m", "input": "hi"},
    )
    assert [item["type"] for item in doc["output"]] == ["message"]

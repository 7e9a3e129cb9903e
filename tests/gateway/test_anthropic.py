"""Anthropic Messages over OpenAI chat: the request, the answer and the stream,
checked against the official ``anthropic`` SDK's types."""

from __future__ import annotations

from typing import Any

import anthropic.types
import httpx
import orjson
import pydantic
import pytest
import trio
from anthropic.lib.streaming._messages import accumulate_event

from llmgw.engines.testing import open_sim
from llmgw.gateway.anthropic import (
    ChatChunkReader,
    MessagesStream,
    chat_to_message,
    error_event,
    request_to_chat,
    tool_input,
)
from llmgw.gateway.errors import ApiError, anthropic_error_body

EVENTS: pydantic.TypeAdapter[anthropic.types.RawMessageStreamEvent] = pydantic.TypeAdapter(
    anthropic.types.RawMessageStreamEvent
)
USAGE = {
    "prompt_tokens": 20,
    "completion_tokens": 9,
    "total_tokens": 29,
    "prompt_tokens_details": {"cached_tokens": 16},
}


# -- helpers ----------------------------------------------------------------------------


def _chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    *,
    usage: dict[str, Any] | None = None,
    choices: bool = True,
) -> bytes:
    doc: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "engine-model",
        "choices": [],
    }
    if choices:
        doc["choices"] = [
            {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        ]
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _events(data: bytes) -> list[dict[str, Any]]:
    """Anthropic SSE bytes as event documents; each ``event:`` name must
    match its data's ``type``."""
    assert data.endswith(b"\n\n")
    docs = []
    for frame in data.decode().split("\n\n")[:-1]:
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ")
        assert data_line.startswith("data: ")
        doc = orjson.loads(data_line[len("data: ") :])
        assert doc["type"] == name_line[len("event: ") :]
        docs.append(doc)
    return docs


def _sdk_message(docs: list[dict[str, Any]]) -> anthropic.types.Message:
    """Every event validated by the SDK's types, then accumulated as the SDK does."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for doc in docs:
        event = EVENTS.validate_python(doc)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    return anthropic.types.Message.model_validate(snapshot.model_dump())


def _kinds(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        kind = doc["type"]
        if kind == "content_block_start":
            kind += ":" + doc["content_block"]["type"]
        elif kind == "content_block_delta":
            kind += ":" + doc["delta"]["type"]
        out.append(kind)
    return out


# -- the request ------------------------------------------------------------------------


def test_a_full_request_becomes_an_openai_chat_request() -> None:
    doc = {
        "model": "claude-ish",
        "max_tokens": 256,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "What is in this picture?"},
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}},
                    {"type": "text", "text": "Describe both."},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "zoom", "input": {"level": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "zoomed"},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stream": True,
        "tools": [
            {
                "name": "zoom",
                "description": "Zoom in",
                "input_schema": {"type": "object", "properties": {"level": {"type": "integer"}}},
            }
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u-42"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    assert request_to_chat(doc) == {
        "model": "claude-ish",
        "max_tokens": 256,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is in this picture?"},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                    {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
                    {"type": "text", "text": "Describe both."},
                ],
            },
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "zoom", "arguments": '{"level":2}'},
                    }
                ],
            },
            # The tool result comes first, then the rest of the user's turn.
            {"role": "tool", "tool_call_id": "toolu_1", "content": "zoomed"},
            {"role": "user", "content": "Here:"},
        ],
        "stop": ["END"],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "zoom",
                    "description": "Zoom in",
                    "parameters": {
                        "type": "object",
                        "properties": {"level": {"type": "integer"}},
                    },
                },
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "user": "u-42",
    }


def test_a_minimal_request_adds_nothing_unasked() -> None:
    chat = request_to_chat(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat == {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "zoom"}, {"type": "function", "function": {"name": "zoom"}}),
    ],
)
def test_tool_choice_maps_to_openai(choice: dict[str, Any], expected: Any) -> None:
    chat = request_to_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "zoom", "input_schema": {"type": "object"}}],
            "tool_choice": choice,
        }
    )
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object"}}}
    ]


def test_tool_results_alone_make_no_empty_user_message_and_their_images_follow_them() -> None:
    chat = request_to_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "a", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "b", "name": "g", "input": {"q": "x"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "a", "content": "one"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "b",
                            "is_error": True,
                            "content": [
                                {"type": "text", "text": "two"},
                                {"type": "text", "text": "lines"},
                            ],
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "c",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {"type": "url", "url": "https://x/p.png"},
                                }
                            ],
                        }
                    ],
                },
            ],
        }
    )
    assert chat["messages"] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "g", "arguments": '{"q":"x"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": "two\nlines"},
        {"role": "tool", "tool_call_id": "c", "content": ""},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://x/p.png"}}],
        },
    ]


def test_several_text_blocks_join_into_one_string_and_text_documents_are_text() -> None:
    chat = request_to_chat(
        {
            "model": "m",
            "max_tokens": 5,
            "system": "sys",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {
                            "type": "document",
                            "title": "notes",
                            "source": {"type": "text", "media_type": "text/plain", "data": "b"},
                        },
                    ],
                }
            ],
        }
    )
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nnotes\nb"},
    ]


def _request(**fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
    }
    doc.update(fields)
    return {k: v for k, v in doc.items() if v is not None}


@pytest.mark.parametrize(
    ("doc", "param"),
    [
        (_request(model=None), "model"),
        (_request(model=""), "model"),
        (_request(max_tokens=None), "max_tokens"),
        (_request(max_tokens=0), "max_tokens"),
        (_request(max_tokens="5"), "max_tokens"),
        (_request(max_tokens=True), "max_tokens"),
        (_request(messages=[]), "messages"),
        (_request(messages="hi"), "messages"),
        (_request(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
        (_request(messages=[{"role": "user", "content": 3}]), "messages.0.content"),
        (
            _request(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
            "messages.0.content.0.type",
        ),
        (
            _request(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            "messages.0.content.0.text",
        ),
        (
            _request(
                messages=[
                    {"role": "user", "content": "x"},
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                    },
                ]
            ),
            "messages.1.content.0.source.type",
        ),
        (
            _request(
                messages=[
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "input": {}}]}
                ]
            ),
            "messages.0.content.0.name",
        ),
        (
            _request(
                messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]
            ),
            "messages.0.content.0.tool_use_id",
        ),
        (_request(system=[{"type": "image"}]), "system.0.type"),
        (_request(system=5), "system"),
        (_request(stop_sequences="END"), "stop_sequences"),
        (_request(temperature="hot"), "temperature"),
        (_request(temperature=3), "temperature"),
        (_request(top_p=1.5), "top_p"),
        (_request(top_k=-1), "top_k"),
        (_request(stream="yes"), "stream"),
        (_request(tools={"name": "x"}), "tools"),
        (_request(tools=[{"name": "x"}]), "tools.0.input_schema"),
        (_request(tools=[{"input_schema": {}}]), "tools.0.name"),
        (_request(tools=[{"type": "web_search_20250305", "name": "web"}]), "tools.0.type"),
        (_request(tool_choice={"type": "maybe"}), "tool_choice.type"),
        (_request(tool_choice={"type": "tool"}), "tool_choice.name"),
        (_request(tool_choice="auto"), "tool_choice"),
        (_request(metadata={"user_id": 5}), "metadata.user_id"),
    ],
)
def test_bad_requests_are_refused_with_400_naming_the_field(
    doc: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as caught:
        request_to_chat(doc)
    assert caught.value.status == 400
    assert caught.value.type == "invalid_request_error"
    assert caught.value.param == param
    assert param.split(".")[0] in caught.value.message


def test_a_count_tokens_body_may_leave_max_tokens_out_but_not_give_a_bad_one() -> None:
    chat = request_to_chat(_request(max_tokens=None, system="sys"), counting=True)
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "x"}],
    }
    assert request_to_chat(_request(max_tokens=7), counting=True)["max_tokens"] == 7
    for bad in (0, "5", True):
        with pytest.raises(ApiError) as caught:
            request_to_chat(_request(max_tokens=bad), counting=True)
        assert caught.value.param == "max_tokens"


# -- the answer -------------------------------------------------------------------------


def _completion(message: dict[str, Any], finish: str | None, **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "engine-model",
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, **choice}
        ],
        "usage": USAGE,
    }


def test_an_answer_with_reasoning_text_and_tool_calls_becomes_an_anthropic_message() -> None:
    chat = _completion(
        {
            "role": "assistant",
            "reasoning_content": "Think first.",
            "content": "Calling.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "zoom", "arguments": '{"level": 2}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": ""}},
            ],
        },
        "tool_calls",
    )
    message = chat_to_message(chat, "claude-ish", message_id="msg_x")
    assert message == {
        "id": "msg_x",
        "type": "message",
        "role": "assistant",
        "model": "claude-ish",
        "content": [
            {"type": "thinking", "thinking": "Think first.", "signature": ""},
            {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "call_1", "name": "zoom", "input": {"level": 2}},
            {"type": "tool_use", "id": "call_2", "name": "f", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 4, "output_tokens": 9, "cache_read_input_tokens": 16},
    }
    sdk = anthropic.types.Message.model_validate(message)
    assert sdk.usage.cache_read_input_tokens == 16
    assert [block.type for block in sdk.content] == ["thinking", "text", "tool_use", "tool_use"]


@pytest.mark.parametrize(
    ("finish", "choice", "reason", "sequence"),
    [
        ("stop", {}, "end_turn", None),
        ("length", {}, "max_tokens", None),
        ("tool_calls", {}, "tool_use", None),
        ("content_filter", {}, "refusal", None),
        (None, {}, "end_turn", None),
        ("stop", {"stop_reason": "END"}, "stop_sequence", "END"),
        ("stop", {"stop_reason": 128001}, "end_turn", None),
    ],
)
def test_finish_reasons_map_to_stop_reasons(
    finish: str | None, choice: dict[str, Any], reason: str, sequence: str | None
) -> None:
    message = chat_to_message(
        _completion({"role": "assistant", "reasoning": "r", "content": "x"}, finish, **choice), "m"
    )
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)
    assert message["id"].startswith("msg_")
    assert message["content"][0] == {"type": "thinking", "thinking": "r", "signature": ""}
    anthropic.types.Message.model_validate(message)


def test_an_empty_or_odd_answer_still_makes_a_valid_message() -> None:
    message = chat_to_message({"choices": []}, "m")
    assert message["content"] == []
    assert message["usage"] == {"input_tokens": 0, "output_tokens": 0}
    anthropic.types.Message.model_validate(message)
    message = chat_to_message(_completion({"role": "assistant", "content": None}, "stop"), "m")
    assert message["content"] == []


def test_tool_arguments_that_are_not_a_json_object_keep_their_raw_text() -> None:
    assert tool_input('{"a": [1]}') == {"a": [1]}
    assert tool_input("") == {}
    assert tool_input("  ") == {}
    assert tool_input(None) == {}
    assert tool_input('{"a": ') == {"_raw_arguments": '{"a": '}
    assert tool_input("[1, 2]") == {"_raw_arguments": "[1, 2]"}


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_bodies_use_anthropics_shape_and_types(status: int, kind: str) -> None:
    assert orjson.loads(anthropic_error_body(status, "nope")) == {
        "type": "error",
        "error": {"type": kind, "message": "nope"},
    }


def test_an_error_event_is_an_sse_frame_in_anthropics_shape() -> None:
    assert error_event("overloaded_error", "busy") == (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
        b'"message":"busy"}}\n\n'
    )


# -- the stream -------------------------------------------------------------------------

TEXT_STREAM = (
    _chunk({"role": "assistant", "content": ""})
    + _chunk({"content": "Hello"})
    + _chunk({"content": " world"})
    + _chunk(finish="stop")
    + _chunk(usage=USAGE, choices=False)
    + DONE
)

REASONING_STREAM = (
    _chunk({"role": "assistant", "content": None})
    + _chunk({"reasoning_content": "Let me "})
    + _chunk({"reasoning_content": "think."})
    + _chunk({"content": "Done."})
    # The final chunk carries both the finish reason and the usage.
    + _chunk({}, "length", usage=USAGE)
    + DONE
)

TOOL_STREAM = (
    _chunk({"role": "assistant", "content": "Let me check."})
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
    + _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]})
    + _chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]})
    + _chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "time", "arguments": '{"tz":'},
                }
            ]
        }
    )
    + _chunk({"tool_calls": [{"index": 1, "function": {"arguments": ' "CET"}'}}]})
    + _chunk(finish="tool_calls")
    + _chunk(usage=USAGE, choices=False)
    + DONE
)


def test_a_text_stream_follows_anthropics_event_sequence() -> None:
    stream = MessagesStream("claude-ish", "msg_1", input_tokens=18)
    docs = _events(stream.feed(TEXT_STREAM))
    assert docs == [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "claude-ish",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 18, "output_tokens": 0},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "Hello"},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": " world"},
        },
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"input_tokens": 4, "output_tokens": 9, "cache_read_input_tokens": 16},
        },
        {"type": "message_stop"},
    ]
    assert stream.done
    assert stream.saw_first_content
    assert stream.content_chunks == 2
    assert stream.finish_reason == "stop"
    assert stream.usage is not None
    assert (
        stream.usage.prompt_tokens,
        stream.usage.completion_tokens,
        stream.usage.cached_tokens,
    ) == (20, 9, 16)
    message = _sdk_message(docs)
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello world"
    assert stream.finish() == b""
    assert stream.feed(TEXT_STREAM) == b""


def test_reasoning_becomes_a_thinking_block_before_the_text() -> None:
    stream = MessagesStream("m", "msg_2")
    docs = _events(stream.feed(REASONING_STREAM))
    assert _kinds(docs) == [
        "message_start",
        "content_block_start:thinking",
        "content_block_delta:thinking_delta",
        "content_block_delta:thinking_delta",
        "content_block_stop",
        "content_block_start:text",
        "content_block_delta:text_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert docs[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [d["index"] for d in docs[1:8]] == [0, 0, 0, 0, 1, 1, 1]
    assert docs[-2]["delta"]["stop_reason"] == "max_tokens"
    assert docs[-2]["usage"]["output_tokens"] == 9
    assert stream.usage is not None
    assert stream.usage.completion_tokens == 9
    message = _sdk_message(docs)
    assert message.content[0].type == "thinking"
    assert message.content[0].thinking == "Let me think."
    assert message.content[1].type == "text"
    assert message.content[1].text == "Done."
    assert message.stop_reason == "max_tokens"


def test_tool_calls_stream_as_tool_use_blocks_with_input_json_deltas() -> None:
    stream = MessagesStream("m", "msg_3")
    docs = _events(stream.feed(TOOL_STREAM))
    assert _kinds(docs) == [
        "message_start",
        "content_block_start:text",
        "content_block_delta:text_delta",
        "content_block_stop",
        "content_block_start:tool_use",
        "content_block_delta:input_json_delta",
        "content_block_delta:input_json_delta",
        "content_block_stop",
        "content_block_start:tool_use",
        "content_block_delta:input_json_delta",
        "content_block_delta:input_json_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert docs[4]["content_block"] == {
        "type": "tool_use",
        "id": "call_a",
        "name": "weather",
        "input": {},
    }
    assert docs[-2]["delta"]["stop_reason"] == "tool_use"
    message = _sdk_message(docs)
    blocks = message.content
    assert blocks[1].type == "tool_use"
    assert (blocks[1].id, blocks[1].name, blocks[1].input) == (
        "call_a",
        "weather",
        {"city": "Oslo"},
    )
    assert blocks[2].type == "tool_use"
    assert (blocks[2].id, blocks[2].name, blocks[2].input) == ("call_b", "time", {"tz": "CET"})
    assert stream.content_chunks == 6


@pytest.mark.parametrize("sample", [TEXT_STREAM, REASONING_STREAM, TOOL_STREAM])
def test_the_stream_cut_at_every_byte_gives_the_same_events(sample: bytes) -> None:
    whole = MessagesStream("m", "msg_s", input_tokens=3).feed(sample)
    for cut in range(len(sample) + 1):
        stream = MessagesStream("m", "msg_s", input_tokens=3)
        assert stream.feed(sample[:cut]) + stream.feed(sample[cut:]) == whole, cut
        assert stream.done


def test_byte_by_byte_with_crlf_line_ends_gives_the_same_events() -> None:
    whole = MessagesStream("m", "msg_c").feed(TOOL_STREAM)
    stream = MessagesStream("m", "msg_c")
    crlf = TOOL_STREAM.replace(b"\n", b"\r\n")
    out = b"".join(stream.feed(crlf[i : i + 1]) for i in range(len(crlf)))
    assert out == whole


def test_a_stream_cut_short_is_closed_well_formed_by_finish() -> None:
    stream = MessagesStream("m", "msg_4")
    cut = TOOL_STREAM.index(b"data: ", TOOL_STREAM.index(b"CET"))  # before the finish chunk
    head = stream.feed(TOOL_STREAM[:cut])
    assert stream.finish_reason is None
    tail = stream.finish()
    docs = _events(head + tail)
    assert _kinds(docs)[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # Without the engine's usage, the content chunks stand in for output tokens.
    assert docs[-2]["usage"] == {"output_tokens": 6}
    assert docs[-2]["delta"]["stop_reason"] == "tool_use"
    _sdk_message(docs)
    assert stream.done
    assert stream.finish() == b""


def test_finish_reads_a_last_event_without_its_blank_line_and_an_empty_stream_is_valid() -> None:
    stream = MessagesStream("m", "msg_5")
    out = stream.feed(_chunk({"content": "a"}) + _chunk(finish="stop")[:-2])
    assert b"message_delta" not in out
    docs = _events(out + stream.finish())
    assert docs[-2]["delta"]["stop_reason"] == "end_turn"
    assert _sdk_message(docs).content[0].type == "text"

    empty = MessagesStream("m", "msg_6")
    docs = _events(empty.finish())
    assert _kinds(docs) == ["message_start", "message_delta", "message_stop"]
    assert not empty.saw_first_content
    assert _sdk_message(docs).content == []


def test_start_sends_message_start_once_before_any_engine_bytes() -> None:
    stream = MessagesStream("m", "msg_7", input_tokens=12)
    first = stream.start()
    assert _kinds(_events(first)) == ["message_start"]
    assert stream.start() == b""
    docs = _events(first + stream.feed(TEXT_STREAM))
    assert _kinds(docs).count("message_start") == 1
    _sdk_message(docs)


def test_an_engine_error_mid_stream_becomes_an_error_event_and_ends_it() -> None:
    stream = MessagesStream("m", "msg_8")
    error = b'data: {"error": {"message": "out of memory", "type": "server_error"}}\n\n'
    docs = _events(stream.feed(_chunk({"content": "a"}) + error + _chunk({"content": "b"})))
    assert docs[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "out of memory"},
    }
    assert stream.done
    assert stream.engine_error == "out of memory"
    assert stream.finish() == b""


def test_the_chunk_reader_skips_comments_and_non_json_and_reports_done() -> None:
    reader = ChatChunkReader()
    assert reader.feed(b': keep-alive\n\nevent: x\ndata: {"a": 1}\n\ndata: nope\n\ndata: [DO') == [
        {"a": 1}
    ]
    assert reader.feed(b"NE]\n\n") == ["[DONE]"]
    assert reader.close() == []


# -- against the sim engine -------------------------------------------------------------


async def test_a_request_through_the_sim_engine_comes_back_as_anthropic_answers() -> None:
    doc = {
        "model": "sim-model",
        "max_tokens": 50,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "weather in Oslo"}],
        "tools": [
            {
                "name": "weather",
                "input_schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            }
        ],
    }
    with trio.fail_after(30):
        async with (
            open_sim("--tokens", "5", "--reasoning", "--reasoning-tokens", "2") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            whole = await client.post("/v1/chat/completions", json=request_to_chat(doc))
            message = chat_to_message(whole.json(), "claude-ish")
            sdk = anthropic.types.Message.model_validate(message)
            assert [block.type for block in sdk.content] == ["thinking", "tool_use"]
            assert message["content"][1]["input"] == {"city": "sim"}
            assert sdk.stop_reason == "tool_use"

            # Without tools: reasoning, then text.
            chat = request_to_chat({**doc, "stream": True, "tools": None})
            stream = MessagesStream("claude-ish", "msg_sim", input_tokens=4)
            out = b""
            async with client.stream("POST", "/v1/chat/completions", json=chat) as response:
                async for piece in response.aiter_raw():
                    out += stream.feed(piece)
            out += stream.finish()
            streamed = _sdk_message(_events(out))
            assert [block.type for block in streamed.content] == ["thinking", "text"]
            assert streamed.content[1].type == "text"
            assert streamed.content[1].text == "tok0 tok1 tok2 tok3 tok4 "
            assert streamed.stop_reason == "end_turn"
            assert streamed.usage.output_tokens == 7
            assert stream.usage is not None
            assert stream.usage.completion_tokens == 7

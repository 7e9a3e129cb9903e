"""Every client API of ``llmgw up --engine sim`` through the official clients
(``openai.OpenAI``, ``anthropic.Anthropic``; sync, ``max_retries=0``).

One ``llmgw up`` serves the whole module (it starts in about a second, but
the tests are many); a model that needs other engine arguments (reasoning)
or other catalog fields (aliases) is added through the admin API. Every
HTTP call is bounded by the clients' ``timeout``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

MODEL = "sim-model"
#: ``llmgw up`` defaults: 4096 context tokens over 4 slots.
MAX_OUTPUT = 4096 // 4
TIMEOUT_S = 30.0

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
OPENAI_WEATHER: Any = {
    "type": "function",
    "function": {"name": "weather", "description": "The weather", "parameters": WEATHER_SCHEMA},
}


@pytest.fixture(scope="module")
def up(start_module_up: Callable[..., Any]) -> Any:
    return start_module_up("--engine", "sim", "--model-name", MODEL)


@pytest.fixture
def client(up: Any) -> Iterator[openai.OpenAI]:
    with up.openai_client(TIMEOUT_S) as made:
        yield made


@pytest.fixture
def claude(up: Any) -> Iterator[anthropic.Anthropic]:
    with up.anthropic_client(TIMEOUT_S) as made:
        yield made


def _add_model(up: Any, admin_request: Callable[..., httpx.Response], doc: dict[str, Any]) -> None:
    """Add a catalog entry and wait until its replicas are ready."""
    added = admin_request(up, "POST", "/api/v1/models", {"min_memory_gb": 0.1, **doc})
    if added.status_code == 404:
        pytest.skip("the admin API has no POST /api/v1/models yet")
    assert added.status_code == 201, added.text

    def ready() -> bool:
        view = admin_request(up, "GET", f"/api/v1/models/{doc['name']}").json()
        counts = view["replicas"]
        return bool(counts["ready"] >= counts["wanted"] > 0)

    up.wait_for(ready, 60, f"{doc['name']} ready")


def _sse_data(body: bytes) -> list[str]:
    return [
        line[len("data: ") :] for line in body.decode().split("\n") if line.startswith("data: ")
    ]


# --- OpenAI chat -----------------------------------------------------------------------


def test_chat_answers_streamed_with_usage_and_not_streamed_with_the_gateway_headers(
    up: Any, client: openai.OpenAI
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "say hello"}], max_tokens=5
    )
    assert raw.headers["x-llmgw-replica"] == f"{MODEL}-0"
    assert float(raw.headers["x-llmgw-overhead-ms"]) >= 0
    assert raw.headers["x-request-id"].startswith("req_")
    answer = raw.parse()
    assert answer.choices[0].message.content == "tok0 tok1 tok2 tok3 tok4 "
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 5

    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "say hello"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    ) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.headers["x-llmgw-replica"] == f"{MODEL}-0"
        assert "x-llmgw-overhead-ms" in streamed.headers
        chunks = list(streamed.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4 tok5 "
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens == 2


def test_chat_tool_call_round_trip(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "weather in Oslo?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[OPENAI_WEATHER], max_tokens=64
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "sim", "days": 1}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[OPENAI_WEATHER], max_tokens=4
    )
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content == "tok0 tok1 tok2 tok3 "

    # Streamed, the call arrives as deltas the client can join.
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[OPENAI_WEATHER],
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas
    first_call = deltas[0].tool_calls
    assert first_call is not None
    assert first_call[0].function is not None
    assert first_call[0].function.name == "weather"
    arguments = "".join(
        (d.tool_calls[0].function.arguments or "")
        for d in deltas
        if d.tool_calls and d.tool_calls[0].function
    )
    assert json.loads(arguments) == {"city": "sim", "days": 1}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_chat_json_object_n_stop_seed_and_logprobs(client: openai.OpenAI) -> None:
    ask: list[Any] = [{"role": "user", "content": "answer in JSON"}]
    as_json = client.chat.completions.create(
        model=MODEL, messages=ask, response_format={"type": "json_object"}, seed=7
    )
    content = as_json.choices[0].message.content
    assert content is not None
    assert set(json.loads(content)) == {"answer"}

    two = client.chat.completions.create(model=MODEL, messages=ask, n=2, max_tokens=3)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == ["tok0 tok1 tok2 "] * 2
    assert two.usage is not None
    assert two.usage.completion_tokens == 6

    stopped = client.chat.completions.create(model=MODEL, messages=ask, stop=["tok3"])
    assert stopped.choices[0].message.content == "tok0 tok1 tok2 "
    assert stopped.choices[0].finish_reason == "stop"

    seeded = [
        client.chat.completions.create(model=MODEL, messages=ask, seed=42, max_tokens=4)
        for _ in range(2)
    ]
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content

    with_logprobs = client.chat.completions.create(
        model=MODEL, messages=ask, logprobs=True, top_logprobs=2, max_tokens=3
    )
    logprobs = with_logprobs.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.content is not None
    assert [entry.token for entry in logprobs.content] == ["tok0 ", "tok1 ", "tok2 "]
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs.content)
    assert all(entry.logprob < 0 for entry in logprobs.content)


def test_a_max_tokens_above_the_models_max_output_is_refused_400(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    models = {m.id: m for m in client.models.list()}
    assert (models[MODEL].model_extra or {}).get("max_output_tokens") == MAX_OUTPUT
    ok = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_OUTPUT
    )
    assert ok.choices[0].finish_reason == "stop"  # the sim's 64 tokens, below the cap
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_OUTPUT + 1
        )
    assert refused.value.status_code == 400
    body: Any = refused.value.body
    assert body["param"] == "max_tokens"
    assert str(MAX_OUTPUT) in body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_OUTPUT + 1)
    with pytest.raises(anthropic.BadRequestError) as anthropic_refused:
        claude.messages.create(
            model=MODEL, max_tokens=MAX_OUTPUT + 1, messages=[{"role": "user", "content": "hi"}]
        )
    error: Any = anthropic_refused.value.body
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"


def test_a_responses_max_output_tokens_above_max_output_is_refused_naming_it(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=MAX_OUTPUT + 1)
    body: Any = refused.value.body
    assert body["param"] == "max_output_tokens"
    assert "max_output_tokens" in body["message"]


# --- completions and embeddings --------------------------------------------------------


def test_completions_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4)
    assert whole.choices[0].text == "tok0 tok1 tok2 tok3 "
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 4)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="once upon a time",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok0 tok1 tok2 tok3 tok4 "
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == 5


def test_embeddings_in_floats_and_in_the_clients_default_base64(client: openai.OpenAI) -> None:
    as_floats = client.embeddings.create(
        model=MODEL, input=["one text", "another"], encoding_format="float"
    )
    assert [d.index for d in as_floats.data] == [0, 1]
    vector = as_floats.data[0].embedding
    assert len(vector) == 384
    assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, rel_tol=1e-6)
    assert as_floats.usage.prompt_tokens == 3
    # Without encoding_format the client asks for base64 and decodes it.
    default = client.embeddings.create(model=MODEL, input="one text")
    decoded = default.data[0].embedding
    assert len(decoded) == 384
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(decoded, vector, strict=True))
    raw = client.embeddings.with_raw_response.create(
        model=MODEL, input="one text", encoding_format="base64"
    )
    assert isinstance(json.loads(raw.text)["data"][0]["embedding"], str)
    assert raw.headers["x-llmgw-replica"] == f"{MODEL}-0"


# --- Anthropic Messages ----------------------------------------------------------------


def test_anthropic_messages_not_streamed_with_a_system_prompt(
    up: Any, claude: anthropic.Anthropic
) -> None:
    raw = claude.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=5,
        system="You are terse.",
        messages=[{"role": "user", "content": "say hello"}],
    )
    assert raw.headers["x-llmgw-replica"] == f"{MODEL}-0"
    assert "x-llmgw-overhead-ms" in raw.headers
    message = raw.parse()
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == MODEL
    assert message.stop_reason == "max_tokens"
    assert [b.type for b in message.content] == ["text"]
    text = message.content[0]
    assert isinstance(text, anthropic.types.TextBlock)
    assert text.text == "tok0 tok1 tok2 tok3 tok4 "
    # Three words of system prompt and two of question, as the sim counts them.
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == 5
    assert message.usage.output_tokens == 5


def test_anthropic_messages_streamed_and_its_usage_row_counts_each_token_once(
    up: Any, claude: anthropic.Anthropic
) -> None:
    with claude.messages.stream(
        model=MODEL,
        max_tokens=7,
        system="You are terse.",
        messages=[{"role": "user", "content": "say hello again"}],
    ) as stream:
        request_id = stream.response.headers["x-request-id"]
        assert stream.response.headers["x-llmgw-replica"] == f"{MODEL}-0"
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start"
    assert events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(events)
    assert "message_delta" in events
    assert final.stop_reason == "max_tokens"
    text = final.content[0]
    assert isinstance(text, anthropic.types.TextBlock)
    assert text.text == "tok0 tok1 tok2 tok3 tok4 tok5 tok6 "
    usage = final.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert prompt == 6
    assert usage.output_tokens == 7

    up.usage_row(request_id)  # written by now
    listed = up.cli("ctl", "usage", "--last", "100", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = [r for r in json.loads(listed.stdout)["data"] if r["request_id"] == request_id]
    assert row["status"] == 200
    assert row["stream"] is True
    assert row["endpoint"] == "messages"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, 7)
    assert row["cached_tokens"] == (usage.cache_read_input_tokens or 0)


def test_anthropic_count_tokens_is_the_input_a_message_then_uses(
    claude: anthropic.Anthropic,
) -> None:
    tool: Any = {"name": "weather", "description": "The weather", "input_schema": WEATHER_SCHEMA}
    ask: Any = {
        "model": MODEL,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "how many tokens is this?"}],
        "tools": [tool],
    }
    counted = claude.messages.count_tokens(**ask)
    # Three words of system prompt and five of question, as the sim counts them.
    assert counted.input_tokens == 8
    usage = claude.messages.create(max_tokens=2, **ask).usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens


def test_anthropic_errors_reach_the_anthropic_client_in_its_own_shape(
    up: Any, claude: anthropic.Anthropic
) -> None:
    hello: Any = [{"role": "user", "content": "hi"}]

    def refused(error: anthropic.APIStatusError, kind: str) -> str:
        doc = error.response.json()
        assert doc["type"] == "error", doc
        assert set(doc["error"]) == {"type", "message"}, doc
        assert doc["error"]["type"] == kind, doc
        message: str = doc["error"]["message"]
        return message

    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.count_tokens(model="nope", messages=hello)
    assert "nope" in refused(missing.value, "not_found_error")
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.count_tokens(model=MODEL, messages=[])
    assert "messages" in refused(bad.value, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as no_batches:
        claude.messages.batches.list()
    refused(no_batches.value, "not_found_error")

    with anthropic.Anthropic(
        base_url=up.base_url, api_key="sk-llmgw-nope", max_retries=0, timeout=TIMEOUT_S
    ) as stranger:
        with pytest.raises(anthropic.AuthenticationError) as unknown:
            stranger.messages.count_tokens(model=MODEL, messages=hello)
        refused(unknown.value, "authentication_error")
        with pytest.raises(anthropic.AuthenticationError) as unknown:
            stranger.messages.create(model=MODEL, max_tokens=2, messages=hello)
        refused(unknown.value, "authentication_error")

    made = up.cli("keys", "create", "one-a-minute", "--json")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)
    limits = up.cli("keys", "limits", "--scope", "key", "--id", key["id"], "--rpm", "1")
    assert limits.returncode == 0, limits.stderr
    with anthropic.Anthropic(
        base_url=up.base_url, api_key=key["key"], max_retries=0, timeout=TIMEOUT_S
    ) as slow:
        assert slow.messages.count_tokens(model=MODEL, messages=hello).input_tokens == 1
        with pytest.raises(anthropic.RateLimitError) as limited:
            slow.messages.count_tokens(model=MODEL, messages=hello)
        refused(limited.value, "rate_limit_error")
        assert int(limited.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError) as limited:
            slow.messages.create(model=MODEL, max_tokens=2, messages=hello)
        refused(limited.value, "rate_limit_error")


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tool: Any = {"name": "weather", "description": "The weather", "input_schema": WEATHER_SCHEMA}
    messages: list[Any] = [{"role": "user", "content": "weather in Oslo?"}]
    first = claude.messages.create(model=MODEL, max_tokens=64, tools=[tool], messages=messages)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if isinstance(b, anthropic.types.ToolUseBlock)]
    assert len(uses) == 1
    assert uses[0].name == "weather"
    assert uses[0].input == {"city": "sim", "days": 1}
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "clear sky"}],
        },
    ]
    second = claude.messages.create(model=MODEL, max_tokens=3, tools=[tool], messages=messages)
    assert second.stop_reason == "max_tokens"
    assert [b.type for b in second.content] == ["text"]

    # Streamed: the tool input arrives as input_json deltas the client joins.
    with claude.messages.stream(
        model=MODEL, max_tokens=64, tools=[tool], messages=[messages[0]]
    ) as stream:
        final = stream.get_final_message()
    streamed_uses = [b for b in final.content if isinstance(b, anthropic.types.ToolUseBlock)]
    assert [u.input for u in streamed_uses] == [{"city": "sim", "days": 1}]
    assert final.stop_reason == "tool_use"


def test_anthropic_thinking_blocks_from_a_reasoning_model(
    up: Any, admin_request: Callable[..., httpx.Response], claude: anthropic.Anthropic
) -> None:
    _add_model(
        up,
        admin_request,
        {"name": "thinker", "engine": "sim", "args": ["--reasoning", "--reasoning-tokens", "3"]},
    )
    message = claude.messages.create(
        model="thinker", max_tokens=5, messages=[{"role": "user", "content": "think"}]
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    thinking = message.content[0]
    assert isinstance(thinking, anthropic.types.ThinkingBlock)
    assert thinking.thinking == "thought0 thought1 thought2 "
    text = message.content[1]
    assert isinstance(text, anthropic.types.TextBlock)
    assert text.text == "tok0 tok1 "
    assert message.usage.output_tokens == 5

    with claude.messages.stream(
        model="thinker", max_tokens=5, messages=[{"role": "user", "content": "think"}]
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    streamed_thinking = final.content[0]
    assert isinstance(streamed_thinking, anthropic.types.ThinkingBlock)
    assert streamed_thinking.thinking == "thought0 thought1 thought2 "


# --- OpenAI Responses ------------------------------------------------------------------


def test_responses_text_streamed_and_not(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="say hello", instructions="be brief", max_output_tokens=4
    )
    assert raw.headers["x-llmgw-replica"] == f"{MODEL}-0"
    response = raw.parse()
    assert response.output_text == "tok0 tok1 tok2 tok3 "
    assert response.usage is not None
    assert response.usage.output_tokens == 4
    assert response.usage.input_tokens == 4

    assert response.status == "incomplete"  # stopped by max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"

    with client.responses.stream(model=MODEL, input="say hello") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created"
    assert "response.output_text.delta" in kinds
    assert kinds[-1] == "response.completed"
    assert final.status == "completed"
    assert final.output_text == "".join(f"tok{i} " for i in range(64))
    assert final.usage is not None
    assert final.usage.output_tokens == 64

    with client.responses.stream(model=MODEL, input="say hello", max_output_tokens=5) as stream:
        cut = [event.type for event in stream]
    assert cut[-1] == "response.incomplete"


def test_responses_function_call_round_trip(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "name": "weather", "parameters": WEATHER_SCHEMA}
    first = client.responses.create(model=MODEL, input="weather in Oslo?", tools=[tool])
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    call: Any = calls[0]
    assert call.name == "weather"
    assert json.loads(call.arguments) == {"city": "sim", "days": 1}
    second = client.responses.create(
        model=MODEL,
        tools=[tool],
        max_output_tokens=3,
        input=[
            {"role": "user", "content": "weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "clear sky"},
        ],
    )
    assert second.output_text == "tok0 tok1 tok2 "

    with client.responses.stream(model=MODEL, input="weather?", tools=[tool]) as stream:
        final = stream.get_final_response()
    streamed: Any = [item for item in final.output if item.type == "function_call"]
    assert [json.loads(c.arguments) for c in streamed] == [{"city": "sim", "days": 1}]


# --- errors and names ------------------------------------------------------------------


def test_an_unknown_model_is_404_in_each_apis_own_error_shape(
    client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        ),
        lambda: client.completions.create(model="nope", prompt="hi"),
        lambda: client.embeddings.create(model="nope", input="hi"),
        lambda: client.responses.create(model="nope", input="hi"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        body: Any = missing.value.body
        assert body["code"] == "model_not_found"
        assert body["param"] == "model"
        assert "nope" in body["message"]
        assert json.loads(missing.value.response.text)["error"]["type"]
    with pytest.raises(anthropic.NotFoundError) as anthropic_missing:
        claude.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    doc = json.loads(anthropic_missing.value.response.text)
    assert doc["type"] == "error"
    assert doc["error"]["type"] == "not_found_error"
    assert "nope" in doc["error"]["message"]


def test_a_model_is_called_by_its_alias(
    up: Any,
    admin_request: Callable[..., httpx.Response],
    client: openai.OpenAI,
    claude: anthropic.Anthropic,
) -> None:
    _add_model(up, admin_request, {"name": "aliased", "engine": "sim", "aliases": ["nick"]})
    listed = {m.id: m.model_extra or {} for m in client.models.list()}
    assert listed["aliased"].get("aliases") == ["nick"]
    raw = client.chat.completions.with_raw_response.create(
        model="nick", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-llmgw-replica"] == "aliased-0"
    assert raw.parse().choices[0].message.content == "tok0 tok1 "
    message = claude.messages.create(
        model="nick", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.model == "nick"  # as the client asked
    row = up.usage_row(raw.headers["x-request-id"])
    assert row["model"] == "aliased"


# --- the exact answer cache ------------------------------------------------------------


def test_the_exact_answer_cache_replays_an_answer_free_streamed_and_not(
    up: Any, admin_request: Callable[..., httpx.Response]
) -> None:
    made = up.cli("keys", "create", "cached", "--project", "Cache/team/proj", "--json")
    assert made.returncode == 0, made.stderr
    key = json.loads(made.stdout)["key"]
    tree = admin_request(up, "GET", "/api/v1/tree")
    assert tree.status_code == 200, tree.text
    [project_id] = [p["project_id"] for p in tree.json()["data"] if p["path"] == "Cache/team/proj"]
    patched = admin_request(
        up,
        "PATCH",
        "/api/v1/config",
        {"key": "router.cache.projects", "value": {project_id: 3600}},
    )
    assert patched.status_code == 200, patched.text
    time.sleep(1.5)  # the other settings loop's poll, to be safe
    headers = {"authorization": f"Bearer {key}"}
    url = f"{up.base_url}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "cache me"}], "max_tokens": 6}

    first = httpx.post(url, json=body, headers=headers, timeout=TIMEOUT_S)
    second = httpx.post(url, json=body, headers=headers, timeout=TIMEOUT_S)
    assert first.status_code == second.status_code == 200
    assert "x-llmgw-cache" not in first.headers
    assert second.headers["x-llmgw-cache"] == "hit"
    assert int(second.headers["age"]) >= 0
    assert second.content == first.content

    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    first_stream = httpx.post(url, json=streamed, headers=headers, timeout=TIMEOUT_S)
    second_stream = httpx.post(url, json=streamed, headers=headers, timeout=TIMEOUT_S)
    assert "x-llmgw-cache" not in first_stream.headers
    assert second_stream.headers["x-llmgw-cache"] == "hit"
    assert "age" in second_stream.headers
    assert second_stream.headers["content-type"].startswith("text/event-stream")
    assert second_stream.content == first_stream.content
    events = _sse_data(second_stream.content)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 6

    # The official client reads the replay like any stream.
    with up.openai_client(TIMEOUT_S, api_key=key) as cached_client:
        chunks = list(
            cached_client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "cache me"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "tok0 tok1 tok2 tok3 tok4 tok5 "
    )

    for answer in (second, second_stream):
        row = up.usage_row(answer.headers["x-request-id"])
        assert row["status"] == 200
        assert row["cache_hit"] is True
        assert (row["prompt_tokens"], row["completion_tokens"], row["cost_micros"]) == (0, 0, 0)
    missed = up.usage_row(first.headers["x-request-id"])
    assert missed["cache_hit"] is False
    assert missed["completion_tokens"] == 6

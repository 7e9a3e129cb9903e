"""The sim engine's wider chat surface (tools, reasoning, n, logprobs, stop,
response_format) and embeddings, driven by the real ``openai`` client.

openai's AsyncOpenAI leaves async generators unfinished under trio, so the
sync client runs in a thread (``trio.to_thread.run_sync``).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import openai
import orjson
import trio
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from llmgw.engines.testing import RunningSim, SimStarter

KEY = "sim-api-key"
CHAT = "/v1/chat/completions"
FAST = ("--tokens-per-second", "0")
T = TypeVar("T")

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "where": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "note": {"type": "string"}},
                    "required": ["lat"],
                },
                "optional": {"type": "string"},
            },
            "required": ["city", "days", "metric", "unit", "where"],
        },
    },
}
WEATHER_ARGS = {"city": "sim", "days": 1, "metric": True, "unit": "C", "where": {"lat": 1}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "weather in Oslo"}]


def _client(sim: RunningSim) -> openai.OpenAI:
    # A keyless sim takes any key; the client insists on one.
    key = sim.api_key or "unused"
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key=key, max_retries=0)


async def _call(sim: RunningSim, work: Callable[[openai.OpenAI], T]) -> T:
    def run() -> T:
        with _client(sim) as client:
            return work(client)

    return await trio.to_thread.run_sync(run)


async def _create(sim: RunningSim, **kwargs: Any) -> ChatCompletion:
    kwargs.setdefault("model", "sim-model")
    kwargs.setdefault("messages", ASK)
    return await _call(sim, lambda client: client.chat.completions.create(**kwargs))


async def _chunks(sim: RunningSim, **kwargs: Any) -> list[ChatCompletionChunk]:
    kwargs.setdefault("model", "sim-model")
    kwargs.setdefault("messages", ASK)
    kwargs.update(stream=True, stream_options={"include_usage": True})

    def work(client: openai.OpenAI) -> list[ChatCompletionChunk]:
        with client.chat.completions.create(**kwargs) as stream:
            return list(stream)

    return await _call(sim, work)


def _extra(model: Any, name: str) -> Any:
    """A field the openai types do not declare (``reasoning_content``)."""
    return (model.model_extra or {}).get(name)


async def test_tools_get_one_call_to_the_first_tool_with_placeholder_arguments(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(60):
        async with start_sim(*FAST, api_key=KEY) as sim:
            answer = await _create(sim, tools=[WEATHER, CLOCK])
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            calls = choice.message.tool_calls
            assert calls is not None
            assert len(calls) == 1
            call = calls[0]
            assert call.type == "function"
            assert call.id.startswith("call_")
            assert call.function.name == "weather"
            assert orjson.loads(call.function.arguments) == WEATHER_ARGS
            assert answer.usage is not None
            assert answer.usage.completion_tokens >= 2

            named = await _create(
                sim,
                tools=[WEATHER, CLOCK],
                tool_choice={"type": "function", "function": {"name": "clock"}},
            )
            named_calls = named.choices[0].message.tool_calls
            assert named_calls is not None
            assert named_calls[0].type == "function"
            assert named_calls[0].function.name == "clock"
            assert named_calls[0].function.arguments == "{}"

            # tool_choice none, or a tool result last: a plain text answer.
            for messages, choice_arg in [
                (ASK, "none"),
                (
                    [
                        *ASK,
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [call.model_dump()],
                        },
                        {"role": "tool", "tool_call_id": call.id, "content": "12 C"},
                    ],
                    "auto",
                ),
            ]:
                plain = await _create(
                    sim, messages=messages, tools=[WEATHER], tool_choice=choice_arg
                )
                assert plain.choices[0].finish_reason == "stop"
                assert plain.choices[0].message.tool_calls is None
                assert plain.choices[0].message.content == "".join(f"tok{i} " for i in range(64))


async def test_a_streamed_tool_call_comes_as_openai_tool_call_deltas(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(60):
        async with start_sim(api_key=KEY) as sim:
            chunks = await _chunks(sim, tools=[WEATHER])
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
            head, pieces = calls[0], calls[1:]
            assert deltas[0].role == "assistant"
            assert head.index == 0
            assert head.id is not None
            assert head.id.startswith("call_")
            assert head.type == "function"
            assert head.function is not None
            assert (head.function.name, head.function.arguments) == ("weather", "")
            assert len(pieces) > 1
            assert all(p.id is None and p.function is not None for p in pieces)
            arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
            assert orjson.loads(arguments) == WEATHER_ARGS
            finals = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finals[-1] == "tool_calls"
            assert all(f is None for f in finals[:-1])
            usage = chunks[-1].usage
            assert usage is not None
            assert usage.completion_tokens == len(calls)


async def test_reasoning_comes_before_the_content_streamed_and_not(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(60):
        async with start_sim(
            *FAST, "--tokens", "4", "--reasoning", "--reasoning-tokens", "3"
        ) as sim:
            whole = await _create(sim)
            message = whole.choices[0].message
            assert _extra(message, "reasoning_content") == "thought0 thought1 thought2 "
            assert message.content == "tok0 tok1 tok2 tok3 "
            assert whole.usage is not None
            assert whole.usage.completion_tokens == 7

            chunks = await _chunks(sim)
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            kinds = [
                "r" if _extra(d, "reasoning_content") else "c" if d.content else "-" for d in deltas
            ]
            assert kinds == ["r", "r", "r", "c", "c", "c", "c", "-"]
            assert "".join(_extra(d, "reasoning_content") or "" for d in deltas) == (
                "thought0 thought1 thought2 "
            )
            assert deltas[0].role == "assistant"

            # max_tokens counts the reasoning too.
            capped = await _create(sim, max_tokens=4)
            assert capped.choices[0].finish_reason == "length"
            assert _extra(capped.choices[0].message, "reasoning_content") == (
                "thought0 thought1 thought2 "
            )
            assert capped.choices[0].message.content == "tok0 "

            # A tool call after reasoning.
            called = await _create(sim, tools=[CLOCK])
            assert _extra(called.choices[0].message, "reasoning_content")
            assert called.choices[0].finish_reason == "tool_calls"


async def test_n_gives_that_many_choices_and_sums_their_tokens(start_sim: SimStarter) -> None:
    with trio.fail_after(60):
        async with start_sim(*FAST, "--tokens", "5", api_key=KEY) as sim:
            whole = await _create(sim, n=3)
            assert [c.index for c in whole.choices] == [0, 1, 2]
            assert {c.message.content for c in whole.choices} == {"tok0 tok1 tok2 tok3 tok4 "}
            assert whole.usage is not None
            assert whole.usage.completion_tokens == 15
            assert whole.usage.total_tokens == whole.usage.prompt_tokens + 15

            chunks = await _chunks(sim, n=2)
            texts: dict[int, str] = {}
            finishes: dict[int, str | None] = {}
            for chunk in chunks:
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                    if choice.finish_reason:
                        finishes[choice.index] = choice.finish_reason
            assert texts == {0: "tok0 tok1 tok2 tok3 tok4 ", 1: "tok0 tok1 tok2 tok3 tok4 "}
            assert finishes == {0: "stop", 1: "stop"}
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 10

            tools = await _create(sim, n=2, tools=[CLOCK])
            ids = set()
            for called in tools.choices:
                assert called.message.tool_calls is not None
                ids.add(called.message.tool_calls[0].id)
            assert len(ids) == 2


async def test_the_same_request_and_seed_give_the_same_text(start_sim: SimStarter) -> None:
    with trio.fail_after(60):
        async with start_sim(*FAST, "--tokens", "6") as sim:
            texts = {
                (await _create(sim, seed=seed, temperature=1.0)).choices[0].message.content
                for seed in (7, 7, 8)
            }
            assert texts == {"tok0 tok1 tok2 tok3 tok4 tok5 "}


async def test_logprobs_come_per_content_token_streamed_and_not(start_sim: SimStarter) -> None:
    with trio.fail_after(60):
        async with start_sim(*FAST, "--tokens", "4") as sim:
            whole = await _create(sim, logprobs=True, top_logprobs=3)
            choice = whole.choices[0]
            assert choice.logprobs is not None
            entries = choice.logprobs.content
            assert entries is not None
            assert [e.token for e in entries] == ["tok0 ", "tok1 ", "tok2 ", "tok3 "]
            for entry in entries:
                assert entry.logprob < 0
                assert entry.bytes == list(entry.token.encode())
                assert len(entry.top_logprobs) == 3
                assert entry.top_logprobs[0].token == entry.token
                assert entry.top_logprobs[0].logprob == entry.logprob
            again = await _create(sim, logprobs=True)
            assert again.choices[0].logprobs is not None
            second = again.choices[0].logprobs.content
            assert second is not None
            assert [e.logprob for e in second] == [e.logprob for e in entries]
            assert all(e.top_logprobs == [] for e in second)

            chunks = await _chunks(sim, logprobs=True, top_logprobs=1)
            streamed = []
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    logprobs = chunk.choices[0].logprobs
                    assert logprobs is not None
                    assert logprobs.content is not None
                    assert len(logprobs.content) == 1
                    streamed.append(logprobs.content[0].token)
            assert streamed == [e.token for e in entries]


async def test_a_stop_string_cuts_the_answer_before_it(start_sim: SimStarter) -> None:
    with trio.fail_after(60):
        async with start_sim(*FAST, "--tokens", "8") as sim:
            whole = await _create(sim, stop=["nothing", "tok3"])
            assert whole.choices[0].message.content == "tok0 tok1 tok2 "
            assert whole.choices[0].finish_reason == "stop"
            assert whole.usage is not None
            assert whole.usage.completion_tokens == 3

            cut_inside = await _create(sim, stop="k2 t")
            assert cut_inside.choices[0].message.content == "tok0 tok1 to"
            assert cut_inside.usage is not None
            assert cut_inside.usage.completion_tokens == 3

            chunks = await _chunks(sim, stop="tok5")
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert content == "tok0 tok1 tok2 tok3 tok4 "
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"

            unmatched = await _create(sim, stop="zzz", max_tokens=2)
            assert unmatched.choices[0].message.content == "tok0 tok1 "
            assert unmatched.choices[0].finish_reason == "length"


async def test_response_format_json_gets_valid_json(start_sim: SimStarter) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    with trio.fail_after(60):
        async with start_sim(*FAST, "--tokens", "3") as sim:
            plain = await _create(sim, response_format={"type": "json_object"})
            content = plain.choices[0].message.content
            assert content is not None
            assert orjson.loads(content) == {"answer": "tok0 tok1 tok2 "}

            shaped = await _create(
                sim,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": schema, "strict": True},
                },
            )
            shaped_content = shaped.choices[0].message.content
            assert shaped_content is not None
            assert orjson.loads(shaped_content) == {"name": "sim", "age": 1}

            chunks = await _chunks(sim, response_format={"type": "json_object"})
            pieces = [c.choices[0].delta.content for c in chunks if c.choices]
            streamed = "".join(p or "" for p in pieces)
            assert orjson.loads(streamed) == {"answer": "tok0 tok1 tok2 "}
            assert len([p for p in pieces if p]) > 1

            text = await _create(sim, response_format={"type": "text"})
            assert text.choices[0].message.content == "tok0 tok1 tok2 "


async def test_embeddings_work_through_the_openai_client_as_floats_and_base64(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(60):
        async with (
            start_sim("--embedding-dim", "16", api_key=KEY) as sim,
            httpx.AsyncClient(
                base_url=sim.base_url, headers={"Authorization": f"Bearer {KEY}"}
            ) as raw,
        ):
            inputs = ["alpha", "beta"]

            def embed(encoding: str | None) -> list[list[float]]:
                with _client(sim) as client:
                    if encoding is None:
                        # The client's default: it asks for base64 and decodes it.
                        result = client.embeddings.create(model="m", input=inputs)
                    else:
                        result = client.embeddings.create(
                            model="m",
                            input=inputs,
                            encoding_format=encoding,  # type: ignore[arg-type]
                        )
                    assert result.usage.prompt_tokens == 2
                    vectors = []
                    for item in result.data:
                        vector: Any = item.embedding
                        if isinstance(vector, str):
                            # Asked for base64 explicitly: the client leaves it as is.
                            raw_bytes = base64.b64decode(vector)
                            vector = list(struct.unpack(f"<{len(raw_bytes) // 4}f", raw_bytes))
                        vectors.append(vector)
                    return vectors

            as_floats = await trio.to_thread.run_sync(embed, "float")
            as_default = await trio.to_thread.run_sync(embed, None)
            as_base64 = await trio.to_thread.run_sync(embed, "base64")
            assert len(as_floats) == 2
            assert all(len(v) == 16 for v in as_floats)
            assert as_floats[0] != as_floats[1]
            for decoded in (as_default, as_base64):
                for got, want in zip(decoded, as_floats, strict=True):
                    assert all(
                        math.isclose(a, b, abs_tol=1e-6) for a, b in zip(got, want, strict=True)
                    )

            body = {"input": "alpha", "encoding_format": "base64", "dimensions": 4}
            doc = (await raw.post("/v1/embeddings", json=body)).json()
            vector = struct.unpack("<4f", base64.b64decode(doc["data"][0]["embedding"]))
            assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-5)


async def test_bad_rich_requests_get_400_and_tool_calls_count_as_stops(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(60):
        async with (
            start_sim(*FAST) as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            bad: list[dict[str, Any]] = [
                {"n": 0},
                {"n": "2"},
                {"logprobs": "yes"},
                {"logprobs": True, "top_logprobs": 50},
                {"stop": 5},
                {"response_format": {"type": "xml"}},
                {"tools": [{"type": "function"}]},
                {"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                {"tools": [CLOCK], "tool_choice": "sometimes"},
            ]
            for extra in bad:
                response = await client.post(CHAT, json={"messages": ASK, **extra})
                assert response.status_code == 400, extra
                assert response.json()["error"]["type"] == "invalid_request_error"
            answer = await client.post(CHAT, json={"messages": ASK, "tools": [CLOCK]})
            assert answer.json()["choices"][0]["finish_reason"] == "tool_calls"
            metrics = (await client.get("/metrics")).text
            stops = 'vllm:request_success_total{model_name="sim-model",finished_reason="stop"} 1'
            assert stops in metrics

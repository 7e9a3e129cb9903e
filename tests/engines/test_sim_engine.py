"""The sim engine, run as a real process and driven over HTTP."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import orjson
import pytest
import trio

from llmgw.engines.testing import RunningSim, SimStarter

KEY = "sim-test-key"
CHAT = "/v1/chat/completions"


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _sse(body: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body: dicts, then the string ``[DONE]``."""
    events: list[Any] = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def _openai(sim: RunningSim) -> openai.OpenAI:
    # openai's AsyncOpenAI streams work on trio but leave async generators
    # unfinished (trio warns), so the sync client runs in a thread.
    return openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key=sim.api_key, max_retries=0)


async def _until(check: Callable[[], Awaitable[bool]], interval: float = 0.05) -> None:
    """Poll ``check`` every ``interval`` seconds until it is true (bound the
    caller with ``trio.fail_after``)."""
    while True:
        if await check():
            return
        await trio.sleep(interval)


async def _metric(client: httpx.AsyncClient, series: str) -> float:
    """The value of ``series``: a name (its first labelled line) or a name
    with its labels (``name{a="b"}``)."""
    response = await client.get("/metrics", headers=_auth())
    assert response.status_code == 200
    prefix = series if series.endswith("}") else series + "{"
    for line in response.text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {series} in {response.text}")


async def test_the_sim_engine_says_where_it_listens_and_answers_health_ok(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim(model="tiny") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            assert sim.started_line == f"sim engine listening on 127.0.0.1:{sim.port} model tiny"
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (200, {"status": "ok"})
            models = await client.get("/v1/models")
            assert models.status_code == 200
            assert [m["id"] for m in models.json()["data"]] == ["tiny"]
            assert models.json()["object"] == "list"


async def test_a_streamed_chat_through_the_openai_client_ends_with_a_usage_chunk(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with start_sim("--tokens", "12", api_key=KEY) as sim:

            def chat() -> list[Any]:
                with _openai(sim) as client:
                    stream = client.chat.completions.create(
                        model="sim-model",
                        messages=[{"role": "user", "content": "one two three four"}],
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    with stream:
                        return list(stream)

            chunks = await trio.to_thread.run_sync(chat)
            content = [c.choices[0].delta.content for c in chunks if c.choices]
            assert "".join(filter(None, content)) == "".join(f"tok{i} " for i in range(12))
            assert chunks[0].choices[0].delta.role == "assistant"
            finals = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finals[-1] == "stop"
            assert all(f is None for f in finals[:-1])
            assert len({c.id for c in chunks}) == 1
            assert chunks[0].id.startswith("chatcmpl-")
            assert all(c.object == "chat.completion.chunk" for c in chunks)
            last = chunks[-1]
            assert last.choices == []
            assert last.usage is not None
            assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 12)
            assert last.usage.total_tokens == 16
            assert last.usage.prompt_tokens_details is not None
            assert last.usage.prompt_tokens_details.cached_tokens == 0


async def test_a_stream_without_include_usage_has_no_usage_chunk_and_ends_with_done(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "5") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            response = await client.post(CHAT, json=body)
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            events = _sse(response.content)
            assert events[-1] == "[DONE]"
            assert all("usage" not in e for e in events[:-1])
            assert events[-2]["choices"][0] == {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": "stop",
            }


async def test_a_non_streamed_chat_reports_usage_and_a_repeated_prompt_hits_the_cache(
    start_sim: SimStarter,
) -> None:
    prompt = " ".join(f"word{i}" for i in range(40))
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "3", api_key=KEY) as sim,
            httpx.AsyncClient(base_url=sim.base_url, headers=_auth()) as client,
        ):
            body = {"model": "x", "messages": [{"role": "user", "content": prompt}]}
            first = (await client.post(CHAT, json=body)).json()
            second = (await client.post(CHAT, json=body)).json()
            assert first["object"] == "chat.completion"
            assert first["id"].startswith("chatcmpl-")
            assert first["model"] == "sim-model"
            assert isinstance(first["created"], int)
            assert first["choices"] == [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "tok0 tok1 tok2 "},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ]
            assert first["usage"] == {
                "prompt_tokens": 40,
                "completion_tokens": 3,
                "total_tokens": 43,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            # 40 tokens hold two full 16-token blocks.
            assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


async def test_max_tokens_caps_the_answer_and_finishes_with_length(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "10") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            messages = [{"role": "user", "content": "hi"}]
            capped = await client.post(CHAT, json={"messages": messages, "max_tokens": 4})
            assert capped.json()["choices"][0]["finish_reason"] == "length"
            assert capped.json()["usage"]["completion_tokens"] == 4
            loose = await client.post(
                CHAT, json={"messages": messages, "max_completion_tokens": 50}
            )
            assert loose.json()["choices"][0]["finish_reason"] == "stop"
            assert loose.json()["usage"]["completion_tokens"] == 10


async def test_text_completions_answer_streamed_and_not_streamed(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "6") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            whole = (await client.post("/v1/completions", json={"prompt": "a b c"})).json()
            assert whole["object"] == "text_completion"
            assert whole["id"].startswith("cmpl-")
            assert whole["choices"][0]["text"] == "tok0 tok1 tok2 tok3 tok4 tok5 "
            assert whole["choices"][0]["finish_reason"] == "stop"
            assert whole["usage"]["prompt_tokens"] == 3
            body = {
                "prompt": "a b c",
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            events = _sse((await client.post("/v1/completions", json=body)).content)
            assert events[-1] == "[DONE]"
            usage_chunk, final = events[-2], events[-3]
            assert usage_chunk["choices"] == []
            assert usage_chunk["usage"]["completion_tokens"] == 2
            assert final["choices"][0]["finish_reason"] == "length"
            texts = [e["choices"][0]["text"] for e in events[:-3]]
            assert texts == ["tok0 ", "tok1 "]
            assert all(e["object"] == "text_completion" for e in events[:-1])


async def test_embeddings_are_deterministic_unit_vectors_in_float_and_base64(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim(api_key=KEY) as sim,
            httpx.AsyncClient(base_url=sim.base_url, headers=_auth()) as client,
        ):
            body = {"input": ["alpha", "beta", "alpha"], "model": "m"}
            doc = (await client.post("/v1/embeddings", json=body)).json()
            vectors = [d["embedding"] for d in doc["data"]]
            assert [d["index"] for d in doc["data"]] == [0, 1, 2]
            assert len(vectors[0]) == 384
            assert vectors[0] == vectors[2] != vectors[1]
            assert math.isclose(math.fsum(x * x for x in vectors[1]), 1.0, rel_tol=1e-9)
            assert doc["usage"] == {"prompt_tokens": 3, "total_tokens": 3}

            def embed() -> list[float]:
                # The openai client asks for base64 and decodes it.
                with _openai(sim) as oai:
                    return oai.embeddings.create(model="m", input="alpha").data[0].embedding

            decoded = await trio.to_thread.run_sync(embed)
            assert len(decoded) == 384
            assert all(
                math.isclose(a, b, abs_tol=1e-6) for a, b in zip(decoded, vectors[0], strict=True)
            )


async def test_every_route_but_health_needs_the_key_and_refusals_use_the_openai_error_shape(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(90):
        async with (
            start_sim(api_key=KEY) as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            assert (await client.get("/health")).status_code == 200
            for method, path in [
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("POST", CHAT),
                ("POST", "/v1/completions"),
                ("POST", "/v1/embeddings"),
                ("POST", "/tokenize"),
            ]:
                for headers in ({}, _auth("wrong-key")):
                    response = await client.request(method, path, headers=headers, json={})
                    assert response.status_code == 401, (method, path)
                    error = response.json()["error"]
                    assert error["type"] == "authentication_error"
                    assert isinstance(error["message"], str)
            assert (await client.get("/v1/models", headers=_auth())).status_code == 200

            def refused() -> int:
                with openai.OpenAI(
                    base_url=f"{sim.base_url}/v1", api_key="wrong", max_retries=0
                ) as oai:
                    try:
                        oai.models.list()
                    except openai.AuthenticationError as error:
                        return error.status_code
                return 200

            assert await trio.to_thread.run_sync(refused) == 401


async def test_health_says_loading_with_503_and_then_ok(start_sim: SimStarter) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--loading-seconds", "1.5") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            loading = await client.get("/health")
            assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
            busy = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x"}]})
            assert busy.status_code == 503
            assert busy.json()["error"]["type"] == "unavailable_error"

            async def ready() -> bool:
                return (await client.get("/health")).status_code != 503

            await _until(ready)
            health = await client.get("/health")
            assert (health.status_code, health.json()) == (200, {"status": "ok"})


async def test_a_fail_rate_of_one_answers_every_generation_with_500(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--fail-rate", "1.0") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            for path, body in [
                (CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True}),
                ("/v1/completions", {"prompt": "x"}),
                ("/v1/embeddings", {"input": "x"}),
            ]:
                response = await client.post(path, json=body)
                assert response.status_code == 500
                error = response.json()["error"]
                assert error["type"] == "server_error"
                assert error["code"] == 500
            assert (await client.get("/health")).status_code == 200


async def test_bad_requests_get_400_and_unknown_routes_404(start_sim: SimStarter) -> None:
    with trio.fail_after(30):
        async with (
            start_sim() as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            not_json = await client.post(CHAT, content=b"{nope")
            assert not_json.status_code == 400
            assert not_json.json()["error"]["type"] == "invalid_request_error"
            no_messages = await client.post(CHAT, json={"messages": []})
            assert no_messages.status_code == 400
            negative = await client.post(
                CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}
            )
            assert negative.status_code == 400
            assert (await client.get("/nowhere")).status_code == 404
            assert (await client.get(CHAT)).status_code == 405


async def test_tokenize_counts_words_and_metrics_use_vllm_names(start_sim: SimStarter) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "2", model="m1") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            tokens = (await client.post("/tokenize", json={"content": "a b  c"})).json()
            again = (await client.post("/tokenize", json={"prompt": "a b c"})).json()
            assert tokens["count"] == 3
            assert tokens["tokens"] == again["tokens"]
            assert (await client.post("/tokenize", json={"content": ""})).json()["count"] == 1
            await client.post(CHAT, json={"messages": [{"role": "user", "content": "p q"}]})
            metrics = await client.get("/metrics")
            assert metrics.headers["content-type"].startswith("text/plain")
            assert 'vllm:num_requests_running{model_name="m1"} 0' in metrics.text
            assert 'vllm:num_requests_waiting{model_name="m1"} 0' in metrics.text
            assert await _metric(client, "vllm:generation_tokens_total") == 2
            assert await _metric(client, "vllm:prompt_tokens_total") == 2


async def test_a_stream_is_paced_by_the_rate_and_coalesces_tokens_into_few_writes(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "40", "--tokens-per-second", "200", "--ttft-ms", "100") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            started = time.monotonic()
            first_at = None
            writes = 0
            async with client.stream("POST", CHAT, json=body) as response:
                async for _ in response.aiter_raw():
                    writes += 1
                    if first_at is None:
                        first_at = time.monotonic()
            ended = time.monotonic()
            assert first_at is not None
            # Never faster than asked: 100 ms to the first token, then 39 at 200/s.
            assert first_at - started >= 0.095
            assert ended - first_at >= 39 / 200 - 0.01
            # A write per tick (50 ms), not per token.
            assert writes < 20


async def test_a_client_that_goes_away_mid_stream_stops_the_generation(
    start_sim: SimStarter,
) -> None:
    request_body = orjson.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True})
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "100000", "--tokens-per-second", "20") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            stream = await trio.open_tcp_stream("127.0.0.1", sim.port)
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: sim\r\n"
                    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(request_body), request_body)
                )
                received = b""
                while b"tok0" not in received:
                    received += await stream.receive_some(65536)
                assert await _metric(client, "vllm:num_requests_running") == 1

            async def stopped() -> bool:
                return await _metric(client, "vllm:num_requests_running") == 0

            await _until(stopped)
            aborted = 'vllm:request_success_total{model_name="sim-model",finished_reason="abort"}'
            assert await _metric(client, aborted) == 1


async def test_requests_beyond_the_slots_wait_for_one(start_sim: SimStarter) -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    with trio.fail_after(30):
        async with (
            start_sim("--slots", "1", "--tokens", "20", "--tokens-per-second", "40") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            statuses: list[int] = []

            async def ask() -> None:
                statuses.append((await client.post(CHAT, json=body)).status_code)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                nursery.start_soon(ask)

                async def one_waits() -> bool:
                    return await _metric(client, "vllm:num_requests_waiting") == 1

                await _until(one_waits)
                assert await _metric(client, "vllm:num_requests_running") == 1
            assert statuses == [200, 200]


async def test_sigterm_stops_the_engine_within_a_second_with_exit_code_zero(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--tokens", "100000", "--tokens-per-second", "50") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            async with client.stream("POST", CHAT, json=body) as response:
                assert response.status_code == 200
                sim.process.send_signal(signal.SIGTERM)
                started = time.monotonic()
                with trio.fail_after(1.0):
                    assert await sim.process.wait() == 0
                assert time.monotonic() - started < 1.0


async def test_a_fail_status_of_429_answers_as_a_rate_limit(start_sim: SimStarter) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--fail-rate", "1", "--fail-status", "429") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            response = await client.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == 429
            assert response.json()["error"]["type"] == "rate_limit_error"


async def test_a_hang_rate_of_one_never_answers_until_the_client_gives_up(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim("--hang-rate", "1") as sim,
            httpx.AsyncClient(base_url=sim.base_url) as client,
        ):
            body = {"messages": [{"role": "user", "content": "x"}]}
            with pytest.raises(httpx.ReadTimeout):
                await client.post(CHAT, json=body, timeout=0.5)
            aborted = 'vllm:request_success_total{model_name="sim-model",finished_reason="abort"}'

            async def gave_up() -> bool:
                return await _metric(client, aborted) == 1

            await _until(gave_up)

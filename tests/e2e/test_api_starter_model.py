"""The client APIs against the real starter model (Gemma 3 270M on llama.cpp)
through the official clients: chat, completions, embeddings and Anthropic
messages, streamed and not.

llama.cpp serves ``/v1/embeddings`` only with ``--embeddings``, and for a
generative model such as Gemma only with a pooling type other than its
default ``none``: ``llmgw up`` starts the starter model with ``--embeddings
--pooling mean`` (chat and completions keep working with both on), so the
model runs here exactly as a user gets it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
TIMEOUT_S = 120.0
#: Gemma 3 270M's hidden size: the length of its embeddings.
EMBEDDING_DIM = 640


@pytest.fixture(scope="module")
def up(start_module_up: Callable[..., Any]) -> Any:
    return start_module_up()


@pytest.fixture
def client(up: Any) -> Iterator[openai.OpenAI]:
    with up.openai_client(TIMEOUT_S) as made:
        yield made


@pytest.fixture
def claude(up: Any) -> Iterator[anthropic.Anthropic]:
    with up.anthropic_client(TIMEOUT_S) as made:
        yield made


def test_chat_streamed_and_not(up: Any, client: openai.OpenAI) -> None:
    ask: list[Any] = [{"role": "user", "content": "Name three rivers."}]
    # Greedy, so never an answer that stops at once (as sampling may give).
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ask, max_tokens=12, temperature=0
    )
    assert raw.headers["x-llmgw-replica"] == f"{MODEL}-0"
    answer = raw.parse()
    assert answer.choices[0].message.content
    assert answer.usage is not None
    assert 0 < answer.usage.completion_tokens <= 12
    assert answer.usage.prompt_tokens > 3

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ask,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    usage = chunks[-1].usage
    assert usage is not None
    assert 0 < usage.completion_tokens <= 12
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    row = up.usage_row(raw.headers["x-request-id"])
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        answer.usage.prompt_tokens,
        answer.usage.completion_tokens,
    )


def test_completions_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8)
    assert whole.choices[0].text
    assert whole.usage is not None
    assert 0 < whole.usage.completion_tokens <= 8
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    # llama.cpp puts the usage in the last chunk, beside its choices.
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1
    assert 0 < usages[0].completion_tokens <= 8


def test_embeddings_in_floats_and_base64(up: Any, client: openai.OpenAI) -> None:
    floats = client.embeddings.create(
        model=MODEL, input=["hello world", "goodbye"], encoding_format="float"
    )
    assert [d.index for d in floats.data] == [0, 1]
    vector = floats.data[0].embedding
    assert len(vector) == EMBEDDING_DIM
    assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, rel_tol=1e-3)
    assert floats.usage.prompt_tokens > 0
    default = client.embeddings.create(model=MODEL, input="hello world")
    decoded = default.data[0].embedding
    assert len(decoded) == EMBEDDING_DIM
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(decoded, vector, strict=True))
    raw = client.embeddings.with_raw_response.create(model=MODEL, input="hello world")
    row = up.usage_row(raw.headers["x-request-id"])
    assert row["endpoint"] == "embeddings"
    assert row["prompt_tokens"] > 0


def test_anthropic_messages_streamed_and_not(up: Any, claude: anthropic.Anthropic) -> None:
    # Greedy: at the default temperature the starter model may stop at once
    # (an empty answer) now and then.
    message = claude.messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        system="Answer briefly.",
        messages=[{"role": "user", "content": "Name three rivers."}],
    )
    assert message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens")
    texts = [b for b in message.content if isinstance(b, anthropic.types.TextBlock)]
    assert texts
    assert texts[0].text
    assert 0 < message.usage.output_tokens <= 12
    assert message.usage.input_tokens > 0

    with claude.messages.stream(
        model=MODEL,
        max_tokens=12,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Name three rivers."}],
    ) as stream:
        request_id = stream.response.headers["x-request-id"]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text
    usage = final.usage
    assert 0 < usage.output_tokens <= 12
    row = up.usage_row(request_id)
    assert row["endpoint"] == "messages"
    assert row["completion_tokens"] == usage.output_tokens
    assert row["prompt_tokens"] == usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_anthropic_count_tokens_is_what_the_model_is_then_sent(
    up: Any, claude: anthropic.Anthropic
) -> None:
    ask: Any = {
        "model": MODEL,
        "system": "Answer briefly.",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    counted = claude.messages.count_tokens(**ask)
    usage = claude.messages.create(max_tokens=1, **ask).usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    # Gemma's tokenizer, not a guess from the text's length: a word a token or so.
    longer = claude.messages.count_tokens(
        model=MODEL,
        system="Answer briefly.",
        messages=[{"role": "user", "content": "What is the capital of France and of Spain?"}],
    )
    assert longer.input_tokens - counted.input_tokens == 3  # " and", " of", " Spain"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.count_tokens(
            **ask, tools=[{"name": "f", "input_schema": {"type": "object"}}]
        )
    assert "tools" in caught.value.response.json()["error"]["message"]


def test_a_plain_question_gets_a_plain_answer_that_stops(client: openai.OpenAI) -> None:
    # Greedy, so the same answer every time: the starter model, a pre-trained
    # Gemma, sees the conversation as plain questions and answers after
    # <bos> and stops at the next question (llmgw.app.up_models).
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    text = choice.message.content or ""
    assert text.strip().rstrip(".") == "Paris", text
    assert answer.usage is not None
    assert answer.usage.completion_tokens < 32


def test_tools_are_refused_clearly(up: Any, client: openai.OpenAI) -> None:
    # The starter's template refuses them (it is not tuned to call tools);
    # llama.cpp answers 400 with its message, and no breaker trips.
    tools: list[Any] = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, tools=tools
        )
    assert "takes no tools" in str(caught.value)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content is not None

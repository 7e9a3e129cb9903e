"""``llmgw up`` with the real starter model served by llama.cpp."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"


def test_the_starter_model_streams_an_answer_with_usage_through_the_openai_client(
    start_up: Any,
) -> None:
    """Fresh data directory: the starter GGUF is assembled and checked, the
    agent starts llama.cpp, and a streamed chat answer arrives with its usage
    (cached tokens included) and a matching usage row."""
    up = start_up()
    up.wait_ready()
    log = up.log()
    assert "model checked: gemma-3-270m sha256" in log
    assert "ready in" in log
    client = openai.OpenAI(base_url=f"{up.base_url}/v1", api_key=up.client_key, max_retries=0)
    try:
        assert [m.id for m in client.models.list()] == [MODEL]
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name three rivers."}],
                max_tokens=16,
                temperature=0,  # sampled, it may stop at once
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    finally:
        client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text.strip()
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= 16
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert all(c.model == MODEL for c in chunks)
    # The starter's chat template is applied: the prompt is more than the words.
    assert usage.prompt_tokens > 3 + 4  # three words, plus the template's examples
    assert "<start_of_turn>" not in text
    assert "<|im_start|>" not in text

    deadline = time.monotonic() + 10
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not rows:
        result = up.cli("ctl", "usage", "--json")
        assert result.returncode == 0, result.stderr
        rows = json.loads(result.stdout)["data"]
        time.sleep(0.2)
    [row] = rows
    assert row["status"] == 200
    assert row["model"] == MODEL
    assert row["prompt_tokens"] == usage.prompt_tokens
    assert row["completion_tokens"] == usage.completion_tokens
    assert row["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert row["ttft_ms"] > 0

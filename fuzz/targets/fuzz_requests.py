"""The client API's request bodies: read, checked and translated as the
gateway does (``llmgw/gateway/parse.py``, ``anthropic.py``,
``responses.py``), for chat, completions, embeddings, messages,
count_tokens and responses, then checked against two models.

The first byte picks the route. Checked: every refusal is an ``ApiError``
with a 4xx status (a 503 only for a stopped model); whatever is accepted
goes to the engine as JSON (``orjson.dumps`` takes it) with a string
``model``, and the token estimates are whole numbers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import orjson
from _harness import fuzz, instrumented

with instrumented():
    from llmgw.gateway import anthropic, responses
    from llmgw.gateway.errors import ApiError
    from llmgw.gateway.parse import (
        ESTIMATE_KIND,
        check_for_model,
        estimate_prompt_tokens,
        estimate_tokens,
        parse_body,
    )
    from llmgw.store import ModelRecord

ROUTES = ("chat", "completions", "embeddings", "messages", "count_tokens", "responses")
MODELS = (
    ModelRecord.simple("sim-model", "sim", max_output=64),
    ModelRecord.simple("llama", "llamacpp", max_output=128),
)


def one_input(data: bytes) -> None:
    if not data:
        return
    route = ROUTES[data[0] % len(ROUTES)]
    kind = "messages" if route == "count_tokens" else route
    try:
        doc = parse_body(data[1:], kind)
        if kind == "messages":
            doc = anthropic.request_to_chat(doc, counting=route == "count_tokens")
        elif kind == "responses":
            doc = responses.request_to_chat(doc)
        orjson.dumps(doc)
        assert isinstance(doc["model"], str)
        estimate = estimate_prompt_tokens(doc, ESTIMATE_KIND[kind])
        assert isinstance(estimate, int) and estimate >= 0, estimate
        for model in MODELS:
            try:
                check_for_model(doc, model, kind)
            except ApiError as exc:
                assert 400 <= exc.status < 500, exc.status
                continue
            # What limits and budgets hold, for a request the model takes.
            spend = estimate_tokens(doc, ESTIMATE_KIND[kind])
            assert isinstance(spend, int) and spend >= estimate, spend
    except ApiError as exc:
        assert 400 <= exc.status < 500, exc.status


if __name__ == "__main__":
    fuzz(one_input)

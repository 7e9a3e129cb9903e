"""The prompt estimate budgets and token limits hold before the real count."""

from __future__ import annotations

from llmgw.gateway.parse import estimate_prompt_tokens, estimate_tokens


def _chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def test_repeated_single_letters_are_not_underestimated() -> None:
    """'a a a …' is one token a word for real tokenizers (2 bytes a token);
    an estimate below that let 20 concurrent requests overspend a budget."""
    assert estimate_prompt_tokens(_chat("a " * 2000), "chat") >= 2000


def test_the_typical_estimate_is_lower_and_max_tokens_is_added() -> None:
    doc = _chat("The quick brown fox jumps over the lazy dog. " * 10, max_tokens=64)
    high = estimate_prompt_tokens(doc, "chat")
    typical = estimate_prompt_tokens(doc, "chat", bytes_per_token=4)
    assert typical < high
    assert estimate_tokens(doc, "chat") == high + 64
    assert estimate_prompt_tokens({"model": "m", "prompt": ""}, "completions") == 1

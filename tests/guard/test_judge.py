"""The judge's parts (``llmgw.guard.judge``): replies read per format,
texts fitted to the judge's context, verdicts cached for 5 minutes."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.guard.judge import CACHE_TTL_S, Judge, JudgeVerdict, parse_reply, pieces
from llmgw.settings import GuardJudge


def test_replies_are_read_per_format() -> None:
    assert parse_reply("Safety: Unsafe\nCategories: Violent, Jailbreak", "qwen3guard") == (
        JudgeVerdict("unsafe", ("Violent", "Jailbreak"))
    )
    assert parse_reply("<think>\n</think>\nSafety: Safe\nCategories: None", "qwen3guard") == (
        JudgeVerdict("safe", ("None",))
    )
    assert parse_reply("safety: controversial", "instructed").safety == "controversial"
    assert parse_reply("unsafe\nS1,S11", "llamaguard") == (
        JudgeVerdict("unsafe", ("Violent", "Suicide & Self-Harm"))
    )
    assert parse_reply("safe", "llamaguard").safety == "safe"
    for reply, form in (("I think it is fine", "qwen3guard"), ("maybe", "llamaguard")):
        with pytest.raises(ValueError, match=r"verdict|Safety"):
            parse_reply(reply, form)


def test_a_verdict_refuses_only_the_policys_categories() -> None:
    judge = GuardJudge(model="j", categories=("Violent",))
    assert JudgeVerdict("unsafe", ("Violent",)).refused(judge) == ("judge:violent",)
    assert JudgeVerdict("unsafe", ("PII",)).refused(judge) == ()
    assert JudgeVerdict("unsafe", ("None",)).refused(judge) == ("judge:unsafe",)
    assert JudgeVerdict("safe").refused(judge) == ()
    assert JudgeVerdict("controversial").refused(judge) == ()
    strict = GuardJudge(model="j", categories=(), controversial="block")
    assert JudgeVerdict("unsafe", ("Suicide & Self-Harm",)).refused(strict) == (
        "judge:suicide_self_harm",
    )
    assert JudgeVerdict("controversial").refused(strict) == ("judge:controversial",)


def test_a_text_longer_than_the_context_is_cut_into_pieces_that_fit_and_all_are_judged() -> None:
    text = " ".join(f"word{i}" for i in range(3000))  # ~26,000 characters
    parts = pieces(text, 2048)
    assert len(parts) > 1
    assert "".join(parts) == text
    assert all(len(p) <= (2048 - 256) * 3 for p in parts)
    assert pieces("short", 2048) == ["short"]


async def test_verdicts_are_cached_for_five_minutes_and_long_texts_judged_whole() -> None:
    now = [0.0]
    asked: list[str] = []

    async def ask(model: str, body: dict[str, Any], tried: list[str]) -> str:
        text = body["messages"][-1]["content"]
        asked.append(text)
        tried.append("replica-0")
        return "Safety: Unsafe\nCategories: Violent" if "bomb" in text else "Safety: Safe"

    judge = Judge(ask, clock=lambda: now[0])
    policy = GuardJudge(model="j")
    assert (await judge.judge(policy, "hello", context_tokens=4096)) == JudgeVerdict("safe")
    again = await judge.judge(policy, "hello", context_tokens=4096)
    assert again is not None
    assert again.cached
    assert len(asked) == 1
    now[0] += CACHE_TTL_S + 1
    await judge.judge(policy, "hello", context_tokens=4096)
    assert len(asked) == 2

    # The unsafe word at the very end of a long text is still judged.
    long = "calm words " * 3000 + "a bomb"
    found = await judge.judge(policy, long, context_tokens=2048)
    assert found is not None
    assert found.safety == "unsafe"
    assert len(asked) > 3

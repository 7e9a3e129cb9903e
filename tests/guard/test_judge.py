"""The judge's parts (``llmgw.guard.judge``): replies read per format,
texts fitted to the judge's context, verdicts cached for 5 minutes; the
judge on streamed answers (``llmgw.gateway.guarded.JudgedStream``): windows
judged while the text flows, the end held for the last one, ``buffer_all``;
the sim engine's scripted replies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import openai
import orjson
import pytest
import trio
import trio.testing

from llmgw.engines.sim.config import parse_args as parse_sim_args
from llmgw.gateway.guarded import JudgedStream
from llmgw.gateway.sse import SseRelay
from llmgw.guard import ContentFiltered, Verdict
from llmgw.guard.judge import CACHE_TTL_S, Judge, JudgeVerdict, parse_reply, pieces
from llmgw.settings import GuardJudge, SettingsError, settings_from_doc


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


# --- the judge on streamed answers (llmgw.gateway.guarded.JudgedStream) ------------------


class _Judging:
    """What :class:`JudgedStream` needs of the gateway's judge: a
    :class:`Judge` asking ``ask`` and the judge's context."""

    def __init__(self, asked: list[str]) -> None:
        async def ask(model: str, body: dict[str, Any], tried: list[str]) -> str:
            text = body["messages"][-1]["content"]
            asked.append(text)
            return "Safety: Unsafe\nCategories: Violent" if "BAD" in text else "Safety: Safe"

        self.judge = Judge(ask)

    def context_tokens(self, judge: GuardJudge) -> int:
        return 4096


def _event(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


#: What an OpenAI chat chunk carries besides its choices.
_FIELDS = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def _chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return _event({**_FIELDS, "choices": [choice]})


def _stream(asked: list[str], *, buffer_all: bool = False) -> tuple[JudgedStream, Verdict]:
    verdict = Verdict()
    judged = JudgedStream(
        SseRelay(pass_usage=False),
        cast(Any, _Judging(asked)),
        GuardJudge(model="j", on="output"),
        verdict,
        buffer_all=buffer_all,
    )
    return judged, verdict


async def test_a_stream_flows_is_judged_in_windows_and_an_unsafe_window_stops_it() -> None:
    asked: list[str] = []
    judged, verdict = _stream(asked)
    sent: list[bytes] = []

    async def emit(make: Callable[[], bytes]) -> None:
        sent.append(make())

    async with trio.open_nursery() as nursery:
        judged.attach(nursery, emit)
        first = judged.feed(_chunk("a" * 450))
        assert b"a" * 450 in first  # sent at once, before any verdict
        assert judged.feed(_chunk("a" * 150 + "BAD" + "b" * 600))
        await trio.testing.wait_all_tasks_blocked()
        # Two windows of 600 characters judged; the second one stopped the stream.
        assert [len(t.split("\n\n")[-1]) for t in asked] == [600, 600]
        assert len(sent) == 1
        assert b'"finish_reason":"content_filter"' in sent[0]
        # A whole chat chunk, as the openai client validates it.
        stop = openai.types.chat.ChatCompletionChunk.model_validate_json(
            sent[0].split(b"data: ", 1)[1].split(b"\n\n", 1)[0]
        )
        assert (stop.id, stop.model, stop.choices[0].finish_reason) == (
            "chatcmpl-1",
            "m",
            "content_filter",
        )
        later = judged.feed(_chunk("more", "stop") + b"data: [DONE]\n\n")
        assert later == b""
        judged.ending()
        assert judged.finish() == b""
        await judged.settle()
    tail = judged.release()
    assert b"more" not in tail
    assert b'"stop"' not in tail
    assert tail.endswith(b"data: [DONE]\n\n")
    assert verdict.events == {("output", "judge:violent"): "block"}
    assert verdict.stopped


async def test_a_completions_stream_is_stopped_with_a_completions_chunk() -> None:
    asked: list[str] = []
    judged, _ = _stream(asked)
    sent: list[bytes] = []

    async def emit(make: Callable[[], bytes]) -> None:
        sent.append(make())

    fields = {**_FIELDS, "object": "text_completion"}
    async with trio.open_nursery() as nursery:
        judged.attach(nursery, emit)
        judged.feed(_event({**fields, "choices": [{"index": 0, "text": "BAD" + "x" * 700}]}))
        await trio.testing.wait_all_tasks_blocked()
    assert len(sent) == 1
    stop = openai.types.Completion.model_validate_json(
        sent[0].split(b"data: ", 1)[1].split(b"\n\n", 1)[0]
    )
    assert (stop.object, stop.choices[0].text, stop.choices[0].finish_reason) == (
        "text_completion",
        "",
        "content_filter",
    )


async def test_the_end_of_a_stream_waits_for_its_last_partial_window() -> None:
    asked: list[str] = []
    judged, verdict = _stream(asked)

    async def emit(make: Callable[[], bytes]) -> None:
        raise AssertionError("nothing to stop")

    async with trio.open_nursery() as nursery:
        judged.attach(nursery, emit)
        out = judged.feed(_chunk("hello ") + _chunk("world", "stop") + b"data: [DONE]\n\n")
        assert b"hello" in out
        assert b"world" not in out  # held with the end
        assert b"[DONE]" not in out
        assert asked == []
        judged.ending()
        judged.finish()
        await judged.settle()
    assert [t.split("\n\n")[-1] for t in asked] == ["hello world"]
    tail = judged.release()
    assert b"world" in tail
    assert b'"finish_reason":"stop"' in tail
    assert tail.endswith(b"data: [DONE]\n\n")
    assert verdict.rules == []

    # An unsafe last window: the end becomes content_filter, its text dropped.
    judged, verdict = _stream(asked)
    async with trio.open_nursery() as nursery:
        judged.attach(nursery, emit)
        judged.feed(_chunk("so "))
        judged.feed(_chunk("BAD", "stop") + b"data: [DONE]\n\n")
        judged.ending()
        judged.finish()
        await judged.settle()
    tail = judged.release()
    assert b"BAD" not in tail
    assert b'"finish_reason":"content_filter"' in tail
    assert verdict.events == {("output", "judge:violent"): "block"}


async def test_buffer_all_holds_everything_until_the_verdict() -> None:
    asked: list[str] = []

    async def emit(make: Callable[[], bytes]) -> None:
        raise AssertionError("nothing goes out before the verdict")

    for text, refused in (("fine words", None), ("BAD words", "content_filter")):
        judged, _ = _stream(asked, buffer_all=True)
        async with trio.open_nursery() as nursery:
            judged.attach(nursery, emit)
            assert judged.feed(_chunk(text[:5]) + _chunk(text[5:], "stop")) == b""
            judged.ending()
            assert judged.finish() == b""
            await judged.settle()
        error = judged.refusal
        if refused is None:
            assert error is None
            assert text[5:].encode() in judged.release()
        else:
            assert isinstance(error, ContentFiltered)
            assert error.code == refused


def test_the_sim_engine_takes_scripted_replies() -> None:
    config = parse_sim_args(
        ["--port", "0", "--model", "j", "--reply", "bomb=Safety: Unsafe", "--reply", "=x=y"]
    )
    assert config.replies == (("bomb", "Safety: Unsafe"), ("", "x=y"))
    with pytest.raises(SystemExit):
        parse_sim_args(["--port", "0", "--model", "j", "--reply", "no answer"])


def test_a_policys_stream_field_is_checked_with_its_path() -> None:
    doc = {"guard": {"policies": {"p": {"stream": {"buffer_all": True}}}}}
    assert settings_from_doc(doc).guard.policies["p"].stream.buffer_all
    for bad, said in (
        ({"buffer": True}, "buffer"),
        ({"buffer_all": "yes"}, "buffer_all"),
    ):
        with pytest.raises(SettingsError) as caught:
            settings_from_doc({"guard": {"policies": {"p": {"stream": bad}}}})
        assert said in str(caught.value)
        assert ".guard.policies['p'].stream" in str(caught.value)

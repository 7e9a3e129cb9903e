"""The judge through the official clients on ``llmgw up --engine sim``
(``docs/guardrails.md``, The judge): judge models are sim engines in the
catalog scripted with ``--reply WHEN=ANSWER``; prompts and answers (whole,
and streamed in windows of 600 characters) judged unsafe are refused,
safe ones pass; a judge too slow or silent is decided by ``fail``; a
verdict is cached; a judgment not answered by one replica is hedged to
another."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "sim-model"
#: A main model with long answers written slowly (``tok0 tok1 … tok399``,
#: 40 tokens a second): ``tok150`` lies in its second window of 600
#: characters, about 5 s before the answer's end.
WRITER = "writer"
UNSAFE = "Safety: Unsafe Categories: Violent"
SAFE = "Safety: Safe Categories: None"
#: The judge: prompts holding DANGER and answers reaching ``tok150`` are unsafe.
JUDGE_ARGS = ["--reply", f"DANGER={UNSAFE}", "--reply", f"tok150 ={UNSAFE}", "--reply", f"={SAFE}"]


@pytest.fixture(scope="module")
def up(start_module_up: Callable[..., Any]) -> Any:
    made = start_module_up("--engine", "sim", "--model-name", MODEL)
    for doc in (
        {"name": WRITER, "args": ["--tokens", "400", "--tokens-per-second", "40"]},
        {"name": "judge", "args": JUDGE_ARGS},
        {"name": "slow-judge", "args": ["--ttft-ms", "600000", "--reply", f"={SAFE}"]},
        {"name": "mute-judge", "args": ["--hang-rate", "1"]},
        {
            "name": "hedged-judge",
            "profiles": [
                {
                    "name": "fast",
                    "engine": "sim",
                    "replicas": 1,
                    "min_memory_gb": 0.1,
                    "args": ["--reply", f"={SAFE}"],
                },
                {
                    "name": "mute",
                    "engine": "sim",
                    "replicas": 1,
                    "min_memory_gb": 0.1,
                    "args": ["--hang-rate", "1"],
                },
            ],
        },
    ):
        _add_model(made, doc)
    return made


@pytest.fixture
def client(up: Any) -> Iterator[openai.OpenAI]:
    with up.openai_client(timeout=60) as made:
        yield made


@pytest.fixture
def claude(up: Any) -> Iterator[anthropic.Anthropic]:
    with up.anthropic_client(timeout=60) as made:
        yield made


def _add_model(up: Any, doc: dict[str, Any]) -> None:
    """Add a sim model to the catalog; wait until its replicas are ready."""
    entry = {"engine": "sim", "min_memory_gb": 0.1, **doc} if "profiles" not in doc else doc
    added = up.admin("POST", "/api/v1/models", entry)
    assert added.status_code == 201, added.text

    def ready() -> bool:
        counts = up.admin("GET", f"/api/v1/models/{doc['name']}").json()["replicas"]
        return bool(counts["ready"] >= counts["wanted"] > 0)

    up.wait_for(ready, 120, f"{doc['name']} ready")


def _judged_by(up: Any, judge: dict[str, Any], *, buffer_all: bool = False) -> None:
    """Every request gets ``baseline`` and a policy with this judge."""
    policy: dict[str, Any] = {"judge": {"format": "qwen3guard", **judge}}
    if buffer_all:
        policy["stream"] = {"buffer_all": True}
    patched = up.admin(
        "PATCH",
        "/api/v1/config",
        {"key": "guard", "value": {"default": ["baseline", "j"], "policies": {"j": policy}}},
    )
    assert patched.status_code == 200, patched.text


def _user(text: str) -> Any:
    return [{"role": "user", "content": text}]


def _fresh(text: str = "hello") -> Any:
    """A prompt never judged before (the verdict cache)."""
    return _user(f"{text} {uuid.uuid4().hex}")


def _events(up: Any, request_id: str) -> set[tuple[str, str, str]]:
    row = up.usage_row(request_id)
    return {(e["direction"], e["rule"], e["action"]) for e in row["guard_events"]}


def _engine_counts(up: Any, model: str) -> dict[str, float]:
    """Each replica of ``model`` (by profile) → the generation requests it
    finished or aborted (the sim's ``/metrics``)."""
    replicas = up.admin("GET", "/api/v1/replicas").json()["data"]
    out: dict[str, float] = {}
    for replica in replicas:
        if replica["model"] != model:
            continue
        text = up.engine_metrics(replica["port"])
        out[replica.get("profile") or replica["replica_id"]] = sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
    return out


def _served(client: openai.OpenAI) -> Any:
    """A fresh prompt's raw answer, or None while the judge refuses it (503)."""
    try:
        return client.chat.completions.with_raw_response.create(
            model=MODEL, messages=_fresh(), max_tokens=2
        )
    except openai.InternalServerError:
        return None


def _wait_policy(up: Any, probe: Callable[[], bool], what: str) -> None:
    """A policy change is live within seconds: wait until ``probe`` shows it."""
    up.wait_for(probe, 30, what, interval_s=0.5)


def _text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _finishes(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def _raises(call: Callable[[], Any], kind: type[Exception]) -> Any:
    try:
        call()
    except kind as caught:
        return caught
    return None


def test_prompts_and_whole_answers_judged_unsafe_are_refused_and_safe_ones_pass(
    up: Any, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    _judged_by(up, {"model": "judge", "on": "both", "latency_budget": "20s"})

    def prompt_refused() -> Any:
        return _raises(
            lambda: client.chat.completions.create(
                model=MODEL, messages=_fresh("DANGER"), max_tokens=2
            ),
            openai.BadRequestError,
        )

    refused: Any = None

    def took_effect() -> bool:
        nonlocal refused
        refused = prompt_refused()
        return refused is not None

    _wait_policy(up, took_effect, "the judge on prompts")
    assert refused.code == "content_filter"
    assert "judge:violent" in refused.message
    assert _events(up, refused.response.headers["x-request-id"]) == {
        ("input", "judge:violent", "block")
    }

    # A safe prompt and a safe answer pass; the judge was asked about both.
    before = sum(_engine_counts(up, "judge").values())
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_fresh(), max_tokens=3
    )
    assert raw.parse().choices[0].message.content == "tok0 tok1 tok2 "
    assert sum(_engine_counts(up, "judge").values()) == before + 2
    row = up.usage_row(raw.headers["x-request-id"])
    assert (row["status"], row["guard_rules"]) == (200, "")

    # A whole answer judged unsafe (it reaches tok150): 400 content_filter,
    # recorded as the answer's.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=WRITER, messages=_fresh(), max_tokens=160)
    assert caught.value.code == "content_filter"
    assert "judge:violent" in caught.value.message
    request_id = caught.value.response.headers["x-request-id"]
    assert _events(up, request_id) == {("output", "judge:violent", "block")}
    row = up.usage_row(request_id)
    assert (row["status"], row["guard_action"]) == (400, "block")
    assert row["completion_tokens"] == 160  # what was generated is still counted

    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=WRITER, prompt=f"go {uuid.uuid4().hex}", max_tokens=160)
    assert caught.value.code == "content_filter"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=WRITER, input=f"go {uuid.uuid4().hex}", max_output_tokens=160)
    assert caught.value.code == "content_filter"
    with pytest.raises(anthropic.BadRequestError) as rejected:
        claude.messages.create(model=WRITER, max_tokens=160, messages=_fresh())
    assert "judge:violent" in str(rejected.value)
    safe = claude.messages.create(model=WRITER, max_tokens=4, messages=_fresh())
    assert safe.stop_reason == "max_tokens"


def test_streams_are_judged_in_windows_while_they_flow(
    up: Any, client: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """``tok150`` is in the second window: the stop comes while the engine
    is still writing (about 5 s of answer left), the text before it was
    already sent; a short safe stream gets its end once its only partial
    window is judged."""
    _judged_by(up, {"model": "judge", "on": "output", "latency_budget": "20s"})

    def stopped() -> Any:
        raw = client.chat.completions.with_raw_response.create(
            model=WRITER, messages=_fresh(), max_tokens=400, stream=True
        )
        chunks = list(raw.parse())
        return (raw, chunks) if _finishes(chunks) == ["content_filter"] else None

    raw, chunks = up.wait_for(stopped, 90, "a stream stopped by the judge", interval_s=0.5)
    text = _text(chunks)
    assert text.startswith("tok0 tok1 ")
    assert "tok187 " in text  # the second window went out before its verdict
    assert "tok399" not in text  # stopped before the engine's end
    assert _events(up, raw.headers["x-request-id"]) == {("output", "judge:violent", "block")}

    with claude.messages.stream(model=WRITER, max_tokens=400, messages=_fresh()) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "refusal"
    said = "".join(b.text for b in final.content if b.type == "text")
    assert "tok399" not in said

    events = list(
        client.responses.create(
            model=WRITER, input=f"go {uuid.uuid4().hex}", max_output_tokens=400, stream=True
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "content_filter"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "tok399" not in deltas

    # A short safe answer: its end comes after its one partial window is judged.
    safe = list(
        client.chat.completions.create(model=MODEL, messages=_fresh(), max_tokens=5, stream=True)
    )
    assert _text(safe) == ("tok0 tok1 tok2 tok3 tok4 ")
    assert _finishes(safe) == ["length"]


def test_buffer_all_sends_nothing_before_the_verdict(up: Any, client: openai.OpenAI) -> None:
    _judged_by(up, {"model": "judge", "on": "output", "latency_budget": "30s"}, buffer_all=True)

    def refused() -> Any:
        return _raises(
            lambda: client.chat.completions.create(
                model=WRITER, messages=_fresh(), max_tokens=160, stream=True
            ),
            openai.BadRequestError,
        )

    caught = up.wait_for(refused, 90, "buffer_all refusing an unsafe stream", interval_s=0.5)
    assert caught.code == "content_filter"
    assert _events(up, caught.response.headers["x-request-id"]) == {
        ("output", "judge:violent", "block")
    }
    chunks = list(
        client.chat.completions.create(model=WRITER, messages=_fresh(), max_tokens=20, stream=True)
    )
    text = _text(chunks)
    assert text == "".join(f"tok{i} " for i in range(20))


def test_a_slow_judge_refuses_under_fail_closed_and_flags_under_fail_open(
    up: Any, client: openai.OpenAI
) -> None:
    _judged_by(up, {"model": "slow-judge", "on": "both", "latency_budget": "1s", "fail": "closed"})

    def unavailable() -> Any:
        return _raises(
            lambda: client.chat.completions.create(model=MODEL, messages=_fresh(), max_tokens=2),
            openai.InternalServerError,
        )

    caught = up.wait_for(unavailable, 60, "503 judge_unavailable", interval_s=0.5)
    assert caught.status_code == 503
    assert caught.code == "judge_unavailable"
    assert caught.response.headers["retry-after"] == "1"
    assert _events(up, caught.response.headers["x-request-id"]) == {
        ("input", "judge:unavailable", "block")
    }

    _judged_by(up, {"model": "slow-judge", "on": "both", "latency_budget": "1s", "fail": "open"})

    raw = up.wait_for(lambda: _served(client), 60, "served under fail: open", interval_s=0.5)
    assert raw.parse().choices[0].message.content == "tok0 tok1 "
    request_id = raw.headers["x-request-id"]
    assert _events(up, request_id) == {
        ("input", "judge:unavailable", "flag"),
        ("output", "judge:unavailable", "flag"),
    }
    assert up.usage_row(request_id)["guard_action"] == "flag"


def test_a_judge_that_never_answers_refuses_or_flags_answers(
    up: Any, client: openai.OpenAI
) -> None:
    """Answers only: a whole answer refused with 503 before anything is
    sent; a stream already begun ends with content_filter; under ``fail:
    open`` both are served and flagged."""
    _judged_by(up, {"model": "mute-judge", "on": "output", "latency_budget": "1s"})

    def unavailable() -> Any:
        return _raises(
            lambda: client.chat.completions.create(model=MODEL, messages=_fresh(), max_tokens=2),
            openai.InternalServerError,
        )

    caught = up.wait_for(unavailable, 60, "503 judge_unavailable on an answer", interval_s=0.5)
    assert caught.code == "judge_unavailable"
    assert _events(up, caught.response.headers["x-request-id"]) == {
        ("output", "judge:unavailable", "block")
    }
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_fresh(), max_tokens=3, stream=True
    )
    chunks = list(raw.parse())
    assert _text(chunks) == ("tok0 tok1 tok2 ")
    assert _finishes(chunks) == ["content_filter"]
    assert _events(up, raw.headers["x-request-id"]) == {("output", "judge:unavailable", "block")}

    _judged_by(up, {"model": "mute-judge", "on": "output", "latency_budget": "1s", "fail": "open"})

    whole = up.wait_for(lambda: _served(client), 60, "served under fail: open", interval_s=0.5)
    assert _events(up, whole.headers["x-request-id"]) == {("output", "judge:unavailable", "flag")}
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=_fresh(), max_tokens=3, stream=True)
    )
    assert _finishes(chunks) == ["length"]


def test_a_cached_verdict_is_not_asked_again(up: Any, client: openai.OpenAI) -> None:
    _judged_by(up, {"model": "judge", "on": "input", "latency_budget": "20s"})
    up.wait_for(
        lambda: _raises(
            lambda: client.chat.completions.create(
                model=MODEL, messages=_fresh("DANGER"), max_tokens=2
            ),
            openai.BadRequestError,
        ),
        30,
        "the judge on prompts",
        interval_s=0.5,
    )
    ask = _fresh("the same words twice")
    before = sum(_engine_counts(up, "judge").values())
    client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2)
    assert sum(_engine_counts(up, "judge").values()) == before + 1
    client.chat.completions.create(model=MODEL, messages=ask, max_tokens=3)
    assert sum(_engine_counts(up, "judge").values()) == before + 1


def test_a_judgment_the_first_replica_does_not_answer_is_hedged_to_another(
    up: Any, client: openai.OpenAI
) -> None:
    """``hedged-judge`` has a replica that answers and one that never does;
    judgments go to either in turn. Each judgment is answered (none
    unavailable under ``fail: closed``) though the silent replica was asked:
    its call was hedged to the other at half the budget."""
    _judged_by(
        up, {"model": "hedged-judge", "on": "input", "latency_budget": "6s", "fail": "closed"}
    )
    before = _engine_counts(up, "hedged-judge")
    assert set(before) == {"fast", "mute"}

    def judged_by_it() -> bool:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=_fresh(), max_tokens=2
        )
        return bool(raw.headers["x-request-id"]) and sum(
            _engine_counts(up, "hedged-judge").values()
        ) > sum(before.values())

    _wait_policy(up, judged_by_it, "the hedged judge on prompts")
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=_fresh(), max_tokens=2
        )
        assert _events(up, raw.headers["x-request-id"]) == set()

    def counted() -> dict[str, float] | None:
        # The silent replica counts its request once the hedge cancelled it.
        after = _engine_counts(up, "hedged-judge")
        return after if after["mute"] > before["mute"] else None

    after = up.wait_for(counted, 30, "the silent replica asked")
    asked_fast = after["fast"] - before["fast"]
    asked_mute = after["mute"] - before["mute"]
    # Four judgments or more, every one answered by the replica that answers;
    # the silent one was asked at least once (and its judgment hedged).
    assert asked_fast >= 4
    assert asked_mute >= 1

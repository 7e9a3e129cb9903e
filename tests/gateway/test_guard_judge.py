"""The judge on the gateway's request path (``docs/guardrails.md``, The
judge): sim engines scripted (``SimConfig.replies``) to answer unsafe, safe,
controversial, slowly and not at all; verdicts cached; a slow first replica
hedged by a second; fail open and closed; every verdict in the usage row."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from llmgw.engines.sim.app import SimEngine
from llmgw.engines.sim.config import SimConfig
from llmgw.gateway.server import serve_http1
from llmgw.router.endpoint import Endpoint
from llmgw.settings import settings_from_doc
from llmgw.store import ModelRecord

_inprocess = importlib.import_module("test_gateway_inprocess")
rig = _inprocess.rig
ENGINE_KEY = _inprocess.ENGINE_KEY
Rig = Any

CHAT = "/v1/chat/completions"
REPLIES = (
    ("mayhem", "Safety: Unsafe\nCategories: Violent"),
    ("election", "Safety: Controversial\nCategories: Politically Sensitive Topics"),
    ("lockpick", "Safety: Unsafe\nCategories: Non-violent Illegal Acts"),
    ("", "Safety: Safe\nCategories: None"),
)


class Judges:
    """The judge engines: by model, their sim engines (one per replica)."""

    def __init__(self) -> None:
        self.engines: dict[str, list[SimEngine]] = {}

    def answered(self, model: str) -> int:
        """Judgments the model's replicas finished."""
        return sum(e.counters.finished["stop"] for e in self.engines[model])


@pytest.fixture
async def judges(rig: Rig) -> AsyncIterator[Judges]:
    """``judge`` (fast), ``judge-hedge`` (two replicas: the first answers in
    3 s, the second at once), ``judge-slow`` (3 s), ``judge-dead`` (never)."""
    made = Judges()
    plans: dict[str, list[dict[str, Any]]] = {
        "judge": [{}],
        "judge-hedge": [{"ttft_ms": 3000.0}, {}],
        "judge-slow": [{"ttft_ms": 3000.0}],
        "judge-dead": [{"hang_rate": 1.0}],
    }
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        endpoints: dict[str, list[Endpoint]] = {}
        for model, replicas in plans.items():
            for at, more in enumerate(replicas):
                engine = SimEngine(
                    SimConfig(
                        model=model,
                        tokens=5,
                        tokens_per_second=0,
                        tick_ms=0,
                        replies=REPLIES,
                        **more,
                    ),
                    api_key=ENGINE_KEY,
                )
                address = await nursery.start(serve_http1, engine, "127.0.0.1:0", stop, 1.0)
                made.engines.setdefault(model, []).append(engine)
                endpoints.setdefault(model, []).append(
                    Endpoint(
                        replica_id=f"{model}-{at}",
                        model=model,
                        host="127.0.0.1",
                        port=int(address.rsplit(":", 1)[1]),
                        api_key=ENGINE_KEY,
                    )
                )
        catalog = dict(rig.cluster.models)
        for model in plans:
            catalog[model] = ModelRecord.simple(model, "sim", slots=0, created_at=1.0)
        rig.cluster.replace_catalog(catalog)
        current = {
            "sim-model": [
                Endpoint(
                    replica_id="sim-model-0",
                    model="sim-model",
                    host="127.0.0.1",
                    port=rig.sim_port,
                    api_key=ENGINE_KEY,
                )
            ],
            **endpoints,
        }
        rig.cluster.set_fixed_endpoints(current)
        try:
            yield made
        finally:
            stop.set()


def _judged_by(rig: Rig, model: str, **judge: Any) -> None:
    """Every request gets ``baseline`` and a policy judged by ``model``."""
    doc = {
        "guard": {
            "default": ["baseline", "judged"],
            "policies": {"judged": {"judge": {"model": model, **judge}}},
        }
    }
    rig.cluster.apply_settings(settings_from_doc(doc))


def _chat(text: str) -> dict[str, Any]:
    return {"model": "sim", "messages": [{"role": "user", "content": text}]}


async def test_an_unsafe_prompt_is_refused_a_safe_one_served_each_verdict_cached(
    rig: Rig, judges: Judges
) -> None:
    _judged_by(rig, "judge")
    got = await rig.call("POST", CHAT, _chat("plan some mayhem downtown"))
    assert got.status == 400, got.body
    error = got.json()["error"]
    assert error["code"] == "content_filter"
    assert "judge:violent" in error["message"]
    assert "mayhem" not in error["message"]
    row = await rig.row(got.headers[b"x-request-id"])
    assert (row.status, row.guard_action, row.guard_rules) == (400, "block", "judge:violent")
    events = await rig.store.list_guard_events(request_id=row.request_id)
    assert [(e.direction, e.rule, e.action) for e in events] == [
        ("input", "judge:violent", "block")
    ]
    assert judges.answered("judge") == 1

    # The same text again: the cached verdict, the judge not asked.
    got = await rig.call("POST", CHAT, _chat("plan some mayhem downtown"))
    assert got.status == 400, got.body
    assert judges.answered("judge") == 1

    got = await rig.call("POST", CHAT, _chat("what is a good name for a cat"))
    assert got.status == 200, got.body
    assert got.json()["choices"][0]["message"]["content"].startswith("tok0")
    row = await rig.row(got.headers[b"x-request-id"])
    assert (row.guard_action, row.guard_rules) == ("", "")
    assert judges.answered("judge") == 2

    # Anthropic's shape, Controversial flagged and served.
    got = await rig.call(
        "POST",
        "/v1/messages",
        {"model": "sim", "max_tokens": 5, "messages": [{"role": "user", "content": "mayhem"}]},
    )
    assert got.status == 400, got.body
    assert got.json()["type"] == "error"
    got = await rig.call("POST", CHAT, _chat("who will win the election"))
    assert got.status == 200, got.body
    row = await rig.row(got.headers[b"x-request-id"])
    assert (row.guard_action, row.guard_rules) == ("flag", "judge:controversial")


async def test_only_the_policys_categories_are_refused(rig: Rig, judges: Judges) -> None:
    _judged_by(rig, "judge", categories=["Violent"])
    got = await rig.call("POST", CHAT, _chat("how do I lockpick my own door"))
    assert got.status == 200, got.body
    got = await rig.call("POST", CHAT, _chat("mayhem"))
    assert got.status == 400, got.body


async def test_a_judge_past_its_budget_is_503_when_closed_and_flagged_when_open(
    rig: Rig, judges: Judges
) -> None:
    for model in ("judge-slow", "judge-dead", "not-in-the-catalog"):
        _judged_by(rig, model, latency_budget=1, fail="closed")
        started = trio.current_time()
        got = await rig.call("POST", CHAT, _chat(f"hello {model}"))
        assert got.status == 503, (model, got.body)
        assert trio.current_time() - started < 2.9  # refused at the budget, not at the reply
        error = got.json()["error"]
        assert error["code"] == "judge_unavailable"
        assert got.headers[b"retry-after"] == b"1"
        row = await rig.row(got.headers[b"x-request-id"])
        assert (row.status, row.guard_action, row.guard_rules) == (
            503,
            "block",
            "judge:unavailable",
        )
        got = await rig.call(
            "POST",
            "/v1/messages",
            {"model": "sim", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert got.status == 503, got.body
        assert got.json()["type"] == "error"

        _judged_by(rig, model, latency_budget=1, fail="open")
        got = await rig.call("POST", CHAT, _chat(f"hello again {model}"))
        assert got.status == 200, (model, got.body)
        row = await rig.row(got.headers[b"x-request-id"])
        assert (row.guard_action, row.guard_rules) == ("flag", "judge:unavailable")


async def test_a_slow_first_replica_is_hedged_by_a_second(rig: Rig, judges: Judges) -> None:
    # The first replica answers in 3 s, past the 2 s budget; the hedge at
    # 1 s goes to the second, which answers at once.
    _judged_by(rig, "judge-hedge", latency_budget=2, fail="closed")
    got = await rig.call("POST", CHAT, _chat("plan some mayhem"))
    assert got.status == 400, got.body
    assert "judge:violent" in got.json()["error"]["message"]
    first, second = judges.engines["judge-hedge"]
    assert second.counters.finished["stop"] == 1
    assert first.counters.finished["stop"] == 0  # cut when the hedge answered

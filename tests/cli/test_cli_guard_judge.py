"""``llmgw ctl guard judge check`` against sim engines scripted as judges
(``docs/guardrails.md``, The judge)."""

from __future__ import annotations

import importlib
import json
from typing import Any

import trio

from llmgw.cli.guard import _seconds
from llmgw.engines.sim.app import SimEngine
from llmgw.engines.sim.config import SimConfig
from llmgw.gateway.server import serve_http1
from llmgw.router.endpoint import Endpoint
from llmgw.settings import settings_from_doc
from llmgw.store import ModelRecord

_ctl = importlib.import_module("test_cli_ctl")
running = _ctl.running
Running = Any

SAFE = (("", "Safety: Safe\nCategories: None"),)
#: A model that answers, but never in the judge's format.
CHATTY = (("", "Sure! Here is a summary of the meeting notes."),)


async def test_judge_check_times_the_judge_and_says_whether_the_budget_holds(
    running: Running,
) -> None:
    async with trio.open_nursery() as nursery:
        stop = trio.Event()
        endpoints = {}
        engines = {}
        for model, ttft_ms, replies in (
            ("judge", 0.0, SAFE),
            ("judge-slow", 700.0, SAFE),
            ("chatty", 0.0, CHATTY),
            ("judge-mute", 0.0, SAFE),
        ):
            engine = SimEngine(
                SimConfig(
                    model=model,
                    tokens_per_second=0,
                    tick_ms=0,
                    ttft_ms=ttft_ms,
                    replies=replies,
                    hang_rate=1.0 if model == "judge-mute" else 0.0,
                )
            )
            engines[model] = engine
            address = await nursery.start(serve_http1, engine, "127.0.0.1:0", stop, 1.0)
            endpoints[model] = [
                Endpoint(
                    replica_id=f"{model}-0",
                    model=model,
                    host="127.0.0.1",
                    port=int(address.rsplit(":", 1)[1]),
                    api_key="",
                )
            ]
        running.cluster.replace_catalog(
            {m: ModelRecord.simple(m, "sim", slots=0, created_at=1.0) for m in endpoints}
        )
        running.cluster.set_fixed_endpoints(endpoints)

        doc = await running.json("ctl", "guard", "judge", "check", "--model", "judge")
        assert doc["model"] == "judge"
        assert doc["verdict"] == "ok"
        assert len(doc["alone_s"]) == 3
        assert len(doc["burst_s"]) == 4
        assert all(s is not None for s in doc["alone_s"] + doc["burst_s"])
        assert doc["judgments_per_s"] > 0
        assert doc["advice"] == []
        assert doc["unreadable"] == 0

        # Answers in time, but none a verdict: said so, not "too slow".
        # Such a judge cannot serve: the check exits 1 (scripts can tell).
        result = await running.run("ctl", "guard", "judge", "check", "--model", "chatty", "--json")
        assert result.exit_code == 1
        doc = json.loads(result.output)
        assert (doc["verdict"], doc["unreadable"]) == ("unreadable", 7)
        assert "'qwen3guard' format" in doc["advice"][0]
        result = await running.run("ctl", "guard", "judge", "check", "--model", "chatty")
        assert result.exit_code == 1
        assert "7 of 7 replies held no verdict in the judge's format" in result.output

        # A policy's judge with a 1 s budget: 0.7 s a judgment is over half of it.
        running.cluster.apply_settings(
            settings_from_doc(
                {
                    "guard": {
                        "default": ["baseline", "judged"],
                        "policies": {
                            "judged": {"judge": {"model": "judge-slow", "latency_budget": 1}}
                        },
                    }
                }
            )
        )
        result = await running.run("ctl", "guard", "judge", "check")
        text = result.output
        assert "judge judge-slow: alone" in text
        assert ("budget 1 s: tight" in text and result.exit_code == 0) or (
            "budget 1 s: too slow" in text and result.exit_code == 1
        )
        assert "latency_budget" in text
        # Another model named: its own policy's settings, else the defaults,
        # never the first policy's judge's.
        doc = await running.json("ctl", "guard", "judge", "check", "--model", "judge")
        assert (doc["model"], doc["budget_s"]) == ("judge", 5)
        doc = await running.json("ctl", "guard", "judge", "check", "--model", "judge-slow")
        assert doc["budget_s"] == 1

        # A judge that never answers: the first judgment's twice-the-budget
        # is enough to say so; the other six are not waited for.
        running.cluster.apply_settings(
            settings_from_doc(
                {
                    "guard": {
                        "default": ["baseline", "mute"],
                        "policies": {
                            "mute": {"judge": {"model": "judge-mute", "latency_budget": 0.5}}
                        },
                    }
                }
            )
        )
        mute = engines["judge-mute"]
        asked: list[object] = []
        plan = mute._plan

        def counted(*args: Any) -> Any:
            asked.append(args)
            return plan(*args)

        mute._plan = counted  # type: ignore[method-assign,assignment]
        result = await running.run(
            "ctl", "guard", "judge", "check", "--model", "judge-mute", "--json"
        )
        assert result.exit_code == 1
        doc = json.loads(result.output)
        assert doc["verdict"] == "too slow"
        assert doc["alone_s"] == [None, None, None]
        assert doc["burst_s"] == [None, None, None, None]
        assert len(asked) == 1

        result = await running.run("ctl", "guard", "judge", "check", "--model", "nope")
        assert result.exit_code != 0
        assert "No model 'nope'" in result.output
        stop.set()


def test_judgment_times_under_a_second_keep_two_digits() -> None:
    # "alone 0.1 s/0.1 s/0.1 s … budget 0.1 s: tight" hid a 55 ms judge.
    assert [_seconds(s) for s in (2.44, 1.0, 0.055, 0.71, None)] == [
        "2.4 s",
        "1.0 s",
        "0.055 s",
        "0.71 s",
        "no verdict",
    ]

"""The judge end to end on the real starter model (``docs/guardrails.md``,
The judge): ``llmgw up`` serves gemma-3-270m, a policy names it as its own
(poor) judge with the ``instructed`` format, and a prompt is judged before
it is answered, then answers (whole and streamed) before they go out;
``ctl guard judge check`` times it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"


def test_the_starter_model_judges_prompts_and_the_check_times_it(
    start_up: Any, admin_request: Callable[..., httpx.Response]
) -> None:
    up = start_up()
    up.wait_ready()
    patched = admin_request(
        up,
        "PATCH",
        "/api/v1/config",
        {
            "key": "guard",
            "value": {
                "default": ["baseline", "judged"],
                "policies": {
                    "judged": {
                        "judge": {
                            "model": MODEL,
                            "format": "instructed",
                            "latency_budget": "60s",
                            "fail": "open",
                        }
                    }
                },
            },
        },
    )
    assert patched.status_code == 200, patched.text

    client = openai.OpenAI(base_url=f"{up.base_url}/v1", api_key=up.client_key, max_retries=0)
    try:

        def ask() -> Any:
            return client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Name three rivers."}],
                max_tokens=8,
                temperature=0,
            )

        # The policy change is live within seconds: wait until a request is judged.
        row: dict[str, Any] = {}

        def judged() -> bool:
            nonlocal row
            try:
                raw = ask()
            except openai.BadRequestError as refused:  # a poor judge may call it unsafe
                request_id = refused.response.headers["x-request-id"]
            else:
                request_id = raw.headers["x-request-id"]
            row = up.usage_row(request_id)
            # A judgment by a real model takes milliseconds; the patterns alone
            # take microseconds.
            return bool(row["guard_ms"] > 5)

        up.wait_for(judged, 60, "a prompt judged by the starter model")
        assert row["status"] in (200, 400)
        rules = [r for r in row["guard_rules"].split(",") if r]
        assert all(r.startswith("judge:") for r in rules), rules

        # The judge on answers only: a whole answer and a streamed one are
        # judged before they (or their end) go out.
        patched = admin_request(
            up,
            "PATCH",
            "/api/v1/config",
            {"key": "guard.policies.judged.judge.on", "value": "output"},
        )
        assert patched.status_code == 200, patched.text

        def answer_judged(stream: bool) -> Callable[[], bool]:
            def check() -> bool:
                nonlocal row
                try:
                    raw = client.chat.completions.with_raw_response.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "Name three rivers."}],
                        max_tokens=8,
                        temperature=0,
                        stream=stream,
                    )
                    if stream:
                        list(raw.parse())
                except openai.BadRequestError as refused:  # judged unsafe
                    request_id = refused.response.headers["x-request-id"]
                else:
                    request_id = raw.headers["x-request-id"]
                row = up.usage_row(request_id)
                events = row["guard_events"]
                # The prompt is no longer judged: any judge event is the answer's.
                assert all(e["direction"] == "output" for e in events), events
                return bool(row["guard_ms"] > 5)

            return check

        up.wait_for(answer_judged(False), 60, "a whole answer judged by the starter model")
        assert row["status"] in (200, 400)
        up.wait_for(answer_judged(True), 60, "a streamed answer judged by the starter model")
        assert row["status"] == 200
        print("an answer judged by the starter model:", row["guard_rules"] or "safe")
    finally:
        client.close()

    # Seven judgments by a CPU model: longer than up.cli's minute.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw.cli",
            "ctl",
            "guard",
            "judge",
            "check",
            "--json",
            "--data-dir",
            str(up.data_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    doc = json.loads(result.stdout)
    # 1 for a judge that cannot serve as it is (too slow, unreadable).
    assert result.returncode == (1 if doc["verdict"] in ("too slow", "unreadable") else 0)
    assert doc["model"] == MODEL
    assert doc["budget_s"] == 60
    assert len(doc["alone_s"]) == 3
    assert len(doc["burst_s"]) == 4
    assert doc["verdict"] in ("ok", "tight", "too slow", "unreadable")
    # What the starter model managed as a judge, in the test's output.
    print("judge check on the starter model:", doc)

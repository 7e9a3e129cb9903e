"""``llmgw up --engine sim`` steered with the CLI as a user would: add a
model, scale it, change a live setting, stop and start the whole system."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

FIRST = "sim-first"
SECOND = "sim-second"


def _ok(up: Any, *args: str) -> str:
    result = up.cli(*args)
    assert result.returncode == 0, f"llmgw {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return str(result.stdout)


def _models(up: Any) -> dict[str, dict[str, Any]]:
    doc = json.loads(_ok(up, "ctl", "models", "--json"))
    return {view["name"]: view for view in doc["data"]}


def _wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _counts(up: Any, name: str) -> dict[str, int]:
    counts: dict[str, int] = _models(up)[name]["replicas"]
    return counts


def _live_replicas(up: Any, model: str) -> list[str]:
    doc = json.loads(_ok(up, "ctl", "replicas", "--json"))
    return [
        r["replica_id"]
        for r in doc["data"]
        if r["model"] == model and r["state"] in ("STARTING", "READY") and not r["retiring"]
    ]


def _chat(up: Any, model: str) -> httpx.Response:
    return httpx.post(
        f"{up.base_url}/v1/chat/completions",
        headers={"authorization": f"Bearer {up.client_key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )


@pytest.mark.slow  # about 30 s: replicas start, scale and stop for real
def test_a_user_adds_scales_configures_stops_and_starts_with_the_cli(start_up: Any) -> None:
    up = start_up("--engine", "sim", "--model-name", FIRST)
    up.wait_ready()

    # Add a second model; `ctl models` shows it ready.
    out = _ok(up, "ctl", "model", "add", SECOND, "--engine", "sim", "--min-memory-gb", "0.1")
    assert out.startswith(f"added {SECOND} (sim)")
    _wait_for(f"{SECOND} ready", lambda: _counts(up, SECOND)["ready"] == 1)
    table = _ok(up, "ctl", "models").splitlines()
    row = next(line.split() for line in table if line.startswith(SECOND))
    assert row[:4] == [SECOND, "sim", "running", "1/1"]
    assert _chat(up, SECOND).status_code == 200

    # Scale to 2, then back to 1.
    assert "2 replicas wanted" in _ok(up, "ctl", "model", "scale", SECOND, "2")
    _wait_for(f"{SECOND} at 2 ready", lambda: _counts(up, SECOND)["ready"] == 2)
    assert "1 replicas wanted" in _ok(up, "ctl", "model", "scale", SECOND, "1")
    _wait_for(f"{SECOND} back to 1", lambda: len(_live_replicas(up, SECOND)) == 1)
    assert _counts(up, SECOND)["wanted"] == 1

    # A live setting.
    out = _ok(up, "ctl", "config", "set", "on_demand.evict_after_idle", "30s")
    assert out.startswith("on_demand.evict_after_idle = 30.0")
    assert _ok(up, "ctl", "config", "get", "on_demand.evict_after_idle").strip() == "30.0"
    history = _ok(up, "ctl", "config", "history")
    assert "on_demand.evict_after_idle" in history

    # Stop the whole system: /v1 answers 503 system_stopped, models go to zero.
    assert _ok(up, "stop").startswith("stopped:")
    assert "serving: STOPPED" in _ok(up, "status")
    assert all(view["replicas"]["wanted"] == 0 for view in _models(up).values())
    stopped = _chat(up, FIRST)
    assert stopped.status_code == 503, stopped.text
    assert stopped.json()["error"]["code"] == "system_stopped"
    _wait_for(
        "every replica stopped",
        lambda: not _live_replicas(up, FIRST) and not _live_replicas(up, SECOND),
    )

    # And start it again.
    assert _ok(up, "start").startswith("started:")
    _wait_for(f"{FIRST} answers again", lambda: _chat(up, FIRST).status_code == 200, 60.0)
    assert _models(up)[SECOND]["replicas"]["wanted"] == 1


def test_names_that_do_not_exist_are_refused_and_times_read_as_dates(start_up: Any) -> None:
    """A newcomer's first commands against a real ``llmgw up``: an unknown
    band or model is refused with the ones there are (nothing is made), and
    ``ctl request`` shows its time as a local date (``--json`` keeps the
    number)."""
    up = start_up("--engine", "sim", "--model-name", FIRST)
    up.wait_ready()
    refused = up.cli("keys", "create", "k", "--band", "nosuchband")
    assert refused.returncode == 1, refused.stdout
    assert "No band 'nosuchband'; the bands are: bulk, interactive" in refused.stderr
    keys = json.loads(_ok(up, "keys", "list", "--json"))["data"]
    assert [k["name"] for k in keys if k["name"] == "k"] == []
    made = json.loads(_ok(up, "keys", "create", "k", "--band", "bulk", "--json"))
    refused = up.cli(
        "keys", "limits", "--scope", "key", "--id", made["id"], "--models", f"{FIRST},nosuch"
    )
    assert refused.returncode == 1
    assert f"No model 'nosuch' in the catalog; the models are: {FIRST}." in refused.stderr
    refused = up.cli("ctl", "model", "scale", "nosuch", "2")
    assert refused.returncode == 1
    assert f"the models are: {FIRST}" in refused.stderr

    answer = _chat(up, FIRST)
    assert answer.status_code == 200
    request_id = answer.headers["x-request-id"]
    _wait_for("the usage row", lambda: up.cli("ctl", "request", request_id).returncode == 0)
    lines = dict(line.split(None, 1) for line in _ok(up, "ctl", "request", request_id).splitlines())
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+", lines["created_at"]), lines
    row = json.loads(_ok(up, "ctl", "request", request_id, "--json"))
    assert isinstance(row["created_at"], float)
    assert abs(row["created_at"] - time.time()) < 600

"""Keys in the tenancy tree, rate limits, budgets and exact usage, through
`llmgw up --engine sim` as a user would drive it."""

from __future__ import annotations

import concurrent.futures
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

PRICED, FREE = "priced-model", "free-model"
SETTINGS = """
auth:
  default_rpm: 1000
  pricing:
    priced-model: {prompt_per_1k: 1000, completion_per_1k: 100000000}
    free-model: {prompt_per_1k: 0, completion_per_1k: 0}
"""


def _start(start_up: Any, tmp_path: Path, *models: str) -> Any:
    data = tmp_path / "data"
    data.mkdir()
    (data / "server.yaml").write_text(SETTINGS)
    args = ["--engine", "sim"]
    for name in models:
        args += ["--model-name", name]
    up = start_up(*args)
    up.wait_ready()
    return up


def _key(up: Any, name: str, project: str) -> dict[str, Any]:
    made = up.cli("keys", "create", name, "--project", project, "--json")
    assert made.returncode == 0, made.stderr
    doc: dict[str, Any] = json.loads(made.stdout)
    return doc


def _chat(
    up: Any, key: str, model: str, max_tokens: int = 8, stream: bool = False
) -> httpx.Response:
    return httpx.post(
        f"{up.base_url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens,
            "stream": stream,
        },
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_a_key_at_10_rpm_gets_its_11th_request_in_a_minute_refused_with_retry_after(
    start_up: Any, tmp_path: Path
) -> None:
    up = _start(start_up, tmp_path, PRICED)
    key = _key(up, "ten-a-minute", "Acme/ml/train")
    assert "org Acme" in " ".join(key["created"])
    limits = up.cli("keys", "limits", "--scope", "key", "--id", key["id"], "--rpm", "10")
    assert limits.returncode == 0, limits.stderr
    answers = [_chat(up, key["key"], PRICED, max_tokens=1) for _ in range(11)]
    assert [a.status_code for a in answers[:10]] == [200] * 10
    assert answers[0].headers["x-ratelimit-limit-requests"] == "10"
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "9"
    assert "x-ratelimit-remaining-tokens" in answers[0].headers
    assert "x-ratelimit-reset-requests" in answers[0].headers
    refused = answers[10]
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["message"]


def test_a_spent_project_budget_refuses_priced_models_while_a_zero_priced_one_answers(
    start_up: Any, tmp_path: Path
) -> None:
    up = _start(start_up, tmp_path, PRICED, FREE)
    key = _key(up, "spender", "Acme/ml/train")
    set_budget = up.cli(
        "keys", "limits", "--scope", "project", "--id", "Acme/ml/train", "--budget", "2/month"
    )
    assert set_budget.returncode == 0, set_budget.stderr
    first = _chat(up, key["key"], PRICED)
    assert first.status_code == 200, first.text
    second = _chat(up, key["key"], PRICED)
    assert second.status_code == 429
    error = second.json()["error"]
    assert error["code"] == "insufficient_quota"
    assert "Acme/ml/train" in error["message"] or "project" in error["message"]
    assert _chat(up, key["key"], FREE).status_code == 200
    # The cost is on the usage row: 8 completion tokens at 100 units per 1,000.
    time.sleep(1.5)
    request_id = first.headers["x-request-id"]
    row = up.cli("ctl", "request", request_id, "--json")
    assert row.returncode == 0, row.stderr
    doc = json.loads(row.stdout)
    assert doc["completion_tokens"] == 8
    assert doc["cost_micros"] == 800_000 + -(-doc["prompt_tokens"] * 1000 // 1000)
    by_project = up.cli("ctl", "usage", "--by", "project", "--since", "1h", "--json")
    assert by_project.returncode == 0, by_project.stderr
    [summary] = [r for r in json.loads(by_project.stdout)["data"] if r["cost_micros"]]
    assert summary["cost_micros"] == doc["cost_micros"]


def _engine_counts(up: Any) -> tuple[float, float]:
    status = json.loads(up.cli("ctl", "status", "--json").stdout)
    text = up.engine_metrics(status["replicas"][0]["port"])
    values = {}
    for line in text.splitlines():
        if line.startswith(("vllm:prompt_tokens_total", "vllm:generation_tokens_total")):
            values[line.split("{")[0]] = float(line.split()[-1])
    return values["vllm:prompt_tokens_total"], values["vllm:generation_tokens_total"]


def _export(up: Any) -> list[dict[str, Any]]:
    result = up.cli("ctl", "usage", "export", "--format", "jsonl", "--since", "1h")
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line]


@pytest.mark.slow
def test_200_streams_give_usage_rows_whose_sums_match_the_engine_and_a_stalled_store_loses_none(
    start_up: Any, tmp_path: Path
) -> None:
    """200 streamed requests while the store refuses writes for 30 s (another
    process holds an exclusive lock): every row arrives afterwards, and the
    token sums equal the engine's own counters."""
    up = _start(start_up, tmp_path, PRICED)
    key = _key(up, "load", "Acme/ml/batch")["key"]
    prompt_before, generated_before = _engine_counts(up)
    lock_held = threading.Event()
    release = threading.Event()

    def hold_lock() -> None:
        db = sqlite3.connect(up.data_dir / "llmgw.db", timeout=30)
        try:
            db.execute("BEGIN EXCLUSIVE")
            lock_held.set()
            release.wait(60)
            db.rollback()
        finally:
            db.close()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    assert lock_held.wait(30)
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        statuses = list(
            pool.map(
                lambda i: _chat(up, key, PRICED, max_tokens=5 + i % 7, stream=True).status_code,
                range(200),
            )
        )
    assert statuses == [200] * 200
    time.sleep(max(0.0, 30 - (time.monotonic() - began)))
    release.set()
    holder.join(timeout=30)
    deadline = time.monotonic() + 60
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = [r for r in _export(up) if r["model"] == PRICED and r["stream"]]
        if len(rows) >= 200:
            break
        time.sleep(1)
    assert len(rows) == 200
    assert len({r["request_id"] for r in rows}) == 200
    prompt_after, generated_after = _engine_counts(up)
    assert sum(r["completion_tokens"] for r in rows) == generated_after - generated_before
    assert sum(r["completion_tokens"] for r in rows) == sum(5 + i % 7 for i in range(200))
    assert sum(r["prompt_tokens"] for r in rows) == prompt_after - prompt_before
    assert "usage rows not written" in up.log()


TREE = """
orgs:
  - name: Acme
    limits: {rpm: 600, budget_month: 500}
    teams:
      - name: ml
        projects:
          - name: train
            limits: {rpm: 60, models: [priced-model]}
            keys: [{name: ci-bot, band: bulk}]
"""


def test_keys_init_is_idempotent_rotate_replaces_the_secret_and_usage_exports_as_csv(
    start_up: Any, tmp_path: Path
) -> None:
    up = _start(start_up, tmp_path, PRICED, FREE)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "orgs:\n  - name: Bad\n    teams:\n      - name: t\n        projects:\n"
        "          - name: p\n            keys: [{name: k1}, {name: k2, expires: bogus}]\n"
    )
    refused = up.cli("keys", "init", str(bad))
    assert refused.returncode != 0
    assert "expires" in refused.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text("orgs:\n  - name: Bad\n    limts: {rpm: 1}\n")
    assert "limts" in up.cli("keys", "init", str(typo)).stderr
    assert "Bad" not in up.cli("keys", "list").stdout + json.dumps(
        json.loads(up.cli("ctl", "usage", "--by", "org", "--json").stdout)
    )
    tree = tmp_path / "tree.yaml"
    tree.write_text(TREE)
    first = up.cli("keys", "init", str(tree), "--json")
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert doc["created"] == ["org Acme", "team Acme/ml", "project Acme/ml/train"]
    [made] = doc["keys"]
    again = json.loads(up.cli("keys", "init", str(tree), "--json").stdout)
    assert again == {"created": [], "keys": []}
    secret = made["key"]
    assert _chat(up, secret, PRICED).status_code == 200
    # The project's allowlist names only the priced model.
    refused = _chat(up, secret, FREE)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "model_not_allowed"
    listed = json.loads(up.cli("keys", "list", "--json").stdout)["data"]
    [bot] = [k for k in listed if k["name"] == "ci-bot"]
    assert bot["project"] == "Acme/ml/train"
    assert bot["band"] == "bulk"
    rotated = up.cli("keys", "rotate", bot["id"])
    assert rotated.returncode == 0, rotated.stderr
    new_secret = rotated.stdout.strip()
    assert _chat(up, secret, PRICED).status_code == 401
    assert _chat(up, new_secret, PRICED).status_code == 200
    time.sleep(1.5)
    exported = up.cli("ctl", "usage", "export", "--format", "csv", "--since", "1h")
    assert exported.returncode == 0, exported.stderr
    lines = exported.stdout.splitlines()
    assert lines[0].startswith("request_id,")
    assert len(lines) - 1 == len(_export(up))
    assert any(bot["id"] in line for line in lines[1:])


def test_a_personal_key_belongs_to_a_person_not_a_project_and_keeps_its_own_limits(
    start_up: Any, tmp_path: Path
) -> None:
    up = _start(start_up, tmp_path, PRICED)
    made = up.cli("keys", "create", "laptop", "--person", "ada@example.com", "--json")
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)
    assert doc["person"] == "ada@example.com"
    assert doc["project"] is None
    both = up.cli("keys", "create", "x", "--person", "ada@example.com", "--project", "A/b/c")
    assert both.returncode != 0
    assert "not both" in both.stderr
    assert (
        up.cli("keys", "limits", "--scope", "key", "--id", doc["id"], "--rpm", "2").returncode == 0
    )
    statuses = [_chat(up, doc["key"], PRICED, max_tokens=1).status_code for _ in range(3)]
    assert statuses == [200, 200, 429]

"""``llmgw up --engine sim``: the whole path, a real process, the official client."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

MODEL = "sim-model"


def _replica(up: Any) -> dict[str, Any]:
    replicas = up.status()["replicas"]
    assert len(replicas) == 1, replicas
    replica: dict[str, Any] = replicas[0]
    return replica


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _port_free(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError:
            return False
    return True


def test_the_openai_client_gets_a_streamed_answer_with_usage_and_a_usage_row_is_written(
    start_up: Any,
) -> None:
    """Through the official client: streamed chat with include_usage, a
    non-streamed completion, /v1/models; then the rows in `ctl usage`."""
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    client = up.openai_client()
    try:
        assert [m.id for m in client.models.list()] == [MODEL]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "say something short"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert text
        assert usage is not None
        assert usage.completion_tokens == 8
        assert usage.prompt_tokens > 0
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens is not None

        # Without include_usage the client gets no usage chunk, but the row
        # still counts the tokens (the gateway asks the engine for them).
        quiet = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
            )
        )
        assert all(c.usage is None for c in quiet)
        completion = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=3)
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 3
    finally:
        client.close()

    def rows() -> list[dict[str, Any]]:
        result = up.cli("ctl", "usage", "--last", "10", "--json")
        assert result.returncode == 0, result.stderr
        data: list[dict[str, Any]] = json.loads(result.stdout)["data"]
        return data

    up.wait_for(lambda: len(rows()) >= 3, 10, "three usage rows")
    newest = rows()
    by_endpoint = {(r["endpoint"], r["stream"], r["completion_tokens"]): r for r in newest}
    streamed = by_endpoint[("chat", True, 8)]
    assert streamed["status"] == 200
    assert streamed["prompt_tokens"] == usage.prompt_tokens
    assert streamed["model"] == MODEL
    assert streamed["ttft_ms"] is not None
    assert streamed["duration_ms"] >= streamed["ttft_ms"]
    assert by_endpoint[("chat", True, 5)]["prompt_tokens"] > 0
    assert by_endpoint[("completions", False, 3)]["status"] == 200
    human = up.cli("ctl", "usage", "--last", "3")
    assert human.returncode == 0
    assert MODEL in human.stdout


def test_bad_requests_get_openai_error_shapes_and_statuses(start_up: Any) -> None:
    """401 missing/wrong key, 400 malformed body naming the problem, 404
    unknown model, 413 too large; each in OpenAI's error shape."""
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    url = f"{up.base_url}/v1/chat/completions"
    good = {"authorization": f"Bearer {up.client_key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30) as http:
        cases = [
            (http.post(url, json=body), 401),
            (http.post(url, json=body, headers={"authorization": "Bearer sk-llmgw-wrong"}), 401),
            (http.post(url, content=b"{not json", headers=good), 400),
            (http.post(url, json={"model": MODEL}, headers=good), 400),
            (http.post(url, json={**body, "model": "no-such-model"}, headers=good), 404),
            (http.post(url, content=b"x" * (33 * 1024 * 1024), headers=good), 413),
        ]
        for response, status in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "code"}
            assert error["message"]
        wrong_method = http.post(f"{up.base_url}/v1/models", headers=good)
        assert wrong_method.status_code == 405
        assert wrong_method.headers["allow"] == "GET, HEAD"
        assert http.get(url, headers=good).headers["allow"] == "POST"
        assert "JSON" in cases[2][0].json()["error"]["message"]
        assert cases[3][0].json()["error"]["param"] == "messages"
        # The admin token is no client key: /v1 refuses it, in OpenAI's shape, saying so.
        admin = http.post(url, json=body, headers={"authorization": f"Bearer {up.admin_token}"})
        assert admin.status_code == 401
        assert admin.json()["error"]["code"] == "invalid_api_key"
        assert admin.json()["error"]["type"] == cases[1][0].json()["error"]["type"]
        assert "admin token" in admin.json()["error"]["message"]
    client = up.openai_client(api_key="sk-llmgw-nope")
    try:
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    finally:
        client.close()


def test_a_key_made_with_keys_create_works_and_is_stored_only_as_a_hash(start_up: Any) -> None:
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    made = up.cli("keys", "create", "ci-bot")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    assert secret.startswith("sk-llmgw-")
    client = up.openai_client(api_key=secret)
    try:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert answer.choices[0].message.content
    finally:
        client.close()
    assert secret.encode() not in (up.data_dir / "llmgw.db").read_bytes()
    listed = up.cli("keys", "list", "--json")
    assert "ci-bot" in listed.stdout
    assert secret not in listed.stdout
    keys = {k["name"]: k for k in json.loads(listed.stdout)["data"]}
    assert up.cli("keys", "revoke", keys["ci-bot"]["id"]).returncode == 0
    again = up.cli("keys", "revoke", keys["ci-bot"]["id"])
    assert again.returncode != 0
    assert "already revoked" in again.stderr
    assert keys["client"]["project"] == "default/default/default"
    assert not keys["client"]["is_admin"]
    refused = httpx.post(
        f"{up.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers={"authorization": f"Bearer {secret}"},
        timeout=10,
    )
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "This API key has been revoked."


def test_a_killed_engine_is_restarted_and_its_replica_is_ready_again(
    start_up: Any, procs: Any
) -> None:
    """SIGKILL the engine while a stream is being answered: the replica is
    reported FAILED with the engine's last lines, restarted with back-off,
    and READY again — without restarting llmgw."""
    up = start_up(
        "--engine",
        "sim",
        "--model-name",
        MODEL,
        "--engine-arg=--tokens-per-second",
        "--engine-arg=20",
    )
    up.wait_ready()
    replica = _replica(up)
    [engine_pid] = procs.on_port(replica["port"])
    outcome: dict[str, Any] = {}

    def long_stream() -> None:
        client = up.openai_client()
        try:
            for _ in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=200,
                stream=True,
            ):
                outcome["chunks"] = outcome.get("chunks", 0) + 1
        except (openai.APIError, httpx.HTTPError) as exc:
            outcome["error"] = exc
        finally:
            client.close()

    reader = threading.Thread(target=long_stream)
    reader.start()
    up.wait_for(lambda: outcome.get("chunks", 0) >= 3, 20, "the stream to be under way")
    os.kill(engine_pid, signal.SIGKILL)
    reader.join(timeout=30)
    assert not reader.is_alive()
    # The stream ends with an error event the client raises, not a cut connection.
    assert isinstance(outcome["error"], openai.APIError)
    assert not isinstance(outcome["error"], openai.APIConnectionError)
    assert "broke off" in str(outcome["error"])
    up.wait_for(lambda: "failed" in up.log().lower(), 20, "the failure to be reported")
    up.wait_for(lambda: _replica(up)["state"] == "READY", 60, "the replica to be READY again")
    [new_pid] = procs.on_port(_replica(up)["port"])
    assert new_pid != engine_pid
    assert up.process.poll() is None
    assert "killed by signal 9" in up.log()
    assert "last output:" in up.log()
    client = up.openai_client()
    try:
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert answer.choices[0].message.content
    finally:
        client.close()
    logs = up.cli("ctl", "logs", "--source", replica["replica_id"], "-n", "50")
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.strip()
    nosuch = up.cli("ctl", "logs", "--source", "nosuch")
    assert nosuch.returncode != 0
    assert "no shard 'nosuch'" in nosuch.stderr
    assert up.cli("ctl", "logs", "-n", "0").returncode != 0


def test_sigint_stops_everything_and_frees_every_port_within_ten_seconds(
    start_up: Any, procs: Any
) -> None:
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    replica = _replica(up)
    engine_pids = procs.on_port(replica["port"])
    assert engine_pids
    addresses = [up.run["api"], up.run["admin"], up.run["metrics"], up.run["agent_hub"]]
    addresses.append(f"127.0.0.1:{replica['port']}")
    began = time.monotonic()
    up.process.send_signal(signal.SIGINT)
    up.process.wait(timeout=10)
    up.wait_for(
        lambda: not any(_alive(p) for p in engine_pids) and all(_port_free(a) for a in addresses),
        max(0.5, 10 - (time.monotonic() - began)),
        "no engine process and every port free",
    )
    assert up.process.returncode == 0, up.log()
    assert not (up.data_dir / "run.json").exists()
    assert "stopped" in up.log()
    _logs_a_clean_stop(up.log())
    # No server.yaml in the data directory: the log does not claim one.
    assert "settings seeded from the defaults" in up.log()
    assert "server.yaml" not in up.log()


def _logs_a_clean_stop(log: str) -> None:
    """A stop reads as a stop: the in-process agent's link ends as one (the
    hub says so), nothing reads as a lost link or an error without text."""
    stop = log[log.index("no new requests") :]
    assert "closed: the agent is stopping" in stop, stop
    for wrong in ("lost", "cannot reach", "HandshakeError", ": \n", "ABNORMAL"):
        assert wrong not in stop, stop


def test_a_first_start_prints_the_client_key_and_where_the_admin_token_is_and_a_second_reuses_them(
    start_up: Any,
) -> None:
    first = start_up("--engine", "sim", "--model-name", MODEL)
    first.wait_ready()
    key, token = first.client_key, first.admin_token
    assert key.startswith("sk-llmgw-")
    assert token.startswith("llmgw-admin-")
    for name in ("client-key", "admin-token"):
        assert oct((first.data_dir / name).stat().st_mode & 0o777) == "0o600"
    log = first.log()
    assert f"client key for /v1 (shown once, kept in {first.data_dir / 'client-key'}" in log
    assert key in log
    assert f"admin token: made, kept in {first.data_dir / 'admin-token'}" in log
    assert token not in log
    assert f"$(cat {first.data_dir / 'client-key'})" in log  # the curl example uses the client key
    assert not (first.data_dir / "admin-key").exists()
    first.stop()
    second = start_up("--engine", "sim", "--model-name", MODEL)
    second.wait_ready()
    assert (second.client_key, second.admin_token) == (key, token)
    assert key not in second.log()
    assert token not in second.log()
    assert f"client key: in {second.data_dir / 'client-key'}" in second.log()
    assert f"admin token: in {second.data_dir / 'admin-token'}" in second.log()


def test_an_older_data_dir_s_admin_key_becomes_the_client_key_and_loses_the_admin_api(
    start_up: Any,
) -> None:
    """A data directory as an older llmgw left it: one sk-llmgw- admin key in
    admin-key, no admin token. The next start keeps that key for /v1 only."""
    first = start_up("--engine", "sim", "--model-name", MODEL)
    first.wait_ready()
    old_key = first.client_key
    first.stop()
    data = first.data_dir
    (data / "client-key").rename(data / "admin-key")
    (data / "admin-token").unlink()
    with sqlite3.connect(data / "llmgw.db") as db:
        db.execute("UPDATE keys SET is_admin = 1")
    second = start_up("--engine", "sim", "--model-name", MODEL)
    second.wait_ready()
    assert not (data / "admin-key").exists()
    assert second.client_key == old_key
    assert f"{data / 'admin-key'} held the admin key of an older llmgw" in second.log()
    assert old_key not in second.log()
    answer = second.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    )
    assert answer.status_code == 200, answer.text
    admin = f"http://{second.run['admin']}/api/v1/keys"
    refused = httpx.get(admin, headers={"authorization": f"Bearer {old_key}"}, timeout=10)
    assert refused.status_code == 401
    listed = second.cli("keys", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [key] = json.loads(listed.stdout)["data"]
    assert not key["is_admin"]


def test_the_admin_api_takes_only_the_admin_token_and_a_rotation_refuses_the_old_one_at_once(
    start_up: Any,
) -> None:
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    admin = f"http://{up.run['admin']}/api/v1/keys"
    old = up.admin_token
    with_client_key = httpx.get(
        admin, headers={"authorization": f"Bearer {up.client_key}"}, timeout=10
    )
    assert with_client_key.status_code == 401
    error = with_client_key.json()["error"]
    assert (error["code"], error["type"]) == ("invalid_api_key", "invalid_request_error")
    assert error["message"].startswith("This is a client key")
    assert httpx.get(admin, headers={"authorization": f"Bearer {old}"}, timeout=10).is_success
    rotated = up.cli("keys", "rotate-admin")
    assert rotated.returncode == 0, rotated.stderr
    new = up.admin_token
    assert new != old
    assert new not in rotated.stdout
    assert oct((up.data_dir / "admin-token").stat().st_mode & 0o777) == "0o600"
    refused = httpx.get(admin, headers={"authorization": f"Bearer {old}"}, timeout=10)
    assert refused.status_code == 401
    assert refused.json()["error"]["message"] == "Incorrect admin token provided."
    assert httpx.get(admin, headers={"authorization": f"Bearer {new}"}, timeout=10).is_success
    listed = up.cli("keys", "list")  # the CLI reads the new token
    assert listed.returncode == 0, listed.stderr
    assert "client" in listed.stdout


def _engine_key(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    [key] = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"LLAMA_API_KEY=")]
    return key.decode()


def test_the_engine_key_is_in_its_environment_and_the_client_key_never_reaches_it(
    start_up: Any, procs: Any
) -> None:
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    port = _replica(up)["port"]
    [pid] = procs.on_port(port)
    key = _engine_key(pid)
    assert len(key) == 64
    assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as engine:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        assert engine.post("/v1/chat/completions", json=body).status_code == 401
        with_client_key = engine.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {up.client_key}"}
        )
        assert with_client_key.status_code == 401
        assert (
            engine.post(
                "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
            ).status_code
            == 200
        )


def test_a_client_that_disconnects_mid_stream_cancels_the_engine_request(
    start_up: Any, procs: Any
) -> None:
    up = start_up(
        "--engine",
        "sim",
        "--model-name",
        MODEL,
        "--engine-arg=--tokens-per-second",
        "--engine-arg=20",
    )
    up.wait_ready()
    port = _replica(up)["port"]
    [pid] = procs.on_port(port)
    engine_key = {"authorization": f"Bearer {_engine_key(pid)}"}

    def running() -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=engine_key, timeout=5).text
        [line] = [x for x in text.splitlines() if x.startswith("vllm:num_requests_running")]
        return float(line.split()[-1])

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 500,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"{up.base_url}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {up.client_key}"},
        ) as response,
    ):
        assert response.status_code == 200
        chunks = response.iter_bytes()  # kept: dropping it would close the stream
        for _ in range(3):
            next(chunks)
        assert running() == 1
    up.wait_for(lambda: running() == 0, 10, "the engine to drop the request")

    def rows() -> list[dict[str, Any]]:
        result = up.cli("ctl", "usage", "--json")
        data: list[dict[str, Any]] = json.loads(result.stdout)["data"]
        return data

    up.wait_for(lambda: bool(rows()), 10, "the usage row")
    [row] = rows()
    assert row["status"] == 499
    assert 0 < row["completion_tokens"] < 500


def test_a_request_in_flight_finishes_after_sigint(start_up: Any) -> None:
    up = start_up(
        "--engine",
        "sim",
        "--model-name",
        MODEL,
        "--engine-arg=--tokens-per-second",
        "--engine-arg=20",
    )
    up.wait_ready()
    client = up.openai_client()
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=40, stream=True
        )
        chunks = iter(stream)
        next(chunks)
        # A terminal's Ctrl-C reaches llmgw twice under `uv run` (the group's
        # signal and uv's forwarded copy): still one graceful stop.
        up.process.send_signal(signal.SIGINT)
        up.process.send_signal(signal.SIGINT)
        rest = list(chunks)
    finally:
        client.close()
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in rest if c.choices and c.choices[0].delta.content) >= 38
    up.process.wait(timeout=15)
    assert up.process.returncode == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{up.base_url}/health", timeout=2)


def test_a_request_for_a_loading_model_waits_for_it_and_is_answered(start_up: Any) -> None:
    # docs/api.md: a request for a model that is loading waits
    # rather than failing.
    up = start_up("--engine", "sim", "--model-name", MODEL, "--engine-arg=--loading-seconds=4")
    up.wait_run(60)
    time.sleep(0.5)
    assert httpx.get(f"{up.base_url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{up.base_url}/ready", timeout=5).status_code == 503
    response = httpx.post(
        f"{up.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3},
        headers={"authorization": f"Bearer {up.client_key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{up.base_url}/ready", timeout=5).status_code == 200


def test_prometheus_metrics_count_requests_tokens_and_latency_on_their_own_listener(
    start_up: Any,
) -> None:
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    client = up.openai_client()
    try:
        list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True
            )
        )
    finally:
        client.close()
    text = httpx.get(f"http://{up.run['metrics']}/metrics", timeout=5).text
    assert f'llmgw_requests_total{{model="{MODEL}",status="200"}} 1.0' in text
    assert f'llmgw_tokens_total{{direction="completion",model="{MODEL}"}} 4.0' in text
    assert f'llmgw_ttft_seconds_count{{model="{MODEL}"}} 1.0' in text
    assert f'llmgw_request_duration_seconds_count{{model="{MODEL}"}} 1.0' in text
    assert httpx.get(f"{up.base_url}/metrics", timeout=5).status_code == 404
    agent_log = up.cli("ctl", "logs")
    assert agent_log.returncode == 0, agent_log.stderr
    assert "registered" in agent_log.stdout


def test_a_second_up_on_the_same_data_dir_or_ports_fails_clearly_and_changes_nothing(
    start_up: Any, up_argv: Any
) -> None:
    first = start_up("--engine", "sim", "--model-name", MODEL)
    first.wait_ready()
    same_dir = subprocess.run(
        up_argv(first.data_dir, "--engine", "sim", "--model-name", "intruder"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert same_dir.returncode != 0
    assert "another llmgw up is using" in same_dir.stderr
    other_dir = first.data_dir.parent / "other"
    # The client port is taken; later flags win, so --listen overrides up_argv's.
    same_ports = subprocess.run(
        up_argv(other_dir, "--engine", "sim", "--listen", first.run["api"]),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert same_ports.returncode == 1
    # One line naming the address, what listens there and the option.
    errors = [line for line in same_ports.stderr.splitlines() if not line.startswith("llmgw: ")]
    assert errors == [
        f"Error: cannot listen on {first.run['api']} (client API): address already in use; "
        "is another llmgw running? Use --listen HOST:PORT"
    ], same_ports.stderr
    # Refused before the store is opened: nothing was started.
    assert not (other_dir / "llmgw.db").exists()
    assert not (other_dir / "admin-token").exists()
    assert not (other_dir / "client-key").exists()
    status = first.status()
    assert status["models"] == [MODEL]
    assert [r["replica_id"] for r in status["replicas"]] == [f"{MODEL}-0"]


def test_up_serves_the_model_it_was_asked_for_and_keeps_those_added_with_ctl(
    start_up: Any,
) -> None:
    first = start_up("--engine", "sim", "--model-name", "first-model")
    first.wait_ready()
    added = first.cli(
        "ctl", "model", "add", "added-model", "--engine", "sim", "--min-memory-gb", "0.1"
    )
    assert added.returncode == 0, added.stderr
    first.stop()
    second = start_up("--engine", "sim", "--model-name", "second-model")
    second.wait_ready()
    assert sorted(second.status()["models"]) == ["added-model", "second-model"]
    assert "first-model from an earlier start removed" in second.log()
    assert "added-model from an earlier start" not in second.log()


def test_an_engine_port_held_by_another_process_is_never_used(start_up: Any) -> None:
    """Something else listens on the first engine port: llmgw must not probe
    it, route to it or send it the engine key; the replica moves."""
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    up = start_up("--engine", "sim", "--model-name", MODEL)
    try:
        squatter.bind(("127.0.0.1", up.engine_ports[0]))
        squatter.listen(16)
        up.wait_ready()
        replica = _replica(up)
        assert replica["port"] != up.engine_ports[0]
        assert "is taken by another process" in up.log()
        client = up.openai_client()
        try:
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            assert answer.choices[0].message.content
        finally:
            client.close()
        squatter.setblocking(False)
        with pytest.raises(BlockingIOError):
            squatter.accept()  # nobody ever connected to it
    finally:
        squatter.close()


def _a_long_stream_begun(start_up: Any) -> tuple[Any, openai.OpenAI, Iterator[Any]]:
    """``llmgw up`` on a sim answering 20 tokens/s, and a 1,000-token stream
    through it whose first chunk has arrived (about 50 s still to go). The
    caller closes the client."""
    up = start_up(
        "--engine",
        "sim",
        "--model-name",
        MODEL,
        "--engine-arg=--tokens-per-second",
        "--engine-arg=20",
        "--engine-arg=--tokens",
        "--engine-arg=1000",
    )
    up.wait_ready()
    client = up.openai_client()
    try:
        chunks = iter(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=1000,
                stream=True,
            )
        )
        next(chunks)
    except BaseException:
        client.close()
        raise
    return up, client, chunks


def test_a_stream_longer_than_the_stop_grace_ends_with_an_error_event_not_a_torn_stream(
    start_up: Any,
) -> None:
    up, client, chunks = _a_long_stream_begun(start_up)
    try:
        up.process.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError) as caught:
            for _ in chunks:
                pass
    finally:
        client.close()
    assert not isinstance(caught.value, openai.APIConnectionError)
    assert "stopping" in str(caught.value)
    up.process.wait(timeout=30)
    assert up.process.returncode == 0
    # Cut at the end of the grace, the stop still reads as a stop.
    _logs_a_clean_stop(up.log())
    # The cut answer is still recorded and charged for what was generated.
    with sqlite3.connect(up.data_dir / "llmgw.db") as db:
        rows = db.execute("SELECT status, completion_tokens FROM usage").fetchall()
    assert len(rows) == 1
    status, completion_tokens = rows[0]
    assert status == 503
    assert completion_tokens > 0


def test_n_is_carried_to_an_engine_that_answers_n_choices_and_bad_n_is_refused(
    start_up: Any,
) -> None:
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    headers = {"authorization": f"Bearer {up.client_key}"}
    response = httpx.post(
        f"{up.base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "n": 2,
            "max_tokens": 3,
        },
        headers=headers,
        timeout=10,
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 6
    response = httpx.post(
        f"{up.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0},
        headers=headers,
        timeout=10,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"


def test_a_second_signal_stops_at_once_and_leaves_no_run_file(start_up: Any) -> None:
    up, client, _ = _a_long_stream_begun(start_up)
    try:
        up.process.send_signal(signal.SIGINT)
        # A second signal later than the same Ctrl-C's echo: stop now, not
        # after the grace (10 s) nor the 50 s stream.
        time.sleep(2.5)
        up.process.send_signal(signal.SIGINT)
        up.process.wait(timeout=8)
    finally:
        client.close()
    assert not (up.data_dir / "run.json").exists()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{up.base_url}/health", timeout=2)

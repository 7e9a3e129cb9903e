"""Routing through ``llmgw up --engine sim``: the ``chat`` profile between a
fast and a slow replica, session affinity, a replica killed under load, an
outside provider with a key at its limit, and fallbacks
(``docs/api.md``, routing and outside providers).

One ``llmgw up`` serves the module; each test adds its own models through
the admin API (``POST /api/v1/models``) so no test sees another's routing
state. Its settings lift the default 60 requests a minute.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.engines.testing import engine_process_env, sim_argv

TIMEOUT_S = 30.0
FAST_TTFT_MS, SLOW_TTFT_MS = "20", "200"


@pytest.fixture(scope="module")
def up(start_module_up: Callable[..., Any]) -> Any:
    return start_module_up("--engine", "sim", "--model-name", "sim-model")


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(
        timeout=TIMEOUT_S, limits=httpx.Limits(max_connections=100, max_keepalive_connections=100)
    ) as client:
        yield client


def _add_model(
    up: Any, admin_request: Callable[..., httpx.Response], doc: dict[str, Any], *, ready: int
) -> None:
    """Add a catalog entry; wait until ``ready`` replicas of it are Ready."""
    added = admin_request(up, "POST", "/api/v1/models", doc)
    assert added.status_code == 201, added.text

    def enough() -> bool:
        counts = admin_request(up, "GET", f"/api/v1/models/{doc['name']}").json()["replicas"]
        return bool(counts["ready"] >= ready)

    up.wait_for(enough, 60, f"{ready} ready replicas of {doc['name']}")


def _sim_profile(name: str, *args: str, replicas: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "sim",
        "replicas": replicas,
        "min_memory_gb": 0.1,
        "args": list(args),
    }


def _fast_and_slow(up: Any, admin_request: Callable[..., httpx.Response], name: str) -> None:
    """A model with one fast and one slow replica: ``<name>-0`` (fast) and ``<name>-1``."""
    _add_model(
        up,
        admin_request,
        {
            "name": name,
            "profiles": [
                _sim_profile("fast", "--ttft-ms", FAST_TTFT_MS),
                _sim_profile("slow", "--ttft-ms", SLOW_TTFT_MS),
            ],
        },
        ready=2,
    )
    replicas = admin_request(up, "GET", "/api/v1/replicas").json()["data"]
    profiles = {r["replica_id"]: r["profile"] for r in replicas if r["model"] == name}
    assert profiles == {f"{name}-0": "fast", f"{name}-1": "slow"}


def _post(
    up: Any,
    http: httpx.Client,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    response: httpx.Response = up.post(path, body, headers, http=http)
    return response


# --- the chat profile: latency and sessions --------------------------------------------


def _spread(results: list[httpx.Response]) -> collections.Counter[str]:
    assert [r.status_code for r in results] == [200] * len(results), [
        r.text for r in results if r.status_code != 200
    ]
    return collections.Counter(r.headers["x-llmgw-replica"] for r in results)


def test_the_chat_profile_sends_most_requests_without_a_session_to_the_faster_replica(
    up: Any, admin_request: Callable[..., httpx.Response], http: httpx.Client
) -> None:
    """Streamed completions carry no session: the soonest-answering replica
    (smoothed TTFT) takes the bulk, the slow one a little (while it is
    measured). Two at a time, 60 requests."""
    _fast_and_slow(up, admin_request, "lat")

    def one(i: int) -> httpx.Response:
        body = {"model": "lat", "prompt": f"question {i}", "max_tokens": 2, "stream": True}
        return _post(up, http, "/v1/completions", body)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        spread = _spread(list(pool.map(one, range(60))))
    assert spread["lat-0"] >= 48, spread
    assert spread["lat-1"] >= 1, spread


def test_chat_requests_without_a_session_id_mostly_go_to_the_faster_replica(
    up: Any, admin_request: Callable[..., httpx.Response], http: httpx.Client
) -> None:
    _fast_and_slow(up, admin_request, "latchat")

    def one(i: int) -> httpx.Response:
        body = {
            "model": "latchat",
            "messages": [{"role": "user", "content": f"question number {i}"}],
            "max_tokens": 2,
            "stream": True,
        }
        return _post(up, http, "/v1/chat/completions", body)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        spread = _spread(list(pool.map(one, range(60))))
    assert spread["latchat-0"] >= 48, spread


def test_non_streamed_requests_without_a_session_mostly_go_to_the_faster_replica(
    up: Any, admin_request: Callable[..., httpx.Response], http: httpx.Client
) -> None:
    _fast_and_slow(up, admin_request, "latwhole")
    spread = _spread(
        [
            _post(
                up, http, "/v1/completions", {"model": "latwhole", "prompt": "q", "max_tokens": 2}
            )
            for _ in range(60)
        ]
    )
    assert spread["latwhole-0"] >= 48, spread


def test_requests_of_one_session_all_land_on_one_replica(
    up: Any, admin_request: Callable[..., httpx.Response], http: httpx.Client
) -> None:
    _add_model(
        up,
        admin_request,
        {"name": "sess", "profiles": [_sim_profile("default", replicas=2)]},
        ready=2,
    )

    def chat(i: int, *, user: str | None = None, session: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {
            "model": "sess",
            "messages": [{"role": "user", "content": f"a different question {i}"}],
            "max_tokens": 2,
        }
        if user is not None:
            body["user"] = user
        headers = {"x-llmgw-session": session} if session is not None else None
        return _post(up, http, "/v1/chat/completions", body, headers)

    by_header = _spread([chat(i, session="conversation-1") for i in range(20)])
    assert len(by_header) == 1, by_header
    by_user = _spread([chat(i, user="alice@example.com") for i in range(20)])
    assert len(by_user) == 1, by_user
    # Streamed too, and two at a time (below the replica's 4 slots).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = _spread(
            list(
                pool.map(
                    lambda i: _post(
                        up,
                        http,
                        "/v1/chat/completions",
                        {
                            "model": "sess",
                            "messages": [{"role": "user", "content": f"q {i}"}],
                            "max_tokens": 2,
                            "stream": True,
                        },
                        {"x-llmgw-session": "conversation-1"},
                    ),
                    range(10),
                )
            )
        )
    assert set(streamed) == set(by_header), (streamed, by_header)
    # Different sessions spread over both replicas.
    many = _spread([chat(0, session=f"session-{i}") for i in range(24)])
    assert set(many) == {"sess-0", "sess-1"}, many


# --- a replica killed under load -------------------------------------------------------


@pytest.mark.slow
def test_killing_a_replica_mid_load_loses_no_request_that_had_not_started(
    up: Any, admin_request: Callable[..., httpx.Response], http: httpx.Client, procs: Any
) -> None:
    """40 concurrent non-streamed requests (no byte reaches a client before
    its answer is whole); one replica is SIGKILLed while they run. Every
    request ends 200, the killed replica's ones retried on the other."""
    _add_model(
        up,
        admin_request,
        {
            "name": "pair",
            "profiles": [
                _sim_profile("default", "--ttft-ms", "400", "--tokens-per-second", "0", replicas=2)
            ],
        },
        ready=2,
    )
    replicas = admin_request(up, "GET", "/api/v1/replicas").json()["data"]
    ports = {r["replica_id"]: r["port"] for r in replicas if r["model"] == "pair"}
    victims = procs.on_port(ports["pair-0"])
    assert victims, f"no engine process with --port {ports['pair-0']}"
    victim = victims[0]

    def one(i: int) -> httpx.Response:
        body = {
            "model": "pair",
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 4,
        }
        return _post(up, http, "/v1/chat/completions", body, {"x-llmgw-profile": "batch"})

    log_before = len(up.log())
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(one, i) for i in range(40)]
        time.sleep(0.6)  # the first eight are in flight, four on each replica
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    statuses = collections.Counter(r.status_code for r in results)
    failed = [(r.status_code, r.text) for r in results if r.status_code != 200]
    assert statuses == {200: 40}, failed
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in results)
    # The kill did hit requests in flight there: the gateway tried another.
    assert "pair-0 did not answer" in up.log()[log_before:], up.log()[log_before:]
    # The killed replica is started again.
    up.wait_for(
        lambda: admin_request(up, "GET", "/api/v1/models/pair").json()["replicas"]["ready"] == 2,
        60,
        "pair back to two ready replicas",
    )


# --- an outside provider with a key at its limit ---------------------------------------


#: A key the provider refuses with 401; it must never show in llmgw's log.
REFUSED_KEY = "sk-refused-4f1c9e0b7d2a"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """A keyless sim engine standing in for an outside provider, answering
    429 to the key ``BAD`` and 401 to :data:`REFUSED_KEY`; and two key
    files, ``BAD`` and ``GOOD`` (a third, ``refused-key``, beside them)."""
    process = subprocess.Popen(
        sim_argv(
            "provider-model",
            "--refuse-key",
            "BAD=429",
            "--refuse-key",
            f"{REFUSED_KEY}=401",
            "--tokens-per-second",
            "0",
        ),
        stdout=subprocess.PIPE,
        env=engine_process_env(""),
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # bounded: the sim prints it at once or exits
        assert "listening on" in line, line
        port = int(line.rsplit(" model ", 1)[0].rsplit(":", 1)[1])
        bad, good = tmp_path / "bad-key", tmp_path / "good-key"
        bad.write_text("BAD\n")
        good.write_text("GOOD\n")
        (tmp_path / "refused-key").write_text(REFUSED_KEY + "\n")
        yield port, bad, good
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_an_outside_key_at_its_limit_is_skipped_for_the_good_one(
    up: Any,
    admin_request: Callable[..., httpx.Response],
    http: httpx.Client,
    provider: tuple[int, Path, Path],
) -> None:
    port, bad, good = provider
    added = admin_request(
        up,
        "POST",
        "/api/v1/models",
        {
            "name": "ext",
            "source": "external",
            "external": {
                "url": f"http://127.0.0.1:{port}",
                "model": "provider-model",
                "api_key_files": [{"file": str(bad)}, {"file": str(good)}],
            },
        },
    )
    assert added.status_code == 201, added.text
    view = admin_request(up, "GET", "/api/v1/models/ext").json()
    assert view["engine"] == "external"

    def chat(i: int, stream: bool = False) -> httpx.Response:
        body = {
            "model": "ext",
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 3,
            "stream": stream,
        }
        return _post(up, http, "/v1/chat/completions", body)

    log_before = len(up.log())
    results = [chat(i) for i in range(25)] + [chat(i, stream=True) for i in range(5)]
    assert [r.status_code for r in results] == [200] * 30, [r.text for r in results]
    assert {r.headers["x-llmgw-replica"] for r in results} == {"external:ext#2"}
    assert results[0].json()["model"] == "provider-model"
    assert all("data: [DONE]" in r.text for r in results[25:])
    row = up.usage_row(results[0].headers["x-request-id"])
    assert (row["model"], row["status"], row["replica_id"]) == ("ext", 200, "external:ext#2")
    # The bad key was tried (a 50/50 draw until its breaker opened) and skipped.
    assert "external:ext#1 answered 429" in up.log()[log_before:]


def test_an_outside_key_refused_401_is_skipped_and_named_only_by_its_endpoint(
    up: Any,
    admin_request: Callable[..., httpx.Response],
    http: httpx.Client,
    provider: tuple[int, Path, Path],
) -> None:
    port, _, good = provider
    refused = good.parent / "refused-key"
    for name, files in (("ext401", [refused, good]), ("extonly", [refused])):
        added = admin_request(
            up,
            "POST",
            "/api/v1/models",
            {
                "name": name,
                "external": {
                    "url": f"http://127.0.0.1:{port}",
                    "model": "provider-model",
                    "api_key_files": [{"file": str(f)} for f in files],
                },
            },
        )
        assert added.status_code == 201, added.text
    log_before = len(up.log())
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    results = [
        _post(up, http, "/v1/chat/completions", {**body, "model": "ext401"}) for _ in range(20)
    ]
    assert [r.status_code for r in results] == [200] * 20, [r.text for r in results]
    assert {r.headers["x-llmgw-replica"] for r in results} == {"external:ext401#2"}
    # With its only key refused, the 401 goes back to the client.
    only = _post(up, http, "/v1/chat/completions", {**body, "model": "extonly"})
    assert only.status_code == 401, only.text
    # Said so the caller does not take it for their own key being wrong.
    assert only.json()["error"]["code"] == "external_key_refused"
    assert "your own key is fine" in only.json()["error"]["message"]
    log = up.log()[log_before:]
    assert "external_key_refused: external:ext401#1" in log, log
    assert "external_key_refused: external:extonly#1" in log, log
    assert REFUSED_KEY not in log


# --- fallbacks ---------------------------------------------------------------------------


def test_a_model_without_a_replica_is_answered_by_its_fallback(
    up: Any, admin_request: Callable[..., httpx.Response], http: httpx.Client
) -> None:
    _add_model(
        up,
        admin_request,
        {"name": "primary", "fallbacks": ["sim-model"], "profiles": [_sim_profile("default")]},
        ready=1,
    )
    body = {"model": "primary", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    served_by_itself = _post(up, http, "/v1/chat/completions", body)
    assert served_by_itself.status_code == 200, served_by_itself.text
    assert served_by_itself.headers["x-llmgw-replica"] == "primary-0"

    # Its only replica goes away: the fallback answers.
    scaled = admin_request(up, "POST", "/api/v1/models/primary/scale", {"replicas": 0})
    assert scaled.status_code == 200, scaled.text
    up.wait_for(
        lambda: (
            not [
                r
                for r in admin_request(up, "GET", "/api/v1/replicas").json()["data"]
                if r["model"] == "primary" and r["state"] == "READY"
            ]
        ),
        30,
        "primary's replica gone",
    )
    fallen_back = _post(up, http, "/v1/chat/completions", body)
    assert fallen_back.status_code == 200, fallen_back.text
    assert fallen_back.headers["x-llmgw-replica"] == "sim-model-0"
    row = up.usage_row(fallen_back.headers["x-request-id"])
    assert (row["model"], row["served_model"], row["status"]) == ("primary", "sim-model", 200)
    assert row["completion_tokens"] == 2

    # A model that can be placed nowhere (no node carries its label) falls back at once.
    nowhere = {**_sim_profile("default"), "selector": {"llmgw.role": "nowhere"}}
    added = admin_request(
        up,
        "POST",
        "/api/v1/models",
        {"name": "unplaced", "fallbacks": ["sim-model"], "profiles": [nowhere]},
    )
    assert added.status_code == 201, added.text
    streamed = _post(
        up,
        http,
        "/v1/chat/completions",
        {**body, "model": "unplaced", "stream": True, "stream_options": {"include_usage": True}},
    )
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["x-llmgw-replica"] == "sim-model-0"
    row = up.usage_row(streamed.headers["x-request-id"])
    assert (row["model"], row["served_model"]) == ("unplaced", "sim-model")

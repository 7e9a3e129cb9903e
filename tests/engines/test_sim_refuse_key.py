"""The sim engine's ``--refuse-key KEY=STATUS``: one key gets a fixed error
while every other is served, so a sim can stand in for an outside provider
whose key is at its limit (429) or refused (401)."""

from __future__ import annotations

import httpx
import pytest
import trio

from llmgw.engines.sim.config import SimConfig, parse_args
from llmgw.engines.testing import SimStarter

CHAT = "/v1/chat/completions"
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_refuse_key_is_repeatable_and_parsed_into_key_status_pairs() -> None:
    config = parse_args(
        ["--port", "0", "--model", "m", "--refuse-key", "BAD=429", "--refuse-key", "a=b=401"]
    )
    assert config.refuse_keys == (("BAD", 429), ("a=b", 401))
    assert parse_args(["--port", "0", "--model", "m"]).refuse_keys == ()


@pytest.mark.parametrize("given", ["BAD", "=429", "BAD=", "BAD=x", "BAD=200", "BAD=600"])
def test_a_malformed_refuse_key_or_a_status_outside_400_599_exits_2(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--port", "0", "--model", "m", "--refuse-key", given])
    assert exit_info.value.code == 2
    assert "refuse" in capsys.readouterr().err


def test_sim_config_checks_its_refusals() -> None:
    with pytest.raises(ValueError, match="400 to 599"):
        SimConfig(model="m", refuse_keys=(("k", 302),))
    with pytest.raises(ValueError, match="empty"):
        SimConfig(model="m", refuse_keys=(("", 429),))


async def test_a_keyless_sim_refuses_only_the_named_keys_and_serves_every_other(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim(
                "--tokens-per-second", "0", "--refuse-key", "BAD=429", "--refuse-key", "NO=401"
            ) as sim,
            httpx.AsyncClient(base_url=sim.base_url, timeout=10) as client,
        ):
            limited = await client.post(CHAT, json=BODY, headers=_bearer("BAD"))
            assert limited.status_code == 429
            error = limited.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "--refuse-key" in error["message"]
            refused = await client.post(CHAT, json=BODY, headers=_bearer("NO"))
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
            # Every route but /health; a key that only starts like a refused one is served.
            assert (await client.get("/v1/models", headers=_bearer("BAD"))).status_code == 429
            assert (await client.get("/health", headers=_bearer("BAD"))).status_code == 200
            for key in ("GOOD", "BADX", "bad"):
                served = await client.post(CHAT, json=BODY, headers=_bearer(key))
                assert served.status_code == 200, (key, served.text)
                assert served.json()["usage"]["completion_tokens"] == 2
            assert (await client.post(CHAT, json=BODY)).status_code == 200  # keyless: no key


async def test_a_keyed_sim_refuses_the_named_key_and_still_checks_its_own(
    start_sim: SimStarter,
) -> None:
    with trio.fail_after(30):
        async with (
            start_sim(
                "--tokens-per-second", "0", "--refuse-key", "BAD=503", api_key="engine"
            ) as sim,
            httpx.AsyncClient(base_url=sim.base_url, timeout=10) as client,
        ):
            failing = await client.post(CHAT, json=BODY, headers=_bearer("BAD"))
            assert failing.status_code == 503
            assert failing.json()["error"]["type"] == "server_error"
            assert (await client.post(CHAT, json=BODY, headers=_bearer("other"))).status_code == 401
            assert (
                await client.post(CHAT, json=BODY, headers=_bearer("engine"))
            ).status_code == 200

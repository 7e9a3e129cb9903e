"""`llmgw bench gateway` as the README's command table shows it: in front of
a sim engine that needs no key, started without ``--engine-key``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import trio

from llmgw.engines.testing import engine_process_env, open_sim, read_line, stop_process

#: Seconds the bench gateway gets to print its first line.
START_TIMEOUT_S = 30.0


async def test_bench_gateway_without_an_engine_key_answers_through_a_keyless_engine(
    tmp_path: Path,
) -> None:
    async with open_sim("--tokens", "4", "--tokens-per-second", "0") as sim:
        argv = [
            *(sys.executable, "-m", "llmgw.cli", "bench", "gateway"),
            *("--engine-url", sim.base_url, "--model", "sim-model"),
            *("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)),
        ]
        gateway = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, env=engine_process_env("")
        )
        try:
            assert gateway.stdout is not None
            with trio.fail_after(START_TIMEOUT_S):
                info = orjson.loads(await read_line(gateway.stdout, bytearray()))
            async with httpx.AsyncClient(timeout=10.0) as client:
                for stream in (False, True):
                    got = await client.post(
                        f"http://{info['listen']}/v1/chat/completions",
                        headers={"authorization": f"Bearer {info['key']}"},
                        json={
                            "model": "sim-model",
                            "messages": [{"role": "user", "content": "hello"}],
                            "stream": stream,
                        },
                    )
                    assert got.status_code == 200, got.text
                    assert b"error" not in got.content
        finally:
            await stop_process(gateway)


async def test_bench_gateway_portal_mode_serves_v1_and_the_pages_behind_the_dispatch(
    tmp_path: Path,
) -> None:
    """``--mode portal``: ``/v1`` answers through the gateway and the
    portal's sign-in page answers too, so the dispatch really is in front."""
    async with open_sim("--tokens", "4", "--tokens-per-second", "0") as sim:
        argv = [
            *(sys.executable, "-m", "llmgw.cli", "bench", "gateway", "--mode", "portal"),
            *("--engine-url", sim.base_url, "--model", "sim-model"),
            *("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)),
        ]
        gateway = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, env=engine_process_env("")
        )
        try:
            assert gateway.stdout is not None
            with trio.fail_after(START_TIMEOUT_S):
                info = orjson.loads(await read_line(gateway.stdout, bytearray()))
            async with httpx.AsyncClient(timeout=10.0) as client:
                got = await client.post(
                    f"http://{info['listen']}/v1/chat/completions",
                    headers={"authorization": f"Bearer {info['key']}"},
                    json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
                )
                assert got.status_code == 200, got.text
                page = await client.get(f"http://{info['listen']}/portal/sign-in")
                assert page.status_code == 200, page.text
                assert 'name="password"' in page.text
        finally:
            await stop_process(gateway)

"""The llama.cpp adapter's command lines, and the bundled xllamacpp launcher."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import trio

from llmgw.engines.base import ShardLaunch, body_says_ready
from llmgw.engines.llamacpp import LlamaCppAdapter, common_params, parse_args
from llmgw.engines.sim.adapter import SimAdapter
from llmgw.engines.sim.config import parse_args as parse_sim_args
from llmgw.engines.testing import engine_process_env, read_line, stop_process

KEY = "llama-test-key"


def _shard(**changes: Any) -> ShardLaunch:
    fields: dict[str, Any] = {
        "replica_id": "r1",
        "http_port": 18080,
        "bind_addr": "127.0.0.1",
        "model_path": "/models/m.gguf",
        "served_model_name": "m",
        "api_key": KEY,
        "context_tokens": 8192,
        "slots": 4,
    }
    fields.update(changes)
    return ShardLaunch(**fields)


def test_a_configured_llama_server_gets_the_flags_and_the_key_only_in_its_environment() -> None:
    adapter = LlamaCppAdapter("/opt/llama/llama-server")
    [command] = adapter.commands(_shard(cpu_cores=6, args=("--chat-template", "chatml")))
    assert command.argv == [
        "/opt/llama/llama-server",
        "-m",
        "/models/m.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "18080",
        "--ctx-size",
        "8192",
        "--parallel",
        "4",
        "--metrics",
        "--alias",
        "m",
        "--threads",
        "6",
        "--chat-template",
        "chatml",
    ]
    assert command.env["LLAMA_API_KEY"] == KEY
    assert all(KEY not in arg for arg in command.argv)
    assert (adapter.name, adapter.health_path(), adapter.metrics_path()) == (
        "llamacpp",
        "/health",
        "/metrics",
    )


def test_without_a_binary_the_bundled_launcher_runs_with_the_same_flags() -> None:
    [command] = LlamaCppAdapter().commands(_shard())
    assert command.path == sys.executable
    assert command.args[:2] == ("-m", "llmgw.engines.llamacpp")
    assert "--threads" not in command.args  # cpu_cores 0: llama.cpp decides
    assert command.args[2:] == (
        "-m",
        "/models/m.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "18080",
        "--ctx-size",
        "8192",
        "--parallel",
        "4",
        "--metrics",
        "--alias",
        "m",
    )
    assert all(KEY not in arg for arg in command.argv)


def test_cuda_visible_devices_follows_the_gpu_indices_and_is_empty_without_cards() -> None:
    for adapter in (LlamaCppAdapter(), SimAdapter()):
        [on_cards] = adapter.commands(_shard(gpu_indices=(0, 2)))
        [on_cpu] = adapter.commands(_shard())
        assert on_cards.env["CUDA_VISIBLE_DEVICES"] == "0,2"
        assert on_cpu.env["CUDA_VISIBLE_DEVICES"] == ""


def test_a_keyless_shard_gets_no_key_variable_and_vetted_env_cannot_override_the_key() -> None:
    [keyless] = LlamaCppAdapter().commands(_shard(api_key="", env={"OMP_NUM_THREADS": "2"}))
    assert "LLAMA_API_KEY" not in keyless.env
    assert keyless.env["OMP_NUM_THREADS"] == "2"
    [keyed] = LlamaCppAdapter().commands(_shard(env={"LLAMA_API_KEY": "other"}))
    assert keyed.env["LLAMA_API_KEY"] == KEY


def test_the_sim_adapter_runs_the_sim_module_with_the_key_in_the_environment() -> None:
    [command] = SimAdapter().commands(_shard(args=("--tokens", "8")))
    assert command.argv == [
        sys.executable,
        "-m",
        "llmgw.engines.sim",
        "--host",
        "127.0.0.1",
        "--port",
        "18080",
        "--model",
        "m",
        "--slots",
        "4",
        "--tokens",
        "8",
    ]
    assert command.env["LLAMA_API_KEY"] == KEY


def test_the_sim_runs_as_many_at_once_as_the_profile_has_slots_unless_its_args_say() -> None:
    # argparse takes the last --slots: the profile's comes before the args.
    [command] = SimAdapter().commands(_shard(slots=2, args=("--slots", "0")))
    assert command.argv[-4:] == ["--slots", "2", "--slots", "0"]
    assert parse_sim_args(command.argv[3:]).slots == 0


def test_the_launcher_turns_llama_server_flags_into_xllamacpp_common_params() -> None:
    ns = parse_args(
        [
            "-m",
            "/models/m.gguf",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "-c",
            "2048",
            "--parallel",
            "3",
            "--threads",
            "2",
            "--metrics",
            "--chat-template",
            "chatml",
            "--cache-ram",
            "0",
        ]
    )
    params = common_params(ns, KEY)
    assert params.model.path == "/models/m.gguf"
    assert params.hostnames == ["0.0.0.0"]
    assert (params.port, params.n_ctx, params.n_parallel) == (9000, 2048, 3)
    assert params.api_keys == [KEY]
    assert params.endpoint_metrics is True
    assert params.cpuparams.n_threads == 2
    assert params.cpuparams_batch.n_threads == 2
    assert params.chat_template == "chatml"
    assert params.cache_ram_mib == 0
    assert params.antiprompt == []
    assert common_params(ns, "").api_keys == []


def test_the_launchers_reverse_prompts_become_llama_cpps_default_stop_strings() -> None:
    ns = parse_args(["-m", "m.gguf", "--jinja", "-r", "\n\nQuestion:", "--reverse-prompt", "\nQ:"])
    params = common_params(ns, "")
    assert params.antiprompt == ["\n\nQuestion:", "\nQ:"]
    assert params.use_jinja is True


async def test_the_launcher_refuses_an_unknown_flag_with_exit_code_2() -> None:
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, "-m", "llmgw.engines.llamacpp", "-m", "x.gguf", "--hf-repo", "a/b"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert result.returncode == 2
    assert b"--hf-repo" in result.stderr
    assert b"unsupported" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.slow
async def test_the_launcher_serves_the_starter_model_with_a_key_and_stops_on_sigterm(
    starter_model: Path, tmp_path: Path
) -> None:
    port = _free_port()
    [command] = LlamaCppAdapter().commands(
        _shard(http_port=port, model_path=str(starter_model), context_tokens=2048, slots=2)
    )
    env = {**engine_process_env(""), **command.env}
    with (tmp_path / "llama.log").open("wb") as log:
        process = await trio.lowlevel.open_process(
            command.argv, stdout=subprocess.PIPE, stderr=log, env=env
        )
    try:
        assert process.stdout is not None
        with trio.fail_after(120):
            buffer = bytearray()
            while "listening on" not in (line := await read_line(process.stdout, buffer)):
                pass
            assert line.endswith(f"listening on http://127.0.0.1:{port}")
            base_url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base_url) as client:
                health = await client.get("/health")
                assert health.status_code == 200
                assert body_says_ready(health.content)
                assert (await client.get("/v1/models")).status_code == 401
                with_key = {"Authorization": f"Bearer {KEY}"}
                metrics = await client.get("/metrics", headers=with_key)
                assert metrics.status_code == 200
                assert "llamacpp:" in metrics.text

            def chat() -> list[Any]:
                with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0) as client:
                    stream = client.chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": "Say hello."}],
                        max_tokens=8,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    with stream:
                        return list(stream)

            chunks = await trio.to_thread.run_sync(chat)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text
            usage = chunks[-1].usage
            assert usage is not None
            assert usage.prompt_tokens > 0
            assert 0 < usage.completion_tokens <= 8
            assert usage.prompt_tokens_details is not None
            assert usage.prompt_tokens_details.cached_tokens is not None

            process.terminate()
            with trio.fail_after(15):
                assert await process.wait() == 0
            assert _port_is_free(port)
    finally:
        await stop_process(process)


@pytest.mark.slow
async def test_the_launcher_exits_at_once_on_sigterm_while_a_stream_is_open(
    starter_model: Path, tmp_path: Path
) -> None:
    port = _free_port()
    [command] = LlamaCppAdapter().commands(
        _shard(http_port=port, model_path=str(starter_model), context_tokens=2048, slots=2)
    )
    body = orjson.dumps(
        {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 2000,
            "stream": True,
        }
    )
    with (tmp_path / "llama.log").open("wb") as log:
        process = await trio.lowlevel.open_process(
            command.argv,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**engine_process_env(""), **command.env},
        )
    try:
        assert process.stdout is not None
        with trio.fail_after(120):
            buffer = bytearray()
            while "listening on" not in await read_line(process.stdout, buffer):
                pass
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: llama\r\n"
                    b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body)
                )
                received = b""
                while b"data: " not in received:
                    received += await stream.receive_some(65536)
                process.terminate()
                with trio.fail_after(5):
                    assert await process.wait() == 0
            assert "in flight; exiting without waiting" in await read_line(process.stdout, buffer)
            assert _port_is_free(port)
    finally:
        await stop_process(process)

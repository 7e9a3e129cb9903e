"""The catalog entries ``llmgw up`` makes: how chat reaches the starter model.

The starter model is a pre-trained Gemma 3 270M: chat is written for it as
plain questions and answers (:data:`~llmgw.app.up_models.STARTER_CHAT_TEMPLATE`)
and stopped at the next question. The template is checked here with Jinja2
and, in the slow test, with llama.cpp's own Jinja engine and tokenizer: the
sequence the model sees begins with ``<bos>``, once.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import attrs
import httpx
import jinja2
import jinja2.sandbox
import pytest
import trio

from llmgw.agent.weights import assemble_starter_model
from llmgw.app import up_models
from llmgw.app.up_models import STARTER_CHAT_ARGS, STARTER_CHAT_TEMPLATE, model_records
from llmgw.engines.llamacpp import KEY_ENV
from llmgw.engines.testing import engine_process_env, read_line, stop_process

#: Where the engine tests keep the assembled starter GGUF (tests/engines/conftest.py).
CACHE_DIR = Path("/tmp/llmgw-test-cache")
#: Gemma's ``<bos>`` token id.
BOS_ID = 2
KEY = "up-models-test-key"

EXAMPLES = (
    "Question: Hello!\nAnswer: Hello! How can I help you?\n\n"
    "Question: What is the largest planet?\nAnswer: Jupiter is the largest planet.\n\n"
)


class _ToolsRefused(Exception):
    pass


def _raise(message: str) -> NoReturn:
    raise _ToolsRefused(message)


def _render(messages: list[dict[str, Any]], **extra: Any) -> str:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
    template = env.from_string(STARTER_CHAT_TEMPLATE)
    context: dict[str, Any] = {"tools": None, "add_generation_prompt": True, **extra}
    return template.render(messages=messages, raise_exception=_raise, **context)


def test_the_starter_template_writes_chat_as_plain_questions_and_answers() -> None:
    assert _render([{"role": "user", "content": " What is the capital of France?\n"}]) == (
        f"{EXAMPLES}Question: What is the capital of France?\nAnswer:"
    )
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a river."},
    ]
    assert _render(conversation) == (
        f"Be brief.\n\n{EXAMPLES}Question: Hi\nAnswer: Hello.\n\nQuestion: Name a river.\nAnswer:"
    )
    assert _render(conversation[:3], add_generation_prompt=False).endswith("Answer: Hello.\n\n")


def test_the_starter_template_refuses_tools() -> None:
    with pytest.raises(_ToolsRefused, match="takes no tools"):
        _render([{"role": "user", "content": "hi"}], tools=[{"type": "function"}])


def test_the_stop_strings_end_an_answer_where_the_template_starts_a_question() -> None:
    assert STARTER_CHAT_ARGS[0] == "--jinja"  # before --chat-template: llama-server's rule
    args = STARTER_CHAT_ARGS
    stops = [args[i + 1] for i, arg in enumerate(args) if arg == "--reverse-prompt"]
    assert stops == ["\n\nQuestion:", "\nQuestion:"]
    assert all(stop in EXAMPLES + "Question:" for stop in stops)


@attrs.frozen
class _Flags:
    engine: str = "llamacpp"
    model: Path | None = None
    model_names: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()
    context_tokens: int = 4096
    slots: int = 4


async def test_the_starter_model_gets_the_template_unless_one_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "weights" / "starter.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"not a gguf")  # planning logs and reserves 0 GB

    def assembled(weights: Path) -> Path:
        assert weights == tmp_path / "weights"
        return gguf

    monkeypatch.setattr(up_models, "assemble_starter_model", assembled)
    [record] = await model_records(_Flags(), tmp_path, lambda _: None)
    args = record.profiles[0].args
    assert args[: len(STARTER_CHAT_ARGS)] == STARTER_CHAT_ARGS
    assert "--no-jinja" not in args
    [own] = await model_records(
        _Flags(engine_args=("--chat-template", "chatml")), tmp_path, lambda _: None
    )
    assert own.profiles[0].args[:2] == ("--chat-template", "chatml")
    assert "--jinja" not in own.profiles[0].args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.slow
async def test_llama_cpp_sees_bos_once_then_the_plain_questions(tmp_path: Path) -> None:
    """The bundled launcher with the starter's arguments: llama.cpp's Jinja
    engine renders what Jinja2 renders, its tokenizer puts ``<bos>`` first
    (once), and tools are refused with a 400 that says why."""
    model = await trio.to_thread.run_sync(assemble_starter_model, CACHE_DIR)
    port = _free_port()
    argv = [
        *(sys.executable, "-m", "llmgw.engines.llamacpp", "-m", str(model)),
        *("--port", str(port), "--parallel", "1", "--threads", "1", "-c", "1024"),
        *STARTER_CHAT_ARGS,
    ]
    with (tmp_path / "llama.log").open("wb") as log:
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=log, env={**engine_process_env(""), KEY_ENV: KEY}
        )
    try:
        assert process.stdout is not None
        with trio.fail_after(120):
            buffer = bytearray()
            while "listening on" not in await read_line(process.stdout, buffer):
                pass
            messages = [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"},
            ]
            headers = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60
            ) as client:
                applied = await client.post("/apply-template", json={"messages": messages})
                prompt = applied.json()["prompt"]
                assert prompt == _render(messages)
                tokenized = await client.post(
                    "/tokenize", json={"content": prompt, "add_special": True}
                )
                tokens = tokenized.json()["tokens"]
                assert tokens[0] == BOS_ID
                assert tokens.count(BOS_ID) == 1
                answer = await client.post(
                    "/v1/chat/completions",
                    json={"messages": messages, "temperature": 0, "max_tokens": 16},
                )
                body = answer.json()
                assert body["usage"]["prompt_tokens"] == len(tokens)
                assert body["choices"][0]["finish_reason"] == "stop"
                tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
                refused = await client.post(
                    "/v1/chat/completions", json={"messages": messages, "tools": tools}
                )
                assert refused.status_code == 400
                assert "takes no tools" in refused.text
    finally:
        await stop_process(process)

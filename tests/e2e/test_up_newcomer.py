"""``llmgw up`` as a newcomer meets it (``docs/up.md``): after a crash the
"ready" line comes only once a request is answered; a ``--model`` that is
not a GGUF is refused at once."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx

MODEL = "sim-model"
WAITING = "standing by until it expires"


def _chat(base_url: str, key: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}]},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_after_a_crash_ready_is_said_only_once_a_chat_is_answered(
    start_up: Any, tmp_path: Path
) -> None:
    first = start_up("--engine", "sim", "--model-name", MODEL)
    first.wait_ready()
    key = first.client_key
    ports = f"{first.engine_ports[0]}-{first.engine_ports[1]}"
    # A crash: the leader lease is not given up, the engine lives on.
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=30)
    (first.data_dir / "run.json").unlink(missing_ok=True)
    up = start_up("--engine", "sim", "--model-name", MODEL, "--engine-ports", ports)
    up.wait_for(lambda: "ready in " in up.log(), 120, f"the ready line:\n{up.log()}")
    # At once, no retry: the line says the API answers.
    up.wait_run()
    response = _chat(up.base_url, key)
    assert response.status_code == 200, response.text
    assert httpx.get(f"{up.base_url}/ready", timeout=5).status_code == 200
    log = up.log()
    # The wait for the killed run's lease was said, once, before.
    assert log.count(WAITING) == 1, log
    assert log.index(WAITING) < log.index("leading (lease epoch") < log.index("ready in "), log


def test_a_model_that_is_not_a_gguf_is_refused_at_once_and_nothing_is_written(
    up_argv: Any, tmp_path: Path
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# A project\n\nNot weights.\n")
    data_dir = tmp_path / "data"
    result = subprocess.run(
        up_argv(data_dir, "--model", str(readme)),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert f"--model {readme}: not a GGUF file" in result.stderr
    assert "Traceback" not in result.stderr
    assert not data_dir.exists()

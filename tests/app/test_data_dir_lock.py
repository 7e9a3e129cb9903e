"""``DATA_DIR/llmgw.lock``: one process per data directory, and the message
another command gets names the command that holds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.app.process import DataDirLock, StartError


def test_the_refusal_names_the_holder_s_command_and_pid(tmp_path: Path) -> None:
    """``llmgw up`` on a directory ``llmgw server`` holds says "another
    llmgw server", not "another llmgw up"."""
    with (
        DataDirLock(tmp_path, "llmgw server"),
        pytest.raises(StartError) as refused,
        DataDirLock(tmp_path, "llmgw up"),
    ):
        pass
    assert str(refused.value) == (
        f"another llmgw server is using {tmp_path} (pid {os.getpid()}); stop it, or pass "
        "another --data-dir"
    )
    with DataDirLock(tmp_path, "llmgw up"):  # free again
        pass


def test_a_holder_that_wrote_no_command_is_another_llmgw(tmp_path: Path) -> None:
    with DataDirLock(tmp_path, "llmgw server"):
        (tmp_path / "llmgw.lock").write_text("")  # as an older llmgw left it
        with (
            pytest.raises(StartError, match=f"^another llmgw is using {tmp_path};"),
            DataDirLock(tmp_path, "llmgw up"),
        ):
            pass

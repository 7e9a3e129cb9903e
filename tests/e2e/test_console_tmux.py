"""``llmgw console`` in a real terminal: tmux, 80x24, keys sent, the
captured screen checked; and ``llmgw`` alone opens it on a control plane's
machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("tmux") is None and os.environ.get("CI") != "true", reason="needs tmux"
    ),
]

WAIT_S = 90.0


class Tmux:
    """One detached tmux session of 80x24 running a command."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.name = f"llmgw-console-{uuid.uuid4().hex[:8]}"
        environment = [f"{k}={v}" for k, v in (env or {}).items()]
        subprocess.run(
            [
                "tmux",
                "new-session",
                "-d",
                "-s",
                self.name,
                "-x",
                "80",
                "-y",
                "24",
                *(["env", *environment] if environment else []),
                *command,
            ],
            check=True,
        )

    def screen(self) -> str:
        result = subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", self.name],
            capture_output=True,
            text=True,
            check=False,
        )
        return result.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def alive(self) -> bool:
        return (
            subprocess.run(
                ["tmux", "has-session", "-t", self.name], capture_output=True, check=False
            ).returncode
            == 0
        )

    def wait_screen(self, *needles: str, timeout_s: float = WAIT_S) -> str:
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if all(n in screen for n in needles):
                return screen
            time.sleep(0.3)
        raise AssertionError(f"not on the screen within {timeout_s} s: {needles}\n{screen}")

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True, check=False)


@pytest.fixture(name="tmux")
def tmux_fixture() -> Iterator[Callable[..., Tmux]]:
    started: list[Tmux] = []

    def start(command: list[str], env: dict[str, str] | None = None) -> Tmux:
        session = Tmux(command, env)
        started.append(session)
        return session

    yield start
    for session in started:
        session.kill()


def test_the_console_in_a_real_terminal(start_up: Callable[..., Any], tmux: Any) -> None:
    up = start_up("--engine", "sim", "--model-name", "sim-model")
    up.wait_ready()
    term = tmux(
        [sys.executable, "-m", "llmgw.cli", "console", "--data-dir", str(up.data_dir)],
        {"TERM": "xterm-256color"},
    )
    screen = term.wait_screen("Overview = llmgw ctl status", "1 connected of 1", "1 ready")
    lines = screen.splitlines()
    assert len(lines) <= 24
    assert all(len(line) <= 80 for line in lines)
    assert "llmgw console" in lines[0]
    assert "q quit" in screen or "Tab" in screen
    term.keys("2")
    term.wait_screen("Models = llmgw ctl models", "sim-model", "1/1")
    term.keys("s")
    term.wait_screen("Scale sim-model")
    term.keys("BSpace", "2", "Enter")
    term.wait_screen("2/2")
    term.keys("4")
    term.wait_screen("Replicas = llmgw ctl replicas", "sim-model-1")
    term.keys("q")
    deadline = time.monotonic() + 30
    while term.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not term.alive(), term.screen()


def test_llmgw_alone_opens_the_console_on_a_control_planes_machine(
    start_up: Callable[..., Any], tmux: Any
) -> None:
    up = start_up("--engine", "sim", "--model-name", "sim-model")
    up.wait_ready()
    term = tmux(
        [sys.executable, "-m", "llmgw.cli"],
        {"TERM": "xterm-256color", "LLMGW_DATA_DIR": str(up.data_dir)},
    )
    term.wait_screen("Overview = llmgw ctl status", "1 connected of 1")
    term.keys("q")

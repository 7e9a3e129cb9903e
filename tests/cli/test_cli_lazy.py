"""The `llmgw` command loads a command group's module only when that command
runs, so `llmgw up` starts without the clients' imports."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from llmgw.cli.main import COMMANDS, cli

_PROBE = """
import sys
import click
from llmgw.cli.main import cli
command = cli.get_command(click.Context(cli), "up")
assert command is not None and command.name == "up", command
print(",".join(sorted(
    name for name in ("llmgw.cli.ctl", "llmgw.cli.keys", "llmgw.cli.serving",
                      "llmgw.cli.bench", "llmgw.bench.cli", "llmgw.app.up", "httpx")
    if name in sys.modules
)))
"""


def test_finding_up_imports_no_other_command_group() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_help_lists_every_command_and_each_one_resolves() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0, result.output
    listed = result.output.split("Commands:", 1)[1]
    for name in COMMANDS:
        assert f"  {name} " in listed
        resolved = CliRunner().invoke(cli, [name, "--help"])
        assert resolved.exit_code == 0, (name, resolved.output)


def test_an_unknown_command_is_refused_by_name() -> None:
    result = CliRunner().invoke(cli, ["nosuchcommand"])
    assert result.exit_code == 2
    assert "No such command 'nosuchcommand'" in result.output

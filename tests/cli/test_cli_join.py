"""``llmgw join``: after joining it replaces itself with the node's agent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.agent import join as agent_join
from llmgw.agent.joincode import JoinCode
from llmgw.cli import join as cli_join
from llmgw.cli.main import cli

CODE = JoinCode(("10.0.0.1:7444",), "tok", "sha256:" + "ab" * 32).encode()


def test_the_agent_command_is_this_llmgw_with_the_nodes_config(tmp_path: Path) -> None:
    argv = cli_join.agent_argv(tmp_path / "agent.yaml")
    assert argv == [
        sys.executable,
        "-m",
        "llmgw.cli",
        "agent",
        "--config",
        str(tmp_path / "agent.yaml"),
    ]
    # The program and module named there run (the agent's own options aside).
    done = subprocess.run(
        [*argv[:3], "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "join" in done.stdout


def test_join_execs_the_agent_once_joined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path = tmp_path / "agent.yaml"
    seen: dict[str, object] = {}

    def fake_join(code: JoinCode, data_dir: Path, **kw: object) -> agent_join.Joined:
        seen.update(code=code, data_dir=data_dir, **kw)
        return agent_join.Joined(
            node_id="node-b",
            config_path=config_path,
            control_plane="10.0.0.1:7444",
            servers=("wss://10.0.0.1:7443/agent",),
            labels={},
            serial="ab",
        )

    def fake_execv(path: str, argv: list[str]) -> None:
        seen["exec"] = (path, argv)

    monkeypatch.setattr(agent_join, "join_cluster", fake_join)
    monkeypatch.setattr("os.execv", fake_execv)
    result = CliRunner().invoke(
        cli, ["join", CODE, "--data-dir", str(tmp_path), "--node-id", "node-b"]
    )
    assert result.exit_code == 0, result.output
    assert seen["exec"] == (sys.executable, cli_join.agent_argv(config_path))
    assert seen["node_id"] == "node-b"
    assert seen["data_dir"] == tmp_path
    assert f"starting the agent: llmgw agent --config {config_path}" in result.output


def test_join_refuses_at_once_while_an_agent_holds_the_node_s_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``llmgw join CODE --force`` while the node's agent runs: refused
    before the code is sent (the code is not used up), in one line."""
    from llmgw.agent.state import StateDir

    (tmp_path / "agent.yaml").write_text("servers: [wss://10.0.0.1:7443/agent]\n")

    def no_dial(*_: object) -> None:
        raise AssertionError("the code was sent")

    monkeypatch.setattr(agent_join, "_find_control_plane", no_dial)
    with StateDir(tmp_path / "agent").lock():
        result = CliRunner().invoke(cli, ["join", CODE, "--data-dir", str(tmp_path), "--force"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert f"an llmgw agent is running on {tmp_path}" in result.output
    assert "the join code was not used" in result.output


def test_join_says_when_the_code_s_node_id_overrides_node_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_join(code: JoinCode, data_dir: Path, **kw: object) -> agent_join.Joined:
        return agent_join.Joined(
            node_id="from-code",
            config_path=data_dir / "agent.yaml",
            control_plane="10.0.0.1:7444",
            servers=("wss://10.0.0.1:7443/agent",),
            labels={},
            serial="ab",
        )

    monkeypatch.setattr(agent_join, "join_cluster", fake_join)
    result = CliRunner().invoke(
        cli, ["join", CODE, "--data-dir", str(tmp_path), "--node-id", "node-b", "--no-start"]
    )
    assert result.exit_code == 0, result.output
    assert "as node from-code" in result.output
    assert (
        "note: the join code names the node from-code, which the control plane kept instead "
        "of node-b"
    ) in result.output

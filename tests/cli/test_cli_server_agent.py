"""``llmgw server`` and ``llmgw agent`` refuse bad options before starting
anything, saying what to do."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from llmgw.cli.main import cli


def test_agent_takes_a_config_or_a_server_and_token_not_both_nor_neither(tmp_path: Path) -> None:
    runner = CliRunner()
    neither = runner.invoke(cli, ["agent"])
    assert neither.exit_code == 2
    assert "give --config agent.yaml, or --server and --token-file" in neither.output
    both = runner.invoke(
        cli, ["agent", "--config", str(tmp_path / "agent.yaml"), "--server", "ws://x:7443/agent"]
    )
    assert both.exit_code == 2
    assert "--config takes no --server or --token-file" in both.output


def test_agent_config_that_is_not_there_or_wrong_is_refused_naming_the_key(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(cli, ["agent", "--config", str(tmp_path / "agent.yaml")])
    assert missing.exit_code == 1
    assert "cannot read" in missing.output
    path = tmp_path / "agent.yaml"
    path.write_text("servers: [wss://10.0.0.1:7443/agent]\ntls: {ca: a, cert: b, kee: c}\n")
    wrong = runner.invoke(cli, ["agent", "--config", str(path)])
    assert wrong.exit_code == 1
    assert "unknown key tls.kee" in wrong.output


def test_server_refuses_a_bad_listen_address_and_a_bad_advertise(tmp_path: Path) -> None:
    runner = CliRunner()
    bad_listen = runner.invoke(
        cli, ["server", "--data-dir", str(tmp_path), "--join-listen", "nowhere"]
    )
    assert bad_listen.exit_code == 2
    assert "is not HOST:PORT" in bad_listen.output
    bad_name = runner.invoke(cli, ["server", "--data-dir", str(tmp_path), "--advertise", "a b"])
    assert bad_name.exit_code == 2
    assert "is not a host name or an address" in bad_name.output
    assert not (tmp_path / "llmgw.db").exists()


def test_agent_on_a_state_directory_another_agent_holds_says_so_in_one_line(
    tmp_path: Path,
) -> None:
    """No "Exception Group Traceback": the error of a busy state directory
    is raised after the ``except*``, as a plain ClickException."""
    from llmgw.agent.state import StateDir

    token = tmp_path / "token"
    token.write_text("t\n")
    state = tmp_path / "state"
    with StateDir(state).lock():
        result = CliRunner().invoke(
            cli,
            [
                "agent",
                "--server",
                "ws://127.0.0.1:1/agent",
                "--token-file",
                str(token),
                "--state-dir",
                str(state),
            ],
        )
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert f"Error: another llmgw agent is using the state directory {state}" in result.output


def test_server_refuses_a_lease_ttl_that_is_no_duration_or_too_short(tmp_path: Path) -> None:
    runner = CliRunner()
    for value, says in (("1", "at least 2 s"), ("soon", "not a duration")):
        result = runner.invoke(cli, ["server", "--data-dir", str(tmp_path), "--lease-ttl", value])
        assert result.exit_code == 2
        assert "--lease-ttl" in result.output
        assert says in result.output
    assert not (tmp_path / "llmgw.db").exists()  # nothing started

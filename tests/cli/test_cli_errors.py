"""How the ``llmgw`` command reports errors: an error of :mod:`llmgw.errors`
is one line ``Error: <message>`` on stderr and exit status 1; and the
``bench`` group when the benchmarks are not installed."""

from __future__ import annotations

import json
import socket
import time
import types
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from llmgw import errors
from llmgw.cli import bench as bench_module
from llmgw.cli.errors import ReportingGroup, first_leaf
from llmgw.cli.main import cli
from llmgw.cli.options import local_time, local_zone, show_times


@pytest.mark.parametrize(
    "exc",
    [
        errors.NotFound("no model 'm'"),
        errors.InvalidInput("'x' is not a number"),
        errors.Refused("404: No model 'm' in the catalog."),
        errors.StoreError("database is locked"),
    ],
)
def test_an_error_of_the_tree_is_one_line_on_stderr_and_exit_1(exc: errors.LlmgwError) -> None:
    @click.group(cls=ReportingGroup)
    def root() -> None:
        pass

    @root.group()
    def inner() -> None:
        pass

    @inner.command()
    def fail() -> None:
        click.echo("before")
        raise exc

    result = CliRunner().invoke(root, ["inner", "fail"])
    assert result.exit_code == 1
    assert result.stdout == "before\n"
    assert result.stderr == f"Error: {exc}\n"


def test_an_error_without_text_still_says_what_it_is() -> None:
    class Silent(errors.UpstreamError):
        """The node did not answer in time."""

    @click.group(cls=ReportingGroup)
    def root() -> None:
        pass

    @root.command()
    def fail() -> None:
        raise Silent()

    result = CliRunner().invoke(root, ["fail"])
    assert result.exit_code == 1
    assert result.stderr == "Error: Silent (the node did not answer in time)\n"


def _commands(command: click.Command, path: tuple[str, ...]) -> list[tuple[str, click.Command]]:
    found = [(" ".join(path), command)]
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            found += _commands(sub, (*path, name))
    return found


def test_every_option_of_every_command_has_help() -> None:
    """``llmgw … --help`` explains every option (``ctl model plan --slots`` did not)."""
    missing = [
        f"{path} {'/'.join(param.opts)}"
        for path, command in _commands(cli, ("llmgw",))
        for param in command.params
        if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip()
    ]
    assert missing == []
    # The walk reaches the nested groups, bench's included when installed.
    paths = [path for path, _ in _commands(cli, ("llmgw",))]
    assert "llmgw ctl model plan" in paths


def test_other_errors_are_not_turned_into_messages() -> None:
    @click.group(cls=ReportingGroup)
    def root() -> None:
        pass

    @root.command()
    def fail() -> None:
        raise RuntimeError("a bug")

    result = CliRunner().invoke(root, ["fail"])
    assert isinstance(result.exception, RuntimeError)


def test_first_leaf_finds_the_error_inside_nested_groups() -> None:
    inner = ValueError("bad")
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [inner]), KeyError("k")])
    assert first_leaf(group) is inner


def test_a_client_command_without_an_admin_token_says_where_it_looked(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["ctl", "models", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr == (
        f"Error: no admin token at {tmp_path / 'admin-token'}: run 'llmgw up' or 'llmgw server' "
        "first, or pass --data-dir\n"
    )


def test_a_client_command_with_nothing_listening_asks_whether_llmgw_runs(
    tmp_path: Path,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    (tmp_path / "admin-token").write_text("llmgw-admin-abcdefghijklmnopqrstuvwxyz\n")
    (tmp_path / "run.json").write_text(json.dumps({"admin": address}))
    result = CliRunner().invoke(cli, ["status", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: cannot reach the admin API at http://{address} (")
    assert result.stderr.endswith("); is llmgw running?\n")


def test_bench_without_the_bench_member_exits_1_saying_where_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}", name="llmgw.bench")

    monkeypatch.setattr("importlib.import_module", missing)
    command = bench_module._bench_group()
    result = CliRunner().invoke(command, ["overhead", "--rates", "20"])
    assert result.exit_code == 1
    assert "llmgw-bench workspace member" in result.stderr
    assert "uv sync" in result.stderr


def test_bench_is_the_bench_members_group_when_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @click.group()
    def bench() -> None:
        """Benchmarks."""

    module = types.ModuleType("llmgw.bench.cli")
    module.bench = bench  # type: ignore[attr-defined]
    monkeypatch.setattr("importlib.import_module", lambda name: module)
    assert bench_module._bench_group() is bench


def test_bench_does_not_hide_a_broken_bench_member(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    monkeypatch.setattr("importlib.import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="numpy"):
        bench_module._bench_group()


def test_times_are_local_dates_with_their_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Europe/Paris")
    time.tzset()
    try:
        at = 1796132320.346  # the figure `ctl request` showed as is
        assert local_time(at) == "2026-12-01 14:38:40"
        assert local_time(at, zone=True) == "2026-12-01 14:38:40 CET"
        assert local_time(None) == "-"
        assert show_times({"created_at": at, "status": 200, "revoked_at": None}) == {
            "created_at": "2026-12-01 14:38:40 CET",
            "status": 200,
            "revoked_at": "-",
        }
        assert local_zone() == "CET"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()

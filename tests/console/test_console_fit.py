"""The console's key bars and the node console's title fit 80 columns, and
every screen names a command the ``llmgw`` CLI (``llmgw.cli.main.cli``)
really has."""

from __future__ import annotations

import click
import pytest

from llmgw.cli.main import cli as llmgw_cli
from llmgw.console.app import keybar_line
from llmgw.console.node import node_title
from llmgw.console.screens import SCREENS


@pytest.mark.parametrize("screen", SCREENS, ids=lambda s: s.name)
def test_each_screens_key_bar_fits_80_columns_and_ends_with_quit(screen: object) -> None:
    help_ = screen.help  # type: ignore[attr-defined]
    line = keybar_line(help_)
    assert len(line) <= 80, line
    assert line.endswith("q quit")
    assert help_ in line


def test_the_node_title_fits_80_columns_and_keeps_the_time() -> None:
    long_path = "/tmp/pytest-of-someone/pytest-1234/test_node_console_0/run/llmgw/agent.sock"
    title = node_title(long_path, "12:34:56")
    assert len(title) <= 80, title
    assert "updated 12:34:56" in title
    assert title.endswith("agent.sock")
    assert node_title("/run/a.sock", "-").endswith("/run/a.sock")


@pytest.mark.parametrize("screen", SCREENS, ids=lambda s: s.name)
def test_each_screen_names_a_command_the_cli_has(screen: object) -> None:
    """Regression: the Manual named ``llmgw docs``, which does not exist."""
    cli: str = screen.cli  # type: ignore[attr-defined]
    if not cli.startswith("llmgw "):
        assert cli == "docs/*.md"  # the Manual: the checkout's pages, no command
        return
    group: click.Command = llmgw_cli
    ctx = click.Context(llmgw_cli)
    for word in cli.split()[1:]:
        if word.isupper():  # an argument such as NODE
            break
        assert isinstance(group, click.Group), cli
        found = group.get_command(ctx, word)
        assert found is not None, f"{cli}: no command {word!r}"
        group = found

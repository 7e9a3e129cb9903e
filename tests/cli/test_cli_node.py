"""``llmgw node add`` checks its options itself, in their own terms."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.cli.main import cli


@pytest.mark.parametrize("expires", ["0s", "0", "31d", "2592001"])
def test_expires_out_of_range_is_refused_in_the_option_s_terms(
    tmp_path: Path, expires: str
) -> None:
    """Refused before the admin API is asked (there is none here), not as
    the API's "'expires_s' must be a number of seconds …"."""
    result = CliRunner().invoke(
        cli, ["node", "add", "--expires", expires, "--data-dir", str(tmp_path)]
    )
    assert result.exit_code == 2, result.output
    assert "--expires must be from 1s to 30d" in result.output
    assert "expires_s" not in result.output


def test_the_help_says_a_bare_number_is_seconds() -> None:
    result = CliRunner().invoke(cli, ["node", "add", "--help"])
    assert "a bare number is seconds" in " ".join(result.output.split())


def test_without_a_control_plane_s_data_dir_it_names_both_commands(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["node", "add", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "run 'llmgw up' or 'llmgw server' first" in result.output

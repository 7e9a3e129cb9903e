"""``--store`` on ``llmgw server`` and ``llmgw up``: a password never on
the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.app.process import check_store_address, store_where
from llmgw.cli.main import cli


@pytest.mark.parametrize("command", ["server", "up"])
@pytest.mark.parametrize(
    "address",
    [
        "postgresql://llmgw:s3cret@db1:5432,db2:5432/llmgw",
        "host=db1 dbname=llmgw user=llmgw password=s3cret",
    ],
)
def test_a_password_on_the_command_line_is_refused_without_echoing_it(
    command: str, address: str, tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        cli, [command, "--data-dir", str(tmp_path), "--store", address], env={"LLMGW_STORE": None}
    )
    assert result.exit_code == 2
    assert "holds a password" in result.output
    assert "PGPASSFILE" in result.output
    assert "s3cret" not in result.output
    assert not (tmp_path / "llmgw.db").exists()


def test_addresses_without_a_password_pass_and_are_said_without_one() -> None:
    address = "postgresql://llmgw@db1:5432,db2:5433/llmgw"
    assert check_store_address(address) == address
    assert store_where(address) == "postgresql://db1:5432,db2:5433/llmgw"
    assert store_where("postgresql://u:pw@db1/x") == "postgresql://db1:5432/x"
    assert check_store_address(" /var/lib/llmgw/llmgw.db ") == "/var/lib/llmgw/llmgw.db"
    with pytest.raises(ValueError, match="empty"):
        check_store_address("  ")

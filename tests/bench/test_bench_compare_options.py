"""``llmgw bench compare``: bad options are one-line usage errors (exit 2)
before anything starts; a system that answered nothing fails the command."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from llmgw.bench.cli import COMPARE_MODES, bench
from llmgw.bench.gateway import MODES


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "4,x"], "--concurrency"),
        (["--concurrency", ","], "--concurrency"),
        (["--rounds", "0"], "--rounds"),
        (["--duration-s", "0"], "--duration-s"),
        (["--engine-url", "notaurl"], "--engine-url"),
        (["--engine-url", "http://host-without-port"], "--engine-url"),
        (["--gateway-url", "ftp://h:1"], "--gateway-url"),
        (["--mode", "nonsense"], "--mode"),
    ],
)
def test_a_bad_option_is_a_usage_error_naming_it(args: list[str], says: str) -> None:
    result = CliRunner().invoke(bench, ["compare", *args])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert "Usage: bench compare" in result.output
    assert says in result.output


def test_the_compare_modes_are_the_bench_gateways() -> None:
    assert COMPARE_MODES == MODES


@pytest.mark.slow
def test_a_system_that_answered_nothing_fails_the_command() -> None:
    """Nothing listens on port 1: every request of every system fails."""
    result = CliRunner().invoke(
        bench,
        [
            "compare",
            "--engine-url",
            "http://127.0.0.1:1",
            "--concurrency",
            "1",
            "--rounds",
            "1",
            "--duration-s",
            "0.5",
            "--warmup-s",
            "0",
            "--no-pin",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "no request answered by: engine alone, llmgw" in result.output

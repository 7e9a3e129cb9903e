"""``llmgw bench …``: the benchmarks, when they are installed.

They live in the ``llmgw-bench`` workspace member (``bench/``, the package
``llmgw.bench``), outside the product's wheel; ``uv sync`` installs it in the
development environment. Where it is installed, :data:`bench` is its click
group (``llmgw.bench.cli:bench``); elsewhere it is a command that says so
and exits with status 1.
"""

from __future__ import annotations

import importlib

import click

__all__ = ["bench"]

_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@click.command("bench", context_settings=_PASS_THROUGH)
def _missing() -> None:
    """Benchmarks (not installed: they are the llmgw-bench workspace member)."""
    raise click.ClickException(
        "the benchmarks are in the llmgw-bench workspace member (bench/), which is not "
        "installed here; 'python3 -m uv sync' in a checkout of llmgw installs it (the dev "
        "environment, which 'python3 -m uv run' without --no-dev also uses)"
    )


def _bench_group() -> click.Command:
    try:
        module = importlib.import_module("llmgw.bench.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("llmgw.bench", "llmgw.bench.cli"):
            raise
        return _missing
    group = module.bench
    assert isinstance(group, click.Command)
    return group


#: ``llmgw.bench.cli:bench`` when installed, else a command that says where it is.
bench: click.Command = _bench_group()

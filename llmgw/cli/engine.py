"""``llmgw engine sim|llamacpp``: the engine launchers the agent starts.

Every argument after the engine's name is passed on to it unread (``--help``
included)."""

from __future__ import annotations

import sys

import click

__all__ = ["engine"]


@click.group()
def engine() -> None:
    """Engine launchers (the agent starts these)."""


_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@engine.command("sim", context_settings=_PASS_THROUGH)
@click.pass_context
def engine_sim(ctx: click.Context) -> None:
    """The sim engine: an OpenAI-compatible fake (see --help after 'sim')."""
    from llmgw.engines.sim.serve import main

    sys.exit(main(list(ctx.args)))


@engine.command("llamacpp", context_settings=_PASS_THROUGH)
@click.pass_context
def engine_llamacpp(ctx: click.Context) -> None:
    """llama.cpp's server from the xllamacpp wheel, with llama-server's flags."""
    from llmgw.engines import llamacpp

    sys.exit(llamacpp.main(list(ctx.args)))

"""The ``llmgw`` command: the root group, and where each command group is
registered.

- ``llmgw up`` runs everything on one machine (:mod:`.up`); ``llmgw agent``
  a node agent (:mod:`.agent`); ``llmgw engine sim|llamacpp`` are the engine
  launchers the agent starts (:mod:`.engine`);
- ``llmgw keys …`` (:mod:`.keys`), ``llmgw ctl …`` (:mod:`.ctl`) and
  ``llmgw stop|start|status`` (:mod:`.serving`) are clients of the admin API
  (address and admin token found in the data directory); each takes
  ``--json``;
- ``llmgw bench …`` when the benchmarks are installed (:mod:`.bench`).

Errors are reported as :mod:`.errors` says.
"""

from __future__ import annotations

import logging
import sys

import click

from .agent import agent
from .bench import bench
from .ctl import ctl
from .engine import engine
from .errors import ReportingGroup
from .keys import keys
from .serving import start, status, stop
from .up import up

__all__ = ["cli", "main"]

#: Loggers that say too much at INFO.
_NOISY = ("httpx", "httpcore", "hypercorn", "llmgw.http", "quart", "trio-websocket")


@click.group(cls=ReportingGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
def cli(verbose: bool) -> None:
    """llmgw: a private, governed, OpenAI-compatible LLM service."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="llmgw: %(message)s"
        if not verbose
        else "%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


for _command in (agent, bench, ctl, engine, keys, start, status, stop, up):
    cli.add_command(_command)


def main() -> None:
    """Entry point of the ``llmgw`` command."""
    cli()

"""The ``llmgw`` command: the root group, and where each command group is
registered.

- ``llmgw up`` runs everything on one machine (:mod:`.up`); ``llmgw server``
  the control plane alone (:mod:`.server`); ``llmgw agent``
  a node agent (:mod:`.agent`); ``llmgw engine sim|llamacpp`` are the engine
  launchers the agent starts (:mod:`.engine`);
- ``llmgw keys …`` (:mod:`.keys`), ``llmgw ctl …`` (:mod:`.ctl`) and
  ``llmgw stop|start|status`` (:mod:`.serving`) are clients of the admin API
  (address and admin token found in the data directory); each takes
  ``--json``;
- ``llmgw doctor`` checks this node (:mod:`.doctor`);
- ``llmgw node add`` prints a join code (:mod:`.node`, a client of the
  admin API); ``llmgw join CODE`` joins this machine to a cluster (:mod:`.join`);
- ``llmgw bench …`` when the benchmarks are installed (:mod:`.bench`);
- ``llmgw mirror serve|import|pull|list|verify``, the model mirror (:mod:`.mirror`).

Errors are reported as :mod:`.errors` says. Each group's module is imported
only when that command runs (or ``--help`` lists them), so ``llmgw up`` does
not pay for the clients' imports before its first line.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Final

import click

from .errors import ReportingGroup

__all__ = ["cli", "main"]

#: Loggers that say too much at INFO.
_NOISY = ("httpx", "httpcore", "hypercorn", "llmgw.http", "quart", "trio-websocket")


#: Each command: the module under ``llmgw.cli`` and the name it has there.
COMMANDS: Final = {
    "agent": ("agent", "agent"),
    "bench": ("bench", "bench"),
    "ctl": ("ctl", "ctl"),
    "doctor": ("doctor", "doctor"),
    "engine": ("engine", "engine"),
    "join": ("join", "join"),
    "keys": ("keys", "keys"),
    "node": ("node", "node"),
    "server": ("server", "server"),
    "start": ("serving", "start"),
    "status": ("serving", "status"),
    "stop": ("serving", "stop"),
    "up": ("up", "up"),
    "mirror": ("mirror", "mirror"),
}


class _LazyGroup(ReportingGroup):
    """The root group: its commands come from :data:`COMMANDS`, each module
    imported when its command is first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in COMMANDS:
            return self.commands.get(cmd_name)
        module_name, attr = COMMANDS[cmd_name]
        command = getattr(importlib.import_module(f"{__package__}.{module_name}"), attr)
        assert isinstance(command, click.Command)
        self.add_command(command, cmd_name)
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
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


def main() -> None:
    """Entry point of the ``llmgw`` command."""
    cli()

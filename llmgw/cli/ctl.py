"""``llmgw ctl …``: read and steer a running llmgw. Each command is a client
of the admin API (:mod:`llmgw.admin`, through
:class:`llmgw.admin.client.AdminClient`); it prints a readable table or
sentence, or the API's JSON with ``--json``. A refusal of the API is printed
as ``Error: <status>: <message>`` with exit status 1 (:mod:`llmgw.cli.errors`).

The commands live with their resource (:mod:`.config`, :mod:`.models`,
:mod:`.nodes`, :mod:`.usage`, :mod:`.serving`); this module gathers them.
"""

from __future__ import annotations

import click

from .config import ctl_config
from .guard import ctl_guard
from .models import ctl_explain_placement, ctl_model, ctl_models, ctl_scale
from .nodes import ctl_logs, ctl_nodes, ctl_replicas, node_commands
from .serving import ctl_status
from .usage import ctl_request, ctl_usage
from .weights import ctl_weights

__all__ = ["ctl"]


@click.group()
def ctl() -> None:
    """Read and steer a running llmgw."""


for _command in (
    ctl_config,
    ctl_explain_placement,
    ctl_logs,
    ctl_model,
    ctl_models,
    ctl_nodes,
    ctl_replicas,
    ctl_request,
    ctl_scale,
    ctl_status,
    ctl_usage,
    ctl_weights,
    *node_commands,
    ctl_guard,
):
    ctl.add_command(_command)

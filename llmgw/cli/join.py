"""``llmgw join CODE``: make this machine a node of the cluster that made
the code (``llmgw node add`` on its control plane), then start its agent.

The work is :func:`llmgw.agent.join.join_cluster`; this module reads the
options, prints what happened, and replaces itself with ``llmgw agent
--config DIR/agent.yaml`` (``--no-start``: prints that command and a
systemd unit instead). See ``docs/cluster.md``.
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
from pathlib import Path

import click

from .options import data_dir_option

__all__ = ["agent_argv", "join", "systemd_unit"]


def agent_argv(config_path: Path) -> list[str]:
    """The command line that runs this node's agent with this llmgw's Python."""
    return [sys.executable, "-m", "llmgw.cli", "agent", "--config", str(config_path)]


def systemd_unit(config_path: Path) -> str:
    """A systemd unit that runs the agent of ``config_path`` as this user.

    ``KillMode=process``: a stop ends the agent only; its engines keep
    serving and the next agent adopts them.
    """
    return (
        "[Unit]\n"
        "Description=llmgw node agent\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "\n"
        "[Service]\n"
        f"User={getpass.getuser()}\n"
        f"ExecStart={' '.join(agent_argv(config_path))}\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "KillMode=process\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


@click.command("join")
@click.argument("code")
@data_dir_option("Where the node's agent.yaml and tls/ are written.")
@click.option("--node-id", default="", help="This node's id (default: the host name).")
@click.option(
    "--address",
    default="",
    help="The address the control plane reaches this node by (default: found by the agent).",
)
@click.option(
    "--no-start", is_flag=True, help="Print the command and a systemd unit instead of starting."
)
@click.option("--force", is_flag=True, help="Join again though DATA_DIR holds a joined node.")
def join(
    code: str, data_dir: Path, node_id: str, address: str, no_start: bool, force: bool
) -> None:
    """Join the cluster whose `llmgw node add` printed CODE, then run the agent."""
    from llmgw.agent.join import join_cluster
    from llmgw.agent.joincode import JoinCode

    parsed = JoinCode.decode(code)
    joined = join_cluster(
        parsed,
        data_dir.absolute(),
        node_id=node_id or socket.gethostname(),
        address=address,
        force=force,
        say=lambda line: click.echo(line, err=True),
    )
    click.echo(
        f"joined the cluster at {joined.control_plane} as node {joined.node_id} "
        f"(certificate {joined.serial}); wrote {joined.config_path}"
    )
    if node_id and joined.node_id != node_id:
        click.echo(
            f"note: the join code names the node {joined.node_id}, which the control plane "
            f"kept instead of {node_id}",
            err=True,
        )
    argv = agent_argv(joined.config_path)
    if no_start:
        click.echo(f"start the agent with:\n  llmgw agent --config {joined.config_path}")
        click.echo(
            "or as a service, in /etc/systemd/system/llmgw-agent.service "
            "(then: systemctl enable --now llmgw-agent):\n"
        )
        click.echo(systemd_unit(joined.config_path))
        return
    click.echo(f"starting the agent: llmgw agent --config {joined.config_path}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)

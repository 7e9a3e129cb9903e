"""``llmgw ctl nodes`` (and ``ctl nodes remove NODE``), ``ctl replicas``, ``ctl cordon|uncordon|drain`` and
``ctl logs``: the nodes and their replicas, through the admin API
(:mod:`llmgw.admin.nodes`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from llmgw.admin.client import AdminClient

from .options import ago, data_dir_option, format_table, json_option, path_part, print_json

__all__ = ["ctl_logs", "ctl_nodes", "ctl_replicas", "node_commands", "print_replicas"]


@click.group("nodes", invoke_without_command=True)
@data_dir_option()
@json_option()
@click.pass_context
def ctl_nodes(ctx: click.Context, data_dir: Path, as_json: bool) -> None:
    """Nodes: address, link, CPUs, memory, GPUs, engines, cordons and replicas
    ('ctl nodes remove NODE' takes one out of the cluster)."""
    if ctx.invoked_subcommand is not None:
        return
    doc = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/nodes")
    if as_json:
        print_json(doc)
        return
    if not doc["data"]:
        click.echo("no nodes have registered")
        return
    rows = []
    for node in doc["data"]:
        state = "draining" if node["draining"] else ("cordoned" if node["cordoned"] else "")
        gpus = node["gpus"]
        gpu_text = ", ".join(g.get("gpu_class") or g["name"] for g in gpus) if gpus else "-"
        bandwidth = node.get("memory_bandwidth_gbps") or 0
        reserved = node.get("reserved") or {}
        rows.append(
            [
                node["node_id"],
                node["address"],
                node.get("interface") or "-",
                "up" if node["connected"] else "DOWN",
                f"{reserved.get('cpu_cores', 0)}/{node['cpu_count']}",
                f"{reserved.get('memory_gb', 0.0):.1f}",
                f"{node['memory_available_mb'] / 1024:.1f}/{node['memory_total_mb'] / 1024:.1f}",
                f"{bandwidth:.0f}" if bandwidth else "-",
                gpu_text,
                ",".join(node["engines"]) or "-",
                state or "-",
                len(node["replicas"]),
            ]
        )
    click.echo(
        format_table(
            [
                "NODE",
                "ADDRESS",
                "IFACE",
                "LINK",
                "CORES RSVD/ALL",
                "MEM GB RSVD",
                "MEM GiB FREE/ALL",
                "GB/S",
                "GPUS",
                "ENGINES",
                "STATE",
                "REPLICAS",
            ],
            rows,
        )
    )


@ctl_nodes.command("remove")
@click.argument("node")
@data_dir_option()
@json_option()
def ctl_nodes_remove(node: str, data_dir: Path, as_json: bool) -> None:
    """Take NODE out of the cluster: revoke its certificate (its agent is
    refused from now on), stop its replicas' engines, close its link; its
    replicas are placed on the other nodes. A node not connected stops its
    engines when its agent next connects and is refused."""
    doc = AdminClient.from_data_dir(data_dir).call("DELETE", f"/api/v1/nodes/{path_part(node)}")
    if as_json:
        print_json(doc)
        return
    stopped = ", ".join(doc["stopped"]) or "none"
    click.echo(
        f"node {node} removed: {doc['revoked_certificates']} certificate(s) revoked; "
        f"replicas stopped there: {stopped}"
        + (
            ""
            if doc["was_connected"]
            else " (it was not connected: its agent stops the engines it still runs "
            "when it next connects and is refused)"
        )
    )


def _uptime(rep: dict[str, Any]) -> str:
    """How long a replica's engine has run (since its latest start), as
    ``42s``, ``5m``, ``3h``, ``2d``; ``-`` for none."""
    if not rep.get("started_at") or rep.get("state") not in ("STARTING", "READY"):
        return "-"
    return ago(rep["started_at"]).removesuffix(" ago")


def print_replicas(replicas: list[dict[str, Any]]) -> None:
    rows = []
    reasons = []
    for rep in replicas:
        state = rep["state"]
        if rep.get("retiring"):
            state += " (retiring)"
        elif not rep.get("wanted", True):
            state += " (stopping)"
        if rep.get("progress") and rep["state"].lower() == "starting":
            state += f" {rep['progress']}"
        rows.append(
            [
                rep["replica_id"],
                rep["model"],
                rep["node_id"],
                rep["port"],
                rep.get("pid") or "-",
                state,
                _uptime(rep),
                rep.get("restarts", 0),
                rep.get("compute") or "-",
                rep.get("profile") or "-",
                "stale" if rep.get("stale") else "",
                ago(rep.get("ready_at")),
            ]
        )
        if rep.get("reason"):
            reasons.append(f"{rep['replica_id']}: {rep['reason']}")
    click.echo(
        format_table(
            [
                "REPLICA",
                "MODEL",
                "NODE",
                "PORT",
                "PID",
                "STATE",
                "UP",
                "RESTARTS",
                "ON",
                "PROFILE",
                "STALE",
                "READY",
            ],
            rows,
        )
    )
    for line in reasons:
        click.echo(line)


@click.command("replicas")
@data_dir_option()
@json_option()
def ctl_replicas(data_dir: Path, as_json: bool) -> None:
    """Replicas: node, port, state (with why a failed one failed), restarts, compute."""
    doc = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/replicas")
    if as_json:
        print_json(doc)
        return
    if not doc["data"]:
        click.echo("no replicas")
        return
    print_replicas(doc["data"])


def _node_command(action: str, help_text: str) -> click.Command:
    @click.command(action, help=help_text)
    @click.argument("node")
    @data_dir_option()
    @json_option()
    def command(node: str, data_dir: Path, as_json: bool) -> None:
        doc = AdminClient.from_data_dir(data_dir).call(
            "POST", f"/api/v1/nodes/{path_part(node)}/{action}"
        )
        if as_json:
            print_json(doc)
            return
        state = (
            "draining (no new replicas; its replicas move away)"
            if doc["draining"]
            else ("cordoned (no new replicas)" if doc["cordoned"] else "open to new replicas")
        )
        click.echo(f"node {node}: {state}")
        if not doc["known"]:
            click.echo(f"note: no node {node!r} has registered (yet)", err=True)

    return command


#: ``ctl cordon``, ``ctl uncordon`` and ``ctl drain``.
node_commands = (
    _node_command("cordon", "Take no new replicas on NODE."),
    _node_command("uncordon", "Let NODE take replicas again (ends a cordon or a drain)."),
    _node_command("drain", "Cordon NODE and move its replicas away, each replacement first."),
)


@click.command("logs")
@click.argument("node", required=False, default="")
@click.option("--source", default="", help="A shard (replica) id; the agent's own log when empty.")
@click.option(
    "-n",
    "lines",
    default=200,
    show_default=True,
    type=click.IntRange(1, 2000),
    help="How many lines.",
)
@data_dir_option()
@json_option()
def ctl_logs(node: str, source: str, lines: int, data_dir: Path, as_json: bool) -> None:
    """The last lines of NODE's agent, or of one of its engines (--source)."""
    doc = AdminClient.from_data_dir(data_dir).call(
        "GET", "/api/v1/logs", params={"node": node, "source": source, "lines": lines}
    )
    if as_json:
        print_json(doc)
        return
    for line in doc["lines"]:
        click.echo(line)

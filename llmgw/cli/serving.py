"""``llmgw stop|start|status`` (and ``llmgw ctl status``): serving as a
whole, through the admin API (:mod:`llmgw.admin.system`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from llmgw.admin.client import AdminClient

from .options import data_dir_option, json_option, local_time, print_json

__all__ = ["ctl_status", "print_status", "start", "status", "stop"]


@click.command("stop")
@data_dir_option()
@json_option()
def stop(data_dir: Path, as_json: bool) -> None:
    """Stop serving: every model to zero replicas (GPUs freed), /v1 answers
    503 system_stopped; control planes, agents and models' definitions stay."""
    doc = AdminClient.from_data_dir(data_dir).call("POST", "/api/v1/system/stop")
    if as_json:
        print_json(doc)
    elif doc["changed"]:
        click.echo(
            "stopped: every model's replicas are stopping and /v1 answers 503 system_stopped; "
            "'llmgw start' brings them back"
        )
    else:
        click.echo("already stopped; 'llmgw start' brings the models back")


@click.command("start")
@data_dir_option()
@json_option()
def start(data_dir: Path, as_json: bool) -> None:
    """Serve again after 'llmgw stop': models come back at their counts."""
    doc = AdminClient.from_data_dir(data_dir).call("POST", "/api/v1/system/start")
    if as_json:
        print_json(doc)
    elif doc["changed"]:
        click.echo("started: models are coming back at their replica counts ('llmgw ctl models')")
    else:
        click.echo("already serving")


def print_status(doc: dict[str, Any]) -> None:
    """``ctl status`` for people: serving, leader, nodes, models, replicas."""
    serving = doc.get("serving", {})
    if serving.get("stopped"):
        click.echo("serving: STOPPED (every model at zero; 'llmgw start' to serve again)")
    else:
        click.echo("serving: yes")
    click.echo(f"leader: {'yes' if doc['leader'] else 'no'}")
    lead = doc.get("leadership") or {}
    if lead.get("holder"):
        since = f", since {local_time(lead['since'], zone=True)}" if lead.get("since") else ""
        where = "this control plane" if lead.get("here") else (lead.get("api") or "elsewhere")
        click.echo(f"leader lease: {lead['holder']} ({where}){since}")
    if doc.get("store"):
        click.echo(f"store: {doc['store']['kind']} {doc['store']['address']}".rstrip())
    for node in doc["nodes"]:
        link = "connected" if node["connected"] else "DISCONNECTED"
        click.echo(
            f"node {node['node_id']} ({node['address']}): {link}, {node['cpu_count']} CPUs, "
            f"{node['memory_total_mb'] / 1024:.1f} GiB memory, {node['gpus']} GPUs"
        )
    for model in doc.get("model_replicas", []):
        if model["external"]:
            state = "external"
        elif model["stopped"]:
            state = "stopped"
        else:
            state = f"{model['ready']}/{model['wanted']} ready"
            if model["starting"]:
                state += f", {model['starting']} starting"
            if model["failed"]:
                state += f", {model['failed']} FAILED"
        click.echo(f"model {model['name']}: {state}")
    for rep in doc["replicas"]:
        reason = f" — {rep['reason']}" if rep["reason"] else ""
        if rep.get("download"):
            from .weights import download_text

            reason += f" — {download_text(rep['download'])}"
        click.echo(
            f"replica {rep['replica_id']} on {rep['node_id']}:{rep['port']}: {rep['state']}{reason}"
        )


@click.command("status")
@data_dir_option()
@json_option()
def status(data_dir: Path, as_json: bool) -> None:
    """Serving or stopped, nodes, models and replicas (= llmgw ctl status)."""
    doc = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/status")
    if as_json:
        print_json(doc)
        return
    print_status(doc)


@click.command("status")
@data_dir_option()
@json_option()
def ctl_status(data_dir: Path, as_json: bool) -> None:
    """Serving or stopped, nodes, models (ready/wanted) and replicas."""
    doc = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/status")
    if as_json:
        print_json(doc)
        return
    print_status(doc)

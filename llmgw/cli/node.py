"""``llmgw node add``: a join code for a new machine, through the admin API
(``POST /api/v1/nodes/join-codes``, :mod:`llmgw.admin.join_codes`).

It prints the one line to run on the new machine, ``llmgw join CODE``
(``--json``: the API's answer). See ``docs/cluster.md``.
"""

from __future__ import annotations

from pathlib import Path

import click

from llmgw.admin.client import AdminClient
from llmgw.settings import parse_duration_s

from .options import data_dir_option, json_option, local_time, print_json

__all__ = ["node"]


@click.group("node")
def node() -> None:
    """Add machines to the cluster."""


def _labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise click.BadParameter(f"{part!r} is not NAME=VALUE", param_hint="--labels")
        labels[name.strip()] = value.strip()
    return labels


@node.command("add")
@click.option(
    "--expires",
    default="1h",
    show_default=True,
    help="How long the code works: 45s, 30m, 12h, 7d; from 1s to 30d (a bare number is seconds).",
)
@click.option("--labels", default="", help="Labels for the node: k=v,k2=v2.")
@click.option("--node-id", default="", help="The node's id (default: the new machine's host name).")
@data_dir_option()
@json_option()
def node_add(expires: str, labels: str, node_id: str, data_dir: Path, as_json: bool) -> None:
    """Print `llmgw join CODE`, to run on the new machine: the code works once."""
    from llmgw.control.join import MAX_CODE_EXPIRES_S

    try:
        expires_s = parse_duration_s(expires)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--expires") from None
    if not 1 <= expires_s <= MAX_CODE_EXPIRES_S:
        # Checked here, in the option's terms, not by the API ('expires_s').
        raise click.BadParameter(
            f"{expires!r}: --expires must be from 1s to {MAX_CODE_EXPIRES_S / 86400:.0f}d",
            param_hint="--expires",
        )
    doc = AdminClient.from_data_dir(data_dir).call(
        "POST",
        "/api/v1/nodes/join-codes",
        json={"expires_s": expires_s, "labels": _labels(labels), "node_id": node_id},
    )
    if as_json:
        print_json(doc)
        return
    click.echo(
        f"Run this on the new machine (works once, until "
        f"{local_time(doc['expires_at'], zone=True)}):",
        err=True,
    )
    click.echo(doc["command"])

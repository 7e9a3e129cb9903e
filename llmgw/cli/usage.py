"""``llmgw ctl usage [export]`` and ``ctl request``: usage rows and their
sums, through the admin API (:mod:`llmgw.admin.usage`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from llmgw.admin.client import AdminClient

from .options import (
    data_dir_option,
    json_option,
    local_time,
    local_zone,
    path_part,
    print_json,
    show_times,
)

__all__ = ["ctl_request", "ctl_usage"]


@click.group("usage", invoke_without_command=True)
@data_dir_option()
@click.option("--last", default=20, show_default=True, help="How many rows, newest first.")
@click.option("--key", "key_id", default=None, help="Only this key's rows.")
@click.option(
    "--by",
    type=click.Choice(["key", "project", "team", "org", "model"]),
    default=None,
    help="Sums by this instead of rows (from the roll-ups, kept for good).",
)
@click.option(
    "--since", default="24h", show_default=True, help="With --by: 24h, 30d, 365d, 2026-11-01 …"
)
@json_option()
@click.pass_context
def ctl_usage(
    ctx: click.Context,
    data_dir: Path,
    last: int,
    key_id: str | None,
    by: str | None,
    since: str,
    as_json: bool,
) -> None:
    """The newest usage rows, or sums --by key|project|team|org|model."""
    if ctx.invoked_subcommand is not None:
        return
    client = AdminClient.from_data_dir(data_dir)
    if by is not None:
        doc = client.call("GET", "/api/v1/usage/summary", params={"by": by, "since": since})
        if as_json:
            print_json(doc)
            return
        click.echo(f"{by:32}  requests  errors  prompt  cached  completion  cost")
        for row in doc["data"]:
            click.echo(
                f"{row['name'][:32]:32}  {row['requests']:8}  {row['errors']:6}  "
                f"{row['prompt_tokens']:6}  {row['cached_tokens']:6}  "
                f"{row['completion_tokens']:10}  {row['cost_micros'] / 1e6:.6f}"
            )
        return
    params: dict[str, Any] = {"last": last}
    if key_id:
        params["key_id"] = key_id
    doc = client.call("GET", "/api/v1/usage", params=params)
    if as_json:
        print_json(doc)
        return
    click.echo(
        f"{f'time ({local_zone()})':19}  {'request':28}  {'key':20}  {'model':16}  status  prompt  cached  compl  dur_ms  ttft_ms  guard"
    )
    for row in doc["data"]:
        when = local_time(row["created_at"])
        ttft = "" if row["ttft_ms"] is None else f"{row['ttft_ms']:.0f}"
        click.echo(
            f"{when:19}  {row['request_id']:28}  {row['key_id']:20}  {row['model'][:16]:16}  "
            f"{row['status']:6}  {row['prompt_tokens']:6}  {row['cached_tokens']:6}  "
            f"{row['completion_tokens']:5}  {row['duration_ms']:6.0f}  {ttft:>7}  "
            f"{_guard_cell(row)}"
        )


def _guard_cell(row: dict[str, Any]) -> str:
    """``block secret:aws_access_key``: the guard's action and rules, or ``-``."""
    action = row.get("guard_action") or ""
    return f"{action} {row.get('guard_rules') or ''}".strip() or "-"


@ctl_usage.command("export")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["csv", "jsonl"]),
    default="jsonl",
    show_default=True,
    help="CSV with a header line, or one JSON object a line.",
)
@click.option("--since", default="30d", show_default=True, help="24h, 30d, 2026-11-01 …")
@click.option("--until", default=None, help="Same forms as --since.")
@data_dir_option()
def ctl_usage_export(fmt: str, since: str, until: str | None, data_dir: Path) -> None:
    """Every usage row in the period, streamed to stdout as CSV or JSON lines.

    Raw rows are kept auth.usage_retain_days (default 90); older ones are
    only in the sums of `ctl usage --by`."""
    client = AdminClient.from_data_dir(data_dir)
    params = {"format": fmt, "since": since}
    if until:
        params["until"] = until
    client.stream("/api/v1/usage/export", params, sys.stdout.buffer)


@click.command("request")
@click.argument("request_id")
@data_dir_option()
@json_option()
def ctl_request(request_id: str, data_dir: Path, as_json: bool) -> None:
    """One request's usage row (the id is in every answer's x-request-id)."""
    doc = AdminClient.from_data_dir(data_dir).call(
        "GET", f"/api/v1/requests/{path_part(request_id)}"
    )
    if as_json:
        print_json(doc)
        return
    events = doc.pop("guard_events", None) or []
    for name, value in show_times(doc).items():
        click.echo(f"{name:18} {'-' if value is None or value == '' else value}")
    for event in events:
        click.echo(f"{'guard event':18} {event['direction']} {event['rule']} {event['action']}")

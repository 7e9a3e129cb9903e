"""``llmgw ctl config get|set|edit|history``: the cluster settings, through
the admin API (:mod:`llmgw.admin.config`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import yaml

from llmgw.admin.client import AdminClient, AdminRefused

from .options import (
    data_dir_option,
    format_table,
    json_option,
    local_time,
    local_zone,
    print_json,
)

__all__ = ["ctl_config", "lookup_key"]


def lookup_key(doc: Any, key: str) -> Any:
    """The value at the dotted ``key`` of ``doc``.

    Raises:
        click.ClickException: no such key.
    """
    value = doc
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise click.ClickException(f"no setting {key!r}")
        value = value[part]
    return value


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, sort_keys=False, default_flow_style=False).rstrip()


@click.group("config")
def ctl_config() -> None:
    """The cluster settings, live on every control plane within seconds."""


@ctl_config.command("get")
@click.argument("key", required=False)
@data_dir_option()
@json_option()
def config_get(key: str | None, data_dir: Path, as_json: bool) -> None:
    """The settings (YAML), or one dotted KEY like on_demand.evict_after_idle."""
    doc = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/config")
    value = lookup_key(doc["document"], key) if key else doc["document"]
    if as_json:
        print_json(value if key else doc)
        return
    if key and not isinstance(value, dict | list):
        click.echo(json.dumps(value) if value is None or isinstance(value, bool) else value)
        return
    if not key:
        click.echo(f"# settings version {doc['version']}")
    click.echo(_yaml(value))


@ctl_config.command("set")
@click.argument("key")
@click.argument("value")
@click.option("--note", default="", help="Why (kept in the history).")
@data_dir_option()
@json_option()
def config_set(key: str, value: str, note: str, data_dir: Path, as_json: bool) -> None:
    """Set the dotted KEY to VALUE, read as YAML: 30s, true, 5,
    '[{name: gold, priority: 300}]'."""
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"not YAML: {exc}", param_hint="VALUE") from None
    try:
        json.dumps(parsed, allow_nan=False)
    except ValueError:
        raise click.BadParameter(
            "not a finite value (NaN and infinity are refused)", param_hint="VALUE"
        ) from None
    body: dict[str, Any] = {"key": key, "value": parsed}
    if note:
        body["note"] = note
    doc = AdminClient.from_data_dir(data_dir).call("PATCH", "/api/v1/config", json=body)
    if as_json:
        print_json(doc)
        return
    now = lookup_key(doc["document"], key)
    shown = json.dumps(now) if not isinstance(now, str) else now
    if doc["changed"]:
        click.echo(f"{key} = {shown} (settings version {doc['version']})")
    else:
        click.echo(f"{key} is already {shown}")
    for later in doc.get("restart_needed", []):
        click.echo(f"note: {later} is read at start: it applies when llmgw next starts")


_EDIT_HEADER = """\
# llmgw cluster settings, version {version}. Save and close to apply on every
# control plane within seconds; close without saving to change nothing.
# Durations are seconds or like 30s, 5m, 12h. Lines starting with # are ignored.
"""


@ctl_config.command("edit")
@click.option("--note", default="", help="Why (kept in the history).")
@data_dir_option()
def config_edit(note: str, data_dir: Path) -> None:
    """Edit the settings as YAML in $EDITOR; validated before they are saved."""
    client = AdminClient.from_data_dir(data_dir)
    current = client.call("GET", "/api/v1/config")
    version = current["version"]
    text = _EDIT_HEADER.format(version=version) + _yaml(current["document"]) + "\n"
    original = text
    while True:
        edited = click.edit(text, extension=".yaml")
        if edited is None or edited == original:
            click.echo("no change")
            return
        problem = ""
        try:
            document = yaml.safe_load(edited)
        except yaml.YAMLError as exc:
            problem = f"not YAML: {exc}"
        else:
            if not isinstance(document, dict):
                problem = "the settings must be a mapping of blocks (auth:, serving:, …)"
        if not problem:
            body = {"document": document, "expected_version": version, "note": note or "edited"}
            try:
                doc = client.call("PUT", "/api/v1/config", json=body)
            except AdminRefused as exc:
                if exc.status == 409:
                    raise click.ClickException(
                        "the settings changed while you edited them; nothing saved. Run "
                        "'llmgw ctl config edit' again."
                    ) from None
                if exc.status != 400:
                    raise
                problem = exc.detail
            else:
                if doc["changed"]:
                    click.echo(f"saved: settings version {doc['version']}")
                else:
                    click.echo("no change")
                return
        if not click.confirm(f"{problem}\nEdit again?", default=True):
            raise click.ClickException("nothing saved")
        lines = [line for line in edited.splitlines() if not line.startswith("# ERROR")]
        error_lines = [f"# ERROR: {line}" for line in problem.splitlines()]
        text = "\n".join([*error_lines, *lines]) + "\n"


@ctl_config.command("history")
@click.option(
    "--last",
    type=click.IntRange(1, 1000),
    default=20,
    show_default=True,
    help="How many versions to show, newest first.",
)
@data_dir_option()
@json_option()
def config_history(last: int, data_dir: Path, as_json: bool) -> None:
    """Who changed the settings, when, and which keys."""
    doc = AdminClient.from_data_dir(data_dir).call(
        "GET", "/api/v1/config/history", params={"last": last}
    )
    if as_json:
        print_json(doc)
        return
    rows = [
        [
            change["version"],
            local_time(change["changed_at"]),
            change["actor"] or "-",
            ", ".join(change["changed"]) or "-",
            change["note"],
        ]
        for change in doc["data"]
    ]
    click.echo(format_table(["VERSION", f"WHEN ({local_zone()})", "WHO", "CHANGED", "NOTE"], rows))

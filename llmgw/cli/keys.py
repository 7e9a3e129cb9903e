"""``llmgw keys …``: client API keys, the tenancy tree, limits and the answer
cache per project, through the admin API (:mod:`llmgw.admin.keys`); and
``keys rotate-admin``, which replaces the admin token in the data directory
itself (:mod:`llmgw.auth.admin_token`), so it works with llmgw stopped too."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import click

from llmgw.admin.client import AdminClient
from llmgw.auth.admin_token import ADMIN_TOKEN_FILE, fingerprint, rotate_admin_token

from .options import (
    ago,
    data_dir_option,
    format_table,
    json_option,
    local_time,
    local_zone,
    path_part,
    print_json,
)

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """Client API keys (and `rotate-admin`: a new admin token)."""


@keys.command("create")
@click.argument("name")
@click.option(
    "--project",
    default=None,
    help="ORG/TEAM/PROJECT (made if missing); default/default/default if not given.",
)
@click.option("--person", default=None, help="A personal key of this sign-in address (no project).")
@click.option(
    "--expires", default=None, help="Life of the key: 30d, 12h … (capped by auth.max_key_ttl)."
)
@click.option(
    "--band",
    default="",
    help="Admission band, one of router.admission.bands (default router.admission.default_band).",
)
@data_dir_option()
@json_option()
def keys_create(
    name: str,
    project: str | None,
    person: str | None,
    expires: str | None,
    band: str,
    data_dir: Path,
    as_json: bool,
) -> None:
    """Make a key called NAME and print its secret (shown only this once)."""
    body: dict[str, Any] = {"name": name, "band": band}
    if project:
        body["project"] = project
    if person:
        body["person"] = person
    if expires:
        body["expires"] = expires
    doc = AdminClient.from_data_dir(data_dir).call("POST", "/api/v1/keys", json=body)
    if as_json:
        print_json(doc)
        return
    for level in doc.get("created", []):
        click.echo(f"created {level}", err=True)
    click.echo(doc["key"])
    click.echo(
        f"key {doc['id']} ({doc['name']}) of {doc['project'] or doc['person']}: keep the "
        "secret above; "
        "it is not shown again",
        err=True,
    )


@keys.command("rotate")
@click.argument("key_id")
@data_dir_option()
@json_option()
def keys_rotate(key_id: str, data_dir: Path, as_json: bool) -> None:
    """Give KEY_ID a new secret (printed once); the old one is refused at once."""
    doc = AdminClient.from_data_dir(data_dir).call(
        "POST", f"/api/v1/keys/{path_part(key_id)}/rotate"
    )
    if as_json:
        print_json(doc)
        return
    click.echo(doc["key"])


@keys.command("rotate-admin")
@data_dir_option()
@json_option()
def keys_rotate_admin(data_dir: Path, as_json: bool) -> None:
    """Replace the admin token (DATA_DIR/admin-token, mode 0600) with a new one.

    The admin API refuses the old token from its next call; `llmgw keys` and
    `llmgw ctl` read the new one from the file. The token is not printed.
    """
    path = data_dir / ADMIN_TOKEN_FILE
    token = rotate_admin_token(path)
    if as_json:
        print_json({"path": str(path), "fingerprint": fingerprint(token)})
        return
    click.echo(
        f"admin token rotated: the new one ({fingerprint(token)}) is in {path}; "
        "the old one is refused from now on"
    )


@keys.command("init")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@data_dir_option()
@json_option()
def keys_init(file: Path, data_dir: Path, as_json: bool) -> None:
    """Provision the tree (and keys) in FILE (YAML); running it again changes nothing.

    \b
    orgs:
      - name: Acme
        limits: {rpm: 600, budget_month: 500}
        teams:
          - name: ml
            projects:
              - name: train
                limits: {rpm: 60, models: [gemma-3-270m]}
                keys: [{name: ci-bot, band: bulk}]
    """
    import yaml

    try:
        tree = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise click.ClickException(f"{file}: {exc}") from exc
    doc = AdminClient.from_data_dir(data_dir).call("POST", "/api/v1/tree", json=tree)
    if as_json:
        print_json(doc)
        return
    for level in doc["created"]:
        click.echo(f"created {level}")
    for key in doc["keys"]:
        click.echo(f"key {key['name']} in {key['project']}: {key['key']}")
    if not doc["created"] and not doc["keys"]:
        click.echo("nothing to do: the tree is already as the file says")


@keys.command("limits")
@click.option(
    "--scope",
    type=click.Choice(["org", "team", "project", "key"]),
    required=True,
    help="The level of the tree whose limits change; --id names it.",
)
@click.option("--id", "ident", required=True, help="ORG, ORG/TEAM, ORG/TEAM/PROJECT or a key id.")
@click.option("--rpm", default=None, help="Requests a minute ('none' clears).")
@click.option("--tpm", default=None, help="Tokens a minute ('none' clears).")
@click.option(
    "--budget",
    default=None,
    help="AMOUNT/day or AMOUNT/month in currency units ('none/month' clears).",
)
@click.option(
    "--models",
    default=None,
    help="Comma-separated models of the catalog allowed ('none' inherits).",
)
@data_dir_option()
@json_option()
def keys_limits(
    scope: str,
    ident: str,
    rpm: str | None,
    tpm: str | None,
    budget: str | None,
    models: str | None,
    data_dir: Path,
    as_json: bool,
) -> None:
    """Set limits at one level of the tree; each level only narrows the ones above."""
    body: dict[str, Any] = {}
    for name, value in (("rpm", rpm), ("tpm", tpm)):
        if value is not None:
            if value.lower() == "none":
                body[name] = None
            elif value.isdigit():
                body[name] = int(value)
            else:
                raise click.BadParameter(
                    f"{value!r}: a whole number or 'none'", param_hint=f"--{name}"
                )
    if budget is not None:
        amount, _, period = budget.partition("/")
        if period not in ("day", "month"):
            raise click.BadParameter(
                f"{budget!r}: AMOUNT/day or AMOUNT/month", param_hint="--budget"
            )
        body[f"budget_{period}"] = None if amount.lower() == "none" else amount
    if models is not None:
        body["models"] = (
            None
            if models.lower() == "none"
            else [m.strip() for m in models.split(",") if m.strip()]
        )
    if not body:
        raise click.UsageError("give at least one of --rpm, --tpm, --budget, --models")
    doc = AdminClient.from_data_dir(data_dir).call(
        "PUT", f"/api/v1/limits/{scope}/{quote(ident.strip('/'), safe='/')}", json=body
    )
    if as_json:
        print_json(doc)
        return
    limits = ", ".join(f"{k} {v}" for k, v in doc["limits"].items() if v is not None) or "none"
    click.echo(f"{scope} {ident}: {limits}")


@keys.command("cache")
@click.option("--project", required=True, help="ORG/TEAM/PROJECT whose answers are cached.")
@click.option(
    "--ttl", default=None, help="How long an answer is reused: 30m, 24h, … (default 24h)."
)
@click.option("--off", is_flag=True, help="Stop caching this project's answers.")
@data_dir_option()
@json_option()
def keys_cache(project: str, ttl: str | None, off: bool, data_dir: Path, as_json: bool) -> None:
    """Turn the exact answer cache on (or --off) for a project's keys.

    Answers are kept in the gateway's memory only, up to router.cache.max_bytes;
    a repeated request is answered from it, free, with x-llmgw-cache: hit.
    """
    if off and ttl is not None:
        raise click.UsageError("give --ttl or --off, not both")
    path = f"/api/v1/projects/{quote(project.strip('/'), safe='/')}/cache"
    client = AdminClient.from_data_dir(data_dir)
    doc = (
        client.call("DELETE", path) if off else client.call("PUT", path, json={"ttl": ttl or "24h"})
    )
    if as_json:
        print_json(doc)
        return
    if doc["cache"]:
        click.echo(f"{doc['project']}: answers cached for {doc['ttl_s']:g} s")
    else:
        click.echo(f"{doc['project']}: answer cache off")


@keys.command("list")
@data_dir_option()
@json_option()
def keys_list(data_dir: Path, as_json: bool) -> None:
    """List keys (never their secrets)."""
    doc = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/keys")
    if as_json:
        print_json(doc)
        return
    rows = []
    for key in doc["data"]:
        state = "revoked" if key["revoked_at"] else "live"
        if key["is_admin"]:
            state += " admin"
        rows.append(
            [
                key["id"],
                f"{key['prefix']}…",
                key["name"],
                key.get("project") or "-",
                key.get("person") or "-",
                key.get("band") or "-",
                state,
                local_time(key.get("created_at"))[:16],
                local_time(key.get("expires_at"))[:16],
                ago(key.get("last_used_at")) if key.get("last_used_at") else "never",
            ]
        )
    zone = local_zone()
    headers = ["ID", "PREFIX", "NAME", "PROJECT", "OWNER", "BAND", "STATE"]
    click.echo(format_table([*headers, f"CREATED ({zone})", f"EXPIRES ({zone})", "LAST USE"], rows))


@keys.command("revoke")
@click.argument("key_id")
@data_dir_option()
def keys_revoke(key_id: str, data_dir: Path) -> None:
    """Revoke the key KEY_ID; it is refused at once."""
    AdminClient.from_data_dir(data_dir).call("POST", f"/api/v1/keys/{path_part(key_id)}/revoke")
    click.echo(f"revoked {key_id}")

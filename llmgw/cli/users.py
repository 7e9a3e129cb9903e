"""``llmgw users …``: people who sign in to the portal (``docs/portal.md``),
through the admin API (:mod:`llmgw.admin.people`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from llmgw.admin.client import AdminClient

from .options import data_dir_option, json_option, path_part, print_json

__all__ = ["users"]


@click.group()
def users() -> None:
    """People: accounts, staff roles, states, passwords, memberships."""


def _show(doc: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(doc)
        return
    where = ", ".join(
        f"{m['role']} of {m['scope']} {m['path']}" for m in doc.get("memberships", [])
    )
    role = doc.get("role") or "-"
    click.echo(f"{doc['email']}  {doc['state']}  staff role {role}  {where or 'no memberships'}")
    if "password" in doc:
        click.echo(doc["password"])
        click.echo("the password above is shown only this once", err=True)


def _call(data_dir: Path, method: str, path: str, **kwargs: Any) -> Any:
    return AdminClient.from_data_dir(data_dir).call(method, path, **kwargs)


@users.command("list")
@data_dir_option()
@json_option()
def users_list(data_dir: Path, as_json: bool) -> None:
    """Every person."""
    doc = _call(data_dir, "GET", "/api/v1/people")
    if as_json:
        print_json(doc)
        return
    for person in doc["data"]:
        _show(person, False)


@users.command("join")
@click.argument("email")
@click.option("--name", default="", help="A display name.")
@click.option("--project", default=None, help="ORG/TEAM/PROJECT to join (made if missing).")
@click.option("--team", default=None, help="ORG/TEAM to join.")
@click.option("--org", default=None, help="ORG to join.")
@click.option(
    "--member-role",
    type=click.Choice(["member", "manager"]),
    default="member",
    show_default=True,
    help="Their role in that org, team or project.",
)
@click.option(
    "--role",
    type=click.Choice(["", "viewer", "operator", "billing", "admin"]),
    default="",
    help="A staff role on /admin (none by default).",
)
@click.option(
    "--password", default=None, help="Their password (else one is made and printed once)."
)
@click.option("--awaiting", is_flag=True, help="Make the account awaiting approval.")
@data_dir_option()
@json_option()
def users_join(
    email: str,
    name: str,
    project: str | None,
    team: str | None,
    org: str | None,
    member_role: str,
    role: str,
    password: str | None,
    awaiting: bool,
    data_dir: Path,
    as_json: bool,
) -> None:
    """Make an account for EMAIL, optionally in an org, team or project."""
    body: dict[str, Any] = {"email": email, "name": name, "role": role, "member_role": member_role}
    for field, value in (
        ("project", project),
        ("team", team),
        ("org", org),
        ("password", password),
    ):
        if value is not None:
            body[field] = value
    if awaiting:
        body["state"] = "awaiting"
    _show(_call(data_dir, "POST", "/api/v1/people", json=body), as_json)


@users.command("role")
@click.argument("who")
@click.argument("role", type=click.Choice(["none", "viewer", "operator", "billing", "admin"]))
@data_dir_option()
@json_option()
def users_role(who: str, role: str, data_dir: Path, as_json: bool) -> None:
    """Set WHO's staff role (none takes it away)."""
    body = {"role": "" if role == "none" else role}
    _show(_call(data_dir, "POST", f"/api/v1/people/{path_part(who)}/role", json=body), as_json)


def _state_command(verb: str, help_text: str) -> None:
    @users.command(verb, help=help_text)
    @click.argument("who")
    @data_dir_option()
    @json_option()
    def command(who: str, data_dir: Path, as_json: bool) -> None:
        _show(_call(data_dir, "POST", f"/api/v1/people/{path_part(who)}/{verb}"), as_json)


_state_command("approve", "Approve WHO's account (awaiting approval → active).")
_state_command("suspend", "Suspend WHO: their sessions end at once.")
_state_command("reinstate", "Make a suspended account active again.")


@users.command("password")
@click.argument("who")
@click.option(
    "--password", default=None, help="The new password (else one is made and printed once)."
)
@data_dir_option()
@json_option()
def users_password(who: str, password: str | None, data_dir: Path, as_json: bool) -> None:
    """Set WHO's password; their sessions end."""
    body = {} if password is None else {"password": password}
    _show(_call(data_dir, "POST", f"/api/v1/people/{path_part(who)}/password", json=body), as_json)


@users.command("delete")
@click.argument("who")
@data_dir_option()
@json_option()
def users_delete(who: str, data_dir: Path, as_json: bool) -> None:
    """Delete WHO's account (their keys stay)."""
    doc = _call(data_dir, "DELETE", f"/api/v1/people/{path_part(who)}")
    if as_json:
        print_json(doc)
    else:
        click.echo(f"deleted {doc['id']}")


@users.command("forget")
@click.argument("who")
@data_dir_option()
@json_option()
def users_forget(who: str, data_dir: Path, as_json: bool) -> None:
    """Erase WHO's personal data; their keys are revoked and their usage kept
    under an anonymous id."""
    doc = _call(data_dir, "POST", f"/api/v1/people/{path_part(who)}/forget")
    if as_json:
        print_json(doc)
    else:
        click.echo(f"forgotten; usage kept under {doc['anonymous_id']}")

"""What the ``llmgw`` commands share: the ``--data-dir`` and ``--json``
options, and how answers are printed (JSON, tables, times)."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import click

from llmgw.console.format import table

__all__ = [
    "DEFAULT_DATA_DIR",
    "ago",
    "data_dir_option",
    "format_table",
    "json_option",
    "local_time",
    "local_zone",
    "path_part",
    "print_json",
    "show_times",
    "store_option",
    "utc_time",
]

#: Where the store, weights and admin token live unless ``--data-dir`` or
#: ``$LLMGW_DATA_DIR`` says otherwise.
DEFAULT_DATA_DIR = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "llmgw"

F = TypeVar("F", bound=Callable[..., Any])


def data_dir_option(
    help: str = "Where the store, weights and admin token live.",
) -> Callable[[F], F]:
    """``--data-dir`` (passed as ``data_dir``, a :class:`~pathlib.Path`)."""
    return click.option(
        "--data-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=lambda: Path(os.environ.get("LLMGW_DATA_DIR", str(DEFAULT_DATA_DIR))),
        show_default="$LLMGW_DATA_DIR or ~/.local/share/llmgw",
        help=help,
    )


def store_option() -> Callable[[F], F]:
    """``--store ADDRESS`` (passed as ``store``, ``None`` when not given):
    the store, ``$LLMGW_STORE`` by default. A PostgreSQL address given on
    the command line must not hold a password (``ps`` shows it); checked
    by :func:`checked_store`."""
    return click.option(
        "--store",
        "store",
        envvar="LLMGW_STORE",
        default=None,
        metavar="ADDRESS",
        help="The store: postgresql://USER@HOST[,HOST2…]/DB or a libpq DSN for several "
        "control planes on one PostgreSQL (password in ~/.pgpass, PGPASSFILE or PGPASSWORD, "
        "or the whole address in $LLMGW_STORE), or a SQLite file. Default: SQLite in "
        "DATA_DIR/llmgw.db.",
    )


def checked_store(store: str | None) -> str | None:
    """The ``--store`` value, refused (``click.BadParameter``) when it is
    not an address the store reads, or when it came from the command line
    with a password in it."""
    if store is None:
        return None
    from llmgw.app.process import check_store_address

    source = click.get_current_context().get_parameter_source("store")
    try:
        text = check_store_address(store)
    except ValueError as exc:
        if source is click.core.ParameterSource.ENVIRONMENT and "password" in str(exc):
            return store.strip()
        raise click.BadParameter(str(exc), param_hint="--store") from None
    return text


def json_option() -> Callable[[F], F]:
    """``--json`` (passed as ``as_json``): print the answer as JSON."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def print_json(doc: Any) -> None:
    """``doc`` as indented JSON, keys sorted, on stdout."""
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


def path_part(name: str) -> str:
    """``name`` quoted to be one segment of an admin API path."""
    return quote(name, safe="")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart; the last column
    is not padded. ``None`` prints as ``-``. The console's tables, as one
    text (:func:`llmgw.console.format.table`)."""
    return "\n".join(table(headers, rows))


def ago(at: float | None) -> str:
    """How long ago the epoch time ``at`` was (``42s ago``, ``5m ago``, …);
    ``-`` for none."""
    if not at:
        return "-"
    seconds = max(0.0, dt.datetime.now(dt.UTC).timestamp() - at)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


def local_zone() -> str:
    """This machine's time zone as times are shown (``CET``, ``UTC``)."""
    return dt.datetime.now().astimezone().strftime("%Z")


def local_time(at: float | None, *, zone: bool = False) -> str:
    """The epoch time ``at`` (seconds) as a local date, ``YYYY-MM-DD
    HH:MM:SS`` (with the zone, ``… CET``, when ``zone``); ``-`` for none.
    Tables name the zone once, in their header (:func:`local_zone`)."""
    if at is None or isinstance(at, bool) or not isinstance(at, int | float):
        return "-"
    when = dt.datetime.fromtimestamp(at).astimezone()
    return when.strftime("%Y-%m-%d %H:%M:%S %Z" if zone else "%Y-%m-%d %H:%M:%S")


def show_times(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its epoch times (keys ending ``_at``) as local dates with
    their zone, for a detail view; ``--json`` keeps the numbers."""
    return {
        name: local_time(value, zone=True) if name.endswith("_at") else value
        for name, value in doc.items()
    }


def utc_time(at: float) -> str:
    """The epoch time ``at`` as ``YYYY-MM-DD HH:MM:SS`` (UTC)."""
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")

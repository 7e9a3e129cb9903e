"""``llmgw doctor``: check this node, one line per check with its fix.

The checks are :mod:`llmgw.agent.doctor`'s; this module finds what to check
(the weights directory, the control planes and the node's TLS files from
``--server`` or ``agent.yaml``), prints the lines (or ``--json``) and exits
1 when a check failed. ``docs/doctor.md`` says what each line means.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import click

from .options import data_dir_option, json_option, print_json

if TYPE_CHECKING:
    from llmgw.agent.doctor import CheckResult

__all__ = ["doctor", "format_results"]

_LABELS = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}


@attrs.frozen
class _NodeFiles:
    """What doctor needs from ``agent.yaml``: the control planes' agent URLs
    and the node's TLS files (absolute, or ``None`` when not named)."""

    servers: tuple[str, ...] = ()
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None


def _read_agent_yaml(path: Path) -> _NodeFiles:
    """``servers`` and ``tls`` of the ``agent.yaml`` at ``path``, read by
    :func:`llmgw.agent.config.load_agent_yaml` (paths resolved against the
    file's folder).

    Raises:
        click.ClickException: the file cannot be read or is not a valid
            agent.yaml (the loader's message, naming the key at fault).
    """
    from llmgw.agent.config import AgentFileError, load_agent_yaml

    try:
        found = load_agent_yaml(path)
    except (OSError, AgentFileError) as exc:
        raise click.ClickException(str(exc)) from None
    return _NodeFiles(found.servers, found.tls.ca, found.tls.cert, found.tls.key)


def _default_files(data_dir: Path) -> _NodeFiles:
    """The TLS files ``llmgw join`` writes under ``data_dir``, those that exist."""
    tls = data_dir / "tls"
    ca = tls / "ca.crt"
    cert, key = tls / "node.crt", tls / "node.key"
    both = cert.is_file() and key.is_file()
    return _NodeFiles(
        (), ca if ca.is_file() else None, cert if both else None, key if both else None
    )


def format_results(results: Sequence[CheckResult]) -> str:
    """One line per check, ``ok   cpu     …``, the fix of a warning or a
    failure on the next line, indented."""
    width = max((len(r.name) for r in results), default=0) + 2
    lines = []
    for result in results:
        lines.append(f"{_LABELS[result.status]:<5}{result.name:<{width}}{result.found}")
        if result.fix:
            lines.append(f"{'':<5}{'':<{width}}fix: {result.fix}")
    return "\n".join(lines)


@click.command("doctor")
@data_dir_option()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The node's agent.yaml (default: DATA_DIR/agent.yaml when it exists).",
)
@click.option(
    "--server",
    "servers",
    multiple=True,
    metavar="HOST[:PORT]",
    help="A control plane to check, PORT its agent port (default 7443); repeatable. "
    "Default: agent.yaml's servers.",
)
@click.option(
    "--join-port",
    type=click.IntRange(1, 65535),
    default=7444,
    show_default=True,
    help="The control planes' join port (HTTPS, also the clock check).",
)
@json_option()
def doctor(
    data_dir: Path,
    config_path: Path | None,
    servers: tuple[str, ...],
    join_port: int,
    as_json: bool,
) -> None:
    """Check this node: CPUs, memory, GPUs and driver, disk for weights, the
    control plane on its agent and join ports, the clock. Exit status 1 when
    a check failed."""
    import logging

    import trio

    from llmgw import errors
    from llmgw.agent.doctor import DoctorConfig, parse_control_plane, run_doctor

    if config_path is None and (data_dir / "agent.yaml").is_file():
        config_path = data_dir / "agent.yaml"
    files = _read_agent_yaml(config_path) if config_path is not None else _default_files(data_dir)
    addresses = servers or files.servers
    try:
        planes = tuple(parse_control_plane(text, join_port=join_port) for text in addresses)
    except errors.InvalidInput as exc:
        hint = "--server" if servers else str(config_path)
        raise click.BadParameter(str(exc), param_hint=hint) from None
    config = DoctorConfig(
        weights_dir=data_dir / "weights",
        control_planes=planes,
        ca_file=files.ca,
        cert_file=files.cert,
        key_file=files.key,
    )
    # The gpu line says what discovery would log ("no NVIDIA cards: …").
    logging.getLogger("llmgw.agent.discovery").setLevel(logging.WARNING)
    results = trio.run(run_doctor, config)
    if as_json:
        print_json([attrs.asdict(result) for result in results])
    else:
        click.echo(format_results(results))
    if any(result.status == "fail" for result in results):
        click.get_current_context().exit(1)

"""``llmgw console`` (and ``llmgw`` with no arguments): the operator's
console on this machine's control plane, or with ``--node`` the node console
(``docs/console.md``).

- ``llmgw console [--data-dir DIR] [--refresh S]``: the admin API found as
  the other clients find it (``DATA_DIR/admin-token``, ``run.json``);
- ``llmgw console --node [--socket PATH | --config agent.yaml]``: the agent's
  status socket, ``STATE_DIR/agent.sock``; needs neither the admin token nor
  a control plane.

``llmgw`` alone opens the console when the data directory holds an admin
token, else the node console when an agent's status socket is found, else
prints the help (:func:`choose`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

import click
import yaml

from llmgw.admin.client import AsyncAdminClient
from llmgw.agent.status_socket import STATUS_SOCKET
from llmgw.auth.admin_token import ADMIN_TOKEN_FILE

from .options import data_dir_option

__all__ = ["choose", "console", "find_socket", "plan_text"]

#: Where an installed node keeps its agent.yaml.
AGENT_YAML = Path("/etc/llmgw/agent.yaml")


def plan_text(source: str, context_tokens: int, nodes: list[dict[str, Any]]) -> str | None:
    """The planner's table (``ctl model plan``) for the Serve form, when
    ``source`` is a file or folder on this machine; None otherwise.

    Raises:
        ValueError: the planner cannot read it.
        OSError: it cannot be read.
    """
    path = Path(source).expanduser()
    if not path.exists():
        return None
    from llmgw.cli.plan_format import format_plan
    from llmgw.control.planning import PlanNode, plan, read_model_facts

    plan_nodes = []
    for n in nodes:
        fields: dict[str, Any] = {
            "node_id": n["node_id"],
            "cpu_count": n["cpu_count"],
            "memory_total_mb": n["memory_total_mb"],
            "memory_bandwidth_gbps": n.get("memory_bandwidth_gbps", 0.0),
            "core_bandwidth_gbps": n.get("core_bandwidth_gbps", 0.0),
            "gpus": [(str(g.get("gpu_class", "")), int(g["memory_total_mb"])) for g in n["gpus"]],
        }
        plan_nodes.append(PlanNode(**fields))
    return format_plan(plan(read_model_facts(path), plan_nodes, context_tokens=context_tokens))


def find_socket(data_dir: Path, config: Path | None = None) -> Path | None:
    """The agent's status socket on this machine: the state directory of
    ``config`` (or of ``/etc/llmgw/agent.yaml``), else ``llmgw up``'s agent
    in ``data_dir``; None when none exists."""
    candidates = []
    for yaml_path in (config, AGENT_YAML):
        if yaml_path is not None and yaml_path.exists():
            # Only its state_dir (docs/cluster.md, "The agent's file"): the
            # rest (TLS files readable by root only) is not needed here.
            try:
                doc = yaml.safe_load(yaml_path.read_text()) or {}
            except (OSError, yaml.YAMLError):
                continue
            state_dir = doc.get("state_dir") if isinstance(doc, dict) else None
            folder = yaml_path.resolve().parent
            state = (
                folder / state_dir if isinstance(state_dir, str) and state_dir else folder / "agent"
            )
            candidates.append(state / STATUS_SOCKET)
    candidates.append(data_dir / "agent" / STATUS_SOCKET)
    return next((c for c in candidates if c.exists()), None)


def choose(data_dir: Path) -> Literal["console", "node", "help"]:
    """What ``llmgw`` alone opens here: the console when ``data_dir`` holds
    an admin token (a control plane's machine), the node console when an
    agent's status socket is found, else the help."""
    if (data_dir / ADMIN_TOKEN_FILE).exists():
        return "console"
    if find_socket(data_dir) is not None:
        return "node"
    return "help"


def _docs_dir() -> Path | None:
    """The manual: ``docs/`` of the source tree llmgw runs from, if any."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "docs" / "architecture.md").exists():
            return parent / "docs"
    return None


def run_console(data_dir: Path, refresh_s: float) -> None:
    """The operator's console on ``data_dir``'s control plane, in this terminal."""
    from llmgw.console.app import REFRESH_CALL_TIMEOUT_S, run_console

    client = AsyncAdminClient.from_data_dir(data_dir, timeout_s=REFRESH_CALL_TIMEOUT_S)
    asyncio.run(run_console(client, docs_dir=_docs_dir(), plan_text=plan_text, refresh_s=refresh_s))


def run_node_console(socket_path: Path, config: Path | None = None) -> None:
    """The node console on ``socket_path``, in this terminal; its agent.yaml
    view shows ``config`` (else ``/etc/llmgw/agent.yaml`` when there is one)."""
    from llmgw.console.node import NodeConsole

    agent_yaml = config or (AGENT_YAML if AGENT_YAML.exists() else None)
    asyncio.run(NodeConsole(socket_path, agent_yaml=agent_yaml, docs_dir=_docs_dir()).run())


@click.command("console")
@click.option("--node", "node", is_flag=True, help="The node console: this node's agent only.")
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(path_type=Path),
    default=None,
    help="The agent's status socket (with --node; default: found from agent.yaml).",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The agent's agent.yaml (with --node).",
)
@click.option(
    "--refresh",
    "refresh_s",
    type=click.FloatRange(1.0, 3.0),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@data_dir_option()
def console(
    node: bool, socket_path: Path | None, config: Path | None, refresh_s: float, data_dir: Path
) -> None:
    """The operator's console (full screen; q quits)."""
    if node:
        found = socket_path or find_socket(data_dir, config)
        if found is None:
            raise click.ClickException(
                f"no agent's status socket found ({STATUS_SOCKET} in the agent's state "
                "directory): is `llmgw agent` running here? Give it with --socket."
            )
        run_node_console(found, config)
        return
    run_console(data_dir, refresh_s)

"""``llmgw ctl`` commands that steer the cluster, and ``llmgw stop|start|status``.

Each is a client of the admin API (:mod:`llmgw.admin.control_api`), prints a
readable table or sentence, or the API's JSON with ``--json``. Errors from
the API are printed as ``llmgw: error: <status>: <message>`` with exit
status 1 (click's ``ClickException``).

The commands attach themselves to the ``cli`` and ``ctl`` groups of
:mod:`llmgw.cli.main` when this module is imported (main imports it last).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import click
import yaml

from .main import AdminClient, AdminError, _data_dir_option, _print_json, cli, ctl

__all__ = ["entry_from_flags", "format_table", "lookup_key"]

F = TypeVar("F", bound=Callable[..., Any])


def _json_option() -> Callable[[F], F]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def _q(name: str) -> str:
    return quote(name, safe="")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart; the last column
    is not padded. ``None`` prints as ``-``."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for at, cell in enumerate(row):
            widths[at] = max(widths[at], len(cell))
    lines = []
    for row in [list(headers), *cells]:
        padded = [cell.ljust(widths[at]) for at, cell in enumerate(row[:-1])]
        lines.append("  ".join([*padded, row[-1]]).rstrip())
    return "\n".join(lines)


def _ago(at: float | None) -> str:
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


def _when(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


# --- whole system -------------------------------------------------------------------


@cli.command("stop")
@_data_dir_option()
@_json_option()
def system_stop(data_dir: Path, as_json: bool) -> None:
    """Stop serving: every model to zero replicas (GPUs freed), /v1 answers
    503 system_stopped; control planes, agents and models' definitions stay."""
    doc = AdminClient(data_dir).call("POST", "/api/v1/system/stop")
    if as_json:
        _print_json(doc)
    elif doc["changed"]:
        click.echo(
            "stopped: every model's replicas are stopping and /v1 answers 503 system_stopped; "
            "'llmgw start' brings them back"
        )
    else:
        click.echo("already stopped; 'llmgw start' brings the models back")


@cli.command("start")
@_data_dir_option()
@_json_option()
def system_start(data_dir: Path, as_json: bool) -> None:
    """Serve again after 'llmgw stop': models come back at their counts."""
    doc = AdminClient(data_dir).call("POST", "/api/v1/system/start")
    if as_json:
        _print_json(doc)
    elif doc["changed"]:
        click.echo("started: models are coming back at their replica counts ('llmgw ctl models')")
    else:
        click.echo("already serving")


# --- models -------------------------------------------------------------------------


def _model_state(view: dict[str, Any], system_stopped: bool = False) -> str:
    if view["external"]:
        return "external"
    if view["stopped"]:
        return "stopped"
    if system_stopped:
        return "system stopped"
    return "on-demand" if view["on_demand"] else "running"


def _print_models(views: list[dict[str, Any]], system_stopped: bool) -> None:
    rows = []
    for view in views:
        counts = view["replicas"]
        entry = view["entry"]
        rows.append(
            [
                view["name"],
                view["engine"],
                _model_state(view, system_stopped),
                f"{counts['ready']}/{counts['wanted']}",
                counts["starting"] or "",
                counts["failed"] or "",
                ", ".join(entry.get("aliases", [])),
            ]
        )
    click.echo(
        format_table(["MODEL", "ENGINE", "STATE", "READY", "STARTING", "FAILED", "ALIASES"], rows)
    )
    for view in views:
        for replica_id, reason in view.get("waiting", {}).items():
            click.echo(f"{replica_id} not placed: {reason}")


@ctl.command("models")
@_data_dir_option()
@_json_option()
def ctl_models(data_dir: Path, as_json: bool) -> None:
    """The catalog: each model with its ready and wanted replicas."""
    client = AdminClient(data_dir)
    doc = client.call("GET", "/api/v1/models")
    if as_json:
        _print_json(doc)
        return
    if not doc["data"]:
        click.echo("no models; add one with 'llmgw ctl model add'")
        return
    stopped = client.call("GET", "/api/v1/status").get("serving", {}).get("stopped", False)
    _print_models(doc["data"], stopped)
    if stopped:
        click.echo("serving is stopped ('llmgw start' to serve again)")


@ctl.group("model")
def ctl_model() -> None:
    """Add, show, scale, stop, start, remove, resize and plan models."""


def entry_from_flags(
    name: str,
    *,
    engine: str,
    source: str | None = None,
    replicas: int | None = None,
    context: int | None = None,
    slots: int | None = None,
    cpu_cores: int | None = None,
    min_memory_gb: float | None = None,
    on_demand: bool = False,
    aliases: Sequence[str] = (),
    args: Sequence[str] = (),
) -> dict[str, Any]:
    """The catalog entry ``ctl model add NAME --engine E …`` sends: one
    profile named ``default``; options not given are left to the defaults.
    A ``source`` that is a local path is made absolute."""
    profile: dict[str, Any] = {"name": "default", "engine": engine}
    for key, value in (
        ("replicas", replicas),
        ("context_tokens", context),
        ("slots", slots),
        ("cpu_cores", cpu_cores),
        ("min_memory_gb", min_memory_gb),
    ):
        if value is not None:
            profile[key] = value
    if args:
        profile["args"] = list(args)
    entry: dict[str, Any] = {"name": name, "profiles": [profile]}
    if source:
        local = "://" not in source and not source.startswith(("hf:", "external"))
        entry["source"] = str(Path(source).expanduser().resolve()) if local else source
    if on_demand:
        entry["on_demand"] = True
    if aliases:
        entry["aliases"] = list(aliases)
    return entry


def _read_entries(file: Path) -> list[dict[str, Any]]:
    try:
        doc = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise click.ClickException(f"{file}: {exc}") from exc
    if isinstance(doc, dict) and isinstance(doc.get("models"), list):
        doc = doc["models"]
    entries = doc if isinstance(doc, list) else [doc]
    if not entries or not all(isinstance(e, dict) for e in entries):
        raise click.ClickException(
            f"{file}: expected a catalog entry (a mapping with 'name'), or a list of them"
        )
    return entries


def _say_model(view: dict[str, Any], verb: str) -> None:
    counts = view["replicas"]
    click.echo(
        f"{verb} {view['name']} ({view['engine']}): {_model_state(view)}, "
        f"{counts['ready']}/{counts['wanted']} replicas ready"
    )


@ctl_model.command("add")
@click.argument("name", required=False)
@click.option(
    "-f",
    "--file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A catalog entry (or a list of them) in YAML or JSON.",
)
@click.option("--engine", default=None, help="llamacpp, sim, vllm, …")
@click.option("--source", default=None, help="The weights: a path, hf:org/repo/file, a URL.")
@click.option("--replicas", type=click.IntRange(0), default=None, help="Replicas wanted.")
@click.option("--context", type=click.IntRange(1), default=None, help="Context tokens.")
@click.option("--slots", type=click.IntRange(1), default=None, help="Parallel sequences.")
@click.option("--cpu-cores", type=click.IntRange(0), default=None, help="Cores to reserve.")
@click.option("--min-memory-gb", type=float, default=None, help="Host memory to reserve, GB.")
@click.option("--on-demand", is_flag=True, help="Load when asked for; evicted when idle.")
@click.option("--alias", "aliases", multiple=True, help="Another name clients may use.")
@click.option("--arg", "args", multiple=True, help="An engine argument (repeatable).")
@_data_dir_option()
@_json_option()
def model_add(
    name: str | None,
    file: Path | None,
    engine: str | None,
    source: str | None,
    replicas: int | None,
    context: int | None,
    slots: int | None,
    cpu_cores: int | None,
    min_memory_gb: float | None,
    on_demand: bool,
    aliases: tuple[str, ...],
    args: tuple[str, ...],
    data_dir: Path,
    as_json: bool,
) -> None:
    """Add a model: from -f FILE, or NAME --engine E [options]."""
    if file is not None:
        if name or engine:
            raise click.UsageError("give either -f FILE or NAME --engine E, not both")
        entries = _read_entries(file)
    else:
        if not name or not engine:
            raise click.UsageError("give NAME and --engine (or -f FILE)")
        entries = [
            entry_from_flags(
                name,
                engine=engine,
                source=source,
                replicas=replicas,
                context=context,
                slots=slots,
                cpu_cores=cpu_cores,
                min_memory_gb=min_memory_gb,
                on_demand=on_demand,
                aliases=aliases,
                args=args,
            )
        ]
    client = AdminClient(data_dir)
    added = [client.call("POST", "/api/v1/models", json=entry) for entry in entries]
    if as_json:
        _print_json(added[0] if len(added) == 1 else {"data": added})
        return
    for view in added:
        _say_model(view, "added")


@ctl_model.command("update")
@click.argument("name")
@click.option(
    "-f",
    "--file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    required=True,
    help="The whole new catalog entry, YAML or JSON.",
)
@_data_dir_option()
@_json_option()
def model_update(name: str, file: Path, data_dir: Path, as_json: bool) -> None:
    """Replace NAME's catalog entry with FILE's; changed profiles roll the replicas."""
    entries = _read_entries(file)
    if len(entries) != 1:
        raise click.ClickException(f"{file}: holds {len(entries)} entries; give one")
    view = AdminClient(data_dir).call("PUT", f"/api/v1/models/{_q(name)}", json=entries[0])
    if as_json:
        _print_json(view)
        return
    _say_model(view, "updated")
    if view.get("restart"):
        click.echo("its replicas are replaced one at a time, each successor ready first")


@ctl_model.command("show")
@click.argument("name")
@_data_dir_option()
@_json_option()
def model_show(name: str, data_dir: Path, as_json: bool) -> None:
    """NAME's catalog entry and its replicas."""
    view = AdminClient(data_dir).call("GET", f"/api/v1/models/{_q(name)}")
    if as_json:
        _print_json(view)
        return
    _say_model(view, "model")
    click.echo(yaml.safe_dump(view["entry"], sort_keys=False).rstrip())
    if view.get("shards"):
        click.echo("")
        _print_replicas(view["shards"])


def _scale(data_dir: Path, name: str, replicas: int, profile: str | None, as_json: bool) -> None:
    body: dict[str, Any] = {"replicas": replicas}
    if profile:
        body["profile"] = profile
    view = AdminClient(data_dir).call("POST", f"/api/v1/models/{_q(name)}/scale", json=body)
    if as_json:
        _print_json(view)
        return
    started = " (started)" if view.get("started") else ""
    counts = view["replicas"]
    click.echo(
        f"{view['name']}: {counts['wanted']} replicas wanted{started}, {counts['ready']} ready now"
    )


_profile_option = click.option("--profile", default=None, help="The profile to scale.")


@ctl_model.command("scale")
@click.argument("name")
@click.argument("replicas", type=click.IntRange(0))
@_profile_option
@_data_dir_option()
@_json_option()
def model_scale(
    name: str, replicas: int, profile: str | None, data_dir: Path, as_json: bool
) -> None:
    """Run REPLICAS replicas of NAME (a stopped model starts at that count)."""
    _scale(data_dir, name, replicas, profile, as_json)


@ctl.command("scale")
@click.argument("name")
@click.argument("replicas", type=click.IntRange(0))
@_profile_option
@_data_dir_option()
@_json_option()
def ctl_scale(name: str, replicas: int, profile: str | None, data_dir: Path, as_json: bool) -> None:
    """Run REPLICAS replicas of NAME (= ctl model scale)."""
    _scale(data_dir, name, replicas, profile, as_json)


@ctl_model.command("stop")
@click.argument("name")
@_data_dir_option()
@_json_option()
def model_stop(name: str, data_dir: Path, as_json: bool) -> None:
    """Stop NAME's replicas; the entry, its files and its counts are kept."""
    view = AdminClient(data_dir).call("POST", f"/api/v1/models/{_q(name)}/stop")
    if as_json:
        _print_json(view)
    elif view["changed"]:
        click.echo(f"stopped {name}: its replicas are stopping; 'ctl model start {name}' resumes")
    else:
        click.echo(f"{name} is already stopped")


@ctl_model.command("start")
@click.argument("name")
@_data_dir_option()
@_json_option()
def model_start(name: str, data_dir: Path, as_json: bool) -> None:
    """Start NAME again at the counts it had when stopped."""
    view = AdminClient(data_dir).call("POST", f"/api/v1/models/{_q(name)}/start")
    if as_json:
        _print_json(view)
    elif view["changed"]:
        click.echo(f"started {name}: {view['replicas']['wanted']} replicas wanted")
    else:
        click.echo(f"{name} is not stopped")


@ctl_model.command("remove")
@click.argument("name")
@click.option(
    "--purge",
    is_flag=True,
    help="Also delete its weights in the data directory when no other model uses them.",
)
@_data_dir_option()
@_json_option()
def model_remove(name: str, purge: bool, data_dir: Path, as_json: bool) -> None:
    """Remove NAME from the catalog; its replicas stop. Files stay unless --purge."""
    suffix = "?purge=1" if purge else ""
    doc = AdminClient(data_dir).call("DELETE", f"/api/v1/models/{_q(name)}{suffix}")
    if as_json:
        _print_json(doc)
        return
    click.echo(f"removed {name}: its replicas are stopping")
    for path in doc.get("purged", []):
        click.echo(f"deleted {path}")
    if purge and not doc.get("purged"):
        click.echo("no weights deleted (none in the data directory only this model used)")


@ctl_model.command("context")
@click.argument("name")
@click.argument("tokens", type=click.IntRange(1), required=False)
@click.option("--slots", type=click.IntRange(1), default=None, help="Parallel sequences.")
@click.option(
    "--max-output", type=click.IntRange(0), default=None, help="Most tokens one answer may ask for."
)
@_profile_option
@_data_dir_option()
@_json_option()
def model_context(
    name: str,
    tokens: int | None,
    slots: int | None,
    max_output: int | None,
    profile: str | None,
    data_dir: Path,
    as_json: bool,
) -> None:
    """Set NAME's context: TOKENS for the whole engine (shared by --slots
    sequences); replicas are replaced one at a time. --max-output alone
    applies at once."""
    body: dict[str, Any] = {}
    for key, value in (
        ("tokens", tokens),
        ("slots", slots),
        ("max_output", max_output),
        ("profile", profile),
    ):
        if value is not None:
            body[key] = value
    if not body.keys() - {"profile"}:
        raise click.UsageError("give TOKENS, --slots or --max-output")
    view = AdminClient(data_dir).call("POST", f"/api/v1/models/{_q(name)}/context", json=body)
    if as_json:
        _print_json(view)
        return
    if view.get("restart"):
        click.echo(f"{name}: context changed; replicas are replaced one at a time")
    else:
        click.echo(f"{name}: changed in the catalog; no restart needed")


@ctl_model.command("plan")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--context",
    "context_tokens",
    type=click.IntRange(1),
    default=4096,
    show_default=True,
    help="Context tokens to hold (all slots).",
)
@click.option("--slots", type=click.IntRange(1), default=1, show_default=True)
@click.option("--engine", default=None, help="GPU engine (default by format).")
@_data_dir_option()
@_json_option()
def model_plan(
    path: Path,
    context_tokens: int,
    slots: int,
    engine: str | None,
    data_dir: Path,
    as_json: bool,
) -> None:
    """Where PATH (a GGUF file, or a folder of safetensors) would fit in this
    cluster: layouts, memory per card, speed estimates."""
    from llmgw.cli.plan_format import format_plan
    from llmgw.control.planning import PlanningError, PlanNode, plan, read_model_facts

    try:
        facts = read_model_facts(path)
    except PlanningError as exc:
        raise click.ClickException(str(exc)) from None
    nodes = AdminClient(data_dir).call("GET", "/api/v1/nodes")["data"]
    plan_nodes = []
    for n in nodes:
        fields: dict[str, Any] = {
            "node_id": n["node_id"],
            "cpu_count": n["cpu_count"],
            "memory_total_mb": n["memory_total_mb"],
            "memory_bandwidth_gbps": n.get("memory_bandwidth_gbps", 0.0),
            "core_bandwidth_gbps": n.get("core_bandwidth_gbps", 0.0),
            # (gpu_class, memory MiB) per card
            "gpus": [(str(g.get("gpu_class", "")), int(g["memory_total_mb"])) for g in n["gpus"]],
        }
        plan_nodes.append(PlanNode(**fields))
    try:
        result = plan(facts, plan_nodes, context_tokens=context_tokens, slots=slots, engine=engine)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        _print_json(result.to_doc())
        return
    click.echo(format_plan(result))


@ctl.command("explain-placement")
@click.argument("model")
@_data_dir_option()
@_json_option()
def ctl_explain_placement(model: str, data_dir: Path, as_json: bool) -> None:
    """Every node against MODEL's profiles: fits, or the constraint that failed."""
    doc = AdminClient(data_dir).call("GET", f"/api/v1/models/{_q(model)}/placement")
    if as_json:
        _print_json(doc)
        return
    if not doc["nodes"]:
        click.echo(f"{doc['model']}: no nodes are known yet")
        return
    rows = [
        [v["node_id"], v["profile"], "fits" if v["fits"] else "no", v["reason"]]
        for v in doc["nodes"]
    ]
    click.echo(format_table(["NODE", "PROFILE", "FITS", "WHY"], rows))


# --- nodes and replicas -----------------------------------------------------------------


@ctl.command("nodes")
@_data_dir_option()
@_json_option()
def ctl_nodes(data_dir: Path, as_json: bool) -> None:
    """Nodes: link, CPUs, memory, GPUs, engines, cordons and replicas."""
    doc = AdminClient(data_dir).call("GET", "/api/v1/nodes")
    if as_json:
        _print_json(doc)
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


def _print_replicas(replicas: list[dict[str, Any]]) -> None:
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
                state,
                rep.get("restarts", 0),
                rep.get("compute") or "-",
                rep.get("profile") or "-",
                "stale" if rep.get("stale") else "",
                _ago(rep.get("ready_at")),
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
                "STATE",
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


@ctl.command("replicas")
@_data_dir_option()
@_json_option()
def ctl_replicas(data_dir: Path, as_json: bool) -> None:
    """Replicas: node, port, state (with why a failed one failed), restarts, compute."""
    doc = AdminClient(data_dir).call("GET", "/api/v1/replicas")
    if as_json:
        _print_json(doc)
        return
    if not doc["data"]:
        click.echo("no replicas")
        return
    _print_replicas(doc["data"])


def _node_command(action: str, help_text: str) -> None:
    @ctl.command(action, help=help_text)
    @click.argument("node")
    @_data_dir_option()
    @_json_option()
    def command(node: str, data_dir: Path, as_json: bool) -> None:
        doc = AdminClient(data_dir).call("POST", f"/api/v1/nodes/{_q(node)}/{action}")
        if as_json:
            _print_json(doc)
            return
        state = (
            "draining (no new replicas; its replicas move away)"
            if doc["draining"]
            else ("cordoned (no new replicas)" if doc["cordoned"] else "open to new replicas")
        )
        click.echo(f"node {node}: {state}")
        if not doc["known"]:
            click.echo(f"note: no node {node!r} has registered (yet)", err=True)


_node_command("cordon", "Take no new replicas on NODE.")
_node_command("uncordon", "Let NODE take replicas again (ends a cordon or a drain).")
_node_command("drain", "Cordon NODE and move its replicas away, each replacement first.")


# --- settings ---------------------------------------------------------------------


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


@ctl.group("config")
def ctl_config() -> None:
    """The cluster settings, live on every control plane within seconds."""


@ctl_config.command("get")
@click.argument("key", required=False)
@_data_dir_option()
@_json_option()
def config_get(key: str | None, data_dir: Path, as_json: bool) -> None:
    """The settings (YAML), or one dotted KEY like on_demand.evict_after_idle."""
    doc = AdminClient(data_dir).call("GET", "/api/v1/config")
    value = lookup_key(doc["document"], key) if key else doc["document"]
    if as_json:
        _print_json(value if key else doc)
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
@_data_dir_option()
@_json_option()
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
    doc = AdminClient(data_dir).call("PATCH", "/api/v1/config", json=body)
    if as_json:
        _print_json(doc)
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
@_data_dir_option()
def config_edit(note: str, data_dir: Path) -> None:
    """Edit the settings as YAML in $EDITOR; validated before they are saved."""
    client = AdminClient(data_dir)
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
            except AdminError as exc:
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
@click.option("--last", type=click.IntRange(1, 1000), default=20, show_default=True)
@_data_dir_option()
@_json_option()
def config_history(last: int, data_dir: Path, as_json: bool) -> None:
    """Who changed the settings, when, and which keys."""
    doc = AdminClient(data_dir).call("GET", "/api/v1/config/history", params={"last": last})
    if as_json:
        _print_json(doc)
        return
    rows = [
        [
            change["version"],
            _when(change["changed_at"]),
            change["actor"] or "-",
            ", ".join(change["changed"]) or "-",
            change["note"],
        ]
        for change in doc["data"]
    ]
    click.echo(format_table(["VERSION", "WHEN (UTC)", "WHO", "CHANGED", "NOTE"], rows))


# --- status -------------------------------------------------------------------------


def print_status(doc: dict[str, Any]) -> None:
    """``ctl status`` for people: serving, leader, nodes, models, replicas."""
    serving = doc.get("serving", {})
    if serving.get("stopped"):
        click.echo("serving: STOPPED (every model at zero; 'llmgw start' to serve again)")
    else:
        click.echo("serving: yes")
    click.echo(f"leader: {'yes' if doc['leader'] else 'no'}")
    for node in doc["nodes"]:
        link = "connected" if node["connected"] else "DISCONNECTED"
        click.echo(
            f"node {node['node_id']} ({node['address']}): {link}, {node['cpu_count']} CPUs, "
            f"{node['memory_total_mb']} MiB, {node['gpus']} GPUs"
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
        click.echo(
            f"replica {rep['replica_id']} on {rep['node_id']}:{rep['port']}: {rep['state']}{reason}"
        )


@cli.command("status")
@_data_dir_option()
@_json_option()
def system_status(data_dir: Path, as_json: bool) -> None:
    """Serving or stopped, nodes, models and replicas (= llmgw ctl status)."""
    doc = AdminClient(data_dir).call("GET", "/api/v1/status")
    if as_json:
        _print_json(doc)
        return
    print_status(doc)

"""``llmgw ctl models``, ``ctl model …``, ``ctl scale`` and
``ctl explain-placement``: the catalog's models, through the admin API
(:mod:`llmgw.admin.models`; the catalog's rules: ``docs/catalog.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import yaml

from llmgw.admin.client import AdminClient

from .nodes import print_replicas
from .options import (
    data_dir_option,
    format_table,
    json_option,
    local_time,
    path_part,
    print_json,
)
from .weights import download_text, model_serve, update_revision

__all__ = [
    "ctl_explain_placement",
    "ctl_model",
    "ctl_models",
    "ctl_scale",
    "entry_from_flags",
]


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
        for download in view.get("downloads", []):
            click.echo(
                f"{download['replica_id']} on {download['node_id']}: {_download_text(download)}"
            )


@click.command("models")
@data_dir_option()
@json_option()
def ctl_models(data_dir: Path, as_json: bool) -> None:
    """The catalog: each model with its ready and wanted replicas."""
    client = AdminClient.from_data_dir(data_dir)
    doc = client.call("GET", "/api/v1/models")
    if as_json:
        print_json(doc)
        return
    if not doc["data"]:
        click.echo("no models; add one with 'llmgw ctl model add'")
        return
    stopped = client.call("GET", "/api/v1/status").get("serving", {}).get("stopped", False)
    _print_models(doc["data"], stopped)
    if stopped:
        click.echo("serving is stopped ('llmgw start' to serve again)")


@click.group("model")
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
@data_dir_option()
@json_option()
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
    client = AdminClient.from_data_dir(data_dir)
    added = [client.call("POST", "/api/v1/models", json=entry) for entry in entries]
    if as_json:
        print_json(added[0] if len(added) == 1 else {"data": added})
        return
    for view in added:
        _say_model(view, "added")


@ctl_model.command("update")
@click.argument("name")
@click.option(
    "-f",
    "--file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The whole new catalog entry, YAML or JSON.",
)
@click.option(
    "--revision",
    default=None,
    help="New weights for a model served from hf:: a branch, tag or commit (default: main).",
)
@data_dir_option()
@json_option()
def model_update(
    name: str, file: Path | None, revision: str | None, data_dir: Path, as_json: bool
) -> None:
    """Replace NAME's catalog entry with FILE's (changed profiles roll the
    replicas), or, without -f, pin a model served from hf: to a new
    revision and say which files changed."""
    if file is None:
        update_revision(name, revision, data_dir, as_json)
        return
    if revision is not None:
        raise click.UsageError("give either -f FILE or --revision, not both")
    entries = _read_entries(file)
    if len(entries) != 1:
        raise click.ClickException(f"{file}: holds {len(entries)} entries; give one")
    view = AdminClient.from_data_dir(data_dir).call(
        "PUT", f"/api/v1/models/{path_part(name)}", json=entries[0]
    )
    if as_json:
        print_json(view)
        return
    _say_model(view, "updated")
    if view.get("restart"):
        click.echo("its replicas are replaced one at a time, each successor ready first")


@ctl_model.command("show")
@click.argument("name")
@data_dir_option()
@json_option()
def model_show(name: str, data_dir: Path, as_json: bool) -> None:
    """NAME's catalog entry and its replicas."""
    view = AdminClient.from_data_dir(data_dir).call("GET", f"/api/v1/models/{path_part(name)}")
    if as_json:
        print_json(view)
        return
    _say_model(view, "model")
    entry = dict(view["entry"])
    added = entry.pop("created_at", None)
    if added:
        click.echo(f"added {local_time(added, zone=True)}")
    click.echo(yaml.safe_dump(entry, sort_keys=False).rstrip())
    if view.get("shards"):
        click.echo("")
        print_replicas(view["shards"])


def _scale(data_dir: Path, name: str, replicas: int, profile: str | None, as_json: bool) -> None:
    body: dict[str, Any] = {"replicas": replicas}
    if profile:
        body["profile"] = profile
    view = AdminClient.from_data_dir(data_dir).call(
        "POST", f"/api/v1/models/{path_part(name)}/scale", json=body
    )
    if as_json:
        print_json(view)
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
@data_dir_option()
@json_option()
def model_scale(
    name: str, replicas: int, profile: str | None, data_dir: Path, as_json: bool
) -> None:
    """Run REPLICAS replicas of NAME (a stopped model starts at that count)."""
    _scale(data_dir, name, replicas, profile, as_json)


@click.command("scale")
@click.argument("name")
@click.argument("replicas", type=click.IntRange(0))
@_profile_option
@data_dir_option()
@json_option()
def ctl_scale(name: str, replicas: int, profile: str | None, data_dir: Path, as_json: bool) -> None:
    """Run REPLICAS replicas of NAME (= ctl model scale)."""
    _scale(data_dir, name, replicas, profile, as_json)


@ctl_model.command("stop")
@click.argument("name")
@data_dir_option()
@json_option()
def model_stop(name: str, data_dir: Path, as_json: bool) -> None:
    """Stop NAME's replicas; the entry, its files and its counts are kept."""
    view = AdminClient.from_data_dir(data_dir).call(
        "POST", f"/api/v1/models/{path_part(name)}/stop"
    )
    if as_json:
        print_json(view)
    elif view["changed"]:
        click.echo(f"stopped {name}: its replicas are stopping; 'ctl model start {name}' resumes")
    else:
        click.echo(f"{name} is already stopped")


@ctl_model.command("start")
@click.argument("name")
@data_dir_option()
@json_option()
def model_start(name: str, data_dir: Path, as_json: bool) -> None:
    """Start NAME again at the counts it had when stopped."""
    view = AdminClient.from_data_dir(data_dir).call(
        "POST", f"/api/v1/models/{path_part(name)}/start"
    )
    if as_json:
        print_json(view)
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
@data_dir_option()
@json_option()
def model_remove(name: str, purge: bool, data_dir: Path, as_json: bool) -> None:
    """Remove NAME from the catalog; its replicas stop. Files stay unless --purge."""
    suffix = "?purge=1" if purge else ""
    doc = AdminClient.from_data_dir(data_dir).call(
        "DELETE", f"/api/v1/models/{path_part(name)}{suffix}"
    )
    if as_json:
        print_json(doc)
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
@data_dir_option()
@json_option()
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
    view = AdminClient.from_data_dir(data_dir).call(
        "POST", f"/api/v1/models/{path_part(name)}/context", json=body
    )
    if as_json:
        print_json(view)
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
@click.option(
    "--slots",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Parallel sequences one replica serves (they share --context).",
)
@click.option("--engine", default=None, help="GPU engine (default by format).")
@data_dir_option()
@json_option()
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
    from llmgw.control.planning import PlanNode, plan, read_model_facts

    facts = read_model_facts(path)
    nodes = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/nodes")["data"]
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
        print_json(result.to_doc())
        return
    click.echo(format_plan(result))


@click.command("explain-placement")
@click.argument("model")
@data_dir_option()
@json_option()
def ctl_explain_placement(model: str, data_dir: Path, as_json: bool) -> None:
    """Every node against MODEL's profiles: fits, or the constraint that failed."""
    doc = AdminClient.from_data_dir(data_dir).call(
        "GET", f"/api/v1/models/{path_part(model)}/placement"
    )
    if as_json:
        print_json(doc)
        return
    if not doc["nodes"]:
        click.echo(f"{doc['model']}: no nodes are known yet")
        return
    rows = [
        [v["node_id"], v["profile"], "fits" if v["fits"] else "no", v["reason"]]
        for v in doc["nodes"]
    ]
    click.echo(format_table(["NODE", "PROFILE", "FITS", "WHY"], rows))
    for download in doc.get("downloads", []):
        click.echo(f"{download['replica_id']} on {download['node_id']}: {_download_text(download)}")


def _download_text(download: dict[str, Any]) -> str:
    return download_text(download)


ctl_model.add_command(model_serve)

"""``llmgw ctl model serve hf:ORG/REPO[@REV]``, ``ctl model update NAME
--revision REV`` and ``ctl weights``: models from Hugging Face or a mirror,
pinned to a commit, and the weights nodes hold (``docs/models-from-hf.md``).

``ctl model serve`` is added to the ``ctl model`` group by :mod:`.models`.
The control plane resolves the revision (the admin API is the one door:
``POST /api/v1/models/serve``, ``POST /api/v1/models/NAME/update``,
``GET /api/v1/weights``); these commands only send and print.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from llmgw.admin.client import AdminClient

from .options import data_dir_option, format_table, json_option, path_part, print_json

__all__ = ["ctl_weights", "download_text", "model_serve", "print_changes", "update_revision"]


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def download_text(download: dict[str, Any]) -> str:
    """``downloading 120.0 MB of 253.1 MB at 30.2 MB/s`` (or ``checking …``)."""
    text = (
        f"{download.get('phase', 'downloading')} {_size(download['done_bytes'])} of "
        f"{_size(download['total_bytes'])}"
    )
    rate = float(download.get("rate_bytes_per_s") or 0.0)
    return f"{text} at {_size(rate)}/s" if rate > 0 else text


def print_changes(changes: dict[str, Any]) -> None:
    """What an update changed, file by file."""
    if changes["from"] == changes["to"]:
        click.echo(f"already at {changes['to']}: nothing changed")
        return
    click.echo(f"revision {changes['from'] or '(none)'} → {changes['to']}")
    for key in ("added", "removed", "changed"):
        for path in changes[key]:
            click.echo(f"  {key:8} {path}")
    if not any(changes[k] for k in ("added", "removed", "changed")):
        click.echo("  the files are the same (same digests)")


@click.command("serve")
@click.argument("source")
@click.option("--file", "file_glob", default=None, help="Which file(s) of the repository (a glob).")
@click.option("--name", default=None, help="The catalog name (default: from the repository).")
@click.option("--engine", default=None, help="llamacpp (GGUF) or vllm (safetensors, GPU).")
@click.option("--replicas", type=click.IntRange(0), default=None, help="Replicas wanted (1).")
@click.option("--context", type=click.IntRange(1), default=None, help="Context tokens (4096).")
@click.option("--slots", type=click.IntRange(1), default=None, help="Parallel sequences (4).")
@click.option("--cpu-cores", type=click.IntRange(0), default=None, help="Cores to reserve.")
@click.option("--min-memory-gb", type=float, default=None, help="Host memory to reserve, GB.")
@click.option("--gpu-class", default=None, help="Card class for vLLM (e.g. h100-80g).")
@click.option("--gpus", type=click.IntRange(1), default=None, help="Cards per replica.")
@click.option("--arg", "args", multiple=True, help="An engine argument (repeatable).")
@data_dir_option()
@json_option()
def model_serve(
    source: str,
    file_glob: str | None,
    name: str | None,
    engine: str | None,
    replicas: int | None,
    context: int | None,
    slots: int | None,
    cpu_cores: int | None,
    min_memory_gb: float | None,
    gpu_class: str | None,
    gpus: int | None,
    args: tuple[str, ...],
    data_dir: Path,
    as_json: bool,
) -> None:
    """Serve SOURCE, hf:ORG/REPO[@REVISION], pinned to its commit: the
    control plane resolves it on the first mirror that answers (or the hub),
    refuses pickle formats before anything is downloaded, picks the engine
    and adds the model; nodes fetch and check the files."""
    body: dict[str, Any] = {"source": source}
    for key, value in (
        ("file", file_glob),
        ("name", name),
        ("engine", engine),
        ("replicas", replicas),
        ("context", context),
        ("slots", slots),
        ("cpu_cores", cpu_cores),
        ("min_memory_gb", min_memory_gb),
        ("gpu_class", gpu_class),
        ("gpus", gpus),
    ):
        if value is not None:
            body[key] = value
    if args:
        body["args"] = list(args)
    view = AdminClient.from_data_dir(data_dir).call("POST", "/api/v1/models/serve", json=body)
    if as_json:
        print_json(view)
        return
    resolved = view["resolved"]
    total = sum(f["size_bytes"] for f in resolved["files"])
    click.echo(
        f"serving {view['name']} ({view['engine']}) from {resolved['repo']}@{resolved['revision']} "
        f"on {resolved['endpoint']}: {len(resolved['files'])} file(s), {_size(total)}"
    )
    for file in resolved["files"]:
        click.echo(f"  {file['path']}  {_size(file['size_bytes'])}  sha256 {file['sha256']}")
    fits = sorted({v["node_id"] for v in view.get("placement", []) if v["fits"]})
    if fits:
        click.echo(f"fits on: {', '.join(fits)}")
    else:
        for verdict in view.get("placement", []):
            click.echo(f"does not fit on {verdict['node_id']}: {verdict['reason']}")
        if not view.get("placement"):
            click.echo("no node is registered yet; it is placed when one joins")


def update_revision(name: str, revision: str | None, data_dir: Path, as_json: bool) -> None:
    """``ctl model update NAME --revision REV``: new weights, and what changed."""
    body = {"revision": revision} if revision else {}
    view = AdminClient.from_data_dir(data_dir).call(
        "POST", f"/api/v1/models/{path_part(name)}/update", json=body
    )
    if as_json:
        print_json(view)
        return
    print_changes(view["changes"])
    if view.get("restart"):
        click.echo("its replicas are replaced one at a time, each successor ready first")


@click.command("weights")
@data_dir_option()
@json_option()
def ctl_weights(data_dir: Path, as_json: bool) -> None:
    """The model versions llmgw fetched onto each connected node."""
    doc = AdminClient.from_data_dir(data_dir).call("GET", "/api/v1/weights")
    if as_json:
        print_json(doc)
        return
    rows = []
    for node in doc["nodes"]:
        if "error" in node:
            rows.append([node["node_id"], "?", "", "", node["error"]])
            continue
        for held in node["held"]:
            rows.append(
                [
                    node["node_id"],
                    f"{held['repo']}@{held['revision'][:12]}",
                    held["files"],
                    _size(held["size_bytes"]),
                    "in use" if held["in_use"] else "",
                ]
            )
    if not rows:
        click.echo("no node holds fetched weights")
        return
    click.echo(format_table(["NODE", "VERSION", "FILES", "SIZE", ""], rows))

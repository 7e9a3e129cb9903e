"""``llmgw mirror serve|import|pull|list|verify``: the model mirror (docs/mirror.md).

The data directory is ``--data-dir``, else ``$LLMGW_MIRROR_DIR``, else
``$XDG_DATA_HOME/llmgw/mirror`` (``~/.local/share/llmgw/mirror``).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from llmgw import errors

from .errors import first_leaf
from .options import DEFAULT_DATA_DIR, format_table, json_option, print_json

__all__ = ["mirror"]

F = TypeVar("F", bound=Callable[..., Any])

_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(
            f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8090)", param_hint=name
        )


def _data_dir_option() -> Callable[[F], F]:
    return click.option(
        "--data-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=lambda: Path(os.environ.get("LLMGW_MIRROR_DIR", str(DEFAULT_DATA_DIR / "mirror"))),
        show_default="$LLMGW_MIRROR_DIR or ~/.local/share/llmgw/mirror",
        help="Where the mirror keeps its files.",
    )


def _store(data_dir: Path) -> Any:
    from llmgw.mirror.store import MirrorStore

    return MirrorStore(data_dir)


def _say(text: str) -> None:
    click.echo(f"llmgw: {text}", err=True)


def _commit_json(store: Any, commit: Any) -> dict[str, Any]:
    doc: dict[str, Any] = commit.to_json()
    del doc["format"]
    for entry in doc["files"]:
        entry["blob"] = str(store.blob_path(entry["sha256"]))
    return doc


@click.group()
def mirror() -> None:
    """The model mirror: pinned, immutable model versions served as the
    Hugging Face Hub's API (point HF_ENDPOINT at it)."""
    # huggingface_hub's HTTP client logs each request at INFO; shown with -v.
    if logging.getLogger().level > logging.DEBUG:
        for noisy in ("httpx2", "httpcore2"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


@mirror.command()
@_data_dir_option()
@click.option(
    "--listen", default="127.0.0.1:8090", show_default=True, help="HOST:PORT to serve on."
)
def serve(data_dir: Path, listen: str) -> None:
    """Serve the mirror's repositories until Ctrl-C."""
    _check_address("--listen", listen)
    import trio

    from llmgw.mirror.server import run_mirror

    try:
        trio.run(run_mirror, _store(data_dir), listen, _say)
    except* OSError as group:
        raise click.ClickException(
            f"cannot listen on {listen}: {errors.describe(first_leaf(group))}"
        ) from None


@mirror.command(name="import")
@click.argument("path", type=click.Path(exists=True, path_type=Path), required=False)
@click.option(
    "--as",
    "repo",
    default=None,
    metavar="ORG/REPO",
    help="Repository id to import as (with --starter: llmgw/gemma-3-270m-gguf by default).",
)
@click.option(
    "--starter",
    is_flag=True,
    help="Import the starter GGUF that ships with llmgw instead of PATH.",
)
@click.option(
    "--revision", default=None, metavar="NAME", help="A ref name for the new commit (besides main)."
)
@click.option(
    "--sha256",
    "expected",
    default=None,
    metavar="HEX",
    help="The sha256 a single file must have (refused otherwise).",
)
@_data_dir_option()
@json_option()
def import_(
    path: Path | None,
    repo: str | None,
    starter: bool,
    revision: str | None,
    expected: str | None,
    data_dir: Path,
    as_json: bool,
) -> None:
    """Import a file or a directory (PATH) as a new immutable commit of
    ORG/REPO; the commit id is derived from the repository id and the files."""
    if expected is not None and not _SHA256.fullmatch(expected):
        raise click.BadParameter("not 64 hex digits", param_hint="--sha256")
    store = _store(data_dir)
    if starter:
        if path is not None or expected is not None:
            raise click.UsageError("--starter takes no PATH and no --sha256")
        from llmgw.mirror.store import STARTER_REPO

        repo = repo or STARTER_REPO
        commit = store.import_starter(repo, revision=revision)
    else:
        if path is None or repo is None:
            raise click.UsageError("give PATH and --as ORG/REPO (or --starter)")
        try:
            commit = store.import_path(path, repo, revision=revision, expected_sha256=expected)
        except OSError as exc:  # an unreadable source, a full disk
            raise click.ClickException(errors.describe(exc)) from None
    if as_json:
        print_json(_commit_json(store, commit))
        return
    for stored in commit.files:
        click.echo(f"{stored.path}  {stored.size_bytes} bytes  sha256 {stored.sha256}")
    click.echo(f"{repo}@{commit.commit}")


@mirror.command()
@click.argument("source", metavar="hf:ORG/REPO[@REV]")
@click.option(
    "--endpoint",
    default=None,
    metavar="URL",
    help="The hub (or another mirror) to pull from; default $HF_ENDPOINT, else huggingface.co.",
)
@click.option(
    "--include", multiple=True, metavar="GLOB", help="Only files whose path matches (repeatable)."
)
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Also pull pickle-format files (.bin, .pt, .pth, .pkl, .ckpt, .pickle), left out by default.",
)
@_data_dir_option()
@json_option()
def pull(
    source: str,
    endpoint: str | None,
    include: tuple[str, ...],
    allow_pickle: bool,
    data_dir: Path,
    as_json: bool,
) -> None:
    """Copy one commit of a Hub repository into the mirror, checking every
    file against the digest the Hub publishes."""
    from llmgw.mirror.pull import parse_hf_source
    from llmgw.mirror.pull import pull as pull_commit

    store = _store(data_dir)
    try:
        commit = pull_commit(
            store,
            parse_hf_source(source),
            endpoint=endpoint,
            include=include,
            allow_pickle=allow_pickle,
            say=_say,
        )
    except OSError as exc:  # the data directory: unwritable, full
        raise click.ClickException(f"{data_dir}: {errors.describe(exc)}") from None
    if as_json:
        print_json(_commit_json(store, commit))
        return
    click.echo(f"{commit.repo}@{commit.commit}")


@mirror.command(name="list")
@_data_dir_option()
@json_option()
def list_(data_dir: Path, as_json: bool) -> None:
    """List the repositories, their refs and commits (--json: each file's
    path, size, sha256 and blob path)."""
    store = _store(data_dir)
    repos = []
    for repo in store.repos():
        repos.append(
            {
                "repo": repo,
                "refs": store.refs(repo),
                "commits": [_commit_json(store, c) for c in store.commits(repo)],
            }
        )
    if as_json:
        print_json({"data_dir": str(data_dir), "repos": repos})
        return
    rows = []
    for entry in repos:
        for commit in entry["commits"]:
            names = sorted(n for n, c in entry["refs"].items() if c == commit["commit"])
            rows.append(
                [
                    entry["repo"],
                    commit["commit"],
                    ",".join(names) or "-",
                    len(commit["files"]),
                    sum(f["size_bytes"] for f in commit["files"]),
                    commit["created_at"][:19].replace("T", " "),
                ]
            )
    if not rows:
        click.echo(f"no repositories in {data_dir}")
        return
    click.echo(format_table(["REPO", "COMMIT", "REFS", "FILES", "BYTES", "CREATED (UTC)"], rows))


@mirror.command()
@_data_dir_option()
@json_option()
def verify(data_dir: Path, as_json: bool) -> None:
    """Re-hash every stored file; list those whose bytes changed or are
    missing (exit status 1 if any)."""
    problems = _store(data_dir).check_blobs()
    if as_json:
        print_json(
            [
                {
                    "sha256": p.sha256,
                    "actual": p.actual,
                    "blob": str(p.blob),
                    "used_by": [{"repo": r, "commit": c, "path": f} for r, c, f in p.used_by],
                }
                for p in problems
            ]
        )
    else:
        for problem in problems:
            found = "missing" if problem.actual is None else f"sha256 {problem.actual}"
            click.echo(f"{problem.blob}: {found}, expected {problem.sha256}")
            for repo, commit, path in problem.used_by:
                click.echo(f"  used by {repo}@{commit} {path}")
        if not problems:
            click.echo("every stored file matches its sha256")
    if problems:
        raise SystemExit(1)

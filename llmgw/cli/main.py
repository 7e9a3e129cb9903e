"""The ``llmgw`` command.

``llmgw up`` runs everything on one machine; ``llmgw keys …`` and
``llmgw ctl …`` (with ``llmgw stop|start|status``, in ``ctl.py``) are
clients of the admin API (address and admin key found in the data directory); ``llmgw engine sim|llamacpp`` are the engine launchers
the agent starts. Every client command takes ``--json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import click
import httpx

__all__ = ["main"]

DEFAULT_DATA_DIR = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "llmgw"
#: Deadline for one admin API call from the command line, in seconds.
ADMIN_TIMEOUT_S = 30.0


F = TypeVar("F", bound=Callable[..., Any])


def _data_dir_option() -> Callable[[F], F]:
    return click.option(
        "--data-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=lambda: Path(os.environ.get("LLMGW_DATA_DIR", str(DEFAULT_DATA_DIR))),
        show_default="$LLMGW_DATA_DIR or ~/.local/share/llmgw",
        help="Where the store, weights and admin key live.",
    )


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(
            f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8080)", param_hint=name
        )


def _parse_range(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a port range like 20000-20999") from None
    if not 1 <= first <= last <= 65535:
        raise click.BadParameter(f"{value!r} is not a port range like 20000-20999")
    return first, last


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
def cli(verbose: bool) -> None:
    """llmgw: a private, governed, OpenAI-compatible LLM service."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="llmgw: %(message)s"
        if not verbose
        else "%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpcore", "hypercorn", "llmgw.http", "quart", "trio-websocket"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# --- up -----------------------------------------------------------------------


@cli.command()
@_data_dir_option()
@click.option("--listen", default="127.0.0.1:8080", show_default=True, help="Client API HOST:PORT.")
@click.option(
    "--model",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Serve this GGUF instead of the starter model.",
)
@click.option(
    "--engine",
    type=click.Choice(["llamacpp", "sim"]),
    default="llamacpp",
    show_default=True,
    help="llama.cpp, or the sim engine (made-up answers, no weights).",
)
@click.option(
    "--model-name",
    "model_names",
    multiple=True,
    help="The name clients use (default: gemma-3-270m or the file's stem); with "
    "--engine sim, repeat it to serve several models.",
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Settings file (YAML; default DATA_DIR/server.yaml when it exists).",
)
@click.option(
    "--admin-listen", default="127.0.0.1:9090", show_default=True, help="Admin API HOST:PORT."
)
@click.option(
    "--metrics-listen", default="127.0.0.1:9091", show_default=True, help="Prometheus HOST:PORT."
)
@click.option(
    "--agent-listen", default="127.0.0.1:7443", show_default=True, help="Agents' hub HOST:PORT."
)
@click.option("--engine-ports", default="20000-20999", show_default=True, help="Engine port range.")
@click.option(
    "--engine-arg", "engine_args", multiple=True, help="An extra engine argument (repeatable)."
)
@click.option("--llama-server", "llamacpp_bin", default=None, help="A llama-server binary to use.")
@click.option(
    "--context",
    "context_tokens",
    default=4096,
    show_default=True,
    help="Context tokens (--ctx-size).",
)
@click.option("--slots", default=4, show_default=True, help="Parallel sequences per replica.")
@click.option(
    "--no-agent",
    is_flag=True,
    help="Run the control plane only; an 'llmgw agent' run apart serves the engines "
    "(its token is in DATA_DIR/agent-token).",
)
def up(
    data_dir: Path,
    listen: str,
    model: Path | None,
    engine: str,
    model_names: tuple[str, ...],
    config: Path | None,
    admin_listen: str,
    metrics_listen: str,
    agent_listen: str,
    engine_ports: str,
    engine_args: tuple[str, ...],
    llamacpp_bin: str | None,
    context_tokens: int,
    slots: int,
    no_agent: bool,
) -> None:
    """Run the control plane, an agent and a model on this machine."""
    import trio

    from llmgw.agent.weights import WeightsMismatch
    from llmgw.app.up import UpError, UpOptions, run_up
    from llmgw.settings import SettingsError

    for name, value in (
        ("--listen", listen),
        ("--admin-listen", admin_listen),
        ("--metrics-listen", metrics_listen),
        ("--agent-listen", agent_listen),
    ):
        _check_address(name, value)

    options = UpOptions(
        data_dir=data_dir,
        listen=listen,
        admin_listen=admin_listen,
        metrics_listen=metrics_listen,
        agent_listen=agent_listen,
        engine_ports=_parse_range(engine_ports),
        engine=engine,
        model=model,
        model_names=model_names,
        config=config,
        engine_args=engine_args,
        llamacpp_bin=llamacpp_bin,
        context_tokens=context_tokens,
        slots=slots,
        agent=not no_agent,
    )
    try:
        trio.run(run_up, options)
    except* (WeightsMismatch, FileNotFoundError, ValueError, UpError, SettingsError) as group:
        raise click.ClickException(str(_leaf(group))) from None
    except* OSError as group:
        raise click.ClickException(
            f"cannot listen: {_leaf(group)} (is another llmgw running on these ports? see "
            "--listen and the other --…-listen options)"
        ) from None


def _leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception inside (possibly nested) exception groups."""
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


# --- agent --------------------------------------------------------------------


@cli.command("agent")
@click.option(
    "--server", required=True, help="The control plane's agent hub, ws://HOST:7443/agent."
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="A file holding the agent token (llmgw up writes DATA_DIR/agent-token).",
)
@click.option("--node-id", default="", help="This node's name (default: the host name).")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Shard files and engine logs, for adopting engines after a restart "
    "(default: ~/.local/state/llmgw/agent/NODE).",
)
@click.option("--llama-server", "llamacpp_bin", default=None, help="A llama-server binary to use.")
def agent(
    server: str, token_file: Path, node_id: str, state_dir: Path | None, llamacpp_bin: str | None
) -> None:
    """Run a node agent until SIGINT or SIGTERM; its engines keep running and
    the next agent on the same state directory adopts them."""
    import trio

    from llmgw.agent.main import AgentConfig, run_agent
    from llmgw.agent.state import StateDirBusy

    if not server.startswith(("ws://", "wss://")):
        raise click.BadParameter(f"{server!r} is not ws://HOST:PORT/agent", param_hint="--server")
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise click.ClickException(f"cannot read the agent token: {exc}") from None
    if not token:
        raise click.ClickException(f"{token_file} is empty: it must hold the agent token")
    config = AgentConfig(
        server_url=server,
        token=token,
        node_id=node_id,
        state_dir=state_dir,
        llamacpp_bin=llamacpp_bin,
    )
    try:
        trio.run(run_agent, config)
    except* (StateDirBusy, OSError) as group:
        raise click.ClickException(str(_leaf(group))) from None


# --- admin API clients -----------------------------------------------------------


class AdminClient:
    """A small synchronous client of the admin API, for one-shot commands."""

    def __init__(self, data_dir: Path) -> None:
        key_path = data_dir / "admin-key"
        try:
            self.key = key_path.read_text().strip()
        except FileNotFoundError:
            raise click.ClickException(
                f"no admin key at {key_path}: run 'llmgw up' first, or pass --data-dir"
            ) from None
        admin = "127.0.0.1:9090"
        try:
            admin = json.loads((data_dir / "run.json").read_text())["admin"]
        except (FileNotFoundError, KeyError, ValueError):
            pass
        self.base_url = f"http://{admin}"

    def stream(self, path: str, params: dict[str, Any], out: Any) -> None:
        """GET ``path`` and copy the body to ``out`` as it arrives."""
        try:
            with (
                httpx.Client(base_url=self.base_url, timeout=ADMIN_TIMEOUT_S) as client,
                client.stream(
                    "GET", path, params=params, headers={"authorization": f"Bearer {self.key}"}
                ) as response,
            ):
                if response.status_code >= 400:
                    response.read()
                    raise _refused(response)
                for chunk in response.iter_bytes():
                    out.write(chunk)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            with httpx.Client(base_url=self.base_url, timeout=ADMIN_TIMEOUT_S) as client:
                response = client.request(
                    method, path, headers={"authorization": f"Bearer {self.key}"}, **kwargs
                )
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        if response.status_code >= 400:
            raise _refused(response)
        try:
            return response.json()
        except ValueError:
            raise click.ClickException(
                f"the admin API answered something that is not JSON: {response.text[:200]}"
            ) from None

    def _unreachable(self, exc: httpx.HTTPError) -> click.ClickException:
        return click.ClickException(
            f"cannot reach the admin API at {self.base_url} ({exc}); is llmgw running?"
        )


class AdminError(click.ClickException):
    """The admin API refused a call: ``status`` and its ``error.message`` as
    ``detail`` (printed as ``STATUS: detail``)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


def _refused(response: httpx.Response) -> AdminError:
    """The admin API's error answer as a one-line CLI error (its OpenAI-shaped
    ``error.message``, else the body)."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return AdminError(response.status_code, str(message))


def _print_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


@cli.group()
def keys() -> None:
    """Client API keys."""


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
@click.option("--band", default="", help="Admission band (gold, bulk …).")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
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
    doc = AdminClient(data_dir).call("POST", "/api/v1/keys", json=body)
    if as_json:
        _print_json(doc)
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
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def keys_rotate(key_id: str, data_dir: Path, as_json: bool) -> None:
    """Give KEY_ID a new secret (printed once); the old one is refused at once."""
    doc = AdminClient(data_dir).call("POST", f"/api/v1/keys/{quote(key_id, safe='')}/rotate")
    if as_json:
        _print_json(doc)
        return
    click.echo(doc["key"])


@keys.command("init")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
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
    doc = AdminClient(data_dir).call("POST", "/api/v1/tree", json=tree)
    if as_json:
        _print_json(doc)
        return
    for level in doc["created"]:
        click.echo(f"created {level}")
    for key in doc["keys"]:
        click.echo(f"key {key['name']} in {key['project']}: {key['key']}")
    if not doc["created"] and not doc["keys"]:
        click.echo("nothing to do: the tree is already as the file says")


@keys.command("limits")
@click.option("--scope", type=click.Choice(["org", "team", "project", "key"]), required=True)
@click.option("--id", "ident", required=True, help="ORG, ORG/TEAM, ORG/TEAM/PROJECT or a key id.")
@click.option("--rpm", default=None, help="Requests a minute ('none' clears).")
@click.option("--tpm", default=None, help="Tokens a minute ('none' clears).")
@click.option(
    "--budget",
    default=None,
    help="AMOUNT/day or AMOUNT/month in currency units ('none/month' clears).",
)
@click.option("--models", default=None, help="Comma-separated models allowed ('none' inherits).")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
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
    doc = AdminClient(data_dir).call(
        "PUT", f"/api/v1/limits/{scope}/{quote(ident.strip('/'), safe='/')}", json=body
    )
    if as_json:
        _print_json(doc)
        return
    limits = ", ".join(f"{k} {v}" for k, v in doc["limits"].items() if v is not None) or "none"
    click.echo(f"{scope} {ident}: {limits}")


@keys.command("cache")
@click.option("--project", required=True, help="ORG/TEAM/PROJECT whose answers are cached.")
@click.option(
    "--ttl", default=None, help="How long an answer is reused: 30m, 24h, … (default 24h)."
)
@click.option("--off", is_flag=True, help="Stop caching this project's answers.")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def keys_cache(project: str, ttl: str | None, off: bool, data_dir: Path, as_json: bool) -> None:
    """Turn the exact answer cache on (or --off) for a project's keys.

    Answers are kept in the gateway's memory only, up to router.cache.max_bytes;
    a repeated request is answered from it, free, with x-llmgw-cache: hit.
    """
    if off and ttl is not None:
        raise click.UsageError("give --ttl or --off, not both")
    path = f"/api/v1/projects/{quote(project.strip('/'), safe='/')}/cache"
    client = AdminClient(data_dir)
    doc = (
        client.call("DELETE", path) if off else client.call("PUT", path, json={"ttl": ttl or "24h"})
    )
    if as_json:
        _print_json(doc)
        return
    if doc["cache"]:
        click.echo(f"{doc['project']}: answers cached for {doc['ttl_s']:g} s")
    else:
        click.echo(f"{doc['project']}: answer cache off")


@keys.command("list")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def keys_list(data_dir: Path, as_json: bool) -> None:
    """List keys (never their secrets)."""
    doc = AdminClient(data_dir).call("GET", "/api/v1/keys")
    if as_json:
        _print_json(doc)
        return
    for key in doc["data"]:
        state = "revoked" if key["revoked_at"] else "live"
        admin = " admin" if key["is_admin"] else ""
        project = key.get("project") or "-"
        click.echo(f"{key['id']}  {key['prefix']}…  {state}{admin}  {project}  {key['name']}")


@keys.command("revoke")
@click.argument("key_id")
@_data_dir_option()
def keys_revoke(key_id: str, data_dir: Path) -> None:
    """Revoke the key KEY_ID; it is refused at once."""
    AdminClient(data_dir).call("POST", f"/api/v1/keys/{quote(key_id, safe='')}/revoke")
    click.echo(f"revoked {key_id}")


@cli.group()
def ctl() -> None:
    """Read and steer a running llmgw."""


@ctl.group("usage", invoke_without_command=True)
@_data_dir_option()
@click.option("--last", default=20, show_default=True, help="How many rows, newest first.")
@click.option("--key", "key_id", default=None, help="Only this key's rows.")
@click.option(
    "--by",
    type=click.Choice(["key", "project", "team", "org", "model"]),
    default=None,
    help="Sums by this instead of rows (from hourly roll-ups).",
)
@click.option("--since", default="24h", show_default=True, help="With --by: 24h, 30d, 2026-11-01 …")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def ctl_usage(
    ctx: click.Context,
    data_dir: Path,
    last: int,
    key_id: str | None,
    by: str | None,
    since: str,
    as_json: bool,
) -> None:
    """The newest usage rows, or sums --by key|project|team|org|model."""
    if ctx.invoked_subcommand is not None:
        return
    client = AdminClient(data_dir)
    if by is not None:
        doc = client.call("GET", "/api/v1/usage/summary", params={"by": by, "since": since})
        if as_json:
            _print_json(doc)
            return
        click.echo(f"{by:32}  requests  prompt  cached  completion  cost")
        for row in doc["data"]:
            click.echo(
                f"{row['name'][:32]:32}  {row['requests']:8}  {row['prompt_tokens']:6}  "
                f"{row['cached_tokens']:6}  {row['completion_tokens']:10}  {row['cost_micros'] / 1e6:.6f}"
            )
        return
    params: dict[str, Any] = {"last": last}
    if key_id:
        params["key_id"] = key_id
    doc = client.call("GET", "/api/v1/usage", params=params)
    if as_json:
        _print_json(doc)
        return
    click.echo(
        f"{'time (UTC)':19}  {'request':28}  {'key':20}  {'model':16}  status  prompt  cached  compl  dur_ms  ttft_ms"
    )
    import datetime as dt

    for row in doc["data"]:
        when = dt.datetime.fromtimestamp(row["created_at"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        ttft = "" if row["ttft_ms"] is None else f"{row['ttft_ms']:.0f}"
        click.echo(
            f"{when:19}  {row['request_id']:28}  {row['key_id']:20}  {row['model'][:16]:16}  "
            f"{row['status']:6}  {row['prompt_tokens']:6}  {row['cached_tokens']:6}  "
            f"{row['completion_tokens']:5}  {row['duration_ms']:6.0f}  {ttft:>7}"
        )


@ctl_usage.command("export")
@click.option(
    "--format", "fmt", type=click.Choice(["csv", "jsonl"]), default="jsonl", show_default=True
)
@click.option("--since", default="30d", show_default=True, help="24h, 30d, 2026-11-01 …")
@click.option("--until", default=None, help="Same forms as --since.")
@_data_dir_option()
def ctl_usage_export(fmt: str, since: str, until: str | None, data_dir: Path) -> None:
    """Every usage row in the period, streamed to stdout as CSV or JSON lines."""
    client = AdminClient(data_dir)
    params = {"format": fmt, "since": since}
    if until:
        params["until"] = until
    client.stream("/api/v1/usage/export", params, sys.stdout.buffer)


@ctl.command("request")
@click.argument("request_id")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ctl_request(request_id: str, data_dir: Path, as_json: bool) -> None:
    """One request's usage row (the id is in every answer's x-request-id)."""
    doc = AdminClient(data_dir).call("GET", f"/api/v1/requests/{quote(request_id, safe='')}")
    if as_json:
        _print_json(doc)
        return
    for name, value in doc.items():
        click.echo(f"{name:18} {value}")


@ctl.command("status")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ctl_status(data_dir: Path, as_json: bool) -> None:
    """Serving or stopped, nodes, models (ready/wanted) and replicas."""
    from .ctl import print_status

    doc = AdminClient(data_dir).call("GET", "/api/v1/status")
    if as_json:
        _print_json(doc)
        return
    print_status(doc)


@ctl.command("logs")
@click.argument("node", required=False, default="")
@click.option("--source", default="", help="A shard (replica) id; the agent's own log when empty.")
@click.option(
    "-n",
    "lines",
    default=200,
    show_default=True,
    type=click.IntRange(1, 2000),
    help="How many lines.",
)
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ctl_logs(node: str, source: str, lines: int, data_dir: Path, as_json: bool) -> None:
    """The last lines of NODE's agent, or of one of its engines (--source)."""
    doc = AdminClient(data_dir).call(
        "GET", "/api/v1/logs", params={"node": node, "source": source, "lines": lines}
    )
    if as_json:
        _print_json(doc)
        return
    for line in doc["lines"]:
        click.echo(line)


# --- engines ---------------------------------------------------------------------------


@cli.group()
def engine() -> None:
    """Engine launchers (the agent starts these)."""


_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@engine.command("sim", context_settings=_PASS_THROUGH)
@click.pass_context
def engine_sim(ctx: click.Context) -> None:
    """The sim engine: an OpenAI-compatible fake (see --help after 'sim')."""
    from llmgw.engines.sim.serve import main

    sys.exit(main(list(ctx.args)))


@engine.command("llamacpp", context_settings=_PASS_THROUGH)
@click.pass_context
def engine_llamacpp(ctx: click.Context) -> None:
    """llama.cpp's server from the xllamacpp wheel, with llama-server's flags."""
    from llmgw.engines import llamacpp

    sys.exit(llamacpp.main(list(ctx.args)))


# --- benchmarks -----------------------------------------------------------------------


@cli.group()
def bench() -> None:
    """Benchmarks: what the gateway adds, and load against any OpenAI server."""


def _add_load_command() -> None:
    from llmgw.bench.load import load_command

    bench.add_command(load_command, "load")


_add_load_command()


@bench.command("overhead")
@click.option(
    "--rates",
    default=",".join(f"{r:g}" for r in (50, 100, 200, 300, 400, 600, 800, 1000)),
    show_default=True,
    help="Offered requests/s, rising, comma-separated.",
)
@click.option("--modes", default="bare,accounted", show_default=True, help="Gateway modes.")
@click.option("--duration-s", default=5.0, show_default=True, help="Measured seconds per run.")
@click.option("--warmup-s", default=1.0, show_default=True, help="Unmeasured seconds per run.")
@click.option("--no-pin", is_flag=True, help="Do not pin the gateway and the engine to cores.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def bench_overhead(
    rates: str, modes: str, duration_s: float, warmup_s: float, no_pin: bool, as_json: bool
) -> None:
    """Latency and CPU the gateway adds over the sim engine, at rising rates."""
    import trio

    from llmgw.bench.gateway import MODES
    from llmgw.bench.overhead import OverheadRow, format_rows, run_overhead

    try:
        rate_list = [float(r) for r in rates.split(",") if r.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{rates!r} is not a list of numbers", param_hint="--rates"
        ) from None
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for mode in mode_list:
        if mode not in MODES:
            raise click.BadParameter(
                f"{mode!r}: choose from {', '.join(MODES)}", param_hint="--modes"
            )

    def show(row: OverheadRow) -> None:
        if not as_json:
            click.echo(format_rows([row]).splitlines()[1], err=True)

    if not as_json:
        click.echo(format_rows([]), err=True)
    rows = trio.run(
        lambda: run_overhead(
            rates=rate_list,
            modes=mode_list,
            duration_s=duration_s,
            warmup_s=warmup_s,
            pin=not no_pin,
            on_row=show,
        )
    )
    if as_json:
        _print_json({"rows": [row.to_json() for row in rows]})


@bench.command("gateway")
@click.option("--engine-url", required=True, help="The engine, http://HOST:PORT.")
@click.option("--engine-key", default="", help="The engine's key.")
@click.option("--model", required=True, help="The model name the engine serves.")
@click.option(
    "--mode", type=click.Choice(["bare", "accounted"]), default="accounted", show_default=True
)
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="HOST:PORT.")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
def bench_gateway(
    engine_url: str, engine_key: str, model: str, mode: str, listen: str, data_dir: Path
) -> None:
    """The gateway alone in front of one engine (started by `bench overhead`)."""
    import trio

    from llmgw.bench.gateway import run_bench_gateway

    trio.run(
        lambda: run_bench_gateway(
            engine_url=engine_url,
            engine_key=engine_key,
            model=model,
            listen=listen,
            mode=mode,
            data_dir=data_dir,
        )
    )


# The cluster commands (models, nodes, replicas, settings, stop/start) live in
# ctl.py and attach themselves to `cli` and `ctl` when imported.
from . import ctl as _ctl_commands  # noqa: E402, F401


def main() -> None:
    """Entry point of the ``llmgw`` command."""
    cli()

"""The ``llmgw`` command.

``llmgw up`` runs everything on one machine; ``llmgw keys …`` and
``llmgw ctl …`` are clients of the admin API (address and admin key found in
the data directory); ``llmgw engine sim|llamacpp`` are the engine launchers
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
    default="",
    help="The name clients use (default: gemma-3-270m or the file's stem).",
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
def up(
    data_dir: Path,
    listen: str,
    model: Path | None,
    engine: str,
    model_name: str,
    admin_listen: str,
    metrics_listen: str,
    agent_listen: str,
    engine_ports: str,
    engine_args: tuple[str, ...],
    llamacpp_bin: str | None,
    context_tokens: int,
    slots: int,
) -> None:
    """Run the control plane, an agent and a model on this machine."""
    import trio

    from llmgw.agent.weights import WeightsMismatch
    from llmgw.control.up import UpError, UpOptions, run_up

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
        model_name=model_name,
        engine_args=engine_args,
        llamacpp_bin=llamacpp_bin,
        context_tokens=context_tokens,
        slots=slots,
    )
    try:
        trio.run(run_up, options)
    except* (WeightsMismatch, FileNotFoundError, ValueError, UpError) as group:
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

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            with httpx.Client(base_url=self.base_url, timeout=ADMIN_TIMEOUT_S) as client:
                response = client.request(
                    method, path, headers={"authorization": f"Bearer {self.key}"}, **kwargs
                )
        except httpx.HTTPError as exc:
            raise click.ClickException(
                f"cannot reach the admin API at {self.base_url} ({exc}); is llmgw running?"
            ) from exc
        try:
            doc = response.json()
        except ValueError:
            doc = {"error": {"message": response.text}}
        if response.status_code >= 400:
            message = (
                doc.get("error", {}).get("message", response.text) if isinstance(doc, dict) else doc
            )
            raise click.ClickException(f"{response.status_code}: {message}")
        return doc


def _print_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


@cli.group()
def keys() -> None:
    """Client API keys."""


@keys.command("create")
@click.argument("name")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def keys_create(name: str, data_dir: Path, as_json: bool) -> None:
    """Make a key called NAME and print its secret (shown only this once)."""
    doc = AdminClient(data_dir).call("POST", "/api/v1/keys", json={"name": name})
    if as_json:
        _print_json(doc)
        return
    click.echo(doc["key"])
    click.echo(
        f"key {doc['id']} ({doc['name']}): keep the secret above; it is not shown again", err=True
    )


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
        click.echo(f"{key['id']}  {key['prefix']}…  {state}{admin}  {key['name']}")


@keys.command("revoke")
@click.argument("key_id")
@_data_dir_option()
def keys_revoke(key_id: str, data_dir: Path) -> None:
    """Revoke the key KEY_ID; it is refused at once."""
    AdminClient(data_dir).call("POST", f"/api/v1/keys/{key_id}/revoke")
    click.echo(f"revoked {key_id}")


@cli.group()
def ctl() -> None:
    """Read and steer a running llmgw."""


@ctl.command("usage")
@_data_dir_option()
@click.option("--last", default=20, show_default=True, help="How many rows, newest first.")
@click.option("--key", "key_id", default=None, help="Only this key's rows.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ctl_usage(data_dir: Path, last: int, key_id: str | None, as_json: bool) -> None:
    """List the newest usage rows."""
    params: dict[str, Any] = {"last": last}
    if key_id:
        params["key_id"] = key_id
    doc = AdminClient(data_dir).call("GET", "/api/v1/usage", params=params)
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


@ctl.command("status")
@_data_dir_option()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ctl_status(data_dir: Path, as_json: bool) -> None:
    """Nodes and replicas."""
    doc = AdminClient(data_dir).call("GET", "/api/v1/status")
    if as_json:
        _print_json(doc)
        return
    click.echo(f"leader: {'yes' if doc['leader'] else 'no'}")
    for node in doc["nodes"]:
        link = "connected" if node["connected"] else "DISCONNECTED"
        click.echo(
            f"node {node['node_id']} ({node['address']}): {link}, {node['cpu_count']} CPUs, "
            f"{node['memory_total_mb']} MiB, {node['gpus']} GPUs"
        )
    for rep in doc["replicas"]:
        reason = f" — {rep['reason']}" if rep["reason"] else ""
        click.echo(
            f"replica {rep['replica_id']} on {rep['node_id']}:{rep['port']}: {rep['state']}{reason}"
        )


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
    from llmgw.engines import sim

    sys.exit(sim.main(list(ctx.args)))


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


def main() -> None:
    """Entry point of the ``llmgw`` command."""
    cli()

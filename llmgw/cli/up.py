"""``llmgw up``: the control plane, an agent and a model on this machine
(``docs/up.md``)."""

from __future__ import annotations

import threading
from pathlib import Path

import click

from llmgw import errors

from .errors import first_leaf
from .options import checked_store, data_dir_option, store_option

__all__ = ["up"]


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(
            f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:8080)", param_hint=name
        )


def _hash_starter_model(data_dir: Path) -> threading.Thread:
    """Start hashing the starter GGUF in ``data_dir/weights`` (when it is
    there) in a thread (:func:`~llmgw.agent.weights.sha256_once`); errors
    are left to the check that follows."""
    from llmgw.agent.weights import sha256_once, starter_model_path

    def run() -> None:
        try:
            sha256_once(starter_model_path(data_dir / "weights"))
        except OSError:
            pass

    thread = threading.Thread(target=run, name="llmgw-hash-starter", daemon=True)
    thread.start()
    return thread


def _parse_range(value: str) -> tuple[int, int]:
    low, _, high = value.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a port range like 20000-20999") from None
    if not 1 <= first <= last <= 65535:
        raise click.BadParameter(f"{value!r} is not a port range like 20000-20999")
    return first, last


@click.command()
@data_dir_option()
@store_option()
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
    store: str | None,
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
    for name, value in (
        ("--listen", listen),
        ("--admin-listen", admin_listen),
        ("--metrics-listen", metrics_listen),
        ("--agent-listen", agent_listen),
    ):
        _check_address(name, value)
    store = checked_store(store)
    click.echo(f"llmgw: starting (data in {data_dir})", err=True)
    # The starter model is hashed while the control plane's modules load
    # (about a second); its check then finds the digest.
    hashing = _hash_starter_model(data_dir) if engine == "llamacpp" and model is None else None

    import trio

    from llmgw.app.up import UpOptions, run_up

    if hashing is not None:
        hashing.join()

    options = UpOptions(
        data_dir=data_dir,
        store=store,
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
    # ValueError covers InvalidInput (a bad setting or catalog entry);
    # AgentError a weights mismatch; StartupError a busy data directory.
    except* (errors.StartupError, errors.AgentError, FileNotFoundError, ValueError) as group:
        raise click.ClickException(errors.describe(first_leaf(group))) from None
    except* OSError as group:
        raise click.ClickException(
            f"cannot listen: {errors.describe(first_leaf(group))} (is another llmgw running on these ports? see "
            "--listen and the other --…-listen options)"
        ) from None

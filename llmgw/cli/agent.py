"""``llmgw agent``: a node agent, run apart from the control plane."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from llmgw import errors

from .errors import first_leaf

if TYPE_CHECKING:
    from llmgw.agent.main import AgentConfig

__all__ = ["agent"]


@click.command("agent")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The node's agent.yaml ('llmgw join CODE' writes it): control planes, TLS files.",
)
@click.option(
    "--server",
    default=None,
    help="The control plane's agent hub, ws://HOST:7443/agent (with --token-file; "
    "for 'llmgw up --no-agent').",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
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
@click.option(
    "--install-engine",
    "install_engines",
    multiple=True,
    metavar="RECIPE",
    help="Install an engine (vllm, llamacpp-cu128) into its own environment with uv before "
    "registering; advertised once it installed and its probe passed (repeatable).",
)
@click.option(
    "--weights-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where models from Hugging Face or a mirror are fetched to (default: STATE_DIR/weights).",
)
def agent(
    config_path: Path | None,
    server: str | None,
    token_file: Path | None,
    node_id: str,
    state_dir: Path | None,
    llamacpp_bin: str | None,
    install_engines: tuple[str, ...],
    weights_dir: Path | None,
) -> None:
    """Run a node agent until SIGINT or SIGTERM; its engines keep running and
    the next agent on the same state directory adopts them."""
    import attrs

    from llmgw.agent.main import AgentConfig

    if config_path is not None:
        if server is not None or token_file is not None:
            raise click.UsageError(
                "--config takes no --server or --token-file (agent.yaml has them)"
            )
        from llmgw.agent.config import agent_config, load_agent_yaml

        try:
            config = agent_config(load_agent_yaml(config_path))
        except errors.InvalidInput as exc:
            raise click.ClickException(errors.describe(exc)) from None
        if node_id and node_id != config.node_id:
            raise click.ClickException(
                f"--node-id {node_id} but this node's certificate is for {config.node_id}"
            )
        config = attrs.evolve(
            config,
            state_dir=state_dir or config.state_dir,
            llamacpp_bin=llamacpp_bin or config.llamacpp_bin,
            engine_installs=tuple(dict.fromkeys((*config.engine_installs, *install_engines))),
            weights_dir=weights_dir or config.weights_dir,
        )
        _run(config)
        return
    if server is None or token_file is None:
        raise click.UsageError("give --config agent.yaml, or --server and --token-file")
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
        engine_installs=tuple(dict.fromkeys(install_engines)),
        weights_dir=weights_dir,
    )
    _run(config)


def _run(config: AgentConfig) -> None:
    import trio

    from llmgw.agent.main import run_agent
    from llmgw.agent.state import StateDirBusy

    failure = ""
    try:
        trio.run(run_agent, config)
    except* (StateDirBusy, OSError) as group:
        # Raised after the try: raised inside ``except*`` it would be wrapped
        # in a group again and print as a traceback.
        failure = errors.describe(first_leaf(group))
    if failure:
        raise click.ClickException(failure)

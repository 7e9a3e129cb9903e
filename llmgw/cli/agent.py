"""``llmgw agent``: a node agent, run apart from the control plane."""

from __future__ import annotations

from pathlib import Path

import click

from llmgw import errors

from .errors import first_leaf

__all__ = ["agent"]


@click.command("agent")
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
        raise click.ClickException(errors.describe(first_leaf(group))) from None

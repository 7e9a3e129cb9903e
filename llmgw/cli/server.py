"""``llmgw server``: the control plane alone, for a cluster of machines
(``docs/cluster.md``)."""

from __future__ import annotations

from pathlib import Path

import click

from llmgw import errors

from .errors import first_leaf
from .options import checked_store, data_dir_option, store_option
from .up import _check_address, _parse_range

__all__ = ["server"]


@click.command()
@data_dir_option()
@store_option()
@click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Settings file (YAML; default DATA_DIR/server.yaml when it exists).",
)
@click.option("--listen", default="0.0.0.0:8080", show_default=True, help="Client API HOST:PORT.")
@click.option(
    "--admin-listen", default="127.0.0.1:9090", show_default=True, help="Admin API HOST:PORT."
)
@click.option(
    "--metrics-listen", default="0.0.0.0:9091", show_default=True, help="Prometheus HOST:PORT."
)
@click.option(
    "--agent-listen",
    default="0.0.0.0:7443",
    show_default=True,
    help="Agents' hub HOST:PORT (wss, mutual TLS).",
)
@click.option(
    "--join-listen",
    default="0.0.0.0:7444",
    show_default=True,
    help="Join HOST:PORT (HTTPS), where 'llmgw join CODE' gets a node's certificate.",
)
@click.option(
    "--advertise",
    multiple=True,
    metavar="NAME_OR_ADDR",
    help="A name or address nodes reach this machine by (repeatable): added to its "
    "certificate and put first in join codes.",
)
@click.option("--engine-ports", default="20000-20999", show_default=True, help="Engine port range.")
@click.option(
    "--lease-ttl",
    default=None,
    metavar="DURATION",
    help="The leader lease's TTL (seconds, or 10s): a killed leader is replaced about this long "
    "after; renewed every third of it (default: the settings' ha.lease_ttl_s, 10 s).",
)
def server(
    data_dir: Path,
    store: str | None,
    config: Path | None,
    listen: str,
    admin_listen: str,
    metrics_listen: str,
    agent_listen: str,
    join_listen: str,
    advertise: tuple[str, ...],
    engine_ports: str,
    lease_ttl: str | None,
) -> None:
    """Run the control plane alone (no agent, no model unless configured);
    machines join it with 'llmgw node add' here and 'llmgw join CODE' there."""
    for name, value in (
        ("--listen", listen),
        ("--admin-listen", admin_listen),
        ("--metrics-listen", metrics_listen),
        ("--agent-listen", agent_listen),
        ("--join-listen", join_listen),
    ):
        _check_address(name, value)
    for value in advertise:
        if not value or any(c.isspace() or c in "/@" for c in value):
            raise click.BadParameter(
                f"{value!r} is not a host name or an address (e.g. gpu-cp.example.com, 10.0.0.1)",
                param_hint="--advertise",
            )
    lease_ttl_s = None if lease_ttl is None else _lease_ttl_s(lease_ttl)
    store = checked_store(store)
    click.echo(f"llmgw: starting the control plane (data in {data_dir})", err=True)

    import trio

    from llmgw.app.server import ServerOptions, run_server

    options = ServerOptions(
        data_dir=data_dir,
        store=store,
        config=config,
        listen=listen,
        admin_listen=admin_listen,
        metrics_listen=metrics_listen,
        agent_listen=agent_listen,
        join_listen=join_listen,
        advertise=advertise,
        engine_ports=_parse_range(engine_ports),
        lease_ttl_s=lease_ttl_s,
    )
    try:
        trio.run(run_server, options)
    # ValueError covers a bad settings file; StartupError a busy data
    # directory or a port in use.
    except* (errors.StartupError, errors.StoreError, ValueError) as group:
        raise click.ClickException(errors.describe(first_leaf(group))) from None
    except* OSError as group:
        raise click.ClickException(
            f"cannot listen: {errors.describe(first_leaf(group))} (is another llmgw running on these ports? see "
            "--listen and the other --…-listen options)"
        ) from None


def _lease_ttl_s(value: str) -> float:
    """``--lease-ttl``'s seconds.

    Raises:
        click.BadParameter: not a duration, or shorter than the settings allow.
    """
    from llmgw.settings import HaSettings

    try:
        return HaSettings(lease_ttl_s=value).lease_ttl_s
    except ValueError as exc:
        raise click.BadParameter(
            f"{value!r}: {exc} (a number of seconds, or like 10s)", param_hint="--lease-ttl"
        ) from None

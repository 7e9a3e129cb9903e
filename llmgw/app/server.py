"""``llmgw server``: the control plane alone, as an operator runs it on a
server (``docs/cluster.md``).

No agent runs in the process and no model is added: the catalog is the
store's (``llmgw ctl model add``, or ``server.yaml``'s settings). Nodes
join over the network (``llmgw node add`` on this machine, ``llmgw join
CODE`` on the node) and link to the agents' hub over mutual TLS. The rest
is ``llmgw up``'s (:mod:`llmgw.app.process`): the data directory's lock,
the store, the first start's admin token, client key and price, ``run.json``,
a listen address in use refused in one line before anything starts, the
signals and the bounded graceful stop.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

import attrs
import trio

from llmgw.control.cluster import Cluster

from .control_plane import ServerConfig
from .process import (
    Beside,
    DataDirLock,
    Say,
    Started,
    check_listeners,
    load_process_settings,
    serve_process,
)

__all__ = ["ServerOptions", "run_server"]

#: How often the "ready" line looks again without a change of the cluster, in seconds.
PROGRESS_POLL_S: Final = 0.2


@attrs.frozen(kw_only=True)
class ServerOptions:
    """What ``llmgw server`` was asked for (see ``llmgw server --help``)."""

    data_dir: Path
    config: Path | None = None
    listen: str = "0.0.0.0:8080"
    admin_listen: str = "127.0.0.1:9090"
    metrics_listen: str = "0.0.0.0:9091"
    agent_listen: str = "0.0.0.0:7443"
    join_listen: str = "0.0.0.0:7444"
    #: Extra names or addresses of this machine for its certificate, put
    #: first in join codes.
    advertise: tuple[str, ...] = ()
    engine_ports: tuple[int, int] = (20000, 20999)
    grace_s: float = 10.0
    #: The store's address (``--store``); ``None``: SQLite in ``DATA_DIR/llmgw.db``.
    store: str | None = None
    #: The leader lease's TTL in seconds (``--lease-ttl``); ``None``: the
    #: settings file's ``ha.lease_ttl_s``.
    lease_ttl_s: float | None = None


def _say_to_stderr(text: str) -> None:
    print(f"llmgw: {text}", file=sys.stderr, flush=True)


def server_listeners(options: ServerOptions) -> tuple[tuple[str, str, str], ...]:
    """``(address, what, option)`` of each listener, for :func:`check_listeners`."""
    return (
        (options.listen, "client API", "--listen"),
        (options.admin_listen, "admin API", "--admin-listen"),
        (options.metrics_listen, "metrics", "--metrics-listen"),
        (options.agent_listen, "agents' hub", "--agent-listen"),
        (options.join_listen, "join", "--join-listen"),
    )


async def run_server(options: ServerOptions, say: Say = _say_to_stderr) -> None:
    """Run the control plane until a signal; see the module docstring.

    Raises:
        StartError: the data directory is in use by another process, or a
            listen address cannot be bound (a port in use, …).
        SettingsError: the settings file is not valid (a ``ValueError``).
        StoreError: the store cannot be opened.
        OSError: the data directory cannot be written.
    """
    started = trio.current_time()
    data_dir = options.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_process_settings(data_dir, options.config, say)
    with DataDirLock(data_dir, "llmgw server"):
        check_listeners(server_listeners(options))
        config = ServerConfig(
            listen=options.listen,
            admin_listen=options.admin_listen,
            metrics_listen=options.metrics_listen,
            agent_listen=options.agent_listen,
            join_listen=options.join_listen,
            advertise=options.advertise,
            engine_ports=options.engine_ports,
            grace_s=options.grace_s,
            settings=loaded.settings
            if options.lease_ttl_s is None
            else attrs.evolve(
                loaded.settings,
                ha=attrs.evolve(loaded.settings.ha, lease_ttl_s=options.lease_ttl_s),
            ),
            settings_source=None if loaded.source is None else str(loaded.source),
            data_dir=data_dir,
        )

        async def start(running: Started, nursery: trio.Nursery) -> None:
            addresses = running.addresses
            say(
                f"control plane listening: API {addresses.base_url}, admin http://{addresses.admin}, "
                f"metrics http://{addresses.metrics}/metrics, agents wss://{addresses.agent_hub}/agent, "
                f"join https://{addresses.join}"
            )
            nursery.start_soon(_report_ready, running.cluster, addresses.base_url, started, say)

        await serve_process(
            config,
            data_dir,
            loaded.price_given,
            Beside(start=start),
            say,
            store_address=options.store,
        )


async def _report_ready(cluster: Cluster, base_url: str, started: float, say: Say) -> None:
    """Say "ready in N s" once this control plane leads (what ``GET /ready``
    asks), and again each time it leads after it stopped."""
    said = False
    while True:
        changed = cluster.changed
        if cluster.is_leader and not said:
            said = True
            elapsed_s = trio.current_time() - started
            say(
                f"ready in {elapsed_s:.1f} s: the API answers at {base_url}/v1; "
                "'llmgw node add' prints the line that joins a machine"
            )
        elif not cluster.is_leader:
            said = False
        with trio.move_on_after(PROGRESS_POLL_S):
            await changed.wait()

"""The control plane's nursery: gateway, admin API, metrics, agents' hub,
live settings, usage journal and writer, replicas' engine metrics and (while leading)
the reconciler, wired together over one store and one :class:`Cluster`.

``serve_control_plane`` is what ``llmgw up`` runs. Its stop is graceful:
when ``stop`` is set the listeners stop taking requests, requests in flight
get ``grace_s`` to finish, and the usage writer flushes.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Final

import attrs
import trio
from prometheus_client import make_asgi_app

from llmgw import metrics
from llmgw.accounting.accountant import Accountant, catch_up_budgets, restore_budgets
from llmgw.accounting.journal import UsageJournal, serve_journal_committer
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter, serve_usage_writer
from llmgw.admin.app import make_admin_app
from llmgw.admin.keys import KeysService
from llmgw.agent.joincode import join_address as join_address_of
from llmgw.auth.admin_token import ADMIN_TOKEN_FILE, AdminTokenFile
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.people import People
from llmgw.auth.tree import ScopeResolver
from llmgw.control.ca import ClusterCA, server_names
from llmgw.control.ca_store import sync_cluster_ca
from llmgw.control.cluster import Cluster
from llmgw.control.hub import HubTLS, serve_agent_hub, serve_standby_links
from llmgw.control.join import JoinService, hub_urls, reachable_hosts, serve_join
from llmgw.control.leader_record import LeaderView, serve_leader_view
from llmgw.control.live import LiveSettings, serve_settings
from llmgw.control.reconciler import PortRange
from llmgw.errors import StartupError, StoreError
from llmgw.gateway.app import Gateway
from llmgw.gateway.forward import LeaderForward
from llmgw.gateway.server import serve_http1
from llmgw.portal.app import make_portal_app
from llmgw.router.engine_metrics import serve_engine_metrics
from llmgw.settings import ServerSettings
from llmgw.store import Store

from .leadership import lease_holder, release_leadership, serve_leadership
from .listen import serve_asgi, split_address, with_lifespan
from .pages import with_pages

__all__ = ["Addresses", "ServerConfig", "serve_control_plane"]

log = logging.getLogger("llmgw.control")

#: Requests in flight get this long to finish after a stop, in seconds.
GRACE_S: Final = 10.0
#: How long the hub waits for the agents of this process to stop, in seconds.
AGENTS_STOP_S: Final = 3.0
#: The first admin's sign-in address unless LLMGW_ADMIN_EMAIL says otherwise.
FIRST_ADMIN_EMAIL: Final = "admin@localhost"
#: The usage journal's folder, in the data directory.
JOURNAL_DIR: Final = "usage-journal"
#: After it comes to lead, how long a control plane under ``llmgw server``
#: holds a request for a model with no ready replica while its nodes link
#: to it (a second or two after a takeover), in seconds.
SETTLE_S: Final = 5.0


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Where the control plane listens (``host:port``; port 0 = any free one)."""

    listen: str = "127.0.0.1:8080"
    admin_listen: str = "127.0.0.1:9090"
    metrics_listen: str = "127.0.0.1:9091"
    agent_listen: str = "127.0.0.1:7443"
    engine_ports: PortRange = (20000, 20999)
    grace_s: float = GRACE_S
    #: The seed of the live settings (``server.yaml``); the store's document wins.
    settings: ServerSettings = attrs.field(factory=ServerSettings)
    #: The file ``settings`` came from; ``None`` = the defaults (no file).
    settings_source: str | None = None
    #: Where weights, the usage journal and the admin token (``admin-token``)
    #: live; ``None`` = the SQLite store's folder.
    data_dir: Path | None = None
    #: Where the join server listens (``llmgw server``); ``None`` = none (``llmgw up``).
    join_listen: str | None = None
    #: Extra names or addresses of this machine for its certificate, put
    #: first in join codes (``llmgw server --advertise``).
    advertise: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Addresses:
    """Where the control plane really listens, once started (``host:port``
    each), and the token agents present to the hub."""

    api: str
    admin: str
    metrics: str
    agent_hub: str
    agent_token: str
    #: The join port (``host:port``); ``""`` when there is none.
    join: str = ""

    @property
    def base_url(self) -> str:
        return f"http://{self.api}"


async def serve_control_plane(
    config: ServerConfig,
    store: Store,
    cluster: Cluster,
    stop: trio.Event,
    *,
    listeners_closed: trio.Event | None = None,
    agents_stopped: trio.Event | None = None,
    task_status: trio.TaskStatus[Addresses] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the control plane until ``stop`` is set, then stop gracefully.

    Args:
        config: listen addresses and the engine port range.
        store: an open store (migrated).
        cluster: the live view shared with the agents' hub and the router.
        stop: set it to stop (signals, tests).
        listeners_closed: set once every listener has closed (requests in
            flight finished or cut), before the rest of the stop.
        agents_stopped: when given, the agents' hub stays open until it is
            set (at most :data:`AGENTS_STOP_S` after the listeners closed):
            an agent in the same process (``llmgw up``) then ends its link
            as a stop instead of seeing the hub go away under it.

    Returns:
        Once every listener has closed, in-flight requests have finished (or
        the grace ran out) and the usage rows are written.
    """
    cluster.set_secret(
        await store.get_or_create_secret("engine-keys", lambda: secrets.token_bytes(32))
    )
    agent_token = (
        await store.get_or_create_secret("agent-token", lambda: secrets.token_hex(32).encode())
    ).decode()
    auth = config.settings.auth
    authenticator = KeyAuthenticator(store, cache_ttl_s=auth.cache_ttl)
    resolver = ScopeResolver(store, cache_ttl_s=auth.cache_ttl)
    accountant = Accountant(
        PriceBook(auth.pricing, auth.default_price),
        default_rpm=auth.default_rpm,
        default_tpm=auth.default_tpm,
    )
    store_path = getattr(store, "path", None)
    data_dir = config.data_dir or (Path(store_path).parent if store_path is not None else None)
    # Usage rows are durable in a local journal before a client gets the end
    # of its answer; without a data directory (a store in memory) they wait
    # in memory for the writer.
    journal = (
        UsageJournal(data_dir / JOURNAL_DIR, sync_interval_s=auth.usage_sync_interval)
        if data_dir is not None
        else None
    )
    usage = UsageWriter(buffer_size=auth.buffer_size, batch_size=auth.batch_size, journal=journal)
    if journal is not None and journal.closed_segments():
        # A crashed process's rows go into the store before the budgets are
        # read back from it, so its spend counts.
        try:
            await usage.flush(store)
        except (StoreError, OSError) as exc:
            log.error("usage journal not replayed yet (%s); the usage writer retries", exc)
        else:
            log.info("usage journal replayed into the store")
    await restore_budgets(store, accountant)
    holder = lease_holder()
    leader_view = LeaderView(holder)
    # Standbys forward /v1 to the leader under `llmgw server` (several
    # control planes of one store, docs/ha.md); `llmgw up` is one machine.
    forward = (
        LeaderForward(leader_view.leader_api, is_leader=lambda: cluster.routes_itself)
        if config.join_listen is not None
        else None
    )
    gateway = Gateway(
        authenticator=authenticator,
        cluster=cluster,
        usage=usage,
        accountant=accountant,
        resolver=resolver,
        forward=forward,
    )
    keys_service = KeysService(
        store,
        authenticator,
        resolver,
        auth,
        accountant,
        bands=lambda: [band.name for band in cluster.settings.router.admission.bands],
    )
    live = LiveSettings(store, cluster)
    people = await _people(store, authenticator)
    # The admin API opens to the token in DATA_DIR/admin-token only (no data
    # directory: to nothing).
    admin_token = AdminTokenFile(data_dir / ADMIN_TOKEN_FILE if data_dir is not None else None)
    join = await _join_service(config, store, cluster, data_dir)
    admin = make_admin_app(
        store,
        cluster,
        admin_token,
        keys_service,
        live=live,
        data_dir=data_dir,
        join=join,
        people=people,
        # Several control planes of one store: changes on the leader only.
        leader_hint=leader_view.describe if config.join_listen is not None else None,
        leader_view=leader_view,
    )
    metrics_app = with_lifespan(make_asgi_app(registry=metrics.REGISTRY))
    # The portal and the admin pages (docs/portal.md): one prefix dispatch in
    # front of each listener; /v1 and /api go on untouched.
    client_app = with_pages(
        gateway,
        make_portal_app(
            store, cluster, people, keys_service, resolver=resolver, accountant=accountant
        ),
    )
    admin_pages = with_pages(
        admin,
        make_portal_app(
            store,
            cluster,
            people,
            keys_service,
            admin_listener=True,
            resolver=resolver,
            accountant=accountant,
        ),
    )

    async with trio.open_nursery() as services:
        # Every control plane keeps its settings live, leader or not; the
        # store's document (seeded once from server.yaml) wins over the file.
        await services.start(
            partial(
                serve_settings,
                store,
                cluster,
                config.settings,
                seed_source=config.settings_source,
                live=live,
            )
        )
        if journal is not None:
            await services.start(serve_journal_committer, journal)
        await services.start(
            partial(serve_usage_writer, usage, store, flush_interval_s=auth.flush_interval)
        )
        hub_host, hub_port = split_address(config.agent_listen)
        hub_tls = _hub_tls(join, store, hub_host, config.advertise)
        bound_hub_port = await services.start(
            partial(
                serve_agent_hub,
                hub_host,
                hub_port,
                agent_token,
                cluster,
                tls=hub_tls,
                standby_hint=leader_view.hint,
            )
        )
        join_address = ""
        if join is not None and config.join_listen is not None:
            join.servers = hub_urls(reachable_hosts(hub_host, config.advertise), bound_hub_port)
            join_host, join_port = split_address(config.join_listen)
            bound_join_port = await services.start(
                partial(serve_join, join_host, join_port, join, advertise=config.advertise)
            )
            join_address = f"{join_host}:{bound_join_port}"
        await services.start(serve_leader_view, store, cluster, leader_view)
        if hub_tls is not None:
            await services.start(serve_standby_links, cluster)
        await services.start(
            partial(
                serve_leadership,
                store,
                cluster,
                holder,
                config.engine_ports,
                view=leader_view,
                ttl_s=config.settings.ha.lease_ttl_s,
                # Under `llmgw server` the nodes link over the network after
                # a takeover: requests wait for them a moment (docs/ha.md).
                settle_s=SETTLE_S if config.join_listen is not None else 0.0,
                on_lead=partial(_catch_up_budgets, store, accountant),
            )
        )
        # The replicas' KV-cache usage, for the long-context routing profile.
        await services.start(serve_engine_metrics, cluster)
        async with trio.open_nursery() as listeners:
            api = await listeners.start(
                serve_http1, client_app, config.listen, stop, config.grace_s
            )
            admin_address = await listeners.start(
                serve_asgi, admin_pages, config.admin_listen, stop, 2.0
            )
            metrics_address = await listeners.start(
                serve_asgi, metrics_app, config.metrics_listen, stop, 2.0
            )
            api_host, api_port = split_address(api)
            leader_view.set_own(
                join_address_of(reachable_hosts(api_host, config.advertise)[0], api_port),
                tuple(hub_urls(reachable_hosts(hub_host, config.advertise), bound_hub_port))
                if hub_tls is not None
                else (),
            )
            task_status.started(
                Addresses(
                    api=api,
                    admin=admin_address,
                    metrics=metrics_address,
                    agent_hub=f"{hub_host}:{bound_hub_port}",
                    agent_token=agent_token,
                    join=join_address,
                )
            )
            # The listeners return once `stop` is set and their requests are done.
        log.info("listeners closed; stopping the control plane")
        if listeners_closed is not None:
            listeners_closed.set()
        await gateway.aclose()
        await release_leadership(store, holder)
        if agents_stopped is not None:
            with trio.move_on_after(AGENTS_STOP_S):
                await agents_stopped.wait()
        services.cancel_scope.cancel()
    if journal is not None:
        journal.close()


async def _join_service(
    config: ServerConfig, store: Store, cluster: Cluster, data_dir: Path | None
) -> JoinService | None:
    """The join service when ``config`` has a join port, over the cluster CA
    kept in the store and copied to ``DATA_DIR/ca`` (made on the first start;
    every control plane of one store serves the same CA, :mod:`llmgw.control.ca_store`).

    Raises:
        StartupError: a join port without a data directory, or a CA that
            cannot be made or read.
    """
    if config.join_listen is None:
        return None
    if data_dir is None:
        raise StartupError(
            "a join port needs a data directory: the cluster CA lives in DATA_DIR/ca"
        )
    await sync_cluster_ca(store, data_dir / "ca")
    ca = ClusterCA.load_or_create(data_dir / "ca", server_names(config.advertise))
    return JoinService(ca, store, cluster, servers=())


def _hub_tls(
    join: JoinService | None, store: Store, hub_host: str, advertise: Sequence[str]
) -> HubTLS | None:
    """Mutual TLS for the agents' hub when this control plane has a cluster
    CA (``llmgw server``, which has a join port); ``None`` for ``llmgw up``
    (plain ws with the agent token on loopback)."""
    if join is None:
        return None
    return HubTLS(
        context=join.ca.server_ssl_context(client_certs=True),
        store=store,
        hosts=tuple(reachable_hosts(hub_host, advertise)),
    )


async def _people(store: Store, authenticator: KeyAuthenticator) -> People:
    """Accounts and sessions; on the first start (nobody in the store) the
    first admin, ``LLMGW_ADMIN_EMAIL`` (default ``admin@localhost``) with
    the password in ``LLMGW_ADMIN_PASSWORD``, else one made up and logged
    once (``docs/portal.md``)."""
    secret = await store.get_or_create_secret("portal-sessions", lambda: secrets.token_bytes(32))
    people = People(store, secret, authenticator)
    email = os.environ.get("LLMGW_ADMIN_EMAIL") or FIRST_ADMIN_EMAIL
    made = await people.ensure_first_admin(email, os.environ.get("LLMGW_ADMIN_PASSWORD") or None)
    if made:
        log.warning(
            "first admin %s made for the portal; its password, shown only this once: %s",
            email,
            made,
        )
    elif made == "":
        log.info("first admin %s made with the password in LLMGW_ADMIN_PASSWORD", email)
    return people


async def _catch_up_budgets(store: Store, accountant: Accountant) -> None:
    """On coming to lead: the budgets raised to the store's spend (what the
    previous leader served); a store that fails is logged, the counters
    kept as they are."""
    try:
        await catch_up_budgets(store, accountant)
    except StoreError as exc:
        log.warning("budgets not caught up with the store on leading (%s)", exc)
    else:
        log.info("budgets caught up with the store's spend on leading")

"""The control plane's nursery: gateway, admin API, metrics, agents' hub,
usage writer and (while leading) the reconciler.

``serve_control_plane`` is shared by ``llmgw server`` and ``llmgw up``. Its
stop is graceful: when ``stop`` is set the listeners stop taking requests,
requests in flight get ``grace_s`` to finish, and the usage writer flushes
(``shared/design/ARCHITECTURE.md``, Concurrency).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import make_asgi_app

from llmgw import metrics
from llmgw.accounting.accountant import Accountant
from llmgw.accounting.budgets import period_start
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter, serve_usage_writer
from llmgw.admin.app import make_admin_app
from llmgw.admin.keys import KeysService
from llmgw.asgi import answer_lifespan
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.gateway.app import Gateway
from llmgw.gateway.server import serve_http1
from llmgw.router.engine_metrics import serve_engine_metrics
from llmgw.settings import ServerSettings
from llmgw.store import Store, StoreError

from .cluster import Cluster
from .hub import serve_agent_hub
from .live import LiveSettings, serve_settings
from .reconciler import PortRange, serve_reconciler

__all__ = ["Addresses", "ServerConfig", "serve_control_plane"]

log = logging.getLogger("llmgw.control")

#: Requests in flight get this long to finish after a stop, in seconds.
GRACE_S: Final = 10.0
LEASE_NAME: Final = "leader"
LEASE_TTL_S: Final = 10.0


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
    #: Where weights live (model purge); ``None`` = the SQLite store's folder.
    data_dir: Path | None = None


@attrs.frozen(kw_only=True)
class Addresses:
    """Where the control plane really listens, once started."""

    api: str
    admin: str
    metrics: str
    agent_hub: str
    agent_token: str

    @property
    def base_url(self) -> str:
        return f"http://{self.api}"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve_asgi(
    app: Any,
    bind: str,
    stop: trio.Event,
    grace_s: float,
    *,
    task_status: trio.TaskStatus[str],
) -> None:
    """Serve ``app`` with hypercorn on ``bind`` until ``stop``; started with
    the bound ``host:port``. Returns once in-flight requests are done or
    ``grace_s`` ran out."""
    config = HypercornConfig()
    config.bind = [bind]
    config.graceful_timeout = grace_s
    config.accesslog = None
    config.errorlog = logging.getLogger("llmgw.http")
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(hypercorn_serve, app, config, shutdown_trigger=stop.wait)
        )
        task_status.started(binds[0].split("://", 1)[-1])


async def restore_budgets(store: Store, accountant: Accountant) -> None:
    """Budget counters rebuilt from the store's usage of this day and month
    (``shared/spec/accounting.md``, Start-up restore)."""
    now = time.time()
    spend: dict[tuple[str, str], int] = {}
    for period in ("day", "month"):
        since = period_start(period, now)
        for scope, micros in (await store.spend_since_by_scope(since)).items():
            spend[(scope, period)] = micros
    accountant.restore(spend, now)


def _with_lifespan(app: Any) -> Any:
    """``app`` plus answers to the ASGI ``lifespan`` scope, which hypercorn
    sends first (prometheus-client's app does not answer it)."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        await app(scope, receive, send)

    return wrapped


async def serve_control_plane(
    config: ServerConfig,
    store: Store,
    cluster: Cluster,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[Addresses] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the control plane until ``stop`` is set, then stop gracefully.

    Args:
        config: listen addresses and the engine port range.
        store: an open store (migrated).
        cluster: the live view shared with the agents' hub and the router.
        stop: set it to stop (signals, tests).

    Returns:
        Once every listener has closed, in-flight requests have finished (or
        the grace ran out) and the usage rows are written.
    """
    cluster.secret = await store.get_or_create_secret(
        "engine-keys", lambda: secrets.token_bytes(32)
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
    await restore_budgets(store, accountant)
    usage = UsageWriter(buffer_size=auth.buffer_size, batch_size=auth.batch_size)
    gateway = Gateway(
        authenticator=authenticator,
        cluster=cluster,
        usage=usage,
        accountant=accountant,
        resolver=resolver,
    )
    keys_service = KeysService(store, authenticator, resolver, auth, accountant)
    live = LiveSettings(store, cluster)
    store_path = getattr(store, "path", None)
    data_dir = config.data_dir or (Path(store_path).parent if store_path is not None else None)
    admin = make_admin_app(
        store, cluster, authenticator, keys_service, live=live, data_dir=data_dir
    )
    metrics_app = _with_lifespan(make_asgi_app(registry=metrics.REGISTRY))
    holder = f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(4)}"

    async with trio.open_nursery() as services:
        # Every control plane keeps its settings live, leader or not; the
        # store's document (seeded once from server.yaml) wins over the file.
        await services.start(partial(serve_settings, store, cluster, config.settings, live=live))
        await services.start(
            partial(serve_usage_writer, usage, store, flush_interval_s=auth.flush_interval)
        )
        hub_host, hub_port = _split(config.agent_listen)
        bound_hub_port = await services.start(
            serve_agent_hub, hub_host, hub_port, agent_token, cluster
        )
        await services.start(_serve_leadership, store, cluster, holder, config.engine_ports)
        # The replicas' KV-cache usage, for the long-context routing profile.
        await services.start(serve_engine_metrics, cluster)
        async with trio.open_nursery() as listeners:
            api = await listeners.start(serve_http1, gateway, config.listen, stop, config.grace_s)
            admin_address = await listeners.start(serve_asgi, admin, config.admin_listen, stop, 2.0)
            metrics_address = await listeners.start(
                serve_asgi, metrics_app, config.metrics_listen, stop, 2.0
            )
            task_status.started(
                Addresses(
                    api=api,
                    admin=admin_address,
                    metrics=metrics_address,
                    agent_hub=f"{hub_host}:{bound_hub_port}",
                    agent_token=agent_token,
                )
            )
            # The listeners return once `stop` is set and their requests are done.
        log.info("listeners closed; stopping the control plane")
        await gateway.aclose()
        with trio.CancelScope(shield=True):
            await store.release_lease(LEASE_NAME, holder)
        services.cancel_scope.cancel()


async def _serve_leadership(
    store: Store,
    cluster: Cluster,
    holder: str,
    engine_ports: PortRange,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Hold the leader lease; while leading, run the reconciler.

    With SQLite there is one control plane and it always leads; the lease
    row exists anyway so the code path is the same (ha-and-leader.md).
    """
    started = False

    def ready() -> None:
        nonlocal started
        if not started:
            task_status.started()
            started = True

    while True:
        try:
            lease = await store.acquire_lease(LEASE_NAME, holder, LEASE_TTL_S, time.time())
        except StoreError as exc:
            log.warning("cannot reach the store to take the leader lease (%s); retrying", exc)
            cluster.is_leader = False
            ready()
            await trio.sleep(1)
            continue
        if lease is None:
            cluster.is_leader = False
            ready()
            await trio.sleep(LEASE_TTL_S / 3)
            continue
        cluster.is_leader = True
        log.info("leading (lease epoch %d)", lease.epoch)
        async with trio.open_nursery() as leading:
            await leading.start(serve_reconciler, store, cluster, engine_ports)
            ready()
            expires_at = lease.expires_at
            while True:
                await trio.sleep(LEASE_TTL_S / 3)
                try:
                    renewed = await store.acquire_lease(
                        LEASE_NAME, holder, LEASE_TTL_S, time.time()
                    )
                except StoreError as exc:
                    if time.time() < expires_at:
                        log.warning("leader lease not renewed (%s); still held, retrying", exc)
                        continue
                    renewed = None
                if renewed is None:
                    log.error("lost the leader lease; stopping leader-only work")
                    cluster.is_leader = False
                    leading.cancel_scope.cancel()
                    break
                expires_at = renewed.expires_at

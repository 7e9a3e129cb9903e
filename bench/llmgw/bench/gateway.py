"""``llmgw bench gateway``: the gateway alone, in front of one fixed engine.

The overhead benchmark runs this as its own process (pinned to its own core)
so what it measures is the gateway: the same :class:`~llmgw.gateway.app.Gateway`
as ``llmgw up``, with a key checked on every request, over a static endpoint
instead of a reconciler and agents. Modes (figures in ``docs/performance.md``,
"Overhead (llmgw bench overhead)"):

- ``bare``: a key, no accounting (no usage rows);
- ``accounted``: what ``llmgw up`` does per request: the key's path in the
  tenancy tree, its rate limits and budgets checked and settled at every
  level (set high enough never to refuse), the cost at a price, and a usage
  row made durable in the usage journal (one fdatasync per group) and
  written by the batching writer into a SQLite store; the guard runs the
  default ``baseline`` policy, as on ``llmgw up``;
- ``unguarded``: ``accounted`` with the guard off (``guard.enabled: false``);
- ``observe``: ``accounted`` with the ``observe`` policy on both directions
  instead of ``baseline`` (every pattern recorded, nothing held back);
- ``portal``: ``accounted`` behind the pages' prefix dispatch, as the client
  port of ``llmgw up`` serves it (:func:`llmgw.app.pages.with_pages` with the
  portal's app beside the gateway): what the pages add to ``/v1``.

On start it prints one JSON line to stdout: ``{"listen": "HOST:PORT",
"key": "sk-llmgw-…", "pid": N}``; it runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import attrs
import trio

from llmgw.accounting.accountant import Accountant
from llmgw.accounting.journal import UsageJournal, serve_journal_committer
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter, serve_usage_writer
from llmgw.admin.keys import KeysService
from llmgw.app.pages import App, with_pages
from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.auth.people import People
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster
from llmgw.gateway.app import Gateway
from llmgw.gateway.server import serve_http1
from llmgw.guard import Guards
from llmgw.portal.app import make_portal_app
from llmgw.router.endpoint import Endpoint
from llmgw.settings import AuthSettings, Price, settings_from_doc
from llmgw.store import ModelRecord, Store, open_store
from llmgw.store.records import Limits

__all__ = ["MODES", "run_bench_gateway"]

MODES: Final = ("bare", "accounted", "unguarded", "observe", "portal")
#: The ``guard`` settings of the modes that set them.
_GUARD: Final = {"unguarded": {"enabled": False}, "observe": {"default": ["observe"]}}
#: A price for the benchmark's model, so costs and budgets are computed.
BENCH_PRICE: Final = Price(prompt_per_1k=100, cached_per_1k=10, completion_per_1k=400)


async def run_bench_gateway(
    *,
    engine_url: str,
    engine_key: str,
    model: str,
    listen: str,
    mode: str,
    data_dir: Path,
    store_address: str | None = None,
) -> None:
    """Serve until a signal; see the module docstring. The store is
    ``store_address`` (a PostgreSQL address, ``docs/store.md``) when given,
    else SQLite in ``data_dir``; the usage journal stays in ``data_dir``.

    Raises:
        ValueError: an unknown mode or an engine URL without host and port.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    # Its output lands in the middle of the benchmark's table: only what matters.
    logging.getLogger("llmgw.store").setLevel(logging.WARNING)
    parts = urlsplit(engine_url)
    if not parts.hostname or not parts.port:
        raise ValueError(f"--engine-url {engine_url!r} needs a host and a port")
    stop = trio.Event()
    async with open_store(store_address or str(data_dir / "llmgw.db")) as store:
        now = time.time()
        path, _ = await store.ensure_project("bench", "bench", mode, now)
        # Limits high enough never to refuse, set at every level, so the
        # accounted mode runs every counter a real tenant would.
        roomy = Limits(rpm=10**9, tpm=10**12, budget_day_micros=10**15, budget_month_micros=10**16)
        for scope, level_id in (
            ("org", path.org.id),
            ("team", path.team.id),
            ("project", path.project.id),
        ):
            await store.set_limits(scope, level_id, roomy)  # type: ignore[arg-type]
        secret, record = new_key(f"bench-{mode}")
        await store.insert_key(attrs.evolve(record, project_id=path.project.id, limits=roomy))
        cluster = Cluster()
        cluster.set_leader(True)
        cluster.replace_catalog(
            {
                model: ModelRecord.simple(
                    # slots=0: the bench's engine runs any number at once, so
                    # admission never queues (its capacity is unbounded).
                    model,
                    "sim",
                    slots=0,
                    created_at=time.time(),
                )
            }
        )
        cluster.set_fixed_endpoints(
            {
                model: [
                    Endpoint(
                        replica_id=f"{model}-static",
                        model=model,
                        host=parts.hostname,
                        port=parts.port,
                        api_key=engine_key,
                    )
                ]
            }
        )
        if mode in _GUARD:
            cluster.apply_settings(settings_from_doc({"guard": _GUARD[mode]}))
        # Read what the guard reads once per process (person names' lists)
        # before serving, as a long-running gateway has: not in the figures.
        Guards().for_request(cluster.settings.guard, "", ("", "", ""))
        accounted = mode != "bare"
        # As `llmgw up` runs it: each row made durable in the usage journal
        # before the end of its answer goes out.
        journal = UsageJournal(data_dir / "usage-journal") if accounted else None
        usage = UsageWriter(journal=journal)
        gateway = Gateway(
            authenticator=KeyAuthenticator(store),
            cluster=cluster,
            usage=usage,
            accounting=accounted,
            accountant=Accountant(PriceBook({model: BENCH_PRICE})) if accounted else None,
            resolver=ScopeResolver(store) if accounted else None,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, stop)
            if journal is not None:
                await nursery.start(serve_journal_committer, journal)
                await nursery.start(serve_usage_writer, usage, store)
            async with trio.open_nursery() as listeners:
                served: App = gateway
                if mode == "portal":
                    served = _with_portal(gateway, store, cluster)
                address = await listeners.start(serve_http1, served, listen, stop, 2.0)
                print(
                    json.dumps({"listen": address, "key": secret, "pid": os.getpid()}), flush=True
                )
            # The listener is closed and its requests are done: the usage
            # writer flushes as it is cancelled.
            nursery.cancel_scope.cancel()
        await gateway.aclose()


def _with_portal(gateway: Gateway, store: Store, cluster: Cluster) -> App:
    """``gateway`` behind the pages' dispatch, as ``llmgw up``'s client port."""
    authenticator = KeyAuthenticator(store)
    resolver = ScopeResolver(store)
    keys = KeysService(store, authenticator, resolver, AuthSettings(), bands=lambda: [])
    people = People(store, os.urandom(32), authenticator)
    return with_pages(gateway, make_portal_app(store, cluster, people, keys))


async def _stop_on_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()
            return

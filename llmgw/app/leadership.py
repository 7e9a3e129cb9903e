"""Leadership: the leader lease in the store, and the leader-only work run
while it is held: the reconciler and the usage retention (raw usage rows
past ``auth.usage_retain_days`` pruned in short batches).

Every control plane tries to take the lease named :data:`LEASE_NAME`; the one
holding it leads and runs the leader-only work, the others serve requests
only.
With SQLite there is one control plane and it always leads; the lease row
exists anyway so the code path is the same.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from functools import partial
from typing import Final, NoReturn

import trio

from llmgw.accounting.retention import serve_usage_retention
from llmgw.control.cluster import Cluster
from llmgw.control.reconciler import PortRange, serve_reconciler
from llmgw.store import Store, StoreError

__all__ = ["LEASE_NAME", "LEASE_TTL_S", "lease_holder", "release_leadership", "serve_leadership"]

log = logging.getLogger("llmgw.control")

LEASE_NAME: Final = "leader"
#: How long a taken or renewed lease holds, in seconds; it is renewed every
#: third of that.
LEASE_TTL_S: Final = 10.0
#: How long giving the lease up at a stop may take, in seconds.
RELEASE_TIMEOUT_S: Final = 1.5


def lease_holder() -> str:
    """A holder name unique to this process: ``host:pid:random``."""
    return f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(4)}"


async def release_leadership(store: Store, holder: str) -> None:
    """Give the lease up at once (shielded from cancellation), so another
    control plane need not wait for it to expire. Bounded by
    :data:`RELEASE_TIMEOUT_S`: a store that is locked or down is given up
    on (logged; the lease then expires after :data:`LEASE_TTL_S`), so a
    stop stays bounded (``docs/up.md``, Stopping)."""
    with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S) as waited:
        try:
            await store.release_lease(LEASE_NAME, holder)
        except StoreError as exc:
            log.warning("leader lease not released (%s); it expires by itself", exc)
    if waited.cancelled_caught:
        log.warning(
            "leader lease not released within %g s; it expires by itself", RELEASE_TIMEOUT_S
        )


async def serve_leadership(
    store: Store,
    cluster: Cluster,
    holder: str,
    engine_ports: PortRange,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Hold the leader lease as ``holder``; while leading, run the reconciler
    with ``engine_ports`` and the usage retention (reading the live
    ``auth.usage_retain_days`` of ``cluster``'s settings). :meth:`Cluster.set_leader` says which, for the
    ``/ready`` and status answers.

    Started once the first attempt to take the lease is over (taken or not).
    A store that cannot be reached is retried every second; a lease held by
    another every third of :data:`LEASE_TTL_S`. A lease that cannot be
    renewed before it expires stops the leader-only work.

    Returns:
        Never returns unless cancelled.
    """
    started = False
    waiting_said = False

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
            cluster.set_leader(False)
            ready()
            await trio.sleep(1)
            continue
        if lease is None:
            if not waiting_said:
                # Said once per wait: with one store, the holder is a run
                # that ended without giving the lease up (killed).
                waiting_said = True
                log.info(
                    "the leader lease is held by another control plane (with one store: "
                    "a previous run that did not stop cleanly); waiting for it to expire "
                    "(up to %g s) before answering requests",
                    LEASE_TTL_S,
                )
            cluster.set_leader(False)
            ready()
            await trio.sleep(LEASE_TTL_S / 3)
            continue
        cluster.set_leader(True)
        waiting_said = False
        log.info("leading (lease epoch %d)", lease.epoch)
        async with trio.open_nursery() as leading:
            await leading.start(serve_reconciler, store, cluster, engine_ports)
            # The retention's deletes carry the lease: the store refuses them
            # once another control plane has taken it over (fencing).
            await leading.start(
                partial(
                    serve_usage_retention,
                    store,
                    lambda: cluster.settings.auth.usage_retain_days,
                    fence=lease,
                )
            )
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
                    cluster.set_leader(False)
                    leading.cancel_scope.cancel()
                    break
                expires_at = renewed.expires_at

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
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, NoReturn

import trio

from llmgw.accounting.retention import serve_usage_retention
from llmgw.control.cluster import Cluster
from llmgw.control.leader_record import LEADER_KEY, LeaderView
from llmgw.control.reconciler import PortRange, serve_reconciler
from llmgw.store import Fenced, Lease, Store, StoreError

__all__ = ["LEASE_NAME", "LEASE_TTL_S", "lease_holder", "release_leadership", "serve_leadership"]

log = logging.getLogger("llmgw.control")

LEASE_NAME: Final = "leader"
#: How long a taken or renewed lease holds, in seconds; it is renewed every
#: third of that.
LEASE_TTL_S: Final = 10.0
#: How often a standby tries to take the lease, in seconds (a conditional
#: update that changes nothing while the lease is held): a released lease
#: is taken within this, an expired one within this after its expiry.
STANDBY_POLL_S: Final = 0.25
#: A leader stops its leader-only work this long before its lease expires
#: by its own clock, when it could not renew it, in seconds.
EXPIRY_MARGIN_S: Final = 0.5
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
    view: LeaderView | None = None,
    ttl_s: float = LEASE_TTL_S,
    settle_s: float = 0.0,
    on_lead: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Hold the leader lease as ``holder``; while leading, run the reconciler
    with ``engine_ports`` and the usage retention (reading the live
    ``auth.usage_retain_days`` of ``cluster``'s settings), and write the
    leader's record to the store through ``view`` (where standbys find the
    leader). :meth:`Cluster.set_leader` says which, for the ``/ready`` and
    ``/leader`` answers, with ``settle_s`` (seconds in which requests for a
    model with no ready replica wait for the nodes to link). ``on_lead`` is
    awaited (in the leader's nursery, beside the work) each time it comes
    to lead: the budgets caught up with the store.

    Started once the first attempt to take the lease is over (taken or not).
    The lease is renewed every third of ``ttl_s``; a standby tries to take
    it every :data:`STANDBY_POLL_S` (a third of ``ttl_s`` when shorter):

    - a store that cannot be reached is retried every second; once it
      answers again a control plane that was not leading waits one round
      (a third of ``ttl_s``) before contending, giving the old leader the
      chance to renew;
    - a leader that cannot renew before the lease expires stops the
      leader-only work at once, at the expiry (half a second before, by its
      own clock), even when the store call is still hanging; the lease
      taken by another stops it at the renewal that finds it.

    Returns:
        Never returns unless cancelled.
    """
    started = False
    waiting_said = False
    outage = False
    # This control plane led until the store failed: it contends at once
    # when the store is back (the round skipped is for the others).
    led_last = False

    def ready() -> None:
        nonlocal started
        if not started:
            task_status.started()
            started = True

    while True:
        if outage:
            # The store answered nothing last time: see that it answers,
            # then skip one round before contending for the lease.
            try:
                await store.get_setting(LEADER_KEY)
            except StoreError:
                await trio.sleep(1)
                continue
            outage = False
            if not led_last:
                log.info(
                    "the store answers again; waiting one round before contending for the lease"
                )
                await trio.sleep(ttl_s / 3)
        try:
            lease = await store.acquire_lease(LEASE_NAME, holder, ttl_s, time.time())
        except StoreError as exc:
            log.warning("cannot reach the store to take the leader lease (%s); retrying", exc)
            cluster.set_leader(False)
            outage = True
            ready()
            await trio.sleep(1)
            continue
        if lease is None:
            if not waiting_said:
                # Said once per wait: with one store, the holder is a run
                # that ended without giving the lease up (killed); with
                # several control planes, the leader.
                waiting_said = True
                log.info(
                    "the leader lease is held by another control plane (with one control plane: "
                    "a previous run that did not stop cleanly); standing by until it expires "
                    "(%g s after its holder last renewed it)",
                    ttl_s,
                )
            cluster.set_leader(False)
            # Another control plane leads: a cut-off one stops routing here.
            cluster.set_cut_off(False)
            led_last = False
            ready()
            await trio.sleep(min(STANDBY_POLL_S, ttl_s / 3))
            continue
        waiting_said = False
        log.info("leading (lease epoch %d)", lease.epoch)
        reason = await _lead(
            store, cluster, lease, engine_ports, view, ttl_s, ready, settle_s, on_lead
        )
        cluster.set_leader(False)
        log.error("%s; stopped leader-only work", reason)
        led_last = reason.startswith("could not renew")
        outage = led_last
        # No other control plane can take the lease while the store is
        # down: this one keeps routing /v1 (not leader-only work) until the
        # store answers again.
        cluster.set_cut_off(led_last)
        if led_last:
            log.warning(
                "keeping on answering /v1 over the replicas known here until the store answers"
            )


def _deadline(expires_at: float) -> float:
    """The trio deadline for a lease expiring at ``expires_at`` (wall time),
    :data:`EXPIRY_MARGIN_S` early."""
    return trio.current_time() + (expires_at - time.time()) - EXPIRY_MARGIN_S


async def _lead(
    store: Store,
    cluster: Cluster,
    lease: Lease,
    engine_ports: PortRange,
    view: LeaderView | None,
    ttl_s: float,
    ready: Callable[[], None],
    settle_s: float = 0.0,
    on_lead: Callable[[], Awaitable[None]] | None = None,
) -> str:
    """Run the leader-only work under ``lease`` until it is lost or cannot
    be renewed before it expires; returns why it stopped.

    A watchdog ends the leadership at the expiry even while a renewal (a
    store call in a worker thread, which cancellation waits for) still
    hangs: :meth:`Cluster.set_leader` is cleared at once, and the work is
    cancelled."""
    reason = f"could not renew the leader lease before it expired (epoch {lease.epoch})"
    expiry = _deadline(lease.expires_at)
    async with trio.open_nursery() as leading:

        async def watchdog() -> None:
            while True:
                await trio.sleep_until(expiry)  # moved on by each renewal
                if trio.current_time() >= expiry:
                    break
            # Cut off first: /v1 keeps being answered here without a gap.
            cluster.set_cut_off(True)
            cluster.set_leader(False)
            leading.cancel_scope.cancel()

        async def renew() -> None:
            nonlocal reason, expiry
            while True:
                await trio.sleep(ttl_s / 3)
                try:
                    renewed = await store.acquire_lease(
                        LEASE_NAME, lease.holder, ttl_s, time.time()
                    )
                except StoreError as exc:
                    log.warning("leader lease not renewed (%s); still held, retrying", exc)
                    continue
                if renewed is None:
                    reason = f"lost the leader lease (epoch {lease.epoch}) to another control plane"
                    cluster.set_leader(False)
                    leading.cancel_scope.cancel()
                    return
                expiry = _deadline(renewed.expires_at)

        cluster.set_leader(True, settle_s=settle_s, lease=lease)
        cluster.set_cut_off(False)
        leading.start_soon(watchdog)
        if on_lead is not None:
            leading.start_soon(on_lead)
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
        if view is not None:
            leading.start_soon(_publish, store, view, lease)
        ready()
        leading.start_soon(renew)
    cluster.set_leader(False)
    return reason


async def _publish(store: Store, view: LeaderView, lease: Lease) -> None:
    """Write the leader's record, retrying while the store fails; a write
    refused by the fence ends it (the renewal notices the loss)."""
    while True:
        try:
            await view.publish(store, lease)
        except Fenced as exc:
            log.warning("the leader's record was refused: %s", exc)
            return
        except StoreError as exc:
            log.warning("cannot write the leader's record (%s); retrying", exc)
            await trio.sleep(1)
            continue
        return

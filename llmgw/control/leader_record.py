"""Where the leader is: a record the leader keeps in the store, read by the
standbys (``docs/ha.md``).

The leader writes :data:`LEADER_KEY` (a store setting) once it holds the
lease and knows its addresses, carrying the lease (``fence=lease``: a
deposed leader's write is refused by the store). It names the holder, the
lease epoch, the client API's address other control planes forward
``/v1`` to, and the agent hubs' URLs (the hint a standby gives an agent it
refuses). Standbys read it every :data:`READ_INTERVAL_S`
(:func:`serve_leader_view`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final, NoReturn

import attrs
import trio

from llmgw.store import Lease, Store, StoreError

from .cluster import Cluster

__all__ = ["LEADER_KEY", "READ_INTERVAL_S", "LeaderRecord", "LeaderView", "serve_leader_view"]

log = logging.getLogger("llmgw.control")

#: The store setting holding the leader's record.
LEADER_KEY: Final = "control.leader"
#: How often a standby reads the record, in seconds.
READ_INTERVAL_S: Final = 1.0


@attrs.frozen(kw_only=True)
class LeaderRecord:
    """The leader's record.

    Attributes:
        holder: the lease holder (``host:pid:random``).
        epoch: the lease epoch it was written under.
        api: the client API's ``host:port`` other control planes reach.
        hubs: the agent hubs' ``wss://`` URLs.
        since: when it came to lead (UTC epoch s); 0 when not known (a
            record of an older llmgw).
    """

    holder: str
    epoch: int
    api: str
    hubs: tuple[str, ...] = ()
    since: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "epoch": self.epoch,
            "api": self.api,
            "hubs": list(self.hubs),
            "since": self.since,
        }

    @classmethod
    def from_json(cls, doc: Any) -> LeaderRecord | None:
        """The record in ``doc``, or ``None`` when it is not one."""
        try:
            return cls(
                holder=str(doc["holder"]),
                epoch=int(doc["epoch"]),
                api=str(doc["api"]),
                hubs=tuple(str(u) for u in doc.get("hubs", ())),
                since=float(doc.get("since", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


class LeaderView:
    """What this control plane knows of the leader: its own addresses (set
    once it listens) and the record last read from the store.

    Attributes:
        holder: this control plane's lease holder name.
        own_api: this control plane's client API ``host:port`` for others
            (``""`` until it listens).
        own_hubs: its agent hubs' URLs.
        record: the leader's record last read (or written), ``None`` before.
    """

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.own_api = ""
        self.own_hubs: tuple[str, ...] = ()
        self.record: LeaderRecord | None = None
        self._addresses_known = trio.Event()

    def set_own(self, api: str, hubs: tuple[str, ...]) -> None:
        """This control plane's addresses, once it listens."""
        self.own_api, self.own_hubs = api, hubs
        self._addresses_known.set()

    def leader_api(self) -> str | None:
        """The leader's client API ``host:port``, or ``None`` when no other
        control plane is known to lead."""
        record = self.record
        if record is None or record.holder == self.holder or not record.api:
            return None
        return record.api

    def hint(self) -> str:
        """Where the leader's agent hub is, for an agent a standby refuses."""
        record = self.record
        if record is None or record.holder == self.holder:
            return "no leader is known yet"
        if record.hubs:
            return f"the leader is at {record.hubs[0]}"
        return f"the leader's API is at {record.api}"

    def describe(self) -> str:
        """Who leads, for an admin change a standby refuses: ``the leader
        is HOLDER, its client API at HOST:PORT`` or ``no leader is known
        yet``."""
        record = self.record
        if record is None or record.holder == self.holder:
            return "no leader is known yet"
        return f"the leader is {record.holder}, its client API at {record.api}"

    async def publish(self, store: Store, lease: Lease) -> None:
        """Write this control plane's record under ``lease`` once its
        addresses are known.

        Raises:
            Fenced: the lease changed hands meanwhile.
            StoreError: the store cannot be reached.
        """
        await self._addresses_known.wait()
        record = LeaderRecord(
            holder=self.holder,
            epoch=lease.epoch,
            api=self.own_api,
            hubs=self.own_hubs,
            since=time.time(),
        )
        await store.put_setting(LEADER_KEY, record.to_json(), fence=lease)
        self.record = record

    async def read(self, store: Store) -> None:
        """Read the leader's record from the store.

        Raises:
            StoreError: the store cannot be reached.
        """
        self.record = LeaderRecord.from_json(await store.get_setting(LEADER_KEY))


async def serve_leader_view(
    store: Store,
    cluster: Cluster,
    view: LeaderView,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Keep ``view.record`` fresh while this control plane does not lead:
    read every :data:`READ_INTERVAL_S` (a store that cannot be reached is
    logged once per outage and the last record kept), and the catalog with
    it, so that a standby coming to lead knows the models at once (the
    leader's reconciler reads it itself)."""
    task_status.started()
    failing = False
    while True:
        if not cluster.is_leader:
            try:
                await view.read(store)
                models = {m.name: m for m in await store.list_models()}
                if models != cluster.models or not cluster.catalog_loaded:
                    cluster.load_catalog(models)
            except StoreError as exc:
                if not failing:
                    log.warning("cannot read where the leader is (%s); retrying", exc)
                failing = True
            else:
                failing = False
        await trio.sleep(READ_INTERVAL_S)

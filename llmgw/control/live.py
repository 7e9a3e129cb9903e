"""Live cluster settings: the settings document in the store, applied by
every control plane within about a second.

The document is the whole :class:`~llmgw.settings.ServerSettings`
unstructured to plain JSON types (durations as seconds), kept by the store
with a version counter and its history (``settings_history``):

- on the first start with no stored document, the settings read from
  ``server.yaml`` (or the defaults, when there is no such file) seed it
  (version 1, actor ``server.yaml`` or ``defaults``); a stored document is
  never overwritten by a file; the log says which of the three the live
  settings came from;
- every control plane (leader or not) runs :func:`serve_settings`, which
  polls :meth:`~llmgw.store.Store.settings_version` every
  :data:`POLL_S` and, when it moved, applies the document to the cluster
  (:meth:`Cluster.apply_settings`) and pokes it so the reconciler acts at
  once;
- a stored document that no longer validates (written by a newer llmgw, or
  by hand) is logged and the last good settings are kept;
- writers (the admin API) go through :meth:`LiveSettings.update`: read,
  change, validate, write with the read version expected (optimistic
  concurrency, retried on a conflict), and apply on this control plane at
  once.

Live too: ``auth.default_rpm``, ``auth.default_tpm``, ``auth.pricing`` and
``auth.default_price`` (the gateway follows them from its next request), and
``auth.usage_retain_days`` (the leader's next pruning pass uses it).
Read once at start, so a change takes effect at the next start
(:data:`RESTART_KEYS`): the usage writer's ``auth.flush_interval``,
``batch_size`` and ``buffer_size``, ``auth.cache_ttl`` and
``auth.max_key_ttl``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn

import trio

from llmgw.settings import (
    ServerSettings,
    SettingsError,
    changed_keys,
    check_doc_keys,
    settings_from_doc,
    settings_to_doc,
)
from llmgw.store import Conflict, Store, StoreError

from .cluster import Cluster

#: Settings read once when a control plane starts: a change applies at the
#: next start (the admin API says so when one is changed).
RESTART_KEYS: Final = (
    "auth.flush_interval",
    "auth.batch_size",
    "auth.buffer_size",
    "auth.cache_ttl",
    "auth.max_key_ttl",
)

__all__ = [
    "POLL_S",
    "RESTART_KEYS",
    "LiveSettings",
    "serve_settings",
]

log = logging.getLogger("llmgw.control.live")

#: How often each control plane looks at the settings version, in seconds.
POLL_S: Final = 1.0
#: Tries of a read-change-write that keeps meeting concurrent writers.
UPDATE_TRIES: Final = 5
SEED_ACTOR: Final = "server.yaml"
#: The actor of a first version seeded from the defaults (no settings file).
DEFAULTS_ACTOR: Final = "defaults"


class LiveSettings:
    """This control plane's view of the stored settings, and the one way to
    change them.

    Attributes:
        version: the version applied to ``cluster.settings`` (0 = none yet).
        doc: the document of that version (normalised, every key present).
    """

    def __init__(self, store: Store, cluster: Cluster) -> None:
        self._store = store
        self._cluster = cluster
        self.version = 0
        self.doc: dict[str, Any] = settings_to_doc(cluster.settings)
        self._bad_version = 0

    def apply(self, version: int, doc: Mapping[str, Any]) -> bool:
        """Make ``doc`` the live settings if ``version`` is newer than the
        applied one; poke the cluster when something changed.

        Returns:
            Whether it was applied. A document that does not validate is
            logged once per version and not applied (the last good one stays).
        """
        if version <= self.version:
            return False
        try:
            settings = settings_from_doc(doc)
        except SettingsError as exc:
            if version != self._bad_version:
                self._bad_version = version
                log.error(
                    "stored settings version %d is not valid (%s); keeping version %d",
                    version,
                    exc,
                    self.version,
                )
            return False
        previous = self._cluster.settings
        self.version = version
        self.doc = settings_to_doc(settings)
        self._cluster.apply_settings(settings)
        if settings != previous:
            log.info("settings version %d applied", version)
            self._cluster.poke()
        return True

    async def refresh(self) -> bool:
        """Load the stored document if its version moved; whether it was applied.

        Raises:
            StoreError: the store cannot be read.
        """
        version = await self._store.settings_version()
        if version == self.version or version == self._bad_version:
            return False
        stored = await self._store.get_settings_doc()
        if stored is None:
            return False
        return self.apply(*stored)

    async def seed(self, settings: ServerSettings, *, source: str | None = None) -> bool:
        """Store ``settings`` as version 1 if there is no document yet (a
        stored one is never replaced); whether this call wrote it.

        Args:
            source: the settings file they were read from (logged, and the
                version's actor is ``server.yaml``), or ``None`` for the
                defaults (actor ``defaults``).

        Raises:
            StoreError: the store cannot be reached.
        """
        if await self._store.settings_version() != 0:
            return False
        where = "the defaults, there being no settings file" if source is None else source
        try:
            version = await self._store.put_settings_doc(
                settings_to_doc(settings),
                expected_version=0,
                actor=DEFAULTS_ACTOR if source is None else SEED_ACTOR,
                note=f"first start: settings from {where}",
            )
        except Conflict:
            return False  # another control plane seeded it first
        log.info("settings seeded from %s (version %d)", where, version)
        return True

    async def update(
        self,
        change: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        actor: str,
        note: str = "",
        expected_version: int | None = None,
    ) -> tuple[int, bool]:
        """Read the stored document, ``change`` it, validate, write it as the
        next version, and apply it here at once.

        ``change`` gets a copy of the current (normalised) document and
        returns the new one; it may raise :class:`SettingsError`. When
        another writer got in between, the whole read-change-write runs again
        (up to :data:`UPDATE_TRIES`) unless ``expected_version`` was given:
        then a document changed since that version is a :class:`Conflict`.

        Returns:
            ``(version, changed)``: the live version afterwards and whether a
            new one was written (a change that changes nothing writes nothing).

        Raises:
            SettingsError: the new document does not validate (the message
                names the key's path).
            Conflict: ``expected_version`` is not the stored version, or the
                store kept changing under us.
            StoreError: the store cannot be reached.
        """
        for _ in range(UPDATE_TRIES):
            stored = await self._store.get_settings_doc()
            version, current = (0, self.doc) if stored is None else stored
            if expected_version is not None and expected_version != version:
                raise Conflict(
                    f"the settings changed meanwhile: version {version} is live, not "
                    f"{expected_version}"
                )
            try:
                current_doc = settings_to_doc(settings_from_doc(current))
            except SettingsError:
                current_doc = dict(current)  # a bad stored document may be replaced whole
            changed_doc = change(copy.deepcopy(current_doc))
            check_doc_keys(changed_doc)
            new_doc = settings_to_doc(settings_from_doc(changed_doc))
            if stored is not None and new_doc == current_doc:
                self.apply(version, current)
                return version, False
            try:
                # Fenced by the lease on a leader: a deposed one writes nothing.
                written = await self._store.put_settings_doc(
                    new_doc,
                    expected_version=version,
                    actor=actor,
                    note=note,
                    fence=self._cluster.lease,
                )
            except Conflict:
                if expected_version is not None:
                    raise
                continue
            self.apply(written, new_doc)
            return written, True
        raise Conflict(f"the settings kept changing; gave up after {UPDATE_TRIES} tries")


async def serve_settings(
    store: Store,
    cluster: Cluster,
    seed: ServerSettings,
    *,
    seed_source: str | None = None,
    live: LiveSettings | None = None,
    task_status: trio.TaskStatus[LiveSettings] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Keep ``cluster.settings`` equal to the stored document, until cancelled.

    First ``cluster.settings`` is set to ``seed`` and, when the store holds
    no document, ``seed`` is stored as version 1; then the stored document
    is loaded. Started (with the :class:`LiveSettings`) once that is done or
    the store could not be reached (then the seed applies and the loop keeps
    trying). Then polls the version every :data:`POLL_S`; store errors are
    logged and retried, never raised.

    Args:
        store: the store.
        cluster: whose ``settings`` are kept current; poked on each change.
        seed: the settings from ``server.yaml`` (or the defaults).
        seed_source: the file ``seed`` was read from, ``None`` for the
            defaults; the log names it.
        live: the state to keep (the admin API shares it); made when ``None``.
    """
    if live is None:
        live = LiveSettings(store, cluster)
    if live.version == 0:
        cluster.apply_settings(seed)
        live.doc = settings_to_doc(seed)
    failing = False
    started = False
    while True:
        try:
            if live.version == 0:
                seeded = await live.seed(seed, source=seed_source)
                if await live.refresh() and not seeded:
                    log.info("settings loaded from the store (version %d)", live.version)
                    if seed_source is not None:
                        _say_seed_ignored(seed, seed_source, live)
            else:
                await live.refresh()
            if failing:
                log.info("settings store reachable again (version %d)", live.version)
                failing = False
        except StoreError as exc:
            if not failing:
                log.warning(
                    "cannot read the settings from the store (%s); keeping version %d",
                    exc,
                    live.version,
                )
                failing = True
        if not started:
            started = True
            task_status.started(live)
        await trio.sleep(POLL_S)


def _say_seed_ignored(seed: ServerSettings, source: str, live: LiveSettings) -> None:
    differ = changed_keys(settings_to_doc(seed), live.doc)
    if differ:
        log.warning(
            "the stored settings (version %d) differ from %s in %s; the stored "
            "ones apply (change them with 'llmgw ctl config')",
            live.version,
            source,
            ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else ""),
        )

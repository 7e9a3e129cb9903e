"""The tenancy tree as the request path sees it: a key's limits along its
path key → project → team → org.

:class:`ScopeResolver` turns a key into the :class:`ScopeLimits` the
accountant checks, caching each key's path for ``cache_ttl_s``; a change made
through this control plane's admin API drops the cache at once.
"""

from __future__ import annotations

import re
import time
from typing import Final

from llmgw.accounting.accountant import ScopeLimits
from llmgw.store import KeyRecord, Store, StoreError
from llmgw.store.records import Limits

__all__ = ["ScopeResolver", "parse_project_path", "scope_limits"]

_NAME: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CACHE_TTL_S: Final = 5.0


def parse_project_path(path: str) -> tuple[str, str, str]:
    """``"Org/team/project"`` → its three names.

    Raises:
        ValueError: not three names of 1 to 64 letters, digits, ``-``, ``_``, ``.``.
    """
    parts = path.strip().strip("/").split("/")
    if len(parts) != 3 or not all(_NAME.match(p) and p.strip(".") for p in parts):
        raise ValueError(
            f"{path!r} is not ORG/TEAM/PROJECT (names of 1-64 letters, digits, '-', '_', '.'; not dots alone)"
        )
    return parts[0], parts[1], parts[2]


def scope_limits(scope: str, limits: Limits) -> ScopeLimits:
    return ScopeLimits(
        scope=scope,
        rpm=limits.rpm,
        tpm=limits.tpm,
        budget_day_micros=limits.budget_day_micros,
        budget_month_micros=limits.budget_month_micros,
        models=limits.models,
    )


class ScopeResolver:
    """Key → its path of limits, cached."""

    def __init__(self, store: Store, *, cache_ttl_s: float = CACHE_TTL_S) -> None:
        self._store = store
        self._ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[float, tuple[ScopeLimits, ...], tuple[str, str, str]]] = {}
        self._names: dict[str, tuple[str, str, str]] = {}

    async def path(self, key: KeyRecord) -> tuple[tuple[ScopeLimits, ...], tuple[str, str, str]]:
        """The key's limits path (key, project, team, org) and its
        (project id, team id, org id), ``""`` for a key outside the tree."""
        now = time.monotonic()
        cached = self._cache.get(key.id)
        if cached is not None and cached[0] > now:
            return cached[1], cached[2]
        levels = [scope_limits(f"key:{key.id}", key.limits)]
        ids = ("", "", "")
        if key.project_id:
            try:
                found = await self._store.get_project_path(key.project_id)
            except StoreError:
                if cached is None:
                    raise
                return cached[1], cached[2]  # the store is down: the last known path

            if found is not None:
                levels += [
                    scope_limits(f"project:{found.project.id}", found.project.limits),
                    scope_limits(f"team:{found.team.id}", found.team.limits),
                    scope_limits(f"org:{found.org.id}", found.org.limits),
                ]
                ids = (found.project.id, found.team.id, found.org.id)
                self._names[key.id] = (
                    found.path,
                    f"{found.org.name}/{found.team.name}",
                    found.org.name,
                )
        path = tuple(levels)
        if len(self._cache) > 100_000:
            self._cache.clear()
            self._names.clear()
        self._cache[key.id] = (now + self._ttl_s, path, ids)
        return path, ids

    def names(self, key_id: str) -> tuple[str, str, str]:
        """The (``Org/team/project``, ``Org/team``, ``Org``) names of a key's
        place in the tree as :meth:`path` last read them, ``""`` when unknown."""
        return self._names.get(key_id, ("", "", ""))

    def forget(self) -> None:
        """Drop every cached path (after a limits or tree change here)."""
        self._cache.clear()

"""Admin routes of the whole system: its status, and stopping or starting
every model at once.

- ``GET /api/v1/status`` → leader, nodes, replicas, model names,
  ``model_replicas`` (per model ``{"name", "wanted", "ready", "starting",
  "failed", "stopped", "external"}``), ``serving`` (``{"stopped"}``) and
  ``settings_version``, ``store`` (``{"kind": "sqlite"|"postgresql",
  "address"}``, never a password) and ``leadership`` (``{"holder",
  "epoch", "since", "api", "here"}``, nulls when no leader is known)
  (:func:`llmgw.admin.views.status_view`);
- ``POST /api/v1/system/stop`` / ``start`` set or clear the setting
  ``serving.stopped`` → ``{"stopped", "changed", "version"}``.
"""

from __future__ import annotations

from typing import Any

from quart_trio import QuartTrio

from llmgw.control.cluster import Cluster
from llmgw.control.leader_record import LeaderView
from llmgw.control.live import LiveSettings
from llmgw.settings import with_key
from llmgw.store import Store

from .inputs import actor
from .views import leadership_view, status_view, store_view

__all__ = ["add_system_routes"]


def add_system_routes(
    app: QuartTrio,
    cluster: Cluster,
    live: LiveSettings,
    *,
    store: Store | None = None,
    leader_view: LeaderView | None = None,
) -> None:
    """Add the routes of the module docstring to ``app``."""

    @app.get("/api/v1/status")
    async def status() -> Any:
        return {
            **status_view(cluster, live.version),
            "store": store_view(store),
            "leadership": leadership_view(cluster, leader_view),
        }

    async def set_stopped(stopped: bool) -> dict[str, Any]:
        version, changed = await live.update(
            lambda doc: with_key(doc, "serving.stopped", stopped),
            actor=actor(),
            note="llmgw stop" if stopped else "llmgw start",
        )
        cluster.poke()
        return {"stopped": stopped, "changed": changed, "version": version}

    @app.post("/api/v1/system/stop")
    async def system_stop() -> Any:
        return await set_stopped(True)

    @app.post("/api/v1/system/start")
    async def system_start() -> Any:
        return await set_stopped(False)

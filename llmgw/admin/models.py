"""Admin routes of the catalog's models (the catalog's rules:
``docs/catalog.md``).

``<name>`` is a model's name; ``GET`` also takes an alias. A view is
:func:`llmgw.admin.views.model_view`; ``wanted`` is what the reconciler aims
at now (0 while the model or the whole system is stopped, or for an idle
on-demand model).

- ``GET /api/v1/models`` → ``{"data": [view]}``; ``GET /api/v1/models/<name>``
  → one view plus ``"shards"`` (replica views);
- ``POST /api/v1/models`` (the entry form; 201; 409 ``model_exists`` if the
  name is taken), ``PUT /api/v1/models/<name>`` (replace the entry whole →
  the view plus ``"restart"``: whether the replicas roll);
- ``POST /api/v1/models/<name>/scale`` ``{"replicas": N, "profile"?}`` → the
  view plus ``"started"``: a stopped model starts at N; a model with
  several profiles needs ``profile``;
- ``POST …/stop`` (keeps the counts for ``start``), ``POST …/start`` → the
  view plus ``"changed"``;
- ``DELETE /api/v1/models/<name>[?purge=1]`` → ``{"name", "removed",
  "purged": [paths deleted]}``; see
  :func:`llmgw.control.model_ops.purge_weights`;
- ``POST …/context`` ``{"tokens"?, "slots"?, "max_output"?, "profile"?}`` →
  the view plus ``"restart"``; see :func:`llmgw.control.model_ops.change_context`;
- ``GET …/placement`` → ``{"model", "nodes": [verdict]}``, every node and
  why it can or cannot take a replica.

An unknown model is 404 ``model_not_found``; a bad entry 400
``invalid_model``. After each change the cluster's catalog is replaced and
the reconciler (on the leader) acts at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio
from quart_trio import QuartTrio

from llmgw import errors
from llmgw.control import model_ops
from llmgw.control.catalog import parse_model
from llmgw.control.cluster import Cluster
from llmgw.control.placement import explain
from llmgw.store import ModelRecord, Store

from .errors import BadRequest, Clash, NoSuch, known_names
from .inputs import actor, count, json_object, query_flag
from .views import model_view, replica_view

__all__ = ["MAX_REPLICAS", "add_model_routes"]

log = logging.getLogger("llmgw.admin")

#: The most replicas one scale request may ask for.
MAX_REPLICAS: Final = 256


def _profile_field(body: dict[str, Any]) -> str | None:
    profile = body.get("profile")
    if profile is not None and not isinstance(profile, str):
        raise BadRequest("'profile' must be a profile's name.", param="profile")
    return profile


def add_model_routes(
    app: QuartTrio, store: Store, cluster: Cluster, *, data_dir: Path | None
) -> None:
    """Add the routes of the module docstring to ``app``.

    Args:
        store: the catalog.
        cluster: the live view; its catalog is replaced after each change.
        data_dir: where this control plane keeps weights; ``purge`` refuses
            without one.
    """

    async def find_model(name: str, *, aliases: bool = False) -> ModelRecord:
        model = await store.get_model(name)
        if model is None and aliases:
            model = next((m for m in await store.list_models() if name in m.aliases), None)
        if model is None:
            names = [m.name for m in await store.list_models()]
            raise NoSuch(
                f"No model {name!r} in the catalog; {known_names('models', names)}.",
                code="model_not_found",
            )
        return model

    async def check(model: ModelRecord, *, new: bool) -> None:
        existing = [m for m in await store.list_models() if m.name != model.name]
        await trio.to_thread.run_sync(partial(model_ops.check_model, model, existing, new=new))

    async def save(model: ModelRecord) -> dict[str, Any]:
        await store.put_model(model, fence=cluster.lease)
        cluster.put_model(model)
        return model_view(model, cluster)

    async def change_model(
        name: str, change: Callable[[ModelRecord], ModelRecord]
    ) -> tuple[ModelRecord, ModelRecord]:
        model = await find_model(name)
        changed = change(model)
        if changed != model:
            await check(changed, new=False)
            await save(changed)
        return model, changed

    @app.get("/api/v1/models")
    async def list_models() -> Any:
        return {"data": [model_view(m, cluster) for m in await store.list_models()]}

    @app.get("/api/v1/models/<name>")
    async def get_model(name: str) -> Any:
        model = await find_model(name, aliases=True)
        view = model_view(model, cluster)
        view["shards"] = [
            replica_view(s, cluster) for s in cluster.shards.values() if s.model == model.name
        ]
        return view

    @app.post("/api/v1/models")
    async def add_model() -> Any:
        model = parse_model(await json_object())
        if await store.get_model(model.name) is not None:
            raise Clash(
                f"A model {model.name!r} is already in the catalog; change it with PUT "
                f"/api/v1/models/{model.name} (ctl model update) or remove it first.",
                code="model_exists",
            )
        if not model.created_at:
            model = attrs.evolve(model, created_at=time.time())
        await check(model, new=True)
        view = await save(model)
        log.info("model %s added by %s", model.name, actor())
        return view, 201

    @app.put("/api/v1/models/<name>")
    async def replace_model(name: str) -> Any:
        doc = await json_object()
        doc.setdefault("name", name)
        if doc["name"] != name:
            raise BadRequest(f"The entry is named {doc['name']!r}, not {name!r}.", param="name")
        old = await find_model(name)
        model = parse_model(doc)
        if not model.created_at:
            model = attrs.evolve(model, created_at=old.created_at or time.time())
        await check(model, new=False)
        view = await save(model)
        view["restart"] = old.profiles != model.profiles or old.source != model.source
        return view

    @app.post("/api/v1/models/<name>/scale")
    async def scale_model(name: str) -> Any:
        body = await json_object(allowed=("replicas", "profile"))
        replicas = count(body, "replicas", low=0, high=MAX_REPLICAS)
        if replicas is None:
            raise BadRequest("'replicas' is required.", param="replicas")
        profile = _profile_field(body)
        old, new = await change_model(name, lambda m: model_ops.scale(m, replicas, profile))
        view = model_view(new, cluster)
        view["started"] = old.stopped and not new.stopped
        return view

    async def set_model_stopped(name: str, stopped: bool) -> dict[str, Any]:
        old, new = await change_model(name, lambda m: attrs.evolve(m, stopped=stopped))
        view = model_view(new, cluster)
        view["changed"] = old != new
        return view

    @app.post("/api/v1/models/<name>/stop")
    async def stop_model(name: str) -> Any:
        return await set_model_stopped(name, True)

    @app.post("/api/v1/models/<name>/start")
    async def start_model(name: str) -> Any:
        return await set_model_stopped(name, False)

    @app.delete("/api/v1/models/<name>")
    async def remove_model(name: str) -> Any:
        purge = query_flag("purge")
        model = await find_model(name)
        if purge and data_dir is None:
            raise BadRequest("This control plane has no data directory to purge from.")
        await store.delete_model(name, fence=cluster.lease)
        cluster.drop_model(name)
        purged: list[str] = []
        if purge and data_dir is not None:
            others = await store.list_models()
            try:
                purged = await trio.to_thread.run_sync(
                    model_ops.purge_weights, model, others, data_dir
                )
            except OSError as exc:
                raise errors.LlmgwError(
                    f"{name} removed, but its weights could not be deleted: {exc}"
                ) from None
        log.info("model %s removed by %s%s", name, actor(), " (purged)" if purge else "")
        return {"name": name, "removed": True, "purged": purged}

    @app.post("/api/v1/models/<name>/context")
    async def model_context(name: str) -> Any:
        body = await json_object(allowed=("tokens", "slots", "max_output", "profile"))
        tokens = count(body, "tokens", low=1, high=1 << 24)
        slots = count(body, "slots", low=1, high=1024)
        max_output = count(body, "max_output", low=0, high=1 << 24)
        profile = _profile_field(body)
        restart = False

        def change(model: ModelRecord) -> ModelRecord:
            nonlocal restart
            changed, restart = model_ops.change_context(
                model, tokens=tokens, slots=slots, max_output=max_output, profile=profile
            )
            return changed

        _, new = await change_model(name, change)
        view = model_view(new, cluster)
        view["restart"] = restart
        return view

    @app.get("/api/v1/models/<name>/placement")
    async def model_placement(name: str) -> Any:
        model = await find_model(name, aliases=True)
        return {"model": model.name, "nodes": [v.to_doc() for v in explain(model, cluster)]}

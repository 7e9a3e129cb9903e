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
- ``GET …/placement`` → ``{"model", "nodes": [verdict], "downloads"}``,
  every node and why it can or cannot take a replica, and the weights
  fetches under way;
- ``POST /api/v1/models/serve`` ``{"source": "hf:ORG/REPO[@REV]", "file"?,
  "name"?, "engine"?, "replicas"?, "context"?, "slots"?, "cpu_cores"?,
  "min_memory_gb"?, "gpu_class"?, "gpus"?}`` → 201, the view plus
  ``"resolved"`` (``{"endpoint", "repo", "revision", "files",
  "main_file"}``) and ``"placement"`` (verdicts); the control plane
  resolves the revision (``docs/models-from-hf.md``); 400 ``hf_refused``
  for a pickle format, an unknown repository or revision, or no hub
  answering;
- ``POST /api/v1/models/<name>/update`` ``{"revision"?}`` → the view plus
  ``"changes"``: ``{"from", "to", "added", "removed", "changed"}`` (the
  only way new weights reach the cluster);
- ``GET /api/v1/weights`` → ``{"nodes": [{"node_id", "held": [{"repo",
  "revision", "path", "files", "size_bytes", "in_use"}], "error"?}]}``.

An unknown model is 404 ``model_not_found``; a bad entry 400
``invalid_model``. After each change the cluster's catalog is replaced and
the reconciler (on the leader) acts at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio
from quart_trio import QuartTrio

from llmgw import errors
from llmgw.agent import protocol
from llmgw.control import hf, model_ops
from llmgw.control.catalog import parse_model
from llmgw.control.cluster import Cluster
from llmgw.control.placement import explain, gpu_class_of
from llmgw.store import ModelRecord, Store

from .errors import BadRequest, Clash, NoSuch, known_names
from .inputs import actor, count, json_object, query_flag
from .views import downloads_view, model_view, replica_view

__all__ = ["MAX_REPLICAS", "add_hf_routes", "add_model_routes"]

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
        if purge and data_dir is None and model.origin is None:
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
        if purge and model.origin is not None:
            purged += await purge_fetched(model, await store.list_models(), cluster)
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
        return {
            "model": model.name,
            "nodes": [v.to_doc() for v in explain(model, cluster)],
            "downloads": downloads_view(model.name, cluster),
        }

    add_hf_routes(app, store, cluster, find_model=find_model, check=check, save=save)


#: Deadline for resolving a model on a hub (all its calls), in seconds; within
#: the admin client's own (30 s).
RESOLVE_TIMEOUT_S: Final = 25.0
#: Deadline for a node to answer a weights request, in seconds.
WEIGHTS_TIMEOUT_S: Final = 10.0


def _text_field(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise BadRequest(f"'{name}' must be a non-empty string.", param=name)
    return value


def add_hf_routes(
    app: QuartTrio,
    store: Store,
    cluster: Cluster,
    *,
    find_model: Callable[[str], Awaitable[ModelRecord]],
    check: Callable[..., Awaitable[None]],
    save: Callable[[ModelRecord], Awaitable[dict[str, Any]]],
) -> None:
    """``serve``, ``update`` and ``weights`` (module docstring): models from
    Hugging Face or a mirror, pinned (:mod:`llmgw.control.hf`)."""

    async def resolve(ref: hf.HfRef, file: str | None, engine: str | None) -> hf.Resolved:
        settings = cluster.settings
        try:
            with trio.fail_after(RESOLVE_TIMEOUT_S):
                return await trio.to_thread.run_sync(
                    partial(hf.resolve, ref, settings, glob=file, engine=engine),
                    abandon_on_cancel=True,
                )
        except trio.TooSlowError:
            raise errors.UpstreamError(
                f"resolving {ref.repo} took more than {RESOLVE_TIMEOUT_S:.0f} s"
            ) from None

    def gpu_class_for(engine: str, asked: str | None) -> str:
        if asked or engine != "vllm":
            return asked or ""
        classes = sorted(
            {gpu_class_of(g) for n in cluster.nodes.values() for g in n.gpus or n.hardware.gpus}
        )
        if not classes:
            raise hf.HfError(
                "safetensors weights run on vLLM, which needs a GPU node, and no node has a "
                "GPU; serve a GGUF version with llama.cpp instead, or give --gpu-class",
                param="gpu_class",
            )
        return classes[0]

    @app.post("/api/v1/models/serve")
    async def serve_model() -> Any:
        body = await json_object(
            allowed=(
                "source", "file", "name", "engine", "replicas", "context", "slots",
                "cpu_cores", "min_memory_gb", "gpu_class", "gpus", "args",
            )
        )  # fmt: skip
        source = _text_field(body, "source")
        if source is None:
            raise BadRequest("'source' is required: hf:ORG/REPO[@REVISION].", param="source")
        ref = hf.parse_hf_source(source)
        file, engine = _text_field(body, "file"), _text_field(body, "engine")
        name = _text_field(body, "name")
        if name is not None and await store.get_model(name) is not None:
            raise Clash(
                f"A model {name!r} is already in the catalog; ctl model update {name} "
                "changes its weights.",
                code="model_exists",
            )
        args = body.get("args") or []
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise BadRequest("'args' must be a list of strings.", param="args")
        memory = body.get("min_memory_gb")
        if memory is not None and (
            isinstance(memory, bool) or not isinstance(memory, int | float) or memory < 0
        ):
            raise BadRequest("'min_memory_gb' must be a number, 0 or more.", param="min_memory_gb")
        replicas = count(body, "replicas", low=0, high=MAX_REPLICAS)
        context = count(body, "context", low=1, high=1 << 24) or 4096
        slots = count(body, "slots", low=1, high=1024) or 4
        cpu_cores = count(body, "cpu_cores", low=0, high=4096) or 0
        gpus = count(body, "gpus", low=1, high=64) or 0
        gpu_class = _text_field(body, "gpu_class")
        resolved = await resolve(ref, file, engine)
        origin = resolved.origin
        name = name or hf.default_name(origin.repo, origin.main_file)
        if await store.get_model(name) is not None:
            raise Clash(
                f"A model {name!r} is already in the catalog; give another --name, or "
                f"ctl model update {name} to change its weights.",
                code="model_exists",
            )
        doc = hf.serve_entry(
            resolved,
            name=name,
            replicas=1 if replicas is None else replicas,
            context_tokens=context,
            slots=slots,
            cpu_cores=cpu_cores,
            min_memory_gb=None if memory is None else float(memory),
            gpu_class=gpu_class_for(resolved.engine, gpu_class),
            gpus=gpus,
            args=args,
        )
        model = attrs.evolve(parse_model(doc), created_at=time.time())
        await check(model, new=True)
        view = await save(model)
        view["resolved"] = {"endpoint": resolved.endpoint, **attrs.asdict(origin)}
        view["placement"] = [v.to_doc() for v in explain(model, cluster)]
        log.info(
            "model %s served from %s@%s (%s) by %s",
            name,
            origin.repo,
            origin.revision,
            resolved.endpoint,
            actor(),
        )
        return view, 201

    @app.post("/api/v1/models/<name>/update")
    async def update_weights(name: str) -> Any:
        body = await json_object(allowed=("revision",))
        revision = _text_field(body, "revision")
        model = await find_model(name)
        old = model.origin
        if old is None:
            raise BadRequest(
                f"{name} has no pinned origin (it was not served from hf:); change its entry "
                "with 'ctl model update NAME -f FILE'.",
                param="revision",
            )
        main = old.main_file
        # The same file (or the same kind of files) at the new revision.
        glob = main if main and not hf.is_split_gguf(main) else None
        engine = model.profile.engine if model.profile else None
        resolved = await resolve(hf.HfRef(repo=old.repo, revision=revision), glob, engine)
        changes = hf.diff_origins(old, resolved.origin)
        new = attrs.evolve(model, origin=resolved.origin, source=hf.origin_source(resolved.origin))
        if new != model:
            await check(new, new=False)
            view = await save(new)
        else:
            view = model_view(model, cluster)
        view["changes"] = changes
        view["restart"] = new.source != model.source
        log.info("model %s updated %s → %s by %s", name, changes["from"], changes["to"], actor())
        return view

    @app.get("/api/v1/weights")
    async def list_weights() -> Any:
        return {"nodes": await ask_weights(cluster, ())}


async def ask_weights(cluster: Cluster, remove: tuple[str, ...]) -> list[dict[str, Any]]:
    """Ask every connected node for the weights it holds, after removing the
    versions in ``remove`` (``ORG/REPO@commit``); one answer per node:
    ``{"node_id", "held", "removed", "kept"}`` or ``{"node_id", "error"}``."""
    answers: dict[str, dict[str, Any]] = {}

    async def one(node_id: str) -> None:
        correlation_id = uuid.uuid4().hex
        ask = protocol.WeightsRequest(correlation_id=correlation_id, remove=remove)
        try:
            with trio.fail_after(WEIGHTS_TIMEOUT_S):
                reply = await cluster.ask(node_id, ask, correlation_id)
        except (LookupError, trio.TooSlowError, errors.LinkError) as exc:
            answers[node_id] = {"node_id": node_id, "error": errors.describe(exc)}
            return
        if not isinstance(reply, protocol.WeightsReply):
            message = reply.message if isinstance(reply, protocol.Error) else "no answer"
            answers[node_id] = {"node_id": node_id, "error": message}
            return
        answers[node_id] = {
            "node_id": node_id,
            "held": [attrs.asdict(h) for h in reply.held],
            "removed": list(reply.removed),
            "kept": list(reply.kept),
        }

    async with trio.open_nursery() as nursery:
        for node_id, node in sorted(cluster.nodes.items()):
            if node.connected:
                nursery.start_soon(one, node_id)
    return [answers[n] for n in sorted(answers)]


async def purge_fetched(
    model: ModelRecord, others: list[ModelRecord], cluster: Cluster
) -> list[str]:
    """Delete ``model``'s pinned version from every connected node, unless
    another model uses it; only files llmgw fetched go, and a node keeps a
    version a shard still runs on. The paths deleted, as ``node:path``."""
    origin = model.origin
    if origin is None:
        return []
    version = f"{origin.repo}@{origin.revision}"
    for other in others:
        theirs = other.origin
        if (
            other.name != model.name
            and theirs is not None
            and (theirs.repo, theirs.revision) == (origin.repo, origin.revision)
        ):
            log.info("purge of %s keeps %s: %s uses it", model.name, version, other.name)
            return []
    answers = await ask_weights(cluster, (version,))
    for answer in answers:
        for why in answer.get("kept", []):
            log.info("node %s kept %s", answer["node_id"], why)
    return [f"{a['node_id']}:{path}" for a in answers for path in a.get("removed", [])]

"""The admin API (quart-trio), on ``127.0.0.1:9090`` only.

Every route needs an admin key (``Authorization: Bearer sk-llmgw-…`` of a
key made with ``is_admin``, such as the one ``llmgw up`` writes to
``DATA_DIR/admin-key``). Errors use the OpenAI error shape, like ``/v1``.

Routes (all JSON):

- ``POST /api/v1/keys`` ``{"name"}`` → the new key, its secret shown once;
- ``GET /api/v1/keys`` → every key (never a secret);
- ``POST /api/v1/keys/<id>/revoke``;
- ``GET /api/v1/usage?last=N&key_id=…`` → usage rows, newest first;
- ``GET /api/v1/status`` → leader, nodes, replicas, model names, and
  ``serving`` (``{"stopped"}``), ``settings_version`` and
  ``model_replicas`` (per model ``{"name", "wanted", "ready", "starting",
  "failed", "stopped", "external"}``);
- ``GET /api/v1/logs?node=…&source=…&lines=N`` → a node's or shard's
  (``source`` = a shard id) last lines.

Settings, whole-system stop/start, models, nodes and replicas: see
:mod:`llmgw.admin.control_api`.
"""

from __future__ import annotations

import csv
import io
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio
from quart import Response, g, request
from quart_trio import QuartTrio

from llmgw.agent import protocol
from llmgw.auth.keys import KeyAuthenticator
from llmgw.control.cluster import Cluster
from llmgw.control.live import LiveSettings
from llmgw.gateway.errors import error_body
from llmgw.store import Store, UsageRow

from .control_api import add_control_routes, replica_counts
from .keys import KeysService, parse_since

__all__ = ["make_admin_app"]

#: Deadline for a node to answer a logs request, in seconds.
LOGS_TIMEOUT_S: Final = 10.0
MAX_USAGE_ROWS: Final = 10_000
MAX_LOG_LINES: Final = 2_000


def _error(status: int, message: str, code: str | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return Response(
        error_body(message, type=kind, code=code), status=status, content_type="application/json"
    )


def make_admin_app(
    store: Store,
    cluster: Cluster,
    authenticator: KeyAuthenticator,
    keys_service: KeysService,
    *,
    live: LiveSettings | None = None,
    data_dir: Path | None = None,
) -> QuartTrio:
    """The admin API application over ``store`` and ``cluster``.

    Args:
        live: the live settings state the control plane's settings loop
            keeps (:func:`llmgw.control.live.serve_settings`); a fresh one
            over ``store`` when ``None`` (tests).
        data_dir: where weights live, for ``DELETE /api/v1/models/<name>?purge=1``.
    """
    app = QuartTrio("llmgw.admin")
    if live is None:
        live = LiveSettings(store, cluster)
    add_control_routes(app, store, cluster, live, data_dir=data_dir)

    @app.errorhandler(404)
    async def not_found(_: Exception) -> Response:
        return _error(404, f"No route {request.method} {request.path}.", "unknown_url")

    @app.errorhandler(500)
    async def internal(_: Exception) -> Response:
        return _error(500, "Internal error; the control plane's log says more.", "internal_error")

    @app.errorhandler(405)
    async def wrong_method(_: Exception) -> Response:
        return _error(405, f"{request.path} does not take {request.method}.", "method_not_allowed")

    @app.before_request
    async def require_admin() -> Response | None:
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret:
            return _error(
                401, "The admin API needs 'Authorization: Bearer <admin key>'.", "invalid_api_key"
            )
        key = await authenticator.authenticate(secret.strip())
        if key is None:
            return _error(401, "Incorrect API key provided.", "invalid_api_key")
        if not key.is_admin:
            return _error(403, "This key is not an admin key.", "forbidden")
        g.admin_actor = f"{key.name} ({key.id})"
        return None

    @app.post("/api/v1/keys")
    async def create_key() -> Any:
        doc = await request.get_json(silent=True)
        if not isinstance(doc, dict):
            return _error(
                400,
                "Send a JSON object with 'name' (and 'project' or 'person', 'expires', 'band').",
            )
        unknown = set(doc) - {"name", "project", "person", "expires", "band"}
        if unknown:
            return _error(400, f"Unknown field(s) {sorted(unknown)}.")
        name = doc.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            return _error(400, "'name' is required: a string of 1 to 200 characters.")
        try:
            made = await keys_service.create(
                name.strip(),
                project=doc.get("project"),
                person=doc.get("person"),
                expires=doc.get("expires"),
                band=doc.get("band") or "",
            )
        except ValueError as exc:
            return _error(400, str(exc))
        return made, 201

    @app.post("/api/v1/keys/<key_id>/rotate")
    async def rotate_key(key_id: str) -> Any:
        try:
            return await keys_service.rotate(key_id)
        except LookupError as exc:
            return _error(404, str(exc), "not_found")
        except ValueError as exc:
            return _error(409, str(exc), "key_revoked")

    @app.post("/api/v1/tree")
    async def init_tree() -> Any:
        doc = await request.get_json(silent=True)
        try:
            return await keys_service.init_tree(doc)
        except ValueError as exc:
            return _error(400, str(exc))

    @app.get("/api/v1/tree")
    async def list_tree() -> Any:
        return {"data": await keys_service.tree()}

    @app.put("/api/v1/limits/<scope>/<path:ident>")
    async def set_limits(scope: str, ident: str) -> Any:
        doc = await request.get_json(silent=True)
        try:
            return await keys_service.set_limits(scope, ident, doc)
        except LookupError as exc:
            return _error(404, str(exc), "not_found")
        except ValueError as exc:
            return _error(400, str(exc))

    @app.get("/api/v1/usage/summary")
    async def usage_summary() -> Any:
        by = request.args.get("by", "key")
        if by not in ("key", "project", "team", "org", "model"):
            return _error(400, "'by' is one of key, project, team, org, model.")
        try:
            since = parse_since(request.args.get("since", "24h"), time.time())
        except ValueError as exc:
            return _error(400, str(exc))
        rows = await store.usage_summary(by, since)  # type: ignore[arg-type]
        names = await keys_service.names(by)
        data = [{**attrs.asdict(r), "name": names.get(r.group, r.group)} for r in rows]
        return {"by": by, "since": since, "data": data}

    @app.get("/api/v1/usage/export")
    async def usage_export() -> Any:
        fmt = request.args.get("format", "jsonl")
        if fmt not in ("csv", "jsonl"):
            return _error(400, "'format' is csv or jsonl.")
        try:
            now = time.time()
            since = parse_since(request.args.get("since", "30d"), now)
            until = parse_since(request.args["until"], now) if request.args.get("until") else None
        except ValueError as exc:
            return _error(400, str(exc))

        async def rows() -> AsyncIterator[bytes]:
            after = ""
            if fmt == "csv":
                yield (",".join(USAGE_FIELDS) + "\n").encode()
            while True:
                page = await store.export_usage(since, until, after_request_id=after, limit=1000)
                if not page:
                    return
                for row in page:
                    yield _export_line(row, fmt)
                after = page[-1].request_id

        content_type = "text/csv" if fmt == "csv" else "application/x-ndjson"
        return Response(rows(), content_type=content_type)

    @app.get("/api/v1/requests/<request_id>")
    async def one_request(request_id: str) -> Any:
        if not request_id.startswith("req_") or not request_id[4:].isalnum():
            return _error(400, f"{request_id!r} is not a request id (req_…).")
        row = await store.get_usage(request_id)
        if row is None:
            return _error(
                404,
                f"No request {request_id!r} (rows are written within a second or two).",
                "not_found",
            )
        return attrs.asdict(row)

    @app.get("/api/v1/keys")
    async def list_keys() -> Any:
        return {"data": await keys_service.list_keys()}

    @app.post("/api/v1/keys/<key_id>/revoke")
    async def revoke_key(key_id: str) -> Any:
        key = await store.get_key(key_id)
        if key is None:
            return _error(404, f"No key {key_id!r}.", "not_found")
        if key.revoked_at is not None:
            return _error(409, f"Key {key_id!r} is already revoked.", "already_revoked")
        if key.is_admin:
            live_admins = [
                k for k in await store.list_keys() if k.is_admin and k.revoked_at is None
            ]
            if len(live_admins) <= 1:
                return _error(
                    409,
                    "This is the only live admin key; revoking it would lock the admin API.",
                    "last_admin_key",
                )
        await store.revoke_key(key_id, time.time())
        authenticator.forget(key_id)
        keys_service.forget_key(key_id)
        return {"id": key_id, "revoked": True}

    @app.get("/api/v1/usage")
    async def usage() -> Any:
        try:
            last = int(request.args.get("last", "20"))
        except ValueError:
            return _error(400, "'last' must be a whole number.")
        if not 1 <= last <= MAX_USAGE_ROWS:
            return _error(400, f"'last' must be between 1 and {MAX_USAGE_ROWS}.")
        rows = await store.list_usage(last=last, key_id=request.args.get("key_id") or None)
        return {"data": [attrs.asdict(r) for r in rows]}

    @app.get("/api/v1/status")
    async def status() -> Any:
        return {
            "leader": cluster.is_leader,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "address": n.address,
                    "connected": n.connected,
                    "cpu_count": n.hardware.cpu_count,
                    "memory_total_mb": n.hardware.memory_total_mb,
                    "memory_available_mb": n.memory_available_mb,
                    "gpus": len(n.hardware.gpus),
                    "agent_version": n.agent_version,
                }
                for n in cluster.nodes.values()
            ],
            "replicas": [
                {
                    "replica_id": s.replica_id,
                    "model": s.model,
                    "node_id": s.node_id,
                    "port": s.port,
                    "state": str(s.state),
                    "reason": s.reason,
                    "failures": s.failures,
                    "last_lines": list(s.last_lines),
                }
                for s in cluster.shards.values()
            ],
            "models": sorted(cluster.models),
            "model_replicas": [
                {
                    "name": m.name,
                    **replica_counts(m, cluster),
                    "stopped": m.stopped,
                    "external": m.is_external,
                }
                for m in sorted(cluster.models.values(), key=lambda m: m.name)
            ],
            "serving": {"stopped": cluster.settings.serving.stopped},
            "settings_version": live.version,
        }

    @app.get("/api/v1/logs")
    async def logs() -> Any:
        node_id = request.args.get("node", "")
        source = request.args.get("source", "")
        try:
            lines = int(request.args.get("lines", "200"))
        except ValueError:
            lines = 0
        if not 1 <= lines <= MAX_LOG_LINES:
            return _error(400, f"'lines' must be a whole number from 1 to {MAX_LOG_LINES}.")
        if not node_id:
            if len(cluster.nodes) != 1:
                return _error(400, "Name the node: 'node' is required when there are several.")
            node_id = next(iter(cluster.nodes))
        correlation_id = uuid.uuid4().hex
        ask = protocol.LogsRequest(correlation_id=correlation_id, source=source, lines=lines)
        try:
            with trio.fail_after(LOGS_TIMEOUT_S):
                reply = await cluster.ask(node_id, ask, correlation_id)
        except LookupError as exc:
            return _error(404, str(exc), "node_not_connected")
        except trio.TooSlowError:
            return _error(504, f"Node {node_id!r} did not answer within {LOGS_TIMEOUT_S:.0f} s.")
        if isinstance(reply, protocol.Error):
            return _error(404, f"Node {node_id!r}: {reply.message}", "not_found")
        assert isinstance(reply, protocol.LogsReply)
        return {"node": node_id, "source": source, "lines": list(reply.lines)}

    return app


USAGE_FIELDS: Final = tuple(a.name for a in attrs.fields(UsageRow))


def _export_line(row: UsageRow, fmt: str) -> bytes:
    doc = attrs.asdict(row)
    if fmt == "jsonl":
        return orjson.dumps(doc) + b"\n"
    out = io.StringIO()
    csv.writer(out).writerow(["" if doc[f] is None else doc[f] for f in USAGE_FIELDS])
    return out.getvalue().encode()

"""The admin API (quart-trio), on ``127.0.0.1:9090`` by default: one app
with the routes of each resource, one admin token check and one error shape.

Every route needs the admin token (``Authorization: Bearer llmgw-admin-…``,
the one in ``DATA_DIR/admin-token``: :mod:`llmgw.auth.admin_token`), compared
in constant time: 401 ``invalid_api_key`` without it, with a message that
says so when a client key (``sk-llmgw-…``) was sent instead. Every route is
JSON in and out (but the usage export). Errors are ``{"error": {"message", "type",
"code", "param"}}`` (:mod:`llmgw.admin.errors`).

The routes, by resource:

- keys, the tenancy tree and limits: :mod:`llmgw.admin.keys`;
- usage rows, sums and exports: :mod:`llmgw.admin.usage`;
- the live settings and the answer cache per project: :mod:`llmgw.admin.config`;
- status and whole-system stop/start: :mod:`llmgw.admin.system`;
- the catalog's models: :mod:`llmgw.admin.models`;
- nodes, replicas, cordons and logs: :mod:`llmgw.admin.nodes`;
- join codes for new nodes: :mod:`llmgw.admin.join_codes`;
- people (accounts, roles, states, memberships): :mod:`llmgw.admin.people`.

The portal's ``/admin`` pages reach this listener through the prefix
dispatch in front of it (:mod:`llmgw.app.pages`), never through these
routes or this token check.

After a change the cluster is poked so the reconciler (on the leader) acts at
once; changes reach the other control planes through the store within about
a second.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Final

from quart import g, request
from quart_trio import QuartTrio

from llmgw.auth.admin_token import AdminTokenFile, fingerprint
from llmgw.auth.keys import KEY_PREFIX, KeyRefused
from llmgw.auth.people import People
from llmgw.control.cluster import Cluster
from llmgw.control.join import JoinService
from llmgw.control.leader_record import LeaderView
from llmgw.control.live import LiveSettings
from llmgw.store import Store

from .config import add_config_routes
from .errors import NotLeader, install
from .guard import add_guard_routes
from .join_codes import add_join_code_routes
from .keys import KeysService, add_key_routes
from .models import add_model_routes
from .nodes import add_node_routes
from .people import add_people_routes
from .system import add_system_routes
from .usage import add_usage_routes

__all__ = ["make_admin_app"]

#: The methods that change something, refused on a standby.
_CHANGES: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def make_admin_app(
    store: Store,
    cluster: Cluster,
    admin_token: AdminTokenFile,
    keys_service: KeysService,
    *,
    live: LiveSettings | None = None,
    data_dir: Path | None = None,
    join: JoinService | None = None,
    people: People | None = None,
    leader_hint: Callable[[], str] | None = None,
    leader_view: LeaderView | None = None,
) -> QuartTrio:
    """The admin API application over ``store`` and ``cluster``.

    Args:
        admin_token: the admin token each call must present.
        keys_service: what the key, tree and limits routes do.
        live: the live settings state the control plane's settings loop
            keeps (:func:`llmgw.control.live.serve_settings`); a fresh one
            over ``store`` when ``None`` (tests).
        data_dir: where weights live, for ``DELETE /api/v1/models/<name>?purge=1``.
        join: what makes join codes; ``None`` when the control plane has no
            join port (``POST /api/v1/nodes/join-codes`` answers 409).
        people: accounts and sessions; a fresh one over ``store`` when
            ``None`` (tests).
        leader_hint: where the leader is (``llmgw server``, several control
            planes of one store): while this control plane does not lead,
            every change (POST, PUT, PATCH, DELETE) is refused with 503
            ``not_leader`` naming it; reads are answered from the store.
            ``None``: one control plane (``llmgw up``), nothing refused.
        leader_view: the leader's record as this control plane knows it,
            for ``GET /api/v1/status``'s ``leadership`` (its own lease when
            it leads is used without it).
    """
    app = QuartTrio("llmgw.admin")
    if live is None:
        live = LiveSettings(store, cluster)
    install(app)

    @app.before_request
    async def require_admin() -> None:
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret:
            raise KeyRefused("The admin API needs 'Authorization: Bearer <admin token>'.")
        secret = secret.strip()
        if secret.startswith(KEY_PREFIX):
            raise KeyRefused(
                "This is a client key (sk-llmgw-…): it calls /v1 only. The admin API "
                "takes the admin token in DATA_DIR/admin-token (llmgw-admin-…), which "
                "'llmgw keys' and 'llmgw ctl' read."
            )
        if not admin_token.check(secret):
            raise KeyRefused("Incorrect admin token provided.")
        g.admin_actor = f"admin token ({fingerprint(secret)})"
        if leader_hint is not None and request.method in _CHANGES and not cluster.is_leader:
            raise NotLeader(
                "This control plane is a standby: changes are made on the leader "
                f"({leader_hint()}); reads are answered here."
            )

    add_key_routes(app, keys_service)
    add_usage_routes(app, store, keys_service)
    add_config_routes(app, store, live)
    add_system_routes(app, cluster, live, store=store, leader_view=leader_view)
    add_model_routes(app, store, cluster, data_dir=data_dir)
    add_node_routes(app, cluster, live, store)
    add_join_code_routes(app, join)
    add_people_routes(app, store, people or People(store, secrets.token_bytes(32)))
    add_guard_routes(app, cluster)
    return app

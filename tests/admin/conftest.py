"""The admin app under quart's test client, over a real SQLite store and an
in-memory cluster, called with the admin token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from quart_trio import QuartTrio

from llmgw.admin.app import make_admin_app
from llmgw.admin.keys import KeysService
from llmgw.auth.admin_token import (
    ADMIN_TOKEN_FILE,
    AdminTokenFile,
    new_admin_token,
    write_admin_token,
)
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster
from llmgw.control.live import LiveSettings
from llmgw.settings import AuthSettings, ServerSettings
from llmgw.store import Store, open_sqlite_store


@attrs.define
class Admin:
    """The app's test client with the admin token, and what is behind it."""

    app: QuartTrio
    client: Any
    secret: str
    store: Store
    cluster: Cluster
    live: LiveSettings
    data_dir: Path

    async def call(
        self, method: str, path: str, body: Any = None, *, key: str | None = None
    ) -> tuple[int, Any]:
        headers = {"authorization": f"Bearer {self.secret if key is None else key}"}
        kwargs: dict[str, Any] = {"method": method, "headers": headers}
        if body is not None:
            kwargs["json"] = body
        response = await self.client.open(path, **kwargs)
        return response.status_code, await response.get_json()


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[Admin]:
    async with open_sqlite_store(tmp_path / "llmgw.db") as store:
        cluster = Cluster()
        cluster.set_secret(b"s" * 32)
        authenticator = KeyAuthenticator(store)
        keys = KeysService(
            store,
            authenticator,
            ScopeResolver(store),
            AuthSettings(),
            bands=lambda: [band.name for band in cluster.settings.router.admission.bands],
        )
        secret = new_admin_token()
        write_admin_token(tmp_path / ADMIN_TOKEN_FILE, secret)
        live = LiveSettings(store, cluster)
        await live.seed(ServerSettings())
        await live.refresh()
        token = AdminTokenFile(tmp_path / ADMIN_TOKEN_FILE)
        app = make_admin_app(store, cluster, token, keys, live=live, data_dir=tmp_path)
        yield Admin(app, app.test_client(), secret, store, cluster, live, tmp_path)

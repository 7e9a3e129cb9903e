"""The admin app under quart's test client, over a real SQLite store and an
in-memory cluster, called with an admin key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from quart_trio import QuartTrio

from llmgw.admin.app import make_admin_app
from llmgw.admin.keys import KeysService
from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.auth.tree import ScopeResolver
from llmgw.control.cluster import Cluster
from llmgw.control.live import LiveSettings
from llmgw.settings import AuthSettings, ServerSettings
from llmgw.store import Store, open_sqlite_store


@attrs.define
class Admin:
    """The app's test client with the admin key, and what is behind it."""

    app: QuartTrio
    client: Any
    secret: str
    key_id: str
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
        secret, record = new_key("ops", is_admin=True)
        await store.insert_key(record)
        live = LiveSettings(store, cluster)
        await live.seed(ServerSettings())
        await live.refresh()
        app = make_admin_app(store, cluster, authenticator, keys, live=live, data_dir=tmp_path)
        yield Admin(app, app.test_client(), secret, record.id, store, cluster, live, tmp_path)

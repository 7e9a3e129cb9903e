"""What ``llmgw up`` keeps in its data directory: the admin token, the client
key, the move of an older ``admin-key``; and the prices of a first start."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest

from llmgw.app.up_files import (
    ensure_admin_token,
    ensure_client_key,
    migrate_admin_key,
)
from llmgw.app.up_prices import FIRST_START_PRICE, first_start_prices, names_default_price
from llmgw.auth.admin_token import AdminTokenFile, new_admin_token, read_admin_token
from llmgw.auth.keys import KeyAuthenticator, KeyRefused, hash_key, new_key
from llmgw.control.cluster import Cluster
from llmgw.control.live import LiveSettings
from llmgw.settings import Price, ServerSettings, load_settings
from llmgw.store import Store, open_sqlite_store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with open_sqlite_store(tmp_path / "llmgw.db") as opened:
        yield opened


def _mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def test_the_admin_token_is_made_0600_once_and_kept(tmp_path: Path) -> None:
    said: list[str] = []
    path = ensure_admin_token(tmp_path, said.append)
    token = read_admin_token(path)
    assert _mode(path) == "0o600"
    assert token not in "\n".join(said)
    assert said == [
        f"admin token: made, kept in {path} (mode 0600). It opens the admin API only "
        "('llmgw keys' and 'llmgw ctl' read it); 'llmgw keys rotate-admin' replaces it"
    ]
    path.chmod(0o644)
    said.clear()
    assert ensure_admin_token(tmp_path, said.append) == path
    assert read_admin_token(path) == token
    assert _mode(path) == "0o600"
    assert said == [f"{path} was mode 0644; now 0600", f"admin token: in {path}"]
    path.write_text("sk-llmgw-not-a-token\n")
    said.clear()
    ensure_admin_token(tmp_path, said.append)
    assert read_admin_token(path).startswith("llmgw-admin-")
    assert said[0] == f"{path} holds no admin token; writing a new one"


async def test_a_first_start_makes_a_client_key_in_the_default_project_and_prints_it(
    store: Store, tmp_path: Path
) -> None:
    said: list[str] = []
    path = await ensure_client_key(store, tmp_path, 3600.0, said.append)
    secret = path.read_text().strip()
    assert _mode(path) == "0o600"
    assert said == [f"client key for /v1 (shown once, kept in {path}, mode 0600): {secret}"]
    key = await KeyAuthenticator(store).check(secret)
    assert (key.name, key.is_admin) == ("client", False)
    assert key.expires_at is not None
    assert key.expires_at - key.created_at == pytest.approx(3600.0)
    [tree] = await store.list_tree()
    assert (tree.path, tree.project.id) == ("default/default/default", key.project_id)
    # A second start keeps it and does not print it.
    said.clear()
    assert await ensure_client_key(store, tmp_path, None, said.append) == path
    assert said == [f"client key: in {path}"]
    assert path.read_text().strip() == secret


async def test_a_revoked_client_key_does_not_come_back_and_another_store_s_is_replaced(
    store: Store, tmp_path: Path
) -> None:
    path = await ensure_client_key(store, tmp_path, None, lambda _: None)
    secret = path.read_text().strip()
    [key] = await store.list_keys()
    await store.revoke_key(key.id, 1.0)
    said: list[str] = []
    await ensure_client_key(store, tmp_path, None, said.append)
    assert path.read_text().strip() == secret
    assert len(await store.list_keys()) == 1
    assert said == [
        f"the client key in {path} is revoked or expired; make another with "
        "'llmgw keys create NAME' and write it there"
    ]
    path.write_text("sk-llmgw-of-another-store\n")
    said.clear()
    await ensure_client_key(store, tmp_path, None, said.append)
    assert said[0] == f"{path} holds no key of this store; making a new client key"
    assert path.read_text().strip() != "sk-llmgw-of-another-store"
    assert len(await store.list_keys()) == 2


async def test_an_older_admin_key_becomes_the_client_key_and_opens_no_admin_api(
    store: Store, tmp_path: Path
) -> None:
    secret, record = new_key("admin", is_admin=True)
    await store.insert_key(record)
    old = tmp_path / "admin-key"
    old.write_text(secret + "\n")
    said: list[str] = []
    await migrate_admin_key(store, tmp_path, said.append)
    client = tmp_path / "client-key"
    assert not old.exists()
    assert client.read_text().strip() == secret
    assert _mode(client) == "0o600"
    found = await store.find_key_by_hash(hash_key(secret))
    assert found is not None
    assert not found.is_admin
    assert found.revoked_at is None  # it still calls /v1
    assert "it is a client key now, moved to" in said[0]
    # ensure_client_key then keeps it; the admin token is another secret.
    said.clear()
    assert await ensure_client_key(store, tmp_path, None, said.append) == client
    assert said == [f"client key: in {client}"]
    token_path = ensure_admin_token(tmp_path, lambda _: None)
    assert not AdminTokenFile(token_path).check(secret)
    # Nothing to move the next time.
    said.clear()
    await migrate_admin_key(store, tmp_path, said.append)
    assert said == []


async def test_an_older_admin_key_beside_a_client_key_is_kept_aside(
    store: Store, tmp_path: Path
) -> None:
    (tmp_path / "client-key").write_text("sk-llmgw-mine\n")
    (tmp_path / "admin-key").write_text("sk-llmgw-unknown\n")
    await migrate_admin_key(store, tmp_path, lambda _: None)
    assert (tmp_path / "client-key").read_text() == "sk-llmgw-mine\n"
    assert (tmp_path / "admin-key.old").read_text() == "sk-llmgw-unknown\n"
    assert not (tmp_path / "admin-key").exists()


async def test_v1_refuses_the_admin_token(store: Store) -> None:
    with pytest.raises(KeyRefused, match="admin token"):
        await KeyAuthenticator(store).check(new_admin_token())


# --- prices ------------------------------------------------------------------------------


async def test_a_first_start_sets_a_default_price_and_says_so(store: Store) -> None:
    said: list[str] = []
    settings = await first_start_prices(store, ServerSettings(), price_given=False, say=said.append)
    assert settings.auth.default_price == FIRST_START_PRICE
    assert not FIRST_START_PRICE.is_zero()
    assert said == [
        "prices: every model without its own price costs 0.10 per million prompt tokens, "
        "0.40 per million completion tokens (auth.default_price, set on this first start), "
        "so budgets count"
    ]
    live = LiveSettings(store, Cluster())
    await live.seed(settings)
    # The next start finds it stored, keeps it and says nothing about prices.
    said.clear()
    again = await first_start_prices(store, ServerSettings(), price_given=False, say=said.append)
    assert again == ServerSettings()  # the store's document wins; the file's are only a seed
    assert said == []


async def test_a_price_named_in_server_yaml_is_kept_even_zero_and_zero_is_said(
    store: Store, tmp_path: Path
) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("auth:\n  default_price: {prompt_per_1k: 0}\n")
    assert names_default_price(config)
    said: list[str] = []
    settings = await first_start_prices(
        store, load_settings(config), price_given=True, say=said.append
    )
    assert settings.auth.default_price == Price()
    assert len(said) == 1
    assert said[0].startswith("prices are zero for every model without its own price")
    assert "never trip a budget" in said[0]
    config.write_text("auth: {default_rpm: 5}\n")
    assert not names_default_price(config)
    assert not names_default_price(None)
    assert not names_default_price(tmp_path / "missing.yaml")


async def test_a_store_seeded_with_zero_prices_is_said_to_be_free(store: Store) -> None:
    live = LiveSettings(store, Cluster())
    await live.seed(ServerSettings())
    said: list[str] = []
    settings = await first_start_prices(store, ServerSettings(), price_given=False, say=said.append)
    assert settings == ServerSettings()
    assert len(said) == 1
    assert said[0].startswith("prices are zero")


def test_run_json_lists_the_join_port_when_there_is_one(tmp_path: Path) -> None:
    import json

    from llmgw.app.control_plane import Addresses
    from llmgw.app.up_files import write_run_file

    base = Addresses(
        api="0.0.0.0:8080",
        admin="127.0.0.1:9090",
        metrics="0.0.0.0:9091",
        agent_hub="0.0.0.0:7443",
        agent_token="t",
    )
    write_run_file(tmp_path, base)
    assert "join" not in json.loads((tmp_path / "run.json").read_text())  # llmgw up
    write_run_file(tmp_path, attrs.evolve(base, join="0.0.0.0:7444"))
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["join"] == "0.0.0.0:7444"
    assert doc["agent_hub"] == "0.0.0.0:7443"

"""The cluster CA kept in the store: every control plane of one store
serves the same CA (``llmgw.control.ca_store``), on both stores."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest

from llmgw.control.ca import ClusterCA
from llmgw.control.ca_store import CA_SECRET, sync_cluster_ca
from llmgw.store import Store, open_store


@pytest.fixture(params=["sqlite", "postgres"])
def store_address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "store.db")
    return str(request.getfixturevalue("postgres_db"))


@pytest.fixture
async def store(store_address: str) -> AsyncIterator[Store]:
    opened: AbstractAsyncContextManager[Store] = open_store(store_address)
    async with opened as s:
        yield s


async def test_two_control_planes_of_one_store_serve_one_ca(store: Store, tmp_path: Path) -> None:
    first, second = tmp_path / "cp1" / "ca", tmp_path / "cp2" / "ca"
    await sync_cluster_ca(store, first)
    ca1 = ClusterCA.load_or_create(first, ["cp1.example"])
    await sync_cluster_ca(store, second)
    ca2 = ClusterCA.load_or_create(second, ["cp2.example"])
    assert ca1.fingerprint == ca2.fingerprint
    assert (first / "ca.key").read_bytes() == (second / "ca.key").read_bytes()
    assert (second / "ca.key").stat().st_mode & 0o777 == 0o600
    # Each has its own server certificate, for its own names, from that CA.
    assert (first / "server.crt").read_bytes() != (second / "server.crt").read_bytes()
    doc = json.loads(await store.get_or_create_secret(CA_SECRET, lambda: b""))
    assert doc["cert"].encode() == ca1.ca_pem


async def test_an_older_control_planes_ca_goes_into_the_store(store: Store, tmp_path: Path) -> None:
    older = tmp_path / "old" / "ca"
    made = ClusterCA.load_or_create(older, [])  # made before the store kept it
    await sync_cluster_ca(store, older)
    assert ClusterCA.load_or_create(older, []).fingerprint == made.fingerprint
    other = tmp_path / "new" / "ca"
    await sync_cluster_ca(store, other)
    assert ClusterCA.load_or_create(other, []).fingerprint == made.fingerprint


async def test_a_folder_with_another_ca_takes_the_stores(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "a" / "ca"
    await sync_cluster_ca(store, shared)
    stray = tmp_path / "b" / "ca"
    ClusterCA.load_or_create(stray, [])
    await sync_cluster_ca(store, stray)
    assert (
        ClusterCA.load_or_create(stray, []).fingerprint
        == ClusterCA.load_or_create(shared, []).fingerprint
    )
    assert "differs from the one in the store" in caplog.text

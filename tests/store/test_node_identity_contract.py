"""The store contract for node identity: node certificates and join tokens.

Every test takes the parametrised ``store`` (or ``open_test_store``) fixture
from ``conftest.py``, so it runs once per backend.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import pytest
import trio

from llmgw import errors
from llmgw.store import (
    Conflict,
    JoinToken,
    JoinTokenExpired,
    JoinTokenUnknown,
    JoinTokenUsed,
    NodeCertificate,
    Store,
)

OpenStore = Callable[[], AbstractAsyncContextManager[Store]]


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def make_token(token: str = "t-1", **kw: object) -> JoinToken:
    fields: dict[str, object] = {
        "token_hash": token_hash(token),
        "created_at": 1_000.0,
        "expires_at": 4_600.0,
    }
    fields.update(kw)
    return JoinToken(**fields)  # type: ignore[arg-type]


# --- node certificates --------------------------------------------------------


async def test_a_node_certificate_is_kept_and_read_back_by_serial(store: Store) -> None:
    cert = NodeCertificate("ab01", "node-b", 1_000.0, 2_000.0)
    await store.insert_node_certificate(cert)
    assert await store.get_node_certificate("ab01") == cert
    assert await store.get_node_certificate("AB01") == cert  # hex in either case
    assert await store.get_node_certificate("ab02") is None


async def test_a_serial_is_kept_once(store: Store) -> None:
    await store.insert_node_certificate(NodeCertificate("ab01", "node-b", 1_000.0, 2_000.0))
    with pytest.raises(Conflict):
        await store.insert_node_certificate(NodeCertificate("ab01", "node-c", 1_001.0, 2_000.0))


async def test_revoking_a_node_revokes_its_valid_certificates_only(store: Store) -> None:
    await store.insert_node_certificate(NodeCertificate("01", "node-b", 1_000.0, 9_000.0))
    await store.insert_node_certificate(NodeCertificate("02", "node-b", 1_100.0, 9_000.0, 1_200.0))
    await store.insert_node_certificate(NodeCertificate("03", "node-b", 1_300.0, 9_000.0))
    await store.insert_node_certificate(NodeCertificate("04", "node-c", 1_000.0, 9_000.0))

    assert await store.revoke_node_certificates("node-b", at=5_000.0) == 2
    assert [(c.serial, c.revoked_at) for c in await store.list_node_certificates("node-b")] == [
        ("01", 5_000.0),
        ("02", 1_200.0),  # the first revocation time stays
        ("03", 5_000.0),
    ]
    got = await store.get_node_certificate("04")
    assert got is not None
    assert got.revoked_at is None
    assert await store.revoke_node_certificates("node-b", at=6_000.0) == 0
    assert await store.revoke_node_certificates("nobody", at=6_000.0) == 0
    assert [c.serial for c in await store.list_node_certificates()] == ["01", "04", "02", "03"]


# --- join tokens --------------------------------------------------------------


async def test_a_join_token_is_used_once(store: Store) -> None:
    await store.insert_join_token(make_token(node_id="node-b", labels={"rack": "r1"}))
    assert await store.get_join_token(token_hash("t-1")) == make_token(
        node_id="node-b", labels={"rack": "r1"}
    )
    assert await store.get_join_token(token_hash("t-2")) is None
    used = await store.use_join_token(token_hash("t-1"), now=1_500.0)
    assert used == make_token(node_id="node-b", labels={"rack": "r1"}, used_at=1_500.0)

    with pytest.raises(JoinTokenUsed) as replayed:
        await store.use_join_token(token_hash("t-1"), now=1_600.0)
    assert replayed.value.used_at == 1_500.0
    assert "already used at 1970-01-01 00:25:00 UTC" in str(replayed.value)
    assert replayed.value.status == 410
    stored = await store.get_join_token(token_hash("t-1"))
    assert stored is not None
    assert stored.used_at == 1_500.0


async def test_an_unknown_token_is_refused_as_unknown(store: Store) -> None:
    await store.insert_join_token(make_token())
    with pytest.raises(JoinTokenUnknown) as unknown:
        await store.use_join_token(token_hash("t-2"), now=1_500.0)
    assert unknown.value.status == 403
    assert "not one of this cluster's" in str(unknown.value)
    assert isinstance(unknown.value, errors.Refused)


async def test_an_expired_token_is_refused_as_expired_and_stays_unused(store: Store) -> None:
    await store.insert_join_token(make_token(expires_at=2_000.0))
    with pytest.raises(JoinTokenExpired) as expired:
        await store.use_join_token(token_hash("t-1"), now=2_000.0)  # the end itself is out
    assert expired.value.expires_at == 2_000.0
    assert expired.value.status == 410
    assert "expired at 1970-01-01 00:33:20 UTC" in str(expired.value)
    # Still expired, not "used", the next time.
    with pytest.raises(JoinTokenExpired):
        await store.use_join_token(token_hash("t-1"), now=2_500.0)


async def test_a_token_hash_is_kept_once(store: Store) -> None:
    await store.insert_join_token(make_token())
    with pytest.raises(Conflict):
        await store.insert_join_token(make_token(created_at=2_000.0))


async def test_two_connections_using_one_token_at_once_succeed_once(
    open_test_store: OpenStore,
) -> None:
    """Like two control planes on one database: exactly one use wins."""
    async with open_test_store() as first, open_test_store() as second:
        await first.insert_join_token(make_token())
        wins: list[JoinToken] = []
        refusals: list[JoinTokenUsed] = []

        async def use(store: Store) -> None:
            try:
                wins.append(await store.use_join_token(token_hash("t-1"), now=1_500.0))
            except JoinTokenUsed as exc:
                refusals.append(exc)

        async with trio.open_nursery() as nursery:
            for store in (first, second, first, second):
                nursery.start_soon(use, store)
    assert len(wins) == 1
    assert len(refusals) == 3


async def test_tokens_and_certificates_survive_a_reopen(open_test_store: OpenStore) -> None:
    async with open_test_store() as store:
        await store.insert_join_token(make_token(labels={"gpu": "h100"}))
        await store.insert_node_certificate(NodeCertificate("0a", "node-b", 1_000.0, 2_000.0))
    async with open_test_store() as store:
        assert (await store.use_join_token(token_hash("t-1"), now=1_100.0)).labels == {
            "gpu": "h100"
        }
        assert await store.get_node_certificate("0a") is not None

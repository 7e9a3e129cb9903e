"""Client API keys: ``sk-llmgw-…`` secrets, kept only as SHA-256 hashes.

:func:`new_key` makes a secret and its record; :class:`KeyAuthenticator`
checks a presented secret against the store with a short in-memory cache
(``auth.cache_ttl``), keyed by the presented secret itself (compared whole;
by its SHA-256 when longer than a key), so a key seen within the TTL costs a
dict look-up, not a SHA-256. A key revoked through this control plane is
dropped from the cache at once. The admin token (``llmgw-admin-…``,
:mod:`llmgw.auth.admin_token`) is never a client key: it is refused with a
message saying so.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Final

import attrs

from llmgw import errors
from llmgw.store import KeyRecord, Store, StoreError

from .admin_token import ADMIN_TOKEN_PREFIX

__all__ = ["KEY_PREFIX", "KeyAuthenticator", "KeyRefused", "hash_key", "new_key"]

KEY_PREFIX: Final = "sk-llmgw-"
#: How long a looked-up key is trusted before the store is asked again.
CACHE_TTL_S: Final = 5.0
#: Most cached entries; the cache is cleared when it grows past this.
CACHE_MAX_ENTRIES: Final = 100_000
#: Secrets up to this many characters are cached by themselves, longer ones
#: by their SHA-256 (a key made by :func:`new_key` has 52).
_CACHED_SECRET_CHARS: Final = 64


def hash_key(secret: str) -> str:
    """Hex SHA-256 of a key's secret (what the store keeps)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_key(
    name: str, *, is_admin: bool = False, now: float | None = None
) -> tuple[str, KeyRecord]:
    """A fresh ``sk-llmgw-…`` secret and the record to store for it.

    The secret is shown once; only its hash is kept.
    """
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    record = KeyRecord(
        id="key_" + secrets.token_hex(8),
        name=name,
        key_hash=hash_key(secret),
        prefix=secret[: len(KEY_PREFIX) + 4],
        created_at=time.time() if now is None else now,
        is_admin=is_admin,
    )
    return secret, record


class KeyRefused(errors.Refused):
    """A presented key is not accepted (401); the message says why, for the caller."""

    status = 401
    code = "invalid_api_key"


@attrs.define
class _Cached:
    record: KeyRecord | None
    until: float


class KeyAuthenticator:
    """Turns a bearer secret into a live :class:`KeyRecord`, or ``None``."""

    def __init__(self, store: Store, *, cache_ttl_s: float = CACHE_TTL_S) -> None:
        self._store = store
        self._ttl_s = cache_ttl_s
        #: Presented secret → its record and until when it is trusted.
        self._cache: dict[str, _Cached] = {}

    async def authenticate(self, secret: str) -> KeyRecord | None:
        """The live key for ``secret``; ``None`` when unknown, revoked or expired."""
        try:
            return await self.check(secret)
        except KeyRefused:
            return None

    async def check(self, secret: str) -> KeyRecord:
        """The live key for ``secret``.

        Raises:
            KeyRefused: unknown, revoked or expired, or the admin token, with a
                message saying which.
            StoreError: the store failed and the key was never seen before.
        """
        if secret.startswith(ADMIN_TOKEN_PREFIX):
            raise KeyRefused(
                "This is the llmgw admin token: it opens the admin API only. Call /v1 "
                "with a client key (sk-llmgw-…): the one in DATA_DIR/client-key, or one "
                "made with 'llmgw keys create'."
            )
        record = await self._lookup(secret)
        if record is None:
            raise KeyRefused("Incorrect API key provided.")
        if record.revoked_at is not None:
            raise KeyRefused("This API key has been revoked.")
        if record.expires_at is not None and record.expires_at <= time.time():
            raise KeyRefused("This API key has expired.")
        return record

    async def _lookup(self, secret: str) -> KeyRecord | None:
        if not secret.startswith(KEY_PREFIX):
            return None
        now = time.monotonic()
        # A secret of a key's length is its own cache key (no SHA-256 per
        # request); a longer one is cached by its digest, so bogus long
        # secrets cannot make the cache large.
        slot = secret if len(secret) <= _CACHED_SECRET_CHARS else hash_key(secret)
        cached = self._cache.get(slot)
        if cached is None or cached.until < now:
            try:
                record = await self._store.find_key_by_hash(
                    hash_key(secret) if slot is secret else slot
                )
            except StoreError:
                if cached is None:
                    raise
                # The store is slow or down: a key seen before stays what it
                # was rather than looking unknown.
                return cached.record
            if len(self._cache) >= CACHE_MAX_ENTRIES:
                self._cache.clear()
            cached = _Cached(record, now + self._ttl_s)
            self._cache[slot] = cached
        return cached.record

    def forget(self, key_id: str) -> None:
        """Drop a key from the cache (after a revoke on this control plane)."""
        for slot, cached in list(self._cache.items()):
            if cached.record is not None and cached.record.id == key_id:
                del self._cache[slot]

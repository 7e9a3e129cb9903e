"""Outside-provider keys as endpoints (``docs/api.md``, Outside providers).

A catalog model with ``source: external`` names a provider ``url`` (without
``/v1``) and one or more key files with weights. :class:`ProviderKeys` turns
them into endpoints, one per readable key: ``external:<model>#<n>``, ``n``
counting from 1 by the key's position in the list, so a key's endpoint — and
its breaker — keeps its name and identity across refreshes.

Keys live in files on the control planes and are read at use:
:meth:`ProviderKeys.refresh` looks at each file at most once a second and
reads it again only when its modification time, change time, size or inode
changed, so a replaced key takes effect within about a second. The files
are tiny and local, so they are read synchronously on the trio thread (a
``stat`` per file per second, a read only on change); a key file on a slow
network mount would stall the event loop for that read. A file that cannot
be read or holds nothing is dropped (a warning names the endpoint and the
file, never the key); if none is left, the model has no endpoint and the
caller withdraws it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Final, NamedTuple
from urllib.parse import urlsplit

from llmgw.router.breaker import Breaker
from llmgw.router.endpoint import Endpoint

__all__ = ["CHECK_EVERY_S", "ExternalKeyFile", "ProviderKeys", "ProviderUrl", "parse_provider_url"]

log = logging.getLogger("llmgw.router")

#: How often a key file is looked at, at most, in seconds.
CHECK_EVERY_S: Final = 1.0


class ExternalKeyFile(NamedTuple):
    """One entry of ``external.api_key_files``: a key file and its traffic
    weight relative to the model's other keys (0 counts as 1)."""

    file: str
    weight: int = 1


class ProviderUrl(NamedTuple):
    """Where a provider answers: ``path_prefix`` goes before ``/v1/…``."""

    host: str
    port: int
    tls: bool
    path_prefix: str


def parse_provider_url(url: str) -> ProviderUrl:
    """``https://api.x.com`` → ``(api.x.com, 443, True, "")``;
    ``http://127.0.0.1:8001`` → ``(127.0.0.1, 8001, False, "")``;
    ``https://host/openai/`` → ``(host, 443, True, "/openai")``.

    Raises:
        ValueError: not an http(s) URL with a host, or one carrying a user,
            a query or a fragment.
    """
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"provider url {url!r} is not valid: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"provider url {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"provider url {url!r} names no host")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"provider url {url!r} must not carry credentials; use a key file")
    if parts.query or parts.fragment:
        raise ValueError(f"provider url {url!r} must not have a query or fragment")
    tls = parts.scheme == "https"
    return ProviderUrl(
        host=parts.hostname,
        port=port if port is not None else (443 if tls else 80),
        tls=tls,
        path_prefix=parts.path.rstrip("/"),
    )


class _Key:
    __slots__ = ("checked_at", "endpoint", "file", "ok", "signature", "weight")

    def __init__(self, file: str, weight: int) -> None:
        self.file = file
        self.weight = weight
        self.endpoint: Endpoint | None = None
        self.checked_at: float | None = None
        self.signature: tuple[int, int, int, int] | None = None
        #: Read and non-empty at the last look; ``None`` before the first.
        self.ok: bool | None = None


class ProviderKeys:
    """The keys of one outside model.

    Args:
        model: the catalog model's name.
        url: the provider's base URL, without ``/v1`` (:func:`parse_provider_url`).
        keys: ``(file, weight)`` pairs (or :class:`ExternalKeyFile`), in the
            catalog's order; weight 0 counts as 1.
        check_every_s: how often each file is looked at, at most.

    Raises:
        ValueError: a bad ``url``, no keys, or a negative weight.
    """

    def __init__(
        self,
        model: str,
        url: str,
        keys: Sequence[tuple[str, int]],
        *,
        check_every_s: float = CHECK_EVERY_S,
    ) -> None:
        if not keys:
            raise ValueError(f"external model {model!r} has no key file")
        self.model = model
        self.url = parse_provider_url(url)
        self._check_every_s = check_every_s
        self._keys: list[_Key] = []
        for file, weight in keys:
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
                raise ValueError(
                    f"external model {model!r}: a key weight must be a whole number ≥ 0"
                )
            self._keys.append(_Key(file, max(weight, 1)))

    def refresh(self, now: float) -> list[Endpoint]:
        """One endpoint per readable, non-empty key file, in the catalog's
        order, at ``now`` (monotonic seconds).

        Files are looked at no more than once per ``check_every_s``. An
        endpoint stays the same object while its file is readable; when the
        key text changed, its ``api_key`` is updated in place and its breaker
        starts afresh (a key refused or rate-limited is typically what gets
        replaced). An empty list: no key can be read, withdraw the model.
        """
        endpoints: list[Endpoint] = []
        for n, key in enumerate(self._keys, start=1):
            if key.checked_at is None or now - key.checked_at >= self._check_every_s:
                key.checked_at = now
                self._look(n, key)
            if key.ok and key.endpoint is not None:
                endpoints.append(key.endpoint)
        return endpoints

    def _look(self, n: int, key: _Key) -> None:
        try:
            st = os.stat(key.file)
            signature = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
            if key.ok and signature == key.signature:
                return
            with open(key.file, encoding="utf-8") as f:
                text = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._drop(n, key, f"cannot be read ({reason})")
            return
        if not text:
            self._drop(n, key, "is empty")
            return
        key.signature = signature
        endpoint = key.endpoint
        if endpoint is None:
            url = self.url
            key.endpoint = Endpoint(
                replica_id=f"external:{self.model}#{n}",
                model=self.model,
                host=url.host,
                port=url.port,
                api_key=text,
                weight=key.weight,
                external=True,
                tls=url.tls,
                path_prefix=url.path_prefix,
            )
        elif endpoint.api_key != text:
            endpoint.api_key = text
            endpoint.breaker = Breaker()
        if key.ok is False:
            log.info("key file of %s is readable again", self._name(n))
        key.ok = True

    def _drop(self, n: int, key: _Key, why: str) -> None:
        if key.ok is not False:
            log.warning("key file %s of %s %s; the key is dropped", key.file, self._name(n), why)
        key.ok = False
        key.signature = None

    def _name(self, n: int) -> str:
        return f"external:{self.model}#{n}"

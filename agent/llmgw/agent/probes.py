"""Probes of an engine over HTTP: where it answers, whether it is ready, and
whether its port is free before it starts.

An engine is ready when ``GET <base url><health path>``, with the engine key
as a bearer token when it has one, answers 200 with a body that
:func:`~llmgw.engines.base.body_says_ready` (at most
:data:`~llmgw.engines.base.MAX_HEALTH_BODY_BYTES` of it read). A probe takes
at most :data:`PROBE_TIMEOUT_S` (a liveness probe of a READY engine,
:data:`LIVENESS_TIMEOUT_S`); any HTTP error, timeout or other status counts
as not ready.
"""

from __future__ import annotations

import socket
from typing import Final

import httpx
import trio

from llmgw.engines.base import MAX_HEALTH_BODY_BYTES, body_says_ready, lists_model

__all__ = [
    "LIVENESS_TIMEOUT_S",
    "PROBE_TIMEOUT_S",
    "auth_headers",
    "base_url",
    "is_ready",
    "lists_served_model",
    "port_free",
    "probe_client",
]

#: How long one readiness probe may take, in seconds.
PROBE_TIMEOUT_S: Final = 2.0
#: How long one liveness probe of a READY engine may take, in seconds: a
#: health endpoint answers at once even while the engine generates.
LIVENESS_TIMEOUT_S: Final = 2.0


def base_url(bind_addr: str, port: int) -> str:
    """``http://HOST:PORT`` where an engine bound to ``bind_addr`` answers
    locally: a wildcard or empty address is probed on loopback (``0.0.0.0``
    → ``127.0.0.1``, ``::`` → ``::1``), an IPv6 host is bracketed."""
    host = bind_addr or "127.0.0.1"
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def auth_headers(api_key: str) -> dict[str, str]:
    """The headers a probe sends: the engine key as a bearer token, or none."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe_client() -> httpx.AsyncClient:
    """An HTTP client for probes: no proxies from the environment, a
    :data:`PROBE_TIMEOUT_S` timeout. The caller closes it (``async with``)."""
    return httpx.AsyncClient(trust_env=False, timeout=PROBE_TIMEOUT_S)


async def is_ready(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> bool:
    """Whether the engine's health endpoint at ``url`` says it is ready
    (see the module docstring) within ``timeout_s`` seconds; never raises
    for network errors."""
    with trio.move_on_after(timeout_s):
        try:
            async with client.stream("GET", url, headers=headers) as response:
                if response.status_code != 200:
                    return False
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) >= MAX_HEALTH_BODY_BYTES:
                        break
                return body_says_ready(bytes(body[:MAX_HEALTH_BODY_BYTES]))
        except httpx.HTTPError:
            return False
    return False


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (SO_REUSEADDR, as servers set
    it: a port in TIME_WAIT counts as free, one with a listener does not).
    An empty ``host`` means every address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host or "0.0.0.0", port))
        except OSError:
            return False
    return True


async def lists_served_model(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    served_model_name: str,
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> bool:
    """Whether ``GET url`` (an engine's ``/v1/models``, with its key) answers
    200 listing ``served_model_name``
    (:func:`~llmgw.engines.base.lists_model`) within ``timeout_s`` seconds;
    never raises for network errors."""
    with trio.move_on_after(timeout_s):
        try:
            response = await client.get(url, headers=headers)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and lists_model(response.content, served_model_name)
    return False

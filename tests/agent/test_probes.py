"""Probes of an engine: its local address, readiness, a free port."""

from __future__ import annotations

import socket

import pytest

from llmgw.agent import probes


@pytest.mark.parametrize(
    ("bind_addr", "url"),
    [
        ("", "http://127.0.0.1:8001"),
        ("0.0.0.0", "http://127.0.0.1:8001"),
        ("::", "http://[::1]:8001"),
        ("10.0.0.7", "http://10.0.0.7:8001"),
        ("fe80::1", "http://[fe80::1]:8001"),
    ],
)
def test_base_url(bind_addr: str, url: str) -> None:
    """A wildcard bind is probed on loopback; IPv6 hosts are bracketed."""
    assert probes.base_url(bind_addr, 8001) == url


def test_auth_headers() -> None:
    """The key as a bearer token, or no header without one."""
    assert probes.auth_headers("k") == {"Authorization": "Bearer k"}
    assert probes.auth_headers("") == {}


def test_port_free() -> None:
    """A port with a listener is taken; once closed it is free."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not probes.port_free("127.0.0.1", port)
    assert probes.port_free("127.0.0.1", port)


async def test_nothing_listening_is_not_ready() -> None:
    """A refused connection is "not ready", never an error."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with probes.probe_client() as client:
        assert not await probes.is_ready(client, f"http://127.0.0.1:{port}/health", {})

"""The upstream pool over TLS (outside providers at https URLs), against a
local TLS server with a throwaway certificate made by ``openssl``."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import pytest
import trio

from llmgw.gateway.upstream import UpstreamError, UpstreamPool, default_ssl_context

ANSWER = (
    b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{"ok":true}'
)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def client_context(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


async def keep_alive_server(stream: trio.abc.Stream) -> None:
    """Answers every request on a connection, seen by its blank line."""
    data = b""
    try:
        while True:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            data += chunk
            while b"\r\n\r\n" in data:
                head, _, data = data.partition(b"\r\n\r\n")
                assert head.startswith(b"GET /v1/models HTTP/1.1\r\n")
                assert b"\r\nhost: localhost:" in head.lower()
                await stream.send_all(ANSWER)
    except trio.BrokenResourceError:
        return


async def serve(
    nursery: trio.Nursery,
    handler: Callable[[trio.abc.Stream], Awaitable[None]],
    server_context: ssl.SSLContext | None,
) -> int:
    if server_context is None:
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    else:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, handler, 0, server_context, host="127.0.0.1")
        )
    listener = listeners[0]
    socket_listener = listener.transport_listener if server_context else listener
    return int(socket_listener.socket.getsockname()[1])


def server_context(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    return context


async def test_requests_go_over_tls_and_reuse_the_connection(
    certificate: tuple[Path, Path],
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await serve(nursery, keep_alive_server, server_context(certificate))
            pool = UpstreamPool(
                "127.0.0.1",
                port,
                ssl_context=client_context(certificate[0]),
                server_hostname="localhost",
                connect_timeout_s=10,
            )
            assert pool.tls
            try:
                for _ in range(3):
                    async with await pool.request(b"GET", b"/v1/models", [], b"") as response:
                        assert response.status == 200
                        assert await response.read() == b'{"ok":true}'
                assert pool.statistics() == {"idle": 1, "opened": 1}
            finally:
                await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_an_untrusted_certificate_is_an_error_before_any_response(
    certificate: tuple[Path, Path],
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await serve(nursery, keep_alive_server, server_context(certificate))
            pool = UpstreamPool(
                "127.0.0.1", port, ssl_context=default_ssl_context(), server_hostname="localhost"
            )
            with pytest.raises(UpstreamError, match="TLS handshake") as caught:
                await pool.request(b"GET", b"/v1/models", [], b"")
            assert caught.value.before_response
            assert pool.statistics() == {"idle": 0, "opened": 0}
            nursery.cancel_scope.cancel()


async def test_a_wrong_hostname_is_refused(certificate: tuple[Path, Path]) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await serve(nursery, keep_alive_server, server_context(certificate))
            pool = UpstreamPool(
                "127.0.0.1",
                port,
                ssl_context=client_context(certificate[0]),
                server_hostname="api.example.com",
            )
            with pytest.raises(UpstreamError, match="TLS handshake"):
                await pool.request(b"GET", b"/v1/models", [], b"")
            nursery.cancel_scope.cancel()


async def test_a_handshake_that_never_ends_is_bounded_by_the_connect_timeout(
    certificate: tuple[Path, Path],
) -> None:
    async def silent(stream: trio.abc.Stream) -> None:
        await trio.sleep_forever()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await serve(nursery, silent, None)  # TCP only: no TLS answer
            pool = UpstreamPool(
                "127.0.0.1",
                port,
                ssl_context=client_context(certificate[0]),
                server_hostname="localhost",
                connect_timeout_s=0.2,
            )
            with pytest.raises(UpstreamError, match="no connection within") as caught:
                await pool.request(b"GET", b"/v1/models", [], b"")
            assert caught.value.before_response
            nursery.cancel_scope.cancel()


def test_host_header_leaves_out_default_ports() -> None:
    tls = UpstreamPool("api.example.com", 443, ssl_context=default_ssl_context())
    assert tls._host_header == b"api.example.com"
    plain = UpstreamPool("127.0.0.1", 8000)
    assert plain._host_header == b"127.0.0.1:8000"
    v6 = UpstreamPool("::1", 8000)
    assert v6._host_header == b"[::1]:8000"
    named = UpstreamPool("10.0.0.1", 8443, ssl_context=default_ssl_context(), server_hostname="p")
    assert named._host_header == b"p:8443"

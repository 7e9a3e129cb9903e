"""Small HTTP pieces the gateway's modules share: response header pairs,
reading a request header, sending a whole answer (ASGI)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from llmgw.asgi import Scope, Send

__all__ = ["JSON", "NO_CACHE", "SSE", "answer", "header"]

JSON: Final = (b"content-type", b"application/json")
SSE: Final = (b"content-type", b"text/event-stream")
NO_CACHE: Final = (b"cache-control", b"no-cache")


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first request header called ``name`` (lower case), or ``None``."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def answer(
    send: Send,
    status: int,
    body: bytes,
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    content_type: tuple[bytes, bytes] = JSON,
) -> None:
    """Send a whole answer: ``status``, ``content_type``, its length,
    ``headers``, then ``body``."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [content_type, (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})

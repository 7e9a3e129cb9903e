"""Listen addresses and the ASGI listener of the composition root."""

from __future__ import annotations

import httpx
import pytest
import trio

from llmgw.app.listen import serve_asgi, split_address, with_lifespan
from llmgw.asgi import Receive, Scope, Send


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:7443", ("::1", 7443)),
        (":9090", ("127.0.0.1", 9090)),
    ],
)
def test_an_address_splits_into_host_and_port(address: str, expected: tuple[str, int]) -> None:
    assert split_address(address) == expected


def test_a_port_that_is_no_number_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        split_address("localhost:http")


async def test_an_app_without_lifespan_is_served_and_stops_on_the_event() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(serve_asgi, with_lifespan(app), "127.0.0.1:0", stop, 1.0)
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://{bound}/")
        assert (response.status_code, response.text) == (200, "ok")
        stop.set()

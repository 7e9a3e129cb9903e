"""The console against an admin address that accepts connections and never
answers (a hung control plane): keys are still taken at once, and the title
bar says the control plane does not answer once the call's deadline passes;
every screen's key bar fits 80 columns."""

from __future__ import annotations

import asyncio
import time

from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from llmgw.admin.client import AsyncAdminClient
from llmgw.console.app import Console


async def _until(predicate: object, what: str, timeout_s: float = 60.0) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


async def _scenario() -> None:
    held: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = AsyncAdminClient(f"http://127.0.0.1:{port}", "sk-llmgw-admin-test", timeout_s=30)
    with create_pipe_input() as pipe:
        console = Console(client, refresh_s=1.0, input=pipe, output=DummyOutput())
        task = asyncio.create_task(console.run())
        try:
            await _until(lambda: held, "the first call to hang")
            pipe.send_text("2")
            await _until(lambda: console.screen == 1, "the key to be taken")
            # Taken while the first refresh is still waiting for its answer.
            assert console.refreshes == 0
            assert console.down is None
            await _until(lambda: console.down is not None, "the console to say so")
            assert "did not answer" in (console.down or "")
            title = "".join(fragment[1] for fragment in console._title())
            assert "CONTROL PLANE NOT ANSWERING" in title
            # Every screen's key bar fits an 80-column terminal (it was cut).
            for n in range(8):
                pipe.send_text(str(n + 1))
                await _until(lambda n=n: console.screen == n, f"screen {n + 1}")
                bar = "".join(fragment[1] for fragment in console._keybar())
                assert len(bar) <= 80, bar
                assert bar.endswith("q quit"), bar
        finally:
            pipe.send_text("\x03")
            await asyncio.wait_for(task, 30)
            await client.aclose()
            for writer in held:
                writer.close()
            server.close()
            await server.wait_closed()


def test_a_hung_control_plane_blocks_no_key_and_is_reported() -> None:
    asyncio.run(_scenario())

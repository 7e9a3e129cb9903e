"""``llmgw.asgi.while_connected``: a handler cancelled when its client goes
away, through the server's watch or a task of its own."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from llmgw.asgi import WATCH_DISCONNECT, Message, while_connected


class Refused(Exception):
    pass


def _receive_disconnect_after(seconds: float) -> Any:
    async def receive() -> Message:
        await trio.sleep(seconds)
        return {"type": "http.disconnect"}

    return receive


async def _never() -> Message:
    await trio.sleep_forever()
    raise AssertionError


async def test_a_task_of_its_own_cancels_the_work_when_the_client_leaves() -> None:
    reached: list[str] = []

    async def work() -> None:
        await trio.sleep_forever()
        reached.append("end")

    with trio.fail_after(10):
        left = await while_connected({}, _receive_disconnect_after(0.01), work)
    assert left is True
    assert reached == []


async def test_work_that_ends_first_is_not_a_client_gone() -> None:
    done = []

    async def work() -> None:
        done.append(1)

    assert await while_connected({}, _never, work) is False
    assert done == [1]


@pytest.mark.parametrize("watched", [False, True])
async def test_an_error_of_the_work_comes_out_as_it_was(watched: bool) -> None:
    async def work() -> None:
        raise Refused("no")

    scope: dict[str, Any] = {}
    if watched:
        scope["extensions"] = {WATCH_DISCONNECT: lambda cancel_scope: None}
    with pytest.raises(Refused):  # not an ExceptionGroup
        await while_connected(scope, _never, work)


async def test_the_servers_watch_is_armed_then_disarmed_and_cancels() -> None:
    armed: list[trio.CancelScope | None] = []

    def watch(cancel_scope: trio.CancelScope | None) -> None:
        armed.append(cancel_scope)

    async def work() -> None:
        scope = armed[0]
        assert scope is not None
        scope.cancel()  # what the server does when the client hangs up
        await trio.sleep_forever()

    left = await while_connected({"extensions": {WATCH_DISCONNECT: watch}}, _never, work)
    assert left is True
    assert len(armed) == 2
    assert armed[1] is None  # disarmed once the work ended

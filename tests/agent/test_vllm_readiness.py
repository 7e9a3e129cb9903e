"""Readiness for adapters that also need ``/v1/models`` to list the served
name (vLLM's rule), run by the real supervisor against the sim engine, which
serves ``/health`` and ``/v1/models`` as vLLM does."""

from __future__ import annotations

import socket
from pathlib import Path

import attrs
import trio

from llmgw.agent.protocol import EngineProfile, ShardState, ShardStatus, StartShard
from llmgw.agent.supervisor import Supervisor
from llmgw.engines.base import EngineAdapter, ReadyByModelList
from llmgw.engines.sim.adapter import SimAdapter

DEADLINE_S = 60


@attrs.frozen
class SimReadyByModels(SimAdapter):
    """The sim engine, made ready only by vLLM's rule."""

    def models_path(self) -> str:
        return "/v1/models"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start(served: str, *args: str) -> StartShard:
    return StartShard(
        correlation_id="c1",
        shard_id="s1",
        replica_id="r1",
        profile=EngineProfile(name="m", engine="simv", served_model_name=served, args=args),
        port=_port(),
        api_key="engine-key-4711",
    )


async def _run(tmp_path: Path, start: StartShard, wait_s: float) -> list[ShardStatus]:
    """Start ``start`` and collect its statuses for up to ``wait_s`` seconds
    (until READY or FAILED); stop it."""
    adapter = SimReadyByModels()
    assert isinstance(adapter, ReadyByModelList)

    def adapter_for(name: str) -> EngineAdapter:
        assert name == "simv"
        return adapter

    send, receive = trio.open_memory_channel[ShardStatus](100)
    sup = Supervisor(
        adapter_for=adapter_for, events=send, state_dir=tmp_path / "state", probe_interval_s=0.05
    )
    seen: list[ShardStatus] = []
    async with send, receive, trio.open_nursery() as nursery:
        await nursery.start(sup.serve)
        await sup.start_shard(start)
        with trio.move_on_after(wait_s):
            async for status in receive:
                seen.append(status)
                if status.state in (ShardState.READY, ShardState.FAILED):
                    break
        await sup.stop_all()
        nursery.cancel_scope.cancel()
    return seen


async def test_ready_once_models_lists_the_served_name(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        seen = await _run(tmp_path, _start("tiny"), DEADLINE_S - 10)
    assert [s.state for s in seen][-1] is ShardState.READY, seen


async def test_healthy_but_serving_another_name_is_not_ready(tmp_path: Path) -> None:
    """/health answers 200 but /v1/models lists "other" (the last --model
    wins in the sim's argparse): the shard stays STARTING."""
    with trio.fail_after(DEADLINE_S):
        seen = await _run(tmp_path, _start("tiny", "--model", "other"), 8)
    states = [s.state for s in seen]
    assert states, seen
    assert states[0] is ShardState.STARTING, seen
    assert ShardState.READY not in states, seen

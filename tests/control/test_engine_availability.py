"""Placement uses what each node really has installed: a model whose engine
no node advertises stays waiting, with a reason naming the engine (and why
its install failed, when the node said), and is placed once a node
advertises it."""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing

from llmgw.agent import protocol
from llmgw.control.cluster import Cluster
from llmgw.control.reconciler import serve_reconciler
from llmgw.settings import ServerSettings
from llmgw.store import ModelRecord, Profile

PORTS = (20000, 20009)


class Catalog:
    def __init__(self, *models: ModelRecord) -> None:
        self.models = list(models)

    async def list_models(self) -> list[ModelRecord]:
        return list(self.models)


def _vllm_model() -> ModelRecord:
    profile = Profile(engine="vllm", gpu_class="h100-80g", gpus=1, context_tokens=8192, slots=4)
    return ModelRecord(name="qwen", source="/models/qwen", profiles=(profile,))


def _register(
    cluster: Cluster,
    sent: list[protocol.Message],
    engines: tuple[str, ...],
    failures: dict[str, str] | None = None,
) -> None:
    card = protocol.Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_mb=81559)

    async def send(message: protocol.Message) -> None:
        sent.append(message)

    cluster.node_registered(
        protocol.Register(
            node_id="gpu-1",
            address="10.0.0.1",
            agent_version="test",
            hardware=protocol.Hardware(cpu_count=16, memory_total_mb=131072, gpus=(card,)),
            engines=engines,
            engine_failures=dict(failures or {}),
        ),
        send,
    )


async def _until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(60):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.05)


async def test_a_model_whose_engine_no_node_has_waits_naming_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = Cluster(clock=trio.current_time)
    cluster.apply_settings(ServerSettings())
    sent: list[protocol.Message] = []
    why = "engine vllm: install failed: No solution found when resolving dependencies"
    _register(cluster, sent, ("llamacpp", "sim"), {"vllm": why})
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_reconciler, Catalog(_vllm_model()), cluster, PORTS)
        await _until(lambda: bool(cluster.waiting))
        await trio.sleep(5)
        (reason,) = cluster.waiting.values()
        assert "fits on no node" in reason
        assert "gpu-1: engine vllm is not installed (installed: llamacpp, sim)" in reason
        assert f"its install failed: {why}" in reason
        assert not any(isinstance(m, protocol.StartShard) for m in sent)
        # the node installs vLLM and registers again: the replica is placed there
        _register(cluster, sent, ("llamacpp", "sim", "vllm"))
        cluster.poke()
        await _until(lambda: any(isinstance(m, protocol.StartShard) for m in sent))
        (start,) = [m for m in sent if isinstance(m, protocol.StartShard)]
        assert start.profile.engine == "vllm"
        assert start.gpu_indices == (0,)
        nursery.cancel_scope.cancel()

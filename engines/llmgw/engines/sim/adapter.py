"""The engine adapter for the sim engine: how an agent starts one."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import attrs

from llmgw.engines.base import Command, ShardLaunch, engine_env, error_line
from llmgw.engines.sim.config import KEY_ENV

__all__ = ["SimAdapter"]


@attrs.frozen
class SimAdapter:
    """The :class:`~llmgw.engines.base.EngineAdapter` for the sim engine.

    One process per shard: ``python -m llmgw.engines.sim --host B --port P
    --model NAME *args``, the key in ``LLAMA_API_KEY``.
    """

    python: str = sys.executable

    @property
    def name(self) -> str:
        return "sim"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str:
        return "/metrics"

    def failure_cause(self, lines: Sequence[str]) -> str:
        """The generic picker, :func:`~llmgw.engines.base.error_line`."""
        return error_line(lines)

    def commands(self, shard: ShardLaunch) -> list[Command]:
        """``[python, -m, llmgw.engines.sim, --host, …, --port, …, --model, …,
        --slots, N, *args]``: the profile's slots bound the requests generating
        at once, as llama.cpp's ``--parallel`` does (a ``--slots`` in ``args``
        wins), so the router's idea of a replica's capacity holds."""
        args = (
            "-m",
            "llmgw.engines.sim",
            "--host",
            shard.bind_addr,
            "--port",
            str(shard.http_port),
            "--model",
            shard.served_model_name,
            "--slots",
            str(shard.slots),
            *shard.args,
        )
        return [Command(name="sim", path=self.python, args=args, env=engine_env(shard, KEY_ENV))]

"""Helpers for tests that run engines as real processes.

:func:`open_sim` starts a sim engine on a kernel-chosen port and stops it on
exit; any test suite (gateway, router, end-to-end) can use it::

    async with open_sim("--tokens", "8", api_key="k") as sim:
        ...  # sim.base_url, sim.port, sim.process
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import attrs
import trio

__all__ = [
    "SIM_START_TIMEOUT",
    "RunningSim",
    "SimStarter",
    "engine_process_env",
    "open_sim",
    "read_line",
    "sim_argv",
    "stop_process",
]

#: Seconds a sim engine gets to print its listening line.
SIM_START_TIMEOUT = 15.0

#: Seconds :func:`stop_process` waits after SIGTERM before SIGKILL.
STOP_TIMEOUT = 5.0


@attrs.frozen
class RunningSim:
    """A sim engine process started by :func:`open_sim`.

    Attributes:
        process: the engine process.
        port: the port it listens on (127.0.0.1).
        api_key: its key; empty when keyless.
        started_line: its first stdout line (``sim engine listening on …``).
    """

    process: trio.Process
    port: int
    api_key: str
    started_line: str

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` (add ``/v1`` for OpenAI clients)."""
        return f"http://127.0.0.1:{self.port}"


#: The type of :func:`open_sim` (for a fixture that hands it out).
SimStarter = Callable[..., AbstractAsyncContextManager[RunningSim]]


def engine_process_env(api_key: str) -> dict[str, str]:
    """This process's environment with ``LLAMA_API_KEY`` set to ``api_key``,
    or removed when ``api_key`` is empty."""
    env = dict(os.environ)
    env.pop("LLAMA_API_KEY", None)
    if api_key:
        env["LLAMA_API_KEY"] = api_key
    return env


async def read_line(stream: trio.abc.ReceiveStream, buffer: bytearray) -> str:
    """The next line (without its newline) from ``stream``; ``buffer`` holds
    what was read past it, for the next call.

    Raises:
        EOFError: the stream ended before a whole line.
    """
    while b"\n" not in buffer:
        data = await stream.receive_some(4096)
        if not data:
            raise EOFError(f"stream ended after {bytes(buffer)!r}")
        buffer += data
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line.decode()


async def stop_process(process: trio.Process, *, grace: float = STOP_TIMEOUT) -> None:
    """SIGTERM ``process`` and wait for it, SIGKILL after ``grace`` seconds;
    then close its pipes. Shielded from cancellation; fine on a process that
    already exited."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.terminate()
            with trio.move_on_after(grace):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                await pipe.aclose()


def sim_argv(model: str, *args: str) -> list[str]:
    """The command line of a sim engine on 127.0.0.1, any free port (it
    prints where it listens), serving ``model``, with extra ``args``."""
    return [
        sys.executable,
        "-m",
        "llmgw.engines.sim",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--model",
        model,
        *args,
    ]


@asynccontextmanager
async def open_sim(
    *args: str, api_key: str = "", model: str = "sim-model"
) -> AsyncIterator[RunningSim]:
    """Run ``python -m llmgw.engines.sim --host 127.0.0.1 --port 0 --model
    MODEL *args`` with ``api_key`` in ``LLAMA_API_KEY``; yield it once it
    listens, and stop it (:func:`stop_process`) on exit.

    Raises:
        trio.TooSlowError: it did not start within :data:`SIM_START_TIMEOUT`.
        EOFError: it exited before saying where it listens.
    """
    argv = sim_argv(model, *args)
    process = await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE, env=engine_process_env(api_key)
    )
    try:
        assert process.stdout is not None
        with trio.fail_after(SIM_START_TIMEOUT):
            line = await read_line(process.stdout, bytearray())
        port = int(line.rsplit(" model ", 1)[0].rsplit(":", 1)[1])
        yield RunningSim(process=process, port=port, api_key=api_key, started_line=line)
    finally:
        await stop_process(process)

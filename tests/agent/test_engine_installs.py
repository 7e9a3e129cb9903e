"""Engine installs, end to end with uv and a small real PyPI package as a
stand-in engine: ``cowsay==6.1`` (pure Python, a console script whose
``--version`` prints ``6.1``), into its own virtual environment, pinned with
``--exclude-newer``. The agent advertises an engine only once it installed
and its probe passed, and reports why when it did not."""

from __future__ import annotations

import gc
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio_websocket

from llmgw.agent import protocol
from llmgw.agent.installs import (
    MARKER,
    RECIPES,
    EngineRecipe,
    InstallFailed,
    install,
    installed_engines,
)
from llmgw.agent.main import AgentConfig, advertised_engines, serve_agent

DEADLINE_S = 240

#: A stand-in engine: cowsay 6.1 was on PyPI by 2023-09-30.
STANDIN = EngineRecipe(
    engine="standin",
    version="6.1",
    packages=("cowsay==6.1",),
    exclude_newer="2023-09-30T00:00:00Z",
    python="3.11",
    executable="cowsay",
    probe_args=("--version",),
)
#: The same package claiming another version: its probe cannot show it.
BAD_PROBE = attrs.evolve(STANDIN, engine="badprobe", version="9.9")
#: One for nodes with a card (the test machines have none).
CARDS_ONLY = attrs.evolve(STANDIN, engine="cardsonly", needs_gpu=True)


def _uv() -> str:
    found = shutil.which("uv") or str(Path.home() / ".local" / "bin" / "uv")
    if not os.access(found, os.X_OK):
        pytest.skip("uv is not installed")
    return found


async def test_install_makes_its_own_environment_probes_it_and_marks_it(tmp_path: Path) -> None:
    uv = _uv()
    with trio.fail_after(DEADLINE_S):
        done = await install(STANDIN, tmp_path, uv=uv)
    home = tmp_path / "standin-6.1"
    assert done.key == "standin-6.1"
    assert done.executable == str(home / "venv" / "bin" / "cowsay")
    assert done.probe_output == "6.1"
    assert (home / MARKER).is_file()
    # its own environment: cowsay is not in the agent's
    site = list((home / "venv" / "lib").glob("python3*/site-packages/cowsay"))
    assert site
    assert installed_engines(tmp_path) == [done]
    assert advertised_engines([done]) == ("llamacpp", "sim", "standin")
    # installed once: a second install does not run uv
    again = await install(STANDIN, tmp_path, uv="/nonexistent/uv")
    assert again == done


async def test_a_failed_probe_leaves_nothing_installed(tmp_path: Path) -> None:
    uv = _uv()
    with trio.fail_after(DEADLINE_S), pytest.raises(InstallFailed) as caught:
        await install(BAD_PROBE, tmp_path, uv=uv)
    assert caught.value.step == "probe"
    assert "did not show version 9.9" in str(caught.value)
    assert "6.1" in caught.value.reason
    assert not (tmp_path / "badprobe-9.9").exists()
    assert installed_engines(tmp_path) == []


async def test_a_failed_install_names_uvs_reason(tmp_path: Path) -> None:
    """Resolved as PyPI was before cowsay 6.1 existed: uv finds no solution."""
    uv = _uv()
    early = attrs.evolve(STANDIN, exclude_newer="2020-01-01T00:00:00Z")
    with trio.fail_after(DEADLINE_S), pytest.raises(InstallFailed) as caught:
        await install(early, tmp_path, uv=uv)
    assert caught.value.step == "install"
    assert "cowsay" in caught.value.reason
    assert not (tmp_path / "standin-6.1").exists()
    with pytest.raises(InstallFailed, match="venv failed: cannot run /nonexistent/uv"):
        await install(STANDIN, tmp_path, uv="/nonexistent/uv")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"packages": ("cowsay",)}, "not pinned"),
        ({"packages": ("-e", ".")}, "not pinned"),
        ({"packages": ("cowsay==6.1 --index-url=http://x",)}, "not pinned"),
        ({"packages": ("git+https://x/y==1",)}, "not pinned"),
        ({"exclude_newer": "yesterday"}, "exclude_newer"),
        ({"executable": "../../bin/sh"}, "executable"),
        ({"index_url": "http://plain"}, "https"),
    ],
)
async def test_recipes_are_pinned_and_take_no_options(
    tmp_path: Path, change: dict[str, Any], problem: str
) -> None:
    with pytest.raises(InstallFailed, match=f"recipe failed: .*{problem}"):
        await install(attrs.evolve(STANDIN, **change), tmp_path, uv="/nonexistent/uv")
    assert await trio.to_thread.run_sync(os.listdir, tmp_path) == []


def test_the_shipped_recipes_are_pinned() -> None:
    vllm = RECIPES["vllm"]
    assert vllm.packages == ("vllm==0.33.0",)
    assert vllm.exclude_newer == "2026-11-03T10:14:00Z"  # a day after its upload
    assert (vllm.executable, vllm.probe_args, vllm.needs_gpu) == ("vllm", ("--version",), True)
    gpu_llama = RECIPES["llamacpp-cu128"]
    assert gpu_llama.engine == "llamacpp"
    assert gpu_llama.index_url == "https://xorbitsai.github.io/xllamacpp/whl/cu128"
    assert gpu_llama.no_deps
    for recipe in RECIPES.values():
        assert recipe.problems() == []


# --- the agent ----------------------------------------------------------------------


@attrs.define
class Hub:
    """A control plane's agent hub that answers Register and keeps them."""

    registers: trio.MemorySendChannel[protocol.Register]
    statuses: list[protocol.ShardStatus] = attrs.field(factory=list)
    ws: trio_websocket.WebSocketConnection | None = None

    async def handle(self, request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        self.ws = ws
        try:
            while True:
                message = protocol.decode(await ws.get_message())
                if isinstance(message, protocol.Register):
                    await ws.send_message(
                        protocol.encode(protocol.Registered(node_id=message.node_id))
                    )
                    await self.registers.send(message)
                elif isinstance(message, protocol.ShardStatus):
                    self.statuses.append(message)
        except trio_websocket.ConnectionClosed:
            pass


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_the_agent_advertises_an_engine_only_once_installed_and_probed(
    tmp_path: Path,
) -> None:
    uv = _uv()
    send, receive = trio.open_memory_channel[protocol.Register](10)
    hub = Hub(send)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as outer:
            server = await outer.start(
                trio_websocket.serve_websocket, hub.handle, "127.0.0.1", 0, None
            )
            config = AgentConfig(
                server_url=f"ws://127.0.0.1:{server.port}/agent",
                token="agent-token-for-tests",
                node_id="node-i",
                state_dir=tmp_path / "state",
                measure_bandwidth=False,
                engine_installs=("standin", "badprobe", "nope", "cardsonly"),
                recipes={"standin": STANDIN, "badprobe": BAD_PROBE, "cardsonly": CARDS_ONLY},
                uv=uv,
            )
            async with trio.open_nursery() as agent:
                await agent.start(serve_agent, config)
                register = await receive.receive()
                agent.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    gc.collect()  # trio-websocket leaves the link's socket to the GC: collect it here
    assert register.engines == ("llamacpp", "sim", "standin")
    failures = register.engine_failures
    assert set(failures) == {"badprobe", "nope", "cardsonly"}
    assert "probe failed: did not show version 9.9" in failures["badprobe"]
    assert "no install recipe 'nope' (known: badprobe, cardsonly, standin)" in failures["nope"]
    assert "cardsonly-6.1 needs an NVIDIA card; this node has none" in failures["cardsonly"]
    engines_dir = tmp_path / "state" / "engines"
    assert [e.key for e in installed_engines(engines_dir)] == ["standin-6.1"]
    assert not (engines_dir / "badprobe-9.9").exists()


@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_vllm_replica_runs_the_installed_executable(tmp_path: Path) -> None:
    """An install that provides ``vllm`` (here the stand-in's console script)
    is what the agent runs for a vLLM replica: cowsay refuses ``serve …``
    (it wants ``-t TEXT``),
    and the replica's failure shows that executable's own words."""
    uv = _uv()
    as_vllm = attrs.evolve(STANDIN, engine="vllm")
    send, receive = trio.open_memory_channel[protocol.Register](10)
    hub = Hub(send)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as outer:
            server = await outer.start(
                trio_websocket.serve_websocket, hub.handle, "127.0.0.1", 0, None
            )
            config = AgentConfig(
                server_url=f"ws://127.0.0.1:{server.port}/agent",
                token="agent-token-for-tests",
                node_id="node-v",
                state_dir=tmp_path / "state",
                measure_bandwidth=False,
                engine_installs=("vllm",),
                recipes={"vllm": as_vllm},
                uv=uv,
            )
            async with trio.open_nursery() as agent:
                await agent.start(serve_agent, config)
                register = await receive.receive()
                assert "vllm" in register.engines
                assert hub.ws is not None
                profile = protocol.EngineProfile(
                    name="qwen", engine="vllm", served_model_name="qwen", model_path="/models/qwen"
                )
                start = protocol.StartShard(
                    correlation_id="c1", shard_id="s1", replica_id="r1", profile=profile, port=0
                )
                await hub.ws.send_message(protocol.encode(start))
                # polled: the hub records statuses without waking anyone
                while not any(st.state is protocol.ShardState.FAILED for st in hub.statuses):  # noqa: ASYNC110
                    await trio.sleep(0.1)
                agent.cancel_scope.cancel()
            outer.cancel_scope.cancel()
    gc.collect()  # trio-websocket leaves the link's socket to the GC: collect it here
    (failed,) = [st for st in hub.statuses if st.state is protocol.ShardState.FAILED]
    text = failed.reason + " " + " ".join(failed.last_lines)
    # cowsay's own argparse refusing vLLM's command line, named by the vLLM adapter
    assert failed.reason.startswith("vllm: Cowsay: error:"), failed
    assert "usage: Cowsay" in text, failed


async def test_a_launcher_environment_runs_the_bundled_launcher_with_its_own_packages(
    tmp_path: Path,
) -> None:
    """``launcher_paths`` (the GPU llama.cpp recipe's way): the environment's
    python imports llmgw's llama.cpp launcher from the agent, while a
    package the environment has itself (here an older attrs, standing in
    for xllamacpp's CUDA build) wins over the agent's copy."""
    uv = _uv()
    recipe = EngineRecipe(
        engine="launcher",
        version="23.1.0",
        packages=("attrs==23.1.0",),
        exclude_newer="2023-06-01T00:00:00Z",
        python=sys.executable,
        executable="python",
        probe_args=(
            "-c",
            "import importlib.metadata as m, llmgw.engines.llamacpp as l; "
            "print(l.__file__); print('attrs', m.version('attrs'))",
        ),
        launcher_paths=True,
    )
    with trio.fail_after(DEADLINE_S):
        done = await install(recipe, tmp_path, uv=uv)
    assert done.probe_output == "attrs 23.1.0"
    assert importlib.metadata.version("attrs") != "23.1.0"  # the agent's own is another
    assert RECIPES["llamacpp-cu128"].launcher_paths


def test_replicas_run_the_install_of_the_recipe_asked_for() -> None:
    from llmgw.agent.installs import InstalledEngine
    from llmgw.agent.main import _chosen_installs

    def found(version: str) -> InstalledEngine:
        key = f"vllm-{version}"
        return InstalledEngine(engine="vllm", version=version, key=key, executable=f"/e/{key}")

    config = AgentConfig(server_url="ws://x/agent", token="t", engine_installs=("vllm",))
    for order in ([found("0.33.0"), found("0.4.0")], [found("0.4.0"), found("0.33.0")]):
        assert _chosen_installs(config, order)["vllm"].version == "0.33.0"
    unasked = attrs.evolve(config, engine_installs=())
    assert _chosen_installs(unasked, [found("0.4.0")])["vllm"].version == "0.4.0"

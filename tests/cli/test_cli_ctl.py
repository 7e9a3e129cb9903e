"""``llmgw ctl`` cluster commands and ``llmgw stop|start|status`` against a
real admin API on a loopback port (hypercorn), driven with click's runner
from a worker thread while trio serves the API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import click
import gguf
import httpx
import numpy as np
import pytest
import trio
from click.testing import CliRunner, Result

from llmgw.admin.app import make_admin_app
from llmgw.admin.keys import KeysService
from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState
from llmgw.app.listen import serve_asgi
from llmgw.auth.admin_token import (
    ADMIN_TOKEN_FILE,
    AdminTokenFile,
    new_admin_token,
    write_admin_token,
)
from llmgw.auth.keys import KeyAuthenticator
from llmgw.auth.tree import ScopeResolver
from llmgw.cli.config import lookup_key
from llmgw.cli.main import cli
from llmgw.cli.models import entry_from_flags
from llmgw.cli.options import format_table
from llmgw.control.cluster import Cluster, ShardInfo
from llmgw.control.live import LiveSettings
from llmgw.settings import AuthSettings, ServerSettings
from llmgw.store import NodeCertificate, Store, open_sqlite_store


@attrs.define
class Running:
    data_dir: Path
    store: Store
    cluster: Cluster

    async def run(self, *args: str, input: str | None = None) -> Result:
        """``llmgw ARGS --data-dir DATA_DIR`` in a worker thread."""
        runner = CliRunner()
        argv = [*args, "--data-dir", str(self.data_dir)]
        return await trio.to_thread.run_sync(
            partial(runner.invoke, cli, argv, input=input, catch_exceptions=False)
        )

    async def ok(self, *args: str, input: str | None = None) -> str:
        result = await self.run(*args, input=input)
        assert result.exit_code == 0, result.output
        return result.output

    async def json(self, *args: str) -> Any:
        return json.loads(await self.ok(*args, "--json"))


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    async with open_sqlite_store(data_dir / "llmgw.db") as store:
        cluster = Cluster()
        authenticator = KeyAuthenticator(store)
        keys = KeysService(
            store,
            authenticator,
            ScopeResolver(store),
            AuthSettings(),
            bands=lambda: [band.name for band in cluster.settings.router.admission.bands],
        )
        write_admin_token(data_dir / ADMIN_TOKEN_FILE, new_admin_token())
        token = AdminTokenFile(data_dir / ADMIN_TOKEN_FILE)
        live = LiveSettings(store, cluster)
        await live.seed(ServerSettings())
        await live.refresh()
        app = make_admin_app(store, cluster, token, keys, live=live, data_dir=data_dir)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            address = await nursery.start(serve_asgi, app, "127.0.0.1:0", stop, 1.0)
            (data_dir / "run.json").write_text(json.dumps({"admin": address}))
            yield Running(data_dir, store, cluster)
            stop.set()


def add_node(cluster: Cluster) -> None:
    cluster.node_registered(
        protocol.Register(
            node_id="n1",
            address="10.0.0.1",
            hardware=protocol.Hardware(
                cpu_count=8,
                memory_total_mb=16384,
                memory_available_mb=8192,
                memory_bandwidth_gbps=40.0,
                core_bandwidth_gbps=12.0,
                gpus=(protocol.Gpu(index=0, name="NVIDIA H100 80GB HBM3", memory_total_mb=81559),),
            ),
            agent_version="0.1.0",
            engines=("llamacpp", "sim"),
        ),
        _send,
    )


async def _send(message: protocol.Message) -> None:
    """A node's link that takes every message and sends it nowhere."""


# --- pure helpers ----------------------------------------------------------------------


def test_format_table_pads_every_column_but_the_last() -> None:
    assert format_table(["A", "BB", "C"], [["xxx", None, "tail"], ["y", 22, ""]]).splitlines() == [
        "A    BB  C",
        "xxx  -   tail",
        "y    22",
    ]


def test_entry_from_flags_is_one_default_profile_with_only_what_was_given(
    tmp_path: Path,
) -> None:
    entry = entry_from_flags(
        "m", engine="llamacpp", source="w.gguf", context=8192, aliases=["a"], args=["--x"]
    )
    assert entry == {
        "name": "m",
        "source": str(Path("w.gguf").resolve()),
        "aliases": ["a"],
        "profiles": [
            {"name": "default", "engine": "llamacpp", "context_tokens": 8192, "args": ["--x"]}
        ],
    }
    assert entry_from_flags("m", engine="vllm", source="hf:org/repo")["source"] == "hf:org/repo"


def test_lookup_key_walks_dotted_keys() -> None:
    assert lookup_key({"a": {"b": [1]}}, "a.b") == [1]
    with pytest.raises(click.ClickException, match=r"no setting 'a\.c'"):
        lookup_key({"a": {"b": 1}}, "a.c")


# --- settings ------------------------------------------------------------------------


async def test_config_set_then_get(running: Running) -> None:
    out = await running.ok("ctl", "config", "set", "on_demand.evict_after_idle", "30s")
    assert out.strip() == "on_demand.evict_after_idle = 30.0 (settings version 2)"
    assert (await running.ok("ctl", "config", "get", "on_demand.evict_after_idle")).strip() == (
        "30.0"
    )
    out = await running.ok(
        "ctl", "config", "set", "router.admission.bands", "[{name: gold, priority: 300}]"
    )
    assert "version 3" in out
    bands = await running.json("ctl", "config", "get", "router.admission.bands")
    assert bands == [{"name": "gold", "priority": 300, "saturation": 1.0, "queue_ttl": 30.0}]
    whole = await running.ok("ctl", "config", "get")
    assert whole.startswith("# settings version 3\nauth:")
    assert (await running.ok("ctl", "config", "get", "serving.stopped")).strip() == "false"

    history = await running.ok("ctl", "config", "history")
    lines = history.splitlines()
    assert lines[0].split() == ["VERSION", "WHEN", "(UTC)", "WHO", "CHANGED", "NOTE"]
    assert "router.admission.bands" in lines[1]
    assert "admin token (" in lines[1]
    assert "defaults" in lines[3]  # seeded with no settings file


async def test_config_set_refuses_an_unknown_key(running: Running) -> None:
    result = await running.run("ctl", "config", "set", "router.nope", "1")
    assert result.exit_code == 1
    assert "400: Settings not valid: router.nope: no such setting" in result.output


async def test_config_edit_reopens_with_the_error_then_saves(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []

    def edit(text: str, **_: Any) -> str:
        seen.append(text)
        if len(seen) == 1:
            return text.replace("  stopped: false", "  stopped: false\n  paused: true")
        return text.replace("  stopped: false\n  paused: true", "  stopped: true")

    monkeypatch.setattr("click.edit", edit)
    out = await running.ok("ctl", "config", "edit", input="y\n")
    assert "serving.paused" in out  # the error, before asking to edit again
    assert "saved: settings version 2" in out
    assert seen[0].startswith("# llmgw cluster settings, version 1.")
    assert seen[1].startswith("# ERROR: Settings not valid:")
    assert running.cluster.settings.serving.stopped


async def test_config_edit_without_saving_changes_nothing(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("click.edit", lambda text, **_: None)
    assert (await running.ok("ctl", "config", "edit")).strip() == "no change"
    assert await running.store.settings_version() == 1


# --- whole system -----------------------------------------------------------------------


async def test_stop_start_and_status(running: Running) -> None:
    out = await running.ok("stop")
    assert out.startswith("stopped:")
    assert "503 system_stopped" in out
    assert running.cluster.settings.serving.stopped
    assert (await running.ok("stop")).startswith("already stopped")
    assert "serving: STOPPED" in await running.ok("status")
    assert (await running.json("ctl", "status"))["serving"] == {"stopped": True}
    assert (await running.ok("start")).startswith("started:")
    assert "serving: yes" in await running.ok("ctl", "status")


# --- models --------------------------------------------------------------------------


async def test_model_add_scale_stop_start_remove(running: Running, tmp_path: Path) -> None:
    out = await running.ok(
        "ctl", "model", "add", "second", "--engine", "sim", "--min-memory-gb", "0.5",
        "--alias", "two", "--replicas", "1",
    )  # fmt: skip
    assert out.strip() == "added second (sim): running, 0/1 replicas ready"
    running.cluster.add_shard(
        ShardInfo(
            shard_id="second-0",
            replica_id="second-0",
            model="second",
            node_id="n1",
            port=20000,
            state=ShardState.READY,
        )
    )
    table = (await running.ok("ctl", "models")).splitlines()
    assert table[0].split() == [
        "MODEL",
        "ENGINE",
        "STATE",
        "READY",
        "STARTING",
        "FAILED",
        "ALIASES",
    ]
    assert table[1].split() == ["second", "sim", "running", "1/1", "two"]
    [view] = (await running.json("ctl", "models"))["data"]
    assert view["replicas"]["ready"] == 1

    assert "2 replicas wanted" in await running.ok("ctl", "model", "scale", "second", "2")
    assert "1 replicas wanted" in await running.ok("ctl", "scale", "second", "1")
    assert "stopped second" in await running.ok("ctl", "model", "stop", "second")
    assert "stopped" in (await running.ok("ctl", "models")).splitlines()[1]
    assert "started second: 1 replicas wanted" in await running.ok(
        "ctl", "model", "start", "second"
    )
    out = await running.ok("ctl", "model", "context", "second", "8192", "--slots", "2")
    assert "replicas are replaced one at a time" in out
    out = await running.ok("ctl", "model", "context", "second", "--max-output", "100")
    assert "no restart needed" in out
    shown = await running.ok("ctl", "model", "show", "second")
    assert "context_tokens: 8192" in shown
    assert "second-0" in shown

    result = await running.run("ctl", "model", "add", "second", "--engine", "sim")
    assert result.exit_code == 1
    assert "409" in result.output

    assert "removed second" in await running.ok("ctl", "model", "remove", "second")
    result = await running.run("ctl", "model", "show", "second")
    assert result.exit_code == 1
    assert "404: No model 'second'" in result.output


async def test_model_add_from_a_yaml_file_and_update(running: Running, tmp_path: Path) -> None:
    entry = tmp_path / "m.yaml"
    entry.write_text("name: filed\nengine: sim\nmin_memory_gb: 1\nreplicas: 2\n")
    out = await running.ok("ctl", "model", "add", "-f", str(entry))
    assert out.strip() == "added filed (sim): running, 0/2 replicas ready"
    entry.write_text("name: filed\nengine: sim\nmin_memory_gb: 1\nreplicas: 2\ncontext: 2048\n")
    out = await running.ok("ctl", "model", "update", "filed", "-f", str(entry))
    assert "replaced one at a time" in out
    result = await running.run("ctl", "model", "add", "-f", str(entry), "x")
    assert result.exit_code == 2


async def test_model_remove_purge_deletes_weights_in_the_data_dir(running: Running) -> None:
    weights = running.data_dir / "weights" / "w.gguf"
    weights.parent.mkdir()
    weights.write_bytes(b"GGUF")
    await running.ok(
        "ctl", "model", "add", "w", "--engine", "sim", "--min-memory-gb", "1",
        "--source", str(weights),
    )  # fmt: skip
    out = await running.ok("ctl", "model", "remove", "w", "--purge")
    assert f"deleted {weights.resolve()}" in out
    assert not weights.exists()


# --- nodes, replicas, placement, plan ----------------------------------------------------


async def test_nodes_replicas_and_cordons(running: Running) -> None:
    add_node(running.cluster)
    running.cluster.add_shard(
        ShardInfo(
            shard_id="m-0",
            replica_id="m-0",
            model="m",
            node_id="n1",
            port=20001,
            state=ShardState.FAILED,
            reason="exit 1; last output: out of memory",
            restarts=3,
            compute="CPU",
            memory_gb=1.5,
            cpu_cores=2,
        )
    )
    nodes = (await running.ok("ctl", "nodes")).splitlines()
    # Cores reserved of all, memory reserved (GB), then what the node reports.
    assert nodes[1].split() == [
        "n1", "10.0.0.1", "-", "up", "2/8", "1.5", "8.0/16.0", "40", "h100-80g", "llamacpp,sim",
        "-", "1",
    ]  # fmt: skip
    replicas = (await running.ok("ctl", "replicas")).splitlines()
    # No engine runs for a failed replica: no pid, no uptime.
    assert replicas[0].split()[:7] == ["REPLICA", "MODEL", "NODE", "PORT", "PID", "STATE", "UP"]
    assert replicas[1].split()[:9] == ["m-0", "m", "n1", "20001", "-", "FAILED", "-", "3", "CPU"]
    assert replicas[-1] == "m-0: exit 1; last output: out of memory"

    assert "draining" in await running.ok("ctl", "drain", "n1")
    assert "draining" in (await running.ok("ctl", "nodes")).splitlines()[1]
    assert "open to new replicas" in await running.ok("ctl", "uncordon", "n1")
    assert "cordoned" in await running.ok("ctl", "cordon", "n1")
    result = await running.run("ctl", "cordon", "nowhere")
    assert result.exit_code == 0
    assert "no node 'nowhere' has registered" in result.output


async def test_nodes_remove_revokes_stops_closes_and_forgets_the_node(running: Running) -> None:
    sent: list[protocol.Message] = []
    closed: list[str] = []

    async def send(message: protocol.Message) -> None:
        sent.append(message)

    async def close(reason: str) -> None:
        closed.append(reason)

    register = protocol.Register(
        node_id="n1",
        address="10.0.0.7",
        interface="eth1",
        hardware=protocol.Hardware(cpu_count=8, memory_total_mb=16384),
        agent_version="0.1.0",
    )
    running.cluster.node_registered(register, send, close)
    running.cluster.add_shard(
        ShardInfo(shard_id="m-0", replica_id="m-0", model="m", node_id="n1", port=20001)
    )
    now = 1_700_000_000.0
    await running.store.insert_node_certificate(
        NodeCertificate(serial="ab12", node_id="n1", issued_at=now, not_after=now + 3600)
    )
    listed = (await running.ok("ctl", "nodes")).splitlines()
    assert listed[1].split()[:4] == ["n1", "10.0.0.7", "eth1", "up"]

    out = await running.ok("ctl", "nodes", "remove", "n1")
    assert out.strip() == "node n1 removed: 1 certificate(s) revoked; replicas stopped there: m-0"
    assert [m.shard_id for m in sent if isinstance(m, protocol.StopShard)] == ["m-0"]
    assert closed == ["node n1 was removed from the cluster"]
    assert "n1" not in running.cluster.nodes
    assert "m-0" not in running.cluster.shards
    certificate = await running.store.get_node_certificate("ab12")
    assert certificate is not None
    assert certificate.revoked_at is not None

    result = await running.run("ctl", "nodes", "remove", "nowhere")
    assert result.exit_code == 1
    assert "No node 'nowhere'" in result.output


async def test_explain_placement(running: Running) -> None:
    add_node(running.cluster)
    await running.ok(
        "ctl", "model", "add", "big", "--engine", "sim", "--min-memory-gb", "64"
    )  # fmt: skip
    out = (await running.ok("ctl", "explain-placement", "big")).splitlines()
    assert out[0].split() == ["NODE", "PROFILE", "FITS", "WHY"]
    assert out[1].split()[:3] == ["n1", "default", "no"]


def _write_gguf(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


async def test_model_plan_uses_the_clusters_nodes(running: Running, tmp_path: Path) -> None:
    add_node(running.cluster)
    model = tmp_path / "tiny.gguf"
    _write_gguf(model)
    doc = await running.json("ctl", "model", "plan", str(model), "--context", "2048")
    assert doc["context_tokens"] == 2048
    assert doc["best"] is not None
    text = await running.ok("ctl", "model", "plan", str(model))
    assert "h100-80g" in text or "n1" in text


async def test_keys_rotate_admin_refuses_the_old_token_at_once(running: Running) -> None:
    path = running.data_dir / ADMIN_TOKEN_FILE
    old = path.read_text().strip()
    done = await running.ok("keys", "rotate-admin")
    new = path.read_text().strip()
    assert new != old
    assert new.startswith("llmgw-admin-")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert new not in done
    assert str(path) in done
    address = json.loads((running.data_dir / "run.json").read_text())["admin"]

    def status_with(token: str) -> int:
        answer = httpx.get(
            f"http://{address}/api/v1/keys", headers={"authorization": f"Bearer {token}"}
        )
        return answer.status_code

    assert await trio.to_thread.run_sync(status_with, old) == 401
    assert await trio.to_thread.run_sync(status_with, new) == 200
    assert await running.json("keys", "list") == {"data": []}  # the CLI reads the new file


async def test_keys_rotate_admin_in_a_folder_without_a_token_makes_nothing(tmp_path: Path) -> None:
    result = await trio.to_thread.run_sync(
        partial(CliRunner().invoke, cli, ["keys", "rotate-admin", "--data-dir", str(tmp_path)])
    )
    assert result.exit_code == 1
    assert "no admin token at" in result.stderr
    assert "'llmgw up' makes one" in result.stderr
    assert await trio.to_thread.run_sync(lambda: list(tmp_path.iterdir())) == []


# --- names that do not exist ---------------------------------------------------------


async def test_a_band_model_or_level_that_does_not_exist_is_refused_naming_those_there_are(
    running: Running,
) -> None:
    """The admin API refuses it; the CLI prints its message and exits 1."""
    await running.ok("ctl", "model", "add", "alpha", "--engine", "sim", "--min-memory-gb", "0.5")
    refused = await running.run("keys", "create", "k", "--band", "nosuchband")
    assert refused.exit_code == 1
    assert refused.stderr == (
        "Error: 400: No band 'nosuchband'; the bands are: bulk, interactive "
        "(router.admission.bands).\n"
    )
    assert [k["name"] for k in (await running.json("keys", "list"))["data"]] == []

    made = await running.json("keys", "create", "k", "--band", "bulk")
    refused = await running.run(
        "keys", "limits", "--scope", "key", "--id", made["id"], "--models", "alpha,beta"
    )
    assert refused.exit_code == 1
    assert "No model 'beta' in the catalog; the models are: alpha." in refused.stderr
    refused = await running.run("keys", "limits", "--scope", "org", "--id", "Nope", "--rpm", "1")
    assert refused.exit_code == 1
    assert "No org 'Nope'; the orgs are: default." in refused.stderr
    refused = await running.run("keys", "revoke", "nokey")
    assert "No key 'nokey'; the live keys are: " in refused.stderr

    for command in (("ctl", "model", "scale", "beta", "1"), ("ctl", "model", "show", "beta")):
        refused = await running.run(*command)
        assert refused.exit_code == 1, command
        assert "No model 'beta' in the catalog; the models are: alpha." in refused.stderr
    refused = await running.run("ctl", "explain-placement", "beta")
    assert "the models are: alpha" in refused.stderr

    refused = await running.run("ctl", "config", "set", "router.admission.default_band", "gold")
    assert refused.exit_code == 1
    assert "no band 'gold'; the bands are: bulk, interactive" in refused.stderr

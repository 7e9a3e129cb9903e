"""The admin API's cluster routes (settings, system, models, nodes, the answer cache) through
quart's test client, over a real SQLite store and an in-memory cluster."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from llmgw.admin.views import leadership_view
from llmgw.agent import protocol
from llmgw.agent.protocol import ShardState
from llmgw.auth.admin_token import fingerprint
from llmgw.auth.keys import new_key
from llmgw.control.cluster import Cluster, NodeInfo, ShardInfo, engine_key
from llmgw.control.leader_record import LeaderRecord, LeaderView
from llmgw.control.model_ops import change_context, purge_weights
from llmgw.store import Lease, ModelRecord, NodeCertificate, Profile

if TYPE_CHECKING:
    from tests.admin.conftest import Admin


def sim_entry(name: str = "second", **fields: Any) -> dict[str, Any]:
    return {"name": name, "engine": "sim", "min_memory_gb": 0.5, **fields}


def hardware(**fields: Any) -> protocol.Hardware:
    return protocol.Hardware(cpu_count=8, memory_total_mb=16384, **fields)


def add_node(cluster: Cluster, node_id: str = "n1") -> NodeInfo:
    cluster.node_registered(
        protocol.Register(
            node_id=node_id,
            address="10.0.0.1",
            hardware=hardware(memory_bandwidth_gbps=40.0, memory_available_mb=8192),
            agent_version="0.1.0",
        ),
        _send,
    )
    return cluster.nodes[node_id]


async def _send(message: protocol.Message) -> None:
    """A node's link that takes every message and sends it nowhere."""


def add_shard(
    cluster: Cluster, replica_id: str, model: str, state: ShardState, **fields: Any
) -> ShardInfo:
    shard = ShardInfo(
        shard_id=replica_id,
        replica_id=replica_id,
        model=model,
        node_id="n1",
        port=20000 + len(cluster.shards),
        state=state,
        **fields,
    )
    cluster.add_shard(shard)
    return shard


# --- the key check ---------------------------------------------------------------------


async def test_the_cluster_routes_need_the_admin_token(admin: Admin) -> None:
    status, body = await admin.call("GET", "/api/v1/config", key="")
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    secret, record = new_key("a client")
    await admin.store.insert_key(record)
    status, body = await admin.call("POST", "/api/v1/system/stop", key=secret)
    assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    assert not admin.cluster.settings.serving.stopped


# --- settings ------------------------------------------------------------------------


async def test_get_config_is_the_whole_document_with_its_version(admin: Admin) -> None:
    status, body = await admin.call("GET", "/api/v1/config")
    assert status == 200
    assert body["version"] == 1
    assert body["document"]["serving"] == {"stopped": False}
    assert body["document"]["on_demand"]["evict_after_idle"] == 120.0


async def test_patch_sets_one_key_live_at_once_and_the_history_says_who(admin: Admin) -> None:
    waiter = admin.cluster.changed
    status, body = await admin.call(
        "PATCH",
        "/api/v1/config",
        {"key": "router.admission.bands", "value": [{"name": "gold", "priority": 300}]},
    )
    assert status == 200, body
    assert (body["version"], body["changed"]) == (2, True)
    assert body["document"]["router"]["admission"]["bands"][0]["name"] == "gold"
    assert [b.name for b in admin.cluster.settings.router.admission.bands] == ["gold"]
    assert waiter.is_set()

    status, body = await admin.call("GET", "/api/v1/config/history?last=5")
    assert status == 200
    newest, seed = body["data"]
    assert newest["version"] == 2
    assert newest["actor"] == f"admin token ({fingerprint(admin.secret)})"
    assert newest["changed"] == ["router.admission.bands"]
    assert newest["note"] == "set router.admission.bands"
    assert seed["actor"] == "defaults"  # no settings file in these tests
    assert seed["changed"] == []


async def test_patch_reads_durations_and_says_when_nothing_changed(admin: Admin) -> None:
    body = {"key": "on_demand.evict_after_idle", "value": "30s"}
    status, doc = await admin.call("PATCH", "/api/v1/config", body)
    assert status == 200
    assert doc["document"]["on_demand"]["evict_after_idle"] == 30.0
    status, doc = await admin.call("PATCH", "/api/v1/config", body)
    assert (doc["version"], doc["changed"]) == (2, False)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"key": "router.nope", "value": 1}, "router.nope: no such setting"),
        ({"key": "on_demand.evict_after_idle", "value": "soon"}, "on_demand.evict_after_idle"),
        ({"key": "serving.stopped", "value": "yes"}, "serving.stopped"),
        ({"key": "serving.stopped"}, "Send {'key'"),
        ({"key": "serving.stopped", "value": True, "extra": 1}, "Unknown field"),
    ],
)
async def test_a_bad_patch_is_400_naming_the_key_and_changes_nothing(
    admin: Admin, body: dict[str, Any], says: str
) -> None:
    status, doc = await admin.call("PATCH", "/api/v1/config", body)
    assert status == 400
    assert says in doc["error"]["message"]
    assert await admin.store.settings_version() == 1


async def test_put_replaces_the_document_whole_with_optimistic_concurrency(admin: Admin) -> None:
    _, current = await admin.call("GET", "/api/v1/config")
    document = current["document"]
    document["nodes"]["cordoned"] = ["n9"]
    status, body = await admin.call(
        "PUT", "/api/v1/config", {"document": document, "expected_version": 1, "note": "edit"}
    )
    assert status == 200, body
    assert body["version"] == 2
    assert admin.cluster.settings.nodes.cordoned == ("n9",)

    status, body = await admin.call(
        "PUT", "/api/v1/config", {"document": document, "expected_version": 1}
    )
    assert status == 409
    assert body["error"]["code"] == "conflict"

    document["router"]["timeouts"]["connect"] = "never"
    status, body = await admin.call("PUT", "/api/v1/config", {"document": document})
    assert status == 400
    assert "router.timeouts.connect" in body["error"]["message"]
    assert await admin.store.settings_version() == 2


async def test_a_partial_document_takes_the_defaults_for_the_rest(admin: Admin) -> None:
    status, body = await admin.call(
        "PUT", "/api/v1/config", {"document": {"serving": {"stopped": True}}}
    )
    assert status == 200
    assert body["document"]["on_demand"]["min_lifetime"] == 300.0
    assert admin.cluster.settings.serving.stopped


# --- whole system ----------------------------------------------------------------------


async def test_system_stop_and_start_set_serving_stopped(admin: Admin) -> None:
    await admin.store.put_model(ModelRecord.simple("m", "sim", replicas=2))
    status, body = await admin.call("POST", "/api/v1/system/stop")
    assert status == 200
    assert body == {"stopped": True, "changed": True, "version": 2}
    assert admin.cluster.settings.serving.stopped
    _, models = await admin.call("GET", "/api/v1/models")
    assert models["data"][0]["replicas"]["wanted"] == 0

    _, again = await admin.call("POST", "/api/v1/system/stop")
    assert again["changed"] is False
    _, started = await admin.call("POST", "/api/v1/system/start")
    assert started == {"stopped": False, "changed": True, "version": 3}
    assert not admin.cluster.settings.serving.stopped
    _, models = await admin.call("GET", "/api/v1/models")
    assert models["data"][0]["replicas"]["wanted"] == 2


async def test_status_says_whether_serving_and_each_model_ready_of_wanted(admin: Admin) -> None:
    add_node(admin.cluster)
    model = ModelRecord.simple("m", "sim", replicas=2)
    admin.cluster.put_model(model)
    add_shard(admin.cluster, "m-0", "m", ShardState.READY)
    add_shard(admin.cluster, "m-1", "m", ShardState.STARTING)
    await admin.call("POST", "/api/v1/system/stop")
    status, body = await admin.call("GET", "/api/v1/status")
    assert status == 200
    assert body["serving"] == {"stopped": True}
    assert body["settings_version"] == 2
    assert body["models"] == ["m"]
    assert body["model_replicas"] == [
        {
            "name": "m",
            "wanted": 0,
            "ready": 1,
            "starting": 1,
            "failed": 0,
            "stopped": False,
            "external": False,
        }
    ]


# --- models ---------------------------------------------------------------------------


async def test_a_model_is_added_listed_and_shown_with_live_counts(admin: Admin) -> None:
    waiter = admin.cluster.changed
    status, view = await admin.call(
        "POST", "/api/v1/models", sim_entry(replicas=3, aliases=["two"])
    )
    assert status == 201, view
    assert waiter.is_set()
    assert view["name"] == "second"
    assert view["engine"] == "sim"
    assert view["replicas"] == {"wanted": 3, "ready": 0, "starting": 0, "failed": 0}
    stored = await admin.store.get_model("second")
    assert stored is not None
    assert stored.created_at > 0

    add_node(admin.cluster)
    add_shard(admin.cluster, "second-0", "second", ShardState.READY)
    add_shard(admin.cluster, "second-1", "second", ShardState.FAILED, reason="exit 1")
    add_shard(admin.cluster, "second-2", "second", ShardState.STARTING)
    add_shard(admin.cluster, "second-9", "second", ShardState.READY, retiring=True)
    _, listing = await admin.call("GET", "/api/v1/models")
    [only] = listing["data"]
    assert only["replicas"] == {"wanted": 3, "ready": 1, "starting": 1, "failed": 1}
    assert only["entry"]["aliases"] == ["two"]

    status, shown = await admin.call("GET", "/api/v1/models/two")
    assert status == 200
    assert shown["name"] == "second"
    assert {s["replica_id"] for s in shown["shards"]} == {
        "second-0",
        "second-1",
        "second-2",
        "second-9",
    }


async def test_adding_a_taken_name_is_409_and_a_bad_entry_400(admin: Admin) -> None:
    assert (await admin.call("POST", "/api/v1/models", sim_entry()))[0] == 201
    status, body = await admin.call("POST", "/api/v1/models", sim_entry())
    assert status == 409
    assert body["error"]["code"] == "model_exists"
    status, body = await admin.call("POST", "/api/v1/models", {"name": "x", "engine": "nope"})
    assert status == 400
    assert "engine" in body["error"]["message"]
    status, body = await admin.call("POST", "/api/v1/models", {"name": "x", "engine": "sim"})
    assert status == 400
    assert "min_memory_gb" in body["error"]["message"]
    status, body = await admin.call("POST", "/api/v1/models", sim_entry("y", enigne="sim"))
    assert status == 400
    assert "enigne" in body["error"]["message"]


async def test_an_outside_model_is_marked_external_and_not_scaled(admin: Admin) -> None:
    entry = {
        "name": "gpt-outside",
        "source": "external",
        "external": {"url": "https://api.example.com", "model": "gpt-x", "api_key_file": "/k"},
    }
    status, view = await admin.call("POST", "/api/v1/models", entry)
    assert status == 201, view
    assert view["external"] is True
    assert view["engine"] == "external"
    status, body = await admin.call("POST", "/api/v1/models/gpt-outside/scale", {"replicas": 2})
    assert status == 400
    assert "outside provider" in body["error"]["message"]


async def test_an_unknown_model_is_404(admin: Admin) -> None:
    for method, path in [
        ("GET", "/api/v1/models/nope"),
        ("POST", "/api/v1/models/nope/stop"),
        ("DELETE", "/api/v1/models/nope"),
        ("GET", "/api/v1/models/nope/placement"),
    ]:
        status, body = await admin.call(method, path)
        assert status == 404, path
        assert body["error"]["code"] == "model_not_found"


async def test_put_replaces_an_entry_and_says_whether_replicas_roll(admin: Admin) -> None:
    await admin.call("POST", "/api/v1/models", sim_entry())
    status, view = await admin.call(
        "PUT", "/api/v1/models/second", sim_entry(description="now described")
    )
    assert status == 200, view
    assert view["restart"] is False
    assert view["entry"]["description"] == "now described"
    status, view = await admin.call("PUT", "/api/v1/models/second", sim_entry(context=8192))
    assert view["restart"] is True
    status, body = await admin.call("PUT", "/api/v1/models/second", sim_entry("other"))
    assert status == 400
    assert "named 'other'" in body["error"]["message"]


async def test_scale_stop_and_start(admin: Admin) -> None:
    await admin.call("POST", "/api/v1/models", sim_entry())
    status, view = await admin.call("POST", "/api/v1/models/second/scale", {"replicas": 2})
    assert status == 200, view
    assert view["replicas"]["wanted"] == 2

    status, view = await admin.call("POST", "/api/v1/models/second/stop")
    assert (view["stopped"], view["changed"], view["replicas"]["wanted"]) == (True, True, 0)
    stored = await admin.store.get_model("second")
    assert stored is not None
    assert (stored.stopped, stored.replicas) == (True, 2)  # the count is kept
    _, again = await admin.call("POST", "/api/v1/models/second/stop")
    assert again["changed"] is False

    _, view = await admin.call("POST", "/api/v1/models/second/start")
    assert (view["stopped"], view["replicas"]["wanted"]) == (False, 2)

    await admin.call("POST", "/api/v1/models/second/stop")
    _, view = await admin.call("POST", "/api/v1/models/second/scale", {"replicas": 1})
    assert (view["stopped"], view["started"], view["replicas"]["wanted"]) == (False, True, 1)


async def test_scale_refuses_bad_counts_and_needs_a_profile_when_there_are_several(
    admin: Admin,
) -> None:
    entry = {
        "name": "two-ways",
        "profiles": [
            {"name": "big", "engine": "sim", "min_memory_gb": 1, "replicas": 1},
            {"name": "small", "engine": "sim", "min_memory_gb": 1, "replicas": 1},
        ],
    }
    assert (await admin.call("POST", "/api/v1/models", entry))[0] == 201
    status, body = await admin.call("POST", "/api/v1/models/two-ways/scale", {"replicas": 3})
    assert status == 400
    assert "big, small" in body["error"]["message"]
    status, view = await admin.call(
        "POST", "/api/v1/models/two-ways/scale", {"replicas": 3, "profile": "small"}
    )
    assert status == 200
    assert view["replicas"]["wanted"] == 4
    for bad in ({"replicas": -1}, {"replicas": "2"}, {}, {"replicas": 1, "profile": "huge"}):
        status, _ = await admin.call("POST", "/api/v1/models/two-ways/scale", bad)
        assert status == 400, bad


async def test_context_changes_the_profile_or_only_the_catalog(admin: Admin) -> None:
    await admin.call("POST", "/api/v1/models", sim_entry(context_length=8192))
    status, view = await admin.call(
        "POST", "/api/v1/models/second/context", {"tokens": 16384, "slots": 2}
    )
    assert status == 200, view
    assert view["restart"] is True
    stored = await admin.store.get_model("second")
    assert stored is not None
    assert stored.profile is not None
    assert (stored.profile.context_tokens, stored.profile.slots) == (16384, 2)

    status, view = await admin.call("POST", "/api/v1/models/second/context", {"max_output": 1000})
    assert status == 200
    assert view["restart"] is False
    assert view["entry"]["max_output"] == 1000

    status, body = await admin.call("POST", "/api/v1/models/second/context", {"tokens": 65536})
    assert status == 400
    assert "trained" in body["error"]["message"]
    status, body = await admin.call("POST", "/api/v1/models/second/context", {})
    assert status == 400


def test_change_context_keeps_max_output_within_one_request() -> None:
    model = ModelRecord.simple("m", "sim", context_tokens=8192, slots=4)
    with pytest.raises(Exception, match="beyond the 2048 tokens"):
        change_context(model, tokens=None, slots=None, max_output=4096)
    changed, restart = change_context(model, tokens=None, slots=1, max_output=4096)
    assert restart
    assert changed.max_output == 4096


async def test_remove_and_purge(admin: Admin, tmp_path: Path) -> None:
    weights = admin.data_dir / "weights"
    weights.mkdir()
    mine = weights / "mine.gguf"
    mine.write_bytes(b"x")
    shared = weights / "shared.gguf"
    shared.write_bytes(b"x")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.gguf"
    outside.write_bytes(b"x")
    for name, source in (("a", mine), ("b", shared), ("c", shared), ("d", outside)):
        await admin.store.put_model(ModelRecord.simple(name, "sim", source=str(source)))

    status, body = await admin.call("DELETE", "/api/v1/models/a?purge=1")
    assert status == 200
    assert body == {"name": "a", "removed": True, "purged": [str(mine.resolve())]}
    assert not mine.exists()
    assert await admin.store.get_model("a") is None

    _, body = await admin.call("DELETE", "/api/v1/models/b?purge=1")
    assert body["purged"] == []  # c still uses it
    assert shared.exists()
    _, body = await admin.call("DELETE", "/api/v1/models/d?purge=1")
    assert body["purged"] == []  # outside the data directory
    assert outside.exists()
    _, body = await admin.call("DELETE", "/api/v1/models/c")
    assert body["purged"] == []
    assert shared.exists()
    outside.unlink()


def test_purge_never_deletes_the_data_directory_itself(tmp_path: Path) -> None:
    model = ModelRecord.simple("m", "sim", source=str(tmp_path))
    assert purge_weights(model, [], tmp_path) == []
    assert tmp_path.exists()


# --- nodes, replicas, placement ----------------------------------------------------------


async def test_nodes_show_hardware_cordons_and_replicas(admin: Admin) -> None:
    add_node(admin.cluster)
    add_shard(admin.cluster, "m-0", "m", ShardState.READY)
    status, body = await admin.call("POST", "/api/v1/nodes/n1/drain")
    assert status == 200
    assert (body["cordoned"], body["draining"], body["known"]) == (True, True, True)
    assert admin.cluster.settings.nodes.draining == ("n1",)

    _, nodes = await admin.call("GET", "/api/v1/nodes")
    [node] = nodes["data"]
    assert node["node_id"] == "n1"
    assert node["cpu_count"] == 8
    assert node["memory_total_mb"] == 16384
    assert node["memory_available_mb"] == 8192
    assert node["memory_bandwidth_gbps"] == 40.0
    assert node["reserved"] == {
        "memory_gb": 0.0,
        "cpu_cores": 0,
        "gpu_memory_mb": {},
        "whole_gpus": [],
    }
    assert (node["cordoned"], node["draining"]) == (True, True)
    assert node["replicas"] == ["m-0"]
    assert node["gpus"] == []

    _, body = await admin.call("POST", "/api/v1/nodes/n1/uncordon")
    assert (body["cordoned"], body["draining"]) == (False, False)
    _, body = await admin.call("POST", "/api/v1/nodes/n1/cordon")
    assert (body["cordoned"], body["draining"]) == (True, False)
    _, body = await admin.call("POST", "/api/v1/nodes/elsewhere/cordon")
    assert body["known"] is False
    assert admin.cluster.settings.nodes.cordoned == ("elsewhere", "n1")


async def test_replicas_show_state_reason_and_on_request_the_engine_key(admin: Admin) -> None:
    add_node(admin.cluster)
    add_shard(admin.cluster, "m-0", "m", ShardState.FAILED, reason="exit 1; last output: oom")
    _, body = await admin.call("GET", "/api/v1/replicas")
    [rep] = body["data"]
    assert rep["replica_id"] == "m-0"
    assert rep["state"] == str(ShardState.FAILED)
    assert rep["reason"] == "exit 1; last output: oom"
    assert "engine_key" not in rep
    _, body = await admin.call("GET", "/api/v1/replicas?engine_keys=1")
    assert body["data"][0]["engine_key"] == engine_key(admin.cluster.secret, "m-0")


async def test_placement_explains_every_node(admin: Admin) -> None:
    add_node(admin.cluster)
    model = ModelRecord(
        name="m", profiles=(Profile(engine="sim", min_memory_gb=64.0),), created_at=1.0
    )
    await admin.store.put_model(model)
    status, body = await admin.call("GET", "/api/v1/models/m/placement")
    assert status == 200, body
    [verdict] = body["nodes"]
    assert verdict["node_id"] == "n1"
    assert verdict["fits"] is False
    assert verdict["reason"]


# --- the answer cache per project ----------------------------------------------------


async def test_the_answer_cache_is_turned_on_and_off_per_project_by_its_path(
    admin: Admin,
) -> None:
    project, _ = await admin.store.ensure_project("Acme", "ml", "train", now=1.0)
    status, body = await admin.call("PUT", "/api/v1/projects/Acme/ml/train/cache", {"ttl": "30m"})
    assert status == 200, body
    assert (body["project"], body["project_id"], body["ttl_s"]) == (
        "Acme/ml/train",
        project.project.id,
        1800.0,
    )
    assert admin.cluster.settings.router.cache.projects == {project.project.id: 1800.0}
    status, body = await admin.call("DELETE", "/api/v1/projects/Acme/ml/train/cache")
    assert status == 200
    assert body["cache"] is False
    assert admin.cluster.settings.router.cache.projects == {}


async def test_the_answer_cache_of_an_unknown_project_or_a_bad_ttl_is_refused(
    admin: Admin,
) -> None:
    await admin.store.ensure_project("Acme", "ml", "train", now=1.0)
    status, body = await admin.call("PUT", "/api/v1/projects/Acme/ml/nope/cache", {"ttl": "1h"})
    assert (status, body["error"]["code"]) == (404, "project_not_found")
    status, body = await admin.call("PUT", "/api/v1/projects/Acme/ml/train/cache", {"ttl": "soon"})
    assert (status, body["error"]["param"]) == (400, "ttl")
    status, body = await admin.call("PUT", "/api/v1/projects/Acme/ml/train/cache", {"ttl": 0})
    assert status == 400
    assert admin.cluster.settings.router.cache.projects == {}


async def test_a_change_to_a_setting_read_at_start_says_it_needs_a_restart(admin: Admin) -> None:
    status, body = await admin.call(
        "PATCH", "/api/v1/config", {"key": "auth.flush_interval", "value": "2s"}
    )
    assert status == 200
    assert body["restart_needed"] == ["auth.flush_interval"]
    status, body = await admin.call(
        "PATCH", "/api/v1/config", {"key": "auth.default_rpm", "value": 1000}
    )
    assert status == 200
    assert body["changed"] is True
    assert "restart_needed" not in body  # the gateway follows it live
    assert admin.cluster.settings.auth.default_rpm == 1000


async def test_a_model_shows_why_its_replicas_wait_and_only_its_own(admin: Admin) -> None:
    await admin.store.put_model(ModelRecord.simple("m", "sim", replicas=2))
    await admin.store.put_model(ModelRecord.simple("m-big", "sim", replicas=1))
    admin.cluster.set_waiting(
        {
            "m-1": "needs 9.0 GB host memory; 2.0 GB of 16.0 GB free after 1 replica",
            "m-big-0": "needs 4 cores",
            "m-0.g2": "successor waits for room",
        }
    )
    _, view = await admin.call("GET", "/api/v1/models/m")
    assert view["waiting"] == {
        "m-0.g2": "successor waits for room",
        "m-1": "needs 9.0 GB host memory; 2.0 GB of 16.0 GB free after 1 replica",
    }
    _, big = await admin.call("GET", "/api/v1/models/m-big")
    assert big["waiting"] == {"m-big-0": "needs 4 cores"}


async def test_the_catalog_is_replaced_whole_so_its_readers_see_each_change(
    admin: Admin,
) -> None:
    before = admin.cluster.models
    status, _ = await admin.call("POST", "/api/v1/models", sim_entry("fresh"))
    assert status == 201
    added = admin.cluster.models
    assert added is not before
    assert "fresh" in added
    assert "fresh" not in before
    status, _ = await admin.call("DELETE", "/api/v1/models/fresh")
    assert status == 200
    assert admin.cluster.models is not added
    assert "fresh" not in admin.cluster.models


async def test_removing_a_node_again_is_not_found(admin: Admin) -> None:
    """The second ``DELETE`` of a node no longer registered, its certificates
    revoked already, is 404 ``node_not_found``, not "removed: 0
    certificate(s) revoked"."""
    now = 1000.0
    await admin.store.insert_node_certificate(
        NodeCertificate(serial="ab", node_id="gone", issued_at=now, not_after=now + 3600)
    )
    status, body = await admin.call("DELETE", "/api/v1/nodes/gone")
    assert status == 200, body
    assert body["revoked_certificates"] == 1
    status, body = await admin.call("DELETE", "/api/v1/nodes/gone")
    assert status == 404, body
    assert body["error"]["code"] == "node_not_found"


async def test_status_names_the_store_without_a_password_and_the_leader(admin: Admin) -> None:
    status, body = await admin.call("GET", "/api/v1/status")
    assert status == 200
    assert body["store"] == {"kind": "sqlite", "address": str(admin.data_dir / "llmgw.db")}
    assert body["leadership"] == {
        "holder": None,
        "epoch": None,
        "since": None,
        "api": None,
        "here": False,
    }
    admin.cluster.set_leader(
        True, lease=Lease(name="leader", holder="cp1:42:ab", epoch=3, expires_at=1e12)
    )
    status, body = await admin.call("GET", "/api/v1/status")
    lead = body["leadership"]
    assert (lead["holder"], lead["epoch"], lead["here"]) == ("cp1:42:ab", 3, True)
    assert lead["since"] == pytest.approx(time.time(), abs=60)


async def test_a_replica_shows_its_engine_pid_while_it_runs(admin: Admin) -> None:
    add_node(admin.cluster)
    admin.cluster.put_model(ModelRecord.simple("m", "sim"))
    add_shard(admin.cluster, "m-0", "m", ShardState.STARTING)

    async def pid() -> int:
        _, body = await admin.call("GET", "/api/v1/replicas")
        [replica] = body["data"]
        value: int = replica["pid"]
        return value

    assert await pid() == 0
    ready = protocol.ShardStatus(shard_id="m-0", replica_id="m-0", state=ShardState.READY, pid=4242)
    admin.cluster.shard_status(ready, "n1")
    assert await pid() == 4242
    failed = protocol.ShardStatus(shard_id="m-0", replica_id="m-0", state=ShardState.FAILED)
    admin.cluster.shard_status(failed, "n1")
    assert await pid() == 0


def test_a_standby_names_the_leader_from_its_record_in_the_store() -> None:
    view = LeaderView("cp2:7:cd")
    record = LeaderRecord(holder="cp1:42:ab", epoch=3, api="10.0.0.1:8080", since=1.7e9)
    view.record = LeaderRecord.from_json(record.to_json())
    assert leadership_view(Cluster(), view) == {
        "holder": "cp1:42:ab",
        "epoch": 3,
        "since": 1.7e9,
        "api": "10.0.0.1:8080",
        "here": False,
    }
    # A record an older llmgw wrote has no `since`: not known.
    older = {"holder": "cp1:42:ab", "epoch": 3, "api": "10.0.0.1:8080", "hubs": []}
    view.record = LeaderRecord.from_json(older)
    assert leadership_view(Cluster(), view)["since"] is None

"""The console's screens as text, from admin API answers (no processes)."""

from __future__ import annotations

import time
from pathlib import Path

from llmgw.console.format import date, duration, gib_from_mb, table
from llmgw.console.screens import (
    flatten_settings,
    render_keys,
    render_logs,
    render_manual,
    render_models,
    render_overview,
    render_replicas,
    traffic,
)


def test_table_aligns_columns_under_their_headers() -> None:
    lines = table(["A", "LONGER"], [["xxxx", 1], [None, "two"]])
    assert lines == ["A     LONGER", "xxxx  1", "-     two"]


def test_units_and_dates() -> None:
    assert gib_from_mb(24105) == "23.5 GiB"
    assert duration(3725) == "1h 02m"
    assert date(None) == "-"
    assert date(0) == "-"
    assert date(1796171119.9).startswith("2026-")


def test_traffic_over_the_window() -> None:
    now = time.time()
    rows = [
        {"created_at": now - 10, "completion_tokens": 30, "ttft_ms": 10.0, "status": 200},
        {"created_at": now - 20, "completion_tokens": 30, "ttft_ms": 30.0, "status": 500},
        {"created_at": now - 900, "completion_tokens": 1000, "ttft_ms": 1.0, "status": 200},
    ]
    t = traffic(rows, 60.0, now)
    assert t["requests"] == 2
    assert t["tps"] == 1.0
    assert t["ttft_p50_ms"] == 20.0
    assert t["errors"] == 1


def test_the_overview_names_what_needs_a_look() -> None:
    data = {
        "status": {
            "leader": True,
            "replicas": [{"replica_id": "m-0", "state": "FAILED", "reason": "out of memory"}],
        },
        "nodes": {"data": [{"node_id": "n1", "connected": False, "gpus": []}]},
        "models": {
            "data": [{"name": "m", "replicas": {"failed": 1}, "waiting": {"m-1": "no node fits"}}]
        },
    }
    text = render_overview(data).text()
    assert "0 connected of 1" in text
    assert "m-0 failed: out of memory" in text
    assert "m-1 waiting: no node fits" in text
    assert "node n1: not connected" in text


def test_models_table_has_a_header_and_selectable_rows() -> None:
    view = {"name": "m", "engine": "sim", "replicas": {"ready": 1, "wanted": 2}, "waiting": {}}
    panel = render_models({"models": {"data": [view]}})
    assert panel.text().splitlines()[0].startswith("MODEL")
    assert panel.items == [(1, view)]
    assert "1/2" in panel.text()


def test_logs_filter_and_highlight() -> None:
    lines = ["a INFO fine", "b WARNING careful", "c ERROR broken"]
    panel = render_logs(lines, "")
    assert [line[0][0] for line in panel.lines] == ["", "class:warning", "class:error"]
    assert render_logs(lines, "broken").text() == "c ERROR broken"
    assert "no line contains" in render_logs(lines, "nothing").text()


def test_settings_flatten_to_key_paths() -> None:
    flat = flatten_settings({"nodes": {"drain_grace": 300, "cordoned": []}, "x": 1})
    assert [(p, leaf) for p, _, _, leaf in flat] == [
        ("nodes", False),
        ("nodes.cordoned", True),
        ("nodes.drain_grace", True),
        ("x", True),
    ]


def test_manual_renders_a_page_as_text(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nSee [the docs](other.md).\n\n```\ncode\n```\n")
    assert render_manual([page], None).items == [(0, page)]
    text = render_manual([page], page).text()
    assert "TITLE" in text
    assert "See the docs." in text
    assert "    code" in text
    assert "```" not in text


def test_keys_show_their_last_use_and_the_tree_lines_are_selectable() -> None:
    now = 1_800_000_000.0
    data = {
        "keys": {
            "data": [
                {"id": "key_a", "name": "a", "limits": {}, "last_used_at": now - 125},
                {"id": "key_b", "name": "b", "limits": {}, "last_used_at": None},
            ]
        },
        "tree": {
            "data": [
                {
                    "path": "Acme/ml/train",
                    "project_id": "p1",
                    "limits": {"org": {}, "team": {"budget_day": "5"}, "project": {}},
                }
            ]
        },
    }
    panel = render_keys(data, now=now)
    text = "\n".join("".join(t for _, t in line) for line in panel.lines)
    assert "LAST USE" in text
    [a] = [ln for ln in text.splitlines() if ln.startswith("key_a")]
    [b] = [ln for ln in text.splitlines() if ln.startswith("key_b")]
    assert "2m 05s ago" in a
    assert "never" in b
    assert "Acme/ml/train: defaults / budget_day 5 / defaults" in text
    tree_items = [item for _, item in panel.items if item.get("tree")]
    assert [t["path"] for t in tree_items] == ["Acme/ml/train"]


def test_replicas_show_the_engine_pid_and_uptime_while_it_runs() -> None:
    now = 1_800_000_000.0
    common = {"node_id": "n1", "compute": "CPU", "port": 20001}
    data = {
        "replicas": {
            "data": [
                {
                    **common,
                    "replica_id": "m-0",
                    "state": "READY",
                    "pid": 4242,
                    "started_at": now - 3725,
                },
                {
                    **common,
                    "replica_id": "m-1",
                    "state": "FAILED",
                    "pid": 0,
                    "started_at": now - 10,
                },
            ]
        }
    }
    lines = ["".join(t for _, t in line) for line in render_replicas(data, now).lines]
    assert lines[0].split()[4:7] == ["PORT", "PID", "UP"]
    assert "4242" in lines[1]
    assert "1h 02m" in lines[1]
    assert lines[2].split()[2:7] == ["FAILED", "CPU", "20001", "-", "-"]


def test_the_overview_names_the_store_and_the_leader() -> None:
    status = {
        "leader": True,
        "store": {"kind": "postgresql", "address": "db1:5432/llmgw"},
        "leadership": {
            "holder": "cp1:42:ab",
            "epoch": 3,
            "since": 1_800_000_000.0,
            "api": None,
            "here": True,
        },
    }
    text = "\n".join("".join(t for _, t in ln) for ln in render_overview({"status": status}).lines)
    assert "Store          postgresql db1:5432/llmgw" in text
    assert "Leader         cp1:42:ab (this control plane) since 2027-" in text
    status["leadership"] = {"holder": None, "epoch": None, "since": None, "api": None}
    text = "\n".join("".join(t for _, t in ln) for ln in render_overview({"status": status}).lines)
    assert "Leader         none known" in text

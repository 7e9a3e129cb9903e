"""The console's screens as text: each turns the admin API's answers into
the lines of its panel (pure functions, no I/O), and names the CLI command
that does the same.

A panel is a :class:`Panel`: its lines (each a list of ``(style, text)``
fragments) and its selectable items (the line each item is on, and the item).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from .format import ago, date, duration, gib_from_mb, money, table, tokens

__all__ = [
    "SCREENS",
    "Panel",
    "ScreenInfo",
    "flatten_settings",
    "manual_pages",
    "render_keys",
    "render_logs",
    "render_manual",
    "render_models",
    "render_nodes",
    "render_overview",
    "render_replicas",
    "render_settings",
    "traffic",
]

StyledLine = list[tuple[str, str]]


@attrs.define
class Panel:
    """Attributes:
    lines: the panel's lines, each a list of ``(style, text)`` fragments.
    items: the selectable items: ``(line index, item)``, in order.
    """

    lines: list[StyledLine] = attrs.field(factory=list)
    items: list[tuple[int, Any]] = attrs.field(factory=list)

    def add(self, text: str = "", style: str = "", item: Any = None) -> None:
        """Add one line (selectable when ``item`` is not None)."""
        if item is not None:
            self.items.append((len(self.lines), item))
        self.lines.append([(style, text)])

    def add_table(
        self, headers: Sequence[str], rows: Sequence[Sequence[Any]], items: Sequence[Any]
    ) -> None:
        """A table: its header line (bold), then one selectable line per row."""
        lines = table(headers, rows)
        self.add(lines[0], "class:header")
        for line, item in zip(lines[1:], items, strict=True):
            self.add(line, "", item)

    def text(self) -> str:
        """The plain text of the panel."""
        return "\n".join("".join(t for _, t in line) for line in self.lines)


@attrs.frozen
class ScreenInfo:
    """A screen: its ``key`` (the digit that opens it), ``name``, the CLI
    command that does the same (``cli``; for the Manual, the ``docs/`` pages
    of the checkout, which no command prints), and its keys (``help``)."""

    key: str
    name: str
    cli: str
    help: str


SCREENS: Final = (
    ScreenInfo("1", "Overview", "llmgw ctl status", ""),
    ScreenInfo(
        "2",
        "Models",
        "llmgw ctl models",
        "s scale  t stop/start  r restart  c context  x/X remove/purge  n serve",
    ),
    ScreenInfo("3", "Nodes", "llmgw ctl nodes", "c cordon/uncordon  d drain  l logs"),
    ScreenInfo("4", "Replicas", "llmgw ctl replicas", "l logs of the replica"),
    ScreenInfo(
        "5",
        "Keys",
        "llmgw keys list",
        "c create  v revoke  o rotate  l limits (key/org/team/project)  p period",
    ),
    ScreenInfo("6", "Logs", "llmgw ctl logs NODE", "/ filter  f follow  [ ] source  n node"),
    ScreenInfo("7", "Settings", "llmgw ctl config", "Enter edit  h history"),
    ScreenInfo("8", "Manual", "docs/*.md", "Enter open  Esc list  PgUp/PgDn"),
)


# --- Overview -------------------------------------------------------------------


def traffic(rows: Sequence[dict[str, Any]], window_s: float, now: float) -> dict[str, Any]:
    """Requests/s, tokens/s, TTFT p50 (ms), errors over the last ``window_s``
    seconds, from usage rows (``GET /api/v1/usage``)."""
    recent = [r for r in rows if r.get("created_at", 0) >= now - window_s]
    ttfts = [r["ttft_ms"] for r in recent if r.get("ttft_ms") is not None]
    completion = sum(r.get("completion_tokens", 0) for r in recent)
    return {
        "requests": len(recent),
        "rps": len(recent) / window_s,
        "tps": completion / window_s,
        "ttft_p50_ms": statistics.median(ttfts) if ttfts else None,
        "errors": sum(1 for r in recent if r.get("status", 200) >= 400),
    }


def render_overview(data: dict[str, Any], now: float | None = None) -> Panel:
    """``status``, ``nodes``, ``models``, ``usage`` (rows) and ``today``
    (a summary by model) → the Overview."""
    now = now or time.time()
    panel = Panel()
    status = data.get("status") or {}
    nodes = (data.get("nodes") or {}).get("data", [])
    models = (data.get("models") or {}).get("data", [])
    connected = sum(1 for n in nodes if n.get("connected"))
    gpus: dict[str, int] = {}
    for node in nodes:
        for gpu in node.get("gpus", []):
            gpus[gpu.get("name", "?")] = gpus.get(gpu.get("name", "?"), 0) + 1
    cards = ", ".join(f"{n} x {name}" for name, n in sorted(gpus.items())) or "none (CPU only)"
    states: dict[str, int] = {}
    for replica in status.get("replicas", []):
        states[replica.get("state", "?")] = states.get(replica.get("state", "?"), 0) + 1
    leader = "this control plane leads" if status.get("leader") else "standing by"
    serving = "STOPPED (llmgw start)" if (status.get("serving") or {}).get("stopped") else "on"
    panel.add(f"Control plane  {leader}; serving {serving}")
    panel.add(f"Nodes          {connected} connected of {len(nodes)}")
    panel.add(f"Cards          {cards}")
    by_state = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "none"
    panel.add(f"Replicas       {by_state}")
    panel.add(f"Models         {len(models)}")
    store = status.get("store") or {}
    if store:
        panel.add(f"Store          {store.get('kind', '?')} {store.get('address') or ''}".rstrip())
    lead = status.get("leadership") or {}
    if lead.get("holder"):
        where = "this control plane" if lead.get("here") else (lead.get("api") or "elsewhere")
        since = f" since {date(lead['since'])}" if lead.get("since") else ""
        panel.add(f"Leader         {lead['holder']} ({where}){since}")
    elif "leadership" in status:
        panel.add("Leader         none known", "class:warning")
    t = traffic((data.get("usage") or {}).get("data", []), 300.0, now)
    ttft = "-" if t["ttft_p50_ms"] is None else f"{t['ttft_p50_ms']:.0f} ms"
    panel.add(
        f"Last 5 min     {t['rps']:.2f} req/s  {t['tps']:.1f} tok/s  "
        f"TTFT p50 {ttft}  errors {t['errors']}"
    )
    today = (data.get("today") or {}).get("data", [])
    spend = sum(r.get("cost_micros", 0) for r in today)
    requests = sum(r.get("requests", 0) for r in today)
    panel.add(f"Today          {requests} requests, spend {money(spend)}")
    panel.add("")
    trouble: list[tuple[str, str]] = []
    for model in models:
        counts = model.get("replicas", {})
        if model.get("stopped"):
            trouble.append(("class:warning", f"{model['name']}: stopped"))
        elif counts.get("failed"):
            trouble.append(
                ("class:error", f"{model['name']}: {counts['failed']} replica(s) failed")
            )
        for replica_id, reason in (model.get("waiting") or {}).items():
            trouble.append(("class:warning", f"{replica_id} waiting: {reason}"))
    for replica in status.get("replicas", []):
        if replica.get("state") == "FAILED":
            reason = replica.get("reason") or "no reason given"
            trouble.append(("class:error", f"{replica['replica_id']} failed: {reason}"))
    for node in nodes:
        if not node.get("connected"):
            trouble.append(("class:error", f"node {node['node_id']}: not connected"))
        elif node.get("draining"):
            trouble.append(("class:warning", f"node {node['node_id']}: draining"))
        elif node.get("cordoned"):
            trouble.append(("class:warning", f"node {node['node_id']}: cordoned"))
    if trouble:
        panel.add("Needs a look", "class:header")
        for style, text in trouble:
            panel.add("  " + text, style)
    else:
        panel.add("Nothing waiting, failed or idle.", "class:ok")
    return panel


# --- Models, Nodes, Replicas ------------------------------------------------------


def model_state(view: dict[str, Any]) -> str:
    """A model view's state word, as ``ctl models`` prints it."""
    if view.get("external"):
        return "external"
    if view.get("stopped"):
        return "stopped"
    return "on-demand" if view.get("on_demand") else "running"


def render_models(data: dict[str, Any]) -> Panel:
    """``models`` → the Models table; items are the model views."""
    panel = Panel()
    views = (data.get("models") or {}).get("data", [])
    rows = []
    for view in views:
        counts = view.get("replicas", {})
        why = "; ".join(f"{k}: {v}" for k, v in (view.get("waiting") or {}).items())
        rows.append(
            [
                view["name"],
                view.get("engine", ""),
                model_state(view),
                f"{counts.get('ready', 0)}/{counts.get('wanted', 0)}",
                counts.get("starting") or "",
                counts.get("failed") or "",
                why,
            ]
        )
    panel.add_table(["MODEL", "ENGINE", "STATE", "READY", "START", "FAIL", "WHY NOT"], rows, views)
    if not views:
        panel.add("No models: n serves one (llmgw ctl model add).")
    return panel


def render_nodes(data: dict[str, Any]) -> Panel:
    """``nodes`` → the Nodes table and each node's hardware; items are node views."""
    panel = Panel()
    views = (data.get("nodes") or {}).get("data", [])
    rows = []
    for node in views:
        state = "connected" if node.get("connected") else "GONE"
        if node.get("draining"):
            state += ", draining"
        elif node.get("cordoned"):
            state += ", cordoned"
        rows.append(
            [
                node["node_id"],
                node.get("address", ""),
                state,
                node.get("cpu_count", ""),
                f"{gib_from_mb(node.get('memory_available_mb'))}/"
                f"{gib_from_mb(node.get('memory_total_mb'))}",
                len(node.get("gpus", [])),
                len(node.get("replicas", [])),
            ]
        )
    panel.add_table(
        ["NODE", "ADDRESS", "STATE", "CPUS", "MEM FREE/TOTAL", "GPUS", "REPL"], rows, views
    )
    for node in views:
        panel.add("")
        reserved = node.get("reserved") or {}
        panel.add(
            f"{node['node_id']}: agent {node.get('agent_version', '?')}, "
            f"load {node.get('load_1m', 0):.2f}, seen {ago(node.get('last_seen'))}, "
            f"engines {', '.join(node.get('engines', []))}",
        )
        panel.add(
            f"  reserved: {reserved.get('cpu_cores', 0)} cores, "
            f"{reserved.get('memory_gb', 0):.1f} GB host memory, "
            f"GPUs {reserved.get('whole_gpus') or '-'}"
        )
        for gpu in node.get("gpus", []):
            panel.add(
                f"  GPU {gpu.get('index')}: {gpu.get('name')} "
                f"{gib_from_mb(gpu.get('memory_used_mb'))}/{gib_from_mb(gpu.get('memory_total_mb'))}"
            )
    return panel


def render_replicas(data: dict[str, Any], now: float | None = None) -> Panel:
    """``replicas`` → the Replicas table; items are replica views."""
    now = now or time.time()
    panel = Panel()
    views = (data.get("replicas") or {}).get("data", [])
    rows = []
    for r in views:
        started = r.get("started_at")
        rows.append(
            [
                r.get("replica_id", ""),
                r.get("node_id", ""),
                r.get("state", "") + (f" {r['progress']}" if r.get("progress") else ""),
                r.get("compute", ""),
                r.get("port", ""),
                r.get("pid") or "-",
                duration(now - started) if started and r.get("state") in _RUNS else "-",
                r.get("restarts", 0),
            ]
        )
    panel.add_table(
        ["REPLICA", "NODE", "STATE", "COMPUTE", "PORT", "PID", "UP", "RESTARTS"], rows, views
    )
    for r in views:
        if r.get("reason"):
            style = "class:error" if r.get("state") == "FAILED" else "class:warning"
            panel.add(f"{r['replica_id']}: {r['reason']}", style)
    return panel


#: The states in which a replica's engine runs (its uptime is shown).
_RUNS: Final = ("STARTING", "READY")


# --- Keys -------------------------------------------------------------------------


def render_keys(data: dict[str, Any], period: str = "24h", now: float | None = None) -> Panel:
    """``keys``, ``usage_by_key`` and ``tree`` → keys, usage over ``period``
    and limits; items are key views, then the projects of the tree
    (``{"tree": True, "path", "project_id", "limits"}``), whose limits per
    level are edited from there."""
    now = now or time.time()
    panel = Panel()
    keys = (data.get("keys") or {}).get("data", [])
    usage = {u.get("group"): u for u in (data.get("usage_by_key") or {}).get("data", [])}
    rows = []
    for key in keys:
        state = "revoked" if key.get("revoked_at") else "live"
        if key.get("is_admin"):
            state += " admin"
        used = usage.get(key.get("id"), {})
        rows.append(
            [
                key.get("id", ""),
                key.get("name", ""),
                key.get("project") or "-",
                key.get("person") or "-",
                key.get("band") or "-",
                state,
                used.get("requests", 0),
                _key_limits(key.get("limits") or {}),
                ago(key.get("last_used_at"), now),
                date(key.get("expires_at")),
            ]
        )
    panel.add_table(
        [
            "ID", "NAME", "PROJECT", "OWNER", "BAND", "STATE", f"REQ {period}", "LIMITS",
            "LAST USE", "EXPIRES",
        ],
        rows,
        keys,
    )  # fmt: skip
    panel.add("")
    panel.add(f"Usage by key over {period}", "class:header")
    sums = (data.get("usage_by_key") or {}).get("data", [])
    if sums:
        for line in table(
            ["KEY", "REQUESTS", "TOKENS IN", "TOKENS OUT", "ERRORS", "SPEND"],
            [
                [
                    s.get("name", s.get("group")),
                    s.get("requests", 0),
                    tokens(s.get("prompt_tokens", 0)),
                    tokens(s.get("completion_tokens", 0)),
                    s.get("errors", 0),
                    money(s.get("cost_micros")),
                ]
                for s in sums
            ],
        ):
            panel.add(line)
    else:
        panel.add("  no requests")
    panel.add("")
    panel.add("Limits per project (org / team / project)", "class:header")
    for project in (data.get("tree") or {}).get("data", []):
        limits = project.get("limits", {})

        def short(level: dict[str, Any]) -> str:
            set_ = {k: v for k, v in level.items() if v is not None}
            return ", ".join(f"{k} {v}" for k, v in set_.items()) or "defaults"

        panel.add(
            f"  {project.get('path')}: "
            + " / ".join(short(limits.get(level, {})) for level in ("org", "team", "project")),
            "",
            {"tree": True, **project},
        )
    return panel


def _key_limits(limits: dict[str, Any]) -> str:
    """A key's own limits, ``rpm 10 tpm 5000``; ``-`` when it has none."""
    set_ = [f"{k} {v}" for k, v in limits.items() if v is not None and k in ("rpm", "tpm")]
    return " ".join(set_) or "-"


# --- Logs -------------------------------------------------------------------------


def render_logs(lines: Sequence[str], flt: str) -> Panel:
    """Log ``lines`` (newest last) that contain ``flt`` (any case), errors
    and warnings highlighted."""
    panel = Panel()
    needle = flt.lower()
    for line in lines:
        if needle and needle not in line.lower():
            continue
        upper = line.upper()
        if "ERROR" in upper or "CRITICAL" in upper or "TRACEBACK" in upper:
            style = "class:error"
        elif "WARNING" in upper or " WARN " in upper:
            style = "class:warning"
        else:
            style = ""
        panel.add(line, style)
    if not panel.lines:
        panel.add("(no lines)" if not needle else f"(no line contains {flt!r})")
    return panel


# --- Settings ---------------------------------------------------------------------


def flatten_settings(doc: Any, prefix: str = "") -> list[tuple[str, int, Any, bool]]:
    """The settings tree as ``(key path, depth, value, is_leaf)``, in order:
    an object is a branch; anything else (lists too) is a leaf."""
    out: list[tuple[str, int, Any, bool]] = []
    if isinstance(doc, dict):
        for name in sorted(doc):
            path = f"{prefix}.{name}" if prefix else name
            value = doc[name]
            depth = path.count(".")
            if isinstance(value, dict) and value:
                out.append((path, depth, value, False))
                out.extend(flatten_settings(value, path))
            else:
                out.append((path, depth, value, True))
    return out


def render_settings(data: dict[str, Any], history: bool = False) -> Panel:
    """``config`` → the settings tree (items: the leaves' key paths), or
    with ``history`` its last changes (``config_history``)."""
    panel = Panel()
    if history:
        rows = [
            [
                c.get("version"),
                date(c.get("changed_at")),
                c.get("actor"),
                ", ".join(c.get("changed", [])) or "-",
                c.get("note", ""),
            ]
            for c in (data.get("config_history") or {}).get("data", [])
        ]
        panel.add_table(["VERSION", "WHEN", "WHO", "CHANGED", "NOTE"], rows, [None] * len(rows))
        panel.items.clear()
        return panel
    config = data.get("config") or {}
    panel.add(f"version {config.get('version', '?')}", "class:header")
    for path, depth, value, leaf in flatten_settings(config.get("document") or {}):
        name = path.rsplit(".", 1)[-1]
        indent = "  " * depth
        if leaf:
            panel.add(f"{indent}{name}: {json.dumps(value)}", "", path)
        else:
            panel.add(f"{indent}{name}", "class:header")
    return panel


# --- Manual -----------------------------------------------------------------------


def manual_pages(docs_dir: Path | None) -> list[Path]:
    """The ``*.md`` pages of ``docs_dir``, by name (none when it is None or missing)."""
    if docs_dir is None or not docs_dir.is_dir():
        return []
    return sorted(docs_dir.glob("*.md"))


def render_manual(pages: Sequence[Path], page: Path | None) -> Panel:
    """The list of ``pages`` (items: the paths), or one ``page`` as text:
    headings highlighted, code blocks indented, links as their text."""
    panel = Panel()
    if page is None:
        if not pages:
            panel.add("No manual pages found (the docs/ directory is not installed here).")
        for path in pages:
            title = path.stem
            try:
                first = path.read_text(errors="replace").splitlines()[0]
                title = first.lstrip("# ").strip() or title
            except (OSError, IndexError):
                pass
            panel.add(f"{path.name:<24} {title}", "", path)
        return panel
    try:
        text = page.read_text(errors="replace")
    except OSError as exc:
        panel.add(f"{page}: {exc}", "class:error")
        return panel
    code = False
    for line in text.splitlines():
        if line.startswith("```"):
            code = not code
            continue
        if code:
            panel.add("    " + line, "class:code")
        elif line.startswith("#"):
            panel.add(
                line.lstrip("# ").upper() if line.startswith("# ") else line.lstrip("# "),
                "class:header",
            )
        else:
            panel.add(_unlink(line))
    return panel


def _unlink(line: str) -> str:
    """Markdown links ``[text](url)`` as ``text``."""
    out = []
    at = 0
    while True:
        start = line.find("[", at)
        mid = line.find("](", start)
        end = line.find(")", mid)
        if start < 0 or mid < 0 or end < 0:
            out.append(line[at:])
            return "".join(out)
        out.append(line[at:start])
        out.append(line[start + 1 : mid])
        at = end + 1

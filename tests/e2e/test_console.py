"""``llmgw console`` driven in-process (prompt-toolkit's pipe input, a dummy
output) against a real ``llmgw up --engine sim``; the node console on a real
agent's status socket with the control plane stopped."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from prompt_toolkit.input import PipeInput, create_pipe_input
from prompt_toolkit.output import DummyOutput

from llmgw.admin.client import AsyncAdminClient
from llmgw.console.app import Console
from llmgw.console.node import NodeConsole
from llmgw.console.screens import SCREENS

pytestmark = pytest.mark.slow

MODEL = "sim-model"
DOCS = Path(__file__).resolve().parents[2] / "docs"
#: Generous: two cores are shared by many processes.
WAIT_S = 90.0


def _screen(name: str) -> str:
    return next(s.key for s in SCREENS if s.name == name)


class Driver:
    """A console on a pipe input: keys in, its state read back."""

    def __init__(self, console: Console | NodeConsole, pipe: PipeInput) -> None:
        self.console: Any = console
        self.pipe = pipe

    def keys(self, text: str) -> None:
        self.pipe.send_text(text)

    async def until(
        self, predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S
    ) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = predicate()
            if found:
                return found
            await asyncio.sleep(0.1)
        text = self.console.panel_text()
        dialog = getattr(self.console, "dialog", None)
        shown = f"\n--- dialog: {dialog.title}: {dialog.text}" if dialog else ""
        raise AssertionError(f"not within {timeout_s} s: {what}\n--- panel:\n{text}{shown}")

    async def panel_has(self, needle: str) -> str:
        text: str = await self.until(
            lambda: needle in self.console.panel_text() and self.console.panel_text(),
            f"{needle!r} in the panel",
        )
        return text

    async def select(self, wanted: Callable[[Any], bool]) -> None:
        """Move the selection (j, k) to the first item for which ``wanted`` is true."""
        console = self.console
        items = await self.until(
            lambda: [i for i, (_, item) in enumerate(console.panel().items) if wanted(item)],
            "the item to select",
        )
        at = console.selected.get(console.screen, 0)
        self.keys("j" * (items[0] - at) if items[0] >= at else "k" * (at - items[0]))
        await self.until(lambda: wanted(console.selected_item()), "the selection to move")


@contextmanager
def _pipe() -> Iterator[PipeInput]:
    with create_pipe_input() as pipe:
        yield pipe


async def _run(console: Console | NodeConsole, pipe: PipeInput, scenario: Any) -> None:
    task = asyncio.create_task(console.run())
    try:
        await scenario(Driver(console, pipe))
    finally:
        pipe.send_text("\x03")  # Ctrl-C: quits even with a dialog open
        try:
            await asyncio.wait_for(task, 30)
        finally:
            if isinstance(console, Console):
                await console.client.aclose()


def _console(up: Any, pipe: PipeInput) -> Console:
    client = AsyncAdminClient.from_data_dir(up.data_dir, timeout_s=5)
    return Console(client, docs_dir=DOCS, refresh_s=1.0, input=pipe, output=DummyOutput())


@pytest.fixture(scope="module", name="up")
def up_fixture(start_module_up: Callable[..., Any]) -> Any:
    return start_module_up("--engine", "sim", "--model-name", MODEL)


def test_every_screen_shows_what_its_command_shows(up: Any) -> None:
    expected = {
        "Overview": "1 connected of 1",
        "Models": MODEL,
        "Nodes": "connected",
        "Replicas": "READY",
        "Keys": "default/default/default",
        "Logs": "registered with the control plane",
        "Settings": "drain_grace",
        "Manual": "architecture.md",
    }

    async def scenario(d: Driver) -> None:
        for screen in SCREENS:
            d.keys(screen.key)
            await d.panel_has(expected[screen.name])
            assert d.console.screen == SCREENS.index(screen)
        # The Manual opens a page.
        await d.select(lambda item: isinstance(item, Path) and item.name == "architecture.md")
        d.keys("\r")
        await d.panel_has("ARCHITECTURE")
        await d.panel_has("Layers")
        assert isinstance(d.console, Console)
        assert d.console.refresh_stats, "no refresh answered"

    with _pipe() as pipe:
        asyncio.run(_run(_console(up, pipe), pipe, scenario))


def test_scaling_from_the_models_screen_changes_the_replica_count(up: Any) -> None:
    async def scenario(d: Driver) -> None:
        d.keys(_screen("Models"))
        await d.panel_has("1/1")
        await d.select(lambda item: item and item["name"] == MODEL)
        d.keys("s")
        await d.until(lambda: d.console.dialog is not None, "the scale dialog")
        d.keys("\x7f2\r")  # backspace over "1", then 2
        await d.panel_has("2/2")
        assert len([r for r in up.status()["replicas"] if r["model"] == MODEL]) == 2
        # And back to one, with the same dialog.
        d.keys("s")
        await d.until(lambda: d.console.dialog is not None, "the scale dialog")
        d.keys("\x7f1\r")
        await d.panel_has("1/1")
        # Serve another model from the form, then remove it (each asks first).
        d.keys("n")
        await d.until(lambda: d.console.dialog is not None, "the serve form")
        d.keys("sim-two\r")  # name
        d.keys("\r")  # no source: the sim engine needs none
        d.keys("\x7f" * 8 + "sim\r\r\r")  # engine, replicas 1, context 4096
        d.keys("0.1\r")  # host memory to hold (a CPU model must say)
        dialog = await d.until(
            lambda: (
                d.console.dialog
                if d.console.dialog and d.console.dialog.kind == "confirm"
                else None
            ),
            "the plan and its question",
        )
        assert "no plan" in dialog.text
        d.keys("y")
        await d.panel_has("sim-two")
        await d.select(lambda item: item and item["name"] == "sim-two")
        d.keys("x")
        dialog = await d.until(
            lambda: (
                d.console.dialog
                if d.console.dialog and d.console.dialog.kind == "confirm"
                else None
            ),
            "the removal's question",
        )
        assert "llmgw ctl model remove sim-two" in dialog.text
        d.keys("y")
        await d.until(lambda: "sim-two" not in d.console.panel_text(), "sim-two gone")

    with _pipe() as pipe:
        asyncio.run(_run(_console(up, pipe), pipe, scenario))


def test_a_key_created_in_the_console_works_with_the_openai_client(up: Any) -> None:
    secret: list[str] = []

    async def scenario(d: Driver) -> None:
        console = d.console
        assert isinstance(console, Console)
        d.keys(_screen("Keys"))
        await d.panel_has("default/default/default")
        d.keys("c")
        await d.until(lambda: console.dialog is not None, "the create dialog")
        d.keys("console-made\r\r")  # name, then an empty project (the default one)
        dialog = await d.until(
            lambda: console.dialog if console.dialog and console.dialog.kind == "message" else None,
            "the secret's dialog",
        )
        found = re.search(r"sk-llmgw-\S+", dialog.text)
        assert found, dialog.text
        secret.append(found.group(0))
        d.keys("\r")
        await d.until(lambda: console.dialog is None, "the dialog to close")
        await d.panel_has("console-made")
        # Its own limit: one request a minute.
        await d.select(lambda item: item and item.get("name") == "console-made")
        d.keys("l")
        await d.until(lambda: console.dialog is not None, "the limits form")
        d.keys("1\r\r")  # rpm 1, tpm as the project says
        await d.panel_has("rpm 1")

    with _pipe() as pipe:
        asyncio.run(_run(_console(up, pipe), pipe, scenario))
    client = up.openai_client(timeout=60, api_key=secret[0])
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content
    with pytest.raises(openai.RateLimitError):  # the limit set in the console
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    with pytest.raises(openai.AuthenticationError):
        up.openai_client(timeout=60, api_key=secret[0] + "x").models.list()
    # `keys list` reads like the console: a header, aligned columns, dates.
    listed = up.cli("keys", "list")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:3] == ["ID", "PREFIX", "NAME"]
    [row] = [r for r in rows if "console-made" in r]
    assert row.index("console-made") == header.index("NAME")
    assert re.search(r"\b20\d\d-\d\d-\d\d \d\d:\d\d\b", row), row


def test_a_setting_is_refused_with_its_path_when_invalid_and_applied_when_valid(up: Any) -> None:
    async def scenario(d: Driver) -> None:
        console = d.console
        assert isinstance(console, Console)
        d.keys(_screen("Settings"))
        await d.panel_has("drain_grace")
        await d.select(lambda item: item == "nodes.drain_grace")
        d.keys("\r")
        await d.until(lambda: console.dialog is not None, "the edit dialog")
        d.keys("\x7f" * 12 + "-5\r")
        dialog = await d.until(
            lambda: console.dialog if console.dialog and console.dialog.kind == "message" else None,
            "the refusal",
        )
        assert "nodes.drain_grace" in dialog.title + dialog.text
        assert "negative" in dialog.text
        d.keys("\r")
        await d.until(lambda: console.dialog is None, "the refusal to close")
        d.keys("\r")
        await d.until(lambda: console.dialog is not None, "the edit dialog")
        d.keys("\x7f" * 12 + "123\r")
        await d.panel_has("drain_grace: 123")

    with _pipe() as pipe:
        asyncio.run(_run(_console(up, pipe), pipe, scenario))
    got = up.cli("ctl", "config", "get", "nodes.drain_grace")
    assert got.returncode == 0, got.stderr
    assert float(got.stdout) == 123


def test_the_logs_screen_follows_an_engine_and_the_agent(up: Any) -> None:
    async def scenario(d: Driver) -> None:
        console = d.console
        assert isinstance(console, Console)
        d.keys(_screen("Replicas"))
        await d.panel_has("READY")
        await d.select(lambda item: item and item["model"] == MODEL)
        d.keys("l")
        await d.panel_has("sim engine listening")
        assert SCREENS[console.screen].name == "Logs"
        # The agent's log, following: a new replica's start shows up by itself.
        d.keys("n")
        await d.panel_has("registered with the control plane")
        up.cli("ctl", "scale", MODEL, "2")
        await d.panel_has(f"shard {MODEL}-1: started")
        # Filter as you type.
        d.keys("/")
        await d.until(lambda: console.filter_active, "the filter")
        d.keys(f"{MODEL}-1")
        await d.until(
            lambda: all(
                f"{MODEL}-1" in line or "following" in line
                for line in console.panel_text().splitlines()
            ),
            "only the filtered lines",
        )
        d.keys("\r")
        up.cli("ctl", "scale", MODEL, "1")

    with _pipe() as pipe:
        asyncio.run(_run(_console(up, pipe), pipe, scenario))


def test_keys_show_last_use_replicas_their_pid_and_the_overview_the_store_and_leader(
    up: Any,
) -> None:
    listed = json.loads(up.cli("keys", "list", "--json").stdout)["data"]
    # The key `llmgw up` made: the one whose prefix starts its secret.
    [key] = [k for k in listed if up.client_key.startswith(k["prefix"])]
    answer = up.openai_client(timeout=60).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].message.content
    sent_at = time.time()
    [replica] = [r for r in json.loads(up.cli("ctl", "replicas", "--json").stdout)["data"]
                 if r["model"] == MODEL and r["state"] == "READY"]  # fmt: skip
    os.kill(replica["pid"], 0)  # a real process: raises if there is none

    async def scenario(d: Driver) -> None:
        console = d.console
        assert isinstance(console, Console)
        text = await d.panel_has("Store          sqlite")
        assert str(up.data_dir) in text
        assert re.search(r"Leader         \S+ \(this control plane\) since 20\d\d-", text), text
        d.keys(_screen("Replicas"))
        await d.panel_has(" PID ")
        await d.until(
            lambda: any(
                str(replica["pid"]) in line and replica["replica_id"] in line
                for line in console.panel_text().splitlines()
            ),
            "the replica's line with its pid",
        )
        d.keys(_screen("Keys"))
        await d.panel_has("LAST USE")

        def key_used() -> bool:
            views = (console.data.get("keys") or {}).get("data", [])
            used = [v.get("last_used_at") for v in views if v["id"] == key["id"]]
            return bool(used and used[0] and used[0] >= sent_at - 60)

        await d.until(key_used, "the key's last use")  # usage rows are written in batches
        [line] = [ln for ln in console.panel_text().splitlines() if ln.startswith(key["id"])]
        assert " ago" in line, line
        # The team's daily budget, from the project's line of the tree.
        await d.select(lambda item: item and item.get("tree") and item["path"].count("/") == 2)
        project = console.selected_item()
        d.keys("l")
        await d.until(lambda: console.dialog is not None, "the level's question")
        d.keys("\x7f" * len("project") + "team\r")
        await d.until(
            lambda: console.dialog is not None and "team" in console.dialog.title,
            "the team's limits form",
        )
        d.keys("\r\r1234.5\r\r")  # rpm, tpm as they are; budget_day; budget_month
        await d.panel_has("budget_day 1234.5")
        tree = (await console.client.call("GET", "/api/v1/tree"))["data"]
        [mine] = [p for p in tree if p["path"] == project["path"]]
        assert mine["limits"]["team"]["budget_day"] == "1234.5"
        assert mine["limits"]["project"]["budget_day"] is None
        # And cleared again from the same form (an empty field clears).
        d.keys("l")
        await d.until(lambda: console.dialog is not None, "the level's question")
        d.keys("\x7f" * len("project") + "team\r")
        await d.until(
            lambda: console.dialog is not None and "team" in console.dialog.title,
            "the team's limits form",
        )
        d.keys("\r\r" + "\x7f" * 10 + "\r\r")
        await d.until(lambda: "budget_day 1234.5" not in console.panel_text(), "the budget cleared")

    with _pipe() as pipe:
        asyncio.run(_run(_console(up, pipe), pipe, scenario))
    # The CLI says the same: `ctl status`, `keys list`, `ctl replicas`.
    status_text = up.cli("ctl", "status").stdout
    assert f"store: sqlite {up.data_dir}" in status_text, status_text
    assert re.search(r"leader lease: \S+ \(this control plane\), since 20\d\d-", status_text)
    keys_table = up.cli("keys", "list")
    header, *rows = keys_table.stdout.splitlines()
    assert "LAST USE" in header
    [row] = [r for r in rows if r.startswith(key["id"])]
    assert row.rstrip().endswith("ago"), row
    replicas_table = up.cli("ctl", "replicas")
    header, *rows = replicas_table.stdout.splitlines()
    assert header.split()[3:6] == ["PORT", "PID", "STATE"], header
    [row] = [r for r in rows if r.startswith(replica["replica_id"] + " ")]
    assert row.split()[4] == str(replica["pid"]), row


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_the_console_says_the_control_plane_is_down_and_recovers(
    start_up: Callable[..., Any],
) -> None:
    admin = f"127.0.0.1:{_free_port()}"
    args = ("--engine", "sim", "--model-name", MODEL, "--admin-listen", admin)
    up = start_up(*args)
    up.wait_ready()

    async def scenario(d: Driver) -> None:
        console = d.console
        assert isinstance(console, Console)
        await d.until(lambda: console.last_ok is not None, "a first answer")
        assert console.down is None
        await asyncio.to_thread(up.stop)
        await d.until(lambda: console.down is not None, "the console to say it is down")
        assert "cannot reach the admin API" in (console.down or "")
        title = "".join(fragment[1] for fragment in console._title())
        assert "CONTROL PLANE NOT ANSWERING" in title
        again = start_up(*args)
        await asyncio.to_thread(again.wait_ready)
        await d.until(lambda: console.down is None, "the console to recover by itself")
        await d.panel_has("1 connected of 1")

    with _pipe() as pipe:
        asyncio.run(_run(_console(up, pipe), pipe, scenario))


def test_the_node_console_works_with_the_control_plane_down(
    start_up: Callable[..., Any], agent_type: Any, procs: Any, tmp_path: Path
) -> None:
    up = start_up("--no-agent", "--engine", "sim", "--model-name", MODEL)
    up.wait_run()
    # A short path: a Unix socket's path has at most 107 bytes.
    state_dir = Path(f"/tmp/llmgw-node-{_free_port()}")
    agent = agent_type(up, state_dir, tmp_path / "agent.log", "node-a")
    agent.start()
    try:
        sock = state_dir / "agent.sock"
        up.wait_for(sock.exists, 120, f"the status socket:\n{agent.log()}")

        async def scenario(d: Driver) -> None:
            console = d.console
            assert isinstance(console, NodeConsole)
            await d.panel_has("answers")
            await d.panel_has("alive")  # the sim engine the control plane placed here
            assert "node-a" in console.panel_text()
            # The title fits an 80-column terminal, the time first (was cut).
            title = "".join(fragment[1] for fragment in console._title())
            assert len(title) <= 80, title
            assert "updated" in title
            await asyncio.to_thread(up.stop)
            await d.panel_has("DOES NOT ANSWER")
            assert console.error is None
            assert "alive" in console.panel_text()
            d.keys("3")  # the manual, read here
            await d.panel_has("architecture.md")
            d.keys("1")
            await d.panel_has("DOES NOT ANSWER")

        with _pipe() as pipe:
            node = NodeConsole(sock, refresh_s=1.0, docs_dir=DOCS, input=pipe, output=DummyOutput())
            asyncio.run(_run(node, pipe, scenario))
    finally:
        agent.kill(signal.SIGTERM)
        procs.kill_groups(procs.engines_in(up.engine_ports, "sim"))
        shutil.rmtree(state_dir, ignore_errors=True)

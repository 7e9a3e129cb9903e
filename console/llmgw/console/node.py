"""The node console (``llmgw console --node``, ``docs/console.md``): what
this node's agent says of itself, read every :data:`NODE_REFRESH_S` seconds
from its read-only status socket (:mod:`llmgw.agent.status_socket`). It needs
neither the admin token nor a reachable control plane."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from prompt_toolkit.application import Application
from prompt_toolkit.data_structures import Point
from prompt_toolkit.formatted_text import StyleAndTextTuples
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.layout import HSplit, Layout, Window
from prompt_toolkit.layout.controls import FormattedTextControl
from prompt_toolkit.output import Output
from prompt_toolkit.widgets import Frame

from .app import STYLE
from .format import date, duration, gib_from_bytes, gib_from_mb
from .screens import Panel, manual_pages, render_manual

__all__ = ["NODE_REFRESH_S", "NodeConsole", "read_status", "render_node"]

#: Seconds between two reads of the status socket.
NODE_REFRESH_S: Final = 3.0
#: Deadline of one read of the status socket, in seconds.
READ_TIMEOUT_S: Final = 5.0


async def read_status(socket_path: Path, timeout_s: float = READ_TIMEOUT_S) -> dict[str, Any]:
    """The agent's status document (``llmgw.agent.status_socket``).

    Raises:
        OSError: no agent listens there (``FileNotFoundError``,
            ``ConnectionRefusedError``), or it answered nothing readable.
        TimeoutError: no answer within ``timeout_s``.
    """
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_unix_connection(str(socket_path))
        try:
            raw = await reader.read()
        finally:
            writer.close()
            await writer.wait_closed()
    try:
        doc: dict[str, Any] = json.loads(raw)
    except ValueError:
        raise OSError(f"the agent's status socket answered {raw[:80]!r}") from None
    return doc


def render_node(doc: dict[str, Any]) -> Panel:
    """The status document as the node console's panel."""
    panel = Panel()
    now = doc.get("now") or time.time()
    state = doc.get("state", "?")
    panel.add(
        f"Agent     {doc.get('node_id', '?')} (pid {doc.get('pid', '?')}, version "
        f"{doc.get('version', '?')}): {state} since {date(doc.get('since'))}",
        "class:ok" if state == "linked" else "class:warning",
    )
    panel.add("")
    panel.add("Control planes", "class:header")
    for cp in doc.get("control_planes", []):
        answers = "answers" if cp.get("answers") else "DOES NOT ANSWER"
        current = " (current)" if cp.get("current") else ""
        panel.add(
            f"  {cp.get('url')}{current}: {answers}", "" if cp.get("answers") else "class:error"
        )
    panel.add("")
    panel.add("Engines", "class:header")
    engines = doc.get("engines", [])
    if not engines:
        panel.add("  none")
    for engine in engines:
        alive = "alive" if engine.get("alive") else "PROCESS GONE"
        gpus = ",".join(str(g) for g in engine.get("gpus", [])) or "CPU"
        panel.add(
            f"  {engine.get('replica_id')}  {engine.get('model')}  {engine.get('state')}  "
            f"port {engine.get('port')}  pid {engine.get('pid')} {alive}  {gpus}",
            "" if engine.get("alive") else "class:error",
        )
    panel.add("")
    panel.add("GPUs", "class:header")
    gpus = doc.get("gpus", [])
    if not gpus:
        panel.add("  none (no NVIDIA driver, or no card)")
    for gpu in gpus:
        panel.add(
            f"  {gpu.get('index')}: {gpu.get('name')}  "
            f"{gib_from_mb(gpu.get('memory_used_mb'))} of {gib_from_mb(gpu.get('memory_total_mb'))}"
        )
    disk = doc.get("disk") or {}
    panel.add("")
    panel.add(
        f"Disk      {gib_from_bytes(disk.get('free_bytes'))} free of "
        f"{gib_from_bytes(disk.get('total_bytes'))} ({disk.get('path')})"
    )
    panel.add("")
    panel.add("Warnings and errors", "class:header")
    warnings = doc.get("warnings", [])
    if not warnings:
        panel.add("  none")
    for line in warnings[-20:]:
        panel.add("  " + line, "class:error" if " ERROR " in line else "class:warning")
    panel.add("")
    panel.add(f"(read {duration(time.time() - now)} after the agent wrote it)")
    return panel


#: The node console's title fits a terminal this wide.
TITLE_WIDTH: Final = 80


def node_title(socket_path: str, when: str) -> str:
    """The title line: the time of the last read first, then the status
    socket, cut from the left (``…``) so the line fits :data:`TITLE_WIDTH`."""
    head = f" llmgw node  updated {when}  "
    room = TITLE_WIDTH - len(head)
    if len(socket_path) > room:
        socket_path = "…" + socket_path[-(room - 1) :]
    return head + socket_path


class NodeConsole:
    """The node console on the status socket ``socket_path``; ``input`` and
    ``output`` as for :class:`~llmgw.console.app.Console`.

    Attributes the tests read: :attr:`doc` (the last status, or None),
    :attr:`error` (why the last read failed, or None), :meth:`panel_text`.
    """

    def __init__(
        self,
        socket_path: Path,
        *,
        refresh_s: float = NODE_REFRESH_S,
        agent_yaml: Path | None = None,
        docs_dir: Path | None = None,
        input: Input | None = None,
        output: Output | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.refresh_s = refresh_s
        self.agent_yaml = agent_yaml
        self.pages = manual_pages(docs_dir)
        self.view = "node"  # node | settings | manual
        self.page: Path | None = None
        self.line = 0
        self.doc: dict[str, Any] | None = None
        self.error: str | None = None
        self.read_at: float | None = None
        kb = KeyBindings()

        @kb.add("q")
        @kb.add("c-c")
        def _quit(event: KeyPressEvent) -> None:
            event.app.exit()

        def show(view: str) -> Callable[[KeyPressEvent], None]:
            def handler(event: KeyPressEvent) -> None:
                self.view, self.line = view, 0

            return handler

        kb.add("1")(show("node"))
        kb.add("2")(show("settings"))
        kb.add("3")(show("manual"))

        @kb.add("down")
        @kb.add("j")
        def _down(event: KeyPressEvent) -> None:
            self.line += 1

        @kb.add("up")
        @kb.add("k")
        def _up(event: KeyPressEvent) -> None:
            self.line = max(0, self.line - 1)

        @kb.add("enter")
        def _open(event: KeyPressEvent) -> None:
            if self.view == "manual" and self.page is None and self.pages:
                self.page = self.pages[min(self.line, len(self.pages) - 1)]
                self.line = 0

        @kb.add("escape", eager=True)
        def _back(event: KeyPressEvent) -> None:
            self.page, self.line = None, 0

        body = Frame(
            Window(
                FormattedTextControl(self._panel, get_cursor_position=self._cursor),
                wrap_lines=False,
            ),
            title=self._frame_title,
        )
        self.app: Application[None] = Application(
            layout=Layout(
                HSplit(
                    [
                        Window(FormattedTextControl(self._title), height=1),
                        body,
                        Window(
                            FormattedTextControl(
                                " 1 node  2 agent.yaml  3 manual  Enter open  Esc back  q quit"
                            ),
                            height=1,
                            style="class:keybar",
                        ),
                    ]
                )
            ),
            key_bindings=kb,
            style=STYLE,
            full_screen=True,
            input=input,
            output=output,
        )

    def panel_text(self) -> str:
        """The panel as plain text."""
        return "".join(fragment[1] for fragment in self._panel())

    def _title(self) -> StyleAndTextTuples:
        if self.error is not None:
            return [
                (
                    "class:title.down",
                    f" llmgw node console  NO AGENT at {self.socket_path}: {self.error}; "
                    f"retrying every {self.refresh_s:g} s",
                )
            ]
        when = (
            "-" if self.read_at is None else time.strftime("%H:%M:%S", time.localtime(self.read_at))
        )
        return [("class:title", node_title(str(self.socket_path), when))]

    def _frame_title(self) -> str:
        if self.view == "settings":
            return f"agent.yaml = {self.agent_yaml or 'none found'}"
        if self.view == "manual":
            return f"Manual{': ' + self.page.name if self.page else ''}"
        return "This node = llmgw doctor, llmgw ctl logs NODE"

    def _cursor(self) -> Point:
        return Point(0, self.line)

    def _panel(self) -> StyleAndTextTuples:
        if self.view != "node":
            if self.view == "manual":
                panel = render_manual(self.pages, self.page)
            else:
                panel = Panel()
                try:
                    text = self.agent_yaml.read_text() if self.agent_yaml else "no agent.yaml"
                except OSError as exc:
                    text = f"{self.agent_yaml}: {exc}"
                for row in text.splitlines():
                    panel.add(row)
            self.line = min(self.line, max(0, len(panel.lines) - 1))
            out: StyleAndTextTuples = []
            selected = self.line if self.view == "manual" and self.page is None else -1
            for index, fragments in enumerate(panel.lines):
                for style, piece in fragments:
                    out.append((style + (" class:selected" if index == selected else ""), piece))
                out.append(("", "\n"))
            return out
        if self.doc is None:
            return [("", "reading the agent's status…" if self.error is None else self.error)]
        lines: StyleAndTextTuples = []
        for fragments in render_node(self.doc).lines:
            lines.extend(fragments)
            lines.append(("", "\n"))
        return lines

    async def refresh(self) -> None:
        """Read the socket once."""
        try:
            self.doc = await read_status(self.socket_path)
        except (OSError, TimeoutError) as exc:
            self.error = str(exc) or type(exc).__name__
        else:
            self.error = None
            self.read_at = time.time()
        self.app.invalidate()

    async def run(self) -> None:
        """Run until the user quits."""

        async def loop() -> None:
            while True:
                await self.refresh()
                await asyncio.sleep(self.refresh_s)

        task = asyncio.create_task(loop())
        try:
            await self.app.run_async()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

"""The operator's console: a full-screen prompt-toolkit application on
asyncio that speaks only to the admin API (``docs/console.md``).

Layout (80x24 and up): a title bar (where it is connected, when it last
heard, or in red that the control plane does not answer), a sidebar of
screens, the current screen in a bordered panel titled with the CLI command
that does the same, a key bar, and dialogs floating over it.

The refresh runs in its own asyncio task every ``refresh_s`` seconds (and at
once after a screen switch or an action): the screen's admin API calls go
out together, each bounded by the client's deadline, so a slow answer never
blocks a key press; an unreachable control plane is shown in the title bar
and the refresh keeps trying.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import attrs
from prompt_toolkit.application import Application
from prompt_toolkit.data_structures import Point
from prompt_toolkit.filters import Condition, Filter
from prompt_toolkit.formatted_text import StyleAndTextTuples
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.layout import (
    ConditionalContainer,
    DynamicContainer,
    Float,
    FloatContainer,
    HSplit,
    Layout,
    VSplit,
    Window,
)
from prompt_toolkit.layout.containers import AnyContainer
from prompt_toolkit.layout.controls import FormattedTextControl
from prompt_toolkit.output import Output
from prompt_toolkit.styles import Style
from prompt_toolkit.widgets import Frame, TextArea

from llmgw.admin.client import AdminRefused, AdminUnreachable, AsyncAdminClient

from .screens import (
    SCREENS,
    Panel,
    manual_pages,
    render_keys,
    render_logs,
    render_manual,
    render_models,
    render_nodes,
    render_overview,
    render_replicas,
    render_settings,
)

__all__ = ["DEFAULT_REFRESH_S", "STYLE", "Console", "PlanText", "run_console"]

log = logging.getLogger("llmgw.console")

#: Seconds between refreshes.
DEFAULT_REFRESH_S: Final = 2.0
#: Deadline of one admin API call made by a refresh, in seconds.
REFRESH_CALL_TIMEOUT_S: Final = 5.0
#: Log lines fetched per refresh on the Logs screen.
LOG_LINES: Final = 500
#: Periods the Keys screen sums usage over (``p`` cycles).
USAGE_PERIODS: Final = ("24h", "7d", "30d")

#: ``(source path or name, context tokens, admin API nodes) → the planner's
#: table`` for the Serve form; ``None`` when the source cannot be planned here.
PlanText = Callable[[str, int, list[dict[str, Any]]], str | None]

STYLE: Final = Style.from_dict(
    {
        "title": "bg:#005f87 #ffffff bold",
        "title.down": "bg:#af0000 #ffffff bold",
        "sidebar": "bg:#262626 #d0d0d0",
        "sidebar.current": "bg:#ffffff #000000 bold",
        "keybar": "bg:#303030 #ffffff",
        "header": "bold",
        "selected": "reverse",
        "error": "#ff5f5f bold",
        "warning": "#ffd700",
        "ok": "#5fd75f",
        "code": "#87afd7",
        "dialog": "bg:#444444 #ffffff",
        "dialog frame.label": "bold",
    }
)


@attrs.define
class _Dialog:
    """A dialog on top of the screen: ``kind`` ``confirm`` (y/n),
    ``message`` (Enter closes) or ``form`` (fields; Enter on the last one
    sends, Tab moves)."""

    title: str
    text: str
    kind: str
    future: asyncio.Future[Any]
    fields: list[tuple[str, TextArea]] = attrs.field(factory=list)


class Console:
    """The console on ``client`` (the admin API). ``docs_dir``: the manual's
    pages; ``plan_text``: the planner for the Serve form (:data:`PlanText`);
    ``input``/``output``: prompt-toolkit's, for tests (a pipe input and a
    dummy output); the terminal when None.

    Attributes the tests read: :attr:`screen` (index in
    :data:`~llmgw.console.screens.SCREENS`), :meth:`panel_text`,
    :attr:`down` (why the control plane is taken to be down, or None),
    :attr:`dialog`, :attr:`refresh_stats` (seconds of admin API time per
    refresh, newest last).
    """

    def __init__(
        self,
        client: AsyncAdminClient,
        *,
        docs_dir: Path | None = None,
        plan_text: PlanText | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
        input: Input | None = None,
        output: Output | None = None,
    ) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.plan_text = plan_text
        self.screen = 0
        self.data: dict[str, Any] = {}
        self.refused: dict[str, str] = {}
        self.down: str | None = None
        self.down_since: float | None = None
        self.last_ok: float | None = None
        self.refreshes = 0
        self.refresh_stats: collections.deque[float] = collections.deque(maxlen=1000)
        self.selected: dict[int, int] = {}
        self.log_filter = ""
        self.log_follow = True
        self.log_source: tuple[str, str] = ("", "")  # (node, shard id or "" for the agent)
        self.log_lines: list[str] = []
        self.log_line = 0  # the line shown while paused
        self.settings_history = False
        self.usage_period = USAGE_PERIODS[0]
        self.pages = manual_pages(docs_dir)
        self.manual_page: Path | None = None
        self.manual_line = 0
        self.dialog: _Dialog | None = None
        self.filter_active = False
        self.notice = ""
        self._poke = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

        self._filter = TextArea(multiline=False, prompt="filter: ", height=1)
        self._filter.buffer.on_text_changed += self._filter_changed
        self._panel_control = FormattedTextControl(
            self._panel_fragments,
            focusable=True,
            get_cursor_position=self._cursor,
            show_cursor=False,
        )
        self._panel_window = Window(self._panel_control, wrap_lines=False)
        body = HSplit(
            [
                self._panel_window,
                ConditionalContainer(
                    self._filter,
                    filter=Condition(lambda: SCREENS[self.screen].name == "Logs"),
                ),
            ]
        )
        self._frame = Frame(body, title=self._frame_title)
        root = FloatContainer(
            content=HSplit(
                [
                    Window(FormattedTextControl(self._title), height=1, style="class:title"),
                    VSplit(
                        [
                            Window(
                                FormattedTextControl(self._sidebar),
                                width=12,
                                style="class:sidebar",
                            ),
                            self._frame,
                        ]
                    ),
                    Window(FormattedTextControl(self._keybar), height=1, style="class:keybar"),
                ]
            ),
            floats=[Float(content=DynamicContainer(self._dialog_container))],
        )
        self.app: Application[None] = Application(
            layout=Layout(root, focused_element=self._panel_window),
            key_bindings=self._bindings(),
            style=STYLE,
            full_screen=True,
            mouse_support=False,
            input=input,
            output=output,
        )

    # --- running --------------------------------------------------------------------

    async def run(self) -> None:
        """Run until the user quits (q, Ctrl-C); the refresh runs beside it."""
        refresher = asyncio.create_task(self._refresh_loop())
        try:
            await self.app.run_async()
        finally:
            refresher.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(refresher, *self._tasks, return_exceptions=True)

    def poke(self) -> None:
        """Refresh now, not at the next tick."""
        self._poke.set()

    async def _refresh_loop(self) -> None:
        while True:
            self._poke.clear()
            await self.refresh()
            try:
                await asyncio.wait_for(self._poke.wait(), self.refresh_s)
            except TimeoutError:
                pass

    def _calls(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """The admin API calls the current screen needs: name → (path, params)."""
        name = SCREENS[self.screen].name
        calls: dict[str, tuple[str, dict[str, Any]]] = {"status": ("/api/v1/status", {})}
        if name == "Overview":
            midnight = time.mktime((*time.localtime()[:3], 0, 0, 0, 0, 0, -1))
            calls["nodes"] = ("/api/v1/nodes", {})
            calls["models"] = ("/api/v1/models", {})
            calls["usage"] = ("/api/v1/usage", {"last": 1000})
            calls["today"] = ("/api/v1/usage/summary", {"by": "model", "since": f"{midnight:.0f}"})
        elif name == "Models":
            calls["models"] = ("/api/v1/models", {})
        elif name == "Nodes":
            calls["nodes"] = ("/api/v1/nodes", {})
        elif name == "Replicas":
            calls["replicas"] = ("/api/v1/replicas", {})
        elif name == "Keys":
            calls["keys"] = ("/api/v1/keys", {})
            calls["usage_by_key"] = (
                "/api/v1/usage/summary",
                {"by": "key", "since": self.usage_period},
            )
            calls["tree"] = ("/api/v1/tree", {})
        elif name == "Logs":
            calls["nodes"] = ("/api/v1/nodes", {})
            calls["replicas"] = ("/api/v1/replicas", {})
            node, source = self.log_source
            if node and (self.log_follow or not self.log_lines):
                calls["logs"] = (
                    "/api/v1/logs",
                    {"node": node, "source": source, "lines": LOG_LINES},
                )
        elif name == "Settings":
            calls["config"] = ("/api/v1/config", {})
            if self.settings_history:
                calls["config_history"] = ("/api/v1/config/history", {"last": 50})
        return calls

    async def refresh(self) -> None:
        """One refresh: the current screen's calls at once; an unreachable
        control plane sets :attr:`down`, a refused call is shown in the panel."""
        calls = self._calls()
        spent: list[float] = []

        async def one(path: str, params: dict[str, Any]) -> Any:
            started = time.perf_counter()
            try:
                return await asyncio.wait_for(
                    self.client.call("GET", path, params=params), REFRESH_CALL_TIMEOUT_S
                )
            except TimeoutError:
                raise AdminUnreachable(
                    f"the admin API at {self.client.base_url} did not answer {path} "
                    f"within {REFRESH_CALL_TIMEOUT_S:.0f} s"
                ) from None
            finally:
                spent.append(time.perf_counter() - started)

        answers = await asyncio.gather(
            *(one(path, params) for path, params in calls.values()), return_exceptions=True
        )
        self.refreshes += 1
        unreachable = [a for a in answers if isinstance(a, AdminUnreachable)]
        if unreachable:
            if self.down is None:
                self.down_since = time.time()
            self.down = str(unreachable[0])
            self.app.invalidate()
            return
        self.refresh_stats.append(sum(spent))
        self.down = None
        self.down_since = None
        self.last_ok = time.time()
        for name, answer in zip(calls, answers, strict=True):
            if isinstance(answer, AdminRefused):
                self.refused[name] = answer.detail
            elif isinstance(answer, BaseException):
                self.refused[name] = f"{type(answer).__name__}: {answer}"
                log.debug("refresh %s", name, exc_info=answer)
            else:
                self.refused.pop(name, None)
                self.data[name] = answer
                if name == "logs":
                    self.log_lines = list(answer.get("lines", []))
        if SCREENS[self.screen].name == "Logs" and not self.log_source[0]:
            sources = self.log_sources()
            if sources:
                self.log_source = sources[0]
                self.poke()
        self.app.invalidate()

    # --- what is drawn ----------------------------------------------------------------

    def panel(self) -> Panel:
        """The current screen's panel."""
        name = SCREENS[self.screen].name
        if name == "Overview":
            panel = render_overview(self.data)
        elif name == "Models":
            panel = render_models(self.data)
        elif name == "Nodes":
            panel = render_nodes(self.data)
        elif name == "Replicas":
            panel = render_replicas(self.data)
        elif name == "Keys":
            panel = render_keys(self.data, self.usage_period)
        elif name == "Logs":
            node, source = self.log_source
            panel = Panel()
            panel.add(
                f"{node or '?'} / {source or 'agent'}"
                f"{'  following' if self.log_follow else '  paused (f follows)'}",
                "class:header",
            )
            rest = render_logs(self.log_lines, self.log_filter)
            panel.lines.extend(rest.lines)
        elif name == "Settings":
            panel = render_settings(self.data, self.settings_history)
        else:
            panel = render_manual(self.pages, self.manual_page)
        for call, message in self.refused.items():
            if call in self._calls():
                panel.lines.insert(0, [("class:error", f"{call}: {message}")])
                panel.items = [(line + 1, item) for line, item in panel.items]
        return panel

    def panel_text(self) -> str:
        """The current panel as plain text (for tests and captures)."""
        return self.panel().text()

    def selected_item(self) -> Any:
        """The item under the selection on the current screen, or None."""
        items = self.panel().items
        if not items:
            return None
        at = min(self.selected.get(self.screen, 0), len(items) - 1)
        return items[at][1]

    def _panel_fragments(self) -> StyleAndTextTuples:
        panel = self.panel()
        selected_line = -1
        if panel.items:
            at = min(self.selected.get(self.screen, 0), len(panel.items) - 1)
            selected_line = panel.items[at][0]
        out: StyleAndTextTuples = []
        for index, line in enumerate(panel.lines):
            for style, text in line:
                out.append((style + (" class:selected" if index == selected_line else ""), text))
            out.append(("", "\n"))
        if out:
            out.pop()
        return out

    def _cursor(self) -> Point:
        panel = self.panel()
        name = SCREENS[self.screen].name
        if name == "Logs":
            last = max(0, len(panel.lines) - 1)
            return Point(0, last if self.log_follow else min(self.log_line, last))
        if name == "Manual" and self.manual_page is not None:
            return Point(0, min(self.manual_line, max(0, len(panel.lines) - 1)))
        if panel.items:
            at = min(self.selected.get(self.screen, 0), len(panel.items) - 1)
            return Point(0, panel.items[at][0])
        return Point(0, 0)

    def _title(self) -> StyleAndTextTuples:
        base = f" llmgw console  {self.client.base_url.removeprefix('http://')}"
        if self.down is not None:
            since = time.strftime("%H:%M:%S", time.localtime(self.down_since or time.time()))
            return [
                (
                    "class:title.down",
                    f" CONTROL PLANE NOT ANSWERING since {since}; retrying every "
                    f"{self.refresh_s:g} s: {self.down}",
                )
            ]
        if self.last_ok is None:
            return [("class:title", f"{base}  connecting…")]
        leader = "leader" if (self.data.get("status") or {}).get("leader") else "standby"
        api_ms = self.refresh_stats[-1] * 1000 if self.refresh_stats else 0.0
        when = time.strftime("%H:%M:%S", time.localtime(self.last_ok))
        notice = f"  {self.notice}" if self.notice else ""
        return [("class:title", f"{base}  {leader}  updated {when} ({api_ms:.0f} ms){notice}")]

    def _sidebar(self) -> StyleAndTextTuples:
        out: StyleAndTextTuples = []
        for index, screen in enumerate(SCREENS):
            style = "class:sidebar.current" if index == self.screen else ""
            out.append((style, f" {screen.key} {screen.name:<9}"[:12].ljust(12) + "\n"))
        return out

    def _frame_title(self) -> str:
        screen = SCREENS[self.screen]
        if screen.name == "Manual" and self.manual_page is not None:
            return f"{screen.name}: {self.manual_page.name}"
        return f"{screen.name} = {screen.cli}"

    def _keybar(self) -> StyleAndTextTuples:
        if self.dialog is not None:
            hint = {
                "confirm": " y yes  n/Esc no",
                "message": " Enter/Esc close",
                "form": " Tab next field  Enter send  Esc cancel",
            }[self.dialog.kind]
            return [("class:keybar", hint)]
        if self.filter_active:
            return [("class:keybar", " type to filter  Enter/Esc done")]
        return [("class:keybar", keybar_line(SCREENS[self.screen].help))]

    def _dialog_container(self) -> AnyContainer:
        dialog = self.dialog
        if dialog is None:
            return Window(width=0, height=0)
        rows: list[AnyContainer] = [
            Window(FormattedTextControl(dialog.text), dont_extend_height=True, wrap_lines=True)
        ]
        for label, area in dialog.fields:
            rows.append(VSplit([Window(FormattedTextControl(f"{label}: "), width=14), area]))
        return Frame(HSplit(rows, width=60), title=dialog.title, style="class:dialog")

    # --- dialogs ---------------------------------------------------------------------

    def _open(self, dialog: _Dialog) -> Any:
        self.dialog = dialog
        if dialog.fields:
            self.app.layout.focus(dialog.fields[0][1])
        self.app.invalidate()
        return dialog.future

    def _close(self, result: Any) -> None:
        dialog = self.dialog
        if dialog is None:
            return
        self.dialog = None
        try:
            self.app.layout.focus(self._panel_window)
        except ValueError:
            pass
        if not dialog.future.done():
            dialog.future.set_result(result)
        self.app.invalidate()

    async def confirm(self, title: str, text: str) -> bool:
        """Ask yes or no; ``True`` for yes."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        return bool(await self._open(_Dialog(title, text, "confirm", future)))

    async def message(self, title: str, text: str) -> None:
        """Show ``text`` until Enter or Esc."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._open(_Dialog(title, text, "message", future))

    async def form(
        self, title: str, text: str, fields: Sequence[tuple[str, str]]
    ) -> list[str] | None:
        """Ask for ``fields`` (label, default); their texts, or None if cancelled."""
        future: asyncio.Future[list[str] | None] = asyncio.get_running_loop().create_future()
        areas = [(label, TextArea(text=default, multiline=False)) for label, default in fields]
        for _, area in areas:
            area.buffer.cursor_position = len(area.text)
        result = await self._open(_Dialog(title, text, "form", future, areas))
        return None if result is None else list(result)

    # --- actions ---------------------------------------------------------------------

    def _spawn(self, action: Callable[[], Awaitable[None]]) -> None:
        async def guarded() -> None:
            try:
                await action()
            except AdminRefused as exc:
                await self.message("Refused", exc.detail)
            except AdminUnreachable as exc:
                await self.message("No answer", str(exc))
            finally:
                self.poke()

        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, path: str, body: Any = None) -> Any:
        return await self.client.call("POST", path, json=body)

    async def scale(self, model: dict[str, Any]) -> None:
        name = model["name"]
        wanted = model.get("replicas", {}).get("wanted", 0)
        got = await self.form(
            f"Scale {name}",
            f"= llmgw ctl scale {name} N",
            [("replicas", str(wanted))],
        )
        if got is None:
            return
        try:
            replicas = int(got[0])
        except ValueError:
            await self.message("Not a number", f"{got[0]!r} is not a whole number of replicas.")
            return
        await self._post(f"/api/v1/models/{_part(name)}/scale", {"replicas": replicas})
        self.notice = f"{name} scaled to {replicas}"

    async def stop_start(self, model: dict[str, Any]) -> None:
        name = model["name"]
        verb = "start" if model.get("stopped") else "stop"
        if await self.confirm(f"{verb.capitalize()} {name}?", f"= llmgw ctl model {verb} {name}"):
            await self._post(f"/api/v1/models/{_part(name)}/{verb}")
            self.notice = f"{name}: {verb}"

    async def restart(self, model: dict[str, Any]) -> None:
        name = model["name"]
        if not await self.confirm(
            f"Restart {name}?",
            f"Its replicas stop, then start again\n"
            f"(= llmgw ctl model stop {name}; llmgw ctl model start {name})",
        ):
            return
        await self._post(f"/api/v1/models/{_part(name)}/stop")
        for _ in range(120):
            view = await self.client.call("GET", f"/api/v1/models/{_part(name)}")
            counts = view.get("replicas", {})
            if not counts.get("ready") and not counts.get("starting"):
                break
            await asyncio.sleep(0.5)
        await self._post(f"/api/v1/models/{_part(name)}/start")
        self.notice = f"{name} restarted"

    async def context(self, model: dict[str, Any]) -> None:
        name = model["name"]
        got = await self.form(
            f"Context of {name}",
            f"= llmgw ctl model context {name} TOKENS (its replicas restart)",
            [("tokens", "")],
        )
        if got is None or not got[0].strip():
            return
        try:
            tokens = int(got[0])
        except ValueError:
            await self.message("Not a number", f"{got[0]!r} is not a whole number of tokens.")
            return
        await self._post(f"/api/v1/models/{_part(name)}/context", {"tokens": tokens})

    async def remove(self, model: dict[str, Any], purge: bool) -> None:
        name = model["name"]
        files = " and its weights files" if purge else ""
        command = f"llmgw ctl model remove {name}{' --purge' if purge else ''}"
        if await self.confirm(
            f"Remove {name}?", f"The model{files} go; its replicas stop.\n= {command}"
        ):
            await self.client.call(
                "DELETE", f"/api/v1/models/{_part(name)}", params={"purge": 1} if purge else {}
            )
            self.notice = f"{name} removed"

    async def serve(self) -> None:
        got = await self.form(
            "Serve a model",
            "= llmgw ctl model add NAME --engine E --source S --replicas N\n"
            "  --context T --min-memory-gb G (host memory to hold, for a CPU model)",
            [
                ("name", ""),
                ("source", ""),
                ("engine", "llamacpp"),
                ("replicas", "1"),
                ("context", "4096"),
                ("memory GB", ""),
            ],
        )
        if got is None:
            return
        name, source, engine, replicas_text, context_text, memory_text = (g.strip() for g in got)
        try:
            replicas, context_tokens = int(replicas_text), int(context_text)
            memory_gb = float(memory_text) if memory_text else None
        except ValueError:
            await self.message(
                "Not a number", "replicas and context are whole numbers, memory GB a number."
            )
            return
        plan = None
        if self.plan_text is not None and source:
            nodes = (await self.client.call("GET", "/api/v1/nodes"))["data"]
            try:
                plan = self.plan_text(source, context_tokens, nodes)
            except (OSError, ValueError) as exc:
                plan = f"no plan: {exc}"
        text = (plan or "(no plan: the source is not a file on this machine)") + "\n\nAdd it?"
        if not await self.confirm(f"Serve {name}", text):
            return
        profile: dict[str, Any] = {
            "name": "default",
            "engine": engine,
            "replicas": replicas,
            "context_tokens": context_tokens,
        }
        if memory_gb is not None:
            profile["min_memory_gb"] = memory_gb
        entry: dict[str, Any] = {"name": name, "profiles": [profile]}
        if source:
            entry["source"] = source
        await self._post("/api/v1/models", entry)
        self.notice = f"{name} added"

    async def cordon(self, node: dict[str, Any], action: str) -> None:
        node_id = node["node_id"]
        if action == "cordon" and (node.get("cordoned") or node.get("draining")):
            action = "uncordon"
        if await self.confirm(
            f"{action.capitalize()} {node_id}?", f"= llmgw ctl {action} {node_id}"
        ):
            await self._post(f"/api/v1/nodes/{_part(node_id)}/{action}")
            self.notice = f"{node_id}: {action}"

    async def create_key(self) -> None:
        got = await self.form(
            "Create a key",
            "= llmgw keys create NAME --project ORG/TEAM/PROJECT",
            [("name", ""), ("project", "")],
        )
        if got is None:
            return
        body: dict[str, Any] = {"name": got[0].strip()}
        if got[1].strip():
            body["project"] = got[1].strip()
        made = await self._post("/api/v1/keys", body)
        await self.message(
            "The new key (shown once)",
            f"{made['key']}\n\nCopy it now: it is not shown again. Id {made.get('id', '?')}.",
        )

    async def revoke_key(self, key: dict[str, Any]) -> None:
        if key.get("tree"):
            self.notice = "v revokes a key: select a key's line"
            return
        if await self.confirm(
            f"Revoke {key['name']}?", f"Refused at once.\n= llmgw keys revoke {key['id']}"
        ):
            await self._post(f"/api/v1/keys/{_part(key['id'])}/revoke")
            self.notice = f"{key['id']} revoked"

    async def rotate_key(self, key: dict[str, Any]) -> None:
        if key.get("tree"):
            self.notice = "o rotates a key: select a key's line"
            return
        if await self.confirm(
            f"Rotate {key['name']}?",
            f"A new secret; the old one is refused.\n= llmgw keys rotate {key['id']}",
        ):
            made = await self._post(f"/api/v1/keys/{_part(key['id'])}/rotate")
            await self.message("The new secret (shown once)", f"{made['key']}\n\nCopy it now.")

    async def key_limits(self, key: dict[str, Any]) -> None:
        """rpm and tpm of one key (empty: inherited from its project); on a
        project's line of the tree, the limits of one of its levels."""
        if key.get("tree"):
            await self.tree_limits(key)
            return
        limits = key.get("limits") or {}

        def shown(value: Any) -> str:
            return "" if value is None else str(value)

        got = await self.form(
            f"Limits of {key['name']}",
            f"Empty: as its project says.\n"
            f"= llmgw keys limits --scope key --id {key['id']} --rpm N --tpm N",
            [("rpm", shown(limits.get("rpm"))), ("tpm", shown(limits.get("tpm")))],
        )
        if got is None:
            return
        try:
            body = {
                name: (int(text) if text.strip() else None)
                for name, text in zip(("rpm", "tpm"), got, strict=True)
            }
        except ValueError:
            await self.message("Not a number", "rpm and tpm are whole numbers, or empty.")
            return
        await self.client.call("PUT", f"/api/v1/limits/key/{_part(key['id'])}", json=body)
        self.notice = f"{key['id']}: limits set"

    async def tree_limits(self, project: dict[str, Any]) -> None:
        """The limits of the org, team or project of a project's line:
        rpm, tpm, budgets per day and month (currency units); empty clears
        one (the level above then decides)."""
        path = str(project.get("path", ""))
        parts = path.split("/")
        got = await self.form(
            f"Limits of {path}",
            "Which level: org, team or project?",
            [("level", "project")],
        )
        if got is None:
            return
        level = got[0].strip().lower()
        if level not in _LEVELS:
            await self.message("No such level", f"{level!r}: the levels are org, team, project.")
            return
        ident = "/".join(parts[: _LEVELS.index(level) + 1])
        limits = (project.get("limits") or {}).get(level) or {}
        fields = ("rpm", "tpm", "budget_day", "budget_month")
        got = await self.form(
            f"Limits of {level} {ident}",
            "Empty: cleared (the level above decides).\n"
            f"= llmgw keys limits --scope {level} --id {ident} --rpm N --tpm N "
            "--budget X/day",
            [(name, "" if limits.get(name) is None else str(limits[name])) for name in fields],
        )
        if got is None:
            return
        body: dict[str, Any] = {}
        for name, text in zip(fields, got, strict=True):
            text = text.strip()
            if not text:
                body[name] = None
            elif name in ("rpm", "tpm"):
                try:
                    body[name] = int(text)
                except ValueError:
                    await self.message("Not a number", f"{name} is a whole number, or empty.")
                    return
            else:
                body[name] = text
        await self.client.call(
            "PUT",
            f"/api/v1/limits/{level}/{'/'.join(_part(p) for p in ident.split('/'))}",
            json=body,
        )
        self.notice = f"{level} {ident}: limits set"

    async def edit_setting(self, path: str) -> None:
        doc = (self.data.get("config") or {}).get("document") or {}
        value: Any = doc
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        got = await self.form(
            f"Set {path}",
            f"A JSON value (a bare word is a string).\n= llmgw ctl config set {path} VALUE",
            [("value", json.dumps(value))],
        )
        if got is None:
            return
        try:
            new = json.loads(got[0])
        except ValueError:
            new = got[0]
        try:
            answer = await self.client.call(
                "PATCH", "/api/v1/config", json={"key": path, "value": new}
            )
        except AdminRefused as exc:
            await self.message(f"Refused: {path}", exc.detail)
            return
        restart = answer.get("restart_needed")
        self.notice = f"{path} set (version {answer.get('version')})" + (
            f"; restart needed for {', '.join(restart)}" if restart else ""
        )

    # --- logs --------------------------------------------------------------------

    def log_sources(self) -> list[tuple[str, str]]:
        """Every log: each node's agent ``(node, "")``, then each replica's
        shard ``(node, shard id)``."""
        nodes = [n["node_id"] for n in (self.data.get("nodes") or {}).get("data", [])]
        shards = [
            (r["node_id"], r["shard_id"])
            for r in (self.data.get("replicas") or {}).get("data", [])
            if r.get("node_id")
        ]
        return [(n, "") for n in nodes] + shards

    def show_log(self, node: str, shard: str) -> None:
        """Switch to the Logs screen on ``node``'s agent or one shard, following."""
        self.log_source = (node, shard)
        self.log_lines = []
        self.log_follow = True
        self.switch(next(i for i, s in enumerate(SCREENS) if s.name == "Logs"))

    def _filter_changed(self, _: object) -> None:
        self.log_filter = self._filter.text
        self.app.invalidate()

    # --- keys ------------------------------------------------------------------------

    def switch(self, index: int) -> None:
        """Show screen ``index`` and refresh it now."""
        self.screen = index % len(SCREENS)
        self.notice = ""
        self.poke()
        self.app.invalidate()

    def _move(self, delta: int) -> None:
        name = SCREENS[self.screen].name
        if name == "Manual" and self.manual_page is not None:
            self.manual_line = max(0, self.manual_line + delta)
            return
        if name == "Logs":
            last = max(0, len(self.panel().lines) - 1)
            if self.log_follow:
                self.log_follow = False
                self.log_line = last
            self.log_line = max(0, min(last, self.log_line + delta))
            return
        count = len(self.panel().items)
        if count:
            at = self.selected.get(self.screen, 0) + delta
            self.selected[self.screen] = max(0, min(count - 1, at))

    def _bindings(self) -> KeyBindings:
        kb = KeyBindings()
        normal = Condition(lambda: self.dialog is None and not self.filter_active)
        confirm = Condition(lambda: self.dialog is not None and self.dialog.kind == "confirm")
        message = Condition(lambda: self.dialog is not None and self.dialog.kind == "message")
        form = Condition(lambda: self.dialog is not None and self.dialog.kind == "form")
        filtering = Condition(lambda: self.filter_active)

        def on(name: str) -> Filter:
            return Condition(lambda: SCREENS[self.screen].name == name) & normal

        @kb.add("c-c")
        @kb.add("q", filter=normal)
        def _quit(event: KeyPressEvent) -> None:
            event.app.exit()

        for index, screen in enumerate(SCREENS):

            def go(event: KeyPressEvent, index: int = index) -> None:
                self.switch(index)

            kb.add(screen.key, filter=normal)(go)

        @kb.add("tab", filter=normal)
        def _next(event: KeyPressEvent) -> None:
            self.switch(self.screen + 1)

        @kb.add("s-tab", filter=normal)
        def _previous(event: KeyPressEvent) -> None:
            self.switch(self.screen - 1)

        @kb.add("down", filter=normal)
        @kb.add("j", filter=normal)
        def _down(event: KeyPressEvent) -> None:
            self._move(1)

        @kb.add("up", filter=normal)
        @kb.add("k", filter=normal)
        def _up(event: KeyPressEvent) -> None:
            self._move(-1)

        @kb.add("pagedown", filter=normal)
        @kb.add(" ", filter=normal)
        def _page_down(event: KeyPressEvent) -> None:
            self._move(max(1, self._panel_height() - 1))

        @kb.add("pageup", filter=normal)
        def _page_up(event: KeyPressEvent) -> None:
            self._move(-max(1, self._panel_height() - 1))

        # dialogs
        @kb.add("y", filter=confirm)
        @kb.add("enter", filter=confirm)
        def _yes(event: KeyPressEvent) -> None:
            self._close(True)

        @kb.add("n", filter=confirm)
        @kb.add("escape", filter=confirm)
        def _no(event: KeyPressEvent) -> None:
            self._close(False)

        @kb.add("enter", filter=message)
        @kb.add("escape", filter=message)
        def _dismiss(event: KeyPressEvent) -> None:
            self._close(None)

        @kb.add("tab", filter=form)
        def _next_field(event: KeyPressEvent) -> None:
            event.app.layout.focus_next()

        @kb.add("enter", filter=form)
        def _send(event: KeyPressEvent) -> None:
            dialog = self.dialog
            assert dialog is not None
            areas = [area for _, area in dialog.fields]
            current = event.app.layout.current_control
            at = next((i for i, a in enumerate(areas) if a.control is current), len(areas) - 1)
            if at < len(areas) - 1:
                event.app.layout.focus(areas[at + 1])
            else:
                self._close([a.text for a in areas])

        @kb.add("escape", filter=form, eager=True)
        def _cancel(event: KeyPressEvent) -> None:
            self._close(None)

        # Models
        def with_item(action: Callable[[Any], Awaitable[None]]) -> Callable[[KeyPressEvent], None]:
            def handler(event: KeyPressEvent) -> None:
                item = self.selected_item()
                if item is not None:
                    self._spawn(lambda: action(item))

            return handler

        kb.add("s", filter=on("Models"))(with_item(self.scale))
        kb.add("t", filter=on("Models"))(with_item(self.stop_start))
        kb.add("r", filter=on("Models"))(with_item(self.restart))
        kb.add("c", filter=on("Models"))(with_item(self.context))
        kb.add("x", filter=on("Models"))(with_item(lambda m: self.remove(m, purge=False)))
        kb.add("X", filter=on("Models"))(with_item(lambda m: self.remove(m, purge=True)))

        @kb.add("n", filter=on("Models"))
        def _serve(event: KeyPressEvent) -> None:
            self._spawn(self.serve)

        # Nodes
        kb.add("c", filter=on("Nodes"))(with_item(lambda n: self.cordon(n, "cordon")))
        kb.add("d", filter=on("Nodes"))(with_item(lambda n: self.cordon(n, "drain")))

        @kb.add("l", filter=on("Nodes"))
        def _node_log(event: KeyPressEvent) -> None:
            item = self.selected_item()
            if item is not None:
                self.show_log(item["node_id"], "")

        @kb.add("l", filter=on("Replicas"))
        @kb.add("enter", filter=on("Replicas"))
        def _replica_log(event: KeyPressEvent) -> None:
            item = self.selected_item()
            if item is not None:
                self.show_log(item["node_id"], item["shard_id"])

        # Keys
        @kb.add("c", filter=on("Keys"))
        def _create_key(event: KeyPressEvent) -> None:
            self._spawn(self.create_key)

        kb.add("v", filter=on("Keys"))(with_item(self.revoke_key))
        kb.add("o", filter=on("Keys"))(with_item(self.rotate_key))
        kb.add("l", filter=on("Keys"))(with_item(self.key_limits))

        @kb.add("p", filter=on("Keys"))
        def _period(event: KeyPressEvent) -> None:
            at = USAGE_PERIODS.index(self.usage_period)
            self.usage_period = USAGE_PERIODS[(at + 1) % len(USAGE_PERIODS)]
            self.poke()

        # Logs
        @kb.add("/", filter=on("Logs"))
        def _filter(event: KeyPressEvent) -> None:
            self.filter_active = True
            event.app.layout.focus(self._filter)

        @kb.add("enter", filter=filtering)
        @kb.add("escape", filter=filtering, eager=True)
        def _filter_done(event: KeyPressEvent) -> None:
            self.filter_active = False
            event.app.layout.focus(self._panel_window)

        @kb.add("f", filter=on("Logs"))
        def _follow(event: KeyPressEvent) -> None:
            self.log_follow = not self.log_follow
            self.poke()

        def cycle(step: int) -> None:
            sources = self.log_sources()
            if not sources:
                return
            at = sources.index(self.log_source) if self.log_source in sources else -step
            self.log_source = sources[(at + step) % len(sources)]
            self.log_lines = []
            self.poke()

        kb.add("]", filter=on("Logs"))(lambda event: cycle(1))
        kb.add("[", filter=on("Logs"))(lambda event: cycle(-1))

        @kb.add("n", filter=on("Logs"))
        def _next_node(event: KeyPressEvent) -> None:
            nodes = [s for s in self.log_sources() if not s[1]]
            if nodes:
                at = (
                    nodes.index((self.log_source[0], ""))
                    if (self.log_source[0], "") in nodes
                    else -1
                )
                self.log_source = nodes[(at + 1) % len(nodes)]
                self.log_lines = []
                self.poke()

        # Settings
        @kb.add("enter", filter=on("Settings"))
        def _edit(event: KeyPressEvent) -> None:
            item = self.selected_item()
            if item is not None and not self.settings_history:
                self._spawn(lambda: self.edit_setting(item))

        @kb.add("h", filter=on("Settings"))
        def _history(event: KeyPressEvent) -> None:
            self.settings_history = not self.settings_history
            self.poke()

        # Manual
        @kb.add("enter", filter=on("Manual"))
        def _open_page(event: KeyPressEvent) -> None:
            if self.manual_page is None:
                item = self.selected_item()
                if item is not None:
                    self.manual_page = item
                    self.manual_line = 0

        @kb.add("escape", filter=on("Manual"), eager=True)
        def _page_list(event: KeyPressEvent) -> None:
            self.manual_page = None

        return kb

    def _panel_height(self) -> int:
        info = self._panel_window.render_info
        return info.window_height if info is not None else 10


#: The levels of the tenancy tree, top first.
_LEVELS: Final = ("org", "team", "project")


def _part(name: str) -> str:
    return quote(name, safe="")


def keybar_line(help_: str) -> str:
    """The key bar under a screen whose keys are ``help_``: at most 80
    characters (the screen switch keys are left out when they do not fit)."""
    line = f" {help_ + '  ' if help_ else ''}Tab/1-8 screens  q quit"
    if len(line) > KEYBAR_WIDTH:
        line = f" {help_}  q quit"
    return line


#: The key bar fits a terminal this wide.
KEYBAR_WIDTH: Final = 80


async def run_console(
    client: AsyncAdminClient,
    *,
    docs_dir: Path | None = None,
    plan_text: PlanText | None = None,
    refresh_s: float = DEFAULT_REFRESH_S,
) -> None:
    """Run the console in this terminal until the user quits; closes ``client``."""
    async with client:
        await Console(client, docs_dir=docs_dir, plan_text=plan_text, refresh_s=refresh_s).run()

"""``llmgw up``: the control plane, one agent and a model, in one trio process.

The agent still talks to the control plane over the real websocket link on
loopback, so this path runs the same code as a cluster. What it does, saying
so as it goes:

1. opens (creates, migrates) the SQLite store at ``DATA_DIR/llmgw.db``;
2. on first start writes the admin token to ``DATA_DIR/admin-token`` (mode
   0600; it opens the admin API only and is not printed), makes a client key
   for ``/v1``, prints it once and writes it to ``DATA_DIR/client-key`` (mode
   0600), and gives every model without a price of its own
   :data:`~llmgw.app.up_prices.FIRST_START_PRICE` unless ``server.yaml`` names
   ``auth.default_price``; an older llmgw's ``admin-key`` becomes the client
   key (:func:`~llmgw.app.up_files.migrate_admin_key`);
3. checks the model: the starter GGUF assembled into ``DATA_DIR/weights``
   and checked against its published sha256, or the ``--model`` file;
4. starts the control plane and writes the agent token to
   ``DATA_DIR/agent-token`` (mode 0600), then the agent (state in
   ``DATA_DIR/agent``), which registers; the reconciler places the model and
   the agent starts its engine. With ``--no-agent`` (``UpOptions.agent``
   false) no agent runs here: a separate ``llmgw agent --server
   ws://<agent hub>/agent --token-file DATA_DIR/agent-token`` joins instead;
5. says "ready in N s" once the model answers (``GET /ready`` is 200).

SIGINT or SIGTERM: stop taking requests, let those in flight finish (grace
10 s), then stop the engines of the agent run here (a separate agent's
engines keep running; SIGKILL after :data:`ENGINE_STOP_GRACE_S`) while the
usage rows are flushed, and exit. The whole stop is bounded: it returns
within the grace plus :data:`STOP_AFTER_GRACE_S`, whatever is in flight.
A second signal, 2 s or more after the first, stops at once (one Ctrl-C
often arrives twice: the terminal signals the process group and ``uv run``
forwards it).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Final

import attrs
import trio

from llmgw import errors
from llmgw.agent.main import AgentConfig, serve_agent
from llmgw.agent.protocol import ShardState
from llmgw.control.cluster import Cluster
from llmgw.settings import ServerSettings, load_settings
from llmgw.store import ModelRecord, open_store

from .control_plane import Addresses, ServerConfig, serve_control_plane
from .up_files import (
    RUN_FILE,
    ensure_admin_token,
    ensure_client_key,
    migrate_admin_key,
    remove_run_file,
    write_agent_token,
    write_run_file,
)
from .up_models import Say, model_records, set_catalog
from .up_prices import first_start_prices, names_default_price

__all__ = ["UpError", "UpOptions", "run_up"]

log = logging.getLogger("llmgw.up")

#: The in-process agent's state directory, under the data directory.
AGENT_STATE_DIR: Final = "agent"
#: The stop's bound: a signal's stop returns within the grace plus this,
#: in seconds, whatever is in flight (``docs/up.md``, Stopping). What is
#: left of the control plane and the agent then is cancelled; the parts
#: that must finish (a cut stream's last event, the engines' SIGKILL) have
#: their own shorter bounds.
STOP_AFTER_GRACE_S: Final = 4.0
#: After the grace, how long the listeners may take to close (a cut
#: stream's error event gets 1 s), in seconds.
LISTENERS_CLOSE_S: Final = 1.5
#: How long the engines of the agent run here get between SIGTERM and
#: SIGKILL, in seconds (then at most ``REAP_DEADLINE_S`` to be reaped).
ENGINE_STOP_GRACE_S: Final = 1.0
#: How long the agent run here gets to close its link and stop its engines
#: before what is left of it is cancelled, in seconds.
AGENT_STOP_S: Final = 3.0


@attrs.frozen(kw_only=True)
class UpOptions:
    """What ``llmgw up`` was asked for (see ``llmgw up --help``)."""

    data_dir: Path
    listen: str = "127.0.0.1:8080"
    admin_listen: str = "127.0.0.1:9090"
    metrics_listen: str = "127.0.0.1:9091"
    agent_listen: str = "127.0.0.1:7443"
    engine_ports: tuple[int, int] = (20000, 20999)
    engine: str = "llamacpp"
    model: Path | None = None
    model_names: tuple[str, ...] = ()
    config: Path | None = None
    engine_args: tuple[str, ...] = ()
    llamacpp_bin: str | None = None
    context_tokens: int = 4096
    slots: int = 4
    grace_s: float = 10.0
    #: Run an agent in this process (``--no-agent`` turns it off).
    agent: bool = True


def _say_to_stderr(text: str) -> None:
    print(f"llmgw: {text}", file=sys.stderr, flush=True)


async def run_up(options: UpOptions, say: Say = _say_to_stderr) -> None:
    """Run everything until a signal; see the module docstring.

    Raises:
        WeightsMismatch: the starter model's digest is not the published one
            (the file has been deleted).
        FileNotFoundError: ``--model`` names no file.
        ValueError: a bad option (an engine argument that is refused, …).
    """
    started = trio.current_time()
    if options.model is not None and not options.model.expanduser().is_file():
        # Checked before anything is written: a bad start leaves nothing behind.
        raise FileNotFoundError(f"--model {options.model}: no such file")
    data_dir = options.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    config_path = options.config
    if config_path is None and (data_dir / "server.yaml").exists():
        config_path = data_dir / "server.yaml"
    settings = load_settings(config_path)
    if config_path is not None:
        say(f"settings from {config_path}")
    price_given = names_default_price(config_path)
    with _DataDirLock(data_dir):
        models = await model_records(options, data_dir, say)
        source = None if config_path is None else str(config_path)
        await _run_locked(options, settings, price_given, source, data_dir, models, started, say)


async def _run_locked(
    options: UpOptions,
    settings: ServerSettings,
    price_given: bool,
    settings_source: str | None,
    data_dir: Path,
    models: list[ModelRecord],
    started: float,
    say: Say,
) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as root:
        root.start_soon(_serve_signals, stop, root.cancel_scope, say, options.grace_s)
        db_path = data_dir / "llmgw.db"
        async with open_store(str(db_path)) as store:
            say(f"store ready: {db_path}")
            settings = await first_start_prices(store, settings, price_given=price_given, say=say)
            cluster = Cluster()
            config = ServerConfig(
                listen=options.listen,
                admin_listen=options.admin_listen,
                metrics_listen=options.metrics_listen,
                agent_listen=options.agent_listen,
                engine_ports=options.engine_ports,
                grace_s=options.grace_s,
                settings=settings,
                settings_source=settings_source,
            )
            listeners_closed = trio.Event()
            # The agent's link ends before the hub closes: a stop, not a lost link.
            agent_stopped = trio.Event()

            async def control_plane(*, task_status: trio.TaskStatus[Addresses]) -> None:
                try:
                    await serve_control_plane(
                        config,
                        store,
                        cluster,
                        stop,
                        listeners_closed=listeners_closed,
                        agents_stopped=agent_stopped,
                        task_status=task_status,
                    )
                finally:
                    listeners_closed.set()

            async with trio.open_nursery() as cp:
                # Listen first: a start that cannot bind its ports changes nothing.
                addresses: Addresses = await cp.start(control_plane)
                ensure_admin_token(data_dir, say)
                await migrate_admin_key(store, data_dir, say)
                client_key = await ensure_client_key(
                    store, data_dir, settings.auth.max_key_ttl, say
                )
                await set_catalog(store, models, say)
                cluster.poke()
                write_run_file(data_dir, addresses)
                # Removed however this ends, a second signal's hard stop included.
                try:
                    token_path = write_agent_token(data_dir, addresses.agent_token)
                    say(
                        f"control plane listening: API {addresses.base_url}, admin http://{addresses.admin}, "
                        f"metrics http://{addresses.metrics}/metrics"
                    )
                    agent_stop = trio.Event()
                    agent_config = AgentConfig(
                        server_url=f"ws://{addresses.agent_hub}/agent",
                        token=addresses.agent_token,
                        llamacpp_bin=options.llamacpp_bin,
                        owns_engines=True,
                        state_dir=data_dir / AGENT_STATE_DIR,
                        engine_stop_grace_s=ENGINE_STOP_GRACE_S,
                        stop=agent_stop,
                    )

                    async def agent_here(*, task_status: trio.TaskStatus[object]) -> None:
                        try:
                            await serve_agent(agent_config, task_status=task_status)
                        finally:
                            agent_stopped.set()

                    async with trio.open_nursery() as agent:
                        if options.agent:
                            await agent.start(agent_here)
                        else:
                            say(
                                "no agent in this process (--no-agent); start one with:\n"
                                f"  llmgw agent --server ws://{addresses.agent_hub}/agent "
                                f"--token-file {shlex.quote(str(token_path))}"
                            )
                        agent.start_soon(
                            _report_progress,
                            cluster,
                            models[0].name,
                            addresses,
                            client_key,
                            started,
                            say,
                        )
                        await stop.wait()
                        # The stop's bound: whatever is left then is cancelled.
                        cp.cancel_scope.deadline = (
                            trio.current_time() + options.grace_s + STOP_AFTER_GRACE_S
                        )
                        with trio.move_on_after(options.grace_s + LISTENERS_CLOSE_S):
                            await listeners_closed.wait()
                        # No request is left for the engines: they stop while
                        # the control plane writes its usage rows.
                        if options.agent:
                            say("stopping the engines")
                            # Its link closes as a stop, then its engines stop.
                            agent_stop.set()
                            with trio.move_on_after(AGENT_STOP_S):
                                await agent_stopped.wait()
                        agent.cancel_scope.cancel()
                finally:
                    agent_stopped.set()
                    remove_run_file(data_dir)
        say("stopped")
        root.cancel_scope.cancel()


class UpError(errors.StartupError):
    """``llmgw up`` cannot start; the message says why and what to do."""


class _DataDirLock:
    """An exclusive lock on ``DATA_DIR/llmgw.lock`` for as long as ``up`` runs,
    so two ``llmgw up`` never share one store."""

    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / "llmgw.lock"
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            holder = ""
            try:
                holder = f" (pid {json.loads((self._path.parent / RUN_FILE).read_text())['pid']})"
            except (OSError, ValueError, KeyError):
                pass
            raise UpError(
                f"another llmgw up is using {self._path.parent}{holder}; stop it, or pass "
                "another --data-dir"
            ) from None

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


#: A second signal this soon after the first is the same Ctrl-C delivered
#: twice (a terminal signals the process group, and ``uv run`` forwards it).
SAME_SIGNAL_WITHIN_S: Final = 2.0


async def _serve_signals(
    stop: trio.Event, hard: trio.CancelScope, say: Say, grace_s: float
) -> None:
    first_at = 0.0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if not stop.is_set():
                say(
                    f"{signal.Signals(signum).name}: no new requests; "
                    f"finishing those in flight (up to {grace_s:.0f} s); signal again to stop now"
                )
                first_at = trio.current_time()
                stop.set()
            elif trio.current_time() - first_at >= SAME_SIGNAL_WITHIN_S:
                say("second signal: stopping now")
                hard.cancel()
                return


async def _report_progress(
    cluster: Cluster,
    model: str,
    addresses: Addresses,
    key_path: Path,
    started: float,
    say: Say,
) -> None:
    ready_said = False
    banner_said = False
    while True:
        changed = cluster.changed
        ready = any(
            s.state is ShardState.READY for s in cluster.shards.values() if s.model == model
        )
        if ready and not ready_said:
            ready_said = True
            if banner_said:
                say(f"{model} is ready again")
            else:
                banner_said = True
                elapsed_s = trio.current_time() - started
                say(f"ready in {elapsed_s:.1f} s: {model} answers at {addresses.base_url}/v1")
                say(
                    "try it:\n"
                    f"  curl {addresses.base_url}/v1/chat/completions \\\n"
                    f'    -H "Authorization: Bearer $(cat {shlex.quote(str(key_path))})" \\\n'
                    '    -H "Content-Type: application/json" \\\n'
                    f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}\''
                )
        elif not ready:
            ready_said = False
        await changed.wait()

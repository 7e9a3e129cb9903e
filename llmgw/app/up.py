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
5. says "ready in N s" once a request for the model would be answered:
   leading (what ``GET /ready`` asks), the model in the catalog and a
   READY replica of it.

Before any of it, a ``--model`` that is not a GGUF file and, before the
store and the model's check, a listen address that cannot be bound are
refused in one line (:func:`check_listeners`).

SIGINT or SIGTERM: stop taking requests, let those in flight finish (grace
10 s), then stop the engines of the agent run here (a separate agent's
engines keep running; SIGKILL after :data:`ENGINE_STOP_GRACE_S`) while the
usage rows are flushed, and exit. The whole stop is bounded: it returns
within the grace plus :data:`STOP_AFTER_GRACE_S`, whatever is in flight.
A second signal, 2 s or more after the first, stops at once (one Ctrl-C
often arrives twice: the terminal signals the process group and ``uv run``
forwards it); the first signal's line says so, and one sooner is said to
be too soon.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shlex
import signal
import socket
import sys
from pathlib import Path
from typing import Final

import attrs
import trio

from llmgw import errors
from llmgw.agent.main import AgentConfig, serve_agent
from llmgw.control.cluster import Cluster
from llmgw.settings import ServerSettings, load_settings
from llmgw.store import ModelRecord, open_store

from .control_plane import Addresses, ServerConfig, serve_control_plane
from .listen import split_address
from .up_files import (
    RUN_FILE,
    ensure_admin_token,
    ensure_client_key,
    migrate_admin_key,
    remove_run_file,
    write_agent_token,
    write_run_file,
)
from .up_models import Say, check_model_file, model_records, set_catalog
from .up_prices import first_start_prices, names_default_price

__all__ = ["UpError", "UpOptions", "check_listeners", "run_up"]

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
        InvalidInput: ``--model`` is not a GGUF file (llama.cpp).
        UpError: a listen address cannot be bound (a port in use, …).
        ValueError: a bad option (an engine argument that is refused, …).
    """
    started = trio.current_time()
    if options.model is not None:
        # Checked before anything is written: a bad start leaves nothing behind.
        check_model_file(options.engine, options.model)
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
        # Before the slow work (the starter model's check, the store): a
        # port taken by another llmgw is said at once, naming the option.
        check_listeners(options)
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


def check_listeners(options: UpOptions) -> None:
    """Bind (and close at once) a socket on each listen address of
    ``options`` with a fixed port (port 0 is any free one, never taken), as
    the listeners do (``SO_REUSEADDR``), so a port in use is refused before
    anything starts.

    Raises:
        UpError: one line naming the first address that cannot be bound,
            what listens there, the reason and the option that changes it,
            e.g. ``cannot listen on 127.0.0.1:8080 (client API): address
            already in use; is another llmgw running? Use --listen HOST:PORT``.
    """
    listeners = (
        (options.listen, "client API", "--listen"),
        (options.admin_listen, "admin API", "--admin-listen"),
        (options.metrics_listen, "metrics", "--metrics-listen"),
        (options.agent_listen, "agents' hub", "--agent-listen"),
    )
    for address, what, option in listeners:
        try:
            host, port = split_address(address)
        except ValueError:
            raise UpError(f"{option} {address}: not HOST:PORT") from None
        if port == 0:
            continue
        reason = _cannot_bind(host, port)
        if reason is not None:
            raise UpError(f"cannot listen on {address} ({what}): {reason} Use {option} HOST:PORT")


def _cannot_bind(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound for TCP (a sentence, its stop
    included), or ``None`` when it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"unknown host ({exc.strerror})."
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "address already in use; is another llmgw running?"
            return f"{(exc.strerror or errors.describe(exc)).lower()}."
    return None


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
    """Set ``stop`` at the first SIGINT or SIGTERM, saying how the stop goes
    and how to hurry it; cancel ``hard`` at a second one
    :data:`SAME_SIGNAL_WITHIN_S` or more after the first. One sooner is
    taken as the same signal delivered twice, and said so once."""
    first_at = 0.0
    too_soon_said = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            again = "Ctrl-C" if signum == signal.SIGINT else name
            if not stop.is_set():
                say(
                    f"{name}: stopping: no new requests; those in flight get up to "
                    f"{grace_s:g} s; {again} again (after {SAME_SIGNAL_WITHIN_S:g} s) stops at once"
                )
                first_at = trio.current_time()
                stop.set()
                continue
            since_s = trio.current_time() - first_at
            if since_s >= SAME_SIGNAL_WITHIN_S:
                say(f"second {name}: stopping now")
                hard.cancel()
                return
            if not too_soon_said:
                too_soon_said = True
                say(
                    f"{name} {since_s:.1f} s after the first: too soon, taken as the same one "
                    f"(a terminal and `uv run` may both deliver it); to stop at once, {again} "
                    f"again {SAME_SIGNAL_WITHIN_S:g} s or more after the first"
                )


def _answers(cluster: Cluster, model: str) -> bool:
    """Whether a request for ``model`` would be answered now: the control
    plane is ready (leading, as ``GET /ready`` asks), has the model in its
    catalog and a READY replica of it to send the request to."""
    return (
        cluster.is_leader
        and cluster.any_ready()
        and model in cluster.models
        and bool(cluster.ready_endpoints(model))
    )


#: How often :func:`_report_progress` looks again without a change of the
#: cluster (taking the lease or reading the catalog pokes nobody), in seconds.
PROGRESS_POLL_S: Final = 0.2


async def _report_progress(
    cluster: Cluster,
    model: str,
    addresses: Addresses,
    key_path: Path,
    started: float,
    say: Say,
) -> None:
    """Say "ready in N s" once a request for ``model`` would be answered
    (:func:`_answers`), then when it stops and starts being so again."""
    ready_said = False
    banner_said = False
    while True:
        changed = cluster.changed
        ready = _answers(cluster, model)
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
        with trio.move_on_after(PROGRESS_POLL_S):
            await changed.wait()

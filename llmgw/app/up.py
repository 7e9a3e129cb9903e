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

import logging
import shlex
import sys
from pathlib import Path
from typing import Final

import attrs
import trio

from llmgw.agent.main import AgentConfig, serve_agent
from llmgw.control.cluster import Cluster
from llmgw.store import ModelRecord

from .control_plane import Addresses, ServerConfig
from .process import (
    LISTENERS_CLOSE_S,
    SAME_SIGNAL_WITHIN_S,
    STOP_AFTER_GRACE_S,
    Beside,
    DataDirLock,
    Started,
    StartError,
    load_process_settings,
    serve_process,
    serve_signals,
)
from .process import check_listeners as check_addresses
from .up_files import write_agent_token
from .up_models import Say, check_model_file, model_records, set_catalog

__all__ = [
    "LISTENERS_CLOSE_S",
    "SAME_SIGNAL_WITHIN_S",
    "STOP_AFTER_GRACE_S",
    "UpError",
    "UpOptions",
    "check_listeners",
    "run_up",
]

log = logging.getLogger("llmgw.up")

#: The in-process agent's state directory, under the data directory.
AGENT_STATE_DIR: Final = "agent"
#: How long the engines of the agent run here get between SIGTERM and
#: SIGKILL, in seconds (then at most ``REAP_DEADLINE_S`` to be reaped).
ENGINE_STOP_GRACE_S: Final = 1.0
#: How long the agent run here gets to close its link and stop its engines
#: before what is left of it is cancelled, in seconds.
AGENT_STOP_S: Final = 3.0

#: ``llmgw up`` cannot start; the message says why and what to do.
UpError = StartError
# The signals' task, under its older name (tests drive it).
_serve_signals = serve_signals


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
    #: The store's address (``--store``); ``None``: SQLite in ``DATA_DIR/llmgw.db``.
    store: str | None = None


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
    loaded = load_process_settings(data_dir, options.config, say)
    with DataDirLock(data_dir, "llmgw up"):
        # Before the slow work (the starter model's check, the store): a
        # port taken by another llmgw is said at once, naming the option.
        check_listeners(options)
        models = await model_records(options, data_dir, say)
        config = ServerConfig(
            listen=options.listen,
            admin_listen=options.admin_listen,
            metrics_listen=options.metrics_listen,
            agent_listen=options.agent_listen,
            engine_ports=options.engine_ports,
            grace_s=options.grace_s,
            settings=loaded.settings,
            settings_source=None if loaded.source is None else str(loaded.source),
            data_dir=data_dir,
        )
        beside = _AgentBeside(options, data_dir, models, started, say)
        await serve_process(
            config,
            data_dir,
            loaded.price_given,
            beside.beside(),
            say,
            store_address=options.store,
        )


class _AgentBeside:
    """What ``llmgw up`` runs beside its control plane: the catalog of its
    flags, the agent (unless ``--no-agent``) and the "ready" line."""

    def __init__(
        self,
        options: UpOptions,
        data_dir: Path,
        models: list[ModelRecord],
        started: float,
        say: Say,
    ) -> None:
        self._options = options
        self._data_dir = data_dir
        self._models = models
        self._started = started
        self._say = say
        self._agent_stop = trio.Event()
        # The agent's link ends before the hub closes: a stop, not a lost link.
        self._agent_stopped = trio.Event()

    def beside(self) -> Beside:
        return Beside(
            prepare=self._prepare,
            start=self._start,
            stop=self._stop,
            agents_stopped=self._agent_stopped,
        )

    async def _prepare(self, started: Started) -> None:
        await set_catalog(started.store, self._models, self._say)
        started.cluster.poke()

    async def _start(self, started: Started, nursery: trio.Nursery) -> None:
        options, say, addresses = self._options, self._say, started.addresses
        token_path = write_agent_token(self._data_dir, addresses.agent_token)
        say(
            f"control plane listening: API {addresses.base_url}, admin http://{addresses.admin}, "
            f"metrics http://{addresses.metrics}/metrics"
        )
        agent_config = AgentConfig(
            server_url=f"ws://{addresses.agent_hub}/agent",
            token=addresses.agent_token,
            llamacpp_bin=options.llamacpp_bin,
            owns_engines=True,
            state_dir=self._data_dir / AGENT_STATE_DIR,
            engine_stop_grace_s=ENGINE_STOP_GRACE_S,
            stop=self._agent_stop,
            weights_dir=self._data_dir / "weights",
        )

        async def agent_here(*, task_status: trio.TaskStatus[object]) -> None:
            try:
                await serve_agent(agent_config, task_status=task_status)
            finally:
                self._agent_stopped.set()

        if options.agent:
            await nursery.start(agent_here)
        else:
            say(
                "no agent in this process (--no-agent); start one with:\n"
                f"  llmgw agent --server ws://{addresses.agent_hub}/agent "
                f"--token-file {shlex.quote(str(token_path))}"
            )
        nursery.start_soon(
            _report_progress,
            started.cluster,
            self._models[0].name,
            addresses,
            started.client_key,
            self._started,
            say,
        )

    async def _stop(self) -> None:
        # No request is left for the engines: they stop while the control
        # plane writes its usage rows.
        if self._options.agent:
            self._say("stopping the engines")
            # Its link closes as a stop, then its engines stop.
            self._agent_stop.set()
            with trio.move_on_after(AGENT_STOP_S):
                await self._agent_stopped.wait()


def check_listeners(options: UpOptions) -> None:
    """Refuse, before anything starts, a listen address of ``options`` that
    cannot be bound (:func:`llmgw.app.process.check_listeners`).

    Raises:
        UpError: one line naming the first address that cannot be bound,
            what listens there, the reason and the option that changes it,
            e.g. ``cannot listen on 127.0.0.1:8080 (client API): address
            already in use; is another llmgw running? Use --listen HOST:PORT``.
    """
    check_addresses(
        (
            (options.listen, "client API", "--listen"),
            (options.admin_listen, "admin API", "--admin-listen"),
            (options.metrics_listen, "metrics", "--metrics-listen"),
            (options.agent_listen, "agents' hub", "--agent-listen"),
        )
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

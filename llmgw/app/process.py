"""What ``llmgw up`` and ``llmgw server`` share: one control plane run as a
process over a data directory.

- :func:`load_process_settings`: the settings file (``--config``, else
  ``DATA_DIR/server.yaml`` when it exists) and whether it names a price;
- :class:`DataDirLock`: one process per data directory;
- :func:`check_listeners`: a listen address that cannot be bound is refused
  in one line before anything starts;
- :func:`serve_process`: the store, the control plane, the first start's
  files (admin token, client key, prices), ``run.json``, what the command
  runs beside the control plane (:class:`Beside`), the signals and the
  bounded graceful stop (``docs/up.md``, Stopping).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Final

import attrs
import trio

from llmgw import errors
from llmgw.control.cluster import Cluster
from llmgw.settings import ServerSettings, load_settings
from llmgw.store import Store, open_store
from llmgw.store.postgres import describe_address, is_postgres_address, postgres_conninfo

from .control_plane import Addresses, ServerConfig, serve_control_plane
from .listen import split_address
from .up_files import (
    RUN_FILE,
    ensure_admin_token,
    ensure_client_key,
    migrate_admin_key,
    remove_run_file,
    write_run_file,
)
from .up_prices import first_start_prices, names_default_price

__all__ = [
    "LISTENERS_CLOSE_S",
    "SAME_SIGNAL_WITHIN_S",
    "STOP_AFTER_GRACE_S",
    "Beside",
    "DataDirLock",
    "ProcessSettings",
    "Say",
    "StartError",
    "Started",
    "check_listeners",
    "check_store_address",
    "load_process_settings",
    "serve_process",
    "serve_signals",
    "store_where",
]

Say = Callable[[str], None]

#: The stop's bound: a signal's stop returns within the grace plus this,
#: in seconds, whatever is in flight (``docs/up.md``, Stopping). What is
#: left of the control plane and the agent then is cancelled; the parts
#: that must finish (a cut stream's last event, the engines' SIGKILL) have
#: their own shorter bounds.
STOP_AFTER_GRACE_S: Final = 4.0
#: After the grace, how long the listeners may take to close (a cut
#: stream's error event gets 1 s), in seconds.
LISTENERS_CLOSE_S: Final = 1.5
#: A second signal this soon after the first is the same Ctrl-C delivered
#: twice (a terminal signals the process group, and ``uv run`` forwards it).
SAME_SIGNAL_WITHIN_S: Final = 2.0


class StartError(errors.StartupError):
    """``llmgw up`` or ``llmgw server`` cannot start; the message says why
    and what to do."""


@attrs.frozen(kw_only=True)
class ProcessSettings:
    """The settings a process starts from.

    Attributes:
        settings: the settings file's tree (the defaults without one).
        source: the file they came from, ``None`` for the defaults.
        price_given: whether the file names ``auth.default_price``.
    """

    settings: ServerSettings
    source: Path | None
    price_given: bool


def load_process_settings(data_dir: Path, config: Path | None, say: Say) -> ProcessSettings:
    """The settings from ``config``, else ``DATA_DIR/server.yaml`` when it
    exists, else the defaults; says which file.

    Raises:
        SettingsError: the file is not valid settings (a ``ValueError``).
    """
    if config is None and (data_dir / "server.yaml").exists():
        config = data_dir / "server.yaml"
    settings = load_settings(config)
    if config is not None:
        say(f"settings from {config}")
    return ProcessSettings(
        settings=settings, source=config, price_given=names_default_price(config)
    )


def check_listeners(listeners: Iterable[tuple[str, str, str]]) -> None:
    """Bind (and close at once) a socket on each listen address with a fixed
    port (port 0 is any free one, never taken), as the listeners do
    (``SO_REUSEADDR``), so a port in use is refused before anything starts.

    Args:
        listeners: ``(address, what, option)`` each: ``("127.0.0.1:8080",
            "client API", "--listen")``.

    Raises:
        StartError: one line naming the first address that cannot be bound,
            what listens there, the reason and the option that changes it,
            e.g. ``cannot listen on 127.0.0.1:8080 (client API): address
            already in use; is another llmgw running? Use --listen HOST:PORT``.
    """
    for address, what, option in listeners:
        try:
            host, port = split_address(address)
        except ValueError:
            raise StartError(f"{option} {address}: not HOST:PORT") from None
        if port == 0:
            continue
        reason = _cannot_bind(host, port)
        if reason is not None:
            raise StartError(
                f"cannot listen on {address} ({what}): {reason} Use {option} HOST:PORT"
            )


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


class DataDirLock:
    """An exclusive lock on ``DATA_DIR/llmgw.lock`` for as long as the
    process runs, so two control planes never share one store.

    Raises (on enter):
        StartError: another process holds it, named by the command it
            wrote in the lock file ("another llmgw server is using DIR (pid
            N); stop it, or pass another --data-dir").
    """

    def __init__(self, data_dir: Path, command: str = "llmgw up") -> None:
        self._path = data_dir / "llmgw.lock"
        self._command = command
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            command, pid = self._holder()
            holder = f" (pid {pid})" if pid else ""
            raise StartError(
                f"another {command} is using {self._path.parent}{holder}; stop it, or pass "
                "another --data-dir"
            ) from None
        # The holder's command and pid, for the message another command
        # gets (`llmgw up` on a directory `llmgw server` holds).
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(
                self._fd, json.dumps({"command": self._command, "pid": os.getpid()}).encode(), 0
            )
        except OSError:
            pass

    def _holder(self) -> tuple[str, object]:
        """The holder's command and pid from the lock file (``run.json``'s
        pid for a holder that wrote none); "llmgw" when unknown."""
        command, pid = "llmgw", None
        for path in (self._path, self._path.parent / RUN_FILE):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(doc, dict):
                continue
            if command == "llmgw" and isinstance(doc.get("command"), str):
                command = doc["command"]
            if pid is None and isinstance(doc.get("pid"), int):
                pid = doc["pid"]
        return command, pid

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


@attrs.frozen(kw_only=True)
class Started:
    """The control plane of :func:`serve_process`, once it listens and the
    first start's files are written.

    Attributes:
        addresses: where it listens.
        store, cluster: its store and live view.
        client_key: the client key's file (``DATA_DIR/client-key``).
        stop: set by the first signal.
    """

    addresses: Addresses
    store: Store
    cluster: Cluster
    client_key: Path
    stop: trio.Event


@attrs.define(kw_only=True)
class Beside:
    """What a command runs beside its control plane (``llmgw up``: the
    agent and its progress; ``llmgw server``: its progress).

    Attributes:
        prepare: after the first start's files, before ``run.json`` (``up``
            writes its catalog).
        start: starts its tasks in the nursery given, which lives until the
            stop (runs after ``run.json`` is written; ``run.json`` is removed
            however the process ends).
        stop: once the listeners have closed (no request left), before the
            rest of the control plane stops (``up`` stops its engines).
        agents_stopped: given, the agents' hub waits for it (at most
            :data:`~llmgw.app.control_plane.AGENTS_STOP_S`) so that an agent
            of this process ends its link as a stop; set when ``start``'s
            nursery ends, whatever happens.
    """

    prepare: Callable[[Started], Awaitable[None]] | None = None
    start: Callable[[Started, trio.Nursery], Awaitable[None]] | None = None
    stop: Callable[[], Awaitable[None]] | None = None
    agents_stopped: trio.Event | None = None


async def serve_process(
    config: ServerConfig,
    data_dir: Path,
    price_given: bool,
    beside: Beside,
    say: Say,
    *,
    store_address: str | None = None,
) -> None:
    """Run a control plane over ``store_address`` (``None``: SQLite in
    ``DATA_DIR/llmgw.db``) until a signal (the caller holds the
    :class:`DataDirLock`; the data directory keeps the local files either
    way: journal, admin token, client key, CA copy).

    Opens the store (says "store ready"), sets the first start's price
    (:func:`~llmgw.app.up_prices.first_start_prices`), starts
    :func:`serve_control_plane` (listening first: a start that cannot bind
    changes nothing), writes the admin token, moves an older admin key, makes
    the client key, runs ``beside``, writes ``run.json`` and says where it
    listens. The first SIGINT or SIGTERM stops it: requests in flight get
    ``config.grace_s``, then ``beside.stop``; the whole stop returns within
    the grace plus :data:`STOP_AFTER_GRACE_S`. A second signal
    :data:`SAME_SIGNAL_WITHIN_S` or more after the first stops at once.

    Raises:
        StoreError: the store cannot be opened.
        OSError: a listener cannot bind, the data directory cannot be written.
    """
    stop = trio.Event()
    async with trio.open_nursery() as root:
        root.start_soon(serve_signals, stop, root.cancel_scope, say, config.grace_s)
        address = store_address or str(data_dir / "llmgw.db")
        async with open_store(address) as store:
            say(f"store ready: {store_where(address)}")
            settings = await first_start_prices(
                store, config.settings, price_given=price_given, say=say
            )
            config = attrs.evolve(config, settings=settings)
            cluster = Cluster()
            listeners_closed = trio.Event()
            agents_stopped = beside.agents_stopped

            async def control_plane(*, task_status: trio.TaskStatus[Addresses]) -> None:
                try:
                    await serve_control_plane(
                        config,
                        store,
                        cluster,
                        stop,
                        listeners_closed=listeners_closed,
                        agents_stopped=agents_stopped,
                        task_status=task_status,
                    )
                finally:
                    listeners_closed.set()

            async with trio.open_nursery() as cp:
                addresses: Addresses = await cp.start(control_plane)
                ensure_admin_token(data_dir, say)
                await migrate_admin_key(store, data_dir, say)
                client_key = await ensure_client_key(
                    store, data_dir, settings.auth.max_key_ttl, say
                )
                started = Started(
                    addresses=addresses,
                    store=store,
                    cluster=cluster,
                    client_key=client_key,
                    stop=stop,
                )
                if beside.prepare is not None:
                    await beside.prepare(started)
                write_run_file(data_dir, addresses)
                # Removed however this ends, a second signal's hard stop included.
                try:
                    async with trio.open_nursery() as besides:
                        if beside.start is not None:
                            await beside.start(started, besides)
                        await stop.wait()
                        # The stop's bound: whatever is left then is cancelled.
                        cp.cancel_scope.deadline = (
                            trio.current_time() + config.grace_s + STOP_AFTER_GRACE_S
                        )
                        with trio.move_on_after(config.grace_s + LISTENERS_CLOSE_S):
                            await listeners_closed.wait()
                        if beside.stop is not None:
                            await beside.stop()
                        besides.cancel_scope.cancel()
                finally:
                    if agents_stopped is not None:
                        agents_stopped.set()
                    remove_run_file(data_dir)
        say("stopped")
        root.cancel_scope.cancel()


def store_where(address: str) -> str:
    """A store address for messages: a SQLite path as given, a PostgreSQL
    address as its hosts, ports and database, never its password."""
    if is_postgres_address(address):
        return describe_address(postgres_conninfo(address))
    return address


def check_store_address(address: str) -> str:
    """``address`` when it is a store address given without a password.

    A PostgreSQL password never goes on a command line (``ps`` shows it to
    every user): give it in a 0600 passfile (``~/.pgpass``, ``PGPASSFILE``,
    or ``passfile=`` in the address), in ``PGPASSWORD``, or give the whole
    address in the ``LLMGW_STORE`` environment variable instead of
    ``--store``.

    Raises:
        ValueError: the address names a password, or is not one
            :func:`~llmgw.store.open_store` reads.
    """
    from psycopg.conninfo import conninfo_to_dict

    text = address.strip()
    if not text:
        raise ValueError("the store address is empty")
    if is_postgres_address(text):
        params = conninfo_to_dict(postgres_conninfo(text))
        if params.get("password"):
            raise ValueError(
                f"the store address for {describe_address(postgres_conninfo(text))} holds a "
                "password: never put it on a command line; use a 0600 passfile "
                "(~/.pgpass, PGPASSFILE or passfile=…), PGPASSWORD, or LLMGW_STORE"
            )
    return text


async def serve_signals(stop: trio.Event, hard: trio.CancelScope, say: Say, grace_s: float) -> None:
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

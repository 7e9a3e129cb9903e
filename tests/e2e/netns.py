"""Several "machines" on one host, as network namespaces joined by a bridge,
for end-to-end tests of a cluster (``docs/testing-clusters.md``).

:func:`machines` builds N namespaces, each with its own address on a
private ``/24`` (``10.213.X.0/24``, ``X`` random so parallel runs do not
share a subnet), loopback up, and one veth pair whose outer end is a port
of a Linux bridge in the root namespace. The bridge holds no address: the
host has no path into the machines, and the only way to reach them is
through them (``ip netns exec``). Each machine has its own ``HOME``, data
directory and XDG directories under the test's folder; the processes a
test starts there write to a log file each, printed when the ``with`` block
ends with an exception.

Everything made is removed on the way out, after a failure or Ctrl-C too:
the processes left in each namespace (``ip netns pids``; SIGTERM, then
SIGKILL after :data:`STOP_GRACE_S`), the namespaces, the veths, the
bridge. What a killed run left behind is removed by
``python tests/e2e/netns.py clean`` (only what runs whose process is gone
made).

Names: a run has a tag of 6 hex digits; its namespaces are
``llmgw-e2e-<pid>-<tag>-<machine>``, its bridge ``lgw<tag>br`` (with the
alias ``llmgw-e2e <pid>``), the outer veth of machine ``i`` ``lgw<tag>h<i>``;
inside a machine the interface is ``eth0``.

Needs root and ``ip`` (iproute2); :func:`skip_reason` says why not.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Final, TypeVar

__all__ = [
    "NETNS_PREFIX",
    "STOP_GRACE_S",
    "Machine",
    "Network",
    "Process",
    "clean_leftovers",
    "machines",
    "skip_reason",
    "wait_for",
]

T = TypeVar("T")

#: Every namespace a run makes starts with this.
NETNS_PREFIX: Final = "llmgw-e2e-"
#: Seconds a process left in a namespace gets between SIGTERM and SIGKILL.
STOP_GRACE_S: Final = 5.0
#: Seconds one ``ip`` command may take.
IP_TIMEOUT_S: Final = 30.0
#: Lines of each log printed after a failure.
LOG_TAIL_LINES: Final = 200
#: Environment variables a machine's processes inherit from the test.
_INHERITED: Final = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONHASHSEED", "LLMGW_TEST_RUN")


def skip_reason() -> str:
    """Why the harness cannot run here ("" when it can): not root, or no ``ip``."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for command in ("ip", "ss"):
        if shutil.which(command) is None:
            return f"the {command} command (iproute2) is not installed"
    return ""


def wait_for(
    predicate: Callable[[], T | None], timeout_s: float, what: str, *, interval_s: float = 0.5
) -> T:
    """Call ``predicate`` until it returns something true, and return that.

    Raises:
        AssertionError: not within ``timeout_s`` seconds (``what`` says what
            was awaited).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = predicate()
        if found:
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(interval_s)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` to completion.

    Raises:
        RuntimeError: it failed and ``check`` (its stderr in the message).
    """
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


class Process:
    """A process started in a machine (its own session and process group).

    Attributes:
        name: its name in the logs.
        popen: the process (``ip netns exec`` execs the command, so its pid
            is the command's).
        log_path: where its stdout and stderr go.
    """

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        """Its output so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send ``sig``, wait up to ``timeout_s`` for it to end, then SIGKILL
        its process group; its exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                return self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.wait()


class Machine:
    """One namespace: its name, address and folders.

    Attributes:
        name: the machine's short name (``a``, ``b`` …).
        index: its place in the network (0-based).
        netns: the namespace's name.
        address: its IPv4 address on the bridge.
        root: its folder; ``home``, ``data_dir`` and the logs are in it.
        home: its ``HOME`` (the XDG directories are under it).
        data_dir: its ``LLMGW_DATA_DIR``.
    """

    def __init__(self, network: Network, name: str, index: int, address: str, root: Path) -> None:
        self._network = network
        self.name = name
        self.index = index
        self.netns = f"{network.netns_prefix}{name}"
        self.address = address
        self.root = root
        self.home = root / "home"
        self.data_dir = root / "data"
        self.veth_outer = f"lgw{network.tag}h{index}"
        self.processes: list[Process] = []

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of its processes: a few of the test's variables
        (``PATH``, locale), its own ``HOME``, XDG directories and
        ``LLMGW_DATA_DIR``, then ``extra``."""
        env = {name: os.environ[name] for name in _INHERITED if name in os.environ}
        env.update(
            HOME=str(self.home),
            XDG_DATA_HOME=str(self.home / ".local" / "share"),
            XDG_STATE_HOME=str(self.home / ".local" / "state"),
            XDG_CONFIG_HOME=str(self.home / ".config"),
            XDG_CACHE_HOME=str(self.home / ".cache"),
            LLMGW_DATA_DIR=str(self.data_dir),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra or {})
        return env

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def start(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> Process:
        """Start ``argv`` in this machine, in its own session, with
        :meth:`env` (plus ``env``) and the machine's folder as working
        directory; stdout and stderr go to ``<root>/<name>.log`` (appended:
        a name started twice keeps one log)."""
        log_path = self.root / f"{name}.log"
        with log_path.open("ab") as out:
            popen = subprocess.Popen(
                self._argv(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(env),
                cwd=self.root,
                start_new_session=True,
            )
        process = Process(f"{self.name}/{name}", popen, log_path)
        self.processes.append(process)
        return process

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in this machine to completion (output captured as text).

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (it is killed).
            subprocess.CalledProcessError: it failed and ``check``.
        """
        return subprocess.run(
            self._argv(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=self.env(env),
            cwd=self.root,
            timeout=timeout_s,
            check=check,
        )

    def python(
        self, code: str, *args: str, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``code`` with the project's Python (the test's own) in this machine."""
        return self.run([sys.executable, "-c", code, *args], timeout_s=timeout_s)

    def set_link(self, up: bool) -> None:
        """Plug (``up``) or unplug this machine's cable: its veth's outer end,
        on the bridge, goes up or down. Inside, ``eth0`` keeps its address
        and routes but has no carrier: what it sends is lost, as on a cut
        network, and nothing is refused at once."""
        _ip("link", "set", "dev", self.veth_outer, "up" if up else "down")

    def link_down(self) -> None:
        self.set_link(False)

    def link_up(self) -> None:
        self.set_link(True)

    def pids(self) -> set[int]:
        """The processes in this namespace now (``ip netns pids``)."""
        result = _ip("netns", "pids", self.netns, check=False)
        return {int(word) for word in result.stdout.split() if word.isdigit()}

    def listening(self) -> list[tuple[str, int]]:
        """The TCP sockets listening in this machine: (address, port) each."""
        result = self.run(["ss", "-Hltn"], timeout_s=IP_TIMEOUT_S, check=True)
        found = []
        for line in result.stdout.splitlines():
            words = line.split()
            if len(words) >= 4:
                host, _, port = words[3].rpartition(":")
                found.append((host.strip("[]"), int(port)))
        return found

    def connections(self) -> list[tuple[tuple[str, int], tuple[str, int]]]:
        """The established TCP connections in this machine: (local, peer)
        each, as (address, port)."""
        result = self.run(
            ["ss", "-Htn", "state", "established"], timeout_s=IP_TIMEOUT_S, check=True
        )
        found = []
        for line in result.stdout.splitlines():
            words = line.split()
            if len(words) >= 4:
                ends = []
                for word in words[2:4]:
                    host, _, port = word.rpartition(":")
                    ends.append((host.strip("[]"), int(port)))
                found.append((ends[0], ends[1]))
        return found


class Network:
    """N machines on one bridge; made by :func:`machines`.

    Attributes:
        tag: this run's 6 hex digits (in every name it makes).
        subnet: the machines' ``/24``, as ``10.213.X``.
        bridge: the bridge's name.
        machines: the machines, in order.
    """

    def __init__(self, names: Sequence[str], root: Path) -> None:
        self.tag = secrets.token_hex(3)
        self.netns_prefix = f"{NETNS_PREFIX}{os.getpid()}-{self.tag}-"
        self.subnet = f"10.213.{random.randrange(256)}"
        self.bridge = f"lgw{self.tag}br"
        self.root = root
        self.machines = [
            Machine(self, name, i, f"{self.subnet}.{i + 1}", root / name)
            for i, name in enumerate(names)
        ]

    def __getitem__(self, name: str) -> Machine:
        for machine in self.machines:
            if machine.name == name:
                return machine
        raise KeyError(name)

    def build(self) -> None:
        """Make the bridge, the namespaces, the veths and the folders.

        Raises:
            RuntimeError: an ``ip`` command failed.
        """
        _ip("link", "add", "name", self.bridge, "type", "bridge")
        _ip("link", "set", "dev", self.bridge, "alias", f"llmgw-e2e {os.getpid()}")
        _ip("link", "set", "dev", self.bridge, "up")
        for machine in self.machines:
            for folder in (machine.root, machine.home, machine.data_dir):
                folder.mkdir(parents=True, exist_ok=True)
            inner = f"lgw{self.tag}n{machine.index}"
            _ip("netns", "add", machine.netns)
            _ip("link", "add", machine.veth_outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", "dev", machine.veth_outer, "master", self.bridge)
            _ip("link", "set", "dev", machine.veth_outer, "up")
            _ip("link", "set", "dev", inner, "netns", machine.netns)
            inside = ("-n", machine.netns)
            _ip(*inside, "link", "set", "dev", inner, "name", "eth0")
            _ip(*inside, "addr", "add", f"{machine.address}/24", "dev", "eth0")
            _ip(*inside, "link", "set", "dev", "eth0", "up")
            _ip(*inside, "link", "set", "dev", "lo", "up")

    def processes(self) -> list[Process]:
        return [p for machine in self.machines for p in machine.processes]

    def print_logs(self, out: IO[str] | None = None) -> None:
        """The last :data:`LOG_TAIL_LINES` lines of every process's log."""
        out = out or sys.stdout
        seen: set[Path] = set()
        for process in self.processes():
            if process.log_path in seen:
                continue
            seen.add(process.log_path)
            lines = process.log().splitlines()[-LOG_TAIL_LINES:]
            print(f"===== {process.name} ({process.log_path}) =====", file=out)
            print("\n".join(lines), file=out)

    def teardown(self) -> list[str]:
        """Remove everything :meth:`build` made, whatever is left of it:
        end the processes in each namespace, then the namespaces, the
        veths and the bridge. Returns what could not be removed."""
        problems: list[str] = []
        for machine in self.machines:
            _end_processes(machine.pids())
        for process in self.processes():
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                process.popen.poll()
        for machine in self.machines:
            if machine.netns in _namespaces():
                result = _ip("netns", "del", machine.netns, check=False)
                if result.returncode != 0:
                    problems.append(f"namespace {machine.netns}: {result.stderr.strip()}")
            if _link_exists(machine.veth_outer):
                _ip("link", "del", machine.veth_outer, check=False)
        if _link_exists(self.bridge):
            result = _ip("link", "del", self.bridge, check=False)
            if result.returncode != 0:
                problems.append(f"bridge {self.bridge}: {result.stderr.strip()}")
        return problems


def _end_processes(pids: set[int]) -> None:
    """SIGTERM ``pids``, wait up to :data:`STOP_GRACE_S` for them, SIGKILL the rest."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _alive(pid)}
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X")


def _namespaces() -> set[str]:
    result = _ip("netns", "list", check=False)
    return {line.split()[0] for line in result.stdout.splitlines() if line.strip()}


def _link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


@contextlib.contextmanager
def machines(root: Path, names: Sequence[str] = ("a", "b", "c")) -> Iterator[Network]:
    """A :class:`Network` of one machine per name, folders under ``root``.

    Removed on the way out whatever happens (exceptions, Ctrl-C); when the
    block raised, every log is printed first.

    Raises:
        RuntimeError: an ``ip`` command failed while building (what was
            made is removed first).
    """
    network = Network(names, root)
    try:
        try:
            network.build()
        except RuntimeError as exc:
            raise RuntimeError(
                f"{exc} (namespaces and bridges need CAP_SYS_ADMIN and CAP_NET_ADMIN: "
                "in a container, run it with --privileged)"
            ) from None
        yield network
    except BaseException:
        network.print_logs()
        raise
    finally:
        problems = network.teardown()
        if problems:
            print("netns teardown left: " + "; ".join(problems), file=sys.stderr)


def clean_leftovers() -> list[str]:
    """Remove the namespaces, veths and bridges of runs whose process is
    gone (a killed run); a running run's are left alone. Returns what it removed."""
    removed: list[str] = []
    for name in sorted(_namespaces()):
        if not name.startswith(NETNS_PREFIX):
            continue
        owner = name[len(NETNS_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and _alive(int(owner)):
            continue
        result = _ip("netns", "pids", name, check=False)
        _end_processes({int(w) for w in result.stdout.split() if w.isdigit()})
        _ip("netns", "del", name, check=False)
        removed.append(f"namespace {name}")
    links = json.loads(_ip("-j", "link", "show").stdout or "[]")
    for link in links:
        name = link.get("ifname", "")
        alias = link.get("ifalias", "")
        if not (name.startswith("lgw") and name.endswith("br") and alias.startswith("llmgw-e2e ")):
            continue
        owner = alias.split()[-1]
        if owner.isdigit() and _alive(int(owner)):
            continue
        for port in json.loads(_ip("-j", "link", "show", "master", name).stdout or "[]"):
            _ip("link", "del", port["ifname"], check=False)
            removed.append(f"veth {port['ifname']}")
        _ip("link", "del", name, check=False)
        removed.append(f"bridge {name}")
    return removed


if __name__ == "__main__":
    if sys.argv[1:] != ["clean"]:
        sys.exit("usage: python tests/e2e/netns.py clean  (as root)")
    if reason := skip_reason():
        sys.exit(reason)
    for line in clean_leftovers():
        print("removed", line)

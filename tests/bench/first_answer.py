"""Time to the first answer: from a command's start to the first streamed token.

Run (from a checkout, in its environment)::

    uv run python tests/bench/first_answer.py                # warm: `llmgw up` here, 3 runs
    uv run python tests/bench/first_answer.py --fresh        # a fresh clone, empty HOME and caches

What one run measures: the clock starts when the command starts (``bash -c
CMD`` in its own process group); the script polls ``GET /ready`` on the
client API every 50 ms, then reads the client key file (:data:`KEY_FILE`,
under the run's HOME) and streams a chat completion with the official
``openai`` client; the clock stops at the first chunk with content. Then
the command gets SIGINT (the stop a Ctrl-C makes) and, if it is still there
after :data:`STOP_TIMEOUT_S`, SIGKILL for its whole group. It also notes
when the command printed its first line, and keeps every line it printed
with its time (``--verbose`` shows them).

``--fresh``: a temporary directory holds a new HOME, ``UV_CACHE_DIR`` and a
``git clone`` of this checkout (its committed HEAD); the README's first
command (the first ``sh`` block of its Quick start, read from the clone's
``README.md``) runs there with a plain Debian ``PATH`` (no ``~/.local/bin``)
and no ``PIP_*``, ``UV_*`` or virtualenv variables: a machine that has
``python3`` and ``pip`` and nothing else. The warm runs that follow (``--runs``)
start ``llmgw up`` in that clone as a new shell would, with ``~/.local/bin``
on ``PATH`` (where the first command linked ``llmgw``). The directory is
removed at the end (``--keep`` keeps it).

Without ``--fresh``, the runs start ``--command`` (default ``llmgw up``) in
``--checkout`` (default this one) with this HOME (or ``--home``).

The client API must be free on ``--port`` (``llmgw up``'s default, 8080),
and the admin, metrics and hub ports too; the script says so and stops
otherwise. Prints one line per run (with when the command printed its first line and
when its agent started llama.cpp, ``started llama-server``, and the CPU
seconds the command's process group had used by then: the work before the
engine starts, which the machine's load stretches in wall time but not in
CPU time) and a summary; ``--json`` prints them
as JSON. Load and cores are printed with them (``os.getloadavg()`` before
each run, ``os.cpu_count()``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Final

import httpx
from openai import OpenAI

#: The client key file ``llmgw up`` writes, relative to the run's HOME.
KEY_FILE: Final = Path(".local/share/llmgw/client-key")
#: What a warm run starts: a new shell's ``llmgw up``.
WARM_COMMAND: Final = "llmgw up"
#: The ports ``llmgw up`` listens on by default, checked free before each run.
UP_PORTS: Final = (8080, 9090, 9091, 7443)
MODEL: Final = "gemma-3-270m"
QUESTION: Final = "What is the capital of France?"
#: A run that has not answered by then failed, in seconds.
RUN_TIMEOUT_S: Final = 600.0
#: SIGINT, then this long before SIGKILL, in seconds.
STOP_TIMEOUT_S: Final = 20.0
POLL_S: Final = 0.05
#: The PATH of a plain Debian shell.
DEBIAN_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def readme_first_command(readme: Path) -> str:
    """The first ``sh`` block under ``## Quick start`` in ``readme``, as one line.

    Raises:
        ValueError: no such block.
    """
    text = readme.read_text()
    start = text.find("## Quick start")
    match = re.search(r"```sh\n(.*?)```", text[start:], re.S) if start >= 0 else None
    if match is None:
        raise ValueError(f"{readme}: no sh block under '## Quick start'")
    return match.group(1).replace("\\\n", " ").strip()


def clean_env(home: Path, path: str, cache: Path | None) -> dict[str, str]:
    """An environment for a run: HOME and PATH set, no virtualenv, uv or pip variables."""
    drop = ("VIRTUAL_ENV", "UV_", "PIP_", "PYTHONHOME", "PYTHONPATH", "LLMGW_", "PYENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(HOME=str(home), PATH=path)
    env.pop("XDG_DATA_HOME", None)
    if cache is not None:
        env["UV_CACHE_DIR"] = str(cache)
    return env


def ports_busy(ports: tuple[int, ...]) -> list[int]:
    busy = []
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


def measure(
    command: str, cwd: Path, env: dict[str, str], home: Path, port: int, verbose: bool
) -> dict[str, Any]:
    """One run of ``command``; see the module docstring. Returns the figures
    in seconds from the command's start (``first_line_s``, ``ready_s``,
    ``first_token_s``) and the answer's first chunk."""
    base = f"http://127.0.0.1:{port}"
    load = os.getloadavg()[0]
    lines: list[tuple[float, str]] = []
    started = time.monotonic()
    process = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    engine_cpu_s: list[float] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))
            if "started llama-server" in line and not engine_cpu_s:
                engine_cpu_s.append(group_cpu_s(process.pid))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready_s = _wait_ready(base, process, started, lines)
        cpu_at_ready_s = group_cpu_s(process.pid)
        key = (home / KEY_FILE).read_text().strip()
        client = OpenAI(base_url=f"{base}/v1", api_key=key, timeout=60.0, max_retries=0)
        first_token_s = 0.0
        answer = ""
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=16,
            temperature=0,
            stream=True,
        ):
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content:
                if not first_token_s:
                    first_token_s = time.monotonic() - started
                answer += content
    finally:
        stopped = _stop(process)
        reader.join(timeout=5)
    if verbose:
        for at, line in lines:
            print(f"  {at:7.2f} s  {line}", file=sys.stderr)
    engine_started = [at for at, line in lines if "started llama-server" in line]
    return {
        "command": command,
        "first_line_s": round(lines[0][0], 2) if lines else None,
        "engine_started_s": round(engine_started[0], 2) if engine_started else None,
        "cpu_before_engine_s": round(engine_cpu_s[0], 2) if engine_cpu_s else None,
        "cpu_at_ready_s": round(cpu_at_ready_s, 2),
        "ready_s": round(ready_s, 2),
        "first_token_s": round(first_token_s, 2),
        "answer": answer,
        "stopped_cleanly": stopped,
        "load_1m_before": round(load, 2),
    }


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user and system, children reaped included) of the
    processes in process group ``pgid`` now: the command's work, which the
    machine's load stretches in wall time but not in CPU time."""
    total = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def _wait_ready(
    base: str, process: subprocess.Popen[str], started: float, lines: list[tuple[float, str]]
) -> float:
    with httpx.Client(timeout=1.0) as http:
        while time.monotonic() - started < RUN_TIMEOUT_S:
            if process.poll() is not None:
                tail = "\n".join(line for _, line in lines[-20:])
                raise RuntimeError(f"the command ended (status {process.returncode}):\n{tail}")
            try:
                if http.get(f"{base}/ready").status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
    raise TimeoutError(f"not ready after {RUN_TIMEOUT_S:.0f} s")


def _stop(process: subprocess.Popen[str]) -> bool:
    """SIGINT to the command's group, SIGKILL after :data:`STOP_TIMEOUT_S`;
    True when it ended on SIGINT with status 0."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return False
        except ProcessLookupError:
            process.wait()
    return process.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fresh", action="store_true", help="A fresh clone, HOME and caches.")
    parser.add_argument("--runs", type=int, default=3, help="Warm runs (default 3).")
    parser.add_argument("--command", default=WARM_COMMAND, help="What a warm run starts.")
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--home", type=Path, default=Path.home())
    parser.add_argument("--port", type=int, default=8080, help="The client API's port.")
    parser.add_argument("--keep", action="store_true", help="Keep --fresh's directory.")
    parser.add_argument("--json", action="store_true", help="Print JSON.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Show each run's output.")
    args = parser.parse_args(argv)

    busy = ports_busy(UP_PORTS)
    if busy:
        print(f"ports in use: {busy}; stop what listens there first", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="llmgw-first-")) if args.fresh else None
    try:
        if scratch is not None:
            home, checkout, cache = scratch / "home", scratch / "llmgw", scratch / "uv-cache"
            home.mkdir()
            subprocess.run(
                ["git", "clone", "--quiet", str(args.checkout), str(checkout)], check=True
            )
            first = readme_first_command(checkout / "README.md")
            result = measure(
                first, checkout, clean_env(home, DEBIAN_PATH, cache), home, args.port, args.verbose
            )
            results.append({"case": "fresh", **result})
            _show(results[-1], args.json)
            warm_env = clean_env(home, f"{home}/.local/bin:{DEBIAN_PATH}", cache)
        else:
            home, checkout = args.home, args.checkout
            path = os.environ.get("PATH", DEBIAN_PATH)
            venv = os.environ.get("VIRTUAL_ENV")
            if venv:  # the script's own environment is not the command's
                path = os.pathsep.join(p for p in path.split(os.pathsep) if not p.startswith(venv))
            warm_env = clean_env(home, path, None)
            if "UV_CACHE_DIR" in os.environ:
                warm_env["UV_CACHE_DIR"] = os.environ["UV_CACHE_DIR"]
        for _ in range(args.runs):
            result = measure(args.command, checkout, warm_env, home, args.port, args.verbose)
            results.append({"case": "warm", **result})
            _show(results[-1], args.json)
    finally:
        if scratch is not None and not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        elif scratch is not None:
            print(f"kept {scratch}", file=sys.stderr)
    summary = {"cores": os.cpu_count(), "load_1m_after": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps({"runs": results, **summary}, indent=2))
    else:
        warm = sorted(r["first_token_s"] for r in results if r["case"] == "warm")
        median = f", warm median {warm[len(warm) // 2]:.2f} s" if warm else ""
        print(f"{summary['cores']} cores, load {summary['load_1m_after']} at the end{median}")
    return 0


def _show(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        return
    print(
        f"{result['case']:5} first token {result['first_token_s']:6.2f} s "
        f"(first line {result['first_line_s']} s, engine started {result['engine_started_s']} s "
        f"after {result['cpu_before_engine_s']} CPU s, "
        f"ready {result['ready_s']} s; "
        f"load {result['load_1m_before']}; stopped cleanly: {result['stopped_cleanly']}) "
        f"{result['command']!r}: {result['answer']!r}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())

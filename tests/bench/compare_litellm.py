"""Closed-loop throughput: the sim engine alone, through LiteLLM's proxy, through llmgw.

Run it from the repository root (it is not a pytest test)::

    uv run python tests/bench/compare_litellm.py [--duration-s 10]
        [--concurrency 16,64,128,256] [--out docs/performance.md]

What it does (``tests/bench/README.md`` has the long form):

1. Installs LiteLLM's proxy (``litellm[proxy]==LITELLM_VERSION``, with
   :data:`LITELLM_COMPANIONS`) into its own virtualenv outside the repository
   (``--litellm-venv``, default ``/tmp/llmgw-bench/litellm-venv``) with
   ``uv venv`` and ``uv pip install``, or reuses it when those versions are
   already there. LiteLLM never becomes a dependency of the project.
2. Starts the sim engine (64-token answers at 500 tokens/s per stream).
   With two cores or more the system under test (LiteLLM, or llmgw's
   ``bench gateway``) runs pinned to the first core, and the engine and this
   process (the load generator, :func:`llmgw.bench.load.run_load`) to the
   second.
3. For each concurrency, closed loop, same prompt size and 64-token answers:
   the engine alone, then LiteLLM, then llmgw. Each system under test is
   started fresh for each concurrency and stopped after it, so only one runs
   at a time and none carries state from the previous step. Each run is
   primed for ``--prime-s`` seconds (not counted), then measured with
   ``--warmup-s`` of warm-up and ``--duration-s`` measured seconds.
4. Writes the results, the machine, the versions and the commands to
   ``--out`` (``docs/performance.md``). The sections ``## Where the time
   goes`` and ``## Overhead (llmgw bench overhead)`` are written by people:
   when the file exists, their text is kept as it is.

Everything listens on 127.0.0.1 only; every run is bounded in time.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio

from llmgw.bench.load import LoadConfig, run_load
from llmgw.bench.overhead import _argv, cpu_s, start_bench_gateway, start_sim_engine
from llmgw.bench.results import LoadResult
from llmgw.engines.testing import stop_process

#: The LiteLLM release measured; change it here to measure another.
LITELLM_VERSION: Final = "1.108.7"
#: Installed beside it. LiteLLM's proxy imports OpenTelemetry's SDK in its
#: auth step on every request, and prisma when it checks a failed lookup; with
#: ``litellm[proxy]`` alone those imports fail, and a failed import is not
#: cached, so each request searches ``sys.path`` again (about a sixth of its
#: CPU in a profile). LiteLLM's own extras list them, so a full deployment
#: has them: the OpenTelemetry pins of its ``proxy-runtime`` extra, and a
#: prisma within its ``extra_proxy`` range.
LITELLM_COMPANIONS: Final = {
    "opentelemetry-api": "1.45.1",
    "opentelemetry-sdk": "1.45.1",
    "prisma": "0.15.0",
}
DEFAULT_VENV: Final = Path("/tmp/llmgw-bench/litellm-venv")
DEFAULT_CONCURRENCY: Final = (16, 64, 128, 256)
MODEL: Final = "bench-model"
ENGINE_TOKENS: Final = 64
ENGINE_TOKENS_PER_S: Final = 500
PROMPT_WORDS: Final = 16
HOST: Final = "127.0.0.1"
#: Bounds, in seconds.
INSTALL_TIMEOUT_S: Final = 900.0
LITELLM_START_TIMEOUT_S: Final = 180.0
REQUEST_TIMEOUT_S: Final = 30.0
#: The measured window spans at least this many mean request times (taken
#: from the priming run), and the warm-up at least one. A closed loop starts
#: all its clients at once; when one request takes longer than the window, the
#: requests *started* in the window are few and say little about throughput.
WINDOW_REQUEST_TIMES: Final = 3.0
#: LiteLLM's environment. Its production checklist asks for
#: ``LITELLM_MODE=PRODUCTION`` (no ``.env`` loading); ``LITELLM_LOG=ERROR``
#: keeps uvicorn's access log and LiteLLM's info logs off the hot path; the
#: offline cost map keeps start-up from fetching it over the network.
LITELLM_ENV: Final = {
    "LITELLM_MODE": "PRODUCTION",
    "LITELLM_LOG": "ERROR",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
#: LiteLLM's proxy command-line flags besides the config, host and port.
LITELLM_FLAGS: Final = ("--num_workers", "1")
#: Sections of the output that people write; kept when the file is rewritten.
KEPT_SECTIONS: Final = ("Where the time goes", "Overhead (llmgw bench overhead)")
SYSTEMS: Final = ("engine alone", "LiteLLM", "llmgw")


# -- LiteLLM's virtualenv ------------------------------------------------------------


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _installed_version(venv: Path, package: str) -> str | None:
    python = _venv_python(venv)
    if not python.exists():
        return None
    done = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def ensure_litellm(venv: Path) -> None:
    """Install ``litellm[proxy]==LITELLM_VERSION`` into ``venv``, or reuse it.

    Raises:
        SystemExit: uv is missing or the install failed.
    """
    wanted = {"litellm": LITELLM_VERSION, **LITELLM_COMPANIONS}
    if all(_installed_version(venv, name) == version for name, version in wanted.items()):
        print(f"LiteLLM {LITELLM_VERSION}: reusing {venv}", file=sys.stderr)
        return
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("uv is needed to install LiteLLM into its own virtualenv")
    venv.parent.mkdir(parents=True, exist_ok=True)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"  # llmgw's own minor
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT")}
    steps: list[list[str]] = []
    if not _venv_python(venv).exists():
        steps.append([uv, "venv", "--python", python, str(venv)])
    steps.append(
        [
            uv,
            "pip",
            "install",
            "--python",
            str(_venv_python(venv)),
            f"litellm[proxy]=={LITELLM_VERSION}",
            *(f"{name}=={version}" for name, version in LITELLM_COMPANIONS.items()),
        ]
    )
    for argv in steps:
        print("+ " + " ".join(argv), file=sys.stderr)
        done = subprocess.run(
            argv, cwd=venv.parent, env=env, timeout=INSTALL_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"installing LiteLLM failed: {' '.join(argv)}")


def litellm_config(engine_url: str, engine_key: str, master_key: str) -> str:
    """LiteLLM's proxy config: one model, no database, quiet, a master key.

    The settings are those of LiteLLM's production checklist that apply
    without a database or Redis (``docs/performance.md`` lists them).
    """
    doc = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"{engine_url}/v1",
                    "api_key": engine_key,
                },
            }
        ],
        "general_settings": {
            "master_key": master_key,
            "disable_spend_logs": True,
            "disable_error_logs": True,
        },
        "litellm_settings": {
            "set_verbose": False,
            "request_timeout": 600,
        },
    }
    # JSON is YAML; LiteLLM reads the file with a YAML loader.
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()


# -- processes -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


async def _http_status(port: int, path: str) -> int | None:
    """The status of ``GET path`` on HOST:port, or None when nothing answers."""
    try:
        with trio.fail_after(2.0):
            stream = await trio.open_tcp_stream(HOST, port)
            async with stream:
                await stream.send_all(
                    f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
                )
                head = b""
                while b"\r\n" not in head:
                    data = await stream.receive_some(4096)
                    if not data:
                        return None
                    head += data
                return int(head.split(b" ", 2)[1])
    except (OSError, trio.TooSlowError, trio.BrokenResourceError, ValueError, IndexError):
        return None


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{current}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            todo.extend(int(child) for child in children)
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and the processes under it."""
    total = 0.0
    for each in _descendants(pid):
        try:
            total += cpu_s(each)
        except (OSError, IndexError, ValueError):
            pass
    return total


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and the processes under it, in MiB."""
    total = 0
    for each in _descendants(pid):
        try:
            status = Path(f"/proc/{each}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        if match:
            total += int(match.group(1))
    return total / 1024


@attrs.define
class Sut:
    """A running system under test."""

    name: str
    process: trio.Process
    url: str
    key: str
    log: Path | None = None
    #: Started as a new session: stop its whole process group.
    group: bool = False


async def start_litellm(
    venv: Path, scratch: Path, engine_url: str, engine_key: str, cores: set[int] | None
) -> Sut:
    """Start LiteLLM's proxy and wait until it answers ``/health/liveliness``.

    Raises:
        RuntimeError: it exited or did not answer within LITELLM_START_TIMEOUT_S.
    """
    master_key = "sk-" + secrets.token_hex(24)
    config = scratch / "litellm-config.yaml"
    config.write_text(litellm_config(engine_url, engine_key, master_key))
    port = _free_port()
    log = scratch / f"litellm-{port}.log"
    argv = _argv(
        [
            str(venv / "bin" / "litellm"),
            "--config",
            str(config),
            "--host",
            HOST,
            "--port",
            str(port),
            *LITELLM_FLAGS,
        ],
        cores,
    )
    env = {**os.environ, **LITELLM_ENV}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(name, None)
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(scratch),
            start_new_session=True,
        )
    try:
        with trio.fail_after(LITELLM_START_TIMEOUT_S):
            while await _http_status(port, "/health/liveliness") != 200:
                if process.returncode is not None:
                    raise RuntimeError(f"LiteLLM exited with {process.returncode}: {_tail(log)}")
                await trio.sleep(0.25)
    except trio.TooSlowError:
        await stop_sut_process(process, group=True)
        raise RuntimeError(f"LiteLLM did not start: {_tail(log)}") from None
    except BaseException:
        await stop_sut_process(process, group=True)
        raise
    return Sut("LiteLLM", process, f"http://{HOST}:{port}", master_key, log, group=True)


async def start_llmgw(
    scratch: Path, engine_url: str, engine_key: str, cores: set[int] | None, env: dict[str, str]
) -> Sut:
    """Start ``llmgw bench gateway --mode accounted`` (a key checked and a usage
    row written per request)."""
    data_dir = Path(tempfile.mkdtemp(prefix="llmgw-", dir=scratch))
    process, info = await start_bench_gateway(
        engine_url, engine_key, "accounted", data_dir, cores, env
    )
    return Sut("llmgw", process, f"http://{info['listen']}", info["key"])


async def stop_sut_process(process: trio.Process, *, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after a grace (:func:`stop_process`); with
    ``group``, then SIGKILL whatever is left of its process group (the
    process was started as the leader of a new session)."""
    await stop_process(process)
    if group:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-lines:])


# -- measuring -----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Run:
    """One concurrency through one system."""

    system: str
    concurrency: int
    result: LoadResult
    #: The system under test's CPU seconds / wall seconds in the measured window.
    sut_cores: float | None
    #: (engine + load generator) CPU seconds / wall seconds in the window:
    #: how busy the shared second core was.
    core1_busy: float
    sut_rss_mib: float | None
    start_s: float | None
    #: The warm-up and measured window used (see WINDOW_REQUEST_TIMES).
    warmup_s: float
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "concurrency": self.concurrency,
            "sut_cores": self.sut_cores,
            "core1_busy": self.core1_busy,
            "sut_rss_mib": self.sut_rss_mib,
            "start_s": self.start_s,
            "warmup_s": self.warmup_s,
            "duration_s": self.duration_s,
            "result": self.result.to_json(),
        }


def _config(url: str, key: str, concurrency: int, duration_s: float, warmup_s: float) -> LoadConfig:
    return LoadConfig(
        url=url,
        api_key=key,
        model=MODEL,
        concurrency=concurrency,
        duration_s=duration_s,
        warmup_s=warmup_s,
        prompt_words=PROMPT_WORDS,
        max_tokens=ENGINE_TOKENS,
        include_usage=True,
        request_timeout_s=REQUEST_TIMEOUT_S,
    )


async def measure(
    *,
    system: str,
    url: str,
    key: str,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    prime_s: float,
    engine_pid: int,
    sut_pid: int | None,
    start_s: float | None,
) -> Run:
    """Prime, then one measured closed-loop run; the CPU of the system under
    test, the engine and this process is read at the edges of the measured
    window. The warm-up and the window grow to one and WINDOW_REQUEST_TIMES
    mean request times of the priming run when those are longer."""
    if prime_s > 0:
        primed = await run_load(_config(url, key, concurrency, prime_s, 0.0))
        request_s = primed.total_ms.mean / 1000.0
        warmup_s = math.ceil(max(warmup_s, request_s))
        duration_s = math.ceil(max(duration_s, WINDOW_REQUEST_TIMES * request_s))
    window: dict[str, float] = {}

    async def sample() -> None:
        await trio.sleep(warmup_s)
        window["t0"] = time.monotonic()
        window["sut0"] = tree_cpu_s(sut_pid) if sut_pid is not None else 0.0
        window["eng0"] = cpu_s(engine_pid)
        window["gen0"] = time.process_time()
        await trio.sleep(duration_s)
        window["t1"] = time.monotonic()
        window["sut1"] = tree_cpu_s(sut_pid) if sut_pid is not None else 0.0
        window["eng1"] = cpu_s(engine_pid)
        window["gen1"] = time.process_time()
        window["rss"] = tree_rss_mib(sut_pid) if sut_pid is not None else 0.0

    results: list[LoadResult] = []

    async def load() -> None:
        results.append(await run_load(_config(url, key, concurrency, duration_s, warmup_s)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        nursery.start_soon(load)
    wall = window["t1"] - window["t0"]
    core1 = (window["eng1"] - window["eng0"] + window["gen1"] - window["gen0"]) / wall
    return Run(
        system=system,
        concurrency=concurrency,
        result=results[0],
        sut_cores=(window["sut1"] - window["sut0"]) / wall if sut_pid is not None else None,
        core1_busy=core1,
        sut_rss_mib=window["rss"] if sut_pid is not None else None,
        start_s=start_s,
        warmup_s=warmup_s,
        duration_s=duration_s,
    )


def _show(run: Run) -> None:
    r = run.result
    cpu = f"{run.sut_cores:.2f}" if run.sut_cores is not None else "-"
    print(
        f"c={run.concurrency:<4} {run.system:13} {r.requests_per_s:8.1f} req/s "
        f"{r.tokens_per_s:9.0f} tok/s  TTFT p50 {r.ttft_ms.p50:8.1f} p95 {r.ttft_ms.p95:8.1f} ms "
        f"err {r.errors:<5} SUT CPU {cpu:>5}  core1 {run.core1_busy:.2f}  "
        f"window {run.warmup_s:g}+{run.duration_s:g} s"
        + (f"  ({', '.join(r.error_samples)})" if r.error_samples else ""),
        file=sys.stderr,
        flush=True,
    )


def _cores() -> tuple[set[int] | None, set[int] | None]:
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        return None, None
    return {available[0]}, {available[1]}


async def compare(
    *,
    venv: Path,
    concurrencies: Sequence[int],
    duration_s: float,
    warmup_s: float,
    prime_s: float,
    systems: Sequence[str],
) -> list[Run]:
    """Run the comparison; see the module docstring."""
    sut_cores, engine_cores = _cores()
    if engine_cores is not None:
        os.sched_setaffinity(0, engine_cores)  # the load generator shares the engine's core
    engine_key = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_API_KEY"}
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-compare-") as scratch_name:
        scratch = Path(scratch_name)
        engine, engine_url = await start_sim_engine(engine_key, engine_cores, env)
        try:
            for concurrency in concurrencies:
                for system in systems:
                    if system == "engine alone":
                        run = await measure(
                            system=system,
                            url=engine_url,
                            key=engine_key,
                            concurrency=concurrency,
                            duration_s=duration_s,
                            warmup_s=warmup_s,
                            prime_s=prime_s,
                            engine_pid=engine.pid,
                            sut_pid=None,
                            start_s=None,
                        )
                    else:
                        began = time.monotonic()
                        if system == "LiteLLM":
                            sut = await start_litellm(
                                venv, scratch, engine_url, engine_key, sut_cores
                            )
                        else:
                            sut = await start_llmgw(scratch, engine_url, engine_key, sut_cores, env)
                        started = time.monotonic() - began
                        try:
                            run = await measure(
                                system=system,
                                url=sut.url,
                                key=sut.key,
                                concurrency=concurrency,
                                duration_s=duration_s,
                                warmup_s=warmup_s,
                                prime_s=prime_s,
                                engine_pid=engine.pid,
                                sut_pid=sut.process.pid,
                                start_s=started,
                            )
                        finally:
                            await stop_sut_process(sut.process, group=sut.group)
                        if sut.log is not None and sut.process.returncode not in (0, -15):
                            print(
                                f"{system} exited with {sut.process.returncode}:\n{_tail(sut.log)}",
                                file=sys.stderr,
                            )
                    runs.append(run)
                    _show(run)
        finally:
            await stop_process(engine)
    return runs


# -- the report ----------------------------------------------------------------------


def _first(path: str, pattern: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError:
        return "unknown"
    match = re.search(pattern, text, re.MULTILINE)
    return match.group(1).strip() if match else "unknown"


def machine_facts() -> dict[str, str]:
    """nproc, memory, CPU model, kernel and the load average now."""
    mem_kb = _first("/proc/meminfo", r"^MemTotal:\s+(\d+) kB")
    memory = f"{int(mem_kb) / 1024 / 1024:.1f} GiB" if mem_kb.isdigit() else "unknown"
    load = os.getloadavg()
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "memory": memory,
        "cpu": _first("/proc/cpuinfo", r"^model name\s*:\s*(.+)$"),
        "kernel": f"{platform.system()} {platform.release()} {platform.machine()}",
        "load": f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)",
    }


def versions(venv: Path) -> dict[str, str]:
    """Versions of the pieces measured, in llmgw's environment and LiteLLM's."""

    def ours(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    out = {"python": platform.python_version()}
    for name in ("llmgw", "trio", "hypercorn", "h11"):
        out[name] = ours(name)
    theirs = ("litellm", "uvicorn", "uvloop", "fastapi", "aiohttp", "httpx", *LITELLM_COMPANIONS)
    probe = (
        "import importlib.metadata as m, platform\n"
        "print('python', platform.python_version())\n"
        f"for n in {theirs!r}:\n"
        "    try: print(n, m.version(n))\n"
        "    except m.PackageNotFoundError: print(n, 'not installed')\n"
    )
    done = subprocess.run(
        [str(_venv_python(venv)), "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    for line in done.stdout.splitlines():
        name, _, version = line.partition(" ")
        out[f"{name} (LiteLLM's venv)" if name != "litellm" else name] = version
    return out


def kept_sections(path: Path) -> dict[str, str]:
    """The bodies of KEPT_SECTIONS in an existing report, by heading."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    for part in parts[1:]:
        heading, _, body = part.partition("\n")
        if heading.strip() in KEPT_SECTIONS:
            out[heading.strip()] = body.strip("\n")
    return out


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def results_table(runs: Sequence[Run]) -> str:
    engine = {
        run.concurrency: run.result.requests_per_s for run in runs if run.system == SYSTEMS[0]
    }
    lines = [
        "| clients | system | req/s | share of engine | tok/s | TTFT p50 ms | TTFT p95 ms "
        "| total p50 ms | errors | SUT CPU (cores) | SUT RSS MiB | core 1 busy "
        "| warm-up + window s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        r = run.result
        base = engine.get(run.concurrency)
        share = f"{100 * r.requests_per_s / base:.0f} %" if base else "-"
        cpu = f"{run.sut_cores:.2f}" if run.sut_cores is not None else "-"
        rss = f"{run.sut_rss_mib:.0f}" if run.sut_rss_mib is not None else "-"
        lines.append(
            f"| {run.concurrency} | {run.system} | {r.requests_per_s:.1f} | {share} "
            f"| {r.tokens_per_s:.0f} | {_ms(r.ttft_ms.p50)} | {_ms(r.ttft_ms.p95)} "
            f"| {_ms(r.total_ms.p50)} | {r.errors} | {cpu} | {rss} | {run.core1_busy:.2f} "
            f"| {run.warmup_s:g} + {run.duration_s:g} |"
        )
    return "\n".join(lines)


def errors_text(runs: Sequence[Run]) -> str:
    failing = [run for run in runs if run.result.errors]
    if not failing:
        return "No request failed in any run."
    lines = ["Failed requests, with up to five distinct error strings per run:", ""]
    for run in failing:
        r = run.result
        total = r.requests + r.errors
        lines.append(
            f"- {run.system}, {run.concurrency} clients: {r.errors} of {total} failed "
            f"({', '.join(f'`{s}`' for s in r.error_samples)})"
        )
    return "\n".join(lines)


def _has_bench_load() -> bool:
    """Whether this llmgw has the ``llmgw bench load`` command."""
    try:
        from llmgw.bench.cli import bench
    except ImportError:
        return False
    return "load" in getattr(bench, "commands", {})


def render(
    *,
    runs: Sequence[Run],
    machine: dict[str, str],
    version: dict[str, str],
    args: argparse.Namespace,
    date: str,
    elapsed_s: float,
    kept: dict[str, str],
    pinned: bool,
) -> str:
    concurrency = ",".join(str(c) for c in args.concurrency)
    starts = [run.start_s for run in runs if run.system == "LiteLLM" and run.start_s is not None]
    llmgw_starts = [
        run.start_s for run in runs if run.system == "llmgw" and run.start_s is not None
    ]
    start_note = ""
    if starts and llmgw_starts:
        start_note = (
            f"Start-up, from launch until it serves (LiteLLM: `/health/liveliness` "
            f"answers 200; llmgw: it prints its address): LiteLLM "
            f"{min(starts):.1f}-{max(starts):.1f} s, llmgw "
            f"{min(llmgw_starts):.1f}-{max(llmgw_starts):.1f} s."
        )
    companions = ", ".join(f"`{n}=={v}`" for n, v in LITELLM_COMPANIONS.items())
    install_args = " ".join(
        [f"'litellm[proxy]=={LITELLM_VERSION}'"]
        + [f"{n}=={v}" for n, v in LITELLM_COMPANIONS.items()]
    )
    load_line = (
        "# one load run against any OpenAI-compatible server\n"
        f"uv run llmgw bench load --url http://127.0.0.1:PORT --key KEY --model {MODEL} "
        "--concurrency 64\n"
        if _has_bench_load()
        else ""
    )
    version_rows = "\n".join(f"| {name} | {value} |" for name, value in version.items())
    pin_text = (
        "the system under test is pinned to core 0 (`taskset -c 0`); the sim engine "
        "(`taskset -c 1`) and the load generator (`os.sched_setaffinity(0, {1})`) share core 1"
        if pinned
        else "nothing is pinned (fewer than two cores were available)"
    )
    where = kept.get(
        KEPT_SECTIONS[0],
        "_To be written: where each gateway spends its CPU per request (profiles), "
        "and why the numbers above look the way they do._",
    )
    overhead = kept.get(
        KEPT_SECTIONS[1],
        "_To be filled in from:_\n\n```sh\ncd llmgw && uv run llmgw bench overhead\n```",
    )
    return f"""# Performance

Generated by `tests/bench/compare_litellm.py` on {date} (the run took {elapsed_s / 60:.1f} min).
Rerun it to refresh the tables; the sections "Where the time goes" and
"Overhead (llmgw bench overhead)" are written by hand and are kept on a rerun.

## What is measured

The same closed-loop load against three systems, one at a time, on one machine over
loopback:

- **engine alone**: the sim engine (`python -m llmgw.engines.sim`, {ENGINE_TOKENS}-token
  answers streamed at {ENGINE_TOKENS_PER_S} tokens/s per stream), called directly;
- **LiteLLM**: LiteLLM's proxy (`litellm[proxy]=={LITELLM_VERSION}`, its own virtualenv)
  in front of that engine;
- **llmgw**: `llmgw bench gateway --mode accounted` in front of that engine: the same
  `Gateway` as `llmgw up`, an API key checked on every request and a usage row written
  per request into SQLite by the batching writer.

Load: `llmgw.bench.load.run_load`, a raw-socket HTTP/1.1 client with keep-alive
connections. N clients (N = {concurrency}), each sending its next request as soon as the
previous answer ended: `POST /v1/chat/completions`, `stream: true`,
`stream_options.include_usage`, a {PROMPT_WORDS}-word user message starting with a unique
request number, `max_tokens: {ENGINE_TOKENS}`, a {REQUEST_TIMEOUT_S:g} s deadline per request.

Per concurrency, in this order: the engine alone, then LiteLLM, then llmgw. **Each
system under test is started fresh for each concurrency and stopped after it**, so only
one runs at a time and none carries state (pools, caches, memory) from the step
before; the engine stays up for the whole run. Each run is primed for
{args.prime_s:g} s (not counted), then measured: {args.warmup_s:g} s warm-up, then
{args.duration_s:g} s measured (requests started in that window count). When a request
takes long (a saturated system with many clients), the warm-up grows to at least one
mean request time of the priming run and the window to at least
{WINDOW_REQUEST_TIMES:g} (rounded up to whole seconds; the last column shows what was
used): a closed loop starts all its clients at once, and a window shorter than a
request would count only the few requests that happened to start in it.

Pinning: {pin_text}. So "share of engine" compares each gateway with what the
engine and load generator reach without one, on the same core.

Columns: req/s and tok/s are completed requests and streamed tokens (`usage`) per
second of the measured window; TTFT is the time from sending a request to its first
content chunk, total the time to the end of the answer; SUT CPU is the system under test's CPU seconds (user + system, all its
threads and child processes, from `/proc/PID/stat`) divided by the wall seconds of the
measured window, so 1.00 is one core saturated; SUT RSS is its resident memory at the
end of the window; core 1 busy is (engine + load generator) CPU seconds over the same
window: near 1.00 the engine side, not the gateway, limits the row.

## Machine

| | |
|---|---|
| CPUs (nproc) | {machine["nproc"]} |
| CPU model | {machine["cpu"]} |
| memory | {machine["memory"]} |
| kernel | {machine["kernel"]} |
| load average before the run | {machine["load"]} |

## Versions

| package | version |
|---|---|
{version_rows}

## LiteLLM's settings

LiteLLM's proxy as its documentation recommends for production, keeping what applies
without a database or Redis (sources: the "Production Best Practices" and "Server
Tuning" pages of docs.litellm.ai/docs/proxy, and `litellm --help` of the installed
version):

- `--num_workers 1`: one Uvicorn worker ("one Uvicorn worker per pod and scale
  horizontally"); it also matches the one core it is given. Uvicorn is the default and
  recommended server; LiteLLM runs it on uvloop by itself.
- `LITELLM_MODE=PRODUCTION` (no `.env` loading), `LITELLM_LOG=ERROR` (no access log, no
  info logs on the hot path), `litellm_settings.set_verbose: false`,
  `litellm_settings.request_timeout: 600`.
- `general_settings.master_key` (requests authenticate with it: virtual keys need a
  database), `disable_spend_logs: true`, `disable_error_logs: true` (no effect without a
  database; set as the checklist suggests).
- No `database_url`: LiteLLM then keeps no per-request spend or usage records, while
  llmgw (accounted mode) writes one per request. `LITELLM_LOCAL_MODEL_COST_MAP=True`
  (the offline cost map; nothing is fetched at start-up).
- Not used: `--run_gunicorn` (for several workers in one container), `--run_granian`
  (an alternative server the docs describe as optional tuning), Redis, callbacks.
- Installed beside `litellm[proxy]`: {companions}. LiteLLM's proxy imports
  OpenTelemetry's SDK in its auth step on every request, and prisma when it checks a
  failed lookup in that step; with `litellm[proxy]` alone those imports fail, a failed
  import is not cached, and each request searches `sys.path` again (about a sixth of its CPU in a
  py-spy profile at 32 clients). LiteLLM's own extras list them (`proxy-runtime`: the
  OpenTelemetry packages, at these pins; `extra_proxy`: prisma, in whose range this
  version is), so a full deployment has them; they are installed here too. Nothing
  configures either: no tracing, no database.

The model entry points `openai/{MODEL}` at the engine's `/v1` with the engine's key.

## Results

{results_table(runs)}

{errors_text(runs)}

{start_note}

## Where the time goes

{where}

## Overhead (llmgw bench overhead)

{overhead}

## Reproduce

```sh
cd llmgw
# this comparison (installs LiteLLM {LITELLM_VERSION} into {args.litellm_venv} on first use)
uv run python tests/bench/compare_litellm.py --duration-s {args.duration_s:g} \\
    --concurrency {concurrency} --out {args.out}
# what llmgw adds over the engine, open loop at rising rates
uv run llmgw bench overhead
{load_line}```

LiteLLM's virtualenv is made with
`uv venv --python {sys.version_info.major}.{sys.version_info.minor} {args.litellm_venv}` and
`uv pip install --python {args.litellm_venv}/bin/python {install_args}`;
it is never part of the project's environment.
"""


# -- main ----------------------------------------------------------------------------


def _concurrency_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrencies must be positive")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--duration-s", type=float, default=10.0, help="Measured seconds per run.")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="Warm-up seconds per run.")
    parser.add_argument(
        "--prime-s", type=float, default=1.0, help="Uncounted seconds of load after each start."
    )
    parser.add_argument(
        "--concurrency",
        type=_concurrency_list,
        default=list(DEFAULT_CONCURRENCY),
        help="Closed-loop clients, comma-separated (default 16,64,128,256).",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="Which systems to measure, comma-separated, of: " + ", ".join(SYSTEMS),
    )
    parser.add_argument("--out", type=Path, default=Path("docs/performance.md"))
    parser.add_argument("--json", type=Path, help="Also write every run as JSON here.")
    parser.add_argument("--litellm-venv", type=Path, default=DEFAULT_VENV)
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in systems]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if "LiteLLM" in args.systems:
        ensure_litellm(args.litellm_venv)
    machine = machine_facts()
    version = versions(args.litellm_venv)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"machine: {machine}", file=sys.stderr)
    began = time.monotonic()
    sut_cores, _ = _cores()
    runs = trio.run(
        lambda: compare(
            venv=args.litellm_venv,
            concurrencies=args.concurrency,
            duration_s=args.duration_s,
            warmup_s=args.warmup_s,
            prime_s=args.prime_s,
            systems=args.systems,
        )
    )
    elapsed = time.monotonic() - began
    if args.json is not None:
        args.json.write_bytes(
            orjson.dumps(
                {"machine": machine, "versions": version, "runs": [r.to_json() for r in runs]},
                option=orjson.OPT_INDENT_2,
            )
        )
    text = render(
        runs=runs,
        machine=machine,
        version=version,
        args=args,
        date=date,
        elapsed_s=elapsed,
        kept=kept_sections(args.out),
        pinned=sut_cores is not None,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

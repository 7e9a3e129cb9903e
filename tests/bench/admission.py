"""Admission bands: an interactive request's latency while bulk traffic floods a model.

Run: ``uv run python tests/bench/admission.py [--bulk 200] [--samples 5] [--json PATH]``

Starts ``llmgw up --engine sim`` in a temporary data directory (two sim
replicas, 4 slots each: ``--slots 4`` and ``--engine-arg=--slots=4``; 64-token
answers at 50 tokens/s, 100 ms to the first token), makes a key in the
``bulk`` band and an interactive one (no band), and measures the interactive
key's streamed chat answers — time to the first token (TTFT) and to the last
— three times:

1. **idle**: nothing else running;
2. **bands on**: ``--bulk`` closed-loop clients of the bulk key keep the
   model saturated; the default bands let bulk fill half the slots;
3. **bands off**: the same load after ``router.admission.bands`` is set to
   one band (saturation 1.0; the bulk key's band no longer exists, so it
   falls into the default one) through ``PATCH /api/v1/config``.

Prints a table with the medians and the ratios to idle, and a JSON report
(``--json`` writes it to a file too). Not a pytest test (no ``test_``
prefix). Loopback only; every request and every phase is bounded in time,
the whole run in about a minute and a half. ``llmgw up`` and its engines
are stopped at the end (SIGINT, then SIGKILL of its process group).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

MODEL = "sim-model"
SLOTS = 4
TOKENS = 64
TOKENS_PER_SECOND = 50
ENGINE_TTFT_MS = 100
STARTUP_TIMEOUT_S = 120.0
#: A bands-off interactive request waits behind the whole bulk queue:
#: about bulk / (2 * SLOTS) answers of TOKENS / TOKENS_PER_SECOND seconds.
REQUEST_TIMEOUT_S = 90.0
SETTINGS = {"auth": {"default_rpm": 1_000_000, "default_tpm": 10**10}}
ONE_BAND = [{"name": "interactive", "priority": 100, "saturation": 1.0, "queue_ttl": 300}]


class Up:
    """``llmgw up`` as a process in its own session."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.log_path = data_dir.parent / "up.log"
        self._log = self.log_path.open("wb")
        base = 30000 + (os.getpid() % 300) * 100
        argv = [
            sys.executable,
            "-m",
            "llmgw.cli",
            "up",
            "--data-dir",
            str(data_dir),
            *("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"),
            *("--metrics-listen", "127.0.0.1:0", "--agent-listen", "127.0.0.1:0"),
            *("--engine-ports", f"{base}-{base + 99}"),
            *("--engine", "sim", "--model-name", MODEL, "--slots", str(SLOTS)),
            f"--engine-arg=--slots={SLOTS}",
            f"--engine-arg=--tokens={TOKENS}",
            f"--engine-arg=--tokens-per-second={TOKENS_PER_SECOND}",
            f"--engine-arg=--ttft-ms={ENGINE_TTFT_MS}",
        ]
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.run: dict[str, Any] = {}

    @property
    def api(self) -> str:
        return f"http://{self.run['api']}"

    @property
    def admin(self) -> str:
        return f"http://{self.run['admin']}"

    @property
    def admin_token(self) -> str:
        return (self.data_dir / "admin-token").read_text().strip()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llmgw up exited:\n{self.log_path.read_text()}")
            run_file = self.data_dir / "run.json"
            if not self.run and run_file.exists():
                try:
                    self.run = json.loads(run_file.read_text())
                except ValueError:
                    pass
            if self.run:
                try:
                    if httpx.get(f"{self.api}/ready", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"llmgw up not ready in {STARTUP_TIMEOUT_S} s")

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "llmgw.cli", *args, "--data-dir", str(self.data_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout

    def admin_call(self, method: str, path: str, body: object = None) -> Any:
        response = httpx.request(
            method,
            f"{self.admin}{path}",
            json=body,
            headers={"authorization": f"Bearer {self.admin_token}"},
            timeout=30,
        )
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


async def timed_answer(client: httpx.AsyncClient, url: str, key: str, text: str) -> dict[str, Any]:
    """One streamed chat answer: seconds to the first content chunk and to the end."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    started = time.perf_counter()
    ttft_s: float | None = None
    async with client.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return {"status": response.status_code, "error": response.text[:200]}
        async for line in response.aiter_lines():
            if ttft_s is None and line.startswith("data: {") and '"content":"' in line:
                ttft_s = time.perf_counter() - started
    return {"status": 200, "ttft_s": ttft_s, "total_s": time.perf_counter() - started}


async def bulk_worker(
    client: httpx.AsyncClient, url: str, key: str, index: int, counts: dict[str, int]
) -> None:
    """A closed-loop bulk client: one request after another until cancelled."""
    turn = 0
    while True:
        try:
            result = await timed_answer(client, url, key, f"bulk import {index} part {turn}")
            counts[str(result["status"])] = counts.get(str(result["status"]), 0) + 1
        except httpx.HTTPError as exc:
            counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
            await trio.sleep(0.1)
        turn += 1


async def phase(
    name: str,
    url: str,
    keys: dict[str, str],
    *,
    bulk: int,
    samples: int,
    concurrent_samples: bool,
) -> dict[str, Any]:
    """Interactive answers, with ``bulk`` bulk clients running meanwhile."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=bulk + samples + 8)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10)
    counts: dict[str, int] = {}
    results: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(limits=limits, timeout=timeout) as client,
        trio.open_nursery() as nursery,
    ):
        for index in range(bulk):
            nursery.start_soon(bulk_worker, client, url, keys["bulk"], index, counts)
        if bulk:
            await trio.sleep(3)  # every bulk client has sent; the queue is full
        ask = "how is the weather today"
        if concurrent_samples:
            async with trio.open_nursery() as inner:

                async def sample() -> None:
                    results.append(await timed_answer(client, url, keys["interactive"], ask))

                for _ in range(samples):
                    inner.start_soon(sample)
        else:
            for _ in range(samples):
                results.append(await timed_answer(client, url, keys["interactive"], ask))
        nursery.cancel_scope.cancel()
    good = [r for r in results if r["status"] == 200 and r["ttft_s"] is not None]
    report: dict[str, Any] = {
        "phase": name,
        "bulk_clients": bulk,
        "samples": results,
        "bulk_answers": counts,
    }
    if good:
        report["ttft_ms"] = statistics.median(r["ttft_s"] for r in good) * 1000
        report["total_ms"] = statistics.median(r["total_s"] for r in good) * 1000
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bulk", type=int, default=200, help="bulk clients (closed loop)")
    parser.add_argument("--samples", type=int, default=5, help="interactive answers per phase")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-admission-") as scratch:
        data_dir = Path(scratch) / "data"
        data_dir.mkdir()
        (data_dir / "server.yaml").write_text(json.dumps(SETTINGS))
        up = Up(data_dir)
        try:
            up.wait_ready()
            up.admin_call("POST", f"/api/v1/models/{MODEL}/scale", {"replicas": 2})
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while up.admin_call("GET", f"/api/v1/models/{MODEL}")["replicas"]["ready"] < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the second replica did not become ready")
                time.sleep(0.2)
            keys = {}
            for name, project, band in (
                ("bulk", "Bench/bulk/import", ["--band", "bulk"]),
                ("interactive", "Bench/app/chat", []),
            ):
                made = up.cli("keys", "create", name, "--project", project, *band, "--json")
                keys[name] = json.loads(made)["key"]
            started = time.monotonic()
            idle = trio.run(
                lambda: phase(
                    "idle", up.api, keys, bulk=0, samples=args.samples, concurrent_samples=False
                )
            )
            bands_on = trio.run(
                lambda: phase(
                    "bands on",
                    up.api,
                    keys,
                    bulk=args.bulk,
                    samples=args.samples,
                    concurrent_samples=False,
                )
            )
            up.admin_call(
                "PATCH", "/api/v1/config", {"key": "router.admission.bands", "value": ONE_BAND}
            )
            time.sleep(1.5)  # the settings loop polls every second
            bands_off = trio.run(
                lambda: phase(
                    "bands off",
                    up.api,
                    keys,
                    bulk=args.bulk,
                    samples=min(args.samples, 3),
                    concurrent_samples=True,
                )
            )
            elapsed_s = time.monotonic() - started
        finally:
            up.stop()
    phases = [idle, bands_on, bands_off]
    base = idle.get("ttft_ms")
    base_total = idle.get("total_ms")
    print(
        f"sim: 2 replicas x {SLOTS} slots, {TOKENS} tokens at {TOKENS_PER_SECOND} tok/s, "
        f"{ENGINE_TTFT_MS} ms engine TTFT; {args.bulk} bulk clients"
    )
    print(f"{'phase':<10} {'TTFT p50 ms':>12} {'x idle':>8} {'total p50 ms':>13} {'x idle':>8}")
    for report in phases:
        ttft, total = report.get("ttft_ms"), report.get("total_ms")
        ratio = f"{ttft / base:.2f}" if ttft and base else "-"
        total_ratio = f"{total / base_total:.2f}" if total and base_total else "-"
        print(
            f"{report['phase']:<10} {ttft or float('nan'):>12.1f} {ratio:>8} "
            f"{total or float('nan'):>13.1f} {total_ratio:>8}"
        )
    doc = {"phases": phases, "elapsed_s": elapsed_s, "bulk": args.bulk}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()

"""CPU of accounting's per-request path, in process, without the HTTP or relay.

Run (from a checkout, in its environment; point ``--python`` of another
checkout's ``.venv`` at this file to compare)::

    uv run python tests/bench/accounting_path.py --requests 20000 --rounds 5

What ``llmgw bench gateway --mode accounted`` does per streamed request,
outside the HTTP server and the relay: the key checked
(:class:`~llmgw.auth.keys.KeyAuthenticator`, cached), its path of limits
(:class:`~llmgw.auth.tree.ScopeResolver`, cached) with limits and budgets
at every level, :meth:`~llmgw.accounting.accountant.Accountant.check` and
the rate headers, the in-flight gauge, the stream's "started" record in the
usage journal (``Recorder.begin``), then its row (``Recorder.record``:
metrics, settle, the row written to the journal, 0.2 s sync policy, no
fsync counted: the committer runs only between rounds). Prints one JSON
line per round (microseconds of process CPU per request) and the median.
Not a pytest test; bounded by ``--requests``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import attrs
import trio

from llmgw import metrics
from llmgw.accounting.accountant import Accountant
from llmgw.accounting.journal import UsageJournal
from llmgw.accounting.prices import PriceBook
from llmgw.accounting.usage import UsageWriter
from llmgw.auth.keys import KeyAuthenticator, new_key
from llmgw.auth.tree import ScopeResolver
from llmgw.gateway.recording import Recorder
from llmgw.gateway.request import Outcome, Request
from llmgw.gateway.sse import Usage
from llmgw.settings import Price
from llmgw.store import open_store
from llmgw.store.records import Limits

MODEL = "bench-model"
PRICE = Price(prompt_per_1k=100, cached_per_1k=10, completion_per_1k=400)


async def _main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="acct-path-") as tmp:
        data = Path(tmp)
        async with open_store(str(data / "llmgw.db")) as store:
            now = time.time()
            path, _ = await store.ensure_project("bench", "bench", "acct", now)
            roomy = Limits(
                rpm=10**9, tpm=10**12, budget_day_micros=10**15, budget_month_micros=10**16
            )
            for scope, level_id in (
                ("org", path.org.id),
                ("team", path.team.id),
                ("project", path.project.id),
            ):
                await store.set_limits(scope, level_id, roomy)  # type: ignore[arg-type]
            secret, record = new_key("bench-acct")
            await store.insert_key(attrs.evolve(record, project_id=path.project.id, limits=roomy))
            authenticator = KeyAuthenticator(store, cache_ttl_s=3600)
            resolver = ScopeResolver(store, cache_ttl_s=3600)
            accountant = Accountant(PriceBook({MODEL: PRICE}))
            journal = UsageJournal(data / "usage-journal")
            recorder = Recorder(
                usage=UsageWriter(journal=journal), accountant=accountant, accounting=True
            )
            catalog = {MODEL: None}
            figures = []
            for round_ in range(args.rounds):
                started_cpu = time.process_time()
                for n in range(args.requests):
                    started = time.perf_counter()
                    metrics.IN_FLIGHT.inc()
                    key = await authenticator.check(secret)
                    limits, scope_ids = await resolver.path(key)
                    reservation = accountant.check(limits, MODEL, 16 + 64, time.time())
                    headers = tuple(reservation.headers())
                    request = Request(
                        kind="chat",
                        request_id=f"req_{round_}_{n}",
                        started=started,
                        key=key,
                        model=MODEL,
                        stream=True,
                        scope_ids=scope_ids,
                        reservation=reservation,
                        rate_headers=headers,
                    )
                    outcome = Outcome()
                    recorder.begin(request, outcome, catalog)
                    outcome.usage = Usage(prompt_tokens=16, completion_tokens=64)
                    outcome.ttft_s = 0.01
                    outcome.replica = "bench-static"
                    outcome.finish(200)
                    durable = recorder.record(request, outcome, catalog)
                    if durable is not None:
                        await durable.wait()
                    metrics.IN_FLIGHT.dec()
                cpu_us = (time.process_time() - started_cpu) / args.requests * 1e6
                figures.append(cpu_us)
                print(json.dumps({"round": round_, "cpu_us_per_request": round(cpu_us, 2)}))
                # Between rounds, out of the figures: sync and rotate.
                await journal.commit()
                await journal.rotate()
            journal.close()
            print(json.dumps({"median_cpu_us_per_request": round(statistics.median(figures), 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    trio.run(_main, parser.parse_args())


if __name__ == "__main__":
    main()

"""A year of usage in the SQLite store: how long a year's sums take, how
large the file is, and what one pruning pass costs.

Not a test (pytest does not collect it): run it by hand, it prints what it
measured (``--json PATH`` also writes it)::

    uv run python tests/bench/usage_year.py                  # defaults below
    uv run python tests/bench/usage_year.py --keys 1000 --rate 2 --days 365 --retain-days 90

What it does:

1. Makes a new store (``--db``, default
   ``/tmp/llmgw-bench/usage-year/llmgw.db``, removed at the end unless
   ``--keep``) through ``open_sqlite_store``, so the schema is the product's.
2. Writes ``--keys`` keys (ids as the product makes them) spread over 100
   projects, 20 teams and 4 orgs; each key uses two of three models.
3. Generates, directly in SQL for speed:
   - the raw rows of the last ``--retain-days`` days at ``--rate`` requests
     a second on average (keys and models drawn at random, 2 % errors,
     prompts of 200 to 2,000 tokens, answers of 50 to 500), and the hourly
     roll-ups of those days summed from them;
   - hourly roll-ups for the rest of the ``--days`` days: one row per hour,
     key and model, i.e. every key busy with both its models every hour
     (the most roll-up rows that keys, models and hours can make; at the default
     rate a key sends about 7 requests an hour, so nearly every hour has
     some), with 1 to 6 requests each;
   - the daily and monthly roll-ups, summed from the hourly and daily ones
     (as the migration does).
4. Reports the file's size (after a WAL checkpoint) and row counts.
5. Times, through the product's store (``usage_summary``, what ``ctl usage
   --by … --since 365d`` and ``/api/v1/usage/summary`` call), the sums over
   365 days by key, project, team, org and model (``--repeat`` times each);
   the budget restore's reads (``spend_since_by_scope`` since the day's and
   the month's start); and, for comparison, the same year by key read from
   the daily roll-ups alone and from the hourly ones alone.
6. Prunes one more hour of raw rows the way the leader does
   (``prune_usage_past``, 2,000 rows a transaction) and reports how long each
   transaction held the write lock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from llmgw.accounting.budgets import period_start
from llmgw.accounting.retention import PRUNE_BATCH, prune_usage_past
from llmgw.store import Lease, Store, SummaryBy
from llmgw.store.sqlite import open_sqlite_store

DAY_S = 86_400
HOUR_S = 3_600
MODELS = ("gemma-3-270m", "qwen2.5-1.5b", "llama-3.1-8b")
#: A raw row's model: one of its key's two (``MODELS[k % 3]``, ``MODELS[(k + 1) % 3]``).
MODEL_SQL = (
    "CASE (k + r1 % 2) % 3 WHEN 0 THEN 'gemma-3-270m' WHEN 1 THEN 'qwen2.5-1.5b'"
    " ELSE 'llama-3.1-8b' END"
)
#: Micro-units per 1,000 prompt and completion tokens, for the generated cost.
PROMPT_PER_1K, COMPLETION_PER_1K = 150, 600


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=Path("/tmp/llmgw-bench/usage-year/llmgw.db"))
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=2.0, help="requests a second, on average")
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--retain-days", type=int, default=90)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument(
        "--measure-only",
        action="store_true",
        help="time the queries on a database kept by an earlier --keep run (kept again)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser.parse_args()


def generate(
    db: Path, *, keys: int, rate: float, days: int, retain_days: int, now: int
) -> dict[str, Any]:
    """Fill the (migrated, empty) store at ``db``; what was written and how long it took."""
    year_start = (now - days * DAY_S) // HOUR_S * HOUR_S
    raw_start = (now - retain_days * DAY_S) // HOUR_S * HOUR_S
    raw_rows = int(rate * (now - raw_start))
    took: dict[str, float] = {}
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        # Bulk loading only: no journal, a large cache, and the raw rows'
        # secondary indexes built once after the rows are in (a sort) rather
        # than row by row. The product's own settings are back at the end.
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA cache_size = -1048576")  # 1 GiB
        conn.execute("PRAGMA synchronous = OFF")
        indexes = [
            (str(name), str(sql))
            for name, sql in conn.execute(
                "SELECT name, sql FROM sqlite_master"
                " WHERE type = 'index' AND tbl_name = 'usage' AND sql IS NOT NULL"
            )
        ]
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO orgs (id, name, created_at) VALUES (?, ?, 0)",
            [(f"org_{o:016x}", f"org{o}") for o in range(4)],
        )
        conn.executemany(
            "INSERT INTO teams (id, org_id, name, created_at) VALUES (?, ?, ?, 0)",
            [(f"team_{t:016x}", f"org_{t % 4:016x}", f"team{t}") for t in range(20)],
        )
        conn.executemany(
            "INSERT INTO projects (id, team_id, name, created_at) VALUES (?, ?, ?, 0)",
            [(f"proj_{p:016x}", f"team_{p % 20:016x}", f"project{p}") for p in range(100)],
        )
        conn.executemany(
            "INSERT INTO keys (id, name, key_hash, prefix, created_at, project_id)"
            " VALUES (?, ?, ?, 'sk-llmgw-xxxx', 0, ?)",
            [
                (f"key_{k:016x}", f"key{k}", f"{k:064x}", f"proj_{k % 100:016x}")
                for k in range(keys)
            ],
        )
        # Each key's place and its two models, for the generators below.
        conn.execute(
            "CREATE TEMP TABLE bench_keys (k INTEGER PRIMARY KEY, key_id TEXT, project_id TEXT,"
            " team_id TEXT, org_id TEXT, m1 TEXT, m2 TEXT)"
        )
        conn.executemany(
            "INSERT INTO bench_keys VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    k,
                    f"key_{k:016x}",
                    f"proj_{k % 100:016x}",
                    f"team_{k % 100 % 20:016x}",
                    f"org_{k % 100 % 20 % 4:016x}",
                    MODELS[k % 3],
                    MODELS[(k + 1) % 3],
                )
                for k in range(keys)
            ],
        )
        conn.execute("COMMIT")

        started = time.perf_counter()
        conn.execute("BEGIN")
        for name, _ in indexes:
            conn.execute(f"DROP INDEX {name}")
        conn.execute(
            f"""
            WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n < ?),
            -- Pseudo-random draws as pure functions of n (multiplicative hashes,
            -- their high bits), so every use of one sees the same value.
            gen AS (
                SELECT n, (n * 2654435761) % 4294967296 * {keys} / 4294967296 AS k,
                       (n * 2246822519) % 4294967296 / 256 AS r1,
                       (n * 3266489917) % 4294967296 / 256 AS r2
                FROM seq
            )
            INSERT INTO usage (request_id, created_at, key_id, model, status, prompt_tokens,
                               cached_tokens, completion_tokens, duration_ms, ttft_ms,
                               replica_id, stream, endpoint, project_id, team_id, org_id,
                               served_model, cost_micros)
            SELECT 'req_' || printf('%024x', n),
                   ? + (n + (r1 % 1000) / 1000.0) / ?,
                   'key_' || printf('%016x', k),
                   {MODEL_SQL},
                   CASE WHEN r2 % 100 < 2 THEN 502 ELSE 200 END,
                   200 + r1 % 1801, (200 + r1 % 1801) * (r2 % 2) / 2, 50 + r2 % 451,
                   500 + r2 % 20000, 50 + r1 % 400,
                   {MODEL_SQL} || '/0', 1, '/v1/chat/completions',
                   'proj_' || printf('%016x', k % 100), 'team_' || printf('%016x', k % 100 % 20),
                   'org_' || printf('%016x', k % 100 % 20 % 4), '',
                   ((200 + r1 % 1801) * {PROMPT_PER_1K} + (50 + r2 % 451) * {COMPLETION_PER_1K}
                    + 999) / 1000
            FROM gen
            """,
            (raw_rows - 1, raw_start, rate),
        )
        for _, sql in indexes:
            conn.execute(sql)
        conn.execute("COMMIT")
        took["raw rows"] = time.perf_counter() - started

        started = time.perf_counter()
        conn.execute("BEGIN")
        conn.execute(
            "INSERT INTO usage_hourly (hour, key_id, model, project_id, team_id, org_id, requests,"
            " prompt_tokens, cached_tokens, completion_tokens, cost_micros, errors)"
            " SELECT CAST(created_at / 3600 AS INTEGER) * 3600 AS hour, key_id,"
            " CASE WHEN served_model != '' THEN served_model ELSE model END AS m, project_id,"
            " team_id, org_id, count(*), sum(prompt_tokens), sum(cached_tokens),"
            " sum(completion_tokens), sum(cost_micros), sum(status >= 400)"
            " FROM usage GROUP BY hour, key_id, m, project_id, team_id, org_id"
        )
        conn.execute(
            f"""
            WITH RECURSIVE hours(h) AS (
                SELECT ? UNION ALL SELECT h + 3600 FROM hours WHERE h + 3600 < ?
            ),
            gen AS (
                SELECT h, b.*, w.which, ((h / 3600) * 48271 + b.k * 69621 + w.which) AS seed
                FROM hours CROSS JOIN bench_keys AS b
                CROSS JOIN (SELECT 1 AS which UNION ALL SELECT 2) AS w
            ),
            draws AS (
                SELECT *, 1 + seed % 6 AS req, (seed * 48271) % 2147483647 AS r1,
                       (seed * 69621) % 2147483647 AS r2
                FROM gen
            )
            INSERT INTO usage_hourly (hour, key_id, model, project_id, team_id, org_id, requests,
                                      prompt_tokens, cached_tokens, completion_tokens,
                                      cost_micros, errors)
            SELECT h, key_id, CASE WHEN which = 1 THEN m1 ELSE m2 END, project_id, team_id,
                   org_id, req, req * (200 + r1 % 1801), req * (r2 % 900), req * (50 + r2 % 451),
                   req * ((200 + r1 % 1801) * {PROMPT_PER_1K} + (50 + r2 % 451)
                          * {COMPLETION_PER_1K} + 999) / 1000,
                   CASE WHEN r2 % 50 < req THEN 1 ELSE 0 END
            FROM draws
            """,
            (year_start, raw_start),
        )
        # As in a store that has pruned: raw rows before raw_start are gone.
        conn.execute("INSERT INTO usage_retention (id, pruned_before) VALUES (1, ?)", (raw_start,))
        conn.execute("COMMIT")
        took["hourly roll-ups"] = time.perf_counter() - started

        started = time.perf_counter()
        conn.execute("BEGIN")
        conn.execute(
            "INSERT INTO usage_daily (day, key_id, model, project_id, team_id, org_id, requests,"
            " prompt_tokens, cached_tokens, completion_tokens, cost_micros, errors)"
            " SELECT hour - hour % 86400 AS day, key_id, model, project_id, team_id, org_id,"
            " sum(requests), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens),"
            " sum(cost_micros), sum(errors) FROM usage_hourly"
            " GROUP BY day, key_id, model, project_id, team_id, org_id"
        )
        conn.execute(
            "INSERT INTO usage_monthly (month, key_id, model, project_id, team_id, org_id,"
            " requests, prompt_tokens, cached_tokens, completion_tokens, cost_micros, errors)"
            " SELECT CAST(strftime('%s', day, 'unixepoch', 'start of month') AS INTEGER) AS month,"
            " key_id, model, project_id, team_id, org_id, sum(requests), sum(prompt_tokens),"
            " sum(cached_tokens), sum(completion_tokens), sum(cost_micros), sum(errors)"
            " FROM usage_daily GROUP BY month, key_id, model, project_id, team_id, org_id"
        )
        conn.execute("COMMIT")
        took["daily and monthly roll-ups"] = time.perf_counter() - started
        conn.execute("PRAGMA journal_mode = WAL")
        counts = {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("usage", "usage_hourly", "usage_daily", "usage_monthly", "keys")
        }
        pages = {
            name: conn.execute(
                "SELECT sum(pgsize) FROM dbstat WHERE name IN"
                " (SELECT name FROM sqlite_master WHERE tbl_name = ?)",
                (name,),
            ).fetchone()[0]
            if _has_dbstat(conn)
            else None
            for name in ("usage", "usage_hourly", "usage_daily", "usage_monthly")
        }
    finally:
        conn.close()
    return {
        "year_start": year_start,
        "raw_start": raw_start,
        "rows": counts,
        "bytes_by_table": pages,
        "generate_s": {k: round(v, 1) for k, v in took.items()},
    }


def _has_dbstat(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("SELECT 1 FROM dbstat LIMIT 1").fetchone()
    except sqlite3.OperationalError:
        return False
    return True


async def timed(fn: Callable[[], Awaitable[Any]], repeat: int) -> dict[str, Any]:
    runs = []
    result: Any = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = await fn()
        runs.append(time.perf_counter() - started)
    return {
        "min_s": round(min(runs), 4),
        "median_s": round(statistics.median(runs), 4),
        "max_s": round(max(runs), 4),
        "groups": len(result),
    }


class TimingStore:
    """Times each ``prune_usage`` transaction of the store it wraps."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.batches: list[tuple[int, float]] = []

    async def prune_usage(
        self, before: float, *, limit: int = 5000, fence: Lease | None = None
    ) -> int:
        started = time.perf_counter()
        deleted = await self.inner.prune_usage(before, limit=limit, fence=fence)
        self.batches.append((deleted, time.perf_counter() - started))
        return deleted


async def measure(
    db: Path, *, now: int, days: int, retain_days: int, repeat: int
) -> dict[str, Any]:
    since = now - days * DAY_S
    out: dict[str, Any] = {}
    async with open_sqlite_store(db) as store:
        summary_by: tuple[SummaryBy, ...] = ("key", "project", "team", "org", "model")
        for by in summary_by:
            out[f"usage_summary by {by}, {days} days"] = await timed(
                partial(store.usage_summary, by, since), repeat
            )
        day_start = period_start("day", now)
        month_start = period_start("month", now)
        out["spend_since_by_scope, month"] = await timed(
            lambda: store.spend_since_by_scope(month_start), repeat
        )
        out["spend_since_by_scope, day"] = await timed(
            lambda: store.spend_since_by_scope(day_start), repeat
        )

        def hourly_only() -> list[Any]:
            with sqlite3.connect(db) as conn:
                return conn.execute(
                    "SELECT key_id, sum(requests), sum(prompt_tokens), sum(cached_tokens),"
                    " sum(completion_tokens), sum(cost_micros), sum(errors) FROM usage_hourly"
                    " WHERE hour >= ? GROUP BY key_id",
                    (since // HOUR_S * HOUR_S,),
                ).fetchall()

        def daily_only() -> list[Any]:
            with sqlite3.connect(db) as conn:
                return conn.execute(
                    "SELECT key_id, sum(requests), sum(prompt_tokens), sum(cached_tokens),"
                    " sum(completion_tokens), sum(cost_micros), sum(errors) FROM usage_daily"
                    " WHERE day >= ? GROUP BY key_id",
                    (since // DAY_S * DAY_S,),
                ).fetchall()

        out[f"daily roll-ups alone by key, {days} days (for comparison)"] = await timed(
            lambda: trio.to_thread.run_sync(daily_only), repeat
        )
        out[f"hourly roll-ups alone by key, {days} days (for comparison)"] = await timed(
            lambda: trio.to_thread.run_sync(hourly_only), max(1, repeat // 2)
        )

        year_before = [await store.usage_summary(by, since) for by in ("org", "model")]
        timing = TimingStore(store)
        # One hour more than is pruned already (runs on a kept database each
        # prune the next hour).
        horizon = await store.usage_pruned_before()
        prune_now = (now if horizon is None else horizon + retain_days * DAY_S) + HOUR_S
        started = time.perf_counter()
        deleted = await prune_usage_past(timing, retain_days, prune_now)  # type: ignore[arg-type]
        pass_s = time.perf_counter() - started
        batch_s = [s for _, s in timing.batches]
        out["prune one hour"] = {
            "rows_deleted": deleted,
            "transactions": len(timing.batches),
            "rows_per_transaction": PRUNE_BATCH,
            "max_transaction_s": round(max(batch_s), 4),
            "median_transaction_s": round(statistics.median(batch_s), 4),
            "pass_s": round(pass_s, 3),
        }
        # The sums did not move: the year (from the roll-ups) is the same.
        out["year unchanged by pruning"] = year_before == [
            await store.usage_summary(by, since) for by in ("org", "model")
        ]
    return out


def main() -> None:
    args = parse_args()
    db: Path = args.db
    # The generated data's "now" and parameters, for a later --measure-only.
    made = db.with_name(db.name + ".bench.json")
    if args.measure_only:
        if not made.exists():
            raise SystemExit(f"{made} is missing: generate with --keep first")
        saved = json.loads(made.read_text())
        now = int(saved["now"])
        args.keys, args.rate, args.days, args.retain_days = (
            saved[k] for k in ("keys", "rate", "days", "retain_days")
        )
        args.keep = True
    else:
        if db.exists():
            raise SystemExit(f"{db} exists: remove it or give another --db")
        db.parent.mkdir(parents=True, exist_ok=True)
        now = int(time.time()) // HOUR_S * HOUR_S + 1234  # mid-hour, as a real "now" is

        async def make() -> None:
            async with open_sqlite_store(db):
                pass

        trio.run(make)
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "load_before": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(),
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
        },
        "parameters": {
            "keys": args.keys,
            "rate_per_s": args.rate,
            "days": args.days,
            "retain_days": args.retain_days,
        },
    }
    try:
        if not args.measure_only:
            started = time.perf_counter()
            report["generated"] = generate(
                db,
                keys=args.keys,
                rate=args.rate,
                days=args.days,
                retain_days=args.retain_days,
                now=now,
            )
            report["generated"]["total_s"] = round(time.perf_counter() - started, 1)
            keys = ("keys", "rate", "days", "retain_days")
            made.write_text(json.dumps({"now": now, **{k: getattr(args, k) for k in keys}}))
        report["file_bytes"] = db.stat().st_size
        report["load_before_queries"] = [round(x, 2) for x in os.getloadavg()]
        report["queries"] = trio.run(
            lambda: measure(
                db, now=now, days=args.days, retain_days=args.retain_days, repeat=args.repeat
            )
        )
        report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        if not args.keep:
            shutil.rmtree(db.parent, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

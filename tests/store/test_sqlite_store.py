"""What only the SQLite backend does: its file, pragmas, migrations, backups."""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import sqlite3
import stat
from pathlib import Path

import attrs
import pytest
import trio

import llmgw.store
from llmgw.store import KeyRecord, SqliteStore, StoreError, UsageRow, open_store
from llmgw.store._common import HOUR_S, hour_of, month_of
from llmgw.store.sqlite import BUSY_TIMEOUT_S, open_sqlite_store

EXTRA_MIGRATION = """
-- A later migration for the tests: a new table and a new column.
CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL);
ALTER TABLE keys ADD COLUMN note TEXT NOT NULL DEFAULT '';
"""

#: The packaged SQLite migrations.
SQLITE_MIGRATIONS = Path(llmgw.store.__file__).parent / "migrations" / "sqlite"


def query(path: Path, sql: str) -> list[tuple[object, ...]]:
    """Rows of ``sql`` read through a separate, short-lived connection."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


def index_columns(path: Path, table: str) -> dict[str, list[str]]:
    """The indexes made by CREATE INDEX on ``table``: name → columns in order."""
    names = [
        str(r[0])
        for r in query(path, f"SELECT name FROM pragma_index_list('{table}') WHERE origin = 'c'")
    ]
    return {
        name: [str(r[0]) for r in query(path, f"SELECT name FROM pragma_index_info('{name}')")]
        for name in names
    }


def packaged_plus(tmp_path: Path, extra: dict[str, str]) -> Path:
    """A migrations folder: the shipped files plus ``extra`` (name → SQL)."""
    folder = tmp_path / "migrations"
    folder.mkdir()
    shipped = importlib.resources.files("llmgw.store").joinpath("migrations", "sqlite")
    for entry in shipped.iterdir():
        if entry.name.endswith(".sql"):
            (folder / entry.name).write_text(entry.read_text(encoding="utf-8"), encoding="utf-8")
    for name, sql in extra.items():
        (folder / name).write_text(sql, encoding="utf-8")
    return folder


KEY = KeyRecord(id="key_1", name="one", key_hash="a" * 64, prefix="sk-llmgw-aaaa", created_at=1.0)


def backups(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if ".bak-" in p.name)


# --- the file ----------------------------------------------------------------


async def test_the_migration_files_ship_inside_the_package() -> None:
    shipped = importlib.resources.files("llmgw.store").joinpath("migrations", "sqlite")
    init = shipped.joinpath("0001_init.sql")
    assert init.is_file()
    assert "CREATE TABLE usage" in init.read_text(encoding="utf-8")


async def test_opening_creates_the_folder_and_a_private_file_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "store.db"
    async with open_sqlite_store(path) as store:
        assert isinstance(store, SqliteStore)
        assert store.path == path
        assert path.is_file()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert query(path, "PRAGMA journal_mode") == [("wal",)]


async def test_the_store_connection_is_wal_synchronous_normal_with_a_busy_timeout(
    tmp_path: Path,
) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        conn = store._db.conn
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
        assert conn.execute("PRAGMA busy_timeout").fetchone() == (int(BUSY_TIMEOUT_S * 1000),)


async def test_the_schema_has_the_tables_and_usage_indexes(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path):
        pass
    tables = {r[0] for r in query(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {
        "keys",
        "usage",
        "usage_hourly",
        "usage_daily",
        "usage_monthly",
        "usage_retention",
        "orgs",
        "teams",
        "projects",
        "models",
        "settings",
        "secrets",
        "leases",
        "node_certificates",
        "join_tokens",
        "schema_migrations",
    } <= tables
    assert index_columns(path, "usage") == {
        "usage_created_at": ["created_at", "request_id"],
        "usage_key_id": ["key_id", "created_at"],
        "usage_project_id": ["project_id", "created_at"],
        "usage_model": ["model", "created_at"],
    }
    # The roll-up table is stored in its primary key's order (no rowid), so
    # that key is the index ranges of hours are read along.
    assert query(path, "SELECT name, pk FROM pragma_table_info('usage_hourly') WHERE pk > 0") == [
        ("hour", 1),
        ("key_id", 2),
        ("model", 3),
        ("project_id", 4),
        ("team_id", 5),
        ("org_id", 6),
    ]
    assert "WITHOUT ROWID" in str(
        query(path, "SELECT sql FROM sqlite_master WHERE name = 'usage_hourly'")[0][0]
    )


async def test_a_closed_store_refuses_calls(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        pass
    with pytest.raises(StoreError, match="closed"):
        await store.list_keys()
    await store.aclose()  # closing twice is harmless


async def test_a_file_that_is_not_a_database_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="not a database"):
        async with open_sqlite_store(path):
            pass


# --- migrations --------------------------------------------------------------

#: The packaged migrations' versions, as rows of ``SELECT version``.
PACKAGED = [
    (int(p.name[:4]),)
    for p in sorted(
        importlib.resources.files("llmgw.store").joinpath("migrations/sqlite").iterdir(),
        key=lambda p: p.name,
    )
    if p.name.endswith(".sql")
]
LATEST = PACKAGED[-1][0]


async def test_migrations_are_applied_once_and_reopening_is_a_no_op(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path):
        pass
    first = query(path, "SELECT version, name, applied_at FROM schema_migrations")
    async with open_sqlite_store(path):
        pass
    assert query(path, "SELECT version, name, applied_at FROM schema_migrations") == first
    packaged = sorted(
        (int(f.name[:4]), f.name) for f in SQLITE_MIGRATIONS.iterdir() if f.name.endswith(".sql")
    )
    assert packaged[:3] == [
        (1, "0001_init.sql"),
        (2, "0002_tenancy.sql"),
        (3, "0003_personal_keys.sql"),
    ]
    assert [(v, n) for v, n, _ in first] == packaged
    assert backups(path) == []


async def test_a_new_migration_on_an_existing_database_backs_it_up_first(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        await store.insert_key(KEY)

    later = packaged_plus(tmp_path, {"0099_notes.sql": EXTRA_MIGRATION})
    async with open_sqlite_store(path, migrations_dir=later) as store:
        assert await store.get_key("key_1") == KEY

    assert backups(path) == [f"s.db.bak-{LATEST:04d}"]
    backup = path.with_name(f"s.db.bak-{LATEST:04d}")
    # The copy is the database as it was: the packaged versions, the key, no new table.
    assert query(backup, "SELECT version FROM schema_migrations ORDER BY version") == [
        *PACKAGED,
    ]
    assert query(backup, "SELECT id FROM keys") == [("key_1",)]
    assert query(backup, "SELECT name FROM sqlite_master WHERE name = 'notes'") == []
    assert query(backup, "PRAGMA journal_mode") == [("delete",)]
    # The live database has moved on.
    assert query(path, "SELECT version FROM schema_migrations ORDER BY version") == [
        *PACKAGED,
        (99,),
    ]
    assert query(path, "SELECT id, note FROM keys") == [("key_1", "")]

    async with open_sqlite_store(path, migrations_dir=later):
        pass
    assert backups(path) == [f"s.db.bak-{LATEST:04d}"]


async def test_a_new_database_gets_no_backup(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    later = packaged_plus(tmp_path, {"0099_notes.sql": EXTRA_MIGRATION})
    async with open_sqlite_store(path, migrations_dir=later):
        pass
    assert backups(path) == []
    assert query(path, "SELECT version FROM schema_migrations ORDER BY version") == [
        *PACKAGED,
        (99,),
    ]


async def test_a_failing_migration_is_rolled_back_and_stays_pending(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        await store.insert_key(KEY)
    broken = packaged_plus(
        tmp_path,
        {"0099_broken.sql": "CREATE TABLE half (id INTEGER);\nTHIS IS NOT SQL;\n"},
    )
    with pytest.raises(StoreError, match=r"0099_broken\.sql"):
        async with open_sqlite_store(path, migrations_dir=broken):
            pass
    assert query(path, "SELECT version FROM schema_migrations ORDER BY version") == [
        *PACKAGED,
    ]
    assert query(path, "SELECT name FROM sqlite_master WHERE name = 'half'") == []
    assert query(path, "SELECT id FROM keys") == [("key_1",)]


async def test_a_database_from_a_newer_llmgw_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    later = packaged_plus(tmp_path, {"0099_notes.sql": EXTRA_MIGRATION})
    async with open_sqlite_store(path, migrations_dir=later):
        pass
    with pytest.raises(StoreError, match="newer llmgw"):
        async with open_sqlite_store(path):
            pass


@pytest.mark.parametrize("name", ["2_short.sql", "0002-dash.sql", "00002_long.sql"])
async def test_a_badly_named_migration_file_is_refused(tmp_path: Path, name: str) -> None:
    folder = packaged_plus(tmp_path, {name: "SELECT 1;"})
    with pytest.raises(StoreError, match=r"0001_what\.sql"):
        async with open_sqlite_store(tmp_path / "s.db", migrations_dir=folder):
            pass


async def test_two_migration_files_with_one_version_are_refused(tmp_path: Path) -> None:
    folder = packaged_plus(tmp_path, {"0001_again.sql": "SELECT 1;"})
    with pytest.raises(StoreError, match="share version 1"):
        async with open_sqlite_store(tmp_path / "s.db", migrations_dir=folder):
            pass


async def test_files_that_are_not_sql_in_the_migrations_folder_are_ignored(
    tmp_path: Path,
) -> None:
    folder = packaged_plus(tmp_path, {"README.md": "notes"})
    async with open_sqlite_store(tmp_path / "s.db", migrations_dir=folder) as store:
        assert await store.list_keys() == []


async def test_two_stores_opening_one_new_file_at_once_migrate_it_once(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    opened: list[SqliteStore] = []
    all_open = trio.Event()

    async def open_and_hold() -> None:
        async with open_sqlite_store(path) as store:
            opened.append(store)
            if len(opened) == 2:
                all_open.set()
            await all_open.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_and_hold)
        nursery.start_soon(open_and_hold)
    assert query(path, "SELECT version FROM schema_migrations ORDER BY version") == [
        *PACKAGED,
    ]


def only_the_first_migration(tmp_path: Path) -> Path:
    """A migrations folder holding just the shipped ``0001_init.sql``."""
    folder = tmp_path / "migrations-0001"
    folder.mkdir()
    shipped = importlib.resources.files("llmgw.store").joinpath("migrations", "sqlite")
    init = shipped.joinpath("0001_init.sql").read_text(encoding="utf-8")
    (folder / "0001_init.sql").write_text(init, encoding="utf-8")
    return folder


#: Usage rows as a 0001 llmgw wrote them: (request_id, created_at, key_id, model,
#: status, prompt_tokens, cached_tokens, completion_tokens), at awkward times.
OLD_USAGE = [
    ("old_1", -1.0, "key_1", "gemma", 200, 10, 1, 5),
    ("old_2", 0.0, "key_1", "gemma", 200, 20, 2, 6),
    ("old_3", 3599.999, "key_1", "gemma", 502, 0, 0, 0),
    ("old_4", 3600.0, "key_1", "gemma", 200, 40, 4, 8),
    ("old_5", 1_767_227_400.5, "key_2", "qwen", 200, 50, 0, 9),
]


async def test_a_0001_database_keeps_its_keys_and_usage_through_the_tenancy_migration(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path, migrations_dir=only_the_first_migration(tmp_path)):
        pass
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(
            "INSERT INTO keys (id, name, key_hash, prefix, created_at, is_admin) VALUES"
            " ('key_1', 'one', ?, 'sk-llmgw-aaaa', 1.0, 1)",
            ("a" * 64,),
        )
        conn.execute(
            "INSERT INTO keys (id, name, key_hash, prefix, created_at, revoked_at, expires_at)"
            " VALUES ('key_2', 'two', ?, 'sk-llmgw-bbbb', 2.0, 3.0, 4.0)",
            ("b" * 64,),
        )
        conn.executemany(
            "INSERT INTO usage (request_id, created_at, key_id, model, status, prompt_tokens,"
            " cached_tokens, completion_tokens, duration_ms, replica_id, stream, endpoint)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 12.5, 'r/0', 1, '/v1/chat/completions')",
            OLD_USAGE,
        )
        conn.commit()

    async with open_sqlite_store(path) as store:
        # The keys are there with no project, band, limits or last use, and work.
        one = KeyRecord(
            id="key_1",
            name="one",
            key_hash="a" * 64,
            prefix="sk-llmgw-aaaa",
            created_at=1.0,
            is_admin=True,
        )
        two = KeyRecord(
            id="key_2",
            name="two",
            key_hash="b" * 64,
            prefix="sk-llmgw-bbbb",
            created_at=2.0,
            revoked_at=3.0,
            expires_at=4.0,
        )
        assert await store.list_keys() == [one, two]
        assert await store.find_key_by_hash("a" * 64) == one
        # The usage rows are there with empty tree ids and no cost.
        old_rows = [
            UsageRow(
                request_id=rid,
                created_at=at,
                key_id=key,
                model=model,
                status=status,
                prompt_tokens=prompt,
                cached_tokens=cached,
                completion_tokens=completion,
                duration_ms=12.5,
                replica_id="r/0",
                stream=True,
                endpoint="/v1/chat/completions",
            )
            for rid, at, key, model, status, prompt, cached, completion in OLD_USAGE
        ]
        assert await store.export_usage(-HOUR_S, None) == old_rows
        # They were summed into the roll-ups, hour by hour as new rows are.
        assert query(path, "SELECT hour, key_id, requests FROM usage_hourly ORDER BY hour") == [
            (-3600, "key_1", 1),
            (0, "key_1", 2),
            (3600, "key_1", 1),
            (1_767_225_600, "key_2", 1),
        ]
        assert [
            (s.group, s.requests, s.prompt_tokens, s.cached_tokens, s.completion_tokens)
            for s in await store.usage_summary("key", -HOUR_S)
        ] == [
            ("key_1", 4, 70, 7, 19),
            ("key_2", 1, 50, 0, 9),
        ]
        assert await store.spend_since_by_scope(-HOUR_S) == {"key:key_1": 0, "key:key_2": 0}
        # The errors (status 400 or more) were counted into the hourly
        # roll-ups, and the daily roll-ups summed from them.
        assert query(path, "SELECT hour, errors FROM usage_hourly ORDER BY hour") == [
            (-3600, 0),
            (0, 1),
            (3600, 0),
            (1_767_225_600, 0),
        ]
        assert query(
            path,
            "SELECT day, key_id, requests, prompt_tokens, errors FROM usage_daily ORDER BY day",
        ) == [
            (-86400, "key_1", 1, 10, 0),
            (0, "key_1", 3, 60, 1),
            (1_767_225_600, "key_2", 1, 50, 0),
        ]
        assert query(path, "SELECT month, key_id, requests, errors FROM usage_monthly") == [
            (-2678400, "key_1", 1, 0),  # 1969-12-01
            (0, "key_1", 3, 1),
            (1_767_225_600, "key_2", 1, 0),
        ]
        assert await store.usage_pruned_before() is None

        # An old key moves into the tree; new usage adds into the old hours.
        path_, _ = await store.ensure_project("Acme", "ml", "train", now=10.0)
        assert await store.update_key(attrs.evolve(one, project_id=path_.project.id)) is True
        await store.insert_usage(
            [
                UsageRow(
                    request_id="new_1",
                    created_at=3599.0,
                    key_id="key_1",
                    model="gemma",
                    status=200,
                    cost_micros=7,
                )
            ]
        )
        assert query(path, "SELECT requests, cost_micros FROM usage_hourly WHERE hour = 0") == [
            (3, 7)
        ]
        assert await store.spend_since_by_scope(0.0) == {"key:key_1": 7, "key:key_2": 0}

    assert backups(path) == ["s.db.bak-0001"]
    assert query(path.with_name("s.db.bak-0001"), "SELECT count(*) FROM usage") == [(5,)]


async def test_the_roll_up_hour_of_the_migration_is_the_one_insert_usage_uses(
    tmp_path: Path,
) -> None:
    """The migration floors times in SQL; the store in Python: they must agree."""
    times = [-7200.5, -3600.0, -0.25, 0.0, 0.5, 3599.9999999, 3600.0, 1_767_225_599.999999]
    path = tmp_path / "s.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        sql = (
            "SELECT (CAST(:t / 3600 AS INTEGER) - (:t < CAST(:t / 3600 AS INTEGER) * 3600)) * 3600"
        )
        migration = (
            importlib.resources.files("llmgw.store")
            .joinpath("migrations", "sqlite", "0002_tenancy.sql")
            .read_text(encoding="utf-8")
        )
        assert sql.replace(":t", "created_at") in " ".join(migration.split())
        assert [conn.execute(sql, {"t": t}).fetchone()[0] for t in times] == [
            hour_of(t) for t in times
        ]
    assert [hour_of(t) for t in times] == [-10800, -3600, -3600, 0, 0, 0, 3600, 1_767_222_000]


async def test_the_roll_up_month_of_the_migration_is_the_one_insert_usage_uses(
    tmp_path: Path,
) -> None:
    """The migration finds a day's month in SQL; the store in Python: they must agree."""
    days = [-86400 * 400, -86400, 0, 86400 * 31, 1_767_225_600, 1_772_236_800, 4_102_444_800]
    path = tmp_path / "s.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        sql = "SELECT CAST(strftime('%s', :day, 'unixepoch', 'start of month') AS INTEGER)"
        migration = (
            importlib.resources.files("llmgw.store")
            .joinpath("migrations", "sqlite", "0007_usage_retention.sql")
            .read_text(encoding="utf-8")
        )
        assert sql.split("SELECT ")[1].replace(":day", "day") in " ".join(migration.split())
        assert [conn.execute(sql, {"day": d}).fetchone()[0] for d in days] == [
            month_of(d) for d in days
        ]
    assert month_of(1_772_236_800 + 3599.5) == 1_769_904_000  # 2026-02-28 → 2026-02-01


# --- several connections on one file ----------------------------------------


async def test_two_stores_on_one_file_write_at_once_without_locking_errors(
    tmp_path: Path,
) -> None:
    """Like two processes on one file: each has its own connection and limiter."""
    path = tmp_path / "s.db"

    async def write(store: SqliteStore, side: str) -> None:
        for i in range(40):
            await store.insert_usage(
                [
                    UsageRow(
                        request_id=f"{side}-{i}-{j}",
                        created_at=float(i),
                        key_id=side,
                        model="m",
                        status=200,
                    )
                    for j in range(5)
                ]
            )

    async with open_sqlite_store(path) as a, open_sqlite_store(path) as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write, a, "a")
            nursery.start_soon(write, b, "b")
        assert len(await a.list_usage(last=1_000)) == 400


async def test_a_lock_held_elsewhere_past_the_busy_timeout_becomes_a_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw.store import sqlite as sqlite_module

    monkeypatch.setattr(sqlite_module, "LOCKED_FIRST_DELAY_S", 0.001)
    monkeypatch.setattr(sqlite_module, "LOCKED_ATTEMPTS", 2)
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        store._db.conn.execute("PRAGMA busy_timeout = 1")
        with contextlib.closing(sqlite3.connect(path, timeout=0.001)) as other:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreError, match="locked"):
                await store.put_setting("x", 1)
            other.execute("ROLLBACK")
        await store.put_setting("x", 2)
        assert await store.get_setting("x") == 2


async def test_a_lock_released_during_the_retries_lets_the_write_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw.store import sqlite as sqlite_module

    monkeypatch.setattr(sqlite_module, "LOCKED_FIRST_DELAY_S", 0.05)
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        store._db.conn.execute("PRAGMA busy_timeout = 1")
        with contextlib.closing(sqlite3.connect(path, timeout=0.001)) as other:
            other.execute("BEGIN IMMEDIATE")

            async def release_soon() -> None:
                await trio.sleep(0.03)
                other.execute("ROLLBACK")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(release_soon)
                await store.put_setting("x", 1)
        assert await store.get_setting("x") == 1


# --- open_store --------------------------------------------------------------


async def test_open_store_takes_a_file_path(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    async with open_store(str(path)) as store:
        await store.put_setting("x", 1)
    assert query(path, "SELECT value FROM settings") == [("1",)]


async def test_open_store_takes_a_sqlite_url(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    async with open_store(f"sqlite:///{path}") as store:
        await store.put_setting("x", 1)
    assert path.is_file()


async def test_open_store_reads_a_sqlite_url_with_three_slashes_as_a_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with open_store("sqlite:///rel/c.db"):
        pass
    assert (tmp_path / "rel" / "c.db").is_file()


@pytest.mark.parametrize("address", ["mysql://x/y", "sqlite://relative.db", "sqlite:x.db"])
def test_open_store_refuses_other_schemes(address: str) -> None:
    with pytest.raises(ValueError, match="not supported"):
        open_store(address)


@pytest.mark.parametrize("address", ["", "  ", "sqlite:///"])
def test_open_store_refuses_an_address_with_no_file(address: str) -> None:
    with pytest.raises(ValueError, match="names no file"):
        open_store(address)


async def test_cancelling_the_block_still_closes_the_store(tmp_path: Path) -> None:
    kept: list[SqliteStore] = []
    with trio.move_on_after(0.05):
        async with open_sqlite_store(tmp_path / "s.db") as store:
            kept.append(store)
            await trio.sleep_forever()
    with pytest.raises(StoreError, match="closed"):
        await kept[0].list_keys()
    async with open_sqlite_store(tmp_path / "s.db") as again:
        assert await again.list_keys() == []

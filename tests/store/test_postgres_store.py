"""What only the PostgreSQL backend does: its address forms, connection
settings, multi-host addresses, migrations, bulk usage writes.

The contract suite (``test_*_contract.py``) runs on PostgreSQL too; these are
the parts SQLite has no counterpart for. The server is the session's
throwaway one (``conftest.py``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import psycopg
import pytest
import trio
from psycopg.conninfo import conninfo_to_dict

import llmgw.store
from llmgw.store import (
    Conflict,
    Fenced,
    KeyRecord,
    ModelRecord,
    PostgresStore,
    StoreError,
    UsageRow,
    open_store,
)
from llmgw.store.postgres import (
    CONNECT_TIMEOUT_S,
    TCP_USER_TIMEOUT_MS,
    describe_address,
    is_postgres_address,
    open_postgres_store,
    postgres_conninfo,
)

#: The packaged PostgreSQL migrations.
MIGRATIONS = Path(llmgw.store.__file__).parent / "migrations" / "postgres"

T0 = 1_699_999_200.0  # an hour boundary (2023-11-14 22:00 UTC)


# --- addresses ---------------------------------------------------------------


def _params(address: str) -> dict[str, str]:
    """The connection parameters llmgw uses for ``address``, as text."""
    return {k: str(v) for k, v in conninfo_to_dict(postgres_conninfo(address)).items()}


@pytest.mark.parametrize(
    "address",
    [
        "postgresql://llmgw@db1,db2/llmgw",
        "postgres://x/y",
        "PostgreSQL://x/y",
        "postgresql+psycopg://u:pw@h:5433/d",
        "host=a,b,c dbname=llmgw target_session_attrs=read-write",
        "dbname=llmgw",
    ],
)
def test_postgresql_addresses_are_recognised(address: str) -> None:
    assert is_postgres_address(address)


@pytest.mark.parametrize(
    "address", ["/var/lib/llmgw/store.db", "sqlite:///x.db", "store.db", "mysql://x/y", ""]
)
def test_other_addresses_are_not_postgresql(address: str) -> None:
    assert not is_postgres_address(address)


def test_the_connection_gets_timeouts_keepalives_and_a_name() -> None:
    params = _params("postgresql://u@db1:5432/llmgw")
    assert params["connect_timeout"] == str(CONNECT_TIMEOUT_S) == "3"
    assert params["keepalives"] == "1"
    assert int(params["keepalives_idle"]) > 0
    assert int(params["keepalives_interval"]) > 0
    assert int(params["keepalives_count"]) > 0
    assert params["tcp_user_timeout"] == str(TCP_USER_TIMEOUT_MS)
    assert params["application_name"] == "llmgw"
    assert "-c statement_timeout=10000" in params["options"]
    assert "-c lock_timeout=5000" in params["options"]
    # One host: no session attribute forced.
    assert "target_session_attrs" not in params


def test_a_multi_host_address_asks_for_the_primary() -> None:
    uri = _params("postgresql://u@a:5432,b:5432,c:5432/llmgw")
    assert uri["host"] == "a,b,c"
    assert uri["target_session_attrs"] == "read-write"
    dsn = _params("host=a,b,c dbname=llmgw user=u")
    assert dsn["target_session_attrs"] == "read-write"


def test_settings_in_the_address_win() -> None:
    params = _params(
        "host=a,b connect_timeout=7 target_session_attrs=any options='-c statement_timeout=1000'"
    )
    assert params["connect_timeout"] == "7"
    assert params["target_session_attrs"] == "any"
    assert "statement_timeout=1000" in params["options"]
    assert "statement_timeout=10000" not in params["options"]
    assert "lock_timeout=5000" in params["options"]


def test_an_address_libpq_cannot_read_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a PostgreSQL connection string"):
        postgres_conninfo("host='unterminated")


def test_messages_name_hosts_and_database_but_never_the_password() -> None:
    text = describe_address(postgres_conninfo("postgresql://u:s3cret@a:5432,b:5433/llmgw"))
    assert text == "postgresql://a:5432,b:5433/llmgw"
    assert "s3cret" not in text


# --- opening -----------------------------------------------------------------


async def test_open_store_opens_a_postgresql_address(postgres_db: str) -> None:
    async with open_store(postgres_db) as store:
        assert isinstance(store, PostgresStore)
        await store.put_setting("k", 1)
    async with open_store(postgres_db.replace("postgresql://", "postgres://", 1)) as store:
        assert await store.get_setting("k") == 1


async def test_a_dsn_with_a_dead_member_first_lands_on_the_live_one(postgres_db: str) -> None:
    params = conninfo_to_dict(postgres_db)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    dsn = (
        f"host=127.0.0.1,127.0.0.1 port={dead_port},{params['port']} "
        f"dbname={params['dbname']} user={params['user']} target_session_attrs=read-write"
    )
    async with open_store(dsn) as store:
        await store.put_setting("k", "v")
        assert await store.get_setting("k") == "v"


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections and never answers: a hung member."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


async def test_a_member_that_never_answers_costs_the_connect_timeout_then_the_next_is_tried(
    postgres_db: str, silent_port: int
) -> None:
    params = conninfo_to_dict(postgres_db)
    dsn = (
        f"host=127.0.0.1,127.0.0.1 port={silent_port},{params['port']} "
        f"dbname={params['dbname']} user={params['user']}"
    )
    started = time.monotonic()
    async with open_store(dsn) as store:
        assert await store.settings_version() == 0
    elapsed = time.monotonic() - started
    # Opening connects twice (the migrations' connection, then the pool's
    # first), each waiting out the hung member once.
    assert CONNECT_TIMEOUT_S - 0.5 <= elapsed < 2 * CONNECT_TIMEOUT_S + 5


async def test_a_store_no_member_of_which_answers_fails_to_open_with_a_store_error() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(StoreError, match=rf"cannot connect to the PostgreSQL store .*:{port}"):
        async with open_store(f"postgresql://u:s3cret@127.0.0.1:{port}/x"):
            pass


async def test_connections_run_with_the_statement_and_lock_timeouts(postgres_db: str) -> None:
    def show() -> tuple[str, str, str]:
        with psycopg.connect(postgres_conninfo(postgres_db)) as conn:
            rows = [
                conn.execute(f"SHOW {name}").fetchone()
                for name in ("statement_timeout", "lock_timeout", "application_name")
            ]
        assert all(r is not None for r in rows)
        return tuple(str(r[0]) for r in rows if r is not None)  # type: ignore[return-value]

    assert await trio.to_thread.run_sync(show) == ("10s", "5s", "llmgw")


async def test_a_closed_store_refuses_calls(postgres_db: str) -> None:
    async with open_postgres_store(postgres_db) as store:
        pass
    with pytest.raises(StoreError, match="closed"):
        await store.get_setting("k")


# --- migrations --------------------------------------------------------------


async def test_migrations_are_applied_once_and_recorded(postgres_db: str) -> None:
    async with open_postgres_store(postgres_db):
        pass
    async with open_postgres_store(postgres_db):
        pass
    with psycopg.connect(postgres_db) as conn:
        rows = conn.execute("SELECT version, name FROM schema_migrations").fetchall()
    packaged = sorted(
        (int(f.name[:4]), f.name) for f in MIGRATIONS.iterdir() if f.name.endswith(".sql")
    )
    assert packaged[:2] == [(1, "0001_init.sql"), (2, "0002_usage_guard.sql")]
    assert rows == packaged


async def test_two_stores_opening_one_new_database_at_once_migrate_it_once(
    postgres_db: str,
) -> None:
    async def open_one() -> None:
        async with open_postgres_store(postgres_db) as store:
            await store.settings_version()

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(open_one)
    with psycopg.connect(postgres_db) as conn:
        row = conn.execute("SELECT count(*) FROM schema_migrations").fetchone()
    assert row == (len([f for f in MIGRATIONS.iterdir() if f.name.endswith(".sql")]),)


async def test_a_database_from_a_newer_llmgw_is_refused(postgres_db: str) -> None:
    async with open_postgres_store(postgres_db):
        pass
    with psycopg.connect(postgres_db) as conn:
        conn.execute(
            "INSERT INTO schema_migrations (version, name, applied_at) VALUES (999, 'x.sql', 0)"
        )
    with pytest.raises(StoreError, match=r"\[999\].*newer llmgw"):
        async with open_postgres_store(postgres_db):
            pass


async def test_a_failing_migration_is_rolled_back_and_named(
    postgres_db: str, tmp_path: Path
) -> None:
    (tmp_path / "0001_ok.sql").write_text("CREATE TABLE a (x INTEGER);")
    (tmp_path / "0002_bad.sql").write_text("CREATE TABLE b (x INTEGER); SELECT nope FROM nowhere;")
    with pytest.raises(StoreError, match=r"migration 0002_bad\.sql failed"):
        async with open_postgres_store(postgres_db, migrations_dir=tmp_path):
            pass
    with psycopg.connect(postgres_db) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_migrations")]
        tables = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
    assert versions == [1]
    assert "a" in tables
    assert "b" not in tables


# --- bulk usage ----------------------------------------------------------------


def _row(i: int) -> UsageRow:
    return UsageRow(
        request_id=f"req-{i:06d}",
        created_at=T0 + i * 0.5,
        key_id=f"key_{i % 7}",
        model="gemma",
        status=500 if i % 10 == 0 else 200,
        prompt_tokens=10,
        completion_tokens=5,
        cost_micros=3,
        ttft_ms=None if i % 2 else 12.5,
        stream=bool(i % 3),
    )


async def test_a_large_usage_batch_is_written_fast_and_exactly_once(postgres_db: str) -> None:
    rows = [_row(i) for i in range(5_000)]
    async with open_postgres_store(postgres_db) as store:
        started = time.monotonic()
        await store.insert_usage(rows)
        elapsed = time.monotonic() - started
        # Retried with the first half again and new rows: only the new ones count.
        await store.insert_usage([*rows[:2_500], _row(5_000), _row(5_001)])
        summary = await store.usage_summary("model", T0 - 3_600, None)
        assert await store.get_usage("req-000001") == rows[1]
    assert elapsed < 5.0, f"5,000 usage rows took {elapsed:.2f} s"
    assert len(summary) == 1
    assert summary[0].requests == 5_002
    assert summary[0].cost_micros == 3 * 5_002
    assert summary[0].errors == 501


async def test_two_control_planes_writing_overlapping_batches_count_each_row_once(
    postgres_db: str,
) -> None:
    rows = [_row(i) for i in range(2_000)]
    async with (
        open_postgres_store(postgres_db) as first,
        open_postgres_store(postgres_db) as second,
        trio.open_nursery() as nursery,
    ):
        # Each sends every row, in its own batches and order, at once.
        for start in range(0, 2_000, 250):
            nursery.start_soon(first.insert_usage, rows[start : start + 250])
            nursery.start_soon(second.insert_usage, rows[::-1][start : start + 250])
    async with open_postgres_store(postgres_db) as store:
        summary = await store.usage_summary("key", T0 - 3_600, None)
        exported = await store.export_usage(T0 - 3_600, None, limit=5_000)
    assert sum(s.requests for s in summary) == 2_000
    assert sum(s.cost_micros for s in summary) == 3 * 2_000
    assert sorted(r.request_id for r in exported) == sorted(r.request_id for r in rows)


async def test_a_conflict_names_the_constraint_not_the_value(postgres_db: str) -> None:
    key = KeyRecord(id="key_1", name="k", key_hash="ab" * 32, prefix="sk-", created_at=1.0)
    async with open_postgres_store(postgres_db) as store:
        await store.insert_key(key)
        with pytest.raises(Conflict, match="keys_key_hash_key") as refused:
            await store.insert_key(attrs.evolve(key, id="key_2"))
    assert "ab" * 32 not in str(refused.value)


# --- fencing under contention ----------------------------------------------------


async def test_a_takeover_waits_for_a_fenced_write_already_checked(postgres_db: str) -> None:
    async with open_postgres_store(postgres_db) as store:
        old = await store.acquire_lease("leader", "cp-a", ttl_s=10.0, now=1_000.0)
        assert old is not None
        done: list[str] = []

        async def write() -> None:
            await store.put_model(ModelRecord.simple("m", "sim"), fence=old)
            done.append("write")

        async def take_over() -> None:
            new = await store.acquire_lease("leader", "cp-b", ttl_s=10.0, now=1_011.0)
            assert new is not None
            assert new.epoch == 2
            done.append("takeover")

        # Another session holds the models table: the fenced write has
        # checked its lease (and holds the lease row) but cannot finish.
        with psycopg.connect(postgres_db) as blocker:
            blocker.execute("LOCK TABLE models IN EXCLUSIVE MODE")

            async def waiting(count: int) -> None:
                with trio.fail_after(5):
                    while True:
                        row = blocker.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
                        if row.fetchone() == (count,):
                            return
                        await trio.sleep(0.02)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                await waiting(1)  # the write waits for the table
                nursery.start_soon(take_over)
                await waiting(2)  # the takeover waits for the lease row
                assert done == []
                blocker.rollback()
        # Both went through: the write was not fenced off by the takeover
        # that came while it waited (the two threads' returns to trio may
        # come in either order, so that order is not asserted).
        assert sorted(done) == ["takeover", "write"]
        assert await store.get_model("m") is not None
        with pytest.raises(Fenced):
            await store.delete_model("m", fence=old)


# --- the store unreachable ---------------------------------------------------


async def test_an_unreachable_store_fails_fast_while_one_call_tries(postgres_db: str) -> None:
    dbname = conninfo_to_dict(postgres_db)["dbname"]
    admin_address = postgres_db.rsplit("/", 1)[0] + "/postgres"

    def cut(allow: bool) -> None:
        with psycopg.connect(admin_address, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE {dbname} WITH ALLOW_CONNECTIONS {str(allow).lower()}")
            if not allow:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (dbname,),
                )

    async with open_postgres_store(postgres_db) as store:
        await store.put_setting("k", 1)
        await trio.to_thread.run_sync(cut, False)
        try:
            with pytest.raises(StoreError):
                await store.get_setting("k")  # finds it unreachable
            outcomes: list[str] = []

            async def call() -> None:
                try:
                    await store.get_setting("k")
                except StoreError as exc:
                    outcomes.append(str(exc))

            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(call)
            assert len(outcomes) == 4
            # One tries; the others fail at once meanwhile.
            assert sum("not tried again yet" in o for o in outcomes) >= 2, outcomes
        finally:
            await trio.to_thread.run_sync(cut, True)

        async def answers() -> bool:
            try:
                return await store.get_setting("k") == 1
            except StoreError:
                return False

        with trio.fail_after(60):
            while not await answers():  # noqa: ASYNC110 (the store, polled)
                await trio.sleep(0.5)

"""PostgreSQL stopped for 30 s under load, then started again: two ``llmgw
server`` on it (a throwaway server, ``pg_ctl stop -m fast`` / ``start``),
one node with a sim engine, clients given both control planes' addresses.

While the store is down, requests with keys already seen keep being
answered (the leader, cut off from the store, still routes over the
replicas it knows; the standby forwards to it), the leader gives up the
leader-only work once it cannot renew its lease (``/leader`` 503
everywhere), and the usage rows wait in the journals. Once PostgreSQL is
back the cluster settles on one leader, the engine was never restarted,
and every answered request's usage row reaches the store. The figures are
printed, not asserted (``docs/ha.md``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

if TYPE_CHECKING:
    from tests.e2e.processes import (
        HaCluster,
        Load,
        Process,
        engines,
        kill_new_engines,
        started_processes,
        wait_until,
    )
else:  # tests is no package: pytest puts this folder on sys.path
    from processes import (
        HaCluster,
        Load,
        Process,
        engines,
        kill_new_engines,
        started_processes,
        wait_until,
    )

NODE = "node-pg-down"
MODEL = "sim-pg-down"
ENGINE_PORTS = (23400, 23499)
OUTAGE_S = 30.0


@pytest.fixture(name="started")
def started_fixture() -> Iterator[list[Process]]:
    before = list(engines(ENGINE_PORTS))
    yield from started_processes()
    kill_new_engines(before, ENGINE_PORTS)


@pytest.mark.slow
def test_postgresql_stopped_for_30_s_under_load_loses_nothing(
    tmp_path: Path, started: list[Process], postgres_server: Any, postgres_db: str
) -> None:
    cluster = HaCluster(tmp_path, postgres_db, started, ENGINE_PORTS)
    cluster.start(MODEL, NODE)
    apis = cluster.apis
    leader = cluster.servers["cp-a"]
    engines_before = engines(ENGINE_PORTS)
    assert len(engines_before) == 1
    load = Load([apis["cp-a"], apis["cp-b"]], cluster.key, MODEL)
    figures: list[str] = []
    with load:
        time.sleep(3)
        assert load.answers, load.why
        load.take_why()
        stopped = time.monotonic()
        postgres_server.stop()
        try:
            # The leader cannot renew: it stops the leader-only work at the
            # lease's expiry, and nobody leads while the store is down.
            wait_until(
                lambda: "could not renew the leader lease" in leader.log(),
                30,
                f"the leader giving up:\n{leader.log()}",
            )
            gave_up_s = time.monotonic() - stopped
            wait_until(lambda: not cluster.leaders(), 10, "no control plane leading")
            time.sleep(max(0.0, stopped + OUTAGE_S - time.monotonic()))
            assert not cluster.leaders()
        finally:
            started_again = time.monotonic()
            postgres_server.start()
        answered_down = load.answered_between(stopped, started_again)
        # After the lease expired, with nobody leading: still answered.
        answered_leaderless = load.answered_between(stopped + gave_up_s, started_again)
        failed_down = load.failed_between(stopped, started_again)
        why_down = load.take_why()
        one = wait_until(lambda: cluster.leaders(), 60, "a leader once the store is back")
        settled_s = time.monotonic() - started_again
        time.sleep(5)
        assert cluster.leaders() == one, "not one leader"
        assert len(one) == 1
        assert engines(ENGINE_PORTS) == engines_before, "the engine was restarted"
        answered_after = len(load.answers)
        time.sleep(2)
        assert len(load.answers) > answered_after, load.why
    assert answered_leaderless > 0, why_down
    answered = load.request_ids()

    def stored() -> set[str]:
        with psycopg.connect(postgres_db) as conn:
            return {r[0] for r in conn.execute("SELECT request_id FROM usage")}

    # The journals are written into the store once it answers again.
    wait_until(lambda: answered <= stored(), 60, "every answered request's usage row")
    lost = answered - stored()
    figures.append(
        f"store stopped {started_again - stopped:.1f} s: {answered_down} answered meanwhile "
        f"({answered_leaderless} after the leader gave up at {gave_up_s:.1f} s), "
        f"{failed_down} failed; failed attempts by cause: {why_down}"
    )
    figures.append(
        f"one leader ({one[0]}) {settled_s:.1f} s after the store was started again; "
        f"engines restarted: 0; answers in the run: {len(answered)}, usage rows lost: {len(lost)}"
    )
    print("\nstore outage figures:\n  " + "\n  ".join(figures))
    assert not lost

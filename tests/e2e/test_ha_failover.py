"""Two ``llmgw server`` on one PostgreSQL (a throwaway server, ``pg_ctl``)
and one node (``llmgw join``, mutual TLS) with a sim engine, under
continuous load from clients given both control planes' addresses.

SIGKILL the leader: the standby leads, the agent links to it, the engine
keeps its pid, requests succeed again, and once the killed control plane
is started again (replaying its usage journal) no answered request lacks
its usage row. Then the same with SIGTERM on the new leader. Run with the
default lease TTL (10 s) and a short one (3 s, ``--lease-ttl``). The
figures (time from the signal to the first answer by the new leader,
requests failed in the gap) are printed, not asserted (``docs/ha.md``)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
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
        status,
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
        status,
        wait_until,
    )

NODE = "node-ha"
MODEL = "sim-ha"
ENGINE_PORTS = (23300, 23399)


@pytest.fixture(name="started")
def started_fixture() -> Iterator[list[Process]]:
    before = list(engines(ENGINE_PORTS))
    yield from started_processes()
    kill_new_engines(before, ENGINE_PORTS)


@pytest.mark.slow
@pytest.mark.parametrize("lease_ttl_s", [None, 3.0], ids=["ttl-default", "ttl-3s"])
def test_the_standby_takes_over_on_sigkill_and_on_sigterm_losing_nothing(
    tmp_path: Path, started: list[Process], postgres_db: str, lease_ttl_s: float | None
) -> None:
    cluster = HaCluster(tmp_path, postgres_db, started, ENGINE_PORTS, lease_ttl_s=lease_ttl_s)
    names, apis = cluster.names, cluster.apis
    cluster.start(MODEL, NODE)
    assert "ready in" not in cluster.servers["cp-b"].log()  # a standby
    # Both serve the same cluster CA (kept in the store).
    assert (tmp_path / "cp-a" / "ca" / "ca.crt").read_bytes() == (
        tmp_path / "cp-b" / "ca" / "ca.crt"
    ).read_bytes()
    assert status(f"http://{apis['cp-a']}/leader") == 200
    assert status(f"http://{apis['cp-b']}/leader") == 503
    assert status(f"http://{apis['cp-b']}/health") == 200
    engines_before = engines(ENGINE_PORTS)
    assert len(engines_before) == 1
    key = cluster.key
    load = Load([apis[n] for n in names], key, MODEL)
    load_started = time.monotonic()
    figures: list[str] = []
    with load:
        time.sleep(3)
        # Through the standby too: it forwards /v1 to the leader.
        forwarded = httpx.post(
            f"http://{apis['cp-b']}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert forwarded.status_code == 200, forwarded.text

        for how, old, new in ((signal.SIGKILL, "cp-a", "cp-b"), (signal.SIGTERM, "cp-b", "cp-a")):
            old_api, new_api = apis[old], apis[new]
            # The new leader is tried only when the old one fails: an answer
            # from it after the signal is its own, not one it forwarded.
            load.apis = [old_api, new_api]
            time.sleep(1)
            answered_before = len(load.answers)
            load.take_why()
            signalled = time.monotonic()
            cluster.servers[old].signal(how)

            def answered_by_new(api: str = new_api, since: float = signalled) -> float | None:
                return load.first_answer_by(api, since)

            agent_log = cluster.agent.log() if cluster.agent is not None else ""
            first = wait_until(
                answered_by_new,
                60,
                f"an answer by {new} after {how.name}:\n{cluster.servers[new].log()}\n{agent_log}",
            )
            cluster.servers[old].process.wait(timeout=30)
            time.sleep(3)
            failed = load.failed_between(signalled, time.monotonic())
            why = load.take_why()
            assert status(f"http://{new_api}/leader") == 200
            assert engines(ENGINE_PORTS) == engines_before, "the engine was restarted"
            assert len(load.answers) > answered_before
            figures.append(
                f"{how.name} {old}: first answer by {new} after {first - signalled:.2f} s; "
                f"requests failed in the gap: {failed}; engines restarted: 0; "
                f"failed attempts by cause (either control plane): {why}"
            )
            # The old control plane comes back as a standby (replaying its journal).
            cluster.restart(old)
            assert status(f"http://{old_api}/leader") == 503
        time.sleep(2)
    load_s = time.monotonic() - load_started
    answered = load.request_ids()
    assert answered

    def stored() -> set[str]:
        with psycopg.connect(postgres_db) as conn:
            return {r[0] for r in conn.execute("SELECT request_id FROM usage")}

    # The leader's usage writer flushes within its interval; under a loaded
    # machine (CI beside itself) it has fallen more than 30 s behind once.
    wait_until(lambda: answered <= stored(), 90, "every answered request's usage row")
    lost = answered - stored()
    figures.append(
        f"lease TTL {lease_ttl_s or 10:g} s; answers: {len(answered)} in {load_s:.0f} s "
        f"({len(answered) / load_s:.1f}/s); usage rows lost: {len(lost)}; "
        f"requests failed over the whole run: {len(load.failed)}"
    )
    print("\nHA failover figures:\n  " + "\n  ".join(figures))
    assert not lost

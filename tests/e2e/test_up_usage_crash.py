"""Usage that survives a crash: `llmgw up --engine sim` under a steady load
is SIGKILLed at several moments and started again on the same data
directory; every request whose client got the end of its answer has its
usage row (``docs/up.md``, "Usage that survives a crash")."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from llmgw.app.control_plane import GRACE_S

#: Roomy limits: the load is far over the default 60 requests a minute.
SETTINGS = {"auth": {"default_rpm": 1_000_000, "default_tpm": 10**10}}
MODEL = "sim-model"


class Load:
    """Client threads sending requests until stopped; ``ended`` holds the
    request ids whose answers arrived whole (a stream's ``[DONE]``, or a
    whole answer's body read and parsed)."""

    def __init__(self, base_url: str, key: str, threads: int = 4) -> None:
        self.base_url = base_url
        self.key = key
        self.ended: set[str] = set()
        #: Streams whose head came but whose end never did.
        self.cut: set[str] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(threads)
        ]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def count(self) -> int:
        with self.lock:
            return len(self.ended)

    def _run(self, n: int) -> None:
        with httpx.Client(timeout=10) as http:
            i = 0
            while not self.stop.is_set():
                i += 1
                try:
                    ended = self._stream(http) if (n + i) % 2 else self._whole(http)
                except (httpx.HTTPError, ValueError):
                    ended = None  # cut by the kill: no whole answer
                if ended is not None:
                    with self.lock:
                        self.ended.add(ended)

    def _body(self, stream: bool) -> dict[str, object]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": "count to ten"}],
            # Streams long enough to be cut with tokens seen.
            "max_tokens": 128 if stream else 16,
            "stream": stream,
        }

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def _stream(self, http: httpx.Client) -> str | None:
        url = f"{self.base_url}/v1/chat/completions"
        with http.stream("POST", url, json=self._body(True), headers=self._headers()) as answer:
            if answer.status_code != 200:
                return None
            request_id = answer.headers["x-request-id"]
            try:
                for line in answer.iter_lines():
                    if line == "data: [DONE]":
                        return str(request_id)
            except httpx.HTTPError:
                pass
            with self.lock:
                self.cut.add(request_id)
        return None

    def _whole(self, http: httpx.Client) -> str | None:
        url = f"{self.base_url}/v1/chat/completions"
        answer = http.post(url, json=self._body(False), headers=self._headers())
        if answer.status_code != 200 or "choices" not in answer.json():
            return None
        return answer.headers["x-request-id"]


def _stored_ids(data_dir: Path) -> set[str]:
    db = sqlite3.connect(data_dir / "llmgw.db", timeout=30)
    try:
        return {r[0] for r in db.execute("SELECT request_id FROM usage")}
    finally:
        db.close()


def _up_with_a_key(start_up: Any, data: Path, name: str) -> tuple[Any, str]:
    """``llmgw up`` on a sim in ``data`` (with :data:`SETTINGS`), ready, and a
    new key ``name`` of project Acme/ml/load."""
    data.mkdir()
    (data / "server.yaml").write_text(json.dumps(SETTINGS))
    up = start_up("--engine", "sim", "--model-name", MODEL)
    up.wait_ready()
    made = up.cli("keys", "create", name, "--project", "Acme/ml/load", "--json")
    assert made.returncode == 0, made.stderr
    return up, str(json.loads(made.stdout)["key"])


def _restarted(start_up: Any, data: Path, ports: str) -> Any:
    """``llmgw up`` again in ``data`` after its process was SIGKILLed, on the
    engine ports ``ports`` (``A-B``) it had (the engines live on); ready."""
    (data / "run.json").unlink(missing_ok=True)  # the killed process's
    up = start_up("--engine", "sim", "--model-name", MODEL, "--engine-ports", ports)
    up.wait_ready()
    return up


def test_no_usage_row_is_lost_when_llmgw_is_killed_under_load(
    start_up: Any, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    up, key = _up_with_a_key(start_up, data, "crash-test")
    ports = f"{up.engine_ports[0]}-{up.engine_ports[1]}"
    ended: set[str] = set()
    cut: set[str] = set()
    # Killed at three moments of the load: early, later, and well into it.
    for kill_after in (5, 40, 120):
        with Load(up.base_url, key) as load:
            up.wait_for(lambda n=kill_after: load.count() >= n, 120, f"{kill_after} answers")
            up.process.send_signal(signal.SIGKILL)
            up.process.wait(timeout=30)
        ended |= load.ended
        cut |= load.cut
        up = _restarted(start_up, data, ports)
        # Before the budgets are read back from the store, so their spend counts.
        assert "usage journal replayed into the store" in up.log()
    # Rows of the journal are written by the process started after each kill.
    _wait_stored(up, data, ended)
    assert len(ended) >= 165
    # Streams cut by the kills are recorded as cut (503), with the tokens
    # seen; one whose "started" record was not yet synced has none.
    cut_rows = _stored_rows(data, cut)
    print(f"{len(cut_rows)} of {len(cut)} cut streams recorded:", sorted(cut_rows.values()))
    assert cut_rows, f"none of {len(cut)} cut streams recorded"
    assert {status for status, _ in cut_rows.values()} == {503}
    up.stop()
    journal = data / "usage-journal"
    assert all(p.stat().st_size == 0 for p in journal.glob("*.seg"))


def test_rows_wait_in_the_journal_while_the_store_is_locked_and_survive_a_kill(
    start_up: Any, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    up, key = _up_with_a_key(start_up, data, "locked-test")
    ports = f"{up.engine_ports[0]}-{up.engine_ports[1]}"
    with _store_locked(data) as lock:
        with Load(up.base_url, key) as load:
            up.wait_for(lambda: load.count() >= 60, 120, "60 answers")
            up.wait_for(lambda: "usage rows not written" in up.log(), 60, "the writer failing")
            pending = up.wait_for(lambda: _journal_bytes(up), 30, "bytes pending in the journal")
            assert pending > 0
            up.process.send_signal(signal.SIGKILL)
            up.process.wait(timeout=30)
        ended = set(load.ended)
        stored = {r[0] for r in lock.execute("SELECT request_id FROM usage")}
        assert ended - stored, "the lock did not keep rows out of the store"
    up = _restarted(start_up, data, ports)
    _wait_stored(up, data, ended)
    up.stop()


def test_a_stop_with_the_store_locked_is_bounded_and_leaves_the_rows_in_the_journal(
    start_up: Any, tmp_path: Path
) -> None:
    """SIGINT while another program holds the store's write lock: the stop
    still returns within the grace plus 5 s (the last rows stay in the
    journal), and the next start writes every ended answer's row."""
    data = tmp_path / "data"
    up, key = _up_with_a_key(start_up, data, "locked-stop")
    ports = f"{up.engine_ports[0]}-{up.engine_ports[1]}"
    with _store_locked(data):
        with Load(up.base_url, key) as load:
            up.wait_for(lambda: load.count() >= 30, 120, "30 answers")
            up.wait_for(lambda: "usage rows not written" in up.log(), 60, "the writer failing")
            up.process.send_signal(signal.SIGINT)
            up.process.wait(timeout=GRACE_S + 5.0)
        assert up.process.returncode == 0, up.log()
        assert "usage rows left in the journal at shutdown" in up.log()
        ended = set(load.ended)
    up = _restarted(start_up, data, ports)
    _wait_stored(up, data, ended)
    up.stop()


@contextlib.contextmanager
def _store_locked(data_dir: Path) -> Iterator[sqlite3.Connection]:
    """Another process's hold on SQLite's write lock for the block: every
    write of llmgw's fails ("database is locked", after its retries); reads
    still work (WAL). Yields that connection."""
    lock = sqlite3.connect(data_dir / "llmgw.db", timeout=30, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        yield lock
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def _stored_rows(data_dir: Path, ids: set[str]) -> dict[str, tuple[int, int]]:
    """Request id → (status, completion tokens) of those of ``ids`` stored."""
    db = sqlite3.connect(data_dir / "llmgw.db", timeout=30)
    try:
        found = db.execute("SELECT request_id, status, completion_tokens FROM usage").fetchall()
    finally:
        db.close()
    return {r[0]: (r[1], r[2]) for r in found if r[0] in ids}


def _journal_bytes(up: Any) -> float:
    text = httpx.get(f"http://{up.run['metrics']}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("llmgw_usage_journal_bytes "):
            return float(line.split()[1])
    return 0.0


def _wait_stored(up: Any, data: Path, ended: set[str]) -> None:
    """Wait until every id of ``ended`` has its usage row; fail naming the missing."""
    try:
        up.wait_for(lambda: not (ended - _stored_ids(data)), 60, "every ended answer's row")
    except AssertionError:
        missing = ended - _stored_ids(data)
        raise AssertionError(
            f"{len(missing)} of {len(ended)} rows lost: {sorted(missing)[:5]}"
        ) from None

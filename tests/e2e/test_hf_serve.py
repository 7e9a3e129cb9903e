"""``ctl model serve hf:…`` end to end, offline: ``llmgw mirror`` is the
hub. The starter GGUF is imported as ``llmgw/gemma-3-270m-gguf`` and served
by ``llmgw mirror serve``; ``llmgw up --no-agent`` has it as its mirror
(through a relay of this test that can slow the bytes down, so an agent can
be killed mid-download); a separate ``llmgw agent`` with no copy fetches it
(``docs/models-from-hf.md``). The mirror's ``/-/stats`` counts the bytes.

- two replicas on one node: READY, answering through the ``openai``
  client, the file downloaded once;
- a byte flipped in the mirror's copy: refused, naming both digests, and the
  replica shows why;
- the agent killed mid-download: the next one resumes (the bytes are not
  fetched twice);
- a ``.bin`` repository: refused before any byte is fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

REPO = "llmgw/gemma-3-270m-gguf"
DEADLINE_S = 240.0


class Mirror:
    """``llmgw mirror serve`` on a free port over ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.lines: list[str] = []
        #: Where the mirror keeps each imported file's bytes, by path.
        self.blobs: dict[str, Path] = {}
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "llmgw.cli", "mirror", "serve"),
                *("--data-dir", str(data_dir), "--listen", "127.0.0.1:0"),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        found: list[str] = []

        def read() -> None:
            assert self.process.stderr is not None
            for line in self.process.stderr:
                self.lines.append(line)
                if not found and (match := re.search(r"serving .* on (http://\S+)", line)):
                    found.append(match.group(1))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 60
        while not found and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found, "".join(self.lines)
        self.url = found[0]

    def served(self, path: str) -> int:
        """Bytes of ``path`` served since the mirror started (``/-/stats``)."""
        stats = httpx.get(f"{self.url}/-/stats", timeout=10).json()
        return sum(f["bytes_served"] for f in stats["files"] if f["path"] == path)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=10)
        if self.process.stderr is not None:
            self.process.stderr.close()


def _llmgw(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "llmgw.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


class Relay:
    """An HTTP relay in front of the mirror that can hold each answer's body
    to ``rate`` bytes per second (0 = as fast as it goes). It reads from the
    mirror only as fast as it writes, so the mirror's counters stay within a
    socket buffer of what the client got."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.rate = 0.0
        #: The first byte of each ``resolve`` GET (0 without ``Range``).
        self.starts: list[int] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self._relay()

            def do_GET(self) -> None:
                self._relay()

            def _relay(self) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("range",)}
                if "/resolve/" in self.path and self.command == "GET":
                    found = re.fullmatch(r"bytes=(\d+)-", headers.get("Range", ""))
                    relay.starts.append(int(found.group(1)) if found else 0)
                with (
                    httpx.Client(timeout=60) as client,
                    client.stream(
                        self.command, relay.upstream + self.path, headers=headers
                    ) as answer,
                ):
                    self.send_response(answer.status_code)
                    for key, value in answer.headers.items():
                        if key.lower() not in ("transfer-encoding", "connection", "server", "date"):
                            self.send_header(key, value)
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    for block in answer.iter_raw(256 * 1024):
                        try:
                            self.wfile.write(block)
                        except OSError:
                            return
                        if relay.rate:
                            time.sleep(len(block) / relay.rate)

        return Handler


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[Mirror, Relay, str, Path]]:
    """The starter imported and served: (mirror, relay, commit, the GGUF's path in the repo)."""
    data_dir = tmp_path / "mirror"
    imported = json.loads(
        _llmgw("mirror", "import", "--starter", "--data-dir", str(data_dir), "--json")
    )
    commit = imported["commit"]
    served = Mirror(data_dir)
    served.blobs = {f["path"]: Path(f["blob"]) for f in imported["files"]}
    relay = Relay(served.url)
    try:
        yield served, relay, commit, Path(imported["files"][0]["path"])
    finally:
        relay.server.shutdown()
        relay.server.server_close()
        served.stop()


@pytest.fixture
def cluster(
    tmp_path: Path, mirror: Any, start_up: Any, agent_type: Any, procs: Any
) -> Iterator[tuple[Any, Any]]:
    """``llmgw up --no-agent`` with the mirror (through the relay) as its
    ``mirrors``, and one agent."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "server.yaml").write_text(json.dumps({"mirrors": [mirror[1].url]}))
    up = start_up("--no-agent", "--engine", "sim", "--model-name", "s")
    up.wait_run(DEADLINE_S)
    agent = agent_type(up, tmp_path / "agent-state", tmp_path / "agent.log", "hf-node")
    agent.start()
    up.wait_for(lambda: "READY" in str(up.status()["replicas"]), DEADLINE_S, "the sim replica")
    try:
        yield up, agent
    finally:
        agent.kill(signal.SIGTERM)
        procs.kill_groups(procs.engines_in(up.engine_ports))


def _replicas(up: Any, model: str) -> list[dict[str, Any]]:
    return [r for r in up.status()["replicas"] if r["model"] == model]


def _serve(up: Any, *args: str) -> dict[str, Any]:
    result = up.cli("ctl", "model", "serve", *args, "--json")
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def test_two_replicas_from_the_mirror_one_download(
    cluster: tuple[Any, Any], mirror: Any, tmp_path: Path
) -> None:
    up, _ = cluster
    served, _, commit, gguf = mirror
    view = _serve(up, f"hf:{REPO}@{commit}", "--name", "g", "--replicas", "2", "--cpu-cores", "1")
    assert view["resolved"]["revision"] == commit
    assert view["entry"]["source"] == f"hf:{REPO}@{commit}/{gguf}"
    size = view["entry"]["origin"]["files"][0]["size_bytes"]
    up.wait_for(
        lambda: [r["state"] for r in _replicas(up, "g")] == ["READY", "READY"],
        DEADLINE_S,
        "two READY replicas of g",
    )
    assert served.served(str(gguf)) == size  # one download for two replicas
    answer = up.openai_client(timeout=60).chat.completions.create(
        model="g", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert answer.choices[0].message.content
    weights = up.cli("ctl", "weights", "--json")
    assert weights.returncode == 0, weights.stderr
    held = json.loads(weights.stdout)["nodes"][0]["held"]
    assert [(h["repo"], h["revision"], h["in_use"]) for h in held] == [(REPO, commit, True)]
    # Purged: the node deletes what it fetched once the replicas stopped.
    removed = up.cli("ctl", "model", "remove", "g", "--purge")
    assert removed.returncode == 0, removed.stderr

    def held_now() -> list[Any]:
        answer = up.cli("ctl", "weights", "--json")
        assert answer.returncode == 0, answer.stderr
        found: list[Any] = json.loads(answer.stdout)["nodes"][0]["held"]
        return found

    up.wait_for(lambda: held_now() == [], DEADLINE_S, "the node's copy purged")
    assert not (tmp_path / "agent-state/weights/hf" / REPO / commit / gguf).exists()


def test_a_flipped_byte_is_refused_naming_both_digests(
    cluster: tuple[Any, Any], mirror: Any, tmp_path: Path
) -> None:
    up, _ = cluster
    served, _, commit, gguf = mirror
    blob = served.blobs[str(gguf)]
    good = blob.name
    blob.chmod(0o644)
    with blob.open("r+b") as f:
        f.seek(1_000_000)
        byte = f.read(1)
        f.seek(1_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = hashlib.sha256(blob.read_bytes()).hexdigest()
    assert bad != good
    _serve(up, f"hf:{REPO}@{commit}", "--name", "flipped", "--cpu-cores", "1")

    def failed() -> str:
        reasons = [r["reason"] for r in _replicas(up, "flipped") if r["state"] == "FAILED"]
        return reasons[0] if reasons else ""

    reason = up.wait_for(failed, DEADLINE_S, "a FAILED replica of flipped")
    assert good in reason
    assert bad in reason
    # The copy was deleted on the node; nothing serves from it.
    assert not (tmp_path / "agent-state/weights/hf" / REPO / commit / gguf).exists()
    assert "READY" not in [r["state"] for r in _replicas(up, "flipped")]


def test_a_killed_agent_resumes_the_download(
    cluster: tuple[Any, Any], mirror: Any, tmp_path: Path
) -> None:
    up, agent = cluster
    served, relay, commit, gguf = mirror
    size = served.blobs[str(gguf)].stat().st_size
    relay.rate = size / 60  # about a minute for the whole file
    _serve(up, f"hf:{REPO}@{commit}", "--name", "slow", "--cpu-cores", "1")
    part = tmp_path / "agent-state/weights/hf" / REPO / commit / f".{gguf.name}.part"
    up.wait_for(
        lambda: part.exists() and part.stat().st_size > size // 4,
        DEADLINE_S,
        "a quarter of the file downloaded",
    )
    downloads = [r.get("download") for r in _replicas(up, "slow")]
    shown = {
        what: up.cli("ctl", *what.split()).stdout
        for what in ("models", "status", "explain-placement slow")
    }
    agent.kill(signal.SIGKILL)
    had = part.stat().st_size
    relay.rate = 0
    agent.start()
    up.wait_for(
        lambda: [r["state"] for r in _replicas(up, "slow")] == ["READY"],
        DEADLINE_S,
        "slow READY after the agent was killed",
    )
    assert relay.starts[0] == 0
    assert relay.starts[-1] >= had > 0  # the next agent resumed where the file stopped
    # Not fetched twice: the bytes the first agent had kept are not sent
    # again. The mirror counts a little more than the file (what was in the
    # sockets and the relay when the agent died), but less than a second
    # copy of what it had.
    assert size <= served.served(str(gguf)) < size + had
    assert any(d and d["total_bytes"] == size for d in downloads), downloads
    for what, text in shown.items():
        assert re.search(r"downloading [\d.]+ MB of 253.1 MB", text), (what, text)


def test_a_pickle_source_is_refused_before_any_byte(
    cluster: tuple[Any, Any], mirror: Any, tmp_path: Path
) -> None:
    up, _ = cluster
    served = mirror[0]
    folder = tmp_path / "old-model"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    (folder / "config.json").write_text("{}")
    _llmgw(
        "mirror",
        "import",
        str(folder),
        "--as",
        "someone/old-model",
        "--data-dir",
        str(served.data_dir),
    )
    result = up.cli("ctl", "model", "serve", "hf:someone/old-model")
    assert result.returncode == 1
    assert "pickle" in result.stderr
    assert served.served("pytorch_model.bin") == 0
    assert served.served("config.json") == 0
    assert "old-model" not in up.cli("ctl", "models").stdout

"""``ctl model serve hf:…`` end to end, offline: a hub of this test's own
(a real HTTP server answering the part of the Hugging Face API that
``huggingface_hub`` and the agent use, with ``Range``, counting the bytes it
serves) holds the starter GGUF as ``llmgw/gemma-3-270m-gguf``; ``llmgw up
--no-agent`` has it as its mirror; a separate ``llmgw agent`` with no copy
fetches it (``docs/models-from-hf.md``).

- two replicas on one node: READY, answering through the ``openai``
  client, the file downloaded once;
- a byte flipped in the hub's copy: refused, naming both digests, and the
  replica shows why;
- the agent killed mid-download: the next one resumes (the bytes are not
  fetched twice);
- a ``.bin`` repository: refused before any byte is fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.weights import assemble_starter_model

pytestmark = pytest.mark.slow

REPO = "llmgw/gemma-3-270m-gguf"
DEADLINE_S = 240.0


class FileHub:
    """Repositories as files (``root/<org>/<repo>/<commit>/<path>``) with
    the digests it publishes, served like the hub (resolve with ``Range``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.published: dict[tuple[str, str], dict[str, tuple[int, str]]] = {}
        self.refs: dict[tuple[str, str], str] = {}
        self.served: Counter[str] = Counter()
        #: (repo, path) -> the byte each resolve GET started from.
        self.starts: dict[tuple[str, str], list[int]] = {}
        #: repo -> bytes per second it is served at (0 = as fast as it goes).
        self.throttle: dict[str, float] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo: str, files: dict[str, Path]) -> str:
        """Import ``files`` as a new commit of ``repo`` (``main``); its id."""
        digests = {p: hashlib.sha256(f.read_bytes()).hexdigest() for p, f in files.items()}
        commit = hashlib.sha1(json.dumps([repo, digests], sort_keys=True).encode()).hexdigest()
        for path, source in files.items():
            target = self.root / repo / commit / path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        self.published[(repo, commit)] = {
            p: ((self.root / repo / commit / p).stat().st_size, d) for p, d in digests.items()
        }
        self.refs[(repo, "main")] = commit
        self.refs[(repo, commit)] = commit
        return commit

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if api := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path):
                    repo, rev = api.group(1), api.group(2) or "main"
                    commit = hub.refs.get((repo, rev))
                    if commit is None:
                        self._json(404, {"error": "not found"}, "RepoNotFound")
                        return
                    siblings = [
                        {"rfilename": p, "size": size}
                        | (
                            {"lfs": {"sha256": sha, "size": size, "pointerSize": 134}}
                            if p.endswith((".gguf", ".bin"))
                            else {}
                        )
                        for p, (size, sha) in sorted(hub.published[(repo, commit)].items())
                    ]
                    self._json(200, {"id": repo, "sha": commit, "siblings": siblings})
                    return
                match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                commit = hub.refs.get((match.group(1), match.group(2))) if match else None
                if match is None or commit is None:
                    self._json(404, {"error": "not found"}, "EntryNotFound")
                    return
                repo, _, name = match.groups()
                file = hub.root / repo / commit / name
                size = file.stat().st_size
                start = 0
                if rng := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
                    start = int(rng.group(1))
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(size - start))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("X-Repo-Commit", commit)
                self.end_headers()
                if self.command == "HEAD":
                    return
                hub.starts.setdefault((repo, name), []).append(start)
                rate = hub.throttle.get(repo, 0.0)
                with file.open("rb") as f:
                    f.seek(start)
                    while block := f.read(1 << 20):
                        try:
                            self.wfile.write(block)
                        except OSError:
                            return
                        hub.served[f"{repo}/{name}"] += len(block)
                        if rate:
                            time.sleep(len(block) / rate)

            def _json(self, status: int, doc: object, error: str = "") -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if error:
                    self.send_header("X-Error-Code", error)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        return Handler


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return assemble_starter_model(tmp_path_factory.mktemp("starter"))


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FileHub]:
    files = FileHub(tmp_path / "hub")
    yield files
    files.server.shutdown()
    files.server.server_close()


@pytest.fixture
def cluster(
    tmp_path: Path, hub: FileHub, start_up: Any, agent_type: Any, procs: Any
) -> Iterator[tuple[Any, Any]]:
    """``llmgw up --no-agent`` with ``hub`` as its mirror, and one agent."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "server.yaml").write_text(json.dumps({"mirrors": [hub.url]}))
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
    cluster: tuple[Any, Any], hub: FileHub, gguf: Path
) -> None:
    up, _ = cluster
    commit = hub.add(REPO, {gguf.name: gguf})
    view = _serve(up, f"hf:{REPO}@{commit}", "--name", "g", "--replicas", "2", "--cpu-cores", "1")
    assert view["resolved"]["revision"] == commit
    assert view["entry"]["source"] == f"hf:{REPO}@{commit}/{gguf.name}"
    assert (
        view["entry"]["origin"]["files"][0]["sha256"]
        == hashlib.sha256(gguf.read_bytes()).hexdigest()
    )
    up.wait_for(
        lambda: [r["state"] for r in _replicas(up, "g")] == ["READY", "READY"],
        DEADLINE_S,
        f"two READY replicas of g: {_replicas(up, 'g')}",
    )
    assert hub.served[f"{REPO}/{gguf.name}"] == gguf.stat().st_size  # one download
    answer = up.openai_client(timeout=60).chat.completions.create(
        model="g", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert answer.choices[0].message.content
    weights = up.cli("ctl", "weights", "--json")
    assert weights.returncode == 0, weights.stderr
    held = json.loads(weights.stdout)["nodes"][0]["held"]
    assert [(h["repo"], h["revision"], h["in_use"]) for h in held] == [(REPO, commit, True)]


def test_a_flipped_byte_is_refused_naming_both_digests(
    cluster: tuple[Any, Any], hub: FileHub, gguf: Path, tmp_path: Path
) -> None:
    up, _ = cluster
    commit = hub.add(REPO, {gguf.name: gguf})
    good = hub.published[(REPO, commit)][gguf.name][1]
    copy = hub.root / REPO / commit / gguf.name
    with copy.open("r+b") as f:
        f.seek(1_000_000)
        byte = f.read(1)
        f.seek(1_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = hashlib.sha256(copy.read_bytes()).hexdigest()
    _serve(up, f"hf:{REPO}@{commit}", "--name", "flipped")

    def failed() -> str:
        reasons = [r["reason"] for r in _replicas(up, "flipped") if r["state"] == "FAILED"]
        return reasons[0] if reasons else ""

    reason = up.wait_for(failed, DEADLINE_S, f"a FAILED replica: {_replicas(up, 'flipped')}")
    assert good in reason
    assert bad in reason
    # The copy was deleted on the node; nothing serves from it.
    assert not (tmp_path / "agent-state/weights/hf" / REPO / commit / gguf.name).exists()
    assert "READY" not in [r["state"] for r in _replicas(up, "flipped")]


def test_a_killed_agent_resumes_the_download(
    cluster: tuple[Any, Any], hub: FileHub, gguf: Path, tmp_path: Path
) -> None:
    up, agent = cluster
    commit = hub.add(REPO, {gguf.name: gguf})
    size = gguf.stat().st_size
    hub.throttle[REPO] = size / 20  # about 20 s for the whole file
    _serve(up, f"hf:{REPO}@{commit}", "--name", "slow")
    part = tmp_path / "agent-state/weights/hf" / REPO / commit / f".{gguf.name}.part"
    up.wait_for(
        lambda: part.exists() and part.stat().st_size > size // 4,
        DEADLINE_S,
        "a quarter of the file downloaded",
    )
    downloads = [r.get("download") for r in _replicas(up, "slow")]
    agent.kill(signal.SIGKILL)
    had = part.stat().st_size
    hub.throttle[REPO] = 0
    agent.start()
    up.wait_for(
        lambda: [r["state"] for r in _replicas(up, "slow")] == ["READY"],
        DEADLINE_S,
        f"slow READY: {_replicas(up, 'slow')}",
    )
    starts = hub.starts[(REPO, gguf.name)]
    assert starts[0] == 0
    assert starts[-1] >= had > 0  # the next agent resumed where the file stopped
    # Not fetched twice: what the first agent had received is not sent again
    # (at most what was in flight when it died, a few MB).
    assert hub.served[f"{REPO}/{gguf.name}"] < size + 16 * 2**20
    assert any(d and d["total_bytes"] == size for d in downloads), downloads


def test_a_pickle_source_is_refused_before_any_byte(
    cluster: tuple[Any, Any], hub: FileHub, tmp_path: Path
) -> None:
    up, _ = cluster
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"\x80\x04not really a pickle")
    config = tmp_path / "config.json"
    config.write_text("{}")
    hub.add("someone/old-model", {"pytorch_model.bin": weights, "config.json": config})
    result = up.cli("ctl", "model", "serve", "hf:someone/old-model")
    assert result.returncode == 1
    assert "pickle" in result.stderr
    assert not hub.served
    assert "old-model" not in up.cli("ctl", "models").stdout

"""Models from a hub, pinned: resolving on the control plane
(:mod:`llmgw.control.hf`) and fetching on a node (:mod:`llmgw.agent.fetch`),
against a small hub of this test's own (a real HTTP server in a thread
answering the part of the Hugging Face API both use, with ``Range``)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from llmgw.agent.fetch import (
    FETCHED_MARKER,
    FetchError,
    FetchRefused,
    WeightsFetcher,
    held_weights,
    remove_weights,
)
from llmgw.agent.protocol import WeightsFetch, WeightsFile
from llmgw.agent.weights import WeightsMismatch
from llmgw.control import hf
from llmgw.settings import ServerSettings, settings_from_doc
from llmgw.store import Origin, OriginFile

COMMIT = "a" * 40
COMMIT2 = "b" * 40
_LFS = (".gguf", ".safetensors", ".bin")


class FakeHub:
    """Repositories in memory, served over HTTP the way the hub does."""

    def __init__(self) -> None:
        # repo -> commit -> path -> bytes
        self.repos: dict[str, dict[str, dict[str, bytes]]] = {}
        self.refs: dict[tuple[str, str], str] = {}
        self.served: Counter[str] = Counter()
        self.requests: list[str] = []
        #: path -> bytes after which the next answer is cut off (once).
        self.cut_after: dict[str, int] = {}
        #: Resolve answers wait on this (cleared: they block).
        self.gate = threading.Event()
        self.gate.set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: str, commit: str, files: dict[str, bytes], ref: str = "main") -> None:
        self.repos.setdefault(repo, {})[commit] = files
        self.refs[(repo, ref)] = commit
        self.refs[(repo, commit)] = commit

    def info(self, repo: str, rev: str) -> dict[str, Any] | None:
        commit = self.refs.get((repo, rev))
        if commit is None:
            return None
        siblings = []
        for path, data in self.repos[repo][commit].items():
            sibling: dict[str, Any] = {"rfilename": path, "size": len(data)}
            if path.endswith(_LFS):
                sibling["lfs"] = {
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            siblings.append(sibling)
        return {"id": repo, "modelId": repo, "sha": commit, "siblings": siblings}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                path = self.path.split("?", 1)[0]
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
                if api:
                    info = hub.info(api.group(1), api.group(2) or "main")
                    if info is None:
                        code = "RevisionNotFound" if api.group(1) in hub.repos else "RepoNotFound"
                        self._send(404, b'{"error": "not found"}', error=code)
                        return
                    self._send(200, json.dumps(info).encode())
                    return
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not resolve:
                    self._send(404, b"{}")
                    return
                repo, rev, file = resolve.groups()
                commit = hub.refs.get((repo, rev))
                data = hub.repos.get(repo, {}).get(commit or "", {}).get(file)
                if data is None:
                    self._send(404, b"{}", error="EntryNotFound")
                    return
                hub.gate.wait(30)
                start = 0
                status = 200
                if rng := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", "")):
                    start = int(rng.group(1))
                    status = 206
                body = data[start:]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", commit or "")
                self.end_headers()
                if self.command == "HEAD":
                    return
                cut = hub.cut_after.pop(file, None)
                # Counted before the bytes go: a client that has them may
                # look at the count at once (it raced the write under load).
                if cut is not None:
                    hub.served[file] += cut
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                hub.served[file] += len(body)
                self.wfile.write(body)

            def _send(self, status: int, body: bytes, error: str = "") -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if error:
                    self.send_header("X-Error-Code", error)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        return Handler


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.thread.start()
    try:
        yield fake
    finally:
        fake.gate.set()
        fake.server.shutdown()
        fake.server.server_close()


def _settings(*urls: str) -> ServerSettings:
    return settings_from_doc({"mirrors": list(urls)})


GGUF = b"GGUF" + bytes(range(256)) * 400  # ~100 kB
CONFIG = b'{"architectures": ["X"]}'


def _spec(hub: FakeHub, repo: str, commit: str, main: str = "") -> WeightsFetch:
    files = tuple(
        WeightsFile(path=p, size_bytes=len(d), sha256=hashlib.sha256(d).hexdigest())
        for p, d in sorted(hub.repos[repo][commit].items())
    )
    return WeightsFetch(
        repo=repo, revision=commit, files=files, main_file=main, endpoints=(hub.url,)
    )


# --- the control plane's side -------------------------------------------------------


def test_parse_hf_source() -> None:
    assert hf.parse_hf_source("hf:org/repo") == hf.HfRef("org/repo", None)
    assert hf.parse_hf_source("hf:org/repo@v1.0") == hf.HfRef("org/repo", "v1.0")
    for bad in ("org/repo", "hf:org", "hf:../x", "hf:org/repo@", "hf:org/re po"):
        with pytest.raises(hf.HfError):
            hf.parse_hf_source(bad)


def test_endpoints_mirrors_first_then_setting_then_environment() -> None:
    settings = settings_from_doc(
        {"mirrors": ["http://m1:8090/", "http://m2:8090"], "weights": {"hf_endpoint": "http://h"}}
    )
    assert hf.endpoints(settings, {}) == ("http://m1:8090", "http://m2:8090", "http://h")
    assert hf.endpoints(ServerSettings(), {"HF_ENDPOINT": "http://e"}) == ("http://e",)
    assert hf.endpoints(ServerSettings(), {}) == (hf.DEFAULT_HF_ENDPOINT,)


def test_choose_files_by_format() -> None:
    files = [("a.Q4.gguf", 10, "1" * 64), ("README.md", 1, "")]
    assert hf.choose_files(files, glob=None, engine=None) == ("llamacpp", [files[0]], "a.Q4.gguf")
    split = [("m-00002-of-00002.gguf", 5, "2" * 64), ("m-00001-of-00002.gguf", 5, "1" * 64)]
    engine, chosen, main = hf.choose_files(split, glob=None, engine=None)
    assert (engine, main) == ("llamacpp", "m-00001-of-00002.gguf")
    assert len(chosen) == 2
    tensors = [
        ("model.safetensors", 10, "1" * 64),
        ("config.json", 1, ""),
        ("modeling_x.py", 1, ""),
        ("pytorch_model.bin", 10, "2" * 64),
    ]
    engine, chosen, main = hf.choose_files(tensors, glob=None, engine=None)
    assert engine == "vllm"
    assert main == ""
    assert [c[0] for c in chosen] == ["config.json", "model.safetensors"]  # no code, no pickle


def test_choose_files_refuses_pickles_and_ambiguity() -> None:
    with pytest.raises(hf.HfError, match="only in pickle formats"):
        hf.choose_files([("pytorch_model.bin", 10, "1" * 64)], glob=None, engine=None)
    with pytest.raises(hf.HfError, match="pickle format"):
        hf.choose_files([("model.pt", 10, "1" * 64)], glob="*.pt", engine=None)
    with pytest.raises(hf.HfError, match="several GGUF files"):
        hf.choose_files([("a.gguf", 1, "1" * 64), ("b.gguf", 1, "2" * 64)], glob=None, engine=None)
    with pytest.raises(hf.HfError, match="matches none"):
        hf.choose_files([("a.gguf", 1, "1" * 64)], glob="*.q8*", engine=None)


def test_resolve_pins_the_commit_with_the_hubs_digests(hub: FakeHub) -> None:
    hub.add("org/m-gguf", COMMIT, {"m.Q4_K_M.gguf": GGUF, "README.md": b"hi"})
    resolved = hf.resolve(hf.HfRef("org/m-gguf"), _settings("http://127.0.0.1:9", hub.url))
    assert resolved.endpoint == hub.url  # the first mirror does not answer
    assert resolved.engine == "llamacpp"
    assert resolved.origin == Origin(
        repo="org/m-gguf",
        revision=COMMIT,
        files=(
            OriginFile(
                path="m.Q4_K_M.gguf",
                size_bytes=len(GGUF),
                sha256=hashlib.sha256(GGUF).hexdigest(),
            ),
        ),
        main_file="m.Q4_K_M.gguf",
    )
    assert hf.origin_source(resolved.origin) == f"hf:org/m-gguf@{COMMIT}/m.Q4_K_M.gguf"
    assert not hub.served  # no weights fetched to resolve


def test_resolve_hashes_small_files_without_a_published_digest(hub: FakeHub) -> None:
    hub.add("org/st", COMMIT, {"model.safetensors": GGUF, "config.json": CONFIG})
    resolved = hf.resolve(hf.HfRef("org/st", COMMIT), _settings(hub.url))
    by_path = {f.path: f for f in resolved.origin.files}
    assert by_path["config.json"].sha256 == hashlib.sha256(CONFIG).hexdigest()
    assert resolved.engine == "vllm"
    assert resolved.origin.main_file == ""
    assert hub.served == Counter({"config.json": len(CONFIG)})


def test_resolve_refuses_a_pickle_repository_before_any_byte(hub: FakeHub) -> None:
    hub.add("org/old", COMMIT, {"pytorch_model.bin": GGUF, "config.json": CONFIG})
    with pytest.raises(hf.HfError, match="pickle"):
        hf.resolve(hf.HfRef("org/old"), _settings(hub.url))
    assert not hub.served
    assert not any("/resolve/" in r for r in hub.requests)


def test_resolve_unknown_repository_and_revision(hub: FakeHub) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF})
    with pytest.raises(hf.HfError, match=r"no repository"):
        hf.resolve(hf.HfRef("org/none"), _settings(hub.url))
    with pytest.raises(hf.HfError, match=r"has no revision"):
        hf.resolve(hf.HfRef("org/m", "v9"), _settings(hub.url))
    with pytest.raises(hf.HfError, match="no hub answers"):
        hf.resolve(
            hf.HfRef("org/m"),
            _settings("http://127.0.0.1:9"),
            environ={"HF_ENDPOINT": "http://127.0.0.1:9"},
        )


def test_diff_origins_names_files() -> None:
    old = Origin(
        repo="o/r",
        revision=COMMIT,
        files=(
            OriginFile(path="a", size_bytes=1, sha256="1" * 64),
            OriginFile(path="b", size_bytes=1, sha256="2" * 64),
        ),
    )
    new = attrs.evolve(
        old,
        revision=COMMIT2,
        files=(
            OriginFile(path="a", size_bytes=1, sha256="3" * 64),
            OriginFile(path="c", size_bytes=1, sha256="4" * 64),
        ),
    )
    assert hf.diff_origins(old, new) == {
        "from": COMMIT,
        "to": COMMIT2,
        "added": ["c"],
        "removed": ["b"],
        "changed": ["a"],
    }


# --- the node's side ------------------------------------------------------------------


async def _fetch(fetcher: WeightsFetcher, spec: WeightsFetch) -> Path:
    """One fetch, its error unwrapped from the nursery's group."""
    got: list[Path] = []
    try:
        async with trio.open_nursery() as nursery:
            got.append(await fetcher.fetch(spec, nursery))
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return got[0]


async def test_fetch_places_checks_and_verifies_once(hub: FakeHub, tmp_path: Path) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF, "sub/config.json": CONFIG})
    fetcher = WeightsFetcher(tmp_path)
    spec = _spec(hub, "org/m", COMMIT, main="m.gguf")
    path = await _fetch(fetcher, spec)
    assert path == tmp_path / "hf/org/m" / COMMIT / "m.gguf"
    assert path.read_bytes() == GGUF
    digest = (path.parent / "m.gguf.sha256").read_text().split()[0]
    assert digest == hashlib.sha256(GGUF).hexdigest()
    assert (path.parent / "sub/config.json").read_bytes() == CONFIG
    assert (path.parent / FETCHED_MARKER).exists()
    assert not list(path.parent.glob(".*.part"))
    served = dict(hub.served)
    assert await _fetch(fetcher, spec) == path
    assert dict(hub.served) == served  # verified once: not fetched again
    held = held_weights(tmp_path)
    assert [(h.repo, h.revision, len(h.files)) for h in held] == [("org/m", COMMIT, 2)]


async def test_fetch_resumes_a_cut_download_without_fetching_bytes_twice(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF})
    hub.cut_after["m.gguf"] = 30_000
    fetcher = WeightsFetcher(tmp_path, retry_delay_s=0.01)
    path = await _fetch(fetcher, _spec(hub, "org/m", COMMIT, "m.gguf"))
    assert path.read_bytes() == GGUF
    assert hub.served["m.gguf"] == len(GGUF)
    assert sum("/resolve/" in r for r in hub.requests) == 2  # cut, then resumed


async def test_fetch_resumes_what_an_earlier_agent_left(hub: FakeHub, tmp_path: Path) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF})
    folder = tmp_path / "hf/org/m" / COMMIT
    folder.mkdir(parents=True)
    (folder / ".m.gguf.part").write_bytes(GGUF[:40_000])
    path = await _fetch(WeightsFetcher(tmp_path), _spec(hub, "org/m", COMMIT, "m.gguf"))
    assert path.read_bytes() == GGUF
    assert hub.served["m.gguf"] == len(GGUF) - 40_000


async def test_fetch_mismatch_deletes_the_copy_and_names_both_digests(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF})
    spec = _spec(hub, "org/m", COMMIT, "m.gguf")
    flipped = bytearray(GGUF)
    flipped[1000] ^= 0xFF
    hub.repos["org/m"][COMMIT]["m.gguf"] = bytes(flipped)
    with pytest.raises(WeightsMismatch) as caught:
        await _fetch(WeightsFetcher(tmp_path), spec)
    message = str(caught.value)
    assert hashlib.sha256(GGUF).hexdigest() in message
    assert hashlib.sha256(bytes(flipped)).hexdigest() in message
    folder = tmp_path / "hf/org/m" / COMMIT
    assert not (folder / "m.gguf").exists()
    assert not list(folder.glob(".*.part"))


async def test_fetch_refuses_pickles_and_full_disks_before_any_byte(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF, "model.bin": GGUF})
    with pytest.raises(FetchRefused, match="pickle"):
        await _fetch(WeightsFetcher(tmp_path), _spec(hub, "org/m", COMMIT))
    small = WeightsFetcher(tmp_path, free_bytes=lambda _: 1000)
    spec = attrs.evolve(
        _spec(hub, "org/m", COMMIT),
        files=tuple(f for f in _spec(hub, "org/m", COMMIT).files if f.path == "m.gguf"),
    )
    with pytest.raises(FetchRefused, match=r"not enough disk .* GB is free"):
        await _fetch(small, spec)
    assert not hub.served


async def test_two_shards_one_download(hub: FakeHub, tmp_path: Path) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF})
    hub.gate.clear()  # hold the download until both asked
    fetcher = WeightsFetcher(tmp_path)
    spec = _spec(hub, "org/m", COMMIT, "m.gguf")
    paths: list[Path] = []

    async def one(nursery: trio.Nursery) -> None:
        paths.append(await fetcher.fetch(spec, nursery))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, nursery)
        nursery.start_soon(one, nursery)
        await trio.sleep(0.2)
        assert fetcher.job_progress("org/m", COMMIT) is not None
        hub.gate.set()
    assert len(paths) == 2
    assert paths[0] == paths[1]
    assert hub.served["m.gguf"] == len(GGUF)


async def test_fetch_fails_clearly_when_no_endpoint_answers(tmp_path: Path) -> None:
    spec = WeightsFetch(
        repo="org/m",
        revision=COMMIT,
        files=(WeightsFile(path="m.gguf", size_bytes=10, sha256="1" * 64),),
        main_file="m.gguf",
        endpoints=("http://127.0.0.1:9",),
    )
    with pytest.raises(FetchError, match="after 2 tries"):
        await _fetch(WeightsFetcher(tmp_path, attempts=2, retry_delay_s=0.01), spec)


async def test_remove_deletes_only_what_llmgw_fetched(hub: FakeHub, tmp_path: Path) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF})
    path = await _fetch(WeightsFetcher(tmp_path), _spec(hub, "org/m", COMMIT, "m.gguf"))
    mine = path.parent / "notes.txt"
    mine.write_text("an operator's file")
    removed = remove_weights(tmp_path, "org/m", COMMIT)
    assert sorted(Path(p).name for p in removed) == ["m.gguf", "m.gguf.sha256"]
    assert mine.exists()
    assert not path.exists()
    assert remove_weights(tmp_path, "org/other", COMMIT) == []
    with pytest.raises(FetchRefused):
        remove_weights(tmp_path, "../x", COMMIT)


def test_an_unusable_hub_url_counts_as_not_answering(hub: FakeHub) -> None:
    # Settings refuse such URLs now; a store written before may still hold one.
    assert hf._first_answering(("http://[::1", "http://h:99999", hub.url), "org/m") == hub.url
    with pytest.raises(hf.HfError, match="no hub answers"):
        hf._first_answering(("http://[::1",), "org/m")


async def test_fetch_skips_an_unusable_endpoint_url(hub: FakeHub, tmp_path: Path) -> None:
    hub.add("org/m", COMMIT, {"m.gguf": GGUF})
    spec = attrs.evolve(
        _spec(hub, "org/m", COMMIT, main="m.gguf"), endpoints=("http://[::1", hub.url)
    )
    fetcher = WeightsFetcher(tmp_path, attempts=3, retry_delay_s=0.01)
    path = await _fetch(fetcher, spec)
    assert path.read_bytes() == GGUF
    only_bad = attrs.evolve(spec, revision=COMMIT2, endpoints=("http://[::1",))
    with pytest.raises(FetchError, match="after 3 tries"):
        await _fetch(WeightsFetcher(tmp_path / "b", attempts=3, retry_delay_s=0.01), only_bad)

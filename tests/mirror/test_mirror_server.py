"""The mirror's HTTP side against the real ``huggingface_hub`` (in its own
process, ``HF_ENDPOINT`` set and nothing else), raw requests for what a
client library would tidy away (``..`` in a path), ranges, counters, the
access log, and ``llmgw mirror pull`` from a mirror as its upstream."""

from __future__ import annotations

import hashlib
import json
import logging
import textwrap
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw.mirror.store import MirrorStore

REPO = "acme/tiny-model"


async def raw_request(
    url: str, target: str, method: str = "GET", body: bytes = b""
) -> tuple[int, dict[str, str], bytes]:
    """Send ``METHOD target`` as written (no client normalises it), with
    ``body``; status, headers (lower-case names) and body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
                f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1")
                + body
            )
            data = b""
            while chunk := await stream.receive_some():
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def flip_byte(blob: Path, offset: int) -> None:
    """Flip every bit of the byte at ``offset`` of a stored blob (blobs are
    read-only: made writable first). How a test corrupts the mirror's copy."""
    blob.chmod(0o644)
    with open(blob, "r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)
        stream.seek(offset)
        stream.write(bytes([byte[0] ^ 0xFF]))


async def test_huggingface_hub_reads_the_mirror(mirror: Any, hf_run: Any) -> None:
    script = textwrap.dedent(
        f"""
        import hashlib, json, os
        from huggingface_hub import HfApi, hf_hub_download, list_repo_tree, snapshot_download
        api = HfApi()
        info = api.model_info("{REPO}", files_metadata=True)
        at_v = api.model_info("{REPO}", revision="main")
        tree = [
            {{"path": e.path, "kind": type(e).__name__,
              "lfs": e.lfs.sha256 if getattr(e, "lfs", None) else None}}
            for e in list_repo_tree("{REPO}", recursive=True)
        ]
        top = sorted(e.path for e in list_repo_tree("{REPO}"))
        sub = sorted(e.path for e in list_repo_tree("{REPO}", path_in_repo="tokenizer"))
        one = hf_hub_download("{REPO}", "tokenizer/extra/merges.txt")
        snap = snapshot_download("{REPO}", revision=info.sha)
        local = snapshot_download("{REPO}", local_dir=os.path.join(os.environ["HF_HOME"], "local"))
        def digests(root):
            out = {{}}
            for folder, dirs, names in os.walk(root):
                dirs[:] = [d for d in dirs if d != ".cache"]
                for name in names:
                    path = os.path.join(folder, name)
                    out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
            return out
        print(json.dumps({{
            "sha": info.sha, "sha_main": at_v.sha,
            "siblings": {{s.rfilename: [s.size, s.lfs.sha256 if s.lfs else None] for s in info.siblings}},
            "tree": tree, "top": top, "sub": sub,
            "one": hashlib.sha256(open(one, "rb").read()).hexdigest(),
            "snap": digests(snap), "local": digests(local),
        }}))
        """
    )
    got = await hf_run(mirror.url, script)
    commit = mirror.commit.commit
    wanted = {path: hashlib.sha256(data).hexdigest() for path, data in mirror.files.items()}
    assert got["sha"] == got["sha_main"] == commit
    assert got["siblings"] == {p: [len(d), wanted[p]] for p, d in mirror.files.items()}
    assert {e["path"]: e["lfs"] for e in got["tree"] if e["kind"] == "RepoFile"} == wanted
    assert {e["path"] for e in got["tree"] if e["kind"] == "RepoFolder"} == {
        "notes",
        "tokenizer",
        "tokenizer/extra",
    }
    assert got["top"] == sorted(
        [".gitattributes", "config.json", "model.safetensors", "notes", "tokenizer"]
    )
    assert got["sub"] == ["tokenizer/extra", "tokenizer/tokenizer.json"]
    assert got["one"] == wanted["tokenizer/extra/merges.txt"]
    assert got["snap"] == wanted
    assert got["local"] == wanted


async def test_huggingface_hub_sees_the_hubs_errors(mirror: Any, hf_run: Any) -> None:
    script = textwrap.dedent(
        f"""
        import json
        from huggingface_hub import HfApi, hf_hub_download
        out = {{}}
        for name, call in {{
            "repo": lambda: HfApi().model_info("acme/nope"),
            "revision": lambda: HfApi().model_info("{REPO}", revision="v9"),
            "entry": lambda: hf_hub_download("{REPO}", "nope.txt"),
            "file_repo": lambda: hf_hub_download("acme/nope", "x.txt"),
        }}.items():
            try:
                call()
                out[name] = None
            except Exception as exc:
                out[name] = type(exc).__name__
        print(json.dumps(out))
        """
    )
    got = await hf_run(mirror.url, script)
    assert got == {
        "repo": "RepositoryNotFoundError",
        "revision": "RevisionNotFoundError",
        "entry": "RemoteEntryNotFoundError",
        "file_repo": "RepositoryNotFoundError",
    }


@pytest.mark.parametrize(
    "target",
    [
        "/{repo}/resolve/main/../config.json",
        "/{repo}/resolve/main/%2e%2e/config.json",
        "/{repo}/resolve/main/tokenizer/..%2Fconfig.json",
        "/{repo}/resolve/main//etc/passwd",
        "/{repo}/resolve/main/%2Fetc%2Fpasswd",
        "/{repo}/resolve/main/config.json%00.txt",
        "/{repo}/resolve/main/a%5C..%5Cconfig.json",
        "/{repo}/resolve/main/%ff",
        "/{repo}/resolve/..%2F..%2Fx/config.json",
        "/acme/..%2F..%2Fetc/resolve/main/config.json",
        "/api/models/{repo}/tree/main/..",
        "/api/models/{repo}/revision/..",
        "/api/models/acme/%00/revision/main",
    ],
)
async def test_bad_paths_get_400_in_the_hubs_shape(mirror: Any, target: str) -> None:
    status, headers, body = await raw_request(mirror.url, target.format(repo=REPO))
    assert status == 400, (status, body)
    message = json.loads(body)["error"]
    assert message
    assert headers["x-error-message"]
    assert headers["content-type"] == "application/json"
    assert mirror.stats.to_json()["bytes_served_total"] == 0


@pytest.mark.parametrize(
    ("target", "code"),
    [
        ("/acme/nope/resolve/main/config.json", "RepoNotFound"),
        ("/{repo}/resolve/v9/config.json", "RevisionNotFound"),
        ("/{repo}/resolve/main/nope.json", "EntryNotFound"),
        ("/api/models/{repo}/tree/main/nope", "EntryNotFound"),
        ("/api/models/{repo}/revision/" + "0" * 40, "RevisionNotFound"),
    ],
)
async def test_absent_things_get_404_with_the_hubs_code(
    mirror: Any, target: str, code: str
) -> None:
    status, headers, body = await raw_request(mirror.url, target.format(repo=REPO))
    assert status == 404
    assert headers["x-error-code"] == code
    assert json.loads(body)["error"]
    if code == "EntryNotFound":
        assert headers["x-repo-commit"] == mirror.commit.commit


async def test_ranges_and_headers(mirror: Any) -> None:
    data = mirror.files["model.safetensors"]
    sha256 = hashlib.sha256(data).hexdigest()
    url = f"{mirror.url}/{REPO}/resolve/main/model.safetensors"
    async with httpx.AsyncClient(timeout=30) as client:
        head = await client.head(url)
        assert head.status_code == 200
        assert head.headers["x-repo-commit"] == mirror.commit.commit
        assert head.headers["etag"] == head.headers["x-linked-etag"] == f'"{sha256}"'
        assert head.headers["x-linked-size"] == head.headers["content-length"] == str(len(data))
        assert head.headers["accept-ranges"] == "bytes"
        part = await client.get(url, headers={"Range": "bytes=100-199"})
        assert part.status_code == 206
        assert part.content == data[100:200]
        assert part.headers["content-range"] == f"bytes 100-199/{len(data)}"
        tail = await client.get(url, headers={"Range": "bytes=-7"})
        assert tail.status_code == 206
        assert tail.content == data[-7:]
        past = await client.get(url, headers={"Range": f"bytes={len(data)}-"})
        assert past.status_code == 416
        assert past.headers["content-range"] == f"bytes */{len(data)}"
        stale = await client.get(url, headers={"Range": "bytes=0-9", "If-Range": '"other"'})
        assert stale.status_code == 200
        assert stale.content == data
        fresh = await client.get(url, headers={"Range": "bytes=0-9", "If-Range": f'"{sha256}"'})
        assert fresh.status_code == 206
        assert fresh.content == data[:10]
        refused = await client.post(url)
        assert refused.status_code == 405
    served = {f["path"]: f for f in mirror.stats.to_json()["files"]}
    entry = served["model.safetensors"]
    assert entry["bytes_served"] == 100 + 7 + len(data) + 10
    assert entry["requests"] == 4
    assert entry["sha256"] == sha256
    assert entry["commit"] == mirror.commit.commit


async def test_a_request_body_is_refused(mirror: Any) -> None:
    target = f"/{REPO}/resolve/main/config.json"
    status, headers, _ = await raw_request(mirror.url, target, "POST", b"x" * 10)
    assert status == 405
    assert headers["allow"] == "GET, HEAD"
    status, _, body = await raw_request(mirror.url, target, "POST", b"x" * 100_000)
    assert status == 413
    assert "no request body" in json.loads(body)["error"]


async def test_huggingface_hub_resumes_with_a_range(
    mirror: Any, hf_run: Any, tmp_path: Path
) -> None:
    data = mirror.files["model.safetensors"]
    have = 1_000_000
    partial_path = tmp_path / "partial"
    await trio.Path(partial_path).write_bytes(data[:have])
    script = textwrap.dedent(
        f"""
        import hashlib, io, json
        from huggingface_hub import hf_hub_url
        from huggingface_hub.file_download import http_get
        out = io.BytesIO()
        partial = open({str(partial_path)!r}, "rb").read()
        out.write(partial)
        http_get(hf_hub_url("{REPO}", "model.safetensors"), out, resume_size=len(partial),
                 expected_size={len(data)})
        print(json.dumps({{"sha256": hashlib.sha256(out.getvalue()).hexdigest()}}))
        """
    )
    got = await hf_run(mirror.url, script)
    assert got["sha256"] == hashlib.sha256(data).hexdigest()
    (entry,) = mirror.stats.to_json()["files"]
    assert entry["bytes_served"] == len(data) - have


async def test_stats_and_the_access_log(mirror: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.mirror.access")
    async with httpx.AsyncClient(timeout=30) as client:
        for path in ("config.json", "config.json", "tokenizer/tokenizer.json"):
            answer = await client.get(f"{mirror.url}/{REPO}/resolve/{mirror.commit.commit}/{path}")
            assert answer.content == mirror.files[path]
        stats = (await client.get(f"{mirror.url}/-/stats")).json()
    config, tokenizer = (
        len(mirror.files["config.json"]),
        len(mirror.files["tokenizer/tokenizer.json"]),
    )
    assert stats["bytes_served_total"] == 2 * config + tokenizer
    assert {f["path"]: (f["bytes_served"], f["requests"]) for f in stats["files"]} == {
        "config.json": (2 * config, 2),
        "tokenizer/tokenizer.json": (tokenizer, 1),
    }

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "llmgw.mirror.access"]

    with trio.fail_after(30):  # each line is written once its answer is sent
        while len(lines()) < 4:  # noqa: ASYNC110 (log records set no event)
            await trio.sleep(0.05)
    assert len(lines()) == 4
    assert f'"GET /{REPO}/resolve/{mirror.commit.commit}/config.json" 200 {config} ' in lines()[0]
    assert '"GET /-/stats" 200' in lines()[3]


async def test_a_flipped_byte_is_served_as_stored(mirror: Any, cli: Any, hf_run: Any) -> None:
    listed = await trio.to_thread.run_sync(
        cli, "mirror", "list", "--data-dir", str(mirror.store.data_dir), "--json"
    )
    (repo,) = json.loads(listed.stdout)["repos"]
    (commit,) = repo["commits"]
    entry = next(f for f in commit["files"] if f["path"] == "model.safetensors")
    blob = Path(entry["blob"])
    flip_byte(blob, 12345)
    script = textwrap.dedent(
        f"""
        import hashlib, json
        from huggingface_hub import HfApi, hf_hub_download
        info = HfApi().model_info("{REPO}", files_metadata=True)
        path = hf_hub_download("{REPO}", "model.safetensors")
        published = next(s.lfs.sha256 for s in info.siblings if s.rfilename == "model.safetensors")
        print(json.dumps({{"published": published,
                           "got": hashlib.sha256(open(path, "rb").read()).hexdigest()}}))
        """
    )
    got = await hf_run(mirror.url, script)
    assert got["published"] == entry["sha256"]
    assert got["got"] != entry["sha256"]
    assert got["got"] == hashlib.sha256(await trio.Path(blob).read_bytes()).hexdigest()


async def test_pull_from_a_mirror_as_upstream(mirror: Any, cli: Any, tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1")
    data_dir = tmp_path / "second"
    args = ("mirror", "pull", f"hf:{REPO}@main", "--data-dir", str(data_dir), "--json")
    done = await trio.to_thread.run_sync(lambda: cli(*args, env=env))
    assert done.returncode == 0, done.stderr
    pulled = json.loads(done.stdout)
    assert pulled["commit"] == mirror.commit.commit
    assert pulled["source"]["kind"] == "hf"
    second = MirrorStore(data_dir)
    assert second.resolve(REPO, "main").files == mirror.commit.files
    for stored in mirror.commit.files:
        assert second.blob_path(stored.sha256).read_bytes() == mirror.files[stored.path]
    assert not (data_dir / "tmp" / "pull").exists()
    served = mirror.stats.to_json()["bytes_served_total"]
    assert served == sum(len(d) for d in mirror.files.values())
    # Again: everything is held, nothing is fetched.
    again = await trio.to_thread.run_sync(lambda: cli(*args, env=env))
    assert again.returncode == 0, again.stderr
    assert mirror.stats.to_json()["bytes_served_total"] == served
    # Only some files.
    only = await trio.to_thread.run_sync(
        lambda: cli(
            "mirror",
            "pull",
            f"hf:{REPO}",
            "--include",
            "*.json",
            "--data-dir",
            str(tmp_path / "third"),
            env=env,
        )
    )
    assert only.returncode == 0, only.stderr
    third = MirrorStore(tmp_path / "third").resolve(REPO, "main")
    # Globs match as fnmatch (and huggingface_hub's allow_patterns) do: "*" spans "/".
    assert [f.path for f in third.files] == ["config.json", "tokenizer/tokenizer.json"]


async def test_pull_refuses_a_corrupt_upstream_copy(mirror: Any, cli: Any, tmp_path: Path) -> None:
    import os

    stored = mirror.commit.file("config.json")
    flip_byte(mirror.store.blob_path(stored.sha256), 3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1")
    data_dir = tmp_path / "second"
    done = await trio.to_thread.run_sync(
        lambda: cli("mirror", "pull", f"hf:{REPO}@main", "--data-dir", str(data_dir), env=env)
    )
    assert done.returncode == 1
    assert "config.json: sha256 is" in done.stderr
    assert stored.sha256 in done.stderr
    assert MirrorStore(data_dir).repos() == []
    assert not (data_dir / "blobs" / "sha256" / stored.sha256[:2] / stored.sha256).exists()


async def test_a_broken_manifest_is_a_500_in_the_hubs_shape(
    mirror: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="llmgw.mirror")
    other = mirror.store.data_dir / "repos" / "acme" / "broken"
    await trio.Path(other / "commits").mkdir(parents=True)
    await trio.Path(other / "refs.json").write_text(json.dumps({"main": "1" * 40}))
    await trio.Path(other / "commits" / f"{'1' * 40}.json").write_text("{")
    status, headers, body = await raw_request(mirror.url, "/api/models/acme/broken")
    assert status == 500
    assert json.loads(body)["error"].startswith("the mirror failed")
    assert headers["x-error-message"]
    # The server goes on answering.
    status, _, _ = await raw_request(mirror.url, f"/api/models/{REPO}")
    assert status == 200


async def test_pull_of_what_the_upstream_lacks_or_cannot_answer(
    mirror: Any, cli: Any, tmp_path: Path
) -> None:
    import os

    data_dir = tmp_path / "second"
    for endpoint, source in (
        (mirror.url, "hf:acme/nope@main"),
        ("http://127.0.0.1:1", f"hf:{REPO}"),
    ):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"))
        done = await trio.to_thread.run_sync(
            partial(cli, "mirror", "pull", source, "--data-dir", str(data_dir), env=env)
        )
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith(f"Error: {endpoint}: "), done.stderr
        assert "Traceback" not in done.stderr
    assert MirrorStore(data_dir).repos() == []

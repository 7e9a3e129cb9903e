"""The mirror's HTTP side: the part of the Hugging Face Hub's API that
``huggingface_hub`` uses to resolve a revision and download files, plus
``/-/stats``. A plain ASGI app served by hypercorn (``llmgw.app.listen``).

Routes (docs/mirror.md):

- ``GET /api/models/{org}/{repo}[/revision/{rev}]``: model info (``id``,
  ``sha`` = the commit, ``siblings``; with ``?blobs=true`` each sibling also
  has ``size``, ``blobId`` and ``lfs: {sha256, size, pointerSize}``);
- ``GET /api/models/{org}/{repo}/tree/{rev}[/{path}][?recursive=true]``: the
  folder's entries (``type`` ``file`` with ``oid``, ``size``, ``path``,
  ``lfs: {oid, size, pointerSize}``, or ``directory``);
- ``GET /api/models/{org}/{repo}/refs``: branches (every ref name);
- ``HEAD|GET /{org}/{repo}/resolve/{rev}/{path}``: the file's bytes, with
  ``X-Repo-Commit``, ``ETag``/``X-Linked-Etag`` (the quoted sha256),
  ``X-Linked-Size``, ``Content-Length``, ``Accept-Ranges: bytes``; one
  ``Range: bytes=…`` is answered 206 with ``Content-Range`` (416 when past
  the end), streamed from disk in 1 MiB blocks;
- ``GET /-/stats``: ``{"bytes_served_total", "files": [{"repo", "commit",
  "path", "sha256", "size_bytes", "bytes_served", "requests"}]}`` since start.

Every file is presented as a Git LFS file, so every ``ETag`` is a sha256 a
client can check. Errors are the Hub's shape: a JSON ``{"error": message}``
with ``X-Error-Message`` and, for a 404, ``X-Error-Code`` (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``). Bad names (``..``, absolute paths,
NUL, …) get 400. Each request is one access log line (logger
``llmgw.mirror.access``): client, method, path, status, body bytes sent, range.
Bytes are served as stored: the mirror does not re-check digests per request.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Final
from urllib.parse import parse_qs, quote, unquote_to_bytes

import attrs
import orjson
import trio

from llmgw.app.listen import serve_asgi
from llmgw.asgi import Receive, Scope, Send, answer_lifespan, cancel_on_disconnect
from llmgw.errors import InvalidInput, describe

from .paths import BadName, check_path, check_repo_id, check_revision
from .store import BLOCK_BYTES, Commit, EntryNotFound, MirrorNotFound, MirrorStore, StoredFile

__all__ = [
    "ByteRange",
    "MirrorApp",
    "RangeNotSatisfiable",
    "Stats",
    "parse_range",
    "run_mirror",
    "serve_mirror",
]

access_log = logging.getLogger("llmgw.mirror.access")
log = logging.getLogger("llmgw.mirror")

_RANGE: Final = re.compile(r"bytes=(\d*)-(\d*)")
_TRUE: Final = frozenset({"1", "true", "True"})
#: A request body read (and dropped) before the answer is 413.
_MAX_BODY_BYTES: Final = 1 << 16


class RangeNotSatisfiable(InvalidInput):
    """A ``Range`` that starts past the file's end."""


@attrs.frozen
class ByteRange:
    """Bytes ``start`` to ``end`` inclusive."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def parse_range(header: str | None, size_bytes: int) -> ByteRange | None:
    """The one byte range ``header`` asks of a file of ``size_bytes``, or
    ``None`` for the whole file (no header, a form not understood, several
    ranges: RFC 9110 lets a server answer those with the whole file).

    Raises:
        RangeNotSatisfiable: the range starts at or past the end (or asks a
            suffix of an empty file).
    """
    if header is None:
        return None
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:
        suffix = int(last)
        if suffix == 0 or size_bytes == 0:
            raise RangeNotSatisfiable(f"range {header} of {size_bytes} bytes")
        return ByteRange(max(0, size_bytes - suffix), size_bytes - 1)
    start = int(first)
    if last and int(last) < start:
        return None
    end = int(last) if last else size_bytes - 1
    if start >= size_bytes:
        raise RangeNotSatisfiable(f"range {header} of {size_bytes} bytes")
    return ByteRange(start, min(end, size_bytes - 1))


@attrs.define
class _FileStats:
    sha256: str
    size_bytes: int
    bytes_served: int = 0
    requests: int = 0


@attrs.define
class Stats:
    """Bytes served per file since the server started."""

    files: dict[tuple[str, str, str], _FileStats] = attrs.field(factory=dict)

    def entry(self, repo: str, commit: str, stored: StoredFile) -> _FileStats:
        key = (repo, commit, stored.path)
        found = self.files.get(key)
        if found is None:
            found = self.files[key] = _FileStats(stored.sha256, stored.size_bytes)
        return found

    def to_json(self) -> dict[str, Any]:
        """The ``/-/stats`` answer (module docstring)."""
        return {
            "bytes_served_total": sum(f.bytes_served for f in self.files.values()),
            "files": [
                {
                    "repo": repo,
                    "commit": commit,
                    "path": path,
                    "sha256": f.sha256,
                    "size_bytes": f.size_bytes,
                    "bytes_served": f.bytes_served,
                    "requests": f.requests,
                }
                for (repo, commit, path), f in sorted(self.files.items())
            ],
        }


class _Answer(Exception):
    """An answer other than the happy one: ``status``, a message, the Hub's
    error code and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers


def _header_text(text: str) -> str:
    """``text`` made safe for a header value: ASCII, no control characters."""
    ascii_text = text.encode("ascii", "backslashreplace").decode("ascii")
    return re.sub(r"[\x00-\x1f\x7f]", "?", ascii_text)


def _iso(commit: Commit) -> str:
    return commit.created_at.strftime("%Y-%m-%dT%H:%M:%S.000Z")


@attrs.define
class _Request:
    method: str
    segments: list[str]
    query: dict[str, list[str]]
    headers: dict[str, str]
    client: str
    target: str
    receive: Receive


class MirrorApp:
    """The ASGI app of the module docstring over ``store``, counting into
    ``stats``."""

    def __init__(self, store: MirrorStore, stats: Stats | None = None) -> None:
        self.store = store
        self.stats = stats if stats is not None else Stats()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body_bytes = 0
        while True:  # no route takes a body: read and drop it, up to a bound
            message = await receive()
            body_bytes += len(message.get("body", b""))
            if not message.get("more_body", False) or body_bytes > _MAX_BODY_BYTES:
                break
        sent = [0]
        status = [0]
        byte_range: list[str] = []

        async def counted_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                sent[0] += len(message.get("body", b""))
            await send(message)

        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        client = scope.get("client") or ("-", 0)
        target = raw_path.decode("latin-1")
        started = time.monotonic()
        try:
            try:
                request = _Request(
                    method=scope["method"],
                    segments=_segments(raw_path),
                    query=parse_qs(scope.get("query_string", b"").decode("latin-1")),
                    headers={
                        k.decode("latin-1").lower(): v.decode("latin-1")
                        for k, v in scope["headers"]
                    },
                    client=str(client[0]),
                    target=target,
                    receive=receive,
                )
                if body_bytes > _MAX_BODY_BYTES:
                    raise _Answer(
                        413, f"the mirror takes no request body over {_MAX_BODY_BYTES} bytes"
                    )
                await self._dispatch(request, counted_send, byte_range)
            except _Answer as answer:
                await _error(counted_send, answer, head=scope["method"] == "HEAD")
            except Exception as exc:  # a broken manifest, an unreadable blob
                log.exception("mirror: %s %s failed", scope["method"], target)
                if status[0]:
                    raise  # the answer had started: hypercorn cuts the connection
                failure = _Answer(500, f"the mirror failed: {describe(exc)}")
                await _error(counted_send, failure, head=scope["method"] == "HEAD")
        finally:
            access_log.info(
                '%s "%s %s" %d %d%s %.3fs',
                client[0],
                scope["method"],
                target,
                status[0],
                sent[0],
                f" range={byte_range[0]}" if byte_range else "",
                time.monotonic() - started,
            )

    async def _dispatch(self, request: _Request, send: Send, byte_range: list[str]) -> None:
        parts = request.segments
        if parts == ["-", "stats"]:
            _only(request, ("GET", "HEAD"))
            await _json(send, self.stats.to_json(), head=request.method == "HEAD")
            return
        if len(parts) >= 4 and parts[0] == "api" and parts[1] == "models":
            _only(request, ("GET", "HEAD"))
            await self._api(request, send, parts[2:])
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            _only(request, ("GET", "HEAD"))
            await self._resolve(request, send, parts, byte_range)
            return
        raise _Answer(404, f"no route for {request.target}")

    async def _api(self, request: _Request, send: Send, parts: list[str]) -> None:
        repo = _repo(parts[0], parts[1])
        rest = parts[2:]
        head = request.method == "HEAD"
        if not rest:
            commit = await self._resolve_commit(repo, "main")
            await _json(send, _model_info(commit, _flag(request, "blobs")), head=head)
        elif rest[0] == "revision" and len(rest) == 2:
            commit = await self._resolve_commit(repo, _revision(rest[1]))
            await _json(send, _model_info(commit, _flag(request, "blobs")), head=head)
        elif rest[0] == "tree" and len(rest) >= 2:
            commit = await self._resolve_commit(repo, _revision(rest[1]))
            folder = _path("/".join(rest[2:])) if rest[2:] else ""
            entries = _tree(commit, folder, _flag(request, "recursive"))
            await _json(send, entries, head=head, commit=commit.commit)
        elif rest == ["refs"]:
            refs = await self._call(lambda: self.store.refs(repo))
            branches = [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": target}
                for name, target in sorted(refs.items())
            ]
            await _json(send, {"branches": branches, "tags": [], "converts": []}, head=head)
        else:
            raise _Answer(404, f"no route for {request.target}")

    async def _resolve_commit(self, repo: str, revision: str) -> Commit:
        commit: Commit = await self._call(lambda: self.store.resolve(repo, revision))
        return commit

    async def _call(self, lookup: Callable[[], Any]) -> Any:
        """``lookup()`` (a store read: small files) in a worker thread, its
        misses turned into the Hub's 404s and 400s."""
        try:
            return await trio.to_thread.run_sync(lookup)
        except MirrorNotFound as exc:
            headers = [("X-Repo-Commit", exc.commit)] if exc.commit else []
            raise _Answer(404, describe(exc), exc.code, headers) from None
        except BadName as exc:
            raise _Answer(400, describe(exc)) from None

    async def _resolve(
        self, request: _Request, send: Send, parts: list[str], byte_range: list[str]
    ) -> None:
        repo = _repo(parts[0], parts[1])
        revision = _revision(parts[3])
        path = _path("/".join(parts[4:]))
        commit = await self._resolve_commit(repo, revision)
        stored = commit.file(path)
        if stored is None:
            raise _Answer(
                404,
                describe(EntryNotFound(f"{path} is not in {repo} at {commit.commit}")),
                "EntryNotFound",
                [("X-Repo-Commit", commit.commit)],
            )
        etag = f'"{stored.sha256}"'
        headers = [
            ("X-Repo-Commit", commit.commit),
            ("ETag", etag),
            ("X-Linked-Etag", etag),
            ("X-Linked-Size", str(stored.size_bytes)),
            ("Accept-Ranges", "bytes"),
            ("Content-Type", "application/octet-stream"),
            ("Content-Disposition", _disposition(path)),
        ]
        wanted: ByteRange | None = None
        range_header = request.headers.get("range")
        if_range = request.headers.get("if-range")
        if (
            request.method == "GET"
            and range_header is not None
            and (if_range is None or if_range.strip() == etag)
        ):
            byte_range.append(range_header)
            try:
                wanted = parse_range(range_header, stored.size_bytes)
            except RangeNotSatisfiable as exc:
                raise _Answer(
                    416,
                    describe(exc),
                    None,
                    [*headers, ("Content-Range", f"bytes */{stored.size_bytes}")],
                ) from None
        if wanted is None:
            status, start, length = 200, 0, stored.size_bytes
        else:
            status, start, length = 206, wanted.start, wanted.length
            headers.append(
                ("Content-Range", f"bytes {wanted.start}-{wanted.end}/{stored.size_bytes}")
            )
        headers.append(("Content-Length", str(length)))
        blob = self.store.blob_path(stored.sha256)
        if request.method == "HEAD":
            await _start(send, status, headers)
            await send({"type": "http.response.body", "body": b""})
            return
        try:
            stream = await trio.open_file(blob, "rb")
        except FileNotFoundError:
            log.error("mirror: blob %s of %s/%s is missing", stored.sha256, repo, path)
            raise _Answer(500, f"the mirror lost the bytes of {path}") from None
        counter = self.stats.entry(repo, commit.commit, stored)
        counter.requests += 1
        # Watch for the client going away only while the body streams: the
        # watcher must be gone before the last message (hypercorn then closes
        # or recycles the connection, and a pending receive holds that up).
        async with stream:
            await stream.seek(start)
            await _start(send, status, headers)
            with trio.CancelScope() as streaming:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(cancel_on_disconnect, request.receive, streaming)
                    remaining = length
                    while remaining > 0:
                        block = await stream.read(min(BLOCK_BYTES, remaining))
                        if not block:
                            log.error("mirror: blob %s is shorter than recorded", stored.sha256)
                            break
                        await send({"type": "http.response.body", "body": block, "more_body": True})
                        counter.bytes_served += len(block)
                        remaining -= len(block)
                    nursery.cancel_scope.cancel()
        if streaming.cancelled_caught:
            return  # the client went away
        await send({"type": "http.response.body", "body": b""})


def _segments(raw_path: bytes) -> list[str]:
    """The URL path's parts, each percent-decoded and read as UTF-8 (a ``%2F``
    stays inside its part); a trailing slash is dropped.

    Raises:
        _Answer: 400 when the path is not ASCII or a part not UTF-8.
    """
    try:
        parts = [unquote_to_bytes(p).decode("utf-8") for p in raw_path.split(b"/")[1:]]
    except UnicodeDecodeError:
        raise _Answer(400, "the URL path is not UTF-8") from None
    if parts and parts[-1] == "":
        parts.pop()
    return parts


def _repo(org: str, name: str) -> str:
    try:
        return check_repo_id(f"{org}/{name}")
    except BadName as exc:
        raise _Answer(400, describe(exc)) from None


def _revision(revision: str) -> str:
    try:
        return check_revision(revision)
    except BadName as exc:
        raise _Answer(400, describe(exc)) from None


def _path(path: str) -> str:
    try:
        return check_path(path)
    except BadName as exc:
        raise _Answer(400, describe(exc)) from None


def _only(request: _Request, methods: tuple[str, ...]) -> None:
    if request.method not in methods:
        raise _Answer(
            405, f"{request.method} is not allowed here", None, [("Allow", ", ".join(methods))]
        )


def _flag(request: _Request, name: str) -> bool:
    return any(v in _TRUE for v in request.query.get(name, []))


def _disposition(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    plain = _header_text(name).replace('"', "")
    return f"inline; filename*=UTF-8''{quote(name)}; filename=\"{plain}\";"


def _sibling(stored: StoredFile, blobs: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"rfilename": stored.path}
    if blobs:
        entry.update(
            size=stored.size_bytes,
            blobId=stored.blob_id,
            lfs={
                "sha256": stored.sha256,
                "size": stored.size_bytes,
                "pointerSize": len(stored.lfs_pointer),
            },
        )
    return entry


def _model_info(commit: Commit, blobs: bool) -> dict[str, Any]:
    org = commit.repo.split("/")[0]
    return {
        "_id": commit.commit[:24],
        "id": commit.repo,
        "modelId": commit.repo,
        "author": org,
        "sha": commit.commit,
        "lastModified": _iso(commit),
        "createdAt": _iso(commit),
        "private": False,
        "gated": False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "library_name": None,
        "siblings": [_sibling(f, blobs) for f in commit.files],
        "usedStorage": sum(f.size_bytes for f in commit.files),
    }


def _tree(commit: Commit, folder: str, recursive: bool) -> list[dict[str, Any]]:
    """The entries under ``folder`` ("" = the root) of ``commit``.

    Raises:
        _Answer: 404 ``EntryNotFound`` when ``folder`` is no folder of it.
    """
    prefix = f"{folder}/" if folder else ""
    folders: set[str] = set()
    files: list[dict[str, Any]] = []
    for stored in commit.files:
        if not stored.path.startswith(prefix):
            continue
        parts = stored.path[len(prefix) :].split("/")
        for depth in range(1, len(parts) if recursive else min(2, len(parts))):
            folders.add(prefix + "/".join(parts[:depth]))
        if recursive or len(parts) == 1:
            files.append(
                {
                    "type": "file",
                    "oid": stored.blob_id,
                    "size": stored.size_bytes,
                    "path": stored.path,
                    "lfs": {
                        "oid": stored.sha256,
                        "size": stored.size_bytes,
                        "pointerSize": len(stored.lfs_pointer),
                    },
                }
            )
    if folder and not files and not folders:
        raise _Answer(
            404,
            f"{folder} is not a folder of {commit.repo} at {commit.commit}",
            "EntryNotFound",
            [("X-Repo-Commit", commit.commit)],
        )
    dirs = [
        {"type": "directory", "oid": _folder_oid(commit, name), "size": 0, "path": name}
        for name in sorted(folders)
    ]
    return dirs + files


def _folder_oid(commit: Commit, folder: str) -> str:
    return hashlib.sha1(f"{commit.commit} {folder}".encode(), usedforsecurity=False).hexdigest()


async def _start(send: Send, status: int, headers: Sequence[tuple[str, str]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(k.lower().encode(), _header_text(v).encode()) for k, v in headers],
        }
    )


async def _json(send: Send, body: Any, *, head: bool = False, commit: str | None = None) -> None:
    data = orjson.dumps(body)
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    if commit is not None:
        headers.append(("X-Repo-Commit", commit))
    await _start(send, 200, headers)
    await send({"type": "http.response.body", "body": b"" if head else data})


async def _error(send: Send, answer: _Answer, *, head: bool) -> None:
    data = orjson.dumps({"error": answer.message})
    headers = [
        *answer.headers,
        ("Content-Type", "application/json"),
        ("X-Error-Message", answer.message),
    ]
    headers = [(k, v) for k, v in headers if k != "Content-Length"]
    headers.append(("Content-Length", str(len(data))))
    if answer.code is not None:
        headers.append(("X-Error-Code", answer.code))
    await _start(send, answer.status, headers)
    await send({"type": "http.response.body", "body": b"" if head else data})


async def serve_mirror(
    store: MirrorStore,
    bind: str,
    stop: trio.Event,
    *,
    stats: Stats | None = None,
    grace_s: float = 5.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``store`` on ``bind`` (``host:port``; port 0 = any free one) until
    ``stop``; started with the bound ``host:port``. Requests still running
    get ``grace_s`` seconds after ``stop``."""
    app = MirrorApp(store, stats)
    async with trio.open_nursery() as nursery:
        bound: str = await nursery.start(serve_asgi, app, bind, stop, grace_s)
        log.debug("mirror: serving %s on http://%s", store.data_dir, bound)
        task_status.started(bound)


async def run_mirror(store: MirrorStore, bind: str, say: Callable[[str], None]) -> None:
    """``llmgw mirror serve``: serve ``store`` on ``bind`` until SIGINT or
    SIGTERM (a second one, later, stops at once); says the bound address."""
    from llmgw.app.process import serve_signals

    stop = trio.Event()
    grace_s = 5.0
    async with trio.open_nursery() as outer:
        outer.start_soon(serve_signals, stop, outer.cancel_scope, say, grace_s)
        async with trio.open_nursery() as inner:
            bound = await inner.start(partial(serve_mirror, store, bind, stop, grace_s=grace_s))
            say(f"mirror: serving {store.data_dir} on http://{bound}")
        outer.cancel_scope.cancel()
    say("mirror: stopped")

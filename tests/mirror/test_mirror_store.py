"""The mirror's store: import, immutable commits, refs, digests, and the
``llmgw mirror import|list`` commands over it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from llmgw.mirror.paths import BadName
from llmgw.mirror.store import (
    CommitConflict,
    DigestMismatch,
    MirrorStore,
    RepoNotFound,
    RevisionNotFound,
    StoredFile,
    git_blob_sha1,
)

REPO = "acme/tiny-model"


def test_import_a_directory(tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]]) -> None:
    root, files = repo_dir
    store = MirrorStore(tmp_path / "m")
    commit = store.import_path(root, REPO, revision="v1")
    assert [f.path for f in commit.files] == sorted(files)
    for stored in commit.files:
        data = files[stored.path]
        assert stored.size_bytes == len(data)
        assert stored.sha256 == hashlib.sha256(data).hexdigest()
        blob = store.blob_path(stored.sha256)
        assert blob.read_bytes() == data
        assert blob.stat().st_mode & 0o777 == 0o444
    assert store.refs(REPO) == {"main": commit.commit, "v1": commit.commit}
    assert store.resolve(REPO, "main") == commit
    assert store.resolve(REPO, "v1") == commit
    assert store.resolve(REPO, commit.commit) == commit
    assert store.repos() == [REPO]
    # Nothing is left in tmp/.
    assert list((tmp_path / "m" / "tmp").iterdir()) == []


def test_the_commit_id_comes_from_the_repo_and_the_files(
    tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]]
) -> None:
    root, _ = repo_dir
    store = MirrorStore(tmp_path / "m")
    first = store.import_path(root, REPO)
    again = store.import_path(root, REPO)
    assert again.commit == first.commit
    other = store.import_path(root, "acme/other")
    assert other.commit != first.commit
    (root / "config.json").write_bytes(b"{}")
    changed = store.import_path(root, REPO, revision="v2")
    assert changed.commit != first.commit
    # main names the newest import; the first commit is still there, unchanged.
    assert store.refs(REPO) == {"main": changed.commit, "v2": changed.commit}
    assert store.resolve(REPO, first.commit).files == first.files
    assert [c.commit for c in store.commits(REPO)] == [first.commit, changed.commit]


def test_a_commit_never_changes(tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]]) -> None:
    root, _ = repo_dir
    store = MirrorStore(tmp_path / "m")
    commit = store.import_path(root, REPO)
    fewer = commit.files[:1]
    with pytest.raises(CommitConflict, match="never changes"):
        store.add_commit(REPO, fewer, source={"kind": "test"}, commit=commit.commit)
    assert store.resolve(REPO, commit.commit).files == commit.files


def test_a_single_file_and_its_expected_digest(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + os.urandom(1000))
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    store = MirrorStore(tmp_path / "m")
    with pytest.raises(DigestMismatch) as caught:
        store.import_path(model, REPO, expected_sha256="0" * 64)
    assert digest in str(caught.value)
    assert "0" * 64 in str(caught.value)
    # Nothing was recorded or kept.
    assert store.repos() == []
    assert not (tmp_path / "m" / "blobs").exists() or not any((tmp_path / "m" / "blobs").rglob("*"))
    assert list((tmp_path / "m" / "tmp").iterdir()) == []
    commit = store.import_path(model, REPO, expected_sha256=digest.upper())
    assert commit.files == (StoredFile("m.gguf", 1004, digest),)


def test_a_stored_blob_that_no_longer_verifies_is_replaced(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 5000)
    store = MirrorStore(tmp_path / "m")
    commit = store.import_path(model, REPO)
    blob = store.blob_path(commit.files[0].sha256)
    blob.chmod(0o644)
    blob.write_bytes(b"y" + b"x" * 4999)
    assert not store.verify_blob(commit.files[0].sha256)
    store.import_path(model, "acme/again")
    assert store.verify_blob(commit.files[0].sha256)


def test_symlinks_are_followed_and_git_folders_skipped(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc").write_bytes(b"weights")
    snap = tmp_path / "snap"
    (snap / ".git").mkdir(parents=True)
    (snap / ".git" / "HEAD").write_text("ref: x")
    (snap / ".cache" / "huggingface").mkdir(parents=True)
    (snap / ".cache" / "huggingface" / "x.lock").write_text("")
    (snap / "model.safetensors").symlink_to(blobs / "abc")
    commit = MirrorStore(tmp_path / "m").import_path(snap, REPO)
    assert [f.path for f in commit.files] == ["model.safetensors"]


@pytest.mark.parametrize(
    ("repo", "revision"), [("acme", None), ("acme/../x", None), (REPO, "a..b"), (REPO, "f" * 40)]
)
def test_bad_names_record_nothing(
    tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]], repo: str, revision: str | None
) -> None:
    store = MirrorStore(tmp_path / "m")
    with pytest.raises(BadName):
        store.import_path(repo_dir[0], repo, revision=revision)
    assert store.repos() == []


def test_nothing_to_import(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    store = MirrorStore(tmp_path / "m")
    with pytest.raises(ValueError, match="holds no files"):
        store.import_path(empty, REPO)
    with pytest.raises(ValueError, match="does not exist"):
        store.import_path(tmp_path / "nope", REPO)


def test_lookups_that_fail(tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]]) -> None:
    store = MirrorStore(tmp_path / "m")
    with pytest.raises(RepoNotFound):
        store.resolve(REPO, "main")
    store.import_path(repo_dir[0], REPO)
    with pytest.raises(RevisionNotFound):
        store.resolve(REPO, "v9")
    with pytest.raises(RevisionNotFound):
        store.resolve(REPO, "0" * 40)


def test_lfs_pointer_and_blob_id() -> None:
    stored = StoredFile("m.gguf", 3, hashlib.sha256(b"abc").hexdigest())
    assert stored.lfs_pointer == (
        b"version https://git-lfs.github.com/spec/v1\n"
        b"oid sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad\n"
        b"size 3\n"
    )
    # git hash-object of an empty file
    assert git_blob_sha1(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert stored.blob_id == git_blob_sha1(stored.lfs_pointer)


def test_cli_import_and_list(
    tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]], cli: Any
) -> None:
    data_dir = tmp_path / "m"
    done = cli(
        "mirror", "import", str(repo_dir[0]), "--as", REPO, "--data-dir", str(data_dir), "--json"
    )
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout)
    listed = cli("mirror", "list", "--data-dir", str(data_dir), "--json")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    (repo,) = doc["repos"]
    assert repo["repo"] == REPO
    assert repo["refs"] == {"main": imported["commit"]}
    (commit,) = repo["commits"]
    assert commit == imported
    for entry in commit["files"]:
        assert Path(entry["blob"]).read_bytes() == repo_dir[1][entry["path"]]
    table = cli("mirror", "list", "--data-dir", str(data_dir))
    assert imported["commit"] in table.stdout
    assert "main" in table.stdout
    bad = cli(
        "mirror", "import", str(repo_dir[0]), "--as", "acme/../x", "--data-dir", str(data_dir)
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("Error: repository id 'acme/../x' is not ORG/REPO")
    missing = cli("mirror", "import", "--data-dir", str(data_dir))
    assert missing.returncode == 2
    assert "give PATH and --as" in missing.stderr


def test_verify_names_a_changed_blob(
    tmp_path: Path, repo_dir: tuple[Path, dict[str, bytes]], cli: Any
) -> None:
    data_dir = tmp_path / "m"
    store = MirrorStore(data_dir)
    commit = store.import_path(repo_dir[0], REPO)
    clean = cli("mirror", "verify", "--data-dir", str(data_dir))
    assert clean.returncode == 0, clean.stderr
    assert "every stored file matches" in clean.stdout
    stored = commit.file("config.json")
    assert stored is not None
    blob = store.blob_path(stored.sha256)
    blob.chmod(0o644)
    blob.write_bytes(b"[" + blob.read_bytes()[1:])
    changed = hashlib.sha256(blob.read_bytes()).hexdigest()
    found = cli("mirror", "verify", "--data-dir", str(data_dir), "--json")
    assert found.returncode == 1
    (problem,) = json.loads(found.stdout)
    assert problem["sha256"] == stored.sha256
    assert problem["actual"] == changed
    assert problem["used_by"] == [{"repo": REPO, "commit": commit.commit, "path": "config.json"}]
    blob.unlink()
    (missing,) = store.check_blobs()
    assert missing.actual is None

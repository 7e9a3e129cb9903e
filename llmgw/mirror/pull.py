"""``llmgw mirror pull hf:ORG/REPO@REV``: copy one commit of a Hub repository
(or of another mirror) into this mirror, checking each file's digest.

``huggingface_hub`` resolves the revision to its commit and lists the files
with their sizes and the LFS sha256 the Hub publishes (``model_info`` with
``files_metadata``), then downloads each file (``hf_hub_download``, which
retries a broken transfer from where it broke) into ``tmp/pull`` in the data
directory. Each file is then hashed: an LFS file must match its
published sha256, any other file its git blob id, and its size; a mismatch
deletes the copy and names both digests. Verified files are moved (not
copied) into the blob store, and the commit is recorded under the Hub's own
commit id, so ``hf:ORG/REPO@<commit>`` means the same bytes on the Hub and
on the mirror. Files already held (same sha256 and size) are not fetched, so
pulling again after an interruption fetches only the files not yet stored.
Pickle-format files (``.bin``, ``.pt``, …) are left out unless asked for.
The endpoint is ``HF_ENDPOINT`` unless given; a token comes from
``huggingface_hub``'s usual places (``HF_TOKEN``, the token file).
"""

from __future__ import annotations

import fnmatch
import logging
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import attrs

from llmgw.control.catalog import PICKLE_SUFFIXES
from llmgw.errors import InvalidInput, UpstreamError, describe

from .paths import check_path, check_repo_id, check_revision
from .store import Commit, DigestMismatch, MirrorStore, StoredFile, git_blob_sha1, sha256_of

__all__ = ["PullSource", "parse_hf_source", "pull"]

log = logging.getLogger("llmgw.mirror")

_SOURCE: Final = re.compile(r"hf:([^@]+?)(?:@(.+))?")


@attrs.frozen
class PullSource:
    """``hf:ORG/REPO[@REV]`` read: the repository id and the revision
    (``main`` when none is given)."""

    repo: str
    revision: str


def parse_hf_source(text: str) -> PullSource:
    """The repository and revision of ``hf:ORG/REPO[@REV]``.

    Raises:
        BadName: not that shape, or a bad repository id or revision.
    """
    match = _SOURCE.fullmatch(text.strip())
    if match is None:
        raise InvalidInput(f"{text!r} is not hf:ORG/REPO[@REVISION]")
    repo, revision = match.groups()
    return PullSource(check_repo_id(repo), check_revision(revision or "main"))


def _wanted(path: str, include: Sequence[str], allow_pickle: bool) -> bool:
    if include and not any(fnmatch.fnmatchcase(path, glob) for glob in include):
        return False
    return allow_pickle or not path.lower().endswith(PICKLE_SUFFIXES)


def pull(
    store: MirrorStore,
    source: PullSource,
    *,
    endpoint: str | None = None,
    include: Sequence[str] = (),
    allow_pickle: bool = False,
    say: Callable[[str], None] = log.info,
) -> Commit:
    """Pull ``source`` into ``store`` (module docstring); the commit recorded.

    Raises:
        InvalidInput: no file left after the filters, or a bad file name.
        DigestMismatch: a downloaded file is not what the Hub published
            (nothing of it is kept).
        UpstreamError: the Hub (or upstream mirror) failed or refused.
        CommitConflict: the commit is held with another set of files.
    """
    import httpx2
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    # What the Hub (or the way to it) can fail with: an HTTP error answer, a
    # transport error, or hf_hub_download's "not reachable, not cached".
    upstream_errors = (HfHubHTTPError, LocalEntryNotFoundError, httpx2.HTTPError)
    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(source.repo, revision=source.revision, files_metadata=True)
    except upstream_errors as exc:
        raise UpstreamError(
            f"{api.endpoint}: {source.repo}@{source.revision}: {describe(exc)}"
        ) from exc
    commit = info.sha
    if commit is None:
        raise UpstreamError(f"{api.endpoint} gave no commit for {source.repo}@{source.revision}")
    siblings = [s for s in info.siblings or [] if _wanted(s.rfilename, include, allow_pickle)]
    skipped = len(info.siblings or []) - len(siblings)
    if not siblings:
        raise InvalidInput(f"no file of {source.repo}@{commit} is left after the filters")
    say(
        f"{source.repo}@{source.revision} is commit {commit}: {len(siblings)} files"
        + (f" ({skipped} left out)" if skipped else "")
    )
    cache = store.tmp_dir() / "pull"
    stored: list[StoredFile] = []
    for sibling in siblings:
        path = check_path(sibling.rfilename)
        lfs = sibling.lfs
        if lfs is not None and store.has_blob(lfs.sha256, lfs.size):
            say(f"  {path}: held already ({lfs.size} bytes)")
            stored.append(StoredFile(path, lfs.size, lfs.sha256))
            continue
        try:
            local = Path(
                hf_hub_download(
                    source.repo, path, revision=commit, cache_dir=cache, endpoint=endpoint
                )
            ).resolve()
        except upstream_errors as exc:
            raise UpstreamError(f"{api.endpoint}: {source.repo}/{path}: {describe(exc)}") from exc
        sha256 = sha256_of(local)
        size = local.stat().st_size
        try:
            _check(path, local, sha256, size, sibling.size, sibling.blob_id, lfs)
        except DigestMismatch:
            local.unlink(missing_ok=True)
            raise
        store.add_blob(local, sha256)
        say(f"  {path}: {size} bytes, sha256 {sha256}")
        stored.append(StoredFile(path, size, sha256))
    refs = () if source.revision == commit else (source.revision,)
    result = store.add_commit(
        source.repo,
        stored,
        source={"kind": "hf", "endpoint": api.endpoint, "revision": source.revision},
        commit=commit,
        ref_names=[r for r in refs if r != "main"],
    )
    shutil.rmtree(cache, ignore_errors=True)
    return result


def _check(
    path: str,
    local: Path,
    sha256: str,
    size: int,
    published_size: int | None,
    blob_id: str | None,
    lfs: object,
) -> None:
    """Raise :class:`DigestMismatch` unless the file matches what was published."""
    expected_sha256 = getattr(lfs, "sha256", None)
    if expected_sha256 is not None:
        if sha256 != expected_sha256:
            raise DigestMismatch(
                f"{path}: sha256 is {sha256}, the upstream published {expected_sha256}"
            )
    elif blob_id is not None:
        actual = git_blob_sha1(local.read_bytes())
        if actual != blob_id:
            raise DigestMismatch(
                f"{path}: git blob id is {actual}, the upstream published {blob_id}"
            )
    else:
        raise DigestMismatch(f"{path}: the upstream published no digest to check")
    if published_size is not None and size != published_size:
        raise DigestMismatch(f"{path}: {size} bytes, the upstream published {published_size}")

"""The names the mirror accepts: repository ids, revisions and file paths.

Everything a client sends in a URL passes through here before the store
looks at it; each check raises :class:`BadName` (an ``InvalidInput``), which
the server answers with 400 in the Hub's error shape (docs/mirror.md).

- a repository id is ``ORG/REPO``, each part 1 to 96 of ``A-Z a-z 0-9 . _ -``,
  starting and ending with a letter or digit, without ``--`` or ``..``;
- a revision is a 40-hex commit or a ref name: 1 to 128 of ``A-Z a-z 0-9 . _ -
  /``, no ``..``, no empty part, not starting with ``/`` or ``-``;
- a file path is relative POSIX text: no empty, ``.`` or ``..`` part, no NUL
  or other control character, no backslash, at most 1024 bytes of UTF-8.
"""

from __future__ import annotations

import re
from typing import Final

from llmgw.errors import InvalidInput

__all__ = [
    "COMMIT",
    "BadName",
    "check_path",
    "check_ref_name",
    "check_repo_id",
    "check_revision",
    "is_commit",
]

#: A commit id: 40 lowercase hex digits.
COMMIT: Final = re.compile(r"[0-9a-f]{40}")
_REPO_PART: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_REF: Final = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9._/-]{0,127}")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_MAX_PATH_BYTES: Final = 1024


class BadName(InvalidInput):
    """A repository id, revision or file path that breaks the mirror's rules."""


def is_commit(revision: str) -> bool:
    """Whether ``revision`` is a 40-hex commit id."""
    return COMMIT.fullmatch(revision) is not None


def check_repo_id(repo: str) -> str:
    """``repo`` (``ORG/REPO``) unchanged when valid.

    Raises:
        BadName: not two valid parts.
    """
    parts = repo.split("/")
    if len(parts) != 2 or not all(
        _REPO_PART.fullmatch(part) and ".." not in part and "--" not in part for part in parts
    ):
        raise BadName(f"repository id {repo!r} is not ORG/REPO (letters, digits, '.', '_', '-')")
    return repo


def check_ref_name(name: str) -> str:
    """``name`` unchanged when it may name a branch or tag (not a commit id).

    Raises:
        BadName: not a valid ref name, or 40 hex digits (which read as a commit).
    """
    if (
        _REF.fullmatch(name) is None
        or ".." in name
        or "//" in name
        or name.endswith("/")
        or is_commit(name)
    ):
        raise BadName(
            f"revision name {name!r} is not a ref name (letters, digits, '.', '_', '-', '/'; "
            "not 40 hex digits)"
        )
    return name


def check_revision(revision: str) -> str:
    """``revision`` unchanged when it is a commit id or a ref name.

    Raises:
        BadName: neither.
    """
    if is_commit(revision):
        return revision
    return check_ref_name(revision)


def check_path(path: str) -> str:
    """``path`` unchanged when it is a relative file path inside a repository.

    Raises:
        BadName: empty, absolute, with an empty, ``.`` or ``..`` part, a NUL
            or other control character, a backslash, or over 1024 bytes.
    """
    if not path:
        raise BadName("file path is empty")
    if _CONTROL.search(path):
        raise BadName(f"file path {path!r} holds a control character")
    if "\\" in path:
        raise BadName(f"file path {path!r} holds a backslash")
    if path.startswith("/"):
        raise BadName(f"file path {path!r} is absolute")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise BadName(f"file path {path!r} has an empty, '.' or '..' part")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise BadName(f"file path {path!r} is not valid UTF-8") from None
    if size > _MAX_PATH_BYTES:
        raise BadName(f"file path is {size} bytes, over {_MAX_PATH_BYTES}")
    return path

"""The names the mirror accepts, and the byte ranges it answers: a plain
list of bad inputs, each refused (no fuzzing)."""

from __future__ import annotations

import pytest

from llmgw.mirror.paths import BadName, check_path, check_ref_name, check_repo_id, check_revision
from llmgw.mirror.pull import parse_hf_source
from llmgw.mirror.server import ByteRange, RangeNotSatisfiable, parse_range

BAD_PATHS = [
    "",
    "..",
    "../etc/passwd",
    "a/../../b",
    "a/./b",
    ".",
    "/etc/passwd",
    "//x",
    "a//b",
    "a/",
    "a\x00b",
    "model.gguf\x00.txt",
    "a\nb",
    "a\\..\\b",
    "x" * 1025,
]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_a_bad_file_path_is_refused(path: str) -> None:
    with pytest.raises(BadName):
        check_path(path)


@pytest.mark.parametrize(
    "path", ["model.gguf", "tokenizer/tokenizer.json", ".gitattributes", "a/b.c/d", "é/ü.txt"]
)
def test_a_good_file_path_passes(path: str) -> None:
    assert check_path(path) == path


@pytest.mark.parametrize(
    "repo",
    [
        "acme",
        "acme/",
        "/x",
        "a/b/c",
        "../x",
        "acme/..",
        "acme/a..b",
        "acme/a--b",
        "-a/b",
        "a/b-",
        "",
    ],
)
def test_a_bad_repo_id_is_refused(repo: str) -> None:
    with pytest.raises(BadName):
        check_repo_id(repo)


def test_a_good_repo_id_passes() -> None:
    assert check_repo_id("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize(
    "name", ["", "..", "a..b", "/main", "main/", "a//b", "-x", "a b", "a\x00", "f" * 40]
)
def test_a_bad_ref_name_is_refused(name: str) -> None:
    with pytest.raises(BadName):
        check_ref_name(name)


def test_revisions() -> None:
    assert check_revision("0" * 40) == "0" * 40
    assert check_revision("main") == "main"
    assert check_revision("refs/pr/1") == "refs/pr/1"
    with pytest.raises(BadName):
        check_revision("A" * 40 + "/..")


def test_hf_sources() -> None:
    assert parse_hf_source("hf:acme/m@v1").revision == "v1"
    assert parse_hf_source("hf:acme/m").revision == "main"
    for bad in ("acme/m", "hf:acme", "hf:acme/m@", "hf:acme/m@..", "hf:../x@main"):
        with pytest.raises(ValueError, match=r"hf:ORG/REPO|repository id|revision"):
            parse_hf_source(bad)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-9", ByteRange(0, 9)),
        ("bytes=90-", ByteRange(90, 99)),
        ("bytes=90-500", ByteRange(90, 99)),
        ("bytes=-10", ByteRange(90, 99)),
        ("bytes=-500", ByteRange(0, 99)),
        ("bytes=5-2", None),  # invalid: the whole file
        ("bytes=0-1,5-6", None),  # several ranges: the whole file
        ("items=0-1", None),
        ("bytes=-", None),
    ],
)
def test_ranges(header: str | None, expected: ByteRange | None) -> None:
    assert parse_range(header, 100) == expected


@pytest.mark.parametrize(
    ("header", "size"), [("bytes=100-", 100), ("bytes=-0", 100), ("bytes=-5", 0)]
)
def test_a_range_past_the_end_is_not_satisfiable(header: str, size: int) -> None:
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)

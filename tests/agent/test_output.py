"""An engine's output: the log file followed into the ring buffer."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from llmgw.agent import output
from llmgw.agent.compute import ComputeReport
from llmgw.agent.output import EngineOutput


def new_output(max_lines: int = 3) -> EngineOutput:
    return EngineOutput(name="shard t", max_lines=max_lines, report=ComputeReport("llamacpp"))


async def test_lines_are_kept_last_first_and_split(tmp_path: Path) -> None:
    """Complete lines go into the ring buffer; a line cut short waits for
    its end, or for close; ``\\r`` and bad UTF-8 are cleaned."""
    path = tmp_path / "engine.log"
    fd = output.create_log(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    out = new_output()
    out.follow(path)
    before = out.last_output_at
    await trio.sleep(0.01)
    try:
        os.write(fd, b"one\r\ntwo\nthr")
        out.read()
        assert list(out.lines) == ["one", "two"]
        assert out.last_output_at > before
        assert out.take_text() == "two"
        assert out.take_text() is None
        os.write(fd, b"ee\nfour \xff\nfive")
        out.read()
        assert out.last_lines(2) == ("three", "four \ufffd")
        assert list(out.lines) == ["two", "three", "four \ufffd"]  # max_lines 3
        assert out.last_lines(0) == ()
    finally:
        os.close(fd)
    out.close()
    assert out.last_lines(1) == ("five",)
    out.read()  # closed: nothing happens


async def test_a_long_line_is_cut(tmp_path: Path) -> None:
    """A run of MAX_LINE_BYTES without a newline becomes a line; the rest
    waits for its end (here: the close)."""
    path = tmp_path / "engine.log"
    await trio.Path(path).write_bytes(b"x" * (output.MAX_LINE_BYTES + 10))
    out = new_output()
    out.follow(path)
    out.read()
    assert [len(line) for line in out.lines] == [output.MAX_LINE_BYTES]
    out.close()
    assert [len(line) for line in out.lines] == [output.MAX_LINE_BYTES, 10]


async def test_following_an_adopted_log(tmp_path: Path) -> None:
    """An adopted engine's log: its head feeds the compute report, its tail
    the ring buffer, from a line start; no progress text is pending."""
    path = tmp_path / "engine.log"
    head = b"load_tensors: offloaded 0/33 layers to GPU\n"
    filler = b"y" * 100 + b"\n"
    body = head + filler * (output.ADOPT_TAIL_BYTES // len(filler) + 5) + b"last words\n"
    await trio.Path(path).write_bytes(body)
    out = new_output(max_lines=10_000)
    out.follow_existing(path, read_head=True)
    assert out.report.text.startswith("CPU")
    assert out.lines[-1] == "last words"
    assert all(line in ("y" * 100, "last words") for line in out.lines)
    assert out.take_text() is None
    out.close()


async def test_a_missing_adopted_log_is_no_error(tmp_path: Path) -> None:
    """No file: nothing read, nothing raised."""
    out = new_output()
    out.follow_existing(tmp_path / "absent.log", read_head=True)
    out.read()
    assert list(out.lines) == []

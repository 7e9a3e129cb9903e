"""``llmgw.errors.describe``: an exception's text for a log line, never empty."""

from __future__ import annotations

import pytest
import trio

from llmgw import errors


class _Silent(Exception):
    pass


class _Documented(Exception):
    """The engine hung up
    before its answer ended."""


def test_an_exception_with_text_is_its_text() -> None:
    assert errors.describe(errors.NotFound("no model 'x'")) == "no model 'x'"


def test_an_exception_without_text_reads_as_its_class_and_what_it_means() -> None:
    assert errors.describe(trio.TooSlowError()) == (
        "TooSlowError (raised by fail_after and fail_at if the timeout expires)"
    )
    assert errors.describe(_Documented()) == (
        "_Documented (the engine hung up before its answer ended)"
    )
    assert errors.describe(_Silent()) == "_Silent (no details given)"
    assert errors.describe(TimeoutError()) == "TimeoutError (timeout expired)"


def test_an_exception_without_text_raised_from_another_reads_as_its_cause() -> None:
    def fail() -> None:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as exc:
            raise _Silent from exc

    with pytest.raises(_Silent) as raised:
        fail()
    assert errors.describe(raised.value) == "_Silent: [Errno 111] Connection refused"

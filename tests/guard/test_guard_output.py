"""The output rules over whole answers and streams (the sliding window)."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.guard import Guards, Redactor, Verdict, guard_chat_doc
from llmgw.guard.output import (
    _CONTINUABLE,
    _CONTINUABLE_NAMES,
    FLAG_SCAN_BYTES,
    HOLD_BYTES,
    OutputGuard,
    _word_release,
)
from llmgw.settings import settings_from_doc


def _guard(guard: dict[str, Any]) -> Any:
    built = Guards().for_request(settings_from_doc({"guard": guard}).guard, "k", ("", "", ""))
    assert built is not None
    return built


def _run(output: OutputGuard, pieces: list[str]) -> tuple[str, bool]:
    sent, stopped = [], False
    for piece in pieces:
        text, stopped = output.feed(0, piece)
        sent.append(text)
        if stopped:
            break
    if not stopped:
        text, stopped = output.close(0)
        sent.append(text)
    return "".join(sent), stopped


def test_a_secret_split_over_pieces_is_caught_and_nothing_of_it_sent() -> None:
    guard = _guard({})
    verdict = Verdict()
    output = OutputGuard(guard.output, verdict, Redactor(), restore=False)
    sent, stopped = _run(output, ["here: AKIAIOSF", "ODNN7EX", "AMPLE and more"])
    assert stopped
    assert sent == "here: "
    assert verdict.rules == ["secret:aws_access_key"]
    assert verdict.stopped


def test_text_is_held_back_only_as_long_as_the_window() -> None:
    guard = _guard({})
    output = OutputGuard(guard.output, Verdict(), Redactor(), restore=False)
    first, _ = output.feed(0, "x" * (HOLD_BYTES + 10))
    assert first == "x" * 10
    rest, stopped = output.close(0)
    assert rest == "x" * HOLD_BYTES
    assert not stopped


def test_flag_only_rules_hold_nothing_back_and_still_record_split_values() -> None:
    guard = _guard({"default": ["observe"]})
    verdict = Verdict()
    output = OutputGuard(guard.output, verdict, Redactor(), restore=False)
    assert output.feed(0, "mail jane@exa") == ("mail jane@exa", False)
    assert output.feed(0, "mple.com now") == ("mple.com now", False)
    # Scanned in batches: a short answer's text at its end.
    assert verdict.rules == []
    assert output.close(0) == ("", False)
    assert verdict.rules == ["pii:email"]
    assert verdict.action == "flag"


def test_flag_only_rules_scan_a_long_stream_in_batches_and_catch_values_split_between_them() -> (
    None
):
    guard = _guard({"default": ["observe"]})
    verdict = Verdict()
    output = OutputGuard(guard.output, verdict, Redactor(), restore=False)
    filler = "word " * (FLAG_SCAN_BYTES // 5)
    first = filler + "mail jane.doe@exa"
    assert output.feed(0, first) == (first, False)  # a whole batch: scanned
    assert verdict.rules == []  # no whole address in it
    assert output.feed(0, "mple.com ok") == ("mple.com ok", False)  # queued
    assert verdict.rules == []
    assert output.close(0) == ("", False)  # the rest, with the tail before it
    assert verdict.rules == ["pii:email"]


def test_restore_puts_back_split_placeholders_before_the_output_rules() -> None:
    guard = _guard(
        {
            "default": ["p"],
            "policies": {
                "p": {
                    "input": {"pii": {"email": "redact"}, "restore": True},
                    "output": {"deny": ["jane@example\\.com"]},
                }
            },
        }
    )
    assert not guard.cacheable
    redactor, verdict = Redactor(), Verdict()
    doc = {"messages": [{"role": "user", "content": "a bob@b.io c jane@example.com"}]}
    guard_chat_doc(doc, guard.input, verdict, redactor)
    output = OutputGuard(guard.output, verdict, redactor, restore=True)
    assert _run(output, ["to [EM", "AIL_1", "] ok"]) == ("to bob@b.io ok", False)
    output = OutputGuard(guard.output, verdict, redactor, restore=True)
    assert _run(output, ["to [EMAIL_2] ok"]) == ("to ", True)
    assert "deny:p:0" in verdict.rules


def test_a_whole_answer_is_cut_before_a_blocked_value() -> None:
    guard = _guard({})
    output = OutputGuard(guard.output, Verdict(), Redactor(), restore=False)
    assert output.whole("card 4111111111111111, key AKIAIOSFODNN7EXAMPLE") == (
        "card ************1111, key ",
        True,
    )


def test_only_the_unfinished_word_and_number_groups_are_held_back() -> None:
    guard = _guard({})
    output = OutputGuard(guard.output, Verdict(), Redactor(), restore=False)
    assert output.feed(0, "tok0 tok1 ") == ("tok0 tok1 ", False)
    assert output.feed(0, "card 4111 1111 ") == ("card ", False)
    assert output.feed(0, "1111 1111 thanks and AKIAIOSF") == (
        "**** **** **** 1111 thanks and ",
        False,
    )
    assert output.feed(0, "ODNN7EXAMPLE") == ("", True)


def test_with_deny_patterns_the_whole_window_is_held() -> None:
    guard = _guard({"policies": {"p": {"output": {"deny": ["project zeus"]}}}, "default": ["p"]})
    output = OutputGuard(guard.output, Verdict(), Redactor(), restore=False)
    assert output.feed(0, "about project ") == ("", False)
    assert output.feed(0, "zeus now") == ("about ", True)


def test_a_person_name_split_over_pieces_is_redacted_whole_and_placeholders_stable() -> None:
    guard = _guard(
        {
            "default": ["names"],
            "policies": {
                "names": {
                    "input": {"pii": {"person": "redact"}},
                    "output": {"pii": {"person": "redact"}},
                }
            },
        }
    )
    verdict, redactor = Verdict(), Redactor()
    doc = {"messages": [{"role": "user", "content": "Write to Maria Lopez about it"}]}
    guard_chat_doc(doc, guard.input, verdict, redactor)
    assert doc["messages"][0]["content"] == "Write to [PERSON_1] about it"
    output = OutputGuard(guard.output, verdict, redactor, restore=False)
    sent, stopped = _run(output, ["Dear Maria", " Lop", "ez, and Dr.", " Watson: hi"])
    assert not stopped
    assert sent == "Dear [PERSON_1], and [PERSON_2]: hi"
    assert verdict.events == {("input", "pii:person"): "redact", ("output", "pii:person"): "redact"}


def _word_release_by_words(held: bytes, continuable: re.Pattern[bytes]) -> int:
    """The word-by-word loop :func:`_word_release` replaced (one regex over
    the text reversed): the reference it must agree with."""
    floor = len(held) - HOLD_BYTES
    end = len(held)
    if end and held[-1] not in b" \t\r\n":
        end = max(held.rfind(c, 0, end) for c in (b" ", b"\n", b"\t", b"\r")) + 1
    while end > max(floor, 0):
        j = end
        while j > 0 and held[j - 1] in b" \t":
            j -= 1
        i = j
        while i > 0 and held[i - 1] not in b" \t\r\n":
            i -= 1
        tail = continuable.search(held, i, j) if i < j else None
        if tail is None:
            break
        start = tail.start()
        if start > i:
            if not held[start - 1 : start].isalnum():
                end = start
            break
        end = i
    return max(end, floor)


_PIECES = [b" ", b"\t", b"\n", b"\r", b"a", b"Z", b"4", b"-", b"+", b"(", b".", b"'", b'"', b"{"]
_PIECES += [b":", b"\xc3\xa9", b"x", b"_", b"/", b"1111 ", b"Maria", b" Lopez", b"tok7 "]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=60).map(b"".join))
def test_the_words_held_back_are_those_of_the_word_by_word_rule(held: bytes) -> None:
    for fast, slow in (
        (_CONTINUABLE, re.compile(rb"[A-Z0-9+().\-]+\Z")),
        (_CONTINUABLE_NAMES, re.compile(rb"[A-Z0-9+().\-][A-Za-z0-9+().'\-\x80-\xff]*\Z")),
    ):
        assert _word_release(held, fast) == _word_release_by_words(held, slow)


_BASELINE = _guard({})
_TEXT_PIECES = [" ", "\n", "tok7 ", " tok", "7", "card ", "4111", " 1111", "-1111", "AKIA"]
_TEXT_PIECES += ["IOSFODNN", "7EXAMPLE", "sk-", "proj-", "abcdefghij", "KLMNOPQRST", "é", "(", ")"]
_TEXT_PIECES += ["pg://u:", "p@h.io", '{"to":"', "555-", "0100", ".", "x" * 40]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_TEXT_PIECES), max_size=40))
def test_the_short_way_of_feed_plain_sends_and_records_what_the_general_one_does(
    pieces: list[str],
) -> None:
    """``feed_plain``'s inline case (words held back, text shorter than any
    match not scanned) against ``_act`` scanning every time: the same
    bytes released, the same stop, the same verdict."""
    guard = _BASELINE
    quick_verdict, slow_verdict = Verdict(), Verdict()
    quick = OutputGuard(guard.output, quick_verdict, Redactor(), restore=False)
    slow = OutputGuard(guard.output, slow_verdict, Redactor(), restore=False)
    assert quick._quick
    assert quick._min_bytes > 0
    slow._quick = False
    slow._min_bytes = 0
    for piece in pieces:
        data = piece.encode()
        assert quick.feed_plain(0, data) == slow.feed_plain(0, data)
    assert quick.close(0) == slow.close(0)
    assert quick_verdict.events == slow_verdict.events
    assert quick_verdict.stopped == slow_verdict.stopped


def test_a_text_shorter_than_any_match_is_not_scanned_and_one_as_long_is() -> None:
    from llmgw.guard.matcher import min_match_bytes
    from llmgw.guard.patterns import INJECTION, PII, SECRETS, Kind, person_kinds

    guard = _guard({})
    matcher = guard.output.matcher
    # baseline's output rules: cards and secrets; the shortest is a
    # connection string (``a://b:c@d``... one more name byte: 10).
    assert matcher.min_bytes == 10
    for kind in (*SECRETS, *PII.values(), *INJECTION, *person_kinds()):
        assert min_match_bytes(kind) > 0, kind.rule
    assert min_match_bytes(Kind("deny:p:0", "DENIED", rb"[[:alpha:]]")) == 0
    denying = _guard({"policies": {"p": {"output": {"deny": ["zeus"]}}}, "default": ["p"]})
    assert denying.output.matcher.min_bytes == 0
    scanned: list[bytes] = []
    real_scan = matcher.scan

    def counting(data: bytes) -> Any:
        scanned.append(data)
        return real_scan(data)

    output = OutputGuard(guard.output, Verdict(), Redactor(), restore=False)
    matcher.scan = counting
    try:
        assert output.feed_plain(0, b"tok7 ") == (b"tok7 ", False)
        assert output.feed_plain(0, b"a://b:c@d ") == (b"a://b:c@d ", False)
        assert output.feed_plain(0, b"pg://user:pw@host ") == (b"", True)
    finally:
        del matcher.scan
    # Not the first; the second and third (again by the general way, which
    # then stops the choice).
    assert scanned[0] == b"a://b:c@d "
    assert set(scanned[1:]) == {b"pg://user:pw@host "}

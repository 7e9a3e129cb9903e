"""``llmgw bench guard``: what the guard's matcher costs, in CPU time.

For the ``baseline`` and ``observe`` policies: one prompt scan per KiB of
plain prose and of number-heavy ordinary text (UUIDs, hashes, numbers that
fail Luhn, dates, log lines), a 64-token answer streamed through the output
rules, and the same kinds as a loop of Python ``re`` patterns for
comparison (``docs/guardrails.md``, The matcher).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from typing import Any, Final

import orjson

from llmgw.gateway.guarded import GuardedStream
from llmgw.gateway.sse import SseRelay
from llmgw.guard import Guards, Redactor, Verdict
from llmgw.guard.output import OutputGuard
from llmgw.guard.patterns import INJECTION, PII, SECRETS
from llmgw.settings import settings_from_doc

__all__ = ["run_bench_guard"]

_PROSE: Final = (
    "The committee met on Tuesday to review the quarterly plan. Most of the "
    "discussion was about hiring, the new office and how to keep the release "
    "on schedule without cutting the testing time. "
)
_NUMBERS: Final = (
    "user_id = '123e4567-e89b-12d3-a456-426614174000'\n"
    "commit 9fceb02d0ae598e95dc970b74767f19372d61af8 (HEAD -> main)\n"
    "order number 4111 1111 1111 1112 was shipped; invoice 1234567890123456\n"
    "2026-12-01T21:57:05.123Z INFO gateway request req_abc123 200 12.3ms\n"
    "The meeting moved from 2024-01-15 to 2024-02-01 at 10:30.\n"
    "Pi is 3.14159265358979323846, e is 2.71828182845904523536.\n"
)


def _stream_events(words: list[str]) -> list[bytes]:
    """A streamed chat answer as an engine sends it, one event per read:
    the role, one chunk per word, the finish, the usage, ``[DONE]``."""
    envelope = {
        "id": "chatcmpl-0123456789abcdef01234567",
        "object": "chat.completion.chunk",
        "created": 1764650000,
        "model": "bench-model",
    }
    chunks: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    chunks += [{"content": word} for word in words]
    docs = [
        {**envelope, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]}
        for d in chunks
    ]
    last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    docs.append({**envelope, "choices": [last]})
    usage = {"prompt_tokens": 10, "completion_tokens": len(words), "total_tokens": 10 + len(words)}
    docs.append({**envelope, "choices": [], "usage": usage})
    return [b"data: " + orjson.dumps(doc) + b"\n\n" for doc in docs] + [b"data: [DONE]\n\n"]


#: The relay's load: 64 words as the sim engine cuts them (``tok7 ``) and
#: as real tokenizers do (`` tok7``, so the last word is held back each time).
_EVENTS: Final = {
    "trailing spaces": _stream_events([f"tok{n} " for n in range(64)]),
    "leading spaces": _stream_events([f" tok{n}" for n in range(64)]),
}


def _per_call_s(fn: Callable[[], Any], *, seconds: float) -> float:
    fn()
    calls = 0
    started = time.process_time()
    while True:
        for _ in range(20):
            fn()
        calls += 20
        spent = time.process_time() - started
        if spent >= seconds:
            return spent / calls


def run_bench_guard(seconds: float = 0.5) -> list[dict[str, Any]]:
    """The figures, one dict per measurement: ``what``, ``policy``, ``us``
    (CPU µs per call) and ``us_per_kib`` where it applies."""
    rows: list[dict[str, Any]] = []
    texts = {
        "prose": (_PROSE * 8)[:1024].encode(),
        "numbers": (_NUMBERS * 8)[:1024].encode(),
    }
    words = [word + " " for word in (_PROSE * 2).split()][:64]
    for policy in ("baseline", "observe"):
        guard = Guards().for_request(
            settings_from_doc({"guard": {"default": [policy]}}).guard, "bench", ("", "", "")
        )
        assert guard is not None
        matcher = guard.input.matcher
        for name, data in texts.items():
            us = _per_call_s(functools.partial(matcher.scan, data), seconds=seconds) * 1e6
            rows.append(
                {"what": f"prompt scan, {name}", "policy": policy, "us": us, "us_per_kib": us}
            )

        def stream(rules: Any = guard.output) -> None:
            output = OutputGuard(rules, Verdict(), Redactor(), restore=False)
            for word in words:
                output.feed(0, word)
            output.close(0)

        us = _per_call_s(stream, seconds=seconds) * 1e6
        rows.append({"what": "64-token answer streamed", "policy": policy, "us": us})
        for name, events in _EVENTS.items():

            def relayed(rules: Any = guard.output, events: list[bytes] = events) -> None:
                output = OutputGuard(rules, Verdict(), Redactor(), restore=False)
                relay = GuardedStream(SseRelay(pass_usage=False), output)
                for event in events:
                    relay.feed(event)
                relay.finish()

            us = _per_call_s(relayed, seconds=seconds) * 1e6
            rows.append({"what": f"64-event stream relayed, {name}", "policy": policy, "us": us})
    for name, events in _EVENTS.items():

        def plain(events: list[bytes] = events) -> None:
            relay = SseRelay(pass_usage=False)
            for event in events:
                relay.feed(event)
            relay.finish()

        us = _per_call_s(plain, seconds=seconds) * 1e6
        rows.append({"what": f"64-event stream relayed, {name}", "policy": "off", "us": us})
    patterns = [
        re.compile(kind.pattern, re.IGNORECASE if kind.caseless else 0)
        for kind in (*SECRETS, *PII.values(), *INJECTION)
    ]
    data = texts["numbers"]

    def loop() -> None:
        for pattern in patterns:
            for _ in pattern.finditer(data):
                pass

    us = _per_call_s(loop, seconds=seconds) * 1e6
    rows.append(
        {
            "what": f"loop of {len(patterns)} re patterns, numbers",
            "policy": "-",
            "us": us,
            "us_per_kib": us,
        }
    )
    return rows

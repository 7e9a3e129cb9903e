"""How a sim engine behaves: :class:`SimConfig`, and the command line that
fills it (:func:`parse_args`)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

__all__ = ["FAIL_STATUSES", "KEY_ENV", "SimConfig", "parse_args"]

#: The environment variable holding the engine key (as for llama.cpp).
KEY_ENV = "LLAMA_API_KEY"

#: The statuses ``--fail-status`` may give.
FAIL_STATUSES = frozenset({429, 500, 502, 503})

_counts = attrs.validators.ge(0)
_amounts = attrs.validators.ge(0.0)
_fraction = [attrs.validators.ge(0.0), attrs.validators.le(1.0)]


def _pairs(value: Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple(value)


def _pairs_of_text(value: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple(value)


def _refusals(_: Any, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    for pair in value:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ValueError(f"'{attribute.name}' holds (key, status) pairs, not {pair!r}")
        key, status = pair
        if not key:
            raise ValueError(f"'{attribute.name}': a key must not be empty")
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"'{attribute.name}': the status for a key must be 400 to 599")


@attrs.frozen(kw_only=True)
class SimConfig:
    """How a sim engine behaves.

    Attributes:
        model: the model name it answers with and lists.
        host: the address to bind.
        port: the TCP port; 0 lets the kernel choose (printed at start).
        tokens_per_second: per-stream decode rate; 0 answers at once.
        tokens: answer length in tokens when a request gives no
            ``max_tokens``; a request's ``max_tokens`` caps it.
        ttft_ms: time to the first token, in milliseconds.
        fail_rate: fraction (0..1) of generation requests answered with
            ``fail_status`` in OpenAI's error shape.
        fail_status: the status of those failures (429, 500, 502 or 503).
        hang_rate: fraction (0..1) of generation requests that never answer
            (until the client goes away).
        slots: requests generating at once; more wait. 0 means unlimited.
        loading_seconds: how long after start ``/health`` says ``loading``
            (503) and the other routes answer 503.
        max_model_len: the context length reported by ``/tokenize`` and
            ``/v1/models``, in tokens.
        embedding_dim: length of embedding vectors unless a request asks
            for ``dimensions``.
        tick_ms: the least time between two writes to one stream, in ms.
        seed: seeds the choice of failing and hanging requests.
        reasoning: chat answers start with reasoning text
            (``reasoning_content``).
        reasoning_tokens: words of reasoning when ``reasoning`` is on.
        refuse_keys: ``(key, status)`` pairs: a request bearing ``Bearer
            key`` is answered ``status`` (400 to 599) and nothing else.

    Raises:
        ValueError: a value is out of range.
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    tokens_per_second: float = attrs.field(default=500.0, validator=_amounts)
    tokens: int = attrs.field(default=64, validator=_counts)
    ttft_ms: float = attrs.field(default=0.0, validator=_amounts)
    fail_rate: float = attrs.field(default=0.0, validator=_fraction)
    fail_status: int = attrs.field(default=500, validator=attrs.validators.in_(FAIL_STATUSES))
    hang_rate: float = attrs.field(default=0.0, validator=_fraction)
    slots: int = attrs.field(default=0, validator=_counts)
    loading_seconds: float = attrs.field(default=0.0, validator=_amounts)
    max_model_len: int = attrs.field(default=32768, validator=_counts)
    embedding_dim: int = attrs.field(default=384, validator=_counts)
    tick_ms: float = attrs.field(default=50.0, validator=_amounts)
    seed: int = 0
    reasoning: bool = False
    reasoning_tokens: int = attrs.field(default=8, validator=_counts)
    refuse_keys: tuple[tuple[str, int], ...] = attrs.field(
        default=(), converter=_pairs, validator=_refusals
    )
    #: Scripted chat answers: ``(when, answer)`` pairs; a chat prompt
    #: holding ``when`` (the first pair that matches; "" matches any) is
    #: answered ``answer`` as its whole content (a judge's verdict in tests).
    replies: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_pairs_of_text)


def parse_args(argv: Sequence[str] | None = None) -> SimConfig:
    """Parse the sim engine's command line into a :class:`SimConfig`.

    ``argv`` defaults to ``sys.argv[1:]``. Exits with code 2 and a message on
    a bad or unknown flag (argparse), or on a value :class:`SimConfig` refuses.
    """
    parser = argparse.ArgumentParser(
        prog="python -m llmgw.engines.sim",
        description="A fake OpenAI-compatible engine for tests and benchmarks. "
        f"The key comes from {KEY_ENV}.",
        allow_abbrev=False,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0 lets the kernel choose")
    parser.add_argument("--model", required=True, help="the model name it answers to")
    parser.add_argument(
        "--tokens-per-second", type=float, default=500.0, help="per stream; 0 = instant"
    )
    parser.add_argument(
        "--tokens", type=int, default=64, help="answer length unless max_tokens is lower"
    )
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token (ms)")
    parser.add_argument(
        "--fail-rate", type=float, default=0.0, help="fraction answered with an error"
    )
    parser.add_argument("--fail-status", type=int, default=500, help="429, 500, 502 or 503")
    parser.add_argument("--hang-rate", type=float, default=0.0, help="fraction never answered")
    parser.add_argument(
        "--slots", type=int, default=0, help="requests generating at once; 0 = no limit"
    )
    parser.add_argument(
        "--loading-seconds", type=float, default=0.0, help="health says loading this long"
    )
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--embedding-dim", type=int, default=384)
    parser.add_argument(
        "--tick-ms", type=float, default=50.0, help="least time between writes to a stream"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reasoning", action="store_true", help="chat answers start with reasoning_content"
    )
    parser.add_argument(
        "--reasoning-tokens", type=int, default=8, help="reasoning words with --reasoning"
    )
    parser.add_argument(
        "--refuse-key",
        action="append",
        default=[],
        metavar="KEY=STATUS",
        help="answer STATUS (400-599) to requests bearing this key (repeatable)",
    )
    parser.add_argument(
        "--reply",
        action="append",
        default=[],
        metavar="WHEN=ANSWER",
        help="answer a chat prompt holding WHEN with ANSWER as its whole content, after "
        "--ttft-ms (repeatable; the first that matches wins; an empty WHEN matches any)",
    )
    ns = parser.parse_args(argv)
    refusals = []
    for given in ns.refuse_key:
        key, _, status = given.rpartition("=")
        if not key or not status.isdigit():
            parser.error(f"--refuse-key {given!r}: give KEY=STATUS, e.g. BAD=429")
        refusals.append((key, int(status)))
    replies = []
    for given in ns.reply:
        when, sep, reply = given.partition("=")
        if not sep or not reply:
            parser.error(f"--reply {given!r}: give WHEN=ANSWER, e.g. 'bomb=Safety: Unsafe'")
        replies.append((when, reply))
    try:
        return SimConfig(
            model=ns.model,
            host=ns.host,
            port=ns.port,
            tokens_per_second=ns.tokens_per_second,
            tokens=ns.tokens,
            ttft_ms=ns.ttft_ms,
            fail_rate=ns.fail_rate,
            fail_status=ns.fail_status,
            hang_rate=ns.hang_rate,
            slots=ns.slots,
            loading_seconds=ns.loading_seconds,
            max_model_len=ns.max_model_len,
            embedding_dim=ns.embedding_dim,
            tick_ms=ns.tick_ms,
            seed=ns.seed,
            reasoning=ns.reasoning,
            reasoning_tokens=ns.reasoning_tokens,
            refuse_keys=tuple(refusals),
            replies=tuple(replies),
        )
    except ValueError as error:
        parser.error(str(error))

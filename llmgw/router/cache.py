"""The exact answer cache (``docs/api.md``, The exact answer cache).

:func:`cache_key` hashes what makes two requests the same question;
:class:`AnswerCache` keeps answers exactly as the client received them, in
this process's memory only (nothing reaches the store or disk; a restart
empties it), bounded by bytes with LRU eviction, each entry for its
project's TTL.

The gateway decides when the cache applies (a project setting; bypassed for
stored conversations, ``no_store`` and ``restore`` policies), stores only
200 answers, and counts each lookup in :data:`CACHE_REQUESTS` with a result
of :data:`RESULTS`. Synchronous and O(1) per operation; runs on the trio
thread.
"""

from __future__ import annotations

import builtins
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

import attrs
import orjson
from prometheus_client import Counter, Gauge

from llmgw.metrics import REGISTRY

__all__ = [
    "ANSWER_FIELDS",
    "CACHE_BYTES",
    "CACHE_ENTRIES",
    "CACHE_REQUESTS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_ENTRY_BYTES",
    "ENTRY_OVERHEAD_BYTES",
    "RESULTS",
    "AnswerCache",
    "CachedAnswer",
    "cache_key",
]

#: ``router.cache.max_bytes`` default (our choice): 256 MiB.
DEFAULT_MAX_BYTES: Final = 256 * 1024 * 1024
#: ``router.cache.max_entry_bytes`` default (the spec's 1 MB, as 1 MiB).
DEFAULT_MAX_ENTRY_BYTES: Final = 1024 * 1024
#: Memory an entry costs beyond its bytes (the key, the objects and the
#: LRU links), an estimate counted toward ``max_bytes``.
ENTRY_OVERHEAD_BYTES: Final = 400

#: The request body fields that change the answer (our enumeration of the
#: spec's "messages, tools, response_format, sampling settings"). The model,
#: project and endpoint kind are hashed beside them; everything else
#: (``user``, ``metadata``, ``store``, …) is left out. ``stream`` and
#: ``stream_options`` are in: a streamed answer is kept as its event
#: sequence, and ``include_usage`` adds an event.
ANSWER_FIELDS: Final = (
    # the question
    "messages",
    "prompt",
    "input",
    "system",
    "suffix",
    "echo",
    # tools and output shape
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "reasoning_effort",
    # sampling
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    # delivery
    "stream",
    "stream_options",
)

#: The ``result`` label values of :data:`CACHE_REQUESTS`.
RESULTS: Final = frozenset({"hit", "similar_hit", "miss", "bypass"})

CACHE_REQUESTS: Final = Counter(
    "llmgw_cache_requests",
    "Answer cache lookups, by model and result (hit, similar_hit, miss, bypass).",
    ["model", "result"],
    registry=REGISTRY,
)
CACHE_BYTES: Final = Gauge(
    "llmgw_cache_bytes",
    "Bytes held by the answer cache, with a per-entry overhead estimate.",
    registry=REGISTRY,
)
CACHE_ENTRIES: Final = Gauge(
    "llmgw_cache_entries", "Answers held by the answer cache.", registry=REGISTRY
)


def cache_key(project_id: str, model: str, endpoint: str, doc: dict[str, Any]) -> bytes:
    """The cache key of a request: a 32-byte blake2b hash of the project, the
    model, the endpoint kind (``chat``, ``completions``, …) and the body's
    :data:`ANSWER_FIELDS` present, serialized by orjson with sorted keys.

    A field given as ``null`` differs from one left out, and ``1`` from
    ``1.0``: such requests merely miss each other.

    Raises:
        TypeError: ``doc`` holds something JSON cannot encode (not possible
            for a parsed request body).
    """
    fields = {name: doc[name] for name in ANSWER_FIELDS if name in doc}
    data = orjson.dumps(
        [1, project_id, model, endpoint, fields],
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.blake2b(data, digest_size=32).digest()


@attrs.frozen(kw_only=True)
class CachedAnswer:
    """An answer as the client received it.

    Attributes:
        status: its HTTP status (200).
        content_type: its ``content-type`` header value.
        body: the body; for a streamed answer the whole SSE byte sequence,
            replayed as a stream.
        stream: whether it was streamed.
        stored_at: when it was stored (UTC epoch seconds), for ``Age``.
    """

    status: int
    content_type: bytes
    body: bytes
    stream: bool
    stored_at: float

    @property
    def size(self) -> int:
        """Its bytes: the body and the content type."""
        return len(self.body) + len(self.content_type)

    def age_s(self, now_wall: float) -> int:
        """Whole seconds since it was stored (the ``Age`` header), never negative."""
        return max(0, int(now_wall - self.stored_at))


class _Entry:
    __slots__ = ("answer", "cost", "expires_at")

    def __init__(self, answer: CachedAnswer, expires_at: float, cost: int) -> None:
        self.answer = answer
        self.expires_at = expires_at
        self.cost = cost


class AnswerCache:
    """Answers by :func:`cache_key`, LRU within ``max_bytes``.

    Args:
        max_bytes: ``router.cache.max_bytes``: the total kept, counting
            :data:`ENTRY_OVERHEAD_BYTES` and the key per entry.
        max_entry_bytes: ``router.cache.max_entry_bytes``: answers whose
            :attr:`CachedAnswer.size` is larger are not kept.
        clock: monotonic seconds, for TTLs.

    Raises:
        ValueError: a negative size.

    Updates :data:`CACHE_BYTES` and :data:`CACHE_ENTRIES` by what it adds and
    drops, so several caches in one process add up.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or max_entry_bytes < 0:
            raise ValueError("cache sizes must not be negative")
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        """The bytes held, overheads included."""
        return self._bytes

    @property
    def entries(self) -> int:
        return len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: builtins.bytes) -> CachedAnswer | None:
        """The answer stored under ``key`` and not expired (which becomes the
        most recently used), or ``None``. An expired one is dropped."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= self._clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.answer

    def put(self, key: builtins.bytes, answer: CachedAnswer, ttl_s: float) -> bool:
        """Keep ``answer`` under ``key`` for ``ttl_s`` seconds, replacing what
        was there, then drop the least recently used until the total is
        within ``max_bytes``.

        Returns ``False`` (and keeps nothing) when the answer is larger than
        ``max_entry_bytes``, its entry alone exceeds ``max_bytes``, or
        ``ttl_s`` is not positive.
        """
        cost = answer.size + len(key) + ENTRY_OVERHEAD_BYTES
        if answer.size > self.max_entry_bytes or cost > self.max_bytes or not ttl_s > 0:
            return False
        if key in self._entries:
            self._drop(key)
        self._entries[key] = _Entry(answer, self._clock() + ttl_s, cost)
        self._bytes += cost
        CACHE_BYTES.inc(cost)
        CACHE_ENTRIES.inc()
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def discard(self, key: builtins.bytes) -> None:
        """Forget ``key``'s answer, if any."""
        if key in self._entries:
            self._drop(key)

    def prune(self) -> int:
        """Drop every expired entry (O(entries): for an occasional sweep, not
        the request path); how many were dropped."""
        now = self._clock()
        expired = [key for key, entry in self._entries.items() if entry.expires_at <= now]
        for key in expired:
            self._drop(key)
        return len(expired)

    def clear(self) -> None:
        """Forget everything."""
        CACHE_BYTES.dec(self._bytes)
        CACHE_ENTRIES.dec(len(self._entries))
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: builtins.bytes) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.cost
        CACHE_BYTES.dec(entry.cost)
        CACHE_ENTRIES.dec()

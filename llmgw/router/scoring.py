"""Choosing an endpoint for a request: the routing profiles
(``docs/api.md``, Which replica answers; Outside providers).

:func:`choose` picks one of a model's endpoints for a profile:

``chat``
    **Session affinity**, then the endpoint **expected to answer soonest**.
    With a session id, a consistent-hash ring over the endpoint set passed
    in (:data:`VNODES_PER_WEIGHT` * weight points per endpoint, blake2b)
    names the endpoint; every router holding the same set names the same
    one. Walking the ring clockwise skips endpoints that are excluded or
    whose breaker is open, so a session moves to the same neighbour on
    every router. The ring's choice is taken when it is not saturated
    (``in_flight < slots``, or ``slots`` unknown); otherwise, and without a
    session, the soonest: least expected wait ::

        wait_s = ttft_s * (1 + in_flight / max(slots, 1))

    ``ttft_s`` is the endpoint's smoothed TTFT; one not measured yet is
    taken as the fastest measured candidate (or :data:`DEFAULT_TTFT_S`), so
    a new replica gets traffic and is measured. The fast replica takes
    every request until its queue makes it as slow as the idle slow one,
    then the two share: most traffic goes to the fast, some to the slow as
    the fast fills up (the spec's goal for ``latency``).

``batch``
    **Shortest queue**: least ``in_flight``.

``long-context``
    **Most free KV cache** (``kv_free_ratio``, unknown taken as
    :data:`UNKNOWN_KV_FREE`), then least ``in_flight``.

Ties are broken at random, weighted by ``weight``. When every candidate is
an outside-provider key, the profiles do not apply (the provider's queue
and cache are out of sight): the key is drawn at random in proportion to
its weight — "traffic is split by weight" — except that a ``chat`` session
still sticks to its key on the ring (where each key holds points in
proportion to its weight, so sessions split by weight too).

Endpoints that are excluded (already tried for this request) or whose
breaker does not allow a request are skipped. The breaker is asked without
taking its half-open probe (:meth:`Breaker.available`); only the endpoint
returned has its probe taken (:meth:`Breaker.allow`).
"""

from __future__ import annotations

import functools
import hashlib
import random
import time
from bisect import bisect_right
from collections.abc import Container, Iterable, Sequence
from typing import Any, Final

import orjson

from llmgw.router.endpoint import Endpoint
from llmgw.settings import ROUTING_PROFILES

__all__ = [
    "DEFAULT_TTFT_S",
    "PROFILES",
    "UNKNOWN_KV_FREE",
    "VNODES_PER_WEIGHT",
    "choose",
    "session_key",
]

#: The routing profiles (``x-llmgw-profile`` and the model setting).
PROFILES: Final = frozenset(ROUTING_PROFILES)
#: Points on the hash ring per unit of an endpoint's weight.
VNODES_PER_WEIGHT: Final = 64
#: Time to first token assumed when no candidate has been measured, in seconds.
DEFAULT_TTFT_S: Final = 0.5
#: Free KV-cache share assumed for an endpoint without metrics.
UNKNOWN_KV_FREE: Final = 0.5
#: Request headers that name a session, looked up in this order.
SESSION_HEADERS: Final = (b"x-llmgw-session", b"x-session-id")
#: Longest session id taken from a header or a body field, in characters;
#: longer ones are hashed.
MAX_SESSION_CHARS: Final = 256

_RING_CACHE_SIZE: Final = 256


def choose(
    endpoints: Sequence[Endpoint],
    profile: str,
    *,
    session: str | None = None,
    exclude: Container[str] = (),
    now: float | None = None,
    rng: random.Random | None = None,
) -> Endpoint | None:
    """The endpoint to send a request to, or ``None`` when every one is
    excluded or cooling down (see :func:`~llmgw.router.breaker.earliest_recovery`).

    Args:
        endpoints: the model's Ready endpoints (replicas or outside keys).
        profile: one of :data:`PROFILES`.
        session: the session id (:func:`session_key`), for ``chat``.
        exclude: replica ids not to choose (tried already for this request).
        now: monotonic seconds for the breakers; :func:`time.monotonic` if
            not given.
        rng: the source of tie-breaking and weighted draws (tests seed one).

    Raises:
        ValueError: ``profile`` is not one of :data:`PROFILES`.

    The chosen endpoint's breaker has been asked :meth:`~Breaker.allow`: if
    it was half-open, this request is its probe. ``in_flight`` is the
    caller's to count.
    """
    if profile not in PROFILES:
        raise ValueError(
            f"unknown routing profile {profile!r}; one of {', '.join(sorted(PROFILES))}"
        )
    if now is None:
        now = time.monotonic()
    candidates = [e for e in endpoints if e.replica_id not in exclude and e.breaker.available(now)]
    if not candidates:
        return None
    draw = rng or _RNG
    chosen: Endpoint | None = None
    if profile == "chat" and session is not None:
        chosen = _on_ring(endpoints, candidates, session)
        if chosen is not None and 0 < chosen.slots <= chosen.in_flight:
            chosen = None  # saturated: take the soonest instead
    if chosen is None:
        if len(candidates) == 1:
            chosen = candidates[0]
        elif all(e.external for e in candidates):
            chosen = _weighted(candidates, draw)
        elif profile == "chat":
            chosen = _soonest(candidates, draw)
        elif profile == "batch":
            chosen = _lowest(candidates, [float(e.in_flight) for e in candidates], draw)
        else:
            chosen = _most_kv_free(candidates, draw)
    chosen.breaker.allow(now)
    return chosen


def session_key(doc: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The session id a request belongs to, for ``chat`` affinity.

    Our reading of the spec's "a session id or the conversation's prefix",
    first found wins:

    1. an ``x-llmgw-session`` or ``x-session-id`` request header (``headers``
       as ASGI gives them: lower-case names, bytes);
    2. the body's ``user`` field (OpenAI's end-user id);
    3. the body's ``metadata.user_id`` (Anthropic's);
    4. for a chat request continuing a conversation (it holds an assistant
       or tool message already): a hash of the conversation's prefix — the
       model, the system/developer messages before the first user message,
       and that first user message — which every later turn repeats, so
       all its turns land on the replica already holding its KV cache. A
       conversation's first request has no cache anywhere: it has no
       session, and goes to the replica expected to answer soonest.

    The source is part of the key (``h:``, ``u:``, ``m:``, ``p:``), so a user
    id cannot collide with a header value. Ids longer than
    :data:`MAX_SESSION_CHARS` are hashed. ``None``: no session (a
    conversation's first turn, or a completions request, without any of 1
    to 3).
    """
    for name, value in headers:
        if name in SESSION_HEADERS:
            text = value.decode("latin-1").strip()
            if text:
                return "h:" + _bounded(text)
    user = doc.get("user")
    if isinstance(user, str) and user:
        return "u:" + _bounded(user)
    metadata = doc.get("metadata")
    if isinstance(metadata, dict):
        user_id = metadata.get("user_id")
        if isinstance(user_id, str) and user_id:
            return "m:" + _bounded(user_id)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not any(
        isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in messages
    ):
        return None
    prefix: list[Any] = [doc.get("model")]
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in ("system", "developer"):
            prefix.append([role, message.get("content")])
        elif role == "user":
            prefix.append(["user", message.get("content")])
            break
    try:
        data = orjson.dumps(prefix, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    return "p:" + hashlib.blake2b(data, digest_size=16).hexdigest()


# --- internals ---------------------------------------------------------------------

_RNG: Final = random.Random()


def _bounded(text: str) -> str:
    if len(text) <= MAX_SESSION_CHARS:
        return text
    return "#" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=_RING_CACHE_SIZE)
def _ring(members: tuple[tuple[str, int], ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ring of a set of ``(replica_id, weight)`` (sorted): its points in
    order and the replica owning each. Cached: a model's set changes
    rarely, and building costs 64 hashes per endpoint."""
    points: list[tuple[int, str]] = []
    for replica_id, weight in members:
        for i in range(VNODES_PER_WEIGHT * weight):
            points.append((_point(f"{replica_id}#{i}".encode()), replica_id))
    points.sort()
    return tuple(p for p, _ in points), tuple(r for _, r in points)


def _on_ring(
    endpoints: Sequence[Endpoint], candidates: list[Endpoint], session: str
) -> Endpoint | None:
    members = tuple(sorted({(e.replica_id, max(e.weight, 1)) for e in endpoints}))
    points, owners = _ring(members)
    usable = {e.replica_id: e for e in candidates}
    start = bisect_right(points, _point(session.encode()))
    size = len(points)
    seen: set[str] = set()
    for i in range(size):
        owner = owners[(start + i) % size]
        found = usable.get(owner)
        if found is not None:
            return found
        seen.add(owner)
        if len(seen) == len(members):
            break
    return None


def _weighted(candidates: list[Endpoint], draw: random.Random) -> Endpoint:
    return draw.choices(candidates, weights=[max(e.weight, 1) for e in candidates])[0]


def _lowest(candidates: list[Endpoint], costs: list[float], draw: random.Random) -> Endpoint:
    """The candidate of least cost; ties drawn by weight."""
    best = min(costs)
    tied = [e for e, c in zip(candidates, costs, strict=True) if c <= best * (1 + 1e-9)]
    return tied[0] if len(tied) == 1 else _weighted(tied, draw)


def _soonest(candidates: list[Endpoint], draw: random.Random) -> Endpoint:
    measured = [e.ttft_ewma_s for e in candidates if e.ttft_ewma_s is not None]
    unknown_s = min(measured) if measured else DEFAULT_TTFT_S
    costs = [
        (unknown_s if e.ttft_ewma_s is None else e.ttft_ewma_s)
        * (1.0 + e.in_flight / max(e.slots, 1))
        for e in candidates
    ]
    return _lowest(candidates, costs, draw)


def _most_kv_free(candidates: list[Endpoint], draw: random.Random) -> Endpoint:
    free = [UNKNOWN_KV_FREE if e.kv_free_ratio is None else e.kv_free_ratio for e in candidates]
    most = max(free)
    tied = [e for e, f in zip(candidates, free, strict=True) if f >= most - 1e-9]
    if len(tied) == 1:
        return tied[0]
    return _lowest(tied, [float(e.in_flight) for e in tied], draw)

"""One client request on a ``/v1`` POST route: what the gateway understood
of it (:class:`Request`, frozen once checked) and how it ended
(:class:`Outcome`, filled in while it is answered)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, Final

import attrs

from llmgw.accounting.accountant import Reservation
from llmgw.guard import Guard, Redactor, Verdict
from llmgw.store import KeyRecord

from .sse import Usage

__all__ = ["NO_SCOPE", "Outcome", "Request", "new_request_id"]

#: The ``(project, team, org)`` ids of a request whose key's place in the
#: tree is not known (yet).
NO_SCOPE: Final = ("", "", "")


@attrs.frozen(kw_only=True)
class Request:
    """A request as the gateway understood it.

    Built whole once the request passed its checks and its limits; a
    request refused before that is recorded with what was known then (the
    later fields at their defaults).

    Attributes:
        kind: the route's kind: ``chat``, ``completions``, ``embeddings``,
            ``messages`` (Anthropic) or ``responses`` (OpenAI Responses).
        request_id: ``req_…``, sent back as ``x-request-id`` and to engines.
        started: when it arrived, :func:`time.perf_counter` seconds.
        key: the client's key, once checked.
        model: the catalog model asked for (an alias resolved), "" before.
        stream: the answer is streamed.
        scope_ids: ``(project, team, org)`` ids of the key's place in the tree.
        reservation: what the accountant holds for it, settled at the end.
        rate_headers: the ``x-ratelimit-*`` headers every answer carries.
        doc: the body as the engines get it (chat for translated kinds);
            the relay sets its ``model`` and ``stream_options``.
        body: the client's own bytes while they can be sent on as they came.
        client_doc: the Anthropic or Responses body as the client sent it.
        pass_usage: the client asked for a stream's usage chunk.
        prompt_estimate: its prompt's tokens estimated from its size (4
            bytes a token), charged when an engine's count never comes.
        guard: its policies combined (``docs/guardrails.md``), None when
            none checks anything.
        redactor: the request's placeholders (only in its memory).
    """

    kind: str
    request_id: str
    started: float
    key: KeyRecord | None = None
    model: str = ""
    stream: bool = False
    scope_ids: tuple[str, str, str] = NO_SCOPE
    reservation: Reservation | None = None
    rate_headers: tuple[tuple[bytes, bytes], ...] = ()
    doc: dict[str, Any] = attrs.field(factory=dict)
    body: bytes | None = None
    client_doc: dict[str, Any] | None = None
    pass_usage: bool = False
    prompt_estimate: int = 0
    guard: Guard | None = None
    redactor: Redactor | None = None

    @property
    def client_model(self) -> str:
        """The model name translated answers report: as the client asked."""
        client_doc = self.client_doc
        if client_doc is not None and isinstance(client_doc.get("model"), str):
            return str(client_doc["model"])
        return self.model


class Outcome:
    """How a request ended, as it becomes known.

    Attributes:
        status: the status recorded; stands once :attr:`finished`.
        finished: the answer's status is settled (the whole answer is in
            hand and on its way, or an error was answered): a client leaving
            now no longer changes it.
        usage: the tokens to charge, ``None`` when nothing is charged.
        ttft_s: seconds from arrival to the first content sent, for streams.
        served: the model that answered (a fallback's name when one did).
        replica: the endpoint that answered (``cache`` for a cached answer).
        cache_hit: answered from the answer cache.
        progress: a stream under way: the tokens seen so far (set by the relay).
        verdict: what the guard found, both directions (None: not guarded).
    """

    __slots__ = (
        "cache_hit",
        "finished",
        "progress",
        "replica",
        "served",
        "status",
        "ttft_s",
        "usage",
        "verdict",
    )

    def __init__(self) -> None:
        self.status = 0
        self.finished = False
        self.usage: Usage | None = None
        self.ttft_s: float | None = None
        self.served = ""
        self.replica = ""
        self.cache_hit = False
        self.progress: Callable[[], Usage | None] | None = None
        self.verdict: Verdict | None = None

    def finish(self, status: int) -> None:
        """Settle the status, unless it is settled already."""
        if not self.finished:
            self.finished = True
            self.status = status


#: Random bytes in a request id (``req_`` and 24 hex digits).
REQUEST_ID_BYTES: Final = 12
#: Request ids drawn from the system's random source at once.
_IDS_PER_DRAW: Final = 256
_ids: list[str] = []


def new_request_id() -> str:
    """A new ``req_…`` id: ``req_`` and :data:`REQUEST_ID_BYTES` random bytes
    in hex, from :mod:`secrets` as before, drawn :data:`_IDS_PER_DRAW` ids
    at a time (one ``getrandom`` call instead of one per request)."""
    if not _ids:
        digits = 2 * REQUEST_ID_BYTES
        raw = secrets.token_hex(REQUEST_ID_BYTES * _IDS_PER_DRAW)
        _ids.extend("req_" + raw[at : at + digits] for at in range(0, len(raw), digits))
    return _ids.pop()

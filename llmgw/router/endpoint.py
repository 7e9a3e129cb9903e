"""What the router sends requests to: a ready replica of ours, or one key of
an outside provider (``docs/api.md``, Which replica answers).

The control plane makes an :class:`Endpoint` for each READY replica (with
the replica's engine key); :class:`~llmgw.router.external.ProviderKeys`
makes one per readable outside key. The router keeps its live figures on
it: requests in flight, the smoothed time to first token, the KV-cache
share free (scraped by :mod:`llmgw.router.engine_metrics`) and its
:class:`~llmgw.router.breaker.Breaker`.

A replica that leaves routing other than by retiring (its engine stopped
answering its health check, failed, stopped) is :meth:`Endpoint.lose`-t:
the attempts still waiting for its first byte are cancelled and end in
:class:`EndpointLost`, which the router retries elsewhere.
"""

from __future__ import annotations

import attrs
import trio

from llmgw import errors
from llmgw.router.breaker import Breaker

__all__ = ["Endpoint", "EndpointLost"]


class EndpointLost(errors.UpstreamError):
    """The endpoint left routing while an attempt waited for its first
    byte (:meth:`Endpoint.lose`); nothing reached the client."""

    def __init__(self, label: str) -> None:
        super().__init__(f"replica {label} left routing before it answered")


@attrs.define(kw_only=True)
class Endpoint:
    """A ready replica, or one outside-provider key, the router may send
    requests to.

    Attributes:
        replica_id: the replica; for an outside key ``external:<model>#<n>``.
        model: the catalog model it serves.
        host, port: where it answers.
        api_key: the engine key (never the client's), or the provider key.
        in_flight: requests sent and not yet finished (queue depth).
        slots: sequences the engine runs in parallel; 0 = unknown/unbounded.
        ttft_ewma_s: smoothed time to first token in seconds, ``None``
            until one was observed (:meth:`observe_ttft`).
        kv_free_ratio: free share of the KV cache, 0 … 1, from the engine's
            metrics; ``None`` when unknown.
        breaker: its circuit breaker (:mod:`llmgw.router.breaker`).
        weight: traffic share relative to the model's other outside keys (≥ 1).
        external: an outside-provider key, not a replica of ours.
        tls: speak HTTPS to it.
        path_prefix: path before ``/v1/…`` at the provider (``/openai``), or "".
        lost: it left routing (:meth:`lose`); a new endpoint is made if the
            replica comes back.
        waiting: the cancel scopes of attempts waiting for its first byte
            (``Attempt.waiting_first_byte`` in :mod:`llmgw.router.router`).
    """

    #: Weight of the newest observation in :attr:`ttft_ewma_s`: about the
    #: last 10 requests count, so a replica that slows down is noticed
    #: within a few answers without one outlier swinging the choice.
    TTFT_ALPHA = 0.2

    replica_id: str
    model: str
    host: str
    port: int
    #: Kept out of ``repr``: an outside key must never reach a log.
    api_key: str = attrs.field(repr=False)
    in_flight: int = 0
    slots: int = 0
    ttft_ewma_s: float | None = None
    kv_free_ratio: float | None = None
    breaker: Breaker = attrs.field(factory=Breaker, eq=False, repr=False)
    weight: int = 1
    external: bool = False
    tls: bool = False
    path_prefix: str = ""
    lost: bool = attrs.field(default=False, eq=False)
    waiting: set[trio.CancelScope] = attrs.field(factory=set, eq=False, repr=False)

    def lose(self) -> None:
        """It left routing: cancel the attempts waiting for its first byte
        (they end in :class:`EndpointLost`), and any that start later."""
        self.lost = True
        for scope in self.waiting:
            scope.cancel()

    @property
    def label(self) -> str:
        """What the ``x-llmgw-replica`` header and usage rows show: the replica
        id, or ``external:<model>#<n>`` for an outside key."""
        return self.replica_id

    def observe_ttft(self, seconds: float) -> None:
        """Fold one time to first token (seconds) into :attr:`ttft_ewma_s`
        (exponential moving average, weight :attr:`TTFT_ALPHA`; the first
        observation is taken as is). Negative or NaN values are ignored."""
        if not seconds >= 0:
            return
        previous = self.ttft_ewma_s
        self.ttft_ewma_s = (
            seconds if previous is None else previous + self.TTFT_ALPHA * (seconds - previous)
        )

    @property
    def base_url(self) -> str:
        """``http(s)://host:port`` plus :attr:`path_prefix` (an IPv6 host in brackets)."""
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{_url_host(self.host)}:{self.port}{self.path_prefix}"

    @property
    def auth_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers that carry this engine's key: ``[(b"authorization",
        b"Bearer <key>")]``, or none at all for an engine without a key (an
        empty or blank :attr:`api_key`), never an empty ``Bearer``."""
        key = self.api_key.strip()
        return [(b"authorization", f"Bearer {key}".encode())] if key else []


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address

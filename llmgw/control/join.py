"""Joining nodes: join codes, and the join port (HTTPS, 7444 by default).

:class:`JoinService` makes join codes (for the admin API's
``POST /api/v1/nodes/join-codes``) and answers joining nodes;
:func:`serve_join` serves it over TLS with the control plane's certificate
(:mod:`llmgw.control.ca`), one request per connection (HTTP/1.1 with h11),
each connection bounded in time (:data:`REQUEST_DEADLINE_S`), body size
(:data:`MAX_BODY_BYTES`) and number (:data:`MAX_CONNECTIONS`).

The routes:

- ``GET /v1/join/ca`` → ``{"ca_pem", "fingerprint"}``: read by a node
  before it trusts anything, to compare with its code's fingerprint;
- ``GET /v1/join/time`` → ``{"time_s"}``: this machine's clock (epoch s);
- ``POST /v1/join`` ``{"token", "csr_pem", "node_id"}`` → ``{"node_id",
  "cert_pem", "ca_pem", "servers", "labels"}``: the token is used once and
  the node's certificate issued (``CN`` = the code's node id when it names
  one, else the one asked), recorded in the store; earlier certificates of
  that node id are revoked. ``servers`` are the agents' hub URLs.

Errors are ``{"error": {"message", "code"}}``: 403 ``join_code_unknown`` (a
forged code, or another cluster's), 410 ``join_code_used`` / ``join_code_expired``,
400 ``bad_request`` (a bad body, certificate request or node id), 409
``node_id_taken`` (a connected node holds a valid certificate for that id),
404, 405, 413, 503 (the store). See ``docs/cluster.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NoReturn

import attrs
import h11
import trio

from llmgw import errors
from llmgw.agent.joincode import JoinCode, join_address
from llmgw.store import JoinToken, NodeCertificate, Store

from .ca import BadCertificateRequest, ClusterCA, check_node_id, machine_addresses
from .cluster import Cluster

__all__ = [
    "JOIN_PORT",
    "MAX_BODY_BYTES",
    "MAX_CODE_EXPIRES_S",
    "REQUEST_DEADLINE_S",
    "JoinService",
    "MadeJoinCode",
    "NodeIdTaken",
    "hub_urls",
    "reachable_hosts",
    "serve_join",
]

log = logging.getLogger("llmgw.control.join")

#: The join port's default.
JOIN_PORT: Final = 7444
#: The largest request body the join port reads, in bytes.
MAX_BODY_BYTES: Final = 64 * 1024
#: One connection's whole life (TLS handshake, request, answer), in seconds.
REQUEST_DEADLINE_S: Final = 15.0
#: Connections served at once; more are closed at once.
MAX_CONNECTIONS: Final = 64
#: The longest a join code may live, in seconds (30 days).
MAX_CODE_EXPIRES_S: Final = 30 * 86400.0

_WILDCARDS = ("", "0.0.0.0", "::", "[::]")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")
MAX_LABEL_VALUE_CHARS: Final = 256
MAX_LABELS: Final = 64


class NodeIdTaken(errors.Refused):
    """A connected node holds a valid certificate for the node id asked."""

    status = 409
    code = "node_id_taken"


class BadJoinRequest(errors.InvalidInput):
    """A join request whose body is not what ``POST /v1/join`` takes."""


@attrs.frozen(kw_only=True)
class MadeJoinCode:
    """A join code just made.

    Attributes:
        code: the code (``llmgw1.…``).
        expires_at: when it stops working (UTC epoch s).
        node_id: the node id it is for (``""``: the node's own choice).
        labels: the labels the node gets.
        addresses: the join addresses it carries, in order.
    """

    code: str
    expires_at: float
    node_id: str
    labels: dict[str, str]
    addresses: tuple[str, ...]


def reachable_hosts(listen_host: str, advertise: Sequence[str]) -> list[str]:
    """The hosts by which a listener on ``listen_host`` is reached, best first.

    ``advertise`` first; then, for a wildcard listener (``0.0.0.0``, ``::``),
    this machine's non-loopback addresses (IPv4 only for ``0.0.0.0``), else
    ``listen_host`` itself. ``127.0.0.1`` only when nothing else is left.
    """
    hosts = [h.strip("[]") for h in advertise if h.strip()]
    if listen_host in _WILDCARDS:
        found = machine_addresses()
        if listen_host == "0.0.0.0":
            found = [a for a in found if ":" not in a]
        hosts.extend(found)
    else:
        hosts.append(listen_host.strip("[]"))
    unique = list(dict.fromkeys(hosts))
    return unique or ["127.0.0.1"]


def hub_urls(hosts: Sequence[str], port: int) -> list[str]:
    """``wss://HOST:PORT/agent`` for each host (an IPv6 one in brackets)."""
    return [f"wss://{join_address(h, port)}/agent" for h in hosts]


def check_labels(labels: object) -> dict[str, str]:
    """``labels`` as a dict when it is an object of at most :data:`MAX_LABELS`
    string labels (keys: letters, digits, ``.``, ``_``, ``/``, ``-``, up to 63).

    Raises:
        errors.InvalidInput: it is not.
    """
    if not isinstance(labels, Mapping):
        raise errors.InvalidInput("labels must be an object of names to strings")
    if len(labels) > MAX_LABELS:
        raise errors.InvalidInput(f"at most {MAX_LABELS} labels, not {len(labels)}")
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.match(key):
            raise errors.InvalidInput(
                f"label name {key!r} is not valid: use up to 63 letters, digits, '.', '_', "
                "'/' or '-', starting and ending with a letter or digit"
            )
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE_CHARS:
            raise errors.InvalidInput(
                f"label {key!r} must be a string of at most {MAX_LABEL_VALUE_CHARS} characters"
            )
        out[key] = value
    return out


def token_hash(token: str) -> str:
    """The hex SHA-256 of a join token, as the store keeps it."""
    return hashlib.sha256(token.encode()).hexdigest()


class JoinService:
    """Makes join codes and answers joining nodes.

    Args:
        ca: the cluster CA.
        store: where tokens and issued certificates are kept.
        cluster: the live view, to tell whether a node id is connected.
        servers: the agents' hub URLs handed to joined nodes.
        clock: the current UTC epoch time in seconds.

    Attributes:
        addresses: the join addresses codes carry (``host:port``); set by
            :func:`serve_join` once it listens, or by the caller.
    """

    def __init__(
        self,
        ca: ClusterCA,
        store: Store,
        cluster: Cluster,
        *,
        servers: Sequence[str],
        addresses: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ca = ca
        self.store = store
        self.cluster = cluster
        self.servers = list(servers)
        self.addresses: tuple[str, ...] = tuple(addresses)
        self._clock = clock

    async def make_code(
        self, *, expires_s: float, labels: Mapping[str, str] | None = None, node_id: str = ""
    ) -> MadeJoinCode:
        """A new join code, its token kept (hashed) in the store.

        Args:
            expires_s: how long it works, in seconds (1 to :data:`MAX_CODE_EXPIRES_S`).
            labels: labels the joining node gets (see :func:`check_labels`).
            node_id: the node id it is for; ``""`` lets the node choose
                (its host name unless ``llmgw join --node-id``).

        Raises:
            errors.InvalidInput: a bad ``expires_s``, label or node id.
            errors.StartupError: the join port is not listening yet.
        """
        if (
            isinstance(expires_s, bool)
            or not isinstance(expires_s, int | float)
            or not 1 <= expires_s <= MAX_CODE_EXPIRES_S
        ):
            raise errors.InvalidInput(
                f"expires_s must be from 1 to {MAX_CODE_EXPIRES_S:.0f} seconds (30 days), "
                f"not {expires_s!r}"
            )
        if node_id:
            check_node_id(node_id)
        checked = check_labels(labels or {})
        if not self.addresses:
            raise errors.StartupError("the join port is not listening yet; try again")
        token = secrets.token_urlsafe(32)
        now = self._clock()
        expires_at = now + float(expires_s)
        await self.store.insert_join_token(
            JoinToken(
                token_hash=token_hash(token),
                created_at=now,
                expires_at=expires_at,
                node_id=node_id,
                labels=checked,
            )
        )
        code = JoinCode(self.addresses, token, self.ca.fingerprint).encode()
        log.info(
            "made a join code for %s, valid until %s",
            node_id or "a new node",
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires_at)),
        )
        return MadeJoinCode(
            code=code,
            expires_at=expires_at,
            node_id=node_id,
            labels=checked,
            addresses=self.addresses,
        )

    def ca_doc(self) -> dict[str, Any]:
        """The answer of ``GET /v1/join/ca``."""
        return {"ca_pem": self.ca.ca_pem.decode("ascii"), "fingerprint": self.ca.fingerprint}

    async def join(self, doc: object, *, peer: str = "") -> dict[str, Any]:
        """Answer ``POST /v1/join`` with ``doc``, its JSON body.

        Raises:
            BadJoinRequest: the body is not ``{"token", "csr_pem", "node_id"}``.
            JoinTokenUnknown, JoinTokenUsed, JoinTokenExpired: the token
                cannot be used (nothing is issued).
            BadCertificateRequest: a bad request or node id (the token stays
                unused).
            NodeIdTaken: a connected node holds a valid certificate for the
                node id (the token stays unused).
        """
        token, csr_pem, asked = _join_fields(doc)
        now = self._clock()
        hashed = token_hash(token)
        stored = await self.store.get_join_token(hashed)
        if stored is None or stored.used_at is not None or stored.expires_at <= now:
            # The store says which refusal it is, with its message.
            await self.store.use_join_token(hashed, now)
            raise AssertionError("a join token unknown, used or expired was used")
        node_id = stored.node_id or asked
        if not node_id:
            raise BadJoinRequest("node_id is missing: name the node (llmgw join --node-id)")
        issued = self.ca.issue(csr_pem.encode(), check_node_id(node_id))
        await self._check_free(node_id, now)
        used = await self.store.use_join_token(hashed, now)
        revoked = await self.store.revoke_node_certificates(node_id, now)
        await self.store.insert_node_certificate(
            NodeCertificate(issued.serial, node_id, now, issued.not_after)
        )
        log.info(
            "node %s joined from %s: certificate %s issued%s",
            node_id,
            peer or "?",
            issued.serial,
            f", {revoked} earlier one(s) revoked" if revoked else "",
        )
        return {
            "node_id": node_id,
            "cert_pem": issued.pem.decode("ascii"),
            "ca_pem": self.ca.ca_pem.decode("ascii"),
            "servers": list(self.servers),
            "labels": dict(used.labels),
        }

    async def _check_free(self, node_id: str, now: float) -> None:
        node = self.cluster.nodes.get(node_id)
        if node is None or not node.connected:
            return
        valid = [
            c
            for c in await self.store.list_node_certificates(node_id)
            if c.revoked_at is None and c.not_after > now
        ]
        if valid:
            raise NodeIdTaken(
                f"node {node_id!r} is connected now with a valid certificate (serial "
                f"{valid[-1].serial}): give this machine another node id (llmgw join "
                f"--node-id), or remove that node first (llmgw ctl nodes remove {node_id})"
            )


def _join_fields(doc: object) -> tuple[str, str, str]:
    if not isinstance(doc, dict):
        raise BadJoinRequest('the body must be a JSON object {"token", "csr_pem", "node_id"}')
    token, csr_pem, node_id = doc.get("token"), doc.get("csr_pem"), doc.get("node_id", "")
    if not isinstance(token, str) or not token:
        raise BadJoinRequest("token is missing: send the join code's token")
    if not isinstance(csr_pem, str) or not csr_pem:
        raise BadJoinRequest("csr_pem is missing: send a PEM certificate request")
    if not isinstance(node_id, str):
        raise BadJoinRequest("node_id must be a string")
    return token, csr_pem, node_id


# --- the HTTPS server ---------------------------------------------------------------


async def serve_join(
    host: str,
    port: int,
    service: JoinService,
    *,
    advertise: Sequence[str] = (),
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve the join port on ``host:port`` until cancelled.

    Started with ``nursery.start``, once listening, with the bound port;
    ``service.addresses`` is then set to the join addresses codes carry
    (:func:`reachable_hosts` of ``host`` and ``advertise``, with that port)
    unless the caller set them.

    Args:
        host, port: where to listen (port 0 picks a free one).
        service: what answers the routes; the port presents its CA's
            server certificate.
        advertise: names and addresses put first in join codes.

    Raises:
        OSError: the port cannot be bound.
    """
    context = service.ca.server_ssl_context(client_certs=False)
    limiter = trio.CapacityLimiter(MAX_CONNECTIONS)

    async def handle(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            await trio.aclose_forcefully(stream)
            return
        try:
            await _serve_connection(stream, service)
        finally:
            limiter.release()

    listeners = await trio.open_ssl_over_tcp_listeners(
        port, context, host=host or None, https_compatible=True
    )
    transport = listeners[0].transport_listener
    assert isinstance(transport, trio.SocketListener)
    bound = int(transport.socket.getsockname()[1])
    if not service.addresses:
        service.addresses = tuple(join_address(h, bound) for h in reachable_hosts(host, advertise))
    log.info(
        "join port on %s (codes carry %s)",
        join_address(host, bound),
        ", ".join(service.addresses),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(bound)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


async def _serve_connection(
    stream: trio.SSLStream[trio.SocketStream], service: JoinService
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
    peer = _peer(stream)
    try:
        with trio.fail_after(REQUEST_DEADLINE_S):
            request = await _next_event(stream, conn)
            if not isinstance(request, h11.Request):
                return
            status, doc = await _answer(stream, conn, request, service, peer)
            await _send(stream, conn, status, doc)
    except trio.TooSlowError:
        log.debug("join connection from %s timed out", peer)
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
        log.debug("join connection from %s broke: %s", peer, errors.describe(exc))
    finally:
        await trio.aclose_forcefully(stream)


async def _answer(
    stream: trio.SSLStream[trio.SocketStream],
    conn: h11.Connection,
    request: h11.Request,
    service: JoinService,
    peer: str,
) -> tuple[int, dict[str, Any]]:
    method = request.method.decode("ascii", "replace")
    path = request.target.decode("ascii", "replace").split("?", 1)[0]
    routes = {"/v1/join/ca": "GET", "/v1/join/time": "GET", "/v1/join": "POST"}
    if path not in routes:
        return _error(404, "not_found", f"no route {path}: the join port has {sorted(routes)}")
    if method != routes[path]:
        return _error(405, "method_not_allowed", f"{path} takes {routes[path]}, not {method}")
    if path == "/v1/join/ca":
        return 200, service.ca_doc()
    if path == "/v1/join/time":
        return 200, {"time_s": time.time()}
    body = await _read_body(stream, conn)
    if body is None:
        return _error(413, "too_large", f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        doc = json.loads(body)
    except ValueError:
        return _error(400, "bad_request", "the body is not JSON")
    try:
        return 200, await service.join(doc, peer=peer)
    except errors.Refused as exc:
        log.info("join from %s refused: %s", peer, exc)
        return _error(exc.status, exc.code, str(exc))
    except (BadCertificateRequest, errors.InvalidInput) as exc:
        log.info("join from %s refused: %s", peer, exc)
        return _error(400, "bad_request", str(exc))
    except errors.StoreError as exc:
        log.error("join from %s: the store failed: %s", peer, exc)
        return _error(503, "store_unavailable", f"the store cannot be reached: {exc}")


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "code": code}}


async def _next_event(stream: trio.SSLStream[trio.SocketStream], conn: h11.Connection) -> Any:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(16 * 1024)))
            continue
        return event


async def _read_body(
    stream: trio.SSLStream[trio.SocketStream], conn: h11.Connection
) -> bytes | None:
    """The request body, or ``None`` when it is over :data:`MAX_BODY_BYTES`."""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await _next_event(stream, conn)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY_BYTES:
                return None
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in a body")


async def _send(
    stream: trio.SSLStream[trio.SocketStream],
    conn: h11.Connection,
    status: int,
    doc: dict[str, Any],
) -> None:
    body = json.dumps(doc).encode()
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
    await stream.send_all(conn.send(h11.Data(data=body)) or b"")
    await stream.send_all(conn.send(h11.EndOfMessage()) or b"")


def _peer(stream: trio.SSLStream[trio.SocketStream]) -> str:
    try:
        address = stream.transport_stream.socket.getpeername()
    except OSError:
        return "?"
    return join_address(str(address[0]), int(address[1]))

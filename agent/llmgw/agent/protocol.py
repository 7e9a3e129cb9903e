"""The wire between an agent and the control plane.

A frame is one websocket binary message holding one msgpack map::

    {"type": "<message class name>", "v": PROTOCOL_VERSION, ...fields}

Messages are frozen attrs classes in one tagged union (:data:`Message`),
structured and unstructured by one cattrs msgpack converter. Rules:

- unknown fields are ignored (forward compatibility within a version);
- a ``v`` other than :data:`PROTOCOL_VERSION` raises :class:`VersionMismatch`
  (a frame without ``v`` is taken as this version);
- an unknown ``type`` raises :class:`UnknownMessage` — the receiver answers
  with :class:`Error` and keeps the link;
- a frame longer than :data:`MAX_FRAME_BYTES` raises :class:`FrameTooLarge`;
- anything else malformed raises :class:`BadFrame`.

All four derive from :class:`llmgw.errors.ProtocolError` (which
:class:`ProtocolError` here is). What each end of the link does about them
is :mod:`llmgw.agent.session`'s.

Commands from the control plane carry a ``correlation_id`` echoed by the
reply. ``StartShard`` is idempotent by ``shard_id``.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Final, TypeAlias

import attrs
import cattrs
import msgpack
from cattrs.preconf.msgpack import make_converter

from llmgw import errors

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "BadFrame",
    "ControlPlanes",
    "DownloadProgress",
    "EngineProfile",
    "Error",
    "FrameTooLarge",
    "Gpu",
    "Hardware",
    "Heartbeat",
    "LogsReply",
    "LogsRequest",
    "Message",
    "ProtocolError",
    "Register",
    "Registered",
    "RunningShard",
    "ShardState",
    "ShardStatus",
    "StartShard",
    "StopShard",
    "UnknownMessage",
    "VersionMismatch",
    "WeightsFetch",
    "WeightsFile",
    "WeightsHeld",
    "WeightsReply",
    "WeightsRequest",
    "decode",
    "encode",
]

PROTOCOL_VERSION: Final = 1
#: The largest frame either side accepts, in bytes. A ``LogsReply`` of 2,000
#: lines fits well inside it.
MAX_FRAME_BYTES: Final = 4 * 1024 * 1024


#: A frame that could not be turned into a message (the tree's class itself).
ProtocolError = errors.ProtocolError


class FrameTooLarge(ProtocolError):
    """The frame is longer than :data:`MAX_FRAME_BYTES`."""


class UnknownMessage(ProtocolError):
    """The frame's ``type`` names no message this side knows.

    Attributes:
        type_name: the unknown name, for the :class:`Error` answer.
    """

    def __init__(self, type_name: str) -> None:
        super().__init__(f"unknown message type {type_name!r}")
        self.type_name = type_name


class BadFrame(ProtocolError):
    """The frame is not a msgpack map of a known message with valid fields."""


class VersionMismatch(ProtocolError):
    """The frame is of another protocol version than :data:`PROTOCOL_VERSION`.

    The message names both versions: ``"agent speaks protocol 2, this
    control plane speaks 1"`` when ``peer`` and ``me`` name the two ends.

    Attributes:
        theirs: the frame's ``v``.
        ours: :data:`PROTOCOL_VERSION`.
    """

    def __init__(self, theirs: int, *, peer: str = "the peer", me: str = "this side") -> None:
        super().__init__(f"{peer} speaks protocol {theirs}, {me} speaks {PROTOCOL_VERSION}")
        self.theirs = theirs
        self.ours: int = PROTOCOL_VERSION


class ShardState(enum.StrEnum):
    STARTING = "STARTING"
    READY = "READY"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


# --- shared shapes -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Gpu:
    index: int
    name: str
    memory_total_mb: int
    uuid: str = ""
    compute_capability: str = ""
    #: Memory in use on the card, and the part of it held by processes
    #: that are not this agent's engines (re-read at every heartbeat).
    memory_used_mb: int = 0
    foreign_memory_mb: int = 0


@attrs.frozen(kw_only=True)
class Hardware:
    """What discovery found. ``gpus`` is empty on a machine with no NVIDIA driver."""

    cpu_count: int
    memory_total_mb: int
    memory_available_mb: int = 0
    gpus: tuple[Gpu, ...] = ()
    os_id: str = ""
    os_version: str = ""
    arch: str = ""
    cpu_flags: tuple[str, ...] = ()
    nvidia_driver: str = ""
    #: Measured memory read bandwidth, whole machine and one core, in GB/s
    #: (0 until the agent's background measurement has run).
    memory_bandwidth_gbps: float = 0.0
    core_bandwidth_gbps: float = 0.0


@attrs.frozen(kw_only=True)
class EngineProfile:
    """How to run one replica.

    Attributes:
        name: the model's catalog name.
        engine: the adapter name (``llamacpp``, ``sim``).
        model_path: a local weights file the agent checks and the engine loads.
        model_sha256: the expected digest of ``model_path``; empty skips the check.
        served_model_name: the name the engine answers to.
        context_tokens: ``--ctx-size``.
        slots: parallel sequences.
        cpu_cores: engine threads, 0 = the engine decides.
        args, env: extra engine arguments and environment, already vetted.
    """

    name: str
    engine: str
    served_model_name: str
    model_path: str = ""
    model_sha256: str = ""
    context_tokens: int = 4096
    slots: int = 4
    cpu_cores: int = 0
    args: tuple[str, ...] = ()
    env: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class RunningShard:
    """A shard an agent runs, as reported in ``Register`` for adoption."""

    shard_id: str
    replica_id: str
    model: str
    state: ShardState
    port: int
    pid: int = 0
    fingerprint: str = ""
    gpu_indices: tuple[int, ...] = ()
    #: What the engine said it runs on ("CPU", "CUDA0 …"); empty = not known.
    compute: str = ""


@attrs.frozen(kw_only=True)
class WeightsFile:
    """One file of a pinned model version.

    Attributes:
        path: its path in the repository (``a/b.gguf``; no ``..``).
        size_bytes: its size.
        sha256: its digest, lowercase hex (the LFS sha256 the hub publishes).
    """

    path: str
    size_bytes: int
    sha256: str


@attrs.frozen(kw_only=True)
class WeightsFetch:
    """What a node fetches before it starts a shard (``docs/models-from-hf.md``).

    The files go to ``WEIGHTS_DIR/hf/<repo>/<revision>/<path>``; the engine
    then runs on ``<main_file>`` there (a file: llama.cpp), or on the
    directory itself when ``main_file`` is empty (vLLM).

    Attributes:
        repo: ``ORG/REPO``.
        revision: the pinned commit, 40 hex digits.
        files: every file to fetch, with size and sha256.
        main_file: the file the engine loads ("" = the directory).
        endpoints: hub endpoints to fetch from, in order (mirrors first).
    """

    repo: str
    revision: str
    files: tuple[WeightsFile, ...]
    main_file: str = ""
    endpoints: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class DownloadProgress:
    """A weights fetch under way on a node.

    Attributes:
        done_bytes: bytes fetched (``downloading``) or hashed (``checking``)
            so far, of ``total_bytes``.
        total_bytes: the model's bytes.
        rate_bytes_per_s: bytes per second over the last few seconds.
        phase: ``downloading`` or ``checking``.
    """

    done_bytes: int
    total_bytes: int
    rate_bytes_per_s: float = 0.0
    phase: str = "downloading"


# --- agent → control plane -------------------------------------------------------


@attrs.frozen(kw_only=True)
class Register:
    """First message on every link: the agent's whole state."""

    node_id: str
    #: Where the control plane and the gateway reach this node's engines
    #: (the source address of its route to the control plane, or agent.yaml's).
    address: str
    agent_version: str
    hardware: Hardware
    #: The network interface ``address`` is on ("" = not known: an older agent).
    interface: str = ""
    engines: tuple[str, ...] = ()
    engines_probed: bool = True
    running_shards: tuple[RunningShard, ...] = ()
    #: Node labels from agent.yaml, matched by profile selectors.
    labels: dict[str, str] = attrs.field(factory=dict)
    #: Engine installs asked for that did not install: recipe name -> why
    #: (``docs/engines.md``, Engine installs); not in ``engines``.
    engine_failures: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class Heartbeat:
    node_id: str
    memory_total_mb: int
    memory_available_mb: int
    cpu_count: int
    load_1m: float = 0.0
    #: The cards as now (foreign memory re-evaluated each beat).
    gpus: tuple[Gpu, ...] = ()
    #: As in :class:`Hardware`, once measured (0 = not yet).
    memory_bandwidth_gbps: float = 0.0
    core_bandwidth_gbps: float = 0.0


@attrs.frozen(kw_only=True)
class ShardStatus:
    """A shard's state changed. ``last_lines`` carries the engine's last
    output when it failed; ``reason`` says why in one line."""

    shard_id: str
    replica_id: str
    state: ShardState
    port: int = 0
    reason: str = ""
    last_lines: tuple[str, ...] = ()
    correlation_id: str = ""
    #: What the engine said it runs on, once READY ("CPU", "CUDA0 …").
    compute: str = ""
    #: STARTING with progress (download bytes, loading): resets the start
    #: deadline. Empty on other changes.
    progress: str = ""
    #: The weights download of a STARTING shard (phase ``downloading`` or
    #: ``checking``); ``None`` otherwise.
    download: DownloadProgress | None = None
    #: The engine's process id while it runs (its first process for a
    #: multi-process shard); 0 when none runs (or an older agent).
    pid: int = 0


@attrs.frozen(kw_only=True)
class LogsReply:
    correlation_id: str
    lines: tuple[str, ...]
    source: str = ""


@attrs.frozen(kw_only=True)
class Error:
    """Either side's answer to a frame it could not act on."""

    message: str
    correlation_id: str = ""


# --- control plane → agent ----------------------------------------------------------


@attrs.frozen(kw_only=True)
class Registered:
    """The control plane accepted the ``Register``."""

    node_id: str
    control_plane: str = ""


@attrs.frozen(kw_only=True)
class ControlPlanes:
    """The control planes' agent hubs an agent may link to
    (``wss://host:7443/agent`` each), sent by the leader after
    ``Registered``; the agent keeps them for its reconnects."""

    urls: tuple[str, ...]


@attrs.frozen(kw_only=True)
class StartShard:
    """Start (or keep running) a shard. Idempotent by ``shard_id``: a shard
    already STARTING or READY is left alone; a FAILED or STOPPED one starts
    again. ``api_key`` is the engine key; it goes to the engine's
    environment only."""

    correlation_id: str
    shard_id: str
    replica_id: str
    profile: EngineProfile
    port: int
    api_key: str = ""
    bind_addr: str = "127.0.0.1"
    gpu_indices: tuple[int, ...] = ()
    fingerprint: str = ""
    #: Weights the agent fetches first (into its weights directory) and then
    #: runs the engine on, in place of ``profile.model_path``; ``None``: the
    #: profile's local path as it is.
    weights: WeightsFetch | None = None


@attrs.frozen(kw_only=True)
class StopShard:
    correlation_id: str
    shard_id: str


@attrs.frozen(kw_only=True)
class LogsRequest:
    """Ask for the last ``lines`` lines of a shard's output (``source`` =
    shard id) or of the agent itself (``source`` empty)."""

    correlation_id: str
    source: str = ""
    lines: int = 200


# --- weights held on a node (``ctl weights``, ``remove --purge``) ------------------


@attrs.frozen(kw_only=True)
class WeightsHeld:
    """A model version llmgw fetched onto a node.

    Attributes:
        repo, revision: ``ORG/REPO`` and its commit.
        path: its directory on the node.
        files: how many of its files are in place.
        size_bytes: their bytes.
        in_use: a shard of this node runs on it.
    """

    repo: str
    revision: str
    path: str
    files: int = 0
    size_bytes: int = 0
    in_use: bool = False


@attrs.frozen(kw_only=True)
class WeightsRequest:
    """Control plane → agent: list the weights llmgw fetched there, after
    deleting the versions in ``remove`` (``ORG/REPO@<commit>`` each) that no
    shard of the node runs on; only files llmgw fetched are deleted."""

    correlation_id: str
    remove: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class WeightsReply:
    """Agent → control plane: the answer to :class:`WeightsRequest`.

    Attributes:
        held: what the node holds now.
        removed: the paths deleted.
        kept: versions asked to be removed but kept, with why.
    """

    correlation_id: str
    held: tuple[WeightsHeld, ...] = ()
    removed: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


Message: TypeAlias = (
    Register
    | Heartbeat
    | ShardStatus
    | LogsReply
    | Error
    | Registered
    | ControlPlanes
    | StartShard
    | StopShard
    | LogsRequest
    | WeightsRequest
    | WeightsReply
)

_TYPES: Final[dict[str, type[Any]]] = {
    cls.__name__: cls
    for cls in (
        Register,
        Heartbeat,
        ShardStatus,
        LogsReply,
        Error,
        Registered,
        ControlPlanes,
        StartShard,
        StopShard,
        LogsRequest,
        WeightsRequest,
        WeightsReply,
    )
}

_converter = make_converter(forbid_extra_keys=False)


def _strict(kind: type[Any], accepts: tuple[type[Any], ...]) -> None:
    """Refuse values of the wrong type instead of converting them (cattrs
    would turn ``["x"]`` into the string ``"['x']"``)."""

    def structure(value: Any, _: Any) -> Any:
        if isinstance(value, bool) and bool not in accepts:
            raise TypeError(f"expected {kind.__name__}, got a boolean")
        if not isinstance(value, accepts):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return kind(value)

    _converter.register_structure_hook(kind, structure)


_strict(str, (str,))
_strict(int, (int,))


def _say_error(exc: BaseException, _: Any) -> str:
    """What was wrong with one field: the hook's own words."""
    if isinstance(exc, KeyError):
        return "required field missing"
    return str(exc) or type(exc).__name__


def _finite(value: Any, _: Any) -> float:
    """A float field: a number, and a finite one (a NaN or an infinity from
    a peer would poison the cluster's sums and comparisons)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected float, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {number}")
    return number


_converter.register_structure_hook(float, _finite)
_strict(bool, (bool,))
# ShardState is a str: give it its own hook, or the str hook above would
# hand back a plain string.
_converter.register_structure_hook(ShardState, lambda value, _: ShardState(value))


def encode(message: Message) -> bytes:
    """One frame for ``message``.

    Raises:
        FrameTooLarge: the encoded frame exceeds :data:`MAX_FRAME_BYTES`.
    """
    doc: dict[str, Any] = _converter.unstructure(message)
    doc["type"] = type(message).__name__
    doc["v"] = PROTOCOL_VERSION
    frame: bytes = msgpack.packb(doc, use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"{type(message).__name__} frame of {len(frame)} bytes")
    return frame


def decode(frame: bytes | str) -> Message:
    """The message in ``frame``.

    Raises:
        FrameTooLarge: the frame exceeds :data:`MAX_FRAME_BYTES` (not parsed).
        VersionMismatch: ``v`` is another protocol version (checked before
            ``type``: a newer version may name messages this one does not know).
        UnknownMessage: ``type`` names no known message.
        BadFrame: not a msgpack map, no ``type``, or fields of the wrong shape.
    """
    if isinstance(frame, str):
        raise BadFrame("text frame; the link carries binary msgpack frames")
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        doc = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BadFrame(f"not msgpack: {exc}") from exc
    if not isinstance(doc, dict):
        raise BadFrame("frame is not a map")
    version = doc.pop("v", PROTOCOL_VERSION)
    if isinstance(version, bool) or not isinstance(version, int):
        raise BadFrame(f"'v' must be a whole number, not {type(version).__name__}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version)
    type_name = doc.pop("type", None)
    doc.pop("trace", None)
    if not isinstance(type_name, str):
        raise BadFrame("frame has no 'type'")
    cls = _TYPES.get(type_name)
    if cls is None:
        raise UnknownMessage(type_name)
    try:
        message: Message = _converter.structure(doc, cls)
    except cattrs.BaseValidationError as exc:
        said = "; ".join(cattrs.transform_error(exc, path=type_name, format_exception=_say_error))
        raise BadFrame(f"bad {type_name}: {said}") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise BadFrame(f"bad {type_name}: {exc}") from exc
    return message

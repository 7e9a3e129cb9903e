"""The engine adapter interface shared by every engine llmgw can run.

An adapter turns a :class:`ShardLaunch` (what the control plane asked for)
into the command lines that start the engine, and says how to tell when the
engine is ready. It does no I/O itself: the agent's supervisor runs the
commands and probes the health path.

Rules every adapter keeps:

- keys always travel in the environment (``LLAMA_API_KEY`` for llama.cpp and
  the sim engine), never on the command line;
- ``CUDA_VISIBLE_DEVICES`` comes from ``gpu_indices``;
- a JSON health body whose ``status`` is one of :data:`NOT_READY_STATUSES`
  means not ready, even with HTTP 200; a non-JSON body counts as ready;
- :meth:`EngineAdapter.failure_cause` picks the engine's own error line
  from its output, so a FAILED reason names the cause (``docs/up.md``,
  Failures); :func:`error_line` is the generic picker it falls back to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final, Protocol, runtime_checkable

import attrs
import orjson

__all__ = [
    "MAX_CAUSE_CHARS",
    "NOT_READY_STATUSES",
    "Command",
    "EngineAdapter",
    "ReadyByModelList",
    "ShardLaunch",
    "body_says_ready",
    "cuda_visible_devices",
    "engine_env",
    "error_line",
    "lists_model",
    "short",
]

#: Health ``status`` values that mean "not ready yet", even with HTTP 200.
NOT_READY_STATUSES = frozenset(
    {"loading", "starting", "initializing", "warming_up", "error", "unhealthy"}
)

#: The most of a health body that is read, in bytes.
MAX_HEALTH_BODY_BYTES = 64 * 1024

#: The longest cause a FAILED reason carries, in characters (longer is cut, with "…").
MAX_CAUSE_CHARS: Final = 300

#: Words that make an output line an error report (whole words, any case).
_ERROR_WORDS: Final = re.compile(
    r"\b(error|fatal|panic|failed|failure|cannot|can't|couldn't|could not|"
    r"unable to|out of memory|no such file|permission denied|aborted|segmentation fault)\b",
    re.IGNORECASE,
)
#: An HTTP access log line (``"POST /v1/… HTTP/1.1" 500 Internal Server Error``):
#: a request's outcome, not the engine's.
_ACCESS_LINE: Final = re.compile(r'HTTP/\d(?:\.\d)?" \d{3}\b')
#: A Python exception line: ``OSError: [Errno 98] …``, ``ValueError: …``.
_EXCEPTION_LINE: Final = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit): \S")


@attrs.frozen(kw_only=True)
class ShardLaunch:
    """Everything an adapter needs to build a shard's command lines.

    Attributes:
        replica_id: the replica this shard belongs to.
        http_port: the TCP port the engine's HTTP server listens on.
        bind_addr: the address it binds (``127.0.0.1`` for ``llmgw up``).
        model_path: a local weights file (GGUF for llama.cpp); ignored by sim.
        served_model_name: the model name the engine answers to.
        api_key: the engine key; empty means keyless (with a warning).
        gpu_indices: the cards given to this shard; empty on CPU.
        context_tokens: the context window per slot times slots (``--ctx-size``).
        slots: parallel sequences (``--parallel``).
        cpu_cores: threads for CPU engines; 0 lets the engine decide.
        args: extra, already vetted, engine arguments.
        env: extra, already vetted, environment variables.
        revision: the commit a Hugging Face id in ``model_path`` is pinned to,
            for engines that download by id (vLLM's ``--revision``); "" for a
            local path.
    """

    replica_id: str
    http_port: int
    bind_addr: str = "127.0.0.1"
    model_path: str = ""
    served_model_name: str
    api_key: str = ""
    gpu_indices: tuple[int, ...] = ()
    context_tokens: int = 4096
    slots: int = 4
    cpu_cores: int = 0
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict)
    revision: str = ""


@attrs.frozen(kw_only=True)
class Command:
    """One process to start for a shard: ``[path, *args]`` with ``env`` added
    to the agent's environment."""

    name: str
    path: str
    args: tuple[str, ...]
    env: Mapping[str, str]

    @property
    def argv(self) -> list[str]:
        return [self.path, *self.args]


class EngineAdapter(Protocol):
    """What the agent needs to know about one kind of engine."""

    @property
    def name(self) -> str: ...

    def health_path(self) -> str:
        """The HTTP path the readiness probe GETs with the engine key."""
        ...

    def metrics_path(self) -> str:
        """The Prometheus path, scraped with the engine key."""
        ...

    def commands(self, shard: ShardLaunch) -> list[Command]:
        """The processes that run ``shard``; the key is in ``env`` only."""
        ...

    def failure_cause(self, lines: Sequence[str]) -> str:
        """The cause of a failed start or a death, from the engine's output
        ``lines`` (oldest first), as one line in the engine's own words
        (at most :data:`MAX_CAUSE_CHARS`); ``""`` when no line reports an
        error. Adapters without engine-specific knowledge return
        :func:`error_line`."""
        ...


def cuda_visible_devices(gpu_indices: tuple[int, ...]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for ``gpu_indices``: ``"0,2"``; ``""`` (no card
    visible) when the tuple is empty."""
    return ",".join(str(index) for index in gpu_indices)


def engine_env(shard: ShardLaunch, key_variable: str) -> dict[str, str]:
    """The environment a shard's engine process gets on top of the agent's.

    ``shard.env`` (already vetted), then what the agent owns, which wins:
    ``CUDA_VISIBLE_DEVICES`` from ``gpu_indices`` and, when the shard has a
    key, ``key_variable`` set to it. A keyless shard gets no key variable at
    all, because engines treat an empty but present key variable as set.
    """
    env = dict(shard.env)
    env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(shard.gpu_indices)
    if shard.api_key:
        env[key_variable] = shard.api_key
    else:
        env.pop(key_variable, None)
    return env


def body_says_ready(body: bytes) -> bool:
    """Whether a 200 health body means ready.

    A JSON object whose ``status`` is in :data:`NOT_READY_STATUSES` is not
    ready; any other body, JSON or not (``OK``), is.
    """
    try:
        doc = orjson.loads(body[:MAX_HEALTH_BODY_BYTES])
    except orjson.JSONDecodeError:
        return True
    if isinstance(doc, dict):
        status = doc.get("status")
        if isinstance(status, str) and status.lower() in NOT_READY_STATUSES:
            return False
    return True


def short(text: str) -> str:
    """``text`` stripped, cut to :data:`MAX_CAUSE_CHARS` characters (ending in ``…`` when cut)."""
    text = text.strip()
    if len(text) <= MAX_CAUSE_CHARS:
        return text
    return text[: MAX_CAUSE_CHARS - 1].rstrip() + "…"


def error_line(lines: Sequence[str]) -> str:
    """The generic cause picker: the first line of ``lines`` (oldest first)
    that reports an error, stripped and cut (:func:`short`); ``""`` when none.

    A line reports an error when it holds an error word (``error``,
    ``failed``, ``cannot``, ``out of memory``, …). Indented lines (a
    traceback's frames and source, continuations) and HTTP access lines (a
    request's ``500 Internal Server Error``) are skipped; when a Python
    traceback is in the output, its exception line (``OSError: …``) wins, as
    it is the cause the frames lead to.
    """
    first = ""
    for line in lines:
        if not line or line[0].isspace() or _ACCESS_LINE.search(line):
            continue
        if _EXCEPTION_LINE.match(line):
            return short(line)
        if not first and _ERROR_WORDS.search(line):
            first = line
    return short(first)


@runtime_checkable
class ReadyByModelList(Protocol):
    """An adapter whose engine is ready only once ``GET models_path()`` (with
    the key) lists the served model name (:func:`lists_model`), after its
    health path answered (vLLM)."""

    def models_path(self) -> str: ...


def lists_model(body: bytes, served_model_name: str) -> bool:
    """Whether a ``/v1/models`` answer ``body`` (OpenAI's ``{"object": "list",
    "data": [{"id": NAME, …}]}``) lists ``served_model_name``; False for
    anything else (not JSON, another shape, another name)."""
    try:
        doc = orjson.loads(body[:MAX_HEALTH_BODY_BYTES])
    except orjson.JSONDecodeError:
        return False
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return False
    return any(isinstance(m, dict) and m.get("id") == served_model_name for m in data)

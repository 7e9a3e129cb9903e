"""llama.cpp: the adapter, and a launcher that runs llama.cpp in-process.

:class:`LlamaCppAdapter` starts either a configured ``llama-server`` binary or,
when there is none, the bundled launcher ``python -m llmgw.engines.llamacpp``
with the same flags. The launcher (:func:`main`) builds
``xllamacpp.CommonParams`` from those flags and runs ``xllamacpp.Server``,
which is llama.cpp's own C++ HTTP server inside this process, until SIGTERM
or SIGINT.

The key travels in ``LLAMA_API_KEY`` only, never on the command line.

:meth:`LlamaCppAdapter.failure_cause` names why llama.cpp failed, from its
output: llama.cpp's first error line (``0.00.003.560 E gguf_init_from_reader:
invalid magic characters …``) becomes ``llama.cpp: failed to load model:
invalid magic characters …``; the launcher's own errors (``llama.cpp
launcher: error: …``) come next; then :func:`~llmgw.engines.base.error_line`.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from llmgw.engines.base import Command, ShardLaunch, engine_env, error_line, short

__all__ = [
    "KEY_ENV",
    "STOP_TIMEOUT",
    "LlamaCppAdapter",
    "common_params",
    "failure_cause",
    "main",
    "parse_args",
]

#: The environment variable llama.cpp (and the launcher) read the key from.
KEY_ENV = "LLAMA_API_KEY"

#: Seconds an idle server gets to stop before the launcher exits with code 1.
STOP_TIMEOUT = 10.0

_PREFIX = "llama.cpp launcher:"
#: How the launcher's own error lines begin.
_ERROR_PREFIX = f"{_PREFIX} error: "
#: What the launcher says when ``xllamacpp.Server`` raised: llama.cpp's
#: generic message; its error lines above say why.
_DID_NOT_START = f"{_ERROR_PREFIX}the server did not start: "

#: A llama.cpp log line at level E: ``0.00.003.560 E gguf_init_from_reader: msg``,
#: ``0.00.003.787 E cmn  common_init_: msg``, ``… E srv    load_model: msg``
#: (time, level, an optional short tag, the function, the message).
_LLAMA_ERROR: Final = re.compile(
    r"^\d+(?:\.\d+)+ E (?:[a-z]{2,5} +(?=\S+: ))?(?:(?P<func>[\w:~<>()]+): )?(?P<message>.*)$"
)
#: Functions whose error lines are about one request (``send_error: task id
#: = 7, error: the request exceeds the available context size``), not the server.
_REQUEST_ERRORS: Final = frozenset({"send_error"})
#: Messages that say llama.cpp could not load the model file.
_LOAD_FAILED: Final = re.compile(r"failed to load model|error loading model")


# -- the adapter --------------------------------------------------------------


@attrs.frozen
class LlamaCppAdapter:
    """The :class:`~llmgw.engines.base.EngineAdapter` for llama.cpp.

    Args:
        bin: a ``llama-server`` binary; None runs the bundled launcher with
            ``python`` (this interpreter by default).
    """

    bin: str | None = None
    python: str = sys.executable

    @property
    def name(self) -> str:
        return "llamacpp"

    def health_path(self) -> str:
        return "/health"

    def metrics_path(self) -> str:
        return "/metrics"

    def failure_cause(self, lines: Sequence[str]) -> str:
        """See :func:`failure_cause`."""
        return failure_cause(lines)

    def commands(self, shard: ShardLaunch) -> list[Command]:
        """One process: ``[bin, -m, model, --host, …, --port, …, --ctx-size, …,
        --parallel, …, --metrics, (--threads, cores), *args]``, or the same
        flags after ``python -m llmgw.engines.llamacpp``.

        ``env`` holds ``LLAMA_API_KEY`` (when the shard has a key) and
        ``CUDA_VISIBLE_DEVICES`` (``""`` without cards).
        """
        flags = [
            "-m",
            shard.model_path,
            "--host",
            shard.bind_addr,
            "--port",
            str(shard.http_port),
            "--ctx-size",
            str(shard.context_tokens),
            "--parallel",
            str(shard.slots),
            "--metrics",
            # The name answers carry in `model` and /v1/models lists; without
            # it llama.cpp shows the GGUF's path. Set here only: a profile's
            # own --alias is refused.
            "--alias",
            shard.served_model_name,
        ]
        if shard.cpu_cores > 0:
            flags += ["--threads", str(shard.cpu_cores)]
        flags += shard.args
        env = engine_env(shard, KEY_ENV)
        if self.bin:
            return [Command(name="llama-server", path=self.bin, args=tuple(flags), env=env)]
        args = ("-m", "llmgw.engines.llamacpp", *flags)
        return [Command(name="llama-server", path=self.python, args=args, env=env)]


def failure_cause(lines: Sequence[str]) -> str:
    """Why llama.cpp (a ``llama-server`` or the launcher) failed, from its
    output ``lines`` (oldest first); ``""`` when no line reports an error.

    In order: llama.cpp's first error line (level ``E``; one request's
    ``send_error`` lines do not count) as ``llama.cpp: MESSAGE``, where a
    model that did not load reads ``llama.cpp: failed to load model: WHY`` (``invalid magic characters: 'x???', expected
    'GGUF'``, ``tensor '…' data is not within the file bounds, model is
    corrupted or incomplete``); else the launcher's first error (``llama.cpp
    launcher: error: unsupported flag(s) --x …``) other than its generic
    "the server did not start"; else :func:`~llmgw.engines.base.error_line`
    (a ``llama-server`` binary's ``error: invalid argument: --x``, a Python
    traceback's exception). At most :data:`~llmgw.engines.base.MAX_CAUSE_CHARS`.
    """
    kept: list[str] = []  # without one request's errors
    messages: list[str] = []  # llama.cpp's error messages
    for line in lines:
        m = _LLAMA_ERROR.match(line)
        if m is None:
            kept.append(line)
        elif m["func"] not in _REQUEST_ERRORS:
            kept.append(line)
            messages.append(m["message"].strip())
    if messages:
        first = messages[0]
        if any(_LOAD_FAILED.search(message) for message in messages):
            first = first.removeprefix("error loading model: ")
            if not _LOAD_FAILED.search(first):
                first = f"failed to load model: {first}"
        return short(f"llama.cpp: {first}")
    for line in kept:
        if line.startswith(_ERROR_PREFIX) and not line.startswith(_DID_NOT_START):
            return short(line)
    return error_line(kept)


# -- the launcher --------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's signature is NoReturn
        self.print_usage(sys.stderr)
        self.exit(2, f"{_ERROR_PREFIX}{message}\n")


def _int32(text: str) -> int:
    """An integer flag's value: llama.cpp holds them in 32-bit ints.

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of that range.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{value} is out of range (at most {2**31 - 1})")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m llmgw.engines.llamacpp",
        description="Run llama.cpp's HTTP server in this process (xllamacpp) with a "
        f"subset of llama-server's flags. The key comes from {KEY_ENV}.",
        allow_abbrev=False,  # llama-server takes no abbreviations either
    )
    add = parser.add_argument
    add("-m", "--model", required=True, metavar="FILE", help="the GGUF file")
    add("--host", default="127.0.0.1")
    add("--port", type=_int32, default=8080)
    add("-c", "--ctx-size", type=_int32, default=4096, metavar="N", help="context, all slots")
    add("-np", "--parallel", type=_int32, default=1, metavar="N", help="slots")
    add("-t", "--threads", type=_int32, default=0, metavar="N", help="0: llama.cpp decides")
    add("-tb", "--threads-batch", type=_int32, default=0, metavar="N", help="0: as --threads")
    add("--threads-http", type=_int32, default=0, metavar="N")
    add("-b", "--batch-size", type=_int32, default=0, metavar="N", help="0: llama.cpp's default")
    add("-ub", "--ubatch-size", type=_int32, default=0, metavar="N", help="0: llama.cpp's default")
    add("--metrics", action="store_true", help="serve /metrics")
    add("-a", "--alias", default="", metavar="NAME", help="the model name answers carry")
    add("--chat-template", default="", metavar="NAME")
    add("--jinja", dest="jinja", action="store_true", default=None)
    add("--no-jinja", dest="jinja", action="store_false")
    add(
        "-r",
        "--reverse-prompt",
        dest="reverse_prompts",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop the answer at TEXT when a request gives no stop of its own (repeatable)",
    )
    add("-cram", "--cache-ram", type=_int32, default=None, metavar="MIB")
    add("--embedding", "--embeddings", dest="embedding", action="store_true")
    add(
        "--pooling",
        choices=("none", "mean", "cls", "last", "rank"),
        default=None,
        help="how embeddings pool the tokens (OpenAI's API needs one other than none)",
    )
    add("-ngl", "--gpu-layers", "--n-gpu-layers", type=_int32, default=None, metavar="N")
    add("--no-webui", action="store_true")
    add("--no-warmup", action="store_true")
    add("-lv", "--verbosity", "--log-verbosity", type=_int32, default=None, metavar="N")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the launcher's llama-server flags.

    Exits with code 2 and a message naming the flag on an unknown or bad flag.
    """
    parser = _parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(
            f"unsupported flag(s) {' '.join(unknown)}: the bundled launcher understands only "
            "the llama-server flags in --help; configure a llama-server binary for others"
        )
    return ns


def common_params(ns: argparse.Namespace, api_key: str) -> Any:
    """``xllamacpp.CommonParams`` for parsed flags and a key (``""``: keyless).

    Raises:
        ImportError: xllamacpp is not installed.
    """
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = ns.model
    params.hostnames = [ns.host]
    params.port = ns.port
    params.n_ctx = ns.ctx_size
    params.n_parallel = ns.parallel
    params.endpoint_metrics = ns.metrics
    if ns.alias:
        params.model_alias = {ns.alias}
    if api_key:
        params.api_keys = [api_key]
    if ns.threads > 0:
        params.cpuparams.n_threads = ns.threads
        params.cpuparams_batch.n_threads = ns.threads
    if ns.threads_batch > 0:
        params.cpuparams_batch.n_threads = ns.threads_batch
    if ns.threads_http > 0:
        params.n_threads_http = ns.threads_http
    if ns.batch_size > 0:
        params.n_batch = ns.batch_size
    if ns.ubatch_size > 0:
        params.n_ubatch = ns.ubatch_size
    if ns.chat_template:
        params.chat_template = ns.chat_template
    if ns.jinja is not None:
        params.use_jinja = ns.jinja
    if ns.reverse_prompts:
        params.antiprompt = list(ns.reverse_prompts)
    if ns.cache_ram is not None:
        params.cache_ram_mib = ns.cache_ram
    if ns.embedding:
        params.embedding = True
    if ns.pooling is not None:
        params.pooling_type = getattr(
            xllamacpp.llama_pooling_type, f"LLAMA_POOLING_TYPE_{ns.pooling.upper()}"
        )
    if ns.gpu_layers is not None:
        params.n_gpu_layers = ns.gpu_layers
    if ns.no_webui:
        params.ui = False
    if ns.no_warmup:
        params.warmup = False
    if ns.verbosity is not None:
        params.verbosity = ns.verbosity
    return params


def _say(message: str) -> None:
    print(f"{_PREFIX} {message}", flush=True)


def _requests_in_flight(server: Any) -> int | None:
    """Requests processing or deferred, from llama.cpp's metrics; None when
    unknown (the server runs without ``--metrics``)."""
    try:
        text: str = server.handle_metrics()
    except Exception:
        return None
    names = ("llamacpp:requests_processing ", "llamacpp:requests_deferred ")
    values = [float(line.split()[1]) for line in text.splitlines() if line.startswith(names)]
    return int(sum(values)) if len(values) == len(names) else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run llama.cpp's server until SIGTERM or SIGINT.

    Prints progress lines to stdout (``… listening on http://H:P`` once the
    model is loaded). After a signal an idle server is stopped in order
    (``~Server``) and 0 returned; with requests in flight, or when that
    takes over :data:`STOP_TIMEOUT`, the process exits at once (codes 0 and
    1), which closes the port too. Returns 1 when the model file is missing
    or the server fails to start; exits 2 on a bad flag. A signal that comes
    while the model loads is acted on once loading ends (xllamacpp holds the
    GIL while loading).
    """
    ns = parse_args(argv)
    if not Path(ns.model).is_file():
        print(f"{_ERROR_PREFIX}no model file {ns.model}", file=sys.stderr, flush=True)
        return 1
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    # Block the stop signals before llama.cpp starts its threads (they inherit
    # the mask), so they stay pending until sigwait takes them below.
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    import xllamacpp

    params = common_params(ns, os.environ.get(KEY_ENV, ""))
    threads = ns.threads or "auto"
    _say(
        f"xllamacpp {xllamacpp.__version__}: loading {ns.model} "
        f"(ctx {ns.ctx_size}, parallel {ns.parallel}, threads {threads})"
    )
    try:
        server = xllamacpp.Server(params)
    except Exception as error:
        print(f"{_DID_NOT_START}{error}", file=sys.stderr, flush=True)
        return 1
    _say(f"listening on {server.listening_address}")
    signum = signal.sigwait(stop_signals)
    busy = _requests_in_flight(server)
    if busy != 0:
        # llama.cpp's shutdown waits for open streams to notice it (up to
        # sse_ping_interval, 30 s) while holding the GIL; exiting closes the
        # port at once, and there is nothing to save.
        what = "unknown requests" if busy is None else f"{busy} request(s)"
        _say(f"{signal.Signals(signum).name}: {what} in flight; exiting without waiting")
        os._exit(0)
    _say(f"{signal.Signals(signum).name}: stopping")
    # A watchdog that needs no GIL (the destructor holds it): exit code 1.
    faulthandler.dump_traceback_later(STOP_TIMEOUT, exit=True)
    # xllamacpp.Server has no stop method: dropping the last reference runs
    # ~Server, which stops the HTTP listener and joins llama.cpp's threads.
    del server
    faulthandler.cancel_dump_traceback_later()
    _say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

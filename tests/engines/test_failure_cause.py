"""The engines' failure-cause pickers, on output captured from real runs.

The llama.cpp excerpts are what ``python -m llmgw.engines.llamacpp`` (xllamacpp
2026.10.11549, CPU) printed for each case, shortened (``…``) to the lines that
matter plus the launcher's generic last line.
"""

from __future__ import annotations

import pytest

from llmgw.engines.base import MAX_CAUSE_CHARS, error_line
from llmgw.engines.llamacpp import LlamaCppAdapter, failure_cause, parse_args
from llmgw.engines.sim.adapter import SimAdapter

LOADING = (
    "llama.cpp launcher: xllamacpp 2026.10.11549: loading /tmp/m.gguf "
    "(ctx 4096, parallel 1, threads auto)"
)
GENERIC = (
    "llama.cpp launcher: error: the server did not start: "
    "Failed to init server, please check the input params."
)

#: A file of random bytes given as the model.
RANDOM_BYTES = (
    LOADING,
    "0.00.000.226 I srv          init: initializing ...",
    "0.00.001.919 W srv          init: security: no API key is set and CORS allows all "
    "origins (see https://github.com/ggml-org/llama.cpp/pull/25655)",
    "0.00.003.485 I srv    load_model: loading model '/tmp/m.gguf'",
    "0.00.003.560 E gguf_init_from_reader: invalid magic characters: 'x???', expected 'GGUF'",
    "0.00.003.681 E llama_model_load: error loading model: llama_model_loader: "
    "failed to load model from /tmp/m.gguf",
    "0.00.003.694 E llama_model_load_from_file_impl: failed to load model",
    "0.00.003.787 E cmn  common_init_: failed to load model '/tmp/m.gguf'",
    "0.00.003.798 E srv    load_model: failed to load model, '/tmp/m.gguf'",
    "0.00.003.810 I srv    operator(): operator(): cleaning up before exit...",
    "0.00.004.064 E srv          init: exiting due to model loading error",
    GENERIC,
)

#: The starter GGUF cut in half.
TRUNCATED = (
    LOADING,
    "0.00.003.485 I srv    load_model: loading model '/tmp/m.gguf'",
    "0.00.063.067 E llama_model_load: error loading model: tensor 'token_embd.weight' data "
    "is not within the file bounds, model is corrupted or incomplete",
    "0.00.063.085 E llama_model_load_from_file_impl: failed to load model",
    "0.00.111.290 E cmn  common_init_: failed to load model '/tmp/m.gguf'",
    "0.00.111.765 E srv          init: exiting due to model loading error",
    GENERIC,
)

#: ``--ctx-size 50000000`` under ``ulimit -v 3000000``: the context does not fit.
OUT_OF_MEMORY = (
    LOADING,
    "0.06.396.801 W common_fit_params: failed to fit params to free device memory: was "
    "unable to fit model into system memory by reducing context, abort",
    "0.06.908.157 W llama_context: n_ctx_seq (50000128) > n_ctx_train (32768) -- possible "
    "training context overflow",
    "0.07.631.367 E llama_init_from_model: failed to initialize the context: std::bad_alloc",
    "0.07.631.394 E cmn  common_init_: failed to create context with model '/tmp/m.gguf'",
    "0.07.631.398 E srv    load_model: failed to create_context with model '/tmp/m.gguf'",
    "0.07.631.792 E srv          init: exiting due to model loading error",
    GENERIC,
)

#: Another process holds the port.
PORT_IN_USE = (
    LOADING,
    "0.00.005.557 W srv          init: security: no API key is set and CORS allows all "
    "origins (see https://github.com/ggml-org/llama.cpp/pull/25655)",
    "0.00.005.657 E srv         start: couldn't bind HTTP server socket, hostname: "
    "127.0.0.1, port: 18127",
    "0.00.005.748 E srv          init: exiting due to HTTP server error",
    GENERIC,
)

#: A flag the bundled launcher does not know (argparse's usage, then its error).
UNKNOWN_FLAG = (
    "usage: python -m llmgw.engines.llamacpp [-h] -m FILE [--host HOST]",
    "                                        [--port PORT] [-c N] [-np N] [-t N]",
    "llama.cpp launcher: error: unsupported flag(s) --frobnicate 3: the bundled launcher "
    "understands only the llama-server flags in --help; configure a llama-server binary "
    "for others",
)

#: A context of more tokens than the model was trained on is not a failure:
#: llama.cpp warns and caps the slot context (``--ctx-size 131072``).
CONTEXT_OVER_TRAINING = (
    LOADING,
    "0.01.011.280 W llama_context: n_ctx_seq (131072) > n_ctx_train (32768) -- possible "
    "training context overflow",
    "0.01.205.781 W srv    load_model: the slot context (131072) exceeds the training "
    "context of the model (32768) - capping",
    "0.01.234.943 I srv          init: listening on http://127.0.0.1:18124",
    "llama.cpp launcher: listening on http://127.0.0.1:18124",
)


@pytest.mark.parametrize(
    ("lines", "cause"),
    [
        pytest.param(
            RANDOM_BYTES,
            "llama.cpp: failed to load model: invalid magic characters: 'x???', expected 'GGUF'",
            id="random-bytes",
        ),
        pytest.param(
            TRUNCATED,
            "llama.cpp: failed to load model: tensor 'token_embd.weight' data is not within "
            "the file bounds, model is corrupted or incomplete",
            id="truncated",
        ),
        pytest.param(
            OUT_OF_MEMORY,
            "llama.cpp: failed to initialize the context: std::bad_alloc",
            id="out-of-memory",
        ),
        pytest.param(
            PORT_IN_USE,
            "llama.cpp: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 18127",
            id="port-in-use",
        ),
        pytest.param(UNKNOWN_FLAG, UNKNOWN_FLAG[-1], id="unknown-flag"),
        pytest.param(CONTEXT_OVER_TRAINING, "", id="context-over-training-is-no-error"),
        pytest.param(
            ("llama.cpp launcher: error: no model file /tmp/gone.gguf",),
            "llama.cpp launcher: error: no model file /tmp/gone.gguf",
            id="no-model-file",
        ),
        pytest.param((LOADING, GENERIC), GENERIC, id="only-the-generic-line"),
        pytest.param((), "", id="no-output"),
        pytest.param(
            (  # built from the format string in xllamacpp's library, not captured
                "0.12.000.001 E srv    send_error: task id = 7, error: the request exceeds the "
                "available context size, try increasing it",
                "0.12.000.002 I srv  log_server_r: request: POST /v1/completions 127.0.0.1 400",
            ),
            "",
            id="one-requests-error-is-no-cause",
        ),
    ],
)
def test_llamacpp_names_the_cause_as_llamacpp_wrote_it(lines: tuple[str, ...], cause: str) -> None:
    assert failure_cause(lines) == cause
    assert LlamaCppAdapter().failure_cause(lines) == cause


def test_llamacpp_falls_back_to_the_generic_picker() -> None:
    """A ``llama-server`` binary's own flag error, a launcher traceback."""
    assert failure_cause(["error: invalid argument: --frobnicate"]) == (
        "error: invalid argument: --frobnicate"
    )
    traceback = [
        "Traceback (most recent call last):",
        '  File "/x/llamacpp.py", line 181, in common_params',
        "    params.n_ctx = ns.ctx_size",
        "OverflowError: value too large to convert to int32_t",
    ]
    assert failure_cause(traceback) == "OverflowError: value too large to convert to int32_t"


def test_the_launcher_refuses_a_flag_value_llamacpp_cannot_hold(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--ctx-size 5000000000`` was a traceback (an OverflowError in
    xllamacpp); now it is a launcher error naming the flag, exit code 2."""
    with pytest.raises(SystemExit) as exited:
        parse_args(["-m", "x.gguf", "--ctx-size", "5000000000"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert failure_cause(err) == (
        "llama.cpp launcher: error: argument -c/--ctx-size: 5000000000 is out of range "
        "(at most 2147483647)"
    )


@pytest.mark.parametrize(
    ("lines", "cause"),
    [
        pytest.param(
            [
                "INFO:     Started server process [4242]",
                "ERROR:    [Errno 98] error while attempting to bind on address "
                "('127.0.0.1', 8080): address already in use",
                "INFO:     Waiting for application shutdown.",
            ],
            "ERROR:    [Errno 98] error while attempting to bind on address "
            "('127.0.0.1', 8080): address already in use",
            id="first-error-line",
        ),
        pytest.param(
            [
                "sim: loading",
                "Traceback (most recent call last):",
                '  File "/x/errors.py", line 3, in <module>',
                "    raise ValueError('bad --slots')",
                "ValueError: bad --slots",
            ],
            "ValueError: bad --slots",
            id="traceback-exception",
        ),
        pytest.param(["loading", "listening on 127.0.0.1:8080", ""], "", id="no-error"),
        pytest.param(
            [
                'INFO:     127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server '
                "Error"
            ],
            "",
            id="access-line-is-no-cause",
        ),
        pytest.param(["fatal: " + "x" * 1000], "fatal: " + "x" * 292 + "…", id="cut"),
    ],
)
def test_the_generic_picker(lines: list[str], cause: str) -> None:
    assert error_line(lines) == cause
    assert SimAdapter().failure_cause(lines) == cause
    assert len(cause) <= MAX_CAUSE_CHARS

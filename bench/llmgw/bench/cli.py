"""``llmgw bench …``: the benchmark commands, as one click group.

- ``load``: streamed chat completions against any OpenAI-compatible server
  (:mod:`llmgw.bench.load`);
- ``overhead``: the latency and CPU the gateway adds over the sim engine, at
  rising rates (:mod:`llmgw.bench.overhead`);
- ``gateway``: the gateway alone in front of one engine, the process
  ``overhead`` starts (:mod:`llmgw.bench.gateway`);
- ``compare``: the engine alone, llmgw and an outside gateway side by side,
  alternated (:mod:`llmgw.bench.compare`);
- ``engine``: the sim engine on the gateway's lean HTTP server, cheap enough
  not to be a benchmark's limit (:mod:`llmgw.bench.engine`).

The ``llmgw`` command mounts :data:`bench` as its ``bench`` group. The
gateway module, which pulls in the whole gateway, is imported only when a
command needs it.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson
import trio

from .load import LoadConfig, run_load
from .overhead import DEFAULT_DURATION_S, DEFAULT_RATES, DEFAULT_WARMUP_S, SATURATION_CONCURRENCY
from .results import format_result

#: ``--json`` (passed as ``as_json``), the same option as the product CLI's.
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON.")

if TYPE_CHECKING:
    from .overhead import OverheadRow

__all__ = ["bench"]


@click.group()
def bench() -> None:
    """Benchmarks: what the gateway adds, and load against any OpenAI server."""


@bench.command("load")
@click.option("--url", required=True, help="The server, http://HOST:PORT.")
@click.option("--key", default="", help="API key (Bearer); none when empty.")
@click.option("--model", default="gemma-3-270m", show_default=True, help="The model asked for.")
@click.option("--concurrency", type=click.IntRange(min=1), help="Closed loop: this many clients.")
@click.option(
    "--rate", type=click.FloatRange(min=0, min_open=True), help="Open loop: requests/s offered."
)
@click.option("--duration-s", default=10.0, show_default=True, help="Measured seconds.")
@click.option("--warmup-s", default=1.0, show_default=True, help="Unmeasured seconds first.")
@click.option("--prompt-words", default=16, show_default=True, help="Words per user message.")
@click.option("--max-tokens", default=64, show_default=True, help="max_tokens of each request.")
@click.option(
    "--timeout-s", default=30.0, show_default=True, help="Deadline of each request, in seconds."
)
@click.option(
    "--extra-body",
    default="{}",
    show_default=True,
    help="More JSON fields of each request, e.g. '{\"ignore_eos\": true}'.",
)
@_JSON
def load_command(
    url: str,
    key: str,
    model: str,
    concurrency: int | None,
    rate: float | None,
    duration_s: float,
    warmup_s: float,
    prompt_words: int,
    max_tokens: int,
    timeout_s: float,
    extra_body: str,
    as_json: bool,
) -> None:
    """Streamed chat completions against an OpenAI-compatible server.

    Give --concurrency N (closed loop: N clients back to back) or --rate R
    (open loop: R requests/s on a fixed schedule). A closed-loop client
    answered 429 or 503 waits the answer's Retry-After (else 1 s) before
    its next request. Exits 1 when no request succeeded.
    """
    if (concurrency is None) == (rate is None):
        raise click.UsageError("give one of --concurrency and --rate")
    try:
        extra = orjson.loads(extra_body)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--extra-body") from None
    if not isinstance(extra, dict):
        raise click.BadParameter("give a JSON object", param_hint="--extra-body")
    try:
        config = LoadConfig(
            url=url,
            api_key=key,
            model=model,
            concurrency=concurrency,
            rate_per_s=rate,
            duration_s=duration_s,
            warmup_s=warmup_s,
            prompt_words=prompt_words,
            max_tokens=max_tokens,
            request_timeout_s=timeout_s,
            extra_body=extra,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = trio.run(run_load, config)
    if as_json:
        click.echo(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(format_result(result))
    if result.requests == 0:
        raise SystemExit(1)


@bench.command("overhead")
@click.option(
    "--rates",
    default=",".join(f"{r:g}" for r in DEFAULT_RATES),
    show_default=True,
    help="Offered requests/s, rising, comma-separated.",
)
@click.option("--modes", default="bare,accounted", show_default=True, help="Gateway modes.")
@click.option(
    "--duration-s", default=DEFAULT_DURATION_S, show_default=True, help="Measured seconds per run."
)
@click.option(
    "--warmup-s", default=DEFAULT_WARMUP_S, show_default=True, help="Unmeasured seconds per run."
)
@click.option("--no-pin", is_flag=True, help="Do not pin the gateway and the engine to cores.")
@click.option(
    "--half-saturation",
    is_flag=True,
    help="Instead of --rates: one rate, half what the engine alone serves closed-loop "
    "(measured first).",
)
@click.option(
    "--saturation-concurrency",
    type=click.IntRange(min=1, max=1024),
    default=SATURATION_CONCURRENCY,
    show_default=True,
    help="Streams of the closed-loop run that finds the engine's saturation.",
)
@_JSON
def overhead_command(
    rates: str,
    modes: str,
    duration_s: float,
    warmup_s: float,
    no_pin: bool,
    half_saturation: bool,
    saturation_concurrency: int,
    as_json: bool,
) -> None:
    """Latency and CPU the gateway adds over the sim engine, at rising rates.

    About a minute with the defaults. Differences within the measured noise
    show as ~0 (±x ms). Ctrl-C stops it: the rows measured so far are
    printed (with --json too, marked "interrupted") and it exits 130.
    --half-saturation measures one rate, half the engine's closed-loop
    requests/s (the added TTFT at half saturation), and says which.
    """
    from .gateway import MODES
    from .overhead import LEGEND, format_rows, run_overhead

    try:
        rate_list = [float(r) for r in rates.split(",") if r.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{rates!r} is not a list of numbers", param_hint="--rates"
        ) from None
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for mode in mode_list:
        if mode not in MODES:
            raise click.BadParameter(
                f"{mode!r}: choose from {', '.join(MODES)}", param_hint="--modes"
            )
    rows: list[OverheadRow] = []
    notes: list[str] = []

    def show(row: OverheadRow) -> None:
        rows.append(row)
        if not as_json:
            click.echo(format_rows([row]).splitlines()[1], err=True)

    def note(text: str) -> None:
        notes.append(text)
        if not as_json:
            click.echo(text, err=True)

    if not as_json:
        click.echo(format_rows([]), err=True)
    interrupted = trio.run(
        until_interrupted,
        lambda: run_overhead(
            rates=rate_list,
            modes=mode_list,
            duration_s=duration_s,
            warmup_s=warmup_s,
            pin=not no_pin,
            on_row=show,
            on_note=note,
            half_saturation=half_saturation,
            saturation_concurrency=saturation_concurrency,
        ),
    )
    if as_json:
        doc: dict[str, Any] = {"rows": [row.to_json() for row in rows], "notes": notes}
        if half_saturation and rows:
            doc["half_saturation_per_s"] = rows[0].rate_per_s
        if interrupted:
            doc["interrupted"] = True
        _print_json(doc)
    else:
        click.echo(LEGEND, err=True)
    if interrupted:
        click.echo(f"interrupted: {len(rows)} row(s) measured, shown above", err=True)
        raise SystemExit(130)


@bench.command("guard")
@click.option("--seconds", default=0.5, show_default=True, help="CPU seconds per figure.")
@_JSON
def guard_command(seconds: float, as_json: bool) -> None:
    """CPU time of the guard's matcher: per KiB of prompt, per streamed answer."""
    from .guard import run_bench_guard

    rows = run_bench_guard(seconds)
    if as_json:
        click.echo(orjson.dumps(rows).decode())
        return
    click.echo(f"{'what':44}  {'policy':8}  {'CPU µs':>9}")
    for row in rows:
        click.echo(f"{row['what']:44}  {row['policy']:8}  {row['us']:9.1f}")


@bench.command("gateway")
@click.option("--engine-url", required=True, help="The engine, http://HOST:PORT.")
@click.option(
    "--engine-key",
    default="",
    help="The engine's key; empty (the default) sends none, for an engine without a key.",
)
@click.option("--model", required=True, help="The model name the engine serves.")
@click.option(
    "--mode",
    type=click.Choice(["bare", "accounted", "unguarded", "observe", "portal"]),
    default="accounted",
    show_default=True,
    help="bare: the key checked, no accounting; accounted: limits, budgets and usage rows"
    " too, and the baseline guard; unguarded: accounted with the guard off; observe:"
    " accounted under the observe guard policy; portal: accounted behind the pages'"
    " prefix dispatch, as on llmgw up's client port.",
)
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="HOST:PORT.")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Where its store and usage journal go.",
)
@click.option(
    "--store",
    "store_address",
    default=None,
    metavar="ADDRESS",
    help="A PostgreSQL address for the store (keys, usage rows) instead of SQLite in "
    "--data-dir; the usage journal stays in --data-dir.",
)
def gateway_command(
    engine_url: str,
    engine_key: str,
    model: str,
    mode: str,
    listen: str,
    data_dir: Path,
    store_address: str | None,
) -> None:
    """The gateway alone in front of one engine (started by `bench overhead`)."""
    from .gateway import run_bench_gateway

    trio.run(
        lambda: run_bench_gateway(
            engine_url=engine_url,
            engine_key=engine_key,
            model=model,
            listen=listen,
            mode=mode,
            data_dir=data_dir,
            store_address=store_address,
        )
    )


async def until_interrupted(run: Callable[[], Awaitable[object]]) -> bool:
    """Await ``run()`` until it returns or SIGINT comes (a Ctrl-C): then it
    is cancelled and left to clean up, later SIGINTs being ignored. Returns
    True when interrupted."""
    interrupted = False
    work = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal interrupted
                async for _ in signals:
                    interrupted = True
                    work.cancel()

            nursery.start_soon(watch)
            with work:
                await run()
            nursery.cancel_scope.cancel()
    return interrupted


def _print_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True))


@bench.command(
    "engine",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("sim_args", nargs=-1, type=click.UNPROCESSED)
def engine_command(sim_args: tuple[str, ...]) -> None:
    """The sim engine on the gateway's own HTTP server (the sim's flags;
    `--help` lists them): cheaper per request than `python -m
    llmgw.engines.sim`, so a benchmark shows the gateway's limit."""
    from .engine import run_bench_engine

    try:
        trio.run(run_bench_engine, sim_args)
    except KeyboardInterrupt:
        pass


class _Streams(click.ParamType[list[int]]):
    """A comma-separated list of whole numbers of at least 1."""

    name = "N[,N…]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, list):
            return value
        try:
            points = [int(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"{value!r}: comma-separated whole numbers", param, ctx)
        if not points or min(points) < 1:
            self.fail(f"{value!r}: each number of streams must be at least 1", param, ctx)
        return points


class _HttpUrl(click.ParamType[str]):
    """``http(s)://HOST:PORT[/…]``, checked before anything starts."""

    name = "URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from urllib.parse import urlsplit

        text = str(value)
        try:
            parts = urlsplit(text)
            port = parts.port
        except ValueError:
            port = None
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port:
            self.fail(f"{text!r}: expected http://HOST:PORT", param, ctx)
        return text


#: The bench gateway's modes (:data:`llmgw.bench.gateway.MODES`, not imported
#: here so that ``--help`` stays fast; a test keeps the two equal).
COMPARE_MODES = ("bare", "accounted", "unguarded", "observe", "portal")


@bench.command("compare")
@click.option(
    "--concurrency",
    type=_Streams(),
    default="16,64,128",
    show_default=True,
    help="Streams, comma-separated.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Runs of each system per point.",
)
@click.option(
    "--duration-s",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Measured seconds per run.",
)
@click.option(
    "--warmup-s",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Unmeasured seconds per run.",
)
@click.option(
    "--mode",
    type=click.Choice(COMPARE_MODES),
    default="accounted",
    show_default=True,
    help="llmgw's bench gateway mode.",
)
@click.option(
    "--engine",
    type=click.Choice(["bench", "sim"]),
    default="bench",
    show_default=True,
    help="bench: llmgw bench engine; sim: python -m llmgw.engines.sim.",
)
@click.option(
    "--engine-url", type=_HttpUrl(), default=None, help="A running engine instead (a real one)."
)
@click.option("--engine-key", default="", help="Its key.")
@click.option("--model", default="bench-model", show_default=True, help="The engine's model.")
@click.option(
    "--gateway-url",
    type=_HttpUrl(),
    default=None,
    help="An outside gateway in front of that engine.",
)
@click.option("--gateway-key", default="", help="Its key.")
@click.option("--gateway-model", default=None, help="Its name for the model (default --model).")
@click.option("--no-pin", is_flag=True, help="Do not pin llmgw and the engine to cores.")
@_JSON
def compare_command(
    concurrency: list[int],
    rounds: int,
    duration_s: float,
    warmup_s: float,
    mode: str,
    engine: str,
    engine_url: str | None,
    engine_key: str,
    model: str,
    gateway_url: str | None,
    gateway_key: str,
    gateway_model: str | None,
    no_pin: bool,
    as_json: bool,
) -> None:
    """The engine alone, llmgw and an outside gateway side by side, alternated.

    Exits 1 when a system answered no request at all (every request failed,
    connection failures included)."""
    from .compare import Outside, format_summary, run_compare, served_nothing, summarize

    points = concurrency
    outside = Outside(gateway_url, gateway_key, gateway_model or model) if gateway_url else None
    rows = trio.run(
        lambda: run_compare(
            concurrency=points,
            rounds=rounds,
            duration_s=duration_s,
            warmup_s=warmup_s,
            mode=mode,
            engine=engine,
            engine_url=engine_url,
            engine_key=engine_key,
            model=model,
            outside=outside,
            pin=not no_pin,
        )
    )
    summary = summarize(rows)
    if as_json:
        _print_json({"runs": [row.to_json() for row in rows], "summary": summary})
    else:
        click.echo(format_summary(summary))
    failed = served_nothing(rows)
    if failed:
        click.echo(f"error: no request answered by: {', '.join(failed)}", err=True)
        raise SystemExit(1)

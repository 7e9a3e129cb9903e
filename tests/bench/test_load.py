"""The load generator: its parsers on awkward byte splits, and short runs
against the sim engine and hostile fakes (light: this machine has 2 cores)."""

from __future__ import annotations

import itertools
import json
import math
import socket
from collections.abc import Awaitable, Callable, Iterator
from functools import partial

import orjson
import pytest
import trio
from click.testing import CliRunner

from llmgw.bench.cli import load_command
from llmgw.bench.load import LoadConfig, _RequestMaker, _Target, run_load
from llmgw.bench.response import (
    ChunkedDecoder,
    HttpProtocolError,
    ResponseParser,
    StreamScanner,
)
from llmgw.bench.results import LoadResult, Percentiles, format_result
from llmgw.engines.testing import open_sim

KEY = "k" * 32


def _chunk(event: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _content(text: str, *, role: bool = False) -> bytes:
    delta: dict[str, object] = {"content": text}
    if role:
        delta = {"role": "assistant", **delta}
    return _chunk({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


#: An OpenAI-style stream: an empty role chunk, 5 content chunks (one with
#: an escaped '"content":"' inside), a null-content chunk, the finish chunk,
#: the usage chunk, [DONE].
EVENTS = (
    _chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    + _content("Hello")
    + _content(' "content":"tricky"')
    + _content("a\nb")
    + _content("\n\n")
    + _content("end")
    + _chunk({"choices": [{"index": 0, "delta": {"content": None}}]})
    + _chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    + _chunk({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}})
    + b"data: [DONE]\n\n"
)


def _chunked(body: bytes, sizes: tuple[int, ...] = (1, 7, 64, 300)) -> bytes:
    """``body`` in chunked framing, chunks of the given sizes in turn, with a
    chunk extension and a trailer for good measure."""
    out = []
    at = 0
    turn = 0
    while at < len(body):
        size = sizes[turn % len(sizes)]
        piece = body[at : at + size]
        extension = b";name=value" if turn == 1 else b""
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), extension, piece))
        at += size
        turn += 1
    out.append(b"0\r\nx-trailer: yes\r\n\r\n")
    return b"".join(out)


HEAD_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"transfer-encoding:  Chunked\r\nServer: fake\r\n\r\n"
)


def _splits(data: bytes) -> Iterator[list[bytes]]:
    """``data`` cut in two at every place, then byte by byte."""
    for at in range(len(data) + 1):
        yield [data[:at], data[at:]]
    yield [data[i : i + 1] for i in range(len(data))]


# -- parsers --------------------------------------------------------------------------


def test_chunked_decoder_survives_every_split() -> None:
    body = bytes(range(256)) * 3
    wire = _chunked(body) + b"NEXT"
    for pieces in _splits(wire):
        decoder = ChunkedDecoder()
        out = b"".join(decoder.feed(piece) for piece in pieces)
        assert decoder.done
        assert out == body
        assert decoder.rest == b"NEXT"


def test_chunked_decoder_one_whole_chunk_per_read() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5\r\nhello\r\n") == b"hello"
    assert decoder.feed(b"1a\r\n" + b"z" * 26 + b"\r\n") == b"z" * 26
    assert decoder.feed(b"0\r\n\r\n") == b""
    assert decoder.done


@pytest.mark.parametrize(
    "wire", [b"zz\r\nhello\r\n", b"5\r\nhelloXX", b"-5\r\nhello\r\n", b"5 5\r\nhello\r\n"]
)
def test_chunked_decoder_refuses_bad_framing(wire: bytes) -> None:
    with pytest.raises(HttpProtocolError):
        ChunkedDecoder().feed(wire)


def test_stream_scanner_counts_content_chunks_across_every_split() -> None:
    for pieces in _splits(EVENTS):
        scanner = StreamScanner()
        for now, piece in enumerate(pieces):
            scanner.feed(piece, float(now))
        assert scanner.chunks == 5
        assert scanner.usage_tokens == 7
        assert scanner.tokens == 7
        assert not scanner.error
        assert scanner.first_at <= scanner.last_at


def test_stream_scanner_times_are_those_of_the_reads_that_completed_events() -> None:
    scanner = StreamScanner()
    first, second = _content("a"), _content("b")
    scanner.feed(first[:10], 1.0)
    scanner.feed(first[10:] + second[:-1], 2.0)  # completes "a"; "b" lacks its last newline
    scanner.feed(second[-1:], 3.0)
    assert (scanner.chunks, scanner.first_at, scanner.last_at) == (2, 2.0, 3.0)
    assert scanner.usage_tokens is None
    assert scanner.tokens == 2


def test_stream_scanner_reads_crlf_events_spaced_json_and_error_events() -> None:
    crlf = EVENTS.replace(b"\n\n", b"\r\n\r\n")
    scanner = StreamScanner()
    for byte in range(len(crlf)):
        scanner.feed(crlf[byte : byte + 1], 0.0)
    assert (scanner.chunks, scanner.usage_tokens) == (5, 7)

    spaced = b"".join(
        b"data: " + json.dumps(event).encode() + b"\n\n"
        for event in (
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "x"}}]},
            {"choices": [{"delta": {"content": "y"}}]},
            {"choices": [], "usage": {"completion_tokens": 2}},
        )
    )
    scanner = StreamScanner()
    scanner.feed(spaced, 0.0)
    assert (scanner.chunks, scanner.usage_tokens, scanner.error) == (2, 2, False)

    scanner = StreamScanner()
    scanner.feed(_content("x") + b'data: {"error":{"message":"boom"}}\n\n', 0.0)
    assert scanner.error


def _response_parse(pieces: list[bytes]) -> ResponseParser:
    parser = ResponseParser()
    done = False
    for piece in filter(None, pieces):
        assert not done, "fed past the end"
        done = parser.feed(piece, 0.0)
    assert done
    return parser


def test_response_parser_chunked_stream_split_everywhere() -> None:
    wire = HEAD_CHUNKED + _chunked(EVENTS)
    for pieces in _splits(wire):
        parser = _response_parse(pieces)
        assert parser.status == 200
        assert parser.keep_alive
        assert parser.scanner is not None
        assert (parser.scanner.chunks, parser.scanner.tokens) == (5, 7)
        assert parser.rest == b""


def test_response_parser_content_length_stream_split_everywhere() -> None:
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(EVENTS), EVENTS)
    for pieces in _splits(wire):
        parser = _response_parse(pieces)
        assert parser.scanner is not None
        assert parser.scanner.chunks == 5
    parser = _response_parse([wire + b"EXTRA"])
    assert parser.rest == b"EXTRA"


def test_response_parser_error_answers_and_bodies_until_close() -> None:
    body = b'{"error":{"message":"Invalid API Key"}}'
    wire = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    parser = _response_parse([wire])
    assert (parser.status, parser.scanner, parser.keep_alive) == (401, None, True)

    empty = _response_parse(
        [b"HTTP/1.1 429 Too Many\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"]
    )
    assert (empty.status, empty.keep_alive) == (429, False)

    parser = ResponseParser()
    assert not parser.feed(b"HTTP/1.0 200 OK\r\n\r\n" + EVENTS[:50], 0.0)
    assert not parser.feed(EVENTS[50:], 0.0)
    assert parser.ends_at_close
    assert not parser.keep_alive
    assert parser.scanner is not None
    assert parser.scanner.chunks == 5


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
    ],
)
def test_response_parser_refuses_bad_heads(head: bytes) -> None:
    with pytest.raises(HttpProtocolError):
        ResponseParser().feed(head, 0.0)


def test_percentiles() -> None:
    assert Percentiles.of([]) == Percentiles(0.0, 0.0, 0.0, 0.0)
    p = Percentiles.of([float(v) for v in range(100, 0, -1)])
    assert p.p50 == pytest.approx(50.5)
    assert p.p99 == pytest.approx(99.01)
    assert p.mean == pytest.approx(50.5)


def test_config_wants_exactly_one_shape_of_load() -> None:
    url = "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(url=url, model="m")
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(url=url, model="m", concurrency=1, rate_per_s=1.0)
    with pytest.raises(ValueError, match="http"):
        LoadConfig(url="https://127.0.0.1:9", model="m", concurrency=1)
    with pytest.raises(ValueError, match="concurrency must be"):
        LoadConfig(url=url, model="m", concurrency=0)
    with pytest.raises(ValueError, match="rate_per_s must be"):
        LoadConfig(url=url, model="m", rate_per_s=math.inf)
    with pytest.raises(ValueError, match="duration_s must be"):
        LoadConfig(url=url, model="m", concurrency=1, duration_s=math.nan)
    with pytest.raises(ValueError, match="may not set max_tokens, messages, stream"):
        LoadConfig(
            url=url,
            model="m",
            concurrency=1,
            extra_body={"stream": False, "messages": [], "max_tokens": 3},
        )


def test_extra_body_fields_are_in_every_request() -> None:
    config = LoadConfig(
        url="http://127.0.0.1:9", model="m", concurrency=1, extra_body={"ignore_eos": True}
    )
    made = _RequestMaker(config, _Target.parse(config.url)).make(7)
    head, body = made.split(b"\r\n\r\n", 1)
    assert b"content-length: %d" % len(body) in head.lower()
    doc = orjson.loads(body)
    assert doc["ignore_eos"] is True
    assert (doc["model"], doc["stream"], doc["max_tokens"]) == ("m", True, 64)
    runner = CliRunner()
    refused = runner.invoke(
        load_command, ["--url", "http://127.0.0.1:9", "--concurrency", "1", "--extra-body", "[1]"]
    )
    assert refused.exit_code == 2
    assert "give a JSON object" in refused.output


# -- runs against the sim engine ----------------------------------------------------


async def test_closed_loop_against_the_sim_engine() -> None:
    with trio.fail_after(30):
        args = (
            "--tokens-per-second",
            "500",
            "--tokens",
            "64",
            "--ttft-ms",
            "30",
            "--tick-ms",
            "10",
        )
        async with open_sim(*args, api_key=KEY) as sim:
            result = await run_load(
                LoadConfig(
                    url=sim.base_url,
                    api_key=KEY,
                    model="sim-model",
                    concurrency=8,
                    duration_s=1.0,
                    warmup_s=0.3,
                    max_tokens=64,
                )
            )
    assert result.errors == 0, result.error_samples
    # 8 clients, ~160 ms a request: about 50 in the second.
    assert 20 <= result.requests <= 80
    assert result.tokens == 64 * result.requests
    assert result.tokens_per_s == pytest.approx(64 * result.requests_per_s)
    assert len(result.ttfts_ms) == len(result.totals_ms) == result.requests
    assert min(result.ttfts_ms) >= 29.5  # the engine's --ttft-ms
    assert result.total_ms.p50 > result.ttft_ms.p50
    assert 1.5 <= result.itl_ms.p50 <= 3.5  # 1 / (500 tokens/s) = 2 ms
    assert result.concurrency == 8
    assert result.rate_per_s is None
    doc = json.loads(json.dumps(result.to_json()))
    assert doc["requests"] == result.requests
    assert set(doc["ttft_ms"]) == {"p50", "p95", "p99", "mean"}
    assert "ttfts_ms" not in doc
    assert len(result.to_json(samples=True)["ttfts_ms"]) == result.requests


async def test_open_loop_gets_about_rate_times_duration() -> None:
    with trio.fail_after(30):
        async with open_sim("--tokens-per-second", "1000", "--tokens", "16") as sim:
            result = await run_load(
                LoadConfig(
                    url=sim.base_url + "/v1",
                    model="sim-model",
                    rate_per_s=40.0,
                    duration_s=1.0,
                    warmup_s=0.25,
                    include_usage=False,
                )
            )
    assert result.errors == 0, result.error_samples
    assert 38 <= result.requests <= 41  # 40 starts fall in the window
    assert result.tokens == 16 * result.requests  # content chunks, no usage asked for
    assert result.rate_per_s == 40.0


async def test_a_wrong_key_gives_http_401_errors() -> None:
    with trio.fail_after(30):
        async with open_sim("--tokens", "4", api_key=KEY) as sim:
            for key in ("wrong", ""):
                result = await run_load(
                    LoadConfig(
                        url=sim.base_url,
                        api_key=key,
                        model="sim-model",
                        concurrency=2,
                        duration_s=0.3,
                        warmup_s=0.0,
                    )
                )
                assert result.requests == 0
                assert result.errors > 0
                assert result.error_samples == ("HTTP 401 (wrong or missing --key?)",)


async def test_a_closed_port_gives_connection_refused_in_time() -> None:
    with socket.socket() as bound:  # bound, never listening: connects are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with trio.fail_after(5):
            result = await run_load(
                LoadConfig(
                    url=f"http://127.0.0.1:{port}",
                    model="m",
                    concurrency=4,
                    duration_s=0.5,
                    warmup_s=0.0,
                )
            )
        assert result.requests == 0
        assert result.errors >= 4
        assert result.error_samples == ("connection refused",)
        assert result.wall_s < 2.0
        open_loop = await run_load(
            LoadConfig(
                url=f"http://127.0.0.1:{port}",
                model="m",
                rate_per_s=20.0,
                duration_s=0.5,
                warmup_s=0.0,
            )
        )
        assert open_loop.errors == 10
        assert open_loop.error_samples == ("connection refused",)


# -- hostile fakes --------------------------------------------------------------------


async def _read_request(stream: trio.SocketStream, buffer: bytearray) -> bool:
    """Read one request (head and Content-Length body); False at EOF."""
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return False
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            return False
        rest += data
    buffer[:] = rest[length:]
    doc = orjson.loads(rest[:length])
    assert doc["stream"] is True
    assert doc["max_tokens"] == 64
    return True


Handler = Callable[[trio.SocketStream], Awaitable[None]]


async def _serve(handler: Handler, nursery: trio.Nursery) -> int:
    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def _run_against(
    handler: Handler, *, duration_s: float = 0.4, request_timeout_s: float = 30.0
) -> LoadResult:
    async with trio.open_nursery() as nursery:
        port = await _serve(handler, nursery)
        result = await run_load(
            LoadConfig(
                url=f"http://127.0.0.1:{port}",
                model="fake",
                concurrency=2,
                duration_s=duration_s,
                warmup_s=0.0,
                request_timeout_s=request_timeout_s,
            )
        )
        nursery.cancel_scope.cancel()
    return result


async def test_answers_written_in_awkward_pieces_are_read_whole() -> None:
    wire = HEAD_CHUNKED + _chunked(EVENTS)
    cuts = [0, 5, 17, len(HEAD_CHUNKED) - 1, len(HEAD_CHUNKED) + 1, 400, 401, 777, len(wire)]

    async def handler(stream: trio.SocketStream) -> None:
        buffer = bytearray()
        while await _read_request(stream, buffer):
            for start, end in itertools.pairwise(cuts):
                await stream.send_all(wire[start:end])
                await trio.sleep(0.002)

    with trio.fail_after(10):
        result = await _run_against(handler)
    assert result.errors == 0, result.error_samples
    assert result.requests > 0
    assert result.tokens == 7 * result.requests  # the usage chunk's count


async def test_a_server_closing_kept_alive_connections_costs_no_errors() -> None:
    """One answer per connection, no ``Connection: close``: the next request
    finds the connection closed and is sent again on a new one."""
    body = EVENTS
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    connections = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        if await _read_request(stream, bytearray()):
            await stream.send_all(wire)
            await trio.sleep(0.01)

    with trio.fail_after(10):
        result = await _run_against(handler)
    assert result.errors == 0, result.error_samples
    assert result.requests >= 4
    assert connections >= result.requests


async def test_a_closed_loop_client_waits_out_a_429_before_asking_again() -> None:
    """Retry-After: 1 on every answer: each of the 2 clients asks at 0 s and
    1 s, not as fast as it can (which would be thousands of refusals)."""
    refusal = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"
    asked = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal asked
        buffer = bytearray()
        while await _read_request(stream, buffer):
            asked += 1
            await stream.send_all(refusal)

    with trio.fail_after(10):
        result = await _run_against(handler, duration_s=1.5)
    assert 2 <= asked <= 6
    assert result.requests == 0
    assert result.errors == asked
    assert result.error_samples == ("HTTP 429 (rate limited: the key's limits)",)


async def test_a_client_whose_connection_closed_while_it_waited_connects_again() -> None:
    """A 429 without Retry-After (1 s by default), then the server closes the
    connection: the client comes back on a new one and gets its answers."""
    refusal = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 0\r\n\r\n"
    wire = HEAD_CHUNKED + _chunked(EVENTS)
    connections = 0

    async def handler(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        buffer = bytearray()
        if connections <= 2:
            if await _read_request(stream, buffer):
                await stream.send_all(refusal)
            return  # closed while the client waits
        while await _read_request(stream, buffer):
            await stream.send_all(wire)

    with trio.fail_after(10):
        result = await _run_against(handler, duration_s=1.6)
    assert result.errors == 2
    assert result.requests > 0
    assert connections >= 3


async def test_a_server_that_never_answers_gives_timeouts_in_time() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await _read_request(stream, bytearray())
        await trio.sleep_forever()

    with trio.fail_after(10):
        result = await _run_against(handler, duration_s=0.3, request_timeout_s=0.2)
    assert result.requests == 0
    assert result.errors >= 2
    assert result.error_samples == ("timeout",)
    assert result.wall_s < 1.0


async def test_a_server_speaking_nonsense_gives_bad_response_errors() -> None:
    async def handler(stream: trio.SocketStream) -> None:
        if await _read_request(stream, bytearray()):
            await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

    with trio.fail_after(10):
        result = await _run_against(handler, duration_s=0.2)
    assert result.requests == 0
    assert result.errors > 0
    assert result.error_samples[0].startswith("bad response: bad status line")


# -- the command ------------------------------------------------------------------------


def test_command_prints_json_and_fails_when_nothing_succeeded() -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        runner = CliRunner()
        args = ["--url", url, "--concurrency", "2", "--duration-s", "0.2", "--warmup-s", "0"]
        result = runner.invoke(load_command, [*args, "--json"])
        assert result.exit_code == 1
        doc = json.loads(result.output)
        assert doc["requests"] == 0
        assert doc["errors"] > 0
        assert doc["error_samples"] == ["connection refused"]
        result = runner.invoke(load_command, args)
        assert "connection refused" in result.output
        assert "TTFT ms" in result.output


def test_command_wants_one_shape_of_load() -> None:
    runner = CliRunner()
    for extra in ([], ["--concurrency", "2", "--rate", "5"]):
        result = runner.invoke(load_command, ["--url", "http://127.0.0.1:9", *extra])
        assert result.exit_code == 2
        assert "--concurrency" in result.output


@pytest.mark.parametrize(
    ("requests_per_s", "tokens_per_s", "shown"),
    [
        (0.05, 3.2, "rate       0.05 requests/s, 3.2 tokens/s"),
        (12.345, 790.4, "rate       12.3 requests/s, 790 tokens/s"),
        (1234.4, 78_999.6, "rate       1234 requests/s, 79000 tokens/s"),
    ],
)
def test_the_table_shows_a_small_rate_instead_of_zero(
    requests_per_s: float, tokens_per_s: float, shown: str
) -> None:
    # A closed loop against a key limited to 6 requests a minute showed
    # "rate 0.0 requests/s".
    none = Percentiles.of([])
    result = LoadResult(
        requests=1,
        errors=0,
        error_samples=(),
        duration_s=20.0,
        requests_per_s=requests_per_s,
        tokens_per_s=tokens_per_s,
        ttft_ms=none,
        total_ms=none,
        itl_ms=none,
        concurrency=1,
        rate_per_s=None,
    )
    assert shown in format_result(result).splitlines()

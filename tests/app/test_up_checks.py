"""What ``llmgw up`` checks and says for a newcomer (``docs/up.md``): a
``--model`` that is not a GGUF and a port in use are refused before anything
starts, in one line naming what to change; "ready" is said only once a
request would be answered; the stop's signals say how to hurry it."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing

from llmgw import errors
from llmgw.app import up
from llmgw.app.control_plane import Addresses
from llmgw.app.up import UpError, UpOptions, check_listeners, run_up
from llmgw.app.up_models import check_model_file
from llmgw.control.cluster import Cluster
from llmgw.router.endpoint import Endpoint
from llmgw.store import ModelRecord

MODEL = "sim-model"


@pytest.fixture(name="taken")
def taken_fixture() -> Iterator[str]:
    """``host:port`` of a loopback socket that listens for the test."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _free_options(data_dir: Path, **changes: Any) -> UpOptions:
    """Options with every listener on port 0, changed by ``changes``."""
    options = UpOptions(
        data_dir=data_dir,
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        agent_listen="127.0.0.1:0",
    )
    return attrs.evolve(options, **changes)


@pytest.mark.parametrize(
    ("field", "what", "option"),
    [
        ("listen", "client API", "--listen"),
        ("admin_listen", "admin API", "--admin-listen"),
        ("metrics_listen", "metrics", "--metrics-listen"),
        ("agent_listen", "agents' hub", "--agent-listen"),
    ],
)
def test_a_port_in_use_is_refused_in_one_line_naming_the_address_and_the_option(
    taken: str, tmp_path: Path, field: str, what: str, option: str
) -> None:
    with pytest.raises(UpError) as refused:
        check_listeners(_free_options(tmp_path, **{field: taken}))
    assert str(refused.value) == (
        f"cannot listen on {taken} ({what}): address already in use; is another llmgw "
        f"running? Use {option} HOST:PORT"
    )


def test_free_ports_and_port_zero_pass(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = f"127.0.0.1:{sock.getsockname()[1]}"
    check_listeners(_free_options(tmp_path, listen=free))


def test_an_address_that_is_not_local_is_refused_with_the_reason(tmp_path: Path) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    with pytest.raises(
        UpError,
        match=r"cannot listen on 192\.0\.2\.1:8080 \(client API\): "
        r"cannot assign requested address\. Use --listen HOST:PORT",
    ):
        check_listeners(_free_options(tmp_path, listen="192.0.2.1:8080"))


def test_a_model_file_that_is_not_a_gguf_is_refused(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# A project\n\nNot weights.\n")
    with pytest.raises(errors.InvalidInput, match=r"README\.md: not a GGUF file"):
        check_model_file("llamacpp", readme)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert check_model_file("llamacpp", gguf) == gguf.resolve()
    # The sim engine reads no file.
    assert check_model_file("sim", readme) == readme.resolve()
    with pytest.raises(FileNotFoundError):
        check_model_file("llamacpp", tmp_path / "missing.gguf")


async def test_up_refuses_a_model_that_is_not_a_gguf_before_it_writes_anything(
    tmp_path: Path,
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# A project\n")
    data_dir = tmp_path / "data"
    said: list[str] = []
    with pytest.raises(errors.InvalidInput, match="not a GGUF file"):
        await run_up(_free_options(data_dir, model=readme), said.append)
    assert not data_dir.exists()
    assert said == []


async def test_up_refuses_a_port_in_use_before_the_store_and_the_model(
    taken: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    said: list[str] = []
    with pytest.raises(UpError, match=f"cannot listen on {taken}"):
        await run_up(_free_options(data_dir, engine="sim", listen=taken), said.append)
    assert not (data_dir / "llmgw.db").exists()
    assert not any(line.startswith("model ") for line in said)


async def test_ready_is_said_only_once_leading_with_the_model_in_the_catalog_and_a_replica(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    cluster = Cluster()
    # A READY replica as adopted from the previous run's engine, while the
    # lease is not yet held and the catalog not yet read (a restart).
    cluster.set_fixed_endpoints(
        {
            MODEL: [
                Endpoint(
                    replica_id=f"{MODEL}-0", model=MODEL, host="127.0.0.1", port=1, api_key="k"
                )
            ]
        }
    )
    addresses = Addresses(api="127.0.0.1:1", admin="a", metrics="m", agent_hub="h", agent_token="t")
    said: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            up._report_progress, cluster, MODEL, addresses, tmp_path / "key", 0.0, said.append
        )
        await trio.sleep(5)
        assert said == []
        cluster.set_leader(True)  # nobody is poked
        await trio.sleep(5)
        assert said == []  # the catalog is not read yet: 404 model_not_found
        cluster.load_catalog({MODEL: ModelRecord.simple(MODEL, "sim")})
        await trio.sleep(1)
        assert said
        assert said[0].startswith("ready in ")
        assert f"{MODEL} answers at" in said[0]
        nursery.cancel_scope.cancel()


async def _wait_said(said: list[str], n: int) -> None:
    while len(said) < n:
        await trio.lowlevel.checkpoint()


async def test_the_first_signal_says_how_to_stop_at_once_and_one_too_soon_says_so(
    mock_clock: trio.testing.MockClock,
) -> None:
    stop = trio.Event()
    hard = trio.CancelScope()
    said: list[str] = []

    async def watchdog() -> None:
        # Real time: the mock clock stands still.
        await trio.to_thread.run_sync(time.sleep, 20, abandon_on_cancel=True)
        raise AssertionError(f"signals not answered within 20 s: {said}")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog)
        nursery.start_soon(up._serve_signals, stop, hard, said.append, 10.0)
        await trio.testing.wait_all_tasks_blocked()
        os.kill(os.getpid(), signal.SIGINT)
        await stop.wait()
        await _wait_said(said, 1)
        assert said[0] == (
            "SIGINT: stopping: no new requests; those in flight get up to 10 s; "
            "Ctrl-C again (after 2 s) stops at once"
        )
        mock_clock.jump(0.5)
        os.kill(os.getpid(), signal.SIGINT)
        await _wait_said(said, 2)
        assert said[1].startswith("SIGINT 0.5 s after the first: too soon")
        assert "Ctrl-C again 2 s or more after the first" in said[1]
        assert not hard.cancel_called
        mock_clock.jump(1.5)
        os.kill(os.getpid(), signal.SIGINT)
        await _wait_said(said, 3)
        assert said[2] == "second SIGINT: stopping now"
        assert hard.cancel_called
        nursery.cancel_scope.cancel()

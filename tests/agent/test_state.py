"""The agent's state directory and the compute report read from engine logs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from llmgw.agent.compute import SIM_COMPUTE, ComputeReport, progress_text
from llmgw.agent.protocol import EngineProfile, StartShard
from llmgw.agent.state import (
    ProcRecord,
    ShardRecord,
    StateDir,
    StateDirBusy,
    boot_id,
    default_state_dir,
)


def record(shard_id: str = "shard-1", compute: str = "") -> ShardRecord:
    start = StartShard(
        correlation_id="c1",
        shard_id=shard_id,
        replica_id="rep-1",
        profile=EngineProfile(
            name="m", engine="sim", served_model_name="m", args=("--tokens", "4"), env={"A": "1"}
        ),
        port=20001,
        api_key="very-secret-engine-key",
        gpu_indices=(0, 2),
        fingerprint="fp-1",
    )
    return ShardRecord(
        start=start,
        procs=(ProcRecord(name="sim", pid=4242, pgid=4242, start_time=99),),
        compute=compute,
        boot_id=boot_id(),
        started_at=1700000000.5,
    )


def test_write_and_load_without_the_key(tmp_path: Path) -> None:
    """A shard file round-trips, is mode 0600, leaves no temporary file and
    never holds the engine key."""
    state = StateDir(tmp_path / "state")
    with state.lock():
        state.write(record(compute="CPU"))
        path = state.shard_path("shard-1")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "very-secret-engine-key" not in path.read_text()
        assert [p.name for p in state.shards_dir.iterdir()] == ["shard-1.json"]
        (loaded,) = state.load_all()
    assert loaded.start.api_key == ""
    assert loaded == ShardRecord(
        start=StartShard(
            correlation_id="c1",
            shard_id="shard-1",
            replica_id="rep-1",
            profile=record().start.profile,
            port=20001,
            gpu_indices=(0, 2),
            fingerprint="fp-1",
        ),
        procs=record().procs,
        compute="CPU",
        boot_id=boot_id(),
        started_at=1700000000.5,
    )
    state.remove("shard-1")
    assert state.load_all() == []


def test_bad_files_are_set_aside(tmp_path: Path) -> None:
    """An unreadable or other-version file is skipped and renamed *.bad."""
    state = StateDir(tmp_path)
    with state.lock():
        state.write(record("good"))
        (state.shards_dir / "junk.json").write_text("{not json")
        (state.shards_dir / "old.json").write_text('{"version": 0}')
        assert [r.shard_id for r in state.load_all()] == ["good"]
        assert sorted(p.name for p in state.shards_dir.iterdir()) == [
            "good.json",
            "junk.bad",
            "old.bad",
        ]


def test_unsafe_shard_ids_are_hashed(tmp_path: Path) -> None:
    """A shard id is never used as a path unless it is a plain name."""
    state = StateDir(tmp_path)
    for shard_id in ("../../etc/passwd", ".hidden", "a/b", "x" * 200):
        path = state.shard_path(shard_id)
        assert path.parent == state.shards_dir
        assert path.name.startswith("x-")
    assert state.log_path("rep-1.0").name == "rep-1.0.log"


def test_lock_is_exclusive(tmp_path: Path) -> None:
    """Only one agent holds a state directory; the lock goes with it."""
    state = StateDir(tmp_path / "s")
    with state.lock():
        assert stat.S_IMODE(state.root.stat().st_mode) == 0o700
        with pytest.raises(StateDirBusy), StateDir(tmp_path / "s").lock():
            pass
    with StateDir(tmp_path / "s").lock():
        pass


def test_prune_logs(tmp_path: Path) -> None:
    """Old logs of shards no longer running go; kept or recent ones stay."""
    state = StateDir(tmp_path)
    with state.lock():
        for name in ("old", "kept", "recent"):
            state.log_path(name).write_text("x\n")
        for name in ("old", "kept"):
            os.utime(state.log_path(name), (1, 1))
        state.prune_logs({"kept"})
    assert sorted(p.name for p in state.logs_dir.iterdir()) == ["kept.log", "recent.log"]


def test_default_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_state_dir("gpu-7") == tmp_path / "llmgw" / "agent" / "gpu-7"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_state_dir("n") == Path.home() / ".local" / "state" / "llmgw" / "agent" / "n"


# --- compute ---------------------------------------------------------------------

CUDA_LOG = """\
ggml_cuda_init: found 2 CUDA devices:
  Device 0: NVIDIA GeForce RTX 4090, compute capability 8.9, VMM: yes
llama_model_load_from_file_impl: using device CUDA0 (NVIDIA GeForce RTX 4090) (0000:01:00.0) - 23000 MiB free
llama_model_load_from_file_impl: using device CUDA1 (NVIDIA GeForce RTX 4090) (0000:02:00.0) - 23000 MiB free
load_tensors: offloading 32 repeating layers to GPU
load_tensors: offloaded 33/33 layers to GPU
load_tensors:        CUDA0 model buffer size =  2403.49 MiB
load_tensors:   CPU_Mapped model buffer size =   281.81 MiB
"""

# What the bundled xllamacpp CPU wheel prints at -lv 4.
CPU_LOG = """\
0.00.005.988 I cmn  common_param: device_info:
0.00.006.013 I cmn  common_param:   - CPU     : AMD EPYC (24105 MiB, 24105 MiB free)
0.01.927.860 I load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
"""

PARTIAL_LOG = """\
0.00.005.988 I cmn  common_param: device_info:
0.00.006.013 I cmn  common_param:   - CUDA0   : NVIDIA L4 (22000 MiB, 21000 MiB free)
0.00.006.013 I cmn  common_param:   - CPU     : AMD EPYC (24105 MiB, 24105 MiB free)
0.01.927.860 I load_tensors: offloaded 10/19 layers to GPU
0.01.927.860 I load_tensors:        CUDA0 model buffer size =  100.00 MiB
"""


def report_of(text: str, engine: str = "llamacpp", gpus: tuple[int, ...] = ()) -> str:
    report = ComputeReport(engine, gpus)
    for line in text.splitlines():
        report.feed(line)
    return report.text


@pytest.mark.parametrize(
    ("log", "engine", "gpus", "expected"),
    [
        (
            CUDA_LOG,
            "llamacpp",
            (0, 1),
            "CUDA0 (NVIDIA GeForce RTX 4090), CUDA1 (NVIDIA GeForce RTX 4090): 33/33 layers",
        ),
        (CPU_LOG, "llamacpp", (), "CPU"),
        (PARTIAL_LOG, "llamacpp", (0,), "CUDA0 (NVIDIA L4): 10/19 layers, rest on CPU"),
        (
            PARTIAL_LOG.replace("10/19", "0/19").replace("CUDA0 model", "CPU model"),
            "llamacpp",
            (0,),
            "CPU (0/19 layers offloaded; GPU found: CUDA0 (NVIDIA L4))",
        ),
        (
            "warning: no usable GPU found, --gpu-layers option will be ignored\n",
            "llamacpp",
            (0,),
            "CPU (no usable GPU: no usable GPU found, --gpu-layers option will be ignored)",
        ),
        ("load_tensors: offloaded 5/5 layers to GPU\n", "llamacpp", (0,), "GPU: 5/5 layers"),
        ("", "llamacpp", (), "CPU"),
        ("", "llamacpp", (0,), ""),
        ("sim engine listening on 127.0.0.1:1 model m\n", "sim", (), SIM_COMPUTE),
        (
            CUDA_LOG,
            "sim",
            (0,),
            "CUDA0 (NVIDIA GeForce RTX 4090), CUDA1 (NVIDIA GeForce RTX 4090): 33/33 layers",
        ),
    ],
)
def test_compute_report(log: str, engine: str, gpus: tuple[int, ...], expected: str) -> None:
    """Devices, backend and layers offloaded, from llama.cpp's start-up log;
    the sim engine says "CPU (sim)" unless it printed such a log."""
    assert report_of(log, engine, gpus) == expected


def test_progress_text() -> None:
    """Progress is the line without llama.cpp's time and level, bounded."""
    assert progress_text("0.01.899.619 I load_tensors: loading model tensors") == (
        "load_tensors: loading model tensors"
    )
    assert progress_text("........") == ""
    assert len(progress_text("x" * 1000)) == 200

"""The wire converter: every message round-trips; bad frames are refused cleanly."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw import errors
from llmgw.agent import protocol
from llmgw.agent.protocol import (
    MAX_FRAME_BYTES,
    BadFrame,
    EngineProfile,
    FrameTooLarge,
    Gpu,
    Hardware,
    LogsReply,
    Register,
    RunningShard,
    ShardState,
    ShardStatus,
    StartShard,
    UnknownMessage,
    VersionMismatch,
    decode,
    encode,
)

PROFILE = EngineProfile(
    name="gemma-3-270m",
    engine="llamacpp",
    served_model_name="gemma-3-270m",
    model_path="/w/gemma.gguf",
    model_sha256="ab" * 32,
    args=("--flash-attn", "on"),
    env={"OMP_NUM_THREADS": "2"},
)

EXAMPLES: list[protocol.Message] = [
    Register(
        node_id="n1",
        address="10.0.0.5",
        agent_version="0.1.0",
        hardware=Hardware(
            cpu_count=64,
            memory_total_mb=512_000,
            gpus=(Gpu(index=0, name="H100", memory_total_mb=81_559, compute_capability="9.0"),),
            cpu_flags=("avx2", "fma"),
        ),
        interface="eth0",
        engines=("llamacpp", "sim"),
        running_shards=(
            RunningShard(
                shard_id="s", replica_id="r", model="m", state=ShardState.READY, port=20001
            ),
        ),
    ),
    protocol.Heartbeat(
        node_id="n1", memory_total_mb=1, memory_available_mb=1, cpu_count=2, load_1m=0.5
    ),
    ShardStatus(
        shard_id="s", replica_id="r", state=ShardState.FAILED, reason="exit 1", last_lines=("boom",)
    ),
    LogsReply(correlation_id="c", lines=("a", "b")),
    protocol.Error(message="nope", correlation_id="c"),
    protocol.Registered(node_id="n1"),
    protocol.ControlPlanes(urls=("wss://10.0.0.1:7443/agent", "wss://[fd00::1]:7443/agent")),
    StartShard(
        correlation_id="c", shard_id="s", replica_id="r", profile=PROFILE, port=20000, api_key="k"
    ),
    protocol.StopShard(correlation_id="c", shard_id="s"),
    protocol.LogsRequest(correlation_id="c", source="s", lines=10),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_a_round_trip(message: protocol.Message) -> None:
    assert decode(encode(message)) == message


def test_a_register_of_an_older_agent_has_no_interface() -> None:
    doc = msgpack.unpackb(encode(EXAMPLES[0]))
    del doc["interface"]
    older = decode(msgpack.packb(doc))
    assert isinstance(older, Register)
    assert older.interface == ""
    assert older.address == "10.0.0.5"


def test_a_frame_names_its_type_and_protocol_version() -> None:
    doc = msgpack.unpackb(encode(EXAMPLES[-1]))
    assert doc["type"] == "LogsRequest"
    assert doc["v"] == protocol.PROTOCOL_VERSION


def test_an_unknown_message_type_is_refused_with_its_name() -> None:
    with pytest.raises(UnknownMessage) as caught:
        decode(msgpack.packb({"type": "FabricTest", "v": protocol.PROTOCOL_VERSION, "a": 1}))
    assert caught.value.type_name == "FabricTest"


@pytest.mark.parametrize("type_name", ["Heartbeat", "FabricTest"])
def test_a_frame_of_another_version_is_refused_naming_both_versions(type_name: str) -> None:
    # Checked before the type: a newer version may name messages this one lacks.
    with pytest.raises(VersionMismatch) as caught:
        decode(msgpack.packb({"type": type_name, "v": 2}))
    assert (caught.value.theirs, caught.value.ours) == (2, 1)
    assert str(caught.value) == "the peer speaks protocol 2, this side speaks 1"
    named = VersionMismatch(2, peer="agent", me="this control plane")
    assert str(named) == "agent speaks protocol 2, this control plane speaks 1"


def test_a_frame_without_a_version_is_taken_as_this_version() -> None:
    doc = msgpack.unpackb(encode(EXAMPLES[-1]))
    del doc["v"]
    assert decode(msgpack.packb(doc)) == EXAMPLES[-1]


def test_the_protocol_errors_are_the_error_trees() -> None:
    assert protocol.ProtocolError is errors.ProtocolError
    for cls in (FrameTooLarge, UnknownMessage, BadFrame, VersionMismatch):
        assert issubclass(cls, errors.ProtocolError)
        assert issubclass(cls, errors.LinkError)


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    doc = msgpack.unpackb(encode(EXAMPLES[-1]))
    doc["added_in_v2"] = {"x": 1}
    assert decode(msgpack.packb(doc)) == EXAMPLES[-1]


def test_an_oversized_frame_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(FrameTooLarge):
        decode(b"\x80" + b"\x00" * MAX_FRAME_BYTES)


def test_a_message_too_large_to_send_is_refused_at_encoding() -> None:
    huge = LogsReply(correlation_id="c", lines=("x" * 1024,) * (MAX_FRAME_BYTES // 1024 + 1))
    with pytest.raises(FrameTooLarge):
        encode(huge)


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1",  # never used in msgpack
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"no": "type"}),
        msgpack.packb({"type": "StopShard"}),  # missing fields
        msgpack.packb({"type": "StopShard", "correlation_id": 1, "shard_id": ["x"]}),
        msgpack.packb({"type": "StopShard", "v": "1", "correlation_id": "c", "shard_id": "s"}),
        "a text frame",
    ],
)
def test_malformed_frames_raise_bad_frame(frame: bytes | str) -> None:
    with pytest.raises(BadFrame):
        decode(frame)


@given(st.binary(max_size=512))
def test_no_byte_string_crashes_the_decoder(frame: bytes) -> None:
    try:
        decode(frame)
    except protocol.ProtocolError:
        pass


def test_enum_fields_come_back_as_enum_members_not_plain_strings() -> None:
    status = decode(encode(EXAMPLES[2]))
    assert isinstance(status, ShardStatus)
    assert status.state is ShardState.FAILED


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_float_that_is_not_a_number_is_a_bad_frame(value: float) -> None:
    # Found by fuzz/targets/protocol.py: a NaN came through into the
    # cluster's figures (and the frame did not decode to itself again).
    doc = msgpack.unpackb(protocol.encode(EXAMPLES[1]))
    assert doc["type"] == "Heartbeat"
    doc["load_1m"] = value
    with pytest.raises(BadFrame, match="finite"):
        protocol.decode(msgpack.packb(doc))

"""Rules that only flag (``observe``) on a streamed answer through the
gateway, in process: the client gets the engine's events as they came, and
the usage row (written as the answer's end is sent) already has what was
flagged in the answer."""

from __future__ import annotations

import importlib
from typing import Any

from llmgw.settings import settings_from_doc

# The in-process rig (gateway, sim engine, store) of test_gateway_inprocess.py.
_inprocess = importlib.import_module("test_gateway_inprocess")
_guarded = importlib.import_module("test_guard_inprocess")
rig = _inprocess.rig
Rig = Any

CHAT = "/v1/chat/completions"


async def test_a_streamed_answers_flags_are_in_its_usage_row_and_guard_events(rig: Rig) -> None:
    rig.cluster.apply_settings(settings_from_doc({"guard": {"default": ["observe"]}}))
    said = "write to jane@example.com or call +44 20 7946 0958 now"
    for options in ({}, {"stream_options": {"include_usage": True}}):
        got = await rig.call("POST", CHAT, _guarded._saying(said, stream=True, **options))
        assert got.status == 200, got.body
        text, finishes = _guarded._stream_text(got.body)
        assert text == '{"say":"' + said + '"}'
        assert finishes == ["stop"]
        assert got.body.rstrip().endswith(b"data: [DONE]")
        row = await rig.row(got.headers[b"x-request-id"])
        assert set(row.guard_rules.split(",")) == {"pii:email", "pii:phone"}
        assert row.guard_action == "flag"
        events = await rig.store.list_guard_events(request_id=row.request_id)
        assert sorted((e.direction, e.rule, e.action) for e in events) == [
            ("output", "pii:email", "flag"),
            ("output", "pii:phone", "flag"),
        ]

"""Join codes: the format of the contract, and what a bad code is told."""

from __future__ import annotations

import base64
import json

import pytest

from llmgw import errors
from llmgw.agent.joincode import JoinCode, JoinCodeError, host_port, join_address

FP = "sha256:" + "ab" * 32
CODE = JoinCode(("10.0.0.1:7444", "[fd00::1]:7444", "cp.example:7444"), "tok-en_1", FP)


def raw(doc: object) -> str:
    return "llmgw1." + base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")


def test_a_code_is_the_prefix_and_unpadded_base64url_of_compact_json() -> None:
    text = CODE.encode()
    assert text.startswith("llmgw1.")
    body = text[len("llmgw1.") :]
    assert "=" not in body
    assert set(body) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    assert doc == {"a": list(CODE.addresses), "t": "tok-en_1", "f": FP}
    assert JoinCode.decode(text) == CODE


def test_a_code_wrapped_over_lines_or_pasted_with_its_command_still_reads() -> None:
    text = CODE.encode()
    wrapped = "\n  ".join(text[i : i + 20] for i in range(0, len(text), 20))
    assert JoinCode.decode(f"  {wrapped}\n") == CODE
    assert JoinCode.decode(f"llmgw join {text}") == CODE


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hello", "this is not a join code: a join code starts with 'llmgw1.'"),
        ("", "this is not a join code"),
        ("llmgw2.eyJ9", "of format llmgw2, which this llmgw does not read"),
        ("llmgw1.%%%%", "damaged (it does not decode"),
        ("llmgw1." + base64.urlsafe_b64encode(b"{not json").decode(), "damaged"),
        (raw([1, 2]), "damaged (not an object)"),
        (raw({"t": "x", "f": FP}), "damaged (no valid control plane address in it)"),
        (raw({"a": [], "t": "x", "f": FP}), "no valid control plane address"),
        (raw({"a": ["10.0.0.1"], "t": "x", "f": FP}), "no valid control plane address"),
        (raw({"a": ["10.0.0.1:99999"], "t": "x", "f": FP}), "no valid control plane address"),
        (raw({"a": ["10.0.0.1:7444"], "f": FP}), "damaged (no token in it)"),
        (raw({"a": ["10.0.0.1:7444"], "t": "x", "f": "md5:00"}), "no valid CA fingerprint"),
        ("llmgw1." + "A" * 9000, "more than any join code"),
    ],
)
def test_a_bad_code_is_refused_saying_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(JoinCodeError) as refused:
        JoinCode.decode(text)
    assert message in str(refused.value)
    assert isinstance(refused.value, errors.InvalidInput)


def test_a_code_cut_short_is_damaged() -> None:
    text = CODE.encode()
    with pytest.raises(JoinCodeError, match="damaged"):
        JoinCode.decode(text[:-7])


def test_addresses_split_and_join_with_ipv6_in_brackets() -> None:
    assert host_port("[fd00::1]:7444") == ("fd00::1", 7444)
    assert host_port("cp.example:7444") == ("cp.example", 7444)
    assert join_address("fd00::1", 7444) == "[fd00::1]:7444"
    assert join_address("10.0.0.1", 7444) == "10.0.0.1:7444"
    with pytest.raises(JoinCodeError):
        host_port("10.0.0.1")

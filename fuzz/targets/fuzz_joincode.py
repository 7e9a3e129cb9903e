"""Join codes (``llmgw/agent/joincode.py``): any text pasted to
``llmgw join``. An input that starts with ``{`` or ``[`` is the code's JSON
itself, wrapped as ``llmgw1.`` + base64url, so the fuzzer mutates the
fields the code carries rather than base64 text that seldom decodes.

Checked: ``JoinCode.decode`` gives a code or raises ``JoinCodeError``; a
code decoded encodes to a text that decodes to itself."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _harness import fuzz, instrumented

with instrumented():
    from llmgw.agent.joincode import JoinCode, JoinCodeError


def one_input(data: bytes) -> None:
    if data[:1] in (b"{", b"["):
        text = "llmgw1." + base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")
    else:
        text = data.decode("utf-8", "replace")
    try:
        code = JoinCode.decode(text)
    except JoinCodeError:
        return
    assert JoinCode.decode(code.encode()) == code, code


if __name__ == "__main__":
    fuzz(one_input)

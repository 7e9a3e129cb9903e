"""The agent link's frames (``llmgw/agent/protocol.py``): any bytes a node
or a control plane may send.

Checked: ``decode`` gives a message or raises ``ProtocolError`` (never
anything else); a message decoded encodes again and decodes to itself."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _harness import fuzz, instrumented

with instrumented():
    from llmgw.agent import protocol


def one_input(data: bytes) -> None:
    try:
        message = protocol.decode(data)
    except protocol.ProtocolError:
        return
    try:
        again = protocol.encode(message)
    except protocol.FrameTooLarge:
        return
    assert protocol.decode(again) == message, message


if __name__ == "__main__":
    fuzz(one_input)

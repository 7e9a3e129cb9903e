"""The server settings file (``llmgw/settings.py``): any YAML text.

Checked: ``load_settings`` gives settings or raises ``SettingsError``; the
settings it gives go back to a document that reads as the same settings."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _harness import fuzz, instrumented

with instrumented():
    from llmgw import settings

FILE = Path(tempfile.mkdtemp(prefix="llmgw-fuzz-")) / "server.yaml"


def one_input(data: bytes) -> None:
    FILE.write_bytes(data)
    try:
        loaded = settings.load_settings(FILE)
    except settings.SettingsError:
        return
    assert settings.settings_from_doc(settings.settings_to_doc(loaded)) == loaded


if __name__ == "__main__":
    try:
        fuzz(one_input)
    finally:
        os.unlink(FILE) if FILE.exists() else None

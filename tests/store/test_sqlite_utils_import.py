"""The store imports sqlite_utils without numpy (a fifth of `llmgw up`'s
start), and leaves numpy importable afterwards."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import llmgw.store
import llmgw.store.sqlite
loaded = "numpy" in sys.modules
import numpy
print(loaded, numpy.int64(7) + 1)
"""


def test_the_store_loads_without_numpy_and_numpy_still_imports() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "8"]

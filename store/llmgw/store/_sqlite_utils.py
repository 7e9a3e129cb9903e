"""``sqlite_utils.Database``, imported without numpy.

sqlite_utils imports numpy when it is installed (it is, for the ``gguf``
reader) only to map numpy scalars to column types; the store never writes
numpy values, and the import costs about a fifth of ``llmgw up``'s start
before its engine can start. So while sqlite_utils is first imported, numpy
is made unimportable (``sys.modules["numpy"] = None``), then put back as it
was: a later ``import numpy`` anywhere works as usual.
"""

from __future__ import annotations

import sys

_BLOCK_NUMPY = "numpy" not in sys.modules and "sqlite_utils.db" not in sys.modules
if _BLOCK_NUMPY:
    sys.modules["numpy"] = None  # type: ignore[assignment]  # import numpy -> ImportError
try:
    from sqlite_utils import Database
finally:
    if _BLOCK_NUMPY and "numpy" in sys.modules and sys.modules["numpy"] is None:
        del sys.modules["numpy"]

__all__ = ["Database"]

"""Catalog entries (``llmgw/control/catalog.py``, the store's JSON form in
``llmgw/store/_catalog_json.py``): any YAML a person writes, any JSON the
store holds.

The first byte picks the form. Checked: a YAML entry gives a model or
raises ``CatalogError``, and ``validate_model`` passes it or raises
``CatalogError``; a JSON one gives a model or raises ``ValueError``; a
model parsed goes to the store's JSON and back unchanged."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _harness import fuzz, instrumented

with instrumented():
    from llmgw.control import catalog
    from llmgw.store._catalog_json import model_from_json, model_to_json

FILE = Path(tempfile.mkdtemp(prefix="llmgw-fuzz-")) / "model.yaml"


def one_input(data: bytes) -> None:
    if not data:
        return
    if data[0] % 2:
        try:
            model = model_from_json(data[1:].decode("utf-8", "replace"))
        except ValueError:
            return
    else:
        FILE.write_bytes(data[1:])
        try:
            model = catalog.load_model_file(FILE)
        except catalog.CatalogError:
            return
        try:
            catalog.validate_model(model)
        except catalog.CatalogError:
            pass
    assert model_from_json(model_to_json(model)) == model, model


if __name__ == "__main__":
    try:
        fuzz(one_input)
    finally:
        os.unlink(FILE) if FILE.exists() else None

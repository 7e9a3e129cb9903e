"""Catalog entries to and from JSON, one cattrs converter.

The store keeps a model's whole entry as one JSON document (``models.spec``)
so fields can grow without a migration each time. Unknown keys are refused,
so a typo in a hand-written entry is caught where it is read.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs
import cattrs
from cattrs.preconf.json import make_converter

from .records import ModelRecord, Profile

__all__ = [
    "model_from_doc",
    "model_from_json",
    "model_to_doc",
    "model_to_json",
    "profile_fingerprint",
]

_converter = make_converter(forbid_extra_keys=True, omit_if_default=True)


def model_to_doc(model: ModelRecord) -> dict[str, Any]:
    """The entry as plain JSON types; defaults are left out."""
    doc: dict[str, Any] = _converter.unstructure(model)
    doc["name"] = model.name
    return doc


def model_from_doc(doc: Any) -> ModelRecord:
    """An entry from plain JSON types.

    Raises:
        ValueError: a field is unknown or of the wrong type; the message
            names it.
    """
    try:
        return _converter.structure(doc, ModelRecord)
    except cattrs.BaseValidationError as exc:
        messages = cattrs.transform_error(exc, path="model")
        raise ValueError("; ".join(messages)) from None
    except (TypeError, KeyError) as exc:
        raise ValueError(f"model: {exc}") from None


def model_to_json(model: ModelRecord) -> str:
    return json.dumps(model_to_doc(model), sort_keys=True, separators=(",", ":"))


def model_from_json(text: str) -> ModelRecord:
    return model_from_doc(json.loads(text))


def profile_fingerprint(model: ModelRecord, profile: Profile) -> str:
    """A short hash of what a replica was started from: the weights and the
    profile, but not its replica count, priority or start timeout. Carried in ``StartShard`` and returned at adoption; a replica
    whose fingerprint differs from the catalog's is stale."""
    # How many run, in which order and how long a start may take change no
    # replica: scaling must not roll them.
    same = attrs.evolve(profile, replicas=1, priority=0, startup_timeout_s=0.0)
    doc = {
        "source": model.source,
        "sha256": model.sha256,
        "profile": _converter.unstructure(same),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]

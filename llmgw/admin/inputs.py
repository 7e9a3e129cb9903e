"""What an admin route reads from its request: the caller, the JSON body and
its whole-number fields, and query arguments. Each check that fails raises
:class:`~llmgw.admin.errors.BadRequest` (400) naming the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from quart import g, request

from .errors import BadRequest

__all__ = [
    "actor",
    "count",
    "json_body",
    "json_object",
    "optional_int",
    "query_flag",
    "query_int",
]


def actor() -> str:
    """Who is calling: ``admin token (FINGERPRINT)`` (set by the token check)."""
    return str(getattr(g, "admin_actor", "") or "admin")


async def json_body() -> Any:
    """The request's body as JSON, or ``None`` when it is not JSON: the
    content type is not JSON, or the bytes are not (invalid UTF-8 too, which
    quart's own ``get_json(silent=True)`` lets through as an exception)."""
    if not request.is_json:
        return None
    raw = await request.get_data(as_text=False)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


async def json_object(*, allowed: Sequence[str] | None = None) -> dict[str, Any]:
    """The request's body, a JSON object with no field outside ``allowed``
    (any field when ``None``).

    Raises:
        BadRequest: not a JSON object, or an unknown field.
    """
    doc = await json_body()
    if not isinstance(doc, dict):
        raise BadRequest("Send a JSON object.")
    if allowed is not None:
        unknown = set(doc) - set(allowed)
        if unknown:
            raise BadRequest(f"Unknown field(s) {sorted(unknown)}; known: {sorted(allowed)}.")
    return doc


def count(doc: dict[str, Any], name: str, *, low: int, high: int) -> int | None:
    """``doc[name]``, a whole number from ``low`` to ``high``, or ``None``
    when absent or null.

    Raises:
        BadRequest: anything else (``param`` is ``name``).
    """
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a whole number from {low} to {high}.", param=name)
    return value


def optional_int(doc: dict[str, Any], name: str) -> int | None:
    """``doc[name]``, a whole number 0 or more, or ``None`` when absent or null.

    Raises:
        BadRequest: anything else (``param`` is ``name``).
    """
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"'{name}' must be a whole number.", param=name)
    return value


def query_flag(name: str) -> bool:
    """Whether the query argument ``name`` is ``1``, ``true`` or ``yes``."""
    return request.args.get(name, "").lower() in ("1", "true", "yes")


def query_int(name: str, default: int) -> int | None:
    """The query argument ``name`` as a whole number (``default`` when
    absent), or ``None`` when it is not one."""
    try:
        return int(request.args.get(name, str(default)))
    except ValueError:
        return None

"""What both backends share and that touches no database: usage periods and
how a range of them is read, limits as JSON, names and ids, the join code
refusals, the keys' last uses.

Each backend keeps its own SQL (but for the keys' last uses, plain SQL both
run as it is); these are the pure pieces around it, so SQLite and
PostgreSQL floor hours, split ranges and word refusals the same.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import secrets
from collections.abc import Sequence
from typing import Any, Final

from .interface import (
    JoinTokenExpired,
    JoinTokenRefused,
    JoinTokenUnknown,
    JoinTokenUsed,
    StoreError,
)
from .records import JoinToken, Limits

__all__ = [
    "DAY_S",
    "ERROR_STATUS",
    "HOUR_S",
    "day_of",
    "hour_of",
    "join_token_refusal",
    "month_of",
]

HOUR_S: Final = 3600
"""The roll-up period, in seconds."""
DAY_S: Final = 86_400
"""The long roll-up period (a UTC day), in seconds."""
ERROR_STATUS: Final = 400
"""A usage row with this status or more counts as an error in the roll-ups."""

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _limits_to_json(limits: Limits) -> str:
    data: dict[str, object] = {}
    for name in ("rpm", "tpm", "budget_day_micros", "budget_month_micros"):
        value = getattr(limits, name)
        if value is not None:
            data[name] = value
    if limits.models is not None:
        data["models"] = list(limits.models)
    return json.dumps(data, separators=(",", ":"))


def _limits_from_json(text: str) -> Limits:
    data = json.loads(text) if text else {}
    if not isinstance(data, dict):
        raise StoreError(f"stored limits are not a JSON object: {text!r}")
    # Members a later llmgw may add are ignored here.
    return Limits(
        rpm=data.get("rpm"),
        tpm=data.get("tpm"),
        budget_day_micros=data.get("budget_day_micros"),
        budget_month_micros=data.get("budget_month_micros"),
        models=data.get("models"),
    )


def hour_of(at: float) -> int:
    """``at`` (UTC epoch s) floored to its hour, as the roll-ups key it."""
    return int(at // HOUR_S) * HOUR_S


def day_of(at: float) -> int:
    """``at`` (UTC epoch s) floored to its UTC day, as the daily roll-ups key it."""
    return int(at // DAY_S) * DAY_S


def month_of(at: float) -> int:
    """``at`` (UTC epoch s) floored to its UTC calendar month, as the monthly
    roll-ups key it."""
    day = dt.datetime.fromtimestamp(day_of(at), dt.UTC)
    return int(day.replace(day=1).timestamp())


def _next_month(month: int) -> int:
    start = dt.datetime.fromtimestamp(month, dt.UTC)
    if start.month == 12:
        return int(start.replace(year=start.year + 1, month=1).timestamp())
    return int(start.replace(month=start.month + 1).timestamp())


#: Where each group column of a sum is read, in the raw rows.
_RAW_COLUMNS: Final[dict[str, str]] = {
    "key_id": "key_id",
    "project_id": "project_id",
    "team_id": "team_id",
    "org_id": "org_id",
    # The roll-ups key a row by the model that answered.
    "model": "CASE WHEN served_model != '' THEN served_model ELSE model END",
}

#: Where each roll-up level is kept: table and period column.
_ROLLUP_TABLES: Final[dict[str, tuple[str, str]]] = {
    "hour": ("usage_hourly", "hour"),
    "day": ("usage_daily", "day"),
    "month": ("usage_monthly", "month"),
}

#: (requests, prompt, cached, completion, cost_micros, errors) of the rows of
#: one group.
_Sums = list[int]


#: The roll-up levels, longest first: (source, floor of a time to its
#: period's start, the start of the next period).
_LEVELS: Final = (
    ("month", month_of, _next_month),
    ("day", day_of, lambda day: day + DAY_S),
    ("hour", hour_of, lambda hour: hour + HOUR_S),
)


def _whole(lo: float, hi: float, levels: int = 0) -> list[tuple[str, float, float | None]]:
    """Pieces of roll-ups covering ``[lo, hi)`` (hour boundaries; ``hi`` may be
    infinite): the longest periods that fit, shorter ones at either end."""
    if lo >= hi:
        return []
    source, floor, step = _LEVELS[levels]
    first = floor(lo)
    if first != lo:
        first = step(first)
    last = hi if math.isinf(hi) else floor(hi)
    if source == "hour" or first >= last:
        if source == "hour":
            return [(source, lo, None if math.isinf(hi) else hi)]
        return _whole(lo, hi, levels + 1)
    return [
        *_whole(lo, first, levels + 1),
        (source, float(first), None if math.isinf(last) else float(last)),
        *_whole(last, hi, levels + 1),
    ]


def _pieces(
    since: float, until: float | None, horizon: float | None
) -> list[tuple[str, float, float | None]]:
    """Split ``[since, until)`` into the reads that sum it exactly.

    Each piece is ``(source, lo, hi)``: ``"raw"`` rows with ``lo <=
    created_at < hi``, whole ``"hour"``, ``"day"`` or ``"month"`` roll-ups
    with ``lo <= hour (day, month) < hi``; ``hi`` ``None`` = no end. The part
    of an hour at either end is read raw, unless raw rows there may be
    pruned (the hour starts before ``horizon``): then that hour is read whole.
    """
    end = math.inf if until is None else until
    if since >= end:
        return []
    pieces: list[tuple[str, float, float | None]] = []
    lo = float(hour_of(since))
    if lo != since:
        if horizon is not None and since < horizon:
            pass  # the raw rows of this hour may be gone: count it whole
        else:
            pieces.append(("raw", since, min(lo + HOUR_S, end)))
            lo = lo + HOUR_S
            if lo >= end:
                return pieces
    hi = end
    tail: list[tuple[str, float, float | None]] = []
    if until is not None:
        last = float(hour_of(until))
        if last != until and last >= lo:
            if horizon is not None and last < horizon:
                hi = last + HOUR_S  # count the last hour whole
            else:
                tail.append(("raw", last, until))
                hi = last
    return [*pieces, *_whole(lo, hi), *tail]


_SUMMARY_COLUMNS: Final[dict[str, str]] = {
    "key": "key_id",
    "project": "project_id",
    "team": "team_id",
    "org": "org_id",
    "model": "model",
}


_LIMITS_TABLES: Final[dict[str, str]] = {
    "org": "orgs",
    "team": "teams",
    "project": "projects",
    "key": "keys",
}


def _check_name(level: str, name: str) -> None:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None or not name.strip("."):
        raise ValueError(
            f"{level} name {name!r} must be 1 to 64 letters, digits, '-', '_' or '.' "
            "(not dots alone)"
        )


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def _utc_text(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def join_token_refusal(token: JoinToken | None) -> JoinTokenRefused:
    """Why a join code's token could not be used: ``token`` is the stored
    one (``None`` when no token has its hash)."""
    if token is None:
        return JoinTokenUnknown(
            "this join code is not one of this cluster's: it was forged, mistyped, or made "
            "by another control plane; make a new one with `llmgw node add`"
        )
    if token.used_at is not None:
        return JoinTokenUsed(
            f"this join code was already used at {_utc_text(token.used_at)}; a code works once: "
            "make a new one with `llmgw node add`",
            used_at=token.used_at,
        )
    return JoinTokenExpired(
        f"this join code expired at {_utc_text(token.expires_at)}; make a new one with "
        "`llmgw node add`",
        expires_at=token.expires_at,
    )


#: Each key's stored last use and its newest usage row: one index seek per
#: key (``usage_key_id`` on ``(key_id, created_at)``), never a usage scan.
_KEYS_LAST_USED_SQL: Final = (
    "SELECT k.id AS id, k.last_used_at AS last_used_at,"
    " (SELECT MAX(u.created_at) FROM usage u WHERE u.key_id = k.id) AS newest FROM keys k"
)


def _newest_uses(rows: Sequence[Sequence[Any]]) -> dict[str, float]:
    """``{key id: the later of its stored last use and newest usage row}``,
    keys never used left out."""
    out: dict[str, float] = {}
    for key_id, stored, newest in rows:
        times = [float(t) for t in (stored, newest) if t is not None]
        if times:
            out[str(key_id)] = max(times)
    return out

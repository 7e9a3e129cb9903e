"""Admin routes of usage: the rows the gateway writes, one per request, and
their sums.

- ``GET /api/v1/usage?last=N&key_id=…`` → ``{"data": [usage row]}``, newest
  first (``last`` 1 to :data:`MAX_USAGE_ROWS`, default 20); a ``key_id``
  that names no key is 404, listing the keys;
- ``GET /api/v1/usage/summary?by=key|project|team|org|model&since=24h`` →
  ``{"by", "since" (epoch seconds), "data": [sum with "name"]}``, from the
  monthly, daily and hourly roll-ups (kept for good; raw rows only for the part of
  an hour at the start), so ``since=365d`` works after raw rows are pruned;
- ``GET /api/v1/usage/export?format=csv|jsonl&since=30d&until=…``: every row
  in the period, streamed (CSV with a header line, or JSON lines);
- ``GET /api/v1/requests/<req_…>`` → one request's row (rows are written
  within a second or two of the answer).

Times (``since``, ``until``) are read by :func:`parse_since`.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import time
from collections.abc import AsyncIterator
from typing import Any, Final

import attrs
import orjson
from quart import Response, request
from quart_trio import QuartTrio

from llmgw import errors
from llmgw.settings import parse_duration_s
from llmgw.store import Store, UsageRow

from .errors import BadRequest, NoSuch
from .keys import KeysService
from .views import guard_events_view, summary_view, usage_view

__all__ = ["MAX_USAGE_ROWS", "USAGE_FIELDS", "add_usage_routes", "parse_since"]

#: The most rows one ``GET /api/v1/usage`` may ask for.
MAX_USAGE_ROWS: Final = 10_000
#: The columns of a CSV export, in order: every field of a usage row.
USAGE_FIELDS: Final = tuple(a.name for a in attrs.fields(UsageRow) if a.name != "guard_events")
#: Rows read from the store at a time while exporting.
_EXPORT_PAGE: Final = 1000


def parse_since(value: str, now: float) -> float:
    """A time in epoch seconds: a duration back from ``now`` (``24h``,
    ``30d``), an ISO date or date-time (UTC when no zone is given), or epoch
    seconds.

    Raises:
        InvalidInput: none of those.
    """
    text = value.strip()
    if len(text) > 40:
        raise errors.InvalidInput(f"{text[:40]!r}… is not a time")
    try:
        back_s = parse_duration_s(text)
    except (ValueError, OverflowError):
        pass
    else:
        if back_s > 100 * 365 * 86400:
            raise errors.InvalidInput(f"{value!r} is more than a hundred years back")
        return now - back_s
    try:
        epoch = float(text)
    except ValueError:
        pass
    else:
        if not 0 <= epoch < 1e11:
            raise errors.InvalidInput(f"{value!r} is not a time in epoch seconds")
        return epoch
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise errors.InvalidInput(
            f"{value!r} is not a time: give 24h, 30d, 2026-11-01, 2026-11-01T12:00 or epoch seconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _export_line(row: UsageRow, fmt: str) -> bytes:
    doc = usage_view(row)
    if fmt == "jsonl":
        return orjson.dumps(doc) + b"\n"
    out = io.StringIO()
    csv.writer(out).writerow(["" if doc[f] is None else doc[f] for f in USAGE_FIELDS])
    return out.getvalue().encode()


def add_usage_routes(app: QuartTrio, store: Store, keys: KeysService) -> None:
    """Add the routes of the module docstring to ``app``.

    Args:
        store: where the usage rows and roll-ups are.
        keys: names the groups of a summary (:meth:`KeysService.names`).
    """

    @app.get("/api/v1/usage")
    async def usage() -> Any:
        try:
            last = int(request.args.get("last", "20"))
        except ValueError:
            raise BadRequest("'last' must be a whole number.") from None
        if not 1 <= last <= MAX_USAGE_ROWS:
            raise BadRequest(f"'last' must be between 1 and {MAX_USAGE_ROWS}.")
        key_id = request.args.get("key_id") or None
        if key_id is not None:
            await keys.check_key(key_id)
        rows = await store.list_usage(last=last, key_id=key_id)
        return {"data": [usage_view(r) for r in rows]}

    @app.get("/api/v1/usage/summary")
    async def usage_summary() -> Any:
        by = request.args.get("by", "key")
        if by not in ("key", "project", "team", "org", "model"):
            raise BadRequest("'by' is one of key, project, team, org, model.")
        since = parse_since(request.args.get("since", "24h"), time.time())
        rows = await store.usage_summary(by, since)  # type: ignore[arg-type]
        names = await keys.names(by)
        data = [summary_view(r, names.get(r.group, r.group)) for r in rows]
        return {"by": by, "since": since, "data": data}

    @app.get("/api/v1/usage/export")
    async def usage_export() -> Any:
        fmt = request.args.get("format", "jsonl")
        if fmt not in ("csv", "jsonl"):
            raise BadRequest("'format' is csv or jsonl.")
        now = time.time()
        since = parse_since(request.args.get("since", "30d"), now)
        until = parse_since(request.args["until"], now) if request.args.get("until") else None

        async def rows() -> AsyncIterator[bytes]:
            after = ""
            if fmt == "csv":
                yield (",".join(USAGE_FIELDS) + "\n").encode()
            while True:
                page = await store.export_usage(
                    since, until, after_request_id=after, limit=_EXPORT_PAGE
                )
                if not page:
                    return
                for row in page:
                    yield _export_line(row, fmt)
                after = page[-1].request_id

        content_type = "text/csv" if fmt == "csv" else "application/x-ndjson"
        return Response(rows(), content_type=content_type)

    @app.get("/api/v1/requests/<request_id>")
    async def one_request(request_id: str) -> Any:
        if not request_id.startswith("req_") or not request_id[4:].isalnum():
            raise BadRequest(f"{request_id!r} is not a request id (req_…).")
        row = await store.get_usage(request_id)
        if row is None:
            raise NoSuch(
                f"No request {request_id!r} (rows are written within a second or two, and "
                "pruned after auth.usage_retain_days)."
            )
        return {
            **usage_view(row),
            "guard_events": guard_events_view(
                await store.list_guard_events(request_id=request_id, last=1000)
            ),
        }

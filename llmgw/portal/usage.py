"""Usage for the portal's pages: a person's keys or one project, summed per
UTC day, drawn as an inline SVG bar chart, and exported as CSV."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Collection, Sequence
from html import escape

import attrs

from llmgw.store import Store, UsageRow

__all__ = ["Day", "bar_chart", "daily", "money", "rows_for", "to_csv"]

DAY_S = 86_400.0
#: Most raw rows one page reads (the newest).
MAX_ROWS = 50_000


@attrs.define
class Day:
    """One UTC day's sums."""

    day: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0


async def rows_for(
    store: Store,
    since: float,
    *,
    key_ids: Collection[str] | None = None,
    project_id: str | None = None,
) -> list[UsageRow]:
    """The usage rows since ``since`` (UTC epoch s) of ``key_ids`` or of
    ``project_id``, oldest first (the newest :data:`MAX_ROWS`)."""
    return await store.usage_of(
        since,
        key_ids=None if key_ids is None else sorted(key_ids),
        project_id=project_id,
        limit=MAX_ROWS,
    )


def daily(rows: Sequence[UsageRow], days: int, now: float | None = None) -> list[Day]:
    """``rows`` summed per UTC day over the last ``days`` days, oldest first
    (days without requests included)."""
    now = time.time() if now is None else now
    today = int(now // DAY_S)
    sums = {
        d: Day(time.strftime("%Y-%m-%d", time.gmtime(d * DAY_S)))
        for d in range(today - days + 1, today + 1)
    }
    for row in rows:
        day = sums.get(int(row.created_at // DAY_S))
        if day is None:
            continue
        day.requests += 1
        day.prompt_tokens += row.prompt_tokens
        day.completion_tokens += row.completion_tokens
        day.cost_micros += row.cost_micros
    return list(sums.values())


def money(micros: int) -> str:
    """Micro-units as money with four decimals (``0.0123``)."""
    return f"{micros / 1_000_000:.4f}"


def bar_chart(
    labels: Sequence[str], values: Sequence[float], *, title: str, width: int = 900
) -> str:
    """An inline SVG bar chart (no script, no outside file); labels escaped."""
    height, left, bottom, top = 220, 48, 28, 16
    count = max(len(values), 1)
    most = max(values, default=0) or 1
    step = (width - left - 10) / count
    bar = max(step * 0.7, 1)
    parts = [
        f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}"'
        f' width="100%" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - 5}" y2="{height - bottom}"'
        ' stroke="#d8dde3"/>',
        f'<text x="4" y="{top + 4}">{escape(_short(most))}</text>',
        f'<text x="4" y="{height - bottom}">0</text>',
    ]
    usable = height - bottom - top
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        h = usable * (value / most)
        x = left + i * step
        parts.append(
            f'<rect x="{x:.1f}" y="{height - bottom - h:.1f}" width="{bar:.1f}" height="{h:.1f}"'
            f' fill="#0b6bcb"><title>{escape(label)}: {escape(_short(value))}</title></rect>'
        )
        if count <= 31 and (count <= 10 or i % max(count // 8, 1) == 0):
            parts.append(
                f'<text x="{x:.1f}" y="{height - 8}">{escape(label[5:] if len(label) == 10 else label)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _short(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:g}"


def to_csv(rows: Sequence[UsageRow]) -> str:
    """The rows as CSV with a header line (never prompt or answer text: the
    store keeps none)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(
        [
            "request_id",
            "created_at_utc",
            "key_id",
            "project_id",
            "model",
            "status",
            "prompt_tokens",
            "completion_tokens",
            "cost",
        ]
    )
    for row in rows:
        writer.writerow(
            [
                row.request_id,
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row.created_at)),
                row.key_id,
                row.project_id,
                row.served_model or row.model,
                row.status,
                row.prompt_tokens,
                row.completion_tokens,
                money(row.cost_micros),
            ]
        )
    return out.getvalue()

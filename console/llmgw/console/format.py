"""How the console and the CLI's tables print things: one unit per kind
(GiB for memory, GB/s for bandwidth), local dates, aligned columns."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["ago", "date", "duration", "gib_from_bytes", "gib_from_mb", "money", "table", "tokens"]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """The header line and one line per row, columns padded to their widest
    cell and two spaces apart (the last column not padded); ``None`` prints
    as ``-``."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for at, cell in enumerate(row):
            widths[at] = max(widths[at], len(cell))
    lines = []
    for row in [list(headers), *cells]:
        padded = [cell.ljust(widths[at]) for at, cell in enumerate(row[:-1])]
        lines.append("  ".join([*padded, row[-1]]).rstrip())
    return lines


def gib_from_mb(mb: float | None) -> str:
    """Megabytes (MiB, as the agents report them) as ``23.5 GiB``; ``-`` for none."""
    if mb is None:
        return "-"
    return f"{mb / 1024:.1f} GiB"


def gib_from_bytes(size: float | None) -> str:
    """Bytes as ``23.5 GiB``; ``-`` for none."""
    if size is None:
        return "-"
    return f"{size / 2**30:.1f} GiB"


def date(at: float | None) -> str:
    """The epoch time ``at`` (seconds) as a local ``YYYY-MM-DD HH:MM``; ``-`` for none."""
    if at is None or isinstance(at, bool) or not isinstance(at, int | float) or at <= 0:
        return "-"
    return dt.datetime.fromtimestamp(at).astimezone().strftime("%Y-%m-%d %H:%M")


def duration(seconds: float | None) -> str:
    """Seconds as ``42s``, ``5m 03s``, ``3h 12m``, ``2d 4h``; ``-`` for none."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def ago(at: float | None, now: float | None = None) -> str:
    """How long ago the epoch time ``at`` was (``5m 03s ago``); ``never`` for none."""
    if not at:
        return "never"
    return f"{duration((now or time.time()) - at)} ago"


def tokens(count: float) -> str:
    """A token count as ``950``, ``12.3k``, ``4.5M``."""
    if count < 1000:
        return f"{count:.0f}"
    if count < 1_000_000:
        return f"{count / 1000:.1f}k"
    return f"{count / 1_000_000:.1f}M"


def money(micros: int | None) -> str:
    """Micro-units of money as ``12.34``."""
    return f"{(micros or 0) / 1_000_000:.2f}"

"""``llmgw ctl guard judge check``: how fast the judge answers against its
budget, through the admin API (:mod:`llmgw.admin.guard`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from llmgw.admin.client import AdminClient

from .options import data_dir_option, json_option, print_json

__all__ = ["CHECK_TIMEOUT_S", "FAILING_VERDICTS", "ctl_guard"]

#: The longest ``ctl guard judge check`` waits for its answer, seconds.
CHECK_TIMEOUT_S = 900.0
#: The verdicts of a judge that cannot serve as it is: the check exits 1.
FAILING_VERDICTS = frozenset({"too slow", "unreadable"})


@click.group("guard")
def ctl_guard() -> None:
    """The guardrails (docs/guardrails.md)."""


@ctl_guard.group("judge")
def judge() -> None:
    """The judge: a model asked whether a text is safe."""


def _rate(per_s: float) -> str:
    """Two significant digits, never in exponent form (610, 6.1, 0.61)."""
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.2g}"


def _seconds(value: float | None) -> str:
    """One decimal from 1 s up, else two significant digits (2.4 s,
    0.055 s): a judge answering in 55 ms under a 0.1 s budget shows it."""
    if value is None:
        return "no verdict"
    return f"{value:.1f} s" if value >= 1 else f"{value:.2g} s"


@judge.command("check")
@data_dir_option()
@click.option("--model", default=None, help="The judge model (default: the policies' judge).")
@click.option("--policy", default=None, help="The judge of this policy.")
@json_option()
def judge_check(data_dir: Path, model: str | None, policy: str | None, as_json: bool) -> None:
    """Time 3 judgments in sequence and a burst of 4; say whether the budget holds.

    It changes nothing: it suggests more cores, a GPU judge, a longer
    latency_budget or fail: open when the judge is tight or too slow.
    Exits 1 when the verdict is "too slow" or "unreadable", 0 for "ok" and
    "tight".
    """
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    if policy:
        body["policy"] = policy
    if not as_json:
        click.echo("asking the judge 7 times (3 in turn, then 4 at once)…", err=True)
    # Seven judgments, each up to twice the budget: more than the admin
    # client's usual wait.
    doc = AdminClient.from_data_dir(data_dir).call(
        "POST", "/api/v1/guard/judge/check", json=body, timeout=CHECK_TIMEOUT_S
    )
    if as_json:
        print_json(doc)
    else:
        _print_check(doc)
    if doc["verdict"] in FAILING_VERDICTS:
        raise SystemExit(1)


def _print_check(doc: dict[str, Any]) -> None:
    alone = "/".join(_seconds(s) for s in doc["alone_s"])
    slowest = [s for s in doc["burst_s"] if s is not None]
    burst = _seconds(max(slowest)) if slowest else "no verdict"
    click.echo(
        f"judge {doc['model']}: alone {alone}, slowest of 4 concurrent {burst}, "
        f"≈ {_rate(doc['judgments_per_s'])} judgments/s "
        f"≈ {_rate(doc['requests_per_s'])} requests/s, "
        f"budget {doc['budget_s']:g} s: {doc['verdict']}"
    )
    if doc.get("unreadable"):
        click.echo(f"  {doc['unreadable']} of 7 replies held no verdict in the judge's format")
    for advice in doc["advice"]:
        click.echo(f"  - {advice}")

"""How the ``llmgw`` command reports errors: an error of :mod:`llmgw.errors`
that reaches a command's top is printed as one line on stderr,
``Error: <message>``, and the command exits with status 1 (a refusal of the
admin API reads ``Error: <status>: <message>``). Mistakes in the command
line itself are click's: usage on stderr, status 2.
"""

from __future__ import annotations

from typing import Any

import click

from llmgw import errors

__all__ = ["ReportingGroup", "first_leaf"]


class ReportingGroup(click.Group):
    """A click group that turns an :class:`~llmgw.errors.LlmgwError` raised
    by any command under it into the one-line message of the module
    docstring (a :class:`click.ClickException`)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.LlmgwError as exc:
            raise click.ClickException(errors.describe(exc)) from None


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception inside (possibly nested) exception groups, such as
    those ``trio.run`` raises."""
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf

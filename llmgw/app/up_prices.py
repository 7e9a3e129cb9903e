"""Prices on ``llmgw up``'s first start: a default price so budgets mean
something, or a clear word that prices are zero (see ``docs/up.md``, Prices).

A zero price never trips a budget, so with the settings' own default (every
price zero) a budget set by a newcomer would never bite. On the first start
(no settings in the store yet) ``auth.default_price`` becomes
:data:`FIRST_START_PRICE` unless ``server.yaml`` names
``auth.default_price`` itself (a zero written there is kept: whoever wrote
it chose it). Every start whose models without a price of their own cost
nothing says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs
import yaml

from llmgw.settings import Price, ServerSettings, SettingsError, settings_from_doc
from llmgw.store import Store

__all__ = ["FIRST_START_PRICE", "first_start_prices", "names_default_price"]

#: ``auth.default_price`` on a first start, in micro-units per 1,000 tokens:
#: 0.10 per million prompt tokens, 0.01 per million cached ones, 0.40 per
#: million completion tokens (about a small hosted model's price).
FIRST_START_PRICE: Final = Price(prompt_per_1k=100, cached_per_1k=10, completion_per_1k=400)

_ZERO_HINT: Final = (
    "'llmgw ctl config set auth.default_price \"{prompt_per_1k: 100, completion_per_1k: 400}\"' "
    "sets one"
)


def names_default_price(config_path: Path | None) -> bool:
    """Whether the settings file at ``config_path`` names ``auth.default_price``
    (whatever its value). A file that cannot be read names nothing (reading
    the settings reports it)."""
    if config_path is None:
        return False
    try:
        doc = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    auth = doc.get("auth") if isinstance(doc, dict) else None
    return isinstance(auth, dict) and "default_price" in auth


def _per_million(price: Price) -> str:
    """``0.10 in, 0.40 out per million tokens`` (a micro-unit per 1,000 tokens
    is a unit per million)."""
    return (
        f"{price.prompt_per_1k / 1000:.2f} per million prompt tokens, "
        f"{price.completion_per_1k / 1000:.2f} per million completion tokens"
    )


async def first_start_prices(
    store: Store, settings: ServerSettings, *, price_given: bool, say: Callable[[str], None]
) -> ServerSettings:
    """``settings`` with :data:`FIRST_START_PRICE` as ``auth.default_price``
    when this is the store's first start and ``price_given`` is false (the
    settings file did not name one); else ``settings`` as they are. Says what
    was set, or that models without a price of their own cost nothing.

    Raises:
        StoreError: the store cannot be read.
    """
    if await store.settings_version() == 0 and not price_given:
        settings = attrs.evolve(
            settings, auth=attrs.evolve(settings.auth, default_price=FIRST_START_PRICE)
        )
        say(
            f"prices: every model without its own price costs {_per_million(FIRST_START_PRICE)} "
            "(auth.default_price, set on this first start), so budgets count"
        )
        return settings
    live = settings
    stored = await store.get_settings_doc()
    if stored is not None:
        try:
            live = settings_from_doc(stored[1])
        except SettingsError:
            return settings  # the control plane's settings loop reports it
    if live.auth.default_price.is_zero():
        say(
            "prices are zero for every model without its own price (auth.default_price): "
            f"their requests cost nothing and never trip a budget; {_ZERO_HINT}"
        )
    return settings

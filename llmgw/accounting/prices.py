"""Prices and the cost of a request.

Every amount is an integer number of **micro-units** of the budget currency
(``_micros``). A price per 1,000 tokens in micro-units equals a price per
million tokens in units: ``Price(prompt_per_1k=2500, cached_per_1k=250,
completion_per_1k=10000)`` is 2.50 / 0.25 / 10.00 per million tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.settings import Price

__all__ = ["PriceBook"]


class PriceBook:
    """Model name → :class:`Price`; a model not listed costs ``default``
    (``auth.pricing`` and ``auth.default_price``)."""

    def __init__(self, pricing: Mapping[str, Price], default: Price | None = None) -> None:
        self._pricing: dict[str, Price] = dict(pricing)
        self.default: Price = default if default is not None else Price()

    def price_for(self, model: str) -> Price:
        """``model``'s price, or the default price when it has none."""
        return self._pricing.get(model, self.default)

    def cost(
        self,
        model: str,
        prompt: int,
        cached: int,
        completion: int,
        images: int = 0,
        meshes: int = 0,
    ) -> int:
        """``cost_micros`` of a request answered by ``model``."""
        return self.price_for(model).cost(prompt, cached, completion, images, meshes)

    def __contains__(self, model: object) -> bool:
        return model in self._pricing

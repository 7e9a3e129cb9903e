"""Prices and the cost of a request (``shared/spec/accounting.md``, Prices).

Every amount is an integer number of **micro-units** of the budget currency
(``_micros``). A price per 1,000 tokens in micro-units equals a price per
million tokens in units: ``Price(prompt_per_1k=2500, cached_per_1k=250,
completion_per_1k=10000)`` is 2.50 / 0.25 / 10.00 per million tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["Price", "PriceBook", "div_up"]


def div_up(a: int, b: int) -> int:
    """Integer ceiling of ``a / b`` (``b > 0``), so a single token still costs something."""
    return -(-a // b)


def _micros(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{attribute.name} must be a whole number of micro-units, got {value!r}")
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


@attrs.frozen
class Price:
    """A model's price; every field in integer micro-units.

    Attributes:
        prompt_per_1k: micro-units per 1,000 prompt tokens (= units per million).
        completion_per_1k: micro-units per 1,000 completion tokens.
        cached_per_1k: micro-units per 1,000 cached prompt tokens; 0 means
            "same as ``prompt_per_1k``".
        per_image: micro-units per image produced.
        per_mesh: micro-units per 3D model produced.
    """

    prompt_per_1k: int = attrs.field(default=0, validator=_micros)
    completion_per_1k: int = attrs.field(default=0, validator=_micros)
    cached_per_1k: int = attrs.field(default=0, validator=_micros)
    per_image: int = attrs.field(default=0, validator=_micros)
    per_mesh: int = attrs.field(default=0, validator=_micros)

    def is_zero(self) -> bool:
        """True when every field is 0: such a model never trips a budget."""
        return not (
            self.prompt_per_1k
            or self.completion_per_1k
            or self.cached_per_1k
            or self.per_image
            or self.per_mesh
        )

    def zero(self) -> bool:
        """The spec's name for :meth:`is_zero`."""
        return self.is_zero()

    def cost(
        self, prompt: int, cached: int, completion: int, images: int = 0, meshes: int = 0
    ) -> int:
        """``cost_micros`` of a request, exactly as the spec's formula::

            cached      = clamp(cached, 0, max(prompt, 0))
            cached_rate = cached_per_1k if cached_per_1k != 0 else prompt_per_1k
            cost = div_up((prompt - cached) * prompt_per_1k + cached * cached_rate, 1000)
                 + div_up(completion * completion_per_1k, 1000)
                 + max(images, 0) * per_image
                 + max(meshes, 0) * per_mesh

        ``prompt`` counts every prompt token, the ``cached`` ones included.
        """
        cached = min(max(cached, 0), max(prompt, 0))
        cached_rate = self.cached_per_1k if self.cached_per_1k != 0 else self.prompt_per_1k
        return (
            div_up((prompt - cached) * self.prompt_per_1k + cached * cached_rate, 1000)
            + div_up(completion * self.completion_per_1k, 1000)
            + max(images, 0) * self.per_image
            + max(meshes, 0) * self.per_mesh
        )

    def max_cost(self, tokens: int, images: int = 0, meshes: int = 0) -> int:
        """The most ``tokens`` tokens (plus images and meshes) can cost in
        micro-units, whichever of prompt, cached or completion they turn out
        to be: each token at the highest of the three rates. The accountant
        reserves this against budgets before a request runs.
        """
        rate = max(self.prompt_per_1k, self.cached_per_1k, self.completion_per_1k)
        return (
            div_up(max(tokens, 0) * rate, 1000)
            + max(images, 0) * self.per_image
            + max(meshes, 0) * self.per_mesh
        )


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

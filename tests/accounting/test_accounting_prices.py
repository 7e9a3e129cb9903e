"""Prices and the exact cost formula."""

from __future__ import annotations

import pytest

from llmgw.accounting.prices import PriceBook
from llmgw.settings import Price, div_up

BASIC = Price(prompt_per_1k=1000, completion_per_1k=3000)
CACHED = Price(prompt_per_1k=1000, cached_per_1k=100, completion_per_1k=3000)


def test_one_prompt_token_costs_one_micro_unit_because_division_rounds_up() -> None:
    assert BASIC.cost(prompt=1, cached=0, completion=0) == 1


def test_a_thousand_prompt_and_a_thousand_completion_tokens_cost_4000() -> None:
    assert BASIC.cost(prompt=1000, cached=0, completion=1000) == 4000


def test_no_usage_costs_nothing() -> None:
    assert BASIC.cost(prompt=0, cached=0, completion=0) == 0


def test_ninety_percent_cached_prompt_costs_1900() -> None:
    assert CACHED.cost(prompt=10_000, cached=9_000, completion=0) == 1900


def test_more_cached_tokens_than_prompt_tokens_are_clamped_to_the_prompt() -> None:
    assert CACHED.cost(prompt=100, cached=500, completion=0) == 10


def test_negative_cached_tokens_count_as_none() -> None:
    assert CACHED.cost(prompt=1000, cached=-5, completion=0) == 1000


def test_without_a_cached_rate_cached_tokens_cost_the_prompt_rate() -> None:
    assert Price(prompt_per_1k=1000).cost(prompt=10_000, cached=10_000, completion=0) == 10_000


def test_twenty_prompt_tokens_and_three_images_cost_150020() -> None:
    price = Price(prompt_per_1k=1000, per_image=50_000)
    assert price.cost(prompt=20, cached=0, completion=0, images=3) == 150_020


def test_meshes_are_priced_per_mesh_and_negative_counts_cost_nothing() -> None:
    price = Price(per_image=7, per_mesh=1_000)
    assert price.cost(0, 0, 0, images=-2, meshes=2) == 2_000


def test_div_up_is_an_integer_ceiling() -> None:
    assert [div_up(a, 1000) for a in (0, 1, 999, 1000, 1001)] == [0, 1, 1, 1, 2]


def test_a_price_with_every_field_zero_is_zero() -> None:
    assert Price().is_zero()
    assert Price().zero()
    assert not Price(per_mesh=1).is_zero()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_a_price_field_must_be_a_whole_number_of_micro_units_at_least_zero(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        Price(prompt_per_1k=bad)  # type: ignore[arg-type]


def test_max_cost_prices_every_token_at_the_highest_rate() -> None:
    assert CACHED.max_cost(1000) == 3000
    assert Price(prompt_per_1k=1000, per_image=50_000).max_cost(20, images=3) == 150_020


def test_an_unknown_model_costs_the_default_price() -> None:
    book = PriceBook({"big": BASIC}, default=Price(prompt_per_1k=5))
    assert book.price_for("big") is BASIC
    assert book.price_for("unlisted") == Price(prompt_per_1k=5)
    assert book.cost("unlisted", 1000, 0, 0) == 5


def test_a_price_book_without_a_default_prices_unknown_models_at_zero() -> None:
    assert PriceBook({}).price_for("anything").is_zero()

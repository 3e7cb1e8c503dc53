"""What a model response cost, from a per-model price table.

A model missing from the table has no known price: its cost is None, never zero, and the
budget then fails closed on the cost dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from turnstile.events import Usage


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per million tokens."""

    input_per_mtok: float
    output_per_mtok: float

    def __post_init__(self) -> None:
        if self.input_per_mtok < 0 or self.output_per_mtok < 0:
            raise ValueError("prices must be >= 0")


PriceTable = Mapping[str, ModelPrice]

# The in-process scripted provider is free; every real model must be priced by the operator.
DEFAULT_PRICES: PriceTable = {"scripted-1": ModelPrice(0.0, 0.0)}


def cost_usd(prices: PriceTable, model: str, usage: Usage, requested_model: str | None = None) -> float | None:
    """The cost of one response. Providers may answer with a dated variant of the model
    asked for; the requested name's price applies then."""
    price = prices.get(model)
    if price is None and requested_model is not None:
        price = prices.get(requested_model)
    if price is None:
        return None
    return (usage.input_tokens * price.input_per_mtok + usage.output_tokens * price.output_per_mtok) / 1_000_000

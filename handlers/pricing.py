"""What a model response cost, from a per-model price table with a price per token component.

A model missing from the table has no known price: its cost is None, never zero, and the
budget then fails closed on the cost dimension. The same holds for prompt-cache writes: a
reply that wrote to the cache of a model whose entry has no price for them has an unknown
cost (writes cost more than input: 1.25-2x on Anthropic). Cache reads without a price of
their own are counted at the input price, an upper bound (every provider discounts them),
so a price given as input and output only keeps turns going when caching starts on its own
(OpenAI caches any prompt over 1,024 tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from turnstile.events import Usage


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per million tokens. Uncached input is billed at `input_per_mtok`, prompt-cache
    reads at `cached_input_per_mtok`, prompt-cache writes at `cache_write_per_mtok`, and all
    output (reasoning included, as both OpenAI and Anthropic bill it) at `output_per_mtok`.
    A cache-read price left as None is the input price (an upper bound); a cache-write price
    left as None is unknown, not free."""

    input_per_mtok: float
    output_per_mtok: float
    cached_input_per_mtok: float | None = None
    cache_write_per_mtok: float | None = None

    def __post_init__(self) -> None:
        prices = (self.input_per_mtok, self.output_per_mtok, self.cached_input_per_mtok, self.cache_write_per_mtok)
        # An infinite or NaN price would make every cost (and the output allowance a
        # budget derives from it) meaningless: refused like a negative one.
        if any(price is not None and not (math.isfinite(price) and price >= 0) for price in prices):
            raise ValueError("prices must be finite numbers >= 0")


PriceTable = Mapping[str, ModelPrice]

# The in-process scripted provider is free; every real model must be priced by the operator.
DEFAULT_PRICES: PriceTable = {"scripted-1": ModelPrice(0.0, 0.0, 0.0, 0.0)}


def unpriced(prices: PriceTable, models: Sequence[str]) -> tuple[str, ...]:
    """The models a worker would run without a price: their cost is unknown, so a turn on
    them pauses on its cost budget before anything more is spent after its first reply (the
    budget fails closed)."""
    return tuple(dict.fromkeys(m for m in models if m not in prices))


def parse_price(text: str) -> tuple[str, ModelPrice]:
    """`MODEL=INPUT,OUTPUT[,CACHED_INPUT[,CACHE_WRITE]]`, USD per million tokens."""
    model, _, numbers = text.rpartition("=")
    parts = numbers.split(",")
    if not model or not 2 <= len(parts) <= 4:
        shape = "MODEL=INPUT,OUTPUT[,CACHED_INPUT[,CACHE_WRITE]] (USD per million tokens)"
        raise ValueError(f"expected {shape}, got {text!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"the prices of {model!r} are not numbers: {numbers!r}") from None
    return model, ModelPrice(*values)


def cost_usd(prices: PriceTable, model: str, usage: Usage) -> float | None:
    """The cost of one response to a request for `model`, at `model`'s price: the price its
    output allowance was cut at. Not the model the reply names (a dated variant, or what a
    gateway routed to): its price could differ from the one the budget was held to, or make
    an unpriced request look priced."""
    price = prices.get(model)
    if price is None:
        return None
    read_price = price.input_per_mtok if price.cached_input_per_mtok is None else price.cached_input_per_mtok
    cached = _component(usage.cached_input_tokens, read_price)
    written = _component(usage.cache_write_tokens, price.cache_write_per_mtok)
    if cached is None or written is None:
        return None
    uncached = usage.input_tokens - usage.cached_input_tokens - usage.cache_write_tokens
    total = uncached * price.input_per_mtok + cached + written + usage.output_tokens * price.output_per_mtok
    return total / 1_000_000


def _component(tokens: int, per_mtok: float | None) -> float | None:
    """Tokens times their price; no tokens cost nothing even where the price is unknown."""
    if tokens == 0:
        return 0.0
    return None if per_mtok is None else tokens * per_mtok

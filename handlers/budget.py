"""The four independent bounds of a logical turn: iterations, tool calls, cost and
wall-clock time. Pure: the runner passes what was used (time included) as numbers.

A hard limit stops the turn before another tool call (paused, keeping the work done) or,
for iterations, ends it as exhausted. Crossing the soft fraction of any limit asks for
older tool exchanges to be compacted before the next request.

The step in flight is bounded too, not only its start (see docs/budgets.md): a model
request's output allowance is cut so that its worst-case cost fits what is left of the
cost budget (`output_allowance`), and a model request or tool call may run only for the
time left before the deadline (`time_left_s`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ChatMessage, ToolSpec

Dimension = Literal["iterations", "tool_calls", "cost", "deadline"]
# The limits that pause a turn (using the iteration allowance up exhausts it instead).
HardDimension = Literal["tool_calls", "cost", "deadline"]


@dataclass(frozen=True, slots=True)
class TurnBudget:
    max_iterations: int = 8
    max_tool_calls: int = 16
    max_cost_usd: float = 0.50
    deadline_ms: int = 120_000
    soft_fraction: float = 0.75

    def __post_init__(self) -> None:
        # As strict as turnstile.toml is for the same keys: a count is an integer, an amount a
        # number, neither a boolean (True < 8 would be a budget of one iteration).
        for name in ("max_iterations", "max_tool_calls", "deadline_ms"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} is an integer, not {getattr(self, name)!r}")
        for name in ("max_cost_usd", "soft_fraction"):
            if not (_is_int(getattr(self, name)) or isinstance(getattr(self, name), float)):
                raise TypeError(f"{name} is a number, not {getattr(self, name)!r}")
        if self.max_iterations < 1 or self.max_tool_calls < 0 or self.max_cost_usd < 0 or self.deadline_ms < 0:
            raise ValueError("budget limits must be positive")
        if self.deadline_ms < 1:
            raise ValueError("deadline_ms must be at least 1: a turn with no time would pause before it starts")
        # The output allowance divides the cost left by a price: an infinite limit has no
        # allowance to give (and NaN compares false with everything, so it would bound nothing).
        if not math.isfinite(self.max_cost_usd):
            raise ValueError("max_cost_usd must be a finite number")
        if not 0 < self.soft_fraction <= 1:
            raise ValueError("soft_fraction must be in (0, 1]")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class Spent:
    """What the logical turn has used so far. `cost_usd` is None once any response had
    no known price."""

    iterations: int
    tool_calls: int
    cost_usd: float | None
    elapsed_ms: int
    # Why cost_usd is None, when it is known ("the price of model 'x' is unknown").
    unknown_cost: str | None = None


@dataclass(frozen=True, slots=True)
class Limit:
    dimension: HardDimension
    reason: str


def hard_limit(spent: Spent, budget: TurnBudget, model: str) -> Limit | None:
    """The first limit reached, checked before another tool call. (The iteration allowance
    is the loop's own bound: using it up makes the turn exhausted, not paused.)"""
    if spent.tool_calls >= budget.max_tool_calls:
        return Limit("tool_calls", f"the tool call allowance ({budget.max_tool_calls}) is used")
    return spending_limit(spent, budget, model)


def spending_limit(spent: Spent, budget: TurnBudget, model: str) -> Limit | None:
    """The limits that also forbid another model request: cost and time. (Iterations are
    the loop's own count; tool calls only forbid tool calls.)"""
    if spent.cost_usd is None:
        # Fail closed: an unpriced model would otherwise spend without bound.
        why = spent.unknown_cost or f"the price of model {model!r} is unknown"
        return Limit("cost", f"{why}, so the turn's cost cannot be bounded")
    if spent.cost_usd >= budget.max_cost_usd:
        return Limit("cost", f"the cost limit (${budget.max_cost_usd:.4f}) is reached (${spent.cost_usd:.4f})")
    if spent.elapsed_ms >= budget.deadline_ms:
        return Limit("deadline", f"the time limit ({budget.deadline_ms / 1000:g} s) is reached")
    return None


def soft_dimension(spent: Spent, budget: TurnBudget) -> Dimension | None:
    """The first dimension past its soft threshold. An unknown cost counts as past it."""
    f = budget.soft_fraction
    if spent.iterations >= f * budget.max_iterations:
        return "iterations"
    if spent.tool_calls >= f * budget.max_tool_calls:
        return "tool_calls"
    if spent.cost_usd is None or spent.cost_usd >= f * budget.max_cost_usd:
        return "cost"
    if spent.elapsed_ms >= f * budget.deadline_ms:
        return "deadline"
    return None


# The smallest output allowance worth a request: below it even a short reply is cut off,
# so the turn pauses on cost instead of paying for a reply it cannot use.
MIN_REPLY_TOKENS = 16
# Structural tokens a request adds beyond its text: role markers per message, and the
# fixed tool-use system prompt (Anthropic documents 346 tokens; OpenAI adds less).
TOKENS_PER_MESSAGE = 8
TOOL_PROMPT_TOKENS = 512
# Float sums of per-reply costs must not creep over the limit by rounding.
_COST_MARGIN = 1e-9


def input_token_bound(messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> int:
    """An upper bound on the input tokens of a request. The byte-level BPE tokenizers of
    both families never make a token of less than one byte, so the UTF-8 size of what is
    sent bounds its tokens; structural tokens are added on top."""
    size = 0
    for m in messages:
        size += len(m.content.encode()) + TOKENS_PER_MESSAGE
        size += sum(len(c.name.encode()) + len(c.arguments.encode()) + TOKENS_PER_MESSAGE for c in m.tool_calls)
        if m.native is not None:
            size += len(json.dumps(list(m.native), default=str).encode())
    for t in tools:
        size += len(t.name.encode()) + len(t.description.encode()) + len(json.dumps(t.parameters).encode())
    return size + (TOOL_PROMPT_TOKENS if tools else 0)


def output_allowance(
    spent: Spent, budget: TurnBudget, model: str, price: ModelPrice | None, input_tokens: int, wanted: int
) -> int | Limit:
    """The output allowance of the next request: at most `wanted`, and small enough that
    the request's worst case (`input_tokens` at the dearest input price, every allowed
    output token at the output price) keeps the turn's cost within its limit. A Limit
    when even `MIN_REPLY_TOKENS` cannot fit.

    An unpriced model cannot be bounded: its allowance is `wanted`, its reply's cost is
    unknown, and `spending_limit` then pauses the turn before anything else happens."""
    if spent.cost_usd is None:
        return spending_limit(spent, budget, model) or Limit("cost", "the cost so far is unknown")
    if price is None:
        return wanted
    left = (budget.max_cost_usd - spent.cost_usd) * (1 - _COST_MARGIN)
    input_price = max(
        p for p in (price.input_per_mtok, price.cached_input_per_mtok, price.cache_write_per_mtok) if p is not None
    )
    left -= input_tokens * input_price / 1_000_000
    if price.output_per_mtok == 0:
        tokens = wanted if left >= 0 else 0
    else:
        tokens = max(0, math.floor(left * 1_000_000 / price.output_per_mtok)) if left > 0 else 0
    if tokens < min(MIN_REPLY_TOKENS, wanted):
        return Limit(
            "cost",
            f"the cost limit (${budget.max_cost_usd:.4f}) leaves too little for another reply "
            f"(${spent.cost_usd:.4f} spent; a request of up to {input_tokens} input tokens)",
        )
    return min(wanted, tokens)


def time_left_s(spent: Spent, budget: TurnBudget) -> float:
    """Seconds left before the deadline: the longest a model request or tool may run."""
    return max(0, budget.deadline_ms - spent.elapsed_ms) / 1000


# What the ToolCallFinished of a read-only call the deadline cancelled says. A side-effecting
# call is not cancelled at the deadline: cut off, it would be in doubt for good (it runs to
# its own timeout instead, and the turn pauses once its result is recorded).
CANCELLED_AT_DEADLINE = "error: the tool was cancelled at the turn's deadline; it did not finish"

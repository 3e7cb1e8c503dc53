"""The four independent bounds of a logical turn: iterations, tool calls, cost and
wall-clock time. Pure: the runner passes what was used (time included) as numbers.

A hard limit stops the turn before another tool call (paused, keeping the work done) or,
for iterations, ends it as exhausted. Crossing the soft fraction of any limit asks for
older tool exchanges to be compacted before the next request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
        if self.max_iterations < 1 or self.max_tool_calls < 0 or self.max_cost_usd < 0 or self.deadline_ms < 0:
            raise ValueError("budget limits must be positive")
        if not 0 < self.soft_fraction <= 1:
            raise ValueError("soft_fraction must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class Spent:
    """What the logical turn has used so far. `cost_usd` is None once any response had
    no known price."""

    iterations: int
    tool_calls: int
    cost_usd: float | None
    elapsed_ms: int


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
        return Limit("cost", f"the price of model {model!r} is unknown, so the turn's cost cannot be bounded")
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

"""What one turn runs under: the model and its fallback chain, budgets, prices, tools and
the attempt policy. Plain values (a route also names the provider object that serves its
model; the state machine reads only its model and protocol family)."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.pricing import DEFAULT_PRICES, PriceTable
from turnstile.handlers.protocol import RepeatPolicy
from turnstile.handlers.provider import Provider, ProviderError
from turnstile.handlers.tools import ToolRegistry


@dataclass(frozen=True, slots=True)
class Route:
    """A model and the provider that serves it: one link of the fallback chain."""

    model: str
    provider: Provider


@dataclass(frozen=True, slots=True)
class TurnSettings:
    model: str = "scripted-1"
    system_prompt: str | None = "You are a helpful assistant. Answer the user's latest messages."
    max_attempts: int = 3
    backoff_base_ms: int = 250
    backoff_max_ms: int = 4000
    budget: TurnBudget = field(default_factory=TurnBudget)
    prices: PriceTable = field(default_factory=lambda: dict(DEFAULT_PRICES))
    tools: ToolRegistry = field(default_factory=ToolRegistry)
    # Models tried after `model`, in order, when it fails mid-attempt (same family only).
    fallbacks: tuple[Route, ...] = ()
    repeats: RepeatPolicy = field(default_factory=RepeatPolicy)
    tool_timeout_s: float = 60.0
    max_output_tokens: int = 1024

    def backoff_s(self, attempt: int, error: ProviderError | None = None) -> float:
        """Exponential and bounded, so a provider outage does not become a retry storm. The
        wait a server asked for is honoured, up to its policy's limit (the transport made an
        error asking for more final); a wait that would reach the turn's deadline is not
        slept (the turn pauses on it)."""
        delay_ms = float(min(self.backoff_max_ms, self.backoff_base_ms * 2 ** (attempt - 1)))
        if error is not None and error.retry_after_s is not None:
            delay_ms = max(delay_ms, error.retry_after_s * 1000)
        return delay_ms / 1000

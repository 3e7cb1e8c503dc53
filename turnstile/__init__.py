"""turnstile: a durable, event-sourced turn engine for LLM chat agents over Apache Kafka.

The public API, for declaring and running your own agent:

- `Agent`: a name, system prompt, model with fallbacks, tools, budgets, debounce and
  double-text policy; `turnstile run module:agent` or `await agent.serve()` runs it, and
  `await agent.answer(text)` runs it until one message is answered (for your tests).
- `Model`: a model behind the OpenAI or Anthropic HTTP API, with its `ModelPrice`.
- `TestModel`: a scripted, in-process model for your own tests.
- `tool`: a decorator turning a typed function into a `Tool` (also `@agent.tool`).
- `Tool`: a tool as the engine runs it (name, description, argument model, flags).
- `NOT_RUN`: what a tool's reconciler returns when a call its stopped worker left in doubt
  had no effect (the model is told it did not run).
- `ModelPrice`: USD per million tokens of input, cached input, cache writes and output.
- `TurnBudget`: bounds of one logical turn (iterations, tool calls, cost, wall clock).
- `DebouncePolicy`: how long a conversation must be quiet before its messages are claimed.
- `DoubleTextPolicy`: what a message arriving mid-turn does, by default and per conversation.
- `LogPlace`: where the log is (a Kafka broker, or the embedded file log in a folder).
- `__version__`: the installed distribution's version.

The repository keeps the design card's folders at its top level (`events/`, `projections/`,
`handlers/`, `streams/`); installed, they are the subpackages `turnstile.events`,
`turnstile.projections`, `turnstile.handlers` and `turnstile.streams` of this one namespace.
The names above are imported on first use, so `import turnstile.events` stays light.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

try:
    __version__ = version("turnstile-engine")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from turnstile.handlers.budget import TurnBudget
    from turnstile.handlers.claim import DebouncePolicy, DoubleTextPolicy
    from turnstile.handlers.pricing import ModelPrice
    from turnstile.handlers.tool_functions import tool
    from turnstile.handlers.tools import NOT_RUN, Tool
    from turnstile.streams.agent import Agent, Model, TestModel
    from turnstile.streams.serving import LogPlace

_PUBLIC = {
    "Agent": "turnstile.streams.agent",
    "Model": "turnstile.streams.agent",
    "TestModel": "turnstile.streams.agent",
    "tool": "turnstile.handlers.tool_functions",
    "Tool": "turnstile.handlers.tools",
    "NOT_RUN": "turnstile.handlers.tools",
    "ModelPrice": "turnstile.handlers.pricing",
    "TurnBudget": "turnstile.handlers.budget",
    "DebouncePolicy": "turnstile.handlers.claim",
    "DoubleTextPolicy": "turnstile.handlers.claim",
    "LogPlace": "turnstile.streams.serving",
}

__all__ = ["NOT_RUN", "Agent", "DebouncePolicy", "DoubleTextPolicy", "LogPlace", "Model", "ModelPrice", "TestModel",
           "Tool", "TurnBudget", "__version__", "tool"]


def __dir__() -> list[str]:
    """The public names too, though they are imported only when first used."""
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> object:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'turnstile' has no attribute {name!r}")

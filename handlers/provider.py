"""The seam between the turn loop and a model provider.

The loop speaks these neutral types; each provider maps them to its wire format
(OpenAI-compatible chat completions, Anthropic messages). A provider belongs to one
protocol family, and fallback never crosses families mid-turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from turnstile.events import ToolCall, Usage

Role = Literal["system", "user", "assistant", "tool"]
ProtocolFamily = Literal["openai", "anthropic", "scripted"]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str
    # Set on assistant messages that requested tools.
    tool_calls: tuple[ToolCall, ...] = ()
    # Set on tool messages: which call this result answers.
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What the model sees of a tool: its name, purpose and JSON Schema of arguments."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True, slots=True)
class ModelRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    max_output_tokens: int = 1024


@dataclass(frozen=True, slots=True)
class ModelReply:
    model: str
    text: str | None
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    finish_reason: str


class ProviderError(Exception):
    """A provider call that produced no usable reply.

    `retryable` is true for timeouts, connection errors, 429 and 5xx: another attempt
    may succeed. Other 4xx and protocol errors are not retryable.
    `kind`: timeout | connection | rate_limited | server_error | client_error | malformed_response
    """

    def __init__(self, kind: str, message: str, *, retryable: bool, status: int | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.retryable = retryable
        self.status = status


class Provider(Protocol):
    family: ProtocolFamily

    async def complete(self, request: ModelRequest) -> ModelReply: ...

    async def aclose(self) -> None: ...

"""The seam between the turn loop and a model provider.

The loop speaks these neutral types; each provider maps them to its wire format
(OpenAI-compatible chat completions, Anthropic messages). A provider belongs to one
protocol family, and fallback never crosses families mid-turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast, get_args

from turnstile.events import ToolCall, Usage

Role = Literal["system", "user", "assistant", "tool"]
ProtocolFamily = Literal["openai", "anthropic", "scripted"]

# Why a reply ended, in the loop's terms (each family maps its own reasons onto these;
# the provider's own word stays in `ModelReply.finish_reason`):
#   end             the model finished its answer
#   tool_use        the model asks for tool results
#   truncated       the output allowance (or the context window) ran out mid-reply
#   refusal         the model declined to answer
#   content_filter  the provider's filter withheld or cut the reply
#   pause           the provider paused a long turn; sending the reply back continues it
StopKind = Literal["end", "tool_use", "truncated", "refusal", "content_filter", "pause"]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    content: str
    # Set on assistant messages that requested tools.
    tool_calls: tuple[ToolCall, ...] = ()
    # Set on tool messages: which call this result answers, and whether it is an error
    # (a call that did not run, failed or timed out).
    tool_call_id: str | None = None
    is_error: bool = False
    # An assistant message as its provider sent it (Anthropic content blocks: thinking
    # with its signature, server tool use...), sent back verbatim to the same family so
    # that reasoning carries across tool rounds. Never shown to another family.
    native: tuple[Mapping[str, Any], ...] | None = None


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
    # The output allowance of this one request (the wire format's max_completion_tokens
    # or max_tokens); a budget may lower it per request.
    max_output_tokens: int = 1024
    # Seconds left before the turn's deadline, if it has one: a transport never waits
    # for a retry past it.
    time_left_s: float | None = None


@dataclass(frozen=True, slots=True)
class ModelReply:
    model: str
    # The reply's text: for an OpenAI refusal its refusal message; for an Anthropic one the
    # text the model had begun before its classifier stopped it (streamed to users already).
    text: str | None
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    # The provider's own word for why the reply ended (recorded on ModelResponded).
    finish_reason: str
    stop: StopKind = "end"
    # See `ChatMessage.native`.
    native: tuple[Mapping[str, Any], ...] | None = None
    # False when the reply said nothing of its tokens (no `usage`, or null): `usage` is then
    # zeros standing for an unknown, and the reply's cost is unknown, never 0.
    usage_reported: bool = True
    # For a refusal, what the provider says of it (OpenAI `message.refusal`, Anthropic
    # `stop_details.explanation`): what the turn's error quotes. Never an Anthropic refusal's
    # partial text, which the docs say is no refusal message.
    refusal: str | None = None


# timeout | connection: no HTTP answer; rate_limited: 429; overloaded: 529 (Anthropic);
# server_error: other 5xx and 408/409; authentication: 401/403; bad_request: other 4xx;
# malformed_response: an answer that is not a usable reply.
ProviderErrorKind = Literal[
    "timeout",
    "connection",
    "rate_limited",
    "overloaded",
    "server_error",
    "authentication",
    "bad_request",
    "malformed_response",
]


def error_kind_of(text: str) -> ProviderErrorKind | None:
    """The kind a `ProviderError`'s text starts with ("timeout: ..."), read back from a reason
    on the log that quotes it; None for any other text."""
    kind = text.partition(":")[0]
    return cast("ProviderErrorKind", kind) if kind in get_args(ProviderErrorKind) else None


class ProviderError(Exception):
    """A provider call that produced no usable reply.

    `retryable`: whether another try may succeed (the official SDKs' rule: timeouts,
    connection errors, 408, 409, 429, 5xx, unless the server's `x-should-retry` says
    otherwise or it asked for a wait longer than allowed). `message` is free of secrets;
    `provider_message` is what the provider's error body said, when it said something.
    `retry_after_s` is the wait the server asked for, if any. `usage` is what the provider
    reported for a whole reply it sent but that cannot be used (a malformed one): billed
    all the same, so the turn counts it.
    """

    def __init__(
        self,
        kind: ProviderErrorKind,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after_s: float | None = None,
        provider_message: str | None = None,
        usage: Usage | None = None,
    ) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.status = status
        self.retry_after_s = retry_after_s
        self.provider_message = provider_message
        self.usage = usage


class ReplyStream(Protocol):
    """Where a provider that streams puts the reply's text as it arrives. Not the durable
    log: the reply is recorded once, whole, by the caller of `complete`."""

    async def delta(self, text: str) -> None: ...

    async def restart(self) -> None:
        """The text sent so far is void: the request is being sent again."""
        ...


class Provider(Protocol):
    @property
    def family(self) -> ProtocolFamily: ...

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        """The reply to `request`. With `stream`, its text also goes there as it arrives."""
        ...

    async def aclose(self) -> None: ...

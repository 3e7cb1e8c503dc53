"""What every provider wire format is made of, and the parsing helpers they share.

A wire format is pure: it turns a `ModelRequest` into a request (URL, headers, JSON
body) and a parsed JSON reply into a `ModelReply`. It does no I/O; the one HTTP
transport (`turnstile.streams.provider_http`) sends what it builds, for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any, Protocol

import orjson
from pydantic import ValidationError

from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import (
    ChatMessage,
    ModelReply,
    ModelRequest,
    ProtocolFamily,
    ProviderError,
    ProviderErrorKind,
)
from turnstile.handlers.providers.sse import SseEvent

# The events bound these fields; a hostile server must not make ModelResponded invalid.
MAX_FINISH_REASON_CHARS = 64
MAX_MODEL_CHARS = 256
# Enough of a provider's error message to tell an operator what it objected to.
MAX_PROVIDER_MESSAGE_CHARS = 300


class ReplyAssembler(Protocol):
    """Builds a streamed reply from its server-sent events: the text deltas as they come,
    then the whole reply as the non-streaming API would have sent it, for `parse_reply`
    (so a streamed and an unstreamed reply are parsed, and end, the same way)."""

    def feed(self, event: SseEvent) -> str | None:
        """Takes the next event; returns the text it adds to the reply, if any. Raises
        `ProviderError` for an error the server reports mid-stream."""
        ...

    @property
    def done(self) -> bool:
        """Whether the reply is whole: the stream's end marker came, or the reply's stop
        reason did (the official SDKs take a stream that ends after it as finished). A stream
        that stops before either is broken."""
        ...

    def payload(self) -> dict[str, Any]: ...


class WireFormat(Protocol):
    @property
    def family(self) -> ProtocolFamily: ...

    def url(self, base_url: str) -> str: ...

    def headers(self, api_key: str | None) -> dict[str, str]: ...

    def request_body(self, request: ModelRequest, stream: bool = False) -> dict[str, Any]: ...

    def parse_reply(self, payload: Any, requested_model: str) -> ModelReply: ...

    def assembler(self) -> ReplyAssembler: ...


def stream_event_json(event: SseEvent) -> dict[str, Any]:
    try:
        data = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        raise malformed(f"a {event.event!r} event is not JSON") from None
    return expect_object(data, f"{event.event!r} event")


def stream_error(error: object, where: str = "in the stream") -> ProviderError:
    """An error reported inside a stream, or in a body (the HTTP status was already 200).
    Both families name its type; it is retried like the status it stands for."""
    fields = error if isinstance(error, dict) else {}
    kind = _STREAM_ERRORS.get(str(fields.get("type")), "server_error")
    message = fields.get("message")
    said = " ".join(message.split())[:MAX_PROVIDER_MESSAGE_CHARS] if isinstance(message, str) else None
    retryable = kind in ("overloaded", "rate_limited", "server_error")
    detail = f"error {where}: {said or 'no message'}"
    return ProviderError(kind, detail, retryable=retryable, provider_message=said)


_STREAM_ERRORS: dict[str, ProviderErrorKind] = {
    "overloaded_error": "overloaded",
    "rate_limit_error": "rate_limited",
    "invalid_request_error": "bad_request",
    "authentication_error": "authentication",
    "permission_error": "authentication",
}


def malformed(detail: str) -> ProviderError:
    """A response we cannot use. Not retryable: the same request tends to get the same answer."""
    return ProviderError("malformed_response", detail, retryable=False)


def parse_billed(
    payload: Any,
    requested_model: str,
    reply: Callable[[dict[str, Any], str], ModelReply],
    usage: Callable[[object], Usage | None],
) -> ModelReply:
    """`reply(body, requested_model)` of a response body; a malformed one raised with the usage
    the body reported (`bill`)."""
    body = expect_object(payload, "response")
    try:
        return reply(body, requested_model)
    except ProviderError as error:
        bill(error, body.get("usage"), usage)
        raise


def bill(error: ProviderError, raw_usage: object, parse: Callable[[object], Usage | None]) -> None:
    """Gives a malformed reply's `error` the usage the provider reported for it (`parse`: None
    unless it gave both counts), when that is there and readable: a whole reply is billed
    even if it cannot be used. A usage unreadable or in part leaves nothing known to count."""
    if error.kind == "malformed_response" and raw_usage is not None:
        with suppress(ProviderError):
            error.usage = parse(raw_usage)


def status_kind(status: int) -> ProviderErrorKind:
    """What an HTTP error status means, in both families."""
    if status in (401, 403):
        return "authentication"
    if status == 429:
        return "rate_limited"
    if status == 529:  # Anthropic: overloaded
        return "overloaded"
    if status == 408:
        return "timeout"
    if status >= 500 or status == 409:
        return "server_error"
    return "bad_request"


def provider_error_message(payload: bytes) -> str | None:
    """The `error.message` of an error body; both families use that shape
    (`{"error": {"type": ..., "message": ...}}`). None when the body says nothing usable."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not message.strip():
        return None
    message = " ".join(message.split())
    if len(message) > MAX_PROVIDER_MESSAGE_CHARS:
        message = message[:MAX_PROVIDER_MESSAGE_CHARS] + "..."
    return message


def expect_object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise malformed(f"{where} is not a JSON object")
    return value


def expect_list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise malformed(f"{where} is not a JSON array")
    return value


def optional_object(value: object, where: str) -> Mapping[str, Any]:
    """An object that compatible servers may leave out or send as null."""
    return {} if value is None else expect_object(value, where)


def build_tool_call(call_id: object, name: object, arguments: str, where: str) -> ToolCall:
    if not isinstance(call_id, str) or not call_id:
        raise malformed(f"{where} has no id")
    if not isinstance(name, str) or not name:
        raise malformed(f"{where} has no name")
    try:
        return ToolCall(call_id=call_id, name=name, arguments=arguments)
    except ValidationError as exc:
        # Over-long ids, names or arguments: the reply cannot be recorded as an event.
        fields = ", ".join(str(error["loc"][0]) for error in exc.errors())
        raise malformed(f"{where}: invalid {fields}") from None


def counts_given(usage: object, input_key: str, output_key: str) -> bool:
    """Whether a reply's `usage` says both how many tokens it read and how many it wrote: with
    either missing (or null, or no usage at all) its cost is not known, and is not taken as 0."""
    return isinstance(usage, Mapping) and usage.get(input_key) is not None and usage.get(output_key) is not None


# No reply has a trillion tokens; a count above it is not a count (and a turn's totals of such
# counts could pass the 2^53 an event's integers, read by any JSON reader, are bounded to).
MAX_TOKEN_COUNT = 10**12


def token_count(fields: Mapping[str, Any], key: str, where: str) -> int:
    """A token count; absent or null is zero."""
    value = fields.get(key)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN_COUNT:
        raise malformed(f"{where}.{key} is not a token count (an integer from 0 to {MAX_TOKEN_COUNT:,})")
    return value


def build_usage(*, input: int, output: int, cached_input: int = 0, cache_write: int = 0, reasoning: int = 0) -> Usage:
    try:
        return Usage(
            input_tokens=input,
            output_tokens=output,
            cached_input_tokens=cached_input,
            cache_write_tokens=cache_write,
            reasoning_tokens=reasoning,
        )
    except ValidationError as exc:
        raise malformed(f"usage is inconsistent: {exc.errors()[0]['msg']}") from None


def reply_model(value: object, requested: str) -> str:
    """The model that answered; compatible servers may omit it, then it is the one asked for."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_MODEL_CHARS else requested


def finish_reason(value: object) -> str:
    if not isinstance(value, str) or not value:
        return "unknown"
    return value[:MAX_FINISH_REASON_CHARS]


def tool_input(arguments: str) -> dict[str, Any]:
    """Tool call arguments as an object. Arguments that are not one (malformed JSON) were
    never executed, and their tool result says so; an empty object keeps a transcript
    valid for a wire format that wants an object."""
    parsed = _object(arguments)
    return parsed if parsed is not None else {}


def object_arguments(arguments: str) -> str:
    """Tool call arguments as a transcript carries them in a string: as the model wrote them
    when they are a JSON object, else `{}` (as `tool_input`: OpenAI-compatible servers such as
    vLLM and SGLang parse them, and answer 400 to anything else, which no retry mends)."""
    return arguments if _object(arguments) is not None else "{}"


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


MISSING_RESULT = "error: no result was recorded for this call; it may not have run."


def pair_tool_results(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """Every tool call answered by exactly one result, right after the message that made it,
    in call order, as both families require (a call without a result, or a result that is
    not next to its call, is a 400). A missing result becomes an error result; a result
    that answers no call just before it is dropped."""
    out: list[ChatMessage] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        index += 1
        if message.role == "tool":
            continue  # not right after the call it answers
        out.append(message)
        if message.role != "assistant" or not message.tool_calls:
            continue
        results: dict[str | None, ChatMessage] = {}
        while index < len(messages) and messages[index].role == "tool":
            results.setdefault(messages[index].tool_call_id, messages[index])
            index += 1
        for call in message.tool_calls:
            missing = ChatMessage("tool", MISSING_RESULT, tool_call_id=call.call_id, is_error=True)
            out.append(results.get(call.call_id, missing))
    return out

"""The Anthropic Messages wire format (`POST {base_url}/v1/messages`), with the rules the
API enforces on a transcript applied before every request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import (
    ChatMessage,
    ModelReply,
    ModelRequest,
    ProtocolFamily,
    StopKind,
    ToolSpec,
)
from turnstile.handlers.providers.sse import SseEvent
from turnstile.handlers.providers.wire import (
    bill,
    build_tool_call,
    build_usage,
    counts_given,
    expect_list,
    expect_object,
    finish_reason,
    malformed,
    optional_object,
    pair_tool_results,
    parse_billed,
    reply_model,
    stream_error,
    stream_event_json,
    token_count,
    tool_input,
)

# Content is either a plain string or a list of typed blocks, as on the wire.
Content = str | list[dict[str, Any]]

# stop_reason -> stop kind; a missing or unknown reason counts as the end of the reply.
_STOPS: dict[str, StopKind] = {
    "end_turn": "end",
    "stop_sequence": "end",
    "tool_use": "tool_use",
    "max_tokens": "truncated",
    "model_context_window_exceeded": "truncated",
    "pause_turn": "pause",
    "refusal": "refusal",
}

# What stands in for a message that would be empty: the API refuses any message with
# empty content except a final assistant one, so one empty reply kept in history would
# otherwise break every later request of the conversation.
EMPTY_REPLY = "[no reply]"
EMPTY_MESSAGE = "[empty message]"


@dataclass(frozen=True, slots=True)
class AnthropicMessages:
    anthropic_version: str = "2023-06-01"

    @property
    def family(self) -> ProtocolFamily:
        return "anthropic"

    def url(self, base_url: str) -> str:
        return base_url.rstrip("/") + "/v1/messages"

    def headers(self, api_key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": self.anthropic_version}
        if api_key:
            headers["x-api-key"] = api_key
        return headers

    def request_body(self, request: ModelRequest, stream: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_output_tokens,
            "messages": wire_messages(request.messages),
        }
        # The API has no system role: every system message, wherever it sits, becomes the
        # top-level system prompt.
        system = "\n\n".join(m.content for m in request.messages if m.role == "system" and m.content.strip())
        if system:
            body["system"] = system
        if request.tools:
            body["tools"] = [_wire_tool(tool) for tool in request.tools]
        if stream:
            body["stream"] = True
        return body

    def assembler(self) -> AnthropicMessagesStream:
        return AnthropicMessagesStream()

    def parse_reply(self, payload: Any, requested_model: str) -> ModelReply:
        return parse_billed(payload, requested_model, _reply, _reported_usage)


def _reply(body: dict[str, Any], requested_model: str) -> ModelReply:
    blocks = expect_list(body.get("content"), "content")
    texts: list[str] = []
    calls: list[ToolCall] = []
    for index, raw in enumerate(blocks):
        where = f"content[{index}]"
        block = expect_object(raw, where)
        if block.get("type") == "text":
            texts.append(_block_text(block, where))
        elif block.get("type") == "tool_use":
            calls.append(_parse_tool_use(block, where))
        # Other blocks (thinking, server tools) are for the model: they go back with
        # `native`, the turn loop does not read them.
    reason = finish_reason(body.get("stop_reason"))
    text = "".join(texts) if texts else None
    stop = _STOPS.get(reason, "tool_use" if calls else "end")
    # A refusal's text is what the model had begun when its classifier stopped it ("not a
    # refusal message", Anthropic's streaming-refusals guide): kept as the reply's text, never
    # quoted as the refusal, whose words are `stop_details.explanation` when it gives one.
    refusal = _refusal_explanation(body.get("stop_details")) if stop == "refusal" else None
    return ModelReply(
        model=reply_model(body.get("model"), requested_model),
        # Text may arrive split around citations or tool_use blocks; the pieces are one message.
        text=text,
        tool_calls=tuple(calls),
        usage=_usage(body.get("usage")),
        finish_reason=reason,
        stop=stop,
        native=tuple(blocks),
        usage_reported=_reported_usage(body.get("usage")) is not None,
        refusal=refusal,
    )


def wire_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The transcript as the API accepts it: tool results right after their calls and
    first in their turn, user and assistant alternating, no empty content (except that a
    final empty assistant message is left out), no trailing whitespace at the end of a
    final assistant message."""
    wire: list[dict[str, Any]] = []
    for message in pair_tool_results([m for m in messages if m.role != "system"]):
        role, blocks = _wire_turn(message)
        # Tool results travel as user turns, so several results in a row (or results
        # followed by a user message) would break the alternation: merge neighbours.
        if wire and wire[-1]["role"] == role:
            wire[-1]["content"] = _results_first(_as_blocks(wire[-1]["content"]) + _as_blocks(blocks))
        else:
            wire.append({"role": role, "content": blocks})
    if wire and wire[-1]["role"] == "assistant":
        last = _without_trailing_whitespace(wire[-1]["content"])
        if _is_empty(last):
            wire.pop()
        else:
            wire[-1]["content"] = last
    for turn in wire:
        if _is_empty(turn["content"]):
            turn["content"] = EMPTY_REPLY if turn["role"] == "assistant" else EMPTY_MESSAGE
    return wire


def _wire_turn(message: ChatMessage) -> tuple[str, Content]:
    if message.role == "tool":
        if message.tool_call_id is None:
            raise ValueError("a tool message must name the tool_call_id it answers")
        result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id}
        result["content"] = message.content
        if message.is_error:
            result["is_error"] = True
        return "user", [result]
    if message.role == "assistant" and message.native is not None:
        # Verbatim: thinking blocks must come back unchanged (their signature covers them).
        return "assistant", _as_blocks([dict(block) for block in message.native])
    if message.role == "assistant" and message.tool_calls:
        tool_uses = [_wire_tool_use(call) for call in message.tool_calls]
        return "assistant", _as_blocks(message.content) + tool_uses
    return message.role, message.content


def _as_blocks(content: Content) -> list[dict[str, Any]]:
    """Content as blocks, without the blank text blocks the API rejects."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content.strip() else []
    return [block for block in content if not (block.get("type") == "text" and not str(block.get("text", "")).strip())]


def _results_first(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # In a user turn, tool_result blocks must come before any other content.
    return sorted(blocks, key=lambda block: block.get("type") != "tool_result")


def _is_empty(content: Content) -> bool:
    return not content.strip() if isinstance(content, str) else not _as_blocks(content)


def _without_trailing_whitespace(content: Content) -> Content:
    if isinstance(content, str):
        return content.rstrip()
    blocks = _as_blocks(content)
    if blocks and blocks[-1].get("type") == "text":
        blocks[-1] = {**blocks[-1], "text": str(blocks[-1]["text"]).rstrip()}
    return blocks


def _wire_tool_use(call: ToolCall) -> dict[str, Any]:
    # `input` must be an object; see `tool_input`.
    return {"type": "tool_use", "id": call.call_id, "name": call.name, "input": tool_input(call.arguments)}


def _wire_tool(tool: ToolSpec) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise malformed(f"{where}.text is not a string")
    return text


def _parse_tool_use(block: dict[str, Any], where: str) -> ToolCall:
    input_object = expect_object(block.get("input"), f"{where}.input")
    return build_tool_call(block.get("id"), block.get("name"), orjson.dumps(input_object).decode(), where)


def _refusal_explanation(raw: object) -> str | None:
    details = raw if isinstance(raw, dict) else {}
    explanation = details.get("explanation")
    return explanation if isinstance(explanation, str) and explanation.strip() else None


def _reported_usage(raw: object) -> Usage | None:
    """The reply's usage, when it says both what it read and what it wrote."""
    return _usage(raw) if counts_given(raw, "input_tokens", "output_tokens") else None


def _usage(raw: object) -> Usage:
    """`input_tokens` on this wire excludes the cache reads and writes; `Usage` counts the
    whole prompt, so they are added back."""
    usage = optional_object(raw, "usage")
    uncached = token_count(usage, "input_tokens", "usage")
    read = token_count(usage, "cache_read_input_tokens", "usage")
    written = token_count(usage, "cache_creation_input_tokens", "usage")
    details = optional_object(usage.get("output_tokens_details"), "usage.output_tokens_details")
    return build_usage(
        input=uncached + read + written,
        output=token_count(usage, "output_tokens", "usage"),
        cached_input=read,
        cache_write=written,
        reasoning=token_count(details, "thinking_tokens", "usage.output_tokens_details"),
    )


class AnthropicMessagesStream:
    """`message_start` (the message, content empty, input usage), then per content block
    `content_block_start`, deltas (`text_delta`, `input_json_delta` fragments of a tool's
    input, `thinking_delta`, `signature_delta`, `citations_delta`) and `content_block_stop`;
    `message_delta` with the stop reason and output usage (a count it gives as null leaves
    `message_start`'s standing, as the SDK's accumulator does); `message_stop`. `ping` is
    ignored; `error` (e.g. `overloaded_error`) fails the request.

    A tool input that does not parse is a malformed reply, unless the reply was cut off by
    its output allowance (`max_tokens`): then the call was cut off mid-input, and is left
    out (never run on a guess); the reply is a cut-off one, its text and usage kept."""

    def __init__(self) -> None:
        self._done = False
        self._message: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}
        self._unparsed: dict[int, str] = {}  # tool inputs that are not JSON, by block
        # Whether message_delta gave the reply's output count: message_start's is a placeholder.
        self._counted = False

    @property
    def done(self) -> bool:
        # (message_delta, which carries the stop reason, carries the final usage too)
        return self._done or self._message.get("stop_reason") is not None

    def feed(self, event: SseEvent) -> str | None:
        if event.event == "ping":
            return None
        data = stream_event_json(event)
        kind = data.get("type", event.event)
        if kind == "error":
            raise stream_error(data.get("error"))
        if kind == "message_start":
            self._message = dict(expect_object(data.get("message"), "message_start.message"))
        elif kind == "content_block_start":
            self._blocks[self._index(data)] = dict(expect_object(data.get("content_block"), "content_block"))
        elif kind == "content_block_delta":
            return self._delta(self._index(data), expect_object(data.get("delta"), "content_block_delta.delta"))
        elif kind == "content_block_stop":
            self._close(self._index(data))
        elif kind == "message_delta":
            self._message.update(optional_object(data.get("delta"), "message_delta.delta"))
            usage = optional_object(data.get("usage"), "message_delta.usage")
            given = {name: count for name, count in usage.items() if count is not None}
            self._counted = self._counted or "output_tokens" in given
            self._message["usage"] = {**optional_object(self._message.get("usage"), "usage"), **given}
        elif kind == "message_stop":
            self._done = True
        return None

    def _index(self, data: dict[str, Any]) -> int:
        index = data.get("index")
        if not isinstance(index, int):
            raise malformed(f"a {data.get('type')} event has no index")
        return index

    def _delta(self, index: int, delta: dict[str, Any]) -> str | None:
        block = self._blocks.get(index)
        if block is None:
            raise malformed(f"a delta for content block {index}, which never started")
        kind = delta.get("type")
        if kind == "text_delta":
            text = str(delta.get("text", ""))
            block["text"] = str(block.get("text", "")) + text
            return text or None
        if kind == "input_json_delta":
            self._json.setdefault(index, []).append(str(delta.get("partial_json", "")))
        elif kind == "thinking_delta":
            block["thinking"] = str(block.get("thinking", "")) + str(delta.get("thinking", ""))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "citations_delta":
            block["citations"] = [*(block.get("citations") or []), delta.get("citation")]
        return None

    def _close(self, index: int) -> None:
        pieces = self._json.pop(index, None)
        block = self._blocks.get(index)
        if pieces is None or block is None:
            return
        text = "".join(pieces)
        try:
            block["input"] = orjson.loads(text) if text else {}
        except orjson.JSONDecodeError:
            self._unparsed[index] = text  # judged once the stop reason is known

    def payload(self) -> dict[str, Any]:
        for index in sorted(self._json):  # a tool input whose block never stopped
            self._close(index)
        if self._unparsed:
            index, text = min(self._unparsed.items())
            if _STOPS.get(str(self._message.get("stop_reason"))) != "truncated":
                # Never run a call on a guess at its arguments.
                error = malformed(f"content[{index}] (tool_use) input is not JSON: {text[:80]!r}")
                bill(error, self._reported(), _reported_usage)
                raise error
        blocks = (block for index, block in sorted(self._blocks.items()) if index not in self._unparsed)
        return {**self._message, "usage": self._reported(), "content": list(blocks)}

    def _reported(self) -> dict[str, Any]:
        """The usage as the stream reported it. message_start's output count is a placeholder:
        without message_delta's, the output count, and so the cost, is unknown."""
        usage = dict(optional_object(self._message.get("usage"), "usage"))
        if not self._counted:
            usage.pop("output_tokens", None)
        return usage

"""The OpenAI chat completions wire format (`POST {base_url}/chat/completions`), as the
official OpenAPI document (`CreateChatCompletionRequest`, `CreateChatCompletionResponse`)
describes it; also spoken by OpenAI-compatible servers."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

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
    build_tool_call,
    build_usage,
    counts_given,
    expect_list,
    expect_object,
    finish_reason,
    malformed,
    object_arguments,
    optional_object,
    pair_tool_results,
    parse_billed,
    reply_model,
    stream_error,
    stream_event_json,
    token_count,
)

# finish_reason -> stop kind. A refusal arrives as `message.refusal` with finish_reason
# "stop"; a reason outside the spec (compatible servers) counts as the end of the reply.
_STOPS: dict[str, StopKind] = {
    "stop": "end",
    "length": "truncated",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "content_filter",
}


@dataclass(frozen=True, slots=True)
class OpenAIChat:
    """`legacy_max_tokens` names the models whose server only knows the deprecated
    `max_tokens` (some OpenAI-compatible servers); "*" means every model. Everyone else
    gets `max_completion_tokens`, which o-series and later models require."""

    legacy_max_tokens: Collection[str] = frozenset()

    @property
    def family(self) -> ProtocolFamily:
        return "openai"

    def url(self, base_url: str) -> str:
        return base_url.rstrip("/") + "/chat/completions"

    def headers(self, api_key: str | None) -> dict[str, str]:
        # Local OpenAI-compatible servers often run without auth; send no header then.
        return {"authorization": f"Bearer {api_key}"} if api_key else {}

    def request_body(self, request: ModelRequest, stream: bool = False) -> dict[str, Any]:
        legacy = "*" in self.legacy_max_tokens or request.model in self.legacy_max_tokens
        body: dict[str, Any] = {
            "model": request.model,
            "messages": [_wire_message(message) for message in pair_tool_results(request.messages)],
            ("max_tokens" if legacy else "max_completion_tokens"): request.max_output_tokens,
        }
        # An empty `tools` array is rejected by some compatible servers; omit it instead.
        if request.tools:
            body["tools"] = [_wire_tool(tool) for tool in request.tools]
        if stream:
            # Without include_usage a streamed reply reports no tokens at all.
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def assembler(self) -> OpenAIChatStream:
        return OpenAIChatStream()

    def parse_reply(self, payload: Any, requested_model: str) -> ModelReply:
        return parse_billed(payload, requested_model, _reply, _reported_usage)


def _reply(body: dict[str, Any], requested_model: str) -> ModelReply:
    choices = expect_list(body.get("choices"), "choices")
    if not choices:
        raise malformed("choices is empty")
    choice = expect_object(choices[0], "choices[0]")
    message = expect_object(choice.get("message"), "choices[0].message")
    content = _optional_text(message, "content")
    refusal = _optional_text(message, "refusal")
    calls = _parse_tool_calls(message.get("tool_calls"))
    reason = finish_reason(choice.get("finish_reason"))
    stop: StopKind = "refusal" if refusal else _STOPS.get(reason, "tool_use" if calls else "end")
    return ModelReply(
        model=reply_model(body.get("model"), requested_model),
        text=refusal if refusal else content,
        tool_calls=calls,
        usage=_usage(body.get("usage")),
        finish_reason=reason,
        stop=stop,
        usage_reported=_reported_usage(body.get("usage")) is not None,
        refusal=refusal,
    )


def _wire_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        if message.tool_call_id is None:
            raise ValueError("a tool message must name the tool_call_id it answers")
        # No error flag on this wire: the content says "error: ..." itself.
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        return {
            "role": "assistant",
            # The wire format wants null, not "", when the assistant only called tools.
            "content": message.content or None,
            "tool_calls": [_wire_tool_call(call) for call in message.tool_calls],
        }
    return {"role": message.role, "content": message.content}


def _wire_tool_call(call: ToolCall) -> dict[str, Any]:
    # As the model said them, unless they are no JSON object: one bad call would otherwise
    # fail every later turn of the conversation on some servers; its result says it did not run.
    function = {"name": call.name, "arguments": object_arguments(call.arguments)}
    return {"id": call.call_id, "type": "function", "function": function}


def _wire_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def _optional_text(message: dict[str, Any], key: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise malformed(f"choices[0].message.{key} is not a string")
    return value


def _parse_tool_calls(raw: object) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    calls = expect_list(raw, "choices[0].message.tool_calls")
    return tuple(_parse_tool_call(call, f"tool_calls[{index}]") for index, call in enumerate(calls))


def _parse_tool_call(raw: object, where: str) -> ToolCall:
    call = expect_object(raw, where)
    function = expect_object(call.get("function"), f"{where}.function")
    arguments = function.get("arguments")
    # Invalid JSON inside the string is the model's mistake, recorded by the turn loop;
    # a non-string is the server breaking the wire format.
    if not isinstance(arguments, str):
        raise malformed(f"{where}.function.arguments is not a string")
    return build_tool_call(call.get("id"), function.get("name"), arguments, where)


def _reported_usage(raw: object) -> Usage | None:
    """The reply's usage, when it says both what it read and what it wrote."""
    return _usage(raw) if counts_given(raw, "prompt_tokens", "completion_tokens") else None


def _usage(raw: object) -> Usage:
    """`CompletionUsage`: prompt tokens include the cached ones, completion tokens the
    reasoning ones, as `Usage` counts them. `prompt_tokens_details.cache_write_tokens` is
    left in the uncached input: OpenAI bills a prompt written to its cache as the ordinary
    input it is (no write surcharge); read as a cache write, it was priced at the table's
    write price for OpenAI, 0 (80k written tokens cost nothing; a price given with no write
    price made the reply's cost unknown, pausing the turn)."""
    usage = optional_object(raw, "usage")
    prompt = optional_object(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details")
    completion = optional_object(usage.get("completion_tokens_details"), "usage.completion_tokens_details")
    return build_usage(
        input=token_count(usage, "prompt_tokens", "usage"),
        output=token_count(usage, "completion_tokens", "usage"),
        cached_input=token_count(prompt, "cached_tokens", "usage.prompt_tokens_details"),
        reasoning=token_count(completion, "reasoning_tokens", "usage.completion_tokens_details"),
    )


class OpenAIChatStream:
    """`ChatCompletionChunk`s, each a `data:` event, until `data: [DONE]`. Text and refusal
    arrive as string deltas; a tool call as pieces keyed by its `index` (id and name in the
    first, `arguments` in fragments); usage in a last chunk with no choices."""

    def __init__(self) -> None:
        self._done = False
        self._model: object = None
        self._content: list[str] = []
        self._refusal: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: object = None
        self._usage: object = None
        self._chose = False  # whether any chunk had a choice

    @property
    def done(self) -> bool:
        # (after the finish reason, only the usage chunk may be missing: the cost is then unknown)
        return self._done or self._finish is not None

    def feed(self, event: SseEvent) -> str | None:
        if event.data.strip() == "[DONE]":
            self._done = True
            return None
        chunk = stream_event_json(event)
        if chunk.get("error"):  # as openai-python's stream reader: `"error": null` is no error
            raise stream_error(chunk["error"])
        self._model = chunk.get("model", self._model)
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        choices = expect_list(chunk.get("choices", []), "chunk.choices")
        if not choices:
            return None
        self._chose = True
        choice = expect_object(choices[0], "chunk.choices[0]")
        self._finish = choice.get("finish_reason") or self._finish
        delta = optional_object(choice.get("delta"), "chunk.choices[0].delta")
        for piece in expect_list(delta.get("tool_calls") or [], "delta.tool_calls"):
            self._add_call_piece(expect_object(piece, "delta.tool_calls[]"))
        if isinstance(delta.get("refusal"), str):
            self._refusal.append(delta["refusal"])
        text = delta.get("content")
        if isinstance(text, str) and text:
            self._content.append(text)
            return text
        return None

    def _add_call_piece(self, piece: dict[str, Any]) -> None:
        index = piece.get("index")
        if not isinstance(index, int):
            raise malformed("a streamed tool call has no index")
        call = self._calls.setdefault(index, {"id": None, "type": "function", "name": "", "arguments": []})
        call["id"] = piece.get("id") or call["id"]
        function = optional_object(piece.get("function"), "delta.tool_calls[].function")
        if isinstance(function.get("name"), str):
            call["name"] += function["name"]
        if isinstance(function.get("arguments"), str):
            call["arguments"].append(function["arguments"])

    def payload(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self._content) if self._content else None,
            "refusal": "".join(self._refusal) if self._refusal else None,
        }
        if self._calls:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": "".join(call["arguments"])},
                }
                for _, call in sorted(self._calls.items())
            ]
        choice = {"index": 0, "message": message, "finish_reason": self._finish}
        body: dict[str, Any] = {"choices": [choice] if self._chose else []}  # none at all: malformed
        if self._model is not None:
            body["model"] = self._model
        if self._usage is not None:
            body["usage"] = self._usage
        return body

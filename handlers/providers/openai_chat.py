"""A client for OpenAI-compatible chat completions (`POST {base_url}/chat/completions`)."""

from __future__ import annotations

from typing import Any

import httpx
from turnstile.events import ToolCall
from turnstile.handlers.provider import ChatMessage, ModelReply, ModelRequest, ProtocolFamily, ToolSpec
from turnstile.handlers.providers.http_errors import (
    JsonHttp,
    build_tool_call,
    build_usage,
    expect_list,
    expect_object,
    finish_reason,
    malformed,
    reply_model,
)


class OpenAIChatProvider:
    family: ProtocolFamily = "openai"

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout_s: float = 60.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self._url = base_url.rstrip("/") + "/chat/completions"
        # Local OpenAI-compatible servers often run without auth; send no header then.
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = JsonHttp(secret=api_key, timeout_s=timeout_s, client=client)

    async def complete(self, request: ModelRequest) -> ModelReply:
        payload = await self._http.post(self._url, self._headers, request_body(request))
        return parse_reply(payload, request.model)

    async def aclose(self) -> None:
        await self._http.aclose()


def request_body(request: ModelRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [_wire_message(message) for message in request.messages],
        "max_tokens": request.max_output_tokens,
    }
    # An empty `tools` array is rejected by some compatible servers; omit it instead.
    if request.tools:
        body["tools"] = [_wire_tool(tool) for tool in request.tools]
    return body


def _wire_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        if message.tool_call_id is None:
            raise ValueError("a tool message must name the tool_call_id it answers")
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
    # `arguments` goes back verbatim, malformed or not: it is what the model said.
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.call_id, "type": "function", "function": function}


def _wire_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def parse_reply(payload: Any, requested_model: str) -> ModelReply:
    body = expect_object(payload, "response")
    choices = expect_list(body.get("choices"), "choices")
    if not choices:
        raise malformed("choices is empty")
    choice = expect_object(choices[0], "choices[0]")
    message = expect_object(choice.get("message"), "choices[0].message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise malformed("choices[0].message.content is not a string")
    return ModelReply(
        model=reply_model(body.get("model"), requested_model),
        text=content,
        tool_calls=_parse_tool_calls(message.get("tool_calls")),
        usage=build_usage(body.get("usage"), "prompt_tokens", "completion_tokens"),
        finish_reason=finish_reason(choice.get("finish_reason")),
    )


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

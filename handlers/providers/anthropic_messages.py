"""A client for the Anthropic Messages API (`POST {base_url}/v1/messages`)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
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

# Content is either a plain string or a list of typed blocks, as on the wire.
Content = str | list[dict[str, Any]]


class AnthropicMessagesProvider:
    family: ProtocolFamily = "anthropic"

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout_s: float = 60.0,
        client: httpx.AsyncClient | None = None,
        anthropic_version: str = "2023-06-01",
    ) -> None:
        self._url = base_url.rstrip("/") + "/v1/messages"
        self._headers = {"anthropic-version": anthropic_version}
        if api_key:
            self._headers["x-api-key"] = api_key
        self._http = JsonHttp(secret=api_key, timeout_s=timeout_s, client=client)

    async def complete(self, request: ModelRequest) -> ModelReply:
        payload = await self._http.post(self._url, self._headers, request_body(request))
        return parse_reply(payload, request.model)

    async def aclose(self) -> None:
        await self._http.aclose()


def request_body(request: ModelRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_output_tokens,
        "messages": _wire_messages(request.messages),
    }
    # The API has no system role: every system message, wherever it sits, becomes the
    # top-level system prompt.
    system = "\n\n".join(message.content for message in request.messages if message.role == "system")
    if system:
        body["system"] = system
    if request.tools:
        body["tools"] = [_wire_tool(tool) for tool in request.tools]
    return body


def _wire_messages(messages: tuple[ChatMessage, ...]) -> list[dict[str, Any]]:
    wire: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "system":
            continue
        role, content = _wire_turn(message)
        # Tool results travel as user turns, so several results in a row (or results
        # followed by a user message) would break the required user/assistant alternation:
        # merge same-role neighbours into one turn of blocks.
        if wire and wire[-1]["role"] == role:
            wire[-1]["content"] = _as_blocks(wire[-1]["content"]) + _as_blocks(content)
        else:
            wire.append({"role": role, "content": content})
    return wire


def _wire_turn(message: ChatMessage) -> tuple[str, Content]:
    if message.role == "tool":
        if message.tool_call_id is None:
            raise ValueError("a tool message must name the tool_call_id it answers")
        result = {"type": "tool_result", "tool_use_id": message.tool_call_id, "content": message.content}
        return "user", [result]
    if message.role == "assistant" and message.tool_calls:
        tool_uses = [_wire_tool_use(call) for call in message.tool_calls]
        return "assistant", _as_blocks(message.content) + tool_uses
    return message.role, message.content


def _as_blocks(content: Content) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    # The API rejects empty text blocks.
    return [{"type": "text", "text": content}] if content else []


def _wire_tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.call_id, "name": call.name, "input": _tool_input(call.arguments)}


def _tool_input(arguments: str) -> dict[str, Any]:
    # `input` must be an object. Arguments that are not one (e.g. malformed JSON from an
    # OpenAI-family model earlier in the history) were never executed, and their tool
    # result says so; an empty object keeps the transcript valid.
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _wire_tool(tool: ToolSpec) -> dict[str, Any]:
    return {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}


def parse_reply(payload: Any, requested_model: str) -> ModelReply:
    body = expect_object(payload, "response")
    texts: list[str] = []
    calls: list[ToolCall] = []
    for index, raw in enumerate(expect_list(body.get("content"), "content")):
        where = f"content[{index}]"
        block = expect_object(raw, where)
        if block.get("type") == "text":
            texts.append(_block_text(block, where))
        elif block.get("type") == "tool_use":
            calls.append(_parse_tool_use(block, where))
        # Other block types (thinking, server-side tools) carry nothing the turn loop consumes.
    return ModelReply(
        model=reply_model(body.get("model"), requested_model),
        # Text may arrive split around citations or tool_use blocks; the pieces are one message.
        text="".join(texts) if texts else None,
        tool_calls=tuple(calls),
        usage=build_usage(body.get("usage"), "input_tokens", "output_tokens"),
        finish_reason=finish_reason(body.get("stop_reason")),
    )


def _block_text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise malformed(f"{where}.text is not a string")
    return text


def _parse_tool_use(block: dict[str, Any], where: str) -> ToolCall:
    tool_input = expect_object(block.get("input"), f"{where}.input")
    return build_tool_call(block.get("id"), block.get("name"), orjson.dumps(tool_input).decode(), where)

"""The rules the Anthropic Messages API enforces on a request body, as its documentation
states them (https://docs.anthropic.com/en/api/messages, "Tool use: handling tool results",
"Extended thinking"), and the 400 messages it answers with when they are broken.

`violations(body)` lists what the real API would reject; tests use it both to check the
bodies the wire format builds and inside a mock server that answers 400 as the API does.
"""

from __future__ import annotations

import re
from typing import Any

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ASSISTANT_ONLY = {"tool_use", "thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result"}
USER_ONLY = {"tool_result", "image", "document"}


def violations(body: dict[str, Any]) -> list[str]:
    found: list[str] = []
    if not isinstance(body.get("model"), str) or not body["model"]:
        found.append("model: field required")
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        found.append("max_tokens: must be an integer >= 1")
    system = body.get("system")
    if system is not None and not (isinstance(system, str) and system.strip()):
        found.append("system: must be non-empty text")
    for index, tool in enumerate(body.get("tools", [])):
        if not TOOL_NAME.match(str(tool.get("name", ""))):
            found.append(f"tools.{index}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'")
        if (tool.get("input_schema") or {}).get("type") != "object":
            found.append(f"tools.{index}.input_schema: type must be 'object'")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return [*found, "messages: at least one message is required"]
    if messages[0].get("role") != "user":
        found.append("messages: first message must use the \"user\" role")
    for index in range(len(messages)):
        found += _message_violations(messages, index)
    return found


def _message_violations(messages: list[dict[str, Any]], index: int) -> list[str]:
    message = messages[index]
    where = f"messages.{index}"
    role, content = message.get("role"), message.get("content")
    final = index == len(messages) - 1
    if role not in ("user", "assistant"):
        return [f"{where}.role: Input should be 'user' or 'assistant'"]
    if index and messages[index - 1].get("role") == role:
        return [f"{where}: roles must alternate between \"user\" and \"assistant\""]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        return [f"{where}.content: must be a string or a list of blocks"]
    found: list[str] = []
    empty = not blocks or (isinstance(content, str) and not content)
    if empty and not (final and role == "assistant"):
        found.append(
            f"{where}: all messages must have non-empty content except for the optional final assistant message"
        )
    for number, block in enumerate(blocks if not isinstance(content, str) or content else []):
        kind = block.get("type")
        if kind == "text" and not str(block.get("text", "")).strip():
            found.append(f"{where}.content.{number}.text: text content blocks must contain non-whitespace text")
        if kind in (ASSISTANT_ONLY if role == "user" else USER_ONLY):
            found.append(f"{where}.content.{number}: {kind} blocks are not allowed in {role} messages")
        if kind == "tool_result" and "is_error" in block and not isinstance(block["is_error"], bool):
            found.append(f"{where}.content.{number}.is_error: must be a boolean")
        if kind == "tool_use" and not isinstance(block.get("input"), dict):
            found.append(f"{where}.content.{number}.input: must be an object")
    if final and role == "assistant" and blocks and blocks[-1].get("type") == "text":
        text = str(blocks[-1].get("text", ""))
        if text and text != text.rstrip():
            found.append("final assistant content cannot end with trailing whitespace")
    return found + _tool_pairing(messages, index)


def _tool_pairing(messages: list[dict[str, Any]], index: int) -> list[str]:
    """tool_use in an assistant turn -> tool_result for each id in the next user turn, first
    in its content; every tool_result answers a tool_use of the turn just before."""
    message = messages[index]
    blocks = message["content"] if isinstance(message["content"], list) else []
    found: list[str] = []
    if message["role"] == "assistant":
        ids = [b.get("id") for b in blocks if b.get("type") == "tool_use"]
        if len(set(ids)) != len(ids):
            found.append(f"messages.{index}: tool_use ids must be unique")
        if ids:
            following = messages[index + 1] if index + 1 < len(messages) else None
            answered = _result_ids(following) if following else []
            missing = [i for i in ids if i not in answered]
            if missing:
                found.append(
                    f"messages.{index + 1}: `tool_use` ids were found without `tool_result` blocks immediately "
                    f"after: {', '.join(map(str, missing))}"
                )
    else:
        results = [b for b in blocks if b.get("type") == "tool_result"]
        kinds = [b.get("type") for b in blocks]
        if results and kinds[: len(results)] != ["tool_result"] * len(results):
            found.append(f"messages.{index}: tool_result blocks must come FIRST in the content array")
        previous = messages[index - 1] if index else {"content": []}
        earlier = previous.get("content", [])
        asked = {b.get("id") for b in earlier if isinstance(b, dict) and b.get("type") == "tool_use"}
        for block in results:
            if block.get("tool_use_id") not in asked:
                found.append(
                    f"messages.{index}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{block.get('tool_use_id')}. Each `tool_result` block must have a corresponding `tool_use` "
                    "block in the previous message."
                )
    return found


def _result_ids(message: dict[str, Any]) -> list[Any]:
    content = message.get("content")
    blocks = content if isinstance(content, list) else []
    return [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]

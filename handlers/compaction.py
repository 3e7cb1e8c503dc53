"""Deterministic compaction of older tool exchanges: their results are replaced by a short
stub before the next request, so a turn near a budget sends less. The structure of the
transcript (every tool call still answered by one result) is kept, so it stays valid in
both wire formats."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from turnstile.handlers.provider import ChatMessage

STUB_PREFIX = "[compacted result: "
EXCERPT_CHARS = 80


def compact_tool_exchanges(
    messages: Sequence[ChatMessage], keep_last: int = 1
) -> tuple[tuple[ChatMessage, ...], tuple[str, ...]]:
    """Replace the results of every tool exchange except the last `keep_last` ones.

    An exchange is an assistant message that called tools plus the results answering it.
    Returns the new transcript and the call ids whose results were compacted now
    (results compacted before are left as they are and not reported again)."""
    exchange_starts = [i for i, m in enumerate(messages) if m.role == "assistant" and m.tool_calls]
    if len(exchange_starts) <= keep_last:
        return tuple(messages), ()
    cutoff = exchange_starts[-keep_last] if keep_last > 0 else len(messages)
    out: list[ChatMessage] = []
    compacted: list[str] = []
    for index, message in enumerate(messages):
        if index < cutoff and message.role == "tool" and not message.content.startswith(STUB_PREFIX):
            out.append(replace(message, content=_stub(message.content)))
            compacted.append(message.tool_call_id or "")
        else:
            out.append(message)
    return tuple(out), tuple(c for c in compacted if c)


def _stub(content: str) -> str:
    excerpt = " ".join(content.split())
    if len(excerpt) > EXCERPT_CHARS:
        excerpt = excerpt[:EXCERPT_CHARS] + "..."
    return f"{STUB_PREFIX}{len(content)} chars] {excerpt}"

"""The context a turn sends to the model: history up to the boundary, then the claimed
inputs as the final user input. Messages that arrive later are not in it: they wait."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from handlers.provider import ChatMessage
from projections import HistoryEntry, PendingInput


def render_pending(rows: Sequence[PendingInput]) -> str:
    """One input is sent as it is; several are listed in order with their UTC times, so
    the model can resolve "that one" and sees that it is answering a batch."""
    if len(rows) == 1:
        return rows[0].content
    lines = [f"[{_hh_mm(row.occurred_at)}] {row.content}" for row in rows]
    return "## Unanswered messages\n\n" + "\n\n".join(lines)


def _hh_mm(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).strftime("%H:%M")


def build_context(
    history: Sequence[HistoryEntry],
    history_boundary: int,
    inputs: Sequence[PendingInput],
    system_prompt: str | None,
) -> tuple[ChatMessage, ...]:
    """History stops at the turn's boundary (a replay long after the turn sees the same
    context as the turn did), and the claimed inputs never appear in history, only as the
    final user message."""
    messages: list[ChatMessage] = []
    if system_prompt:
        messages.append(ChatMessage("system", system_prompt))
    messages.extend(ChatMessage(entry.role, entry.content) for entry in history[:history_boundary])
    messages.append(ChatMessage("user", render_pending(inputs)))
    return tuple(messages)

"""The context a turn sends to the model: history up to the boundary, then the claimed
inputs as the final user input. Messages that arrive later are not in it: they wait."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from turnstile.handlers.provider import ChatMessage
from turnstile.projections import HistoryEntry, PendingInput

# What a later turn sends in place of an input the model refused (`HistoryEntry.withheld`):
# the model knows something was asked and declined, without the words that were refused.
WITHHELD_INPUT = "[A message the model declined to answer earlier; its text is left out]"


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
    rendered: list[ChatMessage] | None = None,
) -> tuple[ChatMessage, ...]:
    """History stops at the turn's boundary (a replay long after the turn sees the same
    context as the turn did), and the claimed inputs never appear in history, only as the
    final user message. The inputs of a turn the model refused are sent as `WITHHELD_INPUT`.

    `rendered`, if given, is the caller's cache of this conversation's history as messages,
    one per entry from the first, kept across turns: history is append-only and its entries
    never change, so only the entries it lacks up to the boundary are rendered (and
    appended to it); each turn then costs a copy of references instead of a message per entry."""
    if rendered is None:
        rendered = []
    if len(rendered) < history_boundary:
        rendered.extend(_message(entry) for entry in history[len(rendered) : history_boundary])
    final = ChatMessage("user", render_pending(inputs))
    if system_prompt:
        return (ChatMessage("system", system_prompt), *rendered[:history_boundary], final)
    return (*rendered[:history_boundary], final)


def _message(entry: HistoryEntry) -> ChatMessage:
    return ChatMessage(entry.role, WITHHELD_INPUT if entry.withheld else entry.content)

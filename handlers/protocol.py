"""Protocol failures: what the model is told when a call cannot run, and when the same
invalid call repeated unchanged calls for a strategy change or stops the turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RepeatAction = Literal["report", "change_strategy", "stop"]


@dataclass(frozen=True, slots=True)
class RepeatPolicy:
    """After `change_strategy_after` occurrences of one invalid call the model is told to
    change strategy; at `stop_after` the turn stops."""

    change_strategy_after: int = 2
    stop_after: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.change_strategy_after <= self.stop_after:
            raise ValueError("need 1 <= change_strategy_after <= stop_after")

    def action(self, occurrences: int) -> RepeatAction:
        if occurrences >= self.stop_after:
            return "stop"
        if occurrences >= self.change_strategy_after:
            return "change_strategy"
        return "report"


STRATEGY_CHANGE = (
    "You have made this exact invalid call {n} times. Do not repeat it: change strategy "
    "(another tool, different arguments, or answer without tools)."
)


def tool_error(detail: str, occurrences: int, policy: RepeatPolicy) -> str:
    """The tool result the model reads for a call that did not run."""
    text = f"error: {detail}"
    if policy.action(occurrences) != "report":
        text += " " + STRATEGY_CHANGE.format(n=occurrences)
    return text


def repeated_call_error(tool: str, arguments: str, occurrences: int) -> str:
    """The user-visible reason a turn stopped on a repeated invalid call."""
    shown = arguments if len(arguments) <= 200 else arguments[:200] + "..."
    return (
        f"The model repeated the same invalid tool call {occurrences} times "
        f"({tool} with arguments {shown}), so the turn was stopped."
    )

"""Resume from the journal: what the next step of an interrupted attempt is.

A new owner of a turn whose run stopped mid-attempt (crash, lost partition, drain out of
grace) does not start over. The journal of the run (its `ModelResponded`,
`ToolCallStarted`, `ToolCallFinished` and `ProtocolFailure` events, in log order) is the
transcript the next attempt continues from: every recorded model step is kept and every
finished tool call keeps its recorded result. What is left is decided here, purely:

- nothing worth keeping (no model step with tool calls): start over;
- a call started and not finished: a read-only one runs again; a side-effecting one runs
  again with its idempotency key if the tool is idempotent, is asked of its reconciler if
  it has one, and otherwise makes the turn unresumable (it fails visibly, as before);
- the remaining calls of the last step run as usual, then the loop asks the model next.

A final reply (no tool calls) recorded without its outcome is not kept: the model is asked
that step again. The final reply and its outcome are sent in one round trip, so only a
crash inside that window costs one repeated request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from turnstile.events import Event, ModelResponded, ProtocolFailure, ToolCallFinished, ToolCallStarted

# The providers' words for a reply cut off by its output allowance (OpenAI's `length`,
# Anthropic's `max_tokens` and `model_context_window_exceeded`), as `ModelResponded` keeps them.
CUT_OFF = frozenset({"length", "max_tokens", "model_context_window_exceeded"})

# How a call started and not finished is settled: run again (read-only), run again with
# its idempotency key, asked of the tool's reconciler, or not at all.
Recovery = Literal["rerun", "idempotent", "reconcile", "none"]


def idempotency_key(conversation_id: str, turn_id: str, call_id: str) -> str:
    """Stable over every run of one call of one logical turn of one conversation, and
    nothing else: turn ids repeat across conversations (two that both send message `m-1`
    have turns of one id) and call ids may too (a server numbering them `call-1`), so a
    key of those two alone let one customer's call be deduplicated against another's."""
    return hashlib.sha256(f"{conversation_id}\x00{turn_id}\x00{call_id}".encode()).hexdigest()[:32]


def key_of_first_run(journal: Sequence[Event], call_id: str) -> str | None:
    """The idempotency key the call's first run was given, as its `ToolCallStarted` on the
    log says: a run again must present the same key, whatever this version would derive
    (keys were derived without the conversation id before)."""
    for event in journal:
        if isinstance(event, ToolCallStarted) and event.call_id == call_id and event.idempotency_key is not None:
            return event.idempotency_key
    return None


def started_before(journal: Sequence[Event], start: ToolCallStarted) -> bool:
    """Whether a run of the turn before `start`'s started the same call: it may have acted."""
    return any(
        isinstance(event, ToolCallStarted) and event.call_id == start.call_id and event.run_id != start.run_id
        for event in journal
    )


@dataclass(frozen=True, slots=True)
class StartOver:
    """The journal holds no step worth keeping: a new attempt from the inputs."""


@dataclass(frozen=True, slots=True)
class Unresumable:
    """A side-effecting call started, did not finish, and nothing can say whether it acted."""

    call: ToolCallStarted


@dataclass(frozen=True, slots=True)
class Resume:
    """Continue after `steps[-1]`: its calls without a result are settled first."""

    steps: tuple[ModelResponded, ...]
    results: Mapping[str, ToolCallFinished]
    # Protocol failures recorded for a call (its tool error is what the model read).
    refused: Mapping[str, ProtocolFailure]
    # Calls started and not finished, and how each is settled (never "none").
    in_doubt: Mapping[str, Recovery] = field(default_factory=dict)

    @property
    def iteration(self) -> int:
        return self.steps[-1].iteration


NextStep = StartOver | Unresumable | Resume


def next_step(journal: Sequence[Event], recovery_of: Callable[[ToolCallStarted], Recovery]) -> NextStep:
    """The next step of an interrupted attempt, given its journal in log order.
    `recovery_of` says how the registry's tool can settle a call left in doubt."""
    steps: list[ModelResponded] = []
    started: dict[str, ToolCallStarted] = {}
    results: dict[str, ToolCallFinished] = {}
    refused: dict[str, ProtocolFailure] = {}
    for event in journal:
        match event:
            case ModelResponded():
                steps.append(event)
            case ToolCallStarted():
                started[event.call_id] = event
            case ToolCallFinished():
                results[event.call_id] = event
            case ProtocolFailure() if event.call_id is not None and event.kind != "repeated_call":
                refused[event.call_id] = event
            case _:
                pass
    while steps and (not steps[-1].tool_calls or steps[-1].finish_reason in CUT_OFF):
        # A final (or paused) reply without its outcome is asked again; so is one cut off by
        # its output allowance, whose calls never run (the last one's arguments may be cut).
        steps.pop()
    if not steps:
        return StartOver()
    in_doubt: dict[str, Recovery] = {}
    for call_id, start in started.items():
        if call_id in results:
            continue
        how = recovery_of(start) if start.side_effect else "rerun"
        if how == "none":
            return Unresumable(start)
        in_doubt[call_id] = how
    return Resume(tuple(steps), results, refused, in_doubt)

"""Approving, denying and resuming a paused turn: the input event an operator's command
writes, decided from the conversation's folded state.

Each input's id is derived from the turn it answers (`approval:TURN:CALL`, see
`approval_key`; `resume:TURN`), so running the same command twice writes a duplicate the fold ignores,
not a second turn. A different second decision (deny after approve, another note) would
conflict on that id and be dead-lettered, so it is refused here while the first one waits
for its claim. Pure: the caller passes the event id and the time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from turnstile.events import Approval, InputInjected, ResumeRequested, input_id, logical_turn_id
from turnstile.events.base import MAX_ID_CHARS
from turnstile.events.inputs import MAX_CONTENT_CHARS
from turnstile.handlers.claim import NOTHING_TO_CONTINUE, DebouncePolicy, claims_ahead, refused_by_model
from turnstile.projections import ConversationState, PendingInput
from turnstile.projections.state import TurnRecord

# An operator's note is a sentence or a paragraph for the model; the bound keeps the input
# it goes into within the event's content limit, whatever the call's arguments.
MAX_NOTE_CHARS = 10_000


@dataclass(frozen=True, slots=True)
class Refused:
    """Why the operation cannot apply, in one sentence that names the fix."""

    reason: str


@dataclass(frozen=True, slots=True)
class Operation:
    event: InputInjected | ResumeRequested
    # The logical turn that will answer it: the claim that takes its input with the inputs
    # pending now, oldest first (more inputs arriving before the claim would change it).
    turn_id: str

    @property
    def input_id(self) -> str:
        """The id the event's input is pending under (and judged a duplicate or conflict by)."""
        return input_id(self.event)


@dataclass(frozen=True, slots=True)
class AlreadyTaken:
    """The same decision is on the log and a turn has claimed it: nothing is written (a
    command run twice is harmless). `turn_id`: the logical turn that took it."""

    input_id: str
    turn_id: str

    @property
    def said(self) -> str:
        return f"{self.input_id} is on the log already, and turn {self.turn_id[:12]} took it: nothing written"


def _taken(
    state: ConversationState, call_id: str, approved: bool, turn_id: str | None
) -> AlreadyTaken | Refused | None:
    """A decision on call `call_id` that a turn has claimed: the same one (AlreadyTaken), the
    other one (Refused: a decision cannot be changed), or None when none was claimed."""
    for turn in reversed(state.turns.values()):
        call = turn.pending_call
        if call is None or call.call_id != call_id or (turn_id is not None and not turn.turn_id.startswith(turn_id)):
            continue
        key = approval_key(turn.turn_id, call_id)
        taker = state.claimed_by.get(key)
        if taker is None:
            continue
        was_approved = _decision_taken(state, taker, call.name)
        if was_approved is None:
            continue  # (its text is not in memory: the checks below answer)
        if was_approved == approved:
            return AlreadyTaken(key, taker)
        was = "approved" if was_approved else "denied"
        return Refused(f"call {call_id!r} of turn {turn.turn_id[:12]} was {was} already (turn {taker[:12]} took it)")
    return None


def _decision_head(approved: bool, tool: str) -> str:
    """How a decision's text begins (`decide_approval` writes it; `_decision_taken` reads it)."""
    return f"{'Approved' if approved else 'Denied'}: {tool} with arguments "


def _decision_taken(state: ConversationState, taker: str, tool: str) -> bool | None:
    """Whether the decision the turn `taker` claimed (running, or ended: in history) was an
    approval; None when its text is not found."""
    if state.active is not None and state.active.turn_id == taker:
        texts = [i.content for i in state.active.inputs]
    else:
        texts = [e.content for e in state.history if e.turn_id == taker and e.role == "user"]
    for approved in (True, False):
        if any(t.startswith(_decision_head(approved, tool)) for t in texts):
            return approved
    return None


def _last_turn(state: ConversationState) -> TurnRecord | Refused:
    who = f"conversation {state.conversation_id!r}"
    if state.active is not None:
        return Refused(f"{who} has a turn running ({state.active.turn_id[:12]}); wait for its outcome")
    if not state.turns:
        return Refused(f"{who} has no turns: nothing is paused")
    return next(reversed(state.turns.values()))


def awaiting_approval(state: ConversationState) -> TurnRecord | None:
    """The newest turn paused for an approval (its `pending_call`, the call to approve or
    deny) that is still undecided, when no turn runs; else None."""
    if state.active is not None:
        return None
    return next(iter(_undecided(state)), None)


def _undecided(state: ConversationState) -> list[TurnRecord]:
    """The turns paused for an approval whose decision no turn has claimed, newest first.
    Not only the last turn: a user who writes again while a call waits ("any news on my
    refund?") gets a turn of its own, and the call still waits for its decision."""
    waiting = []
    for turn in reversed(state.turns.values()):
        call = turn.pending_call
        if turn.outcome != "paused" or call is None:
            continue
        key = approval_key(turn.turn_id, call.call_id)
        if key not in state.seen_inputs or key in state.pending:  # (pending: a duplicate is harmless)
            waiting.append(turn)
    return waiting


def approval_key(turn_id: str, call_id: str) -> str:
    """`approval:TURN:CALL`, the id of the decision on a call: an input id is at most 256
    characters, a call id too, so a call id that would not fit (over 182 characters after a
    64-character turn id) is named by its sha256 instead: a decision on it stays possible."""
    key = f"approval:{turn_id}:{call_id}"
    if len(key) <= MAX_ID_CHARS:
        return key
    return f"approval:{turn_id}:sha256:{hashlib.sha256(call_id.encode()).hexdigest()}"


def _note_problem(note: str | None) -> Refused | None:
    if note is not None and len(note) > MAX_NOTE_CHARS:
        return Refused(f"the note has {len(note):,} characters; at most {MAX_NOTE_CHARS:,} are taken")
    return None


def _conflict(state: ConversationState, input_id: str, content: str, what: str) -> Refused | None:
    """A different input already written under this id and not yet claimed: the fold keeps
    the first and dead-letters the second, so writing it would only look like it worked."""
    waiting = state.pending.get(input_id)
    if waiting is None or waiting.content == content:
        return None
    return Refused(f"{what} is already on the log, waiting for its claim; the first one stands")


def _next_turn(state: ConversationState, written: PendingInput, policy: DebouncePolicy) -> str:
    """The logical turn that will take `written` (as pending once on the log; the same
    decision written before keeps its place), with the inputs pending now."""
    key = written.input_id
    pending = [*state.pending.values()] if key in state.pending else [*state.pending.values(), written]
    batch = next(b for b in claims_ahead(pending, policy) if any(p.input_id == key for p in b))
    return logical_turn_id(p.input_id for p in batch)


def decide_approval(
    state: ConversationState,
    call_id: str,
    approved: bool,
    note: str | None,
    *,
    event_id: str,
    now_ms: int,
    policy: DebouncePolicy = DebouncePolicy(),
    turn_id: str | None = None,
) -> Operation | Refused | AlreadyTaken:
    """`turn_id` (or its first characters) names the paused turn, when more than one waits
    on a call of this id (call ids are unique within a turn, not across turns)."""
    if (taken := _taken(state, call_id, approved, turn_id)) is not None:
        return taken
    last = _last_turn(state)
    if isinstance(last, Refused):
        return last
    undecided = _undecided(state)
    matching = [t for t in undecided if t.pending_call is not None and t.pending_call.call_id == call_id]
    named = [t for t in matching if turn_id is None or t.turn_id.startswith(turn_id)]
    if len(named) > 1:
        turns = ", ".join(t.turn_id[:12] for t in named)
        return Refused(f"call {call_id!r} waits in {len(named)} turns ({turns}): name one with --turn (HTTP: turn_id)")
    if not named:
        if matching:
            return Refused(f"no turn {turn_id!r} waits on call {call_id!r}; {matching[0].turn_id[:12]} does")
        return _not_waiting(state, last, undecided, call_id)
    asked = named[0]
    call, turn = asked.pending_call, asked.turn_id[:12]
    assert call is not None
    if problem := _note_problem(note):
        return problem
    head = _decision_head(approved, call.name)
    tail = "." + (f" Note: {note}" if note else "")
    # The arguments may be as long as an input's whole content: cut what does not fit.
    room = MAX_CONTENT_CHARS - len(head) - len(tail)
    shown = call.arguments if len(call.arguments) <= room else call.arguments[: room - 1] + "…"
    content = head + shown + tail
    key = approval_key(asked.turn_id, call.call_id)
    if conflict := _conflict(state, key, content, f"a decision on call {call.call_id!r} of turn {turn}"):
        return conflict
    event = InputInjected(
        event_id=event_id,
        conversation_id=state.conversation_id,
        occurred_at=now_ms,
        occurrence_key=key,
        source="approval",
        content=content,
        approval=Approval(turn_id=asked.turn_id, call_id=call.call_id, approved=approved),
    )
    return Operation(event, _next_turn(state, PendingInput(key, "injected", content, now_ms), policy))


def _not_waiting(state: ConversationState, last: TurnRecord, undecided: list[TurnRecord], call_id: str) -> Refused:
    """Why no call `call_id` waits for a decision, naming what does wait, if anything."""
    if undecided:
        newest = undecided[0]
        assert newest.pending_call is not None
        call = newest.pending_call
        return Refused(
            f"turn {newest.turn_id[:12]} waits for approval of call {call.call_id!r} ({call.name}), not {call_id!r}"
        )
    turn = last.turn_id[:12]
    if last.outcome == "paused" and last.pending_call is None:
        return Refused(
            f"turn {turn} paused on its budget, not for an approval; continue it with "
            f"`turnstile resume {state.conversation_id}`"
        )
    return Refused(f"conversation {state.conversation_id!r} has nothing paused: its last turn {turn} {last.outcome}")


def decide_resume(
    state: ConversationState,
    note: str | None,
    *,
    event_id: str,
    now_ms: int,
    policy: DebouncePolicy = DebouncePolicy(),
) -> Operation | Refused:
    last = _last_turn(state)
    if isinstance(last, Refused):
        return last
    turn = last.turn_id[:12]
    if last.outcome == "completed":
        return Refused(f"conversation {state.conversation_id!r} has nothing to resume: its last turn {turn} completed")
    if refused_by_model(state, last.turn_id):
        return Refused(f"the model refused turn {turn} of {state.conversation_id!r}: {NOTHING_TO_CONTINUE}")
    if last.pending_call is not None:
        call = last.pending_call
        return Refused(
            f"turn {turn} waits for approval of call {call.call_id!r} ({call.name}); decide it with "
            f"`turnstile approve|deny {state.conversation_id} {call.call_id}`"
        )
    if problem := _note_problem(note):
        return problem
    request_id = f"resume:{last.turn_id}"
    content = note or "Continue."
    if conflict := _conflict(state, request_id, content, f"a resume request of turn {turn} with another note"):
        return conflict
    event = ResumeRequested(
        event_id=event_id,
        conversation_id=state.conversation_id,
        occurred_at=now_ms,
        request_id=request_id,
        resumes_turn_id=last.turn_id,
        content=content,
    )
    return Operation(event, _next_turn(state, PendingInput(request_id, "resume", content, now_ms), policy))


Verb = Literal["approve", "deny", "resume"]
VERBS: tuple[Verb, ...] = ("approve", "deny", "resume")


def decide_operation(
    state: ConversationState,
    verb: Verb,
    call_id: str | None,
    note: str | None,
    *,
    event_id: str,
    now_ms: int,
    policy: DebouncePolicy = DebouncePolicy(),
    turn_id: str | None = None,
) -> Operation | Refused | AlreadyTaken:
    """One operator verb, as the CLI and the HTTP API both take it."""
    if verb == "resume":
        return decide_resume(state, note, event_id=event_id, now_ms=now_ms, policy=policy)
    if not call_id:
        return Refused(f"{verb} needs the id of the call the turn paused on (turnstile inspect shows it)")
    approved = verb == "approve"
    return decide_approval(
        state, call_id, approved, note, event_id=event_id, now_ms=now_ms, policy=policy, turn_id=turn_id
    )

"""The turn's rules that are not the loop itself, as named decisions: what makes a turn
isolated, whether a failed attempt is retried, what a turn taken over carries out of its
last attempt's verdict and whether it may go on,
which approval decides a call, and what a tool's result is as the model reads it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeGuard

from turnstile.events import STOPPED_MID_ATTEMPT, Event, ToolCallFinished, ToolCallStarted, encode
from turnstile.handlers.failure_text import MAX_ATTEMPTS, NOT_REPLAYED, stopped_too_often, unresumable
from turnstile.handlers.provider import ProviderError
from turnstile.handlers.resume import NextStep, Resume, Unresumable
from turnstile.handlers.tools import call_signature
from turnstile.handlers.turn_steps import ToolRaised, ToolReturned, ToolTimedOut
from turnstile.projections import AttemptVerdict, PendingInput

# A tool result is recorded in ToolCallFinished: keep it well inside one log value.
MAX_RESULT_CHARS = 100_000
DENIED = "error: the user denied this call; it did not run. Do not call it again."
DID_NOT_RUN = "error: this call did not run."
RECONCILED_NOT_RUN = (
    "error: this call did not run (the worker stopped as it began, and nothing shows it had an effect); "
    "make it again if it is still needed"
)


def isolated_turn(inputs: Iterable[PendingInput]) -> bool:
    """A turn of scheduled inputs only: nobody is watching, so only tools marked for
    isolated turns are offered."""
    return all(i.kind == "injected" and i.source == "schedule" for i in inputs)


def retries_after(error: ProviderError, model_attempts: int, max_attempts: int, side_effect_started: bool) -> bool:
    """Whether the turn's attempt failed with `error` is followed by another: only for a
    retryable error, within the attempt allowance (`model_attempts` made so far, stopped
    ones not counted), and never once a side-effecting call started (rule 9: a new attempt
    replays the turn from its inputs)."""
    return error.retryable and model_attempts < max_attempts and not side_effect_started


def owner_verdict(verdict: AttemptVerdict | None) -> Literal["go_on", "fail", "retry"]:
    """What a turn taken over carries out of the verdict its last attempt closed with. No
    verdict (the run stopped mid-attempt) or a takeover's closing (`STOPPED_MID_ATTEMPT`):
    go on from the journal. Failed for good by its owner: fail, writing the outcome that
    owner did not get to write (rule 9: the next owner never runs on a turn its owner
    decided to fail). Failed retryably (its owner died backing off): retry as that owner
    would have -- a fresh attempt from the inputs, once its backoff, counted from the
    failure's time, is over."""
    if verdict is None or verdict.reason == STOPPED_MID_ATTEMPT:
        return "go_on"
    return "retry" if verdict.retryable else "fail"


# Takeovers of a turn whose worker stopped mid-attempt: a rolling deploy's rebalances may cut a
# long model call more than once (each cut is an attempt on the log), and that is no failure of
# the model's, so such stops are counted apart from its attempts; a turn that kills its worker
# each time stops here.
STOPS_ALLOWED = 10


def takeover_failure(
    step: NextStep, side_effect_started: bool, model_attempts: int, stops: int, max_attempts: int
) -> str | None:
    """Why a turn taken over cannot go on (its TurnFailed error), or None when the next
    attempt starts (resuming the journal when `step` says so). `model_attempts`: those that
    ran to a verdict (the stopped are `stops`)."""
    if isinstance(step, Unresumable):
        return unresumable(step.call.tool, step.call.call_id)
    if side_effect_started and not isinstance(step, Resume):
        return NOT_REPLAYED
    if stops > STOPS_ALLOWED:
        return stopped_too_often(stops)
    if model_attempts >= max_attempts:
        return MAX_ATTEMPTS
    return None


def approval_of(inputs: Iterable[PendingInput], signature: str, used: set[str]) -> tuple[bool, str] | None:
    """The decision of an approval claimed by this turn on exactly this call (same tool,
    same normalized arguments) and the approval's call id, if any. An approval lets one
    call run, not a series: `used` holds the call ids of approvals already spent."""
    for item in inputs:
        grant = item.grant
        if grant is None or call_signature(grant.tool, grant.arguments) != signature:
            continue
        if not grant.approved:
            return False, grant.call_id
        if grant.call_id not in used:
            return True, grant.call_id
    return None


def tool_outcome(seen: ToolReturned | ToolRaised | ToolTimedOut, timeout_s: float) -> tuple[str, bool]:
    """The result the model reads and whether the call succeeded: only text is a result."""
    match seen:
        case ToolReturned(result=None):
            return f"error: the tool returned {seen.returned}, not text", False
        case ToolReturned(result=str() as result):
            return result, True
        case ToolRaised():
            return f"error: {seen.error}", False
        case ToolTimedOut():
            return f"error: the tool did not finish within {timeout_s:g} s", False
    raise AssertionError(seen)


def fenced(event: Event) -> TypeGuard[ToolCallStarted]:
    """Whether the run may go on after appending `event` only once it is read back as
    accepted: a side-effecting `ToolCallStarted`. Written after another owner's takeover it
    is ignored by every reader -- and its tool must not run either (the zombie case)."""
    return isinstance(event, ToolCallStarted) and event.side_effect


def bounded_result(result: str) -> str:
    return result if len(result) <= MAX_RESULT_CHARS else _truncated(result, MAX_RESULT_CHARS)


def result_cut_to_fit(finished: ToolCallFinished, whole: str, limit: int) -> ToolCallFinished | None:
    """`finished` with the longest start of the tool's `whole` result (and a note saying it
    was cut) whose value fits the log's `limit` bytes: a result is worth keeping in part,
    the tool having acted. None when not even the note fits."""

    def cut(chars: int) -> ToolCallFinished:
        return finished.model_copy(update={"result": _truncated(whole, chars)})

    if len(encode(cut(0))) > limit:
        return None
    # cut(fits) fits; cut(over) is known not to: it is what did not fit (the bounded result).
    fits, over = 0, min(len(whole), MAX_RESULT_CHARS)
    while over - fits > 1:
        middle = (fits + over) // 2
        fits, over = (middle, over) if len(encode(cut(middle))) <= limit else (fits, middle)
    return cut(fits)


def _truncated(result: str, chars: int) -> str:
    return result[:chars] + f"\n[truncated: the result had {len(result)} characters]"

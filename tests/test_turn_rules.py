"""The turn's named rules, given/when/then: pure functions, no runner."""

from __future__ import annotations

from turnstile.events import STOPPED_MID_ATTEMPT, ProtocolFailure, ToolCall, ToolCallStarted
from turnstile.handlers.failure_text import MAX_ATTEMPTS, NOT_REPLAYED
from turnstile.handlers.pauses import DoneCall, kept_work
from turnstile.handlers.provider import ProviderError
from turnstile.handlers.resume import Resume, StartOver, Unresumable
from turnstile.handlers.tools import call_signature
from turnstile.handlers.turn_rules import (
    MAX_RESULT_CHARS,
    STOPS_ALLOWED,
    approval_of,
    bounded_result,
    fenced,
    isolated_turn,
    owner_verdict,
    retries_after,
    takeover_failure,
    tool_outcome,
)
from turnstile.handlers.turn_steps import ToolRaised, ToolReturned, ToolTimedOut
from turnstile.projections import ApprovalGrant, AttemptVerdict, PendingInput

RETRYABLE = ProviderError("server_error", "500", retryable=True)


def test_a_turn_is_isolated_only_when_every_input_is_scheduled():
    scheduled = PendingInput("s1", "injected", "tick", 0, "schedule")
    assert isolated_turn([scheduled])
    assert not isolated_turn([scheduled, PendingInput("m1", "message", "hi", 1)])


def test_a_failed_attempt_is_retried_only_if_retryable_within_the_allowance_and_before_a_side_effect():
    assert retries_after(RETRYABLE, 1, 3, side_effect_started=False)
    assert not retries_after(RETRYABLE, 3, 3, side_effect_started=False)
    assert not retries_after(RETRYABLE, 1, 3, side_effect_started=True)
    assert not retries_after(ProviderError("authentication", "401", retryable=False), 1, 3, False)


def test_a_takeover_carries_out_the_verdict_its_last_attempt_closed_with():
    # A run that stopped mid-attempt, or one a takeover closed: on from the journal.
    assert owner_verdict(None) == "go_on"
    assert owner_verdict(AttemptVerdict(retryable=False, reason=STOPPED_MID_ATTEMPT, at=5)) == "go_on"
    assert owner_verdict(AttemptVerdict(retryable=True, reason=STOPPED_MID_ATTEMPT, at=5)) == "go_on"
    # The owner's own verdict stands: failed for good is failed; retryable is retried.
    assert owner_verdict(AttemptVerdict(retryable=False, reason="timeout: slow", at=5)) == "fail"
    assert owner_verdict(AttemptVerdict(retryable=True, reason="server_error: 500", at=5)) == "retry"


def test_a_takeover_goes_on_unless_a_side_effect_cannot_be_settled_or_attempts_are_used():
    start = ToolCallStarted(
        event_id="e", conversation_id="c", occurred_at=0, turn_id="t", run_id="r", attempt=1,
        iteration=1, call_id="c1", tool="send", arguments="{}", side_effect=True,
    )  # fmt: skip
    assert "send, call c1" in (takeover_failure(Unresumable(start), True, 1, 0, 3) or "")
    assert takeover_failure(StartOver(), True, 1, 0, 3) == NOT_REPLAYED
    assert takeover_failure(StartOver(), False, 3, 0, 3) == MAX_ATTEMPTS
    assert takeover_failure(StartOver(), False, 1, 0, 3) is None
    assert takeover_failure(Resume((), {}, {}), True, 1, 0, 3) is None
    # stops are counted apart from the model's attempts, and bounded
    assert takeover_failure(StartOver(), False, 2, STOPS_ALLOWED, 3) is None
    assert "stopped mid-attempt 11 times" in (takeover_failure(StartOver(), False, 0, STOPS_ALLOWED + 1, 3) or "")


def test_an_approval_decides_exactly_its_call_once():
    grant = ApprovalGrant("t0", "call_9", "wire", '{"to": "bob"}', approved=True)
    inputs = [PendingInput("a1", "injected", "approved", 0, "approval", grant)]
    same = call_signature("wire", '{ "to":"bob" }')
    used: set[str] = set()
    assert approval_of(inputs, same, used) == (True, "call_9")
    used.add("call_9")
    assert approval_of(inputs, same, used) is None  # one approval, one call
    assert approval_of(inputs, call_signature("wire", '{"to": "eve"}'), set()) is None
    denied = [PendingInput("a1", "injected", "no", 0, "approval", ApprovalGrant("t0", "call_9", "wire", "{}", False))]
    assert approval_of(denied, call_signature("wire", "{}"), set()) == (False, "call_9")


def test_tool_results_are_text_or_a_named_error():
    assert tool_outcome(ToolReturned("ok", 0), 5) == ("ok", True)
    assert tool_outcome(ToolReturned(None, 0, "int"), 5) == ("error: the tool returned int, not text", False)
    assert tool_outcome(ToolRaised("ValueError: bad", 0), 5) == ("error: ValueError: bad", False)
    assert tool_outcome(ToolTimedOut(0), 2.5) == ("error: the tool did not finish within 2.5 s", False)
    long = "x" * (MAX_RESULT_CHARS + 10)
    assert bounded_result(long).endswith(f"[truncated: the result had {len(long)} characters]")
    assert bounded_result("short") == "short"


def test_a_pause_keeps_the_reply_the_results_and_the_calls_not_run():
    blocked = (ToolCall(call_id="c3", name="send", arguments="{}"),)
    kept = kept_work("so far", [DoneCall("search", "{}", True, "r" * 400)], blocked)
    lines = kept.splitlines()
    assert lines[0] == "so far" and lines[1] == "Completed operations:"
    assert lines[2].startswith("- search({}) -> ok: rrr") and lines[2].endswith("...")
    assert lines[-1] == "- send({}) [call c3]"
    assert kept_work(None, []) == ""


def test_only_a_side_effecting_start_is_fenced_by_its_read_back():
    def start(side_effect: bool) -> ToolCallStarted:
        return ToolCallStarted(
            event_id="e", conversation_id="c", occurred_at=0, turn_id="t", run_id="r", attempt=1,
            iteration=1, call_id="c1", tool="send", arguments="{}", side_effect=side_effect,
        )  # fmt: skip

    assert fenced(start(True)) and not fenced(start(False))
    assert not fenced(ProtocolFailure(
        event_id="p", conversation_id="c", occurred_at=0, turn_id="t", run_id="r", attempt=1,
        iteration=1, model="m", kind="unknown_tool", detail="no such tool",
    ))  # fmt: skip

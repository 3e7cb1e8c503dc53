"""Approve, deny and resume as operations: the pure decision from folded state, and the
commands end to end on the embedded log against a served Agent."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from builders import completed, started
from worker_harness import events_of

from turnstile import Agent, LogPlace, TestModel
from turnstile.events import (
    Event,
    InputInjected,
    MessageReceived,
    ResumeRequested,
    ToolCall,
    ToolCallFinished,
    TurnClaimed,
    TurnCompleted,
    TurnPaused,
    decode,
    encode,
    logical_turn_id,
)
from turnstile.events.inputs import MAX_CONTENT_CHARS
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, claim_event, plan_claim
from turnstile.handlers.operations import (
    MAX_NOTE_CHARS,
    Operation,
    Refused,
    awaiting_approval,
    decide_approval,
    decide_resume,
)
from turnstile.projections import apply_event, new_state
from turnstile.projections.state import TurnRecord
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Topics

ROOT = Path(__file__).parent.parent
CALL = ToolCall(call_id="call-1", name="send_email", arguments='{"to": "a@b.c"}')


def state_with(outcome: str, pending_call: ToolCall | None = None):  # type: ignore[no-untyped-def]
    state = new_state("c1")
    state.turns["t1"] = TurnRecord("t1", ("m1",), outcome, 1, pending_call)  # type: ignore[arg-type]
    return state


def test_given_a_turn_paused_for_approval_when_its_call_is_approved_then_an_approval_input_names_it() -> None:
    decided = decide_approval(state_with("paused", CALL), "call-1", True, "ok by me", event_id="e", now_ms=5)
    assert isinstance(decided, Operation) and isinstance(decided.event, InputInjected)
    assert decided.event.approval is not None and decided.event.approval.approved
    assert (decided.event.occurrence_key, decided.event.source) == ("approval:t1:call-1", "approval")
    assert decided.event.content.startswith("Approved: send_email") and "Note: ok by me" in decided.event.content
    assert decided.turn_id == logical_turn_id(["approval:t1:call-1"])


def test_given_more_messages_pending_than_a_claim_takes_when_approved_then_the_turn_named_is_the_one_that_takes_it(
) -> None:
    state = state_with("paused", CALL)
    for n in (2, 3, 4):
        message = MessageReceived(event_id=f"e{n}", conversation_id="c1", occurred_at=n, message_id=f"m{n}",
                                  content="and another thing")  # fmt: skip
        assert apply_event(state, message) is None
    two = DebouncePolicy(quiet_ms=0, max_wait_ms=0, max_batch=2)
    decided = decide_approval(state, "call-1", True, None, event_id="e", now_ms=10, policy=two)
    assert isinstance(decided, Operation)
    # The oldest first: m2 and m3 go first, the decision with m4 after them.
    assert decided.turn_id == logical_turn_id(["m4", "approval:t1:call-1"])
    assert apply_event(state, decided.event) is None
    first = plan_claim(state, 10, two)
    assert isinstance(first, ClaimPlan) and first.input_ids == ("m2", "m3")
    # and once that turn has its outcome, the next claim is the turn named
    claimed = claim_event(state, first, event_id="c-1", run_id="r-1", now_ms=11)
    assert apply_event(state, claimed) is None
    assert apply_event(state, started(claimed, 12)) is None
    assert apply_event(state, completed(claimed, 13)) is None
    second = plan_claim(state, 14, two)
    assert isinstance(second, ClaimPlan) and second.turn_id == decided.turn_id
    # Written again before its claim, it keeps its place (its first stamp, not the new one).
    again = decide_approval(state, "call-1", True, None, event_id="e2", now_ms=1, policy=two)
    assert isinstance(again, Operation) and again.turn_id == decided.turn_id


def test_given_a_call_id_as_long_as_a_tool_call_may_have_when_approved_then_the_decision_fits_an_input_id() -> None:
    for call_id in ("c" * 182, "c" * 183, "c" * 256, "call\n1"):
        long_call = ToolCall(call_id=call_id, name="send_email", arguments="{}")
        paused = new_state("c1")
        paused.turns["t" * 64] = TurnRecord("t" * 64, ("m1",), "paused", 1, long_call)
        decided = decide_approval(paused, call_id, True, None, event_id="e", now_ms=5)
        # (an input id over 256 characters made the event invalid: a 500, and no way to decide)
        assert isinstance(decided, Operation) and isinstance(decided.event, InputInjected), call_id
        key = decided.event.occurrence_key
        assert len(key) <= 256 and decide_approval(paused, call_id, True, None, event_id="e", now_ms=5) == decided
        assert key == (f"approval:{'t' * 64}:{call_id}" if len(call_id) <= 182 else key)
        assert decided.event.approval is not None and decided.event.approval.call_id == call_id
        assert apply_event(paused, decided.event) is None  # the fold takes it, as the grant of that call
        assert paused.pending[key].grant is not None


def test_given_no_paused_approval_when_approving_then_the_refusal_says_why() -> None:
    wrong = decide_approval(state_with("paused", CALL), "call-9", False, None, event_id="e", now_ms=5)
    assert wrong == Refused("turn t1 waits for approval of call 'call-1' (send_email), not 'call-9'")
    done = decide_approval(state_with("completed"), "call-1", True, None, event_id="e", now_ms=5)
    assert done == Refused("conversation 'c1' has nothing paused: its last turn t1 completed")
    budget = decide_approval(state_with("paused"), "call-1", True, None, event_id="e", now_ms=5)
    assert isinstance(budget, Refused) and "`turnstile resume c1`" in budget.reason
    empty = decide_approval(new_state("c1"), "call-1", True, None, event_id="e", now_ms=5)
    assert empty == Refused("conversation 'c1' has no turns: nothing is paused")


def test_given_a_call_waiting_when_the_user_writes_again_then_it_still_waits_for_its_decision() -> None:
    # Given a turn paused for approval of a call, and the user's follow-up ("any news on my
    # refund?") answered by a turn of its own
    state = state_with("paused", CALL)
    state.turns["t2"] = TurnRecord("t2", ("m2",), "completed", 1, None)
    # Then the call still waits: shown, and approvable by its id
    assert awaiting_approval(state) == state.turns["t1"]
    decided = decide_approval(state, "call-1", True, None, event_id="e", now_ms=5)
    assert isinstance(decided, Operation) and isinstance(decided.event, InputInjected)
    assert decided.event.approval is not None and decided.event.approval.turn_id == "t1"
    # (written twice before its claim: a duplicate, as for the last turn)
    assert apply_event(state, decided.event) is None
    assert awaiting_approval(state) == state.turns["t1"]
    # When a turn claims the decision, then nothing waits any more
    state.pending.clear()
    state.turns["t3"] = TurnRecord("t3", (decided.input_id,), "completed", 1, None)
    assert awaiting_approval(state) is None
    again = decide_approval(state, "call-1", False, None, event_id="e2", now_ms=6)
    assert again == Refused("conversation 'c1' has nothing paused: its last turn t3 completed")


def test_given_calls_of_one_id_waiting_in_two_turns_then_a_decision_must_name_its_turn() -> None:
    # Given two paused turns whose calls a server numbered alike (call ids are unique within
    # a turn only): tA waits on a refund of 100, tB on one of 5,000
    state = new_state("c1")
    small = ToolCall(call_id="call_0", name="refund", arguments='{"usd": 100}')
    large = ToolCall(call_id="call_0", name="refund", arguments='{"usd": 5000}')
    state.turns["tA" * 8] = TurnRecord("tA" * 8, ("m1",), "paused", 1, small)
    state.turns["tB" * 8] = TurnRecord("tB" * 8, ("m2",), "paused", 1, large)
    # When approved by call id alone, then it is refused, naming both turns: never the wrong one
    refused = decide_approval(state, "call_0", True, None, event_id="e", now_ms=5)
    assert isinstance(refused, Refused) and "waits in 2 turns (tBtBtBtBtBtB, tAtAtAtAtAtA)" in refused.reason
    # When the turn is named (by its first characters), then that turn's call is approved
    decided = decide_approval(state, "call_0", True, None, event_id="e", now_ms=5, turn_id="tAtAtA")
    assert isinstance(decided, Operation) and isinstance(decided.event, InputInjected)
    assert decided.event.approval is not None and decided.event.approval.turn_id == "tA" * 8
    assert '{"usd": 100}' in decided.event.content
    wrong = decide_approval(state, "call_0", True, None, event_id="e", now_ms=5, turn_id="tC")
    assert isinstance(wrong, Refused) and "no turn 'tC' waits on call 'call_0'" in wrong.reason


def test_given_a_failed_turn_when_resumed_then_a_resume_request_names_it_once() -> None:
    decided = decide_resume(state_with("failed"), None, event_id="e", now_ms=5)
    assert isinstance(decided, Operation) and isinstance(decided.event, ResumeRequested)
    assert (decided.event.resumes_turn_id, decided.event.request_id) == ("t1", "resume:t1")
    assert decided.turn_id == logical_turn_id(["resume:t1"])
    waiting = decide_resume(state_with("paused", CALL), None, event_id="e", now_ms=5)
    assert isinstance(waiting, Refused) and "`turnstile approve|deny c1 call-1`" in waiting.reason
    assert isinstance(decide_resume(state_with("completed"), None, event_id="e", now_ms=5), Refused)


def test_given_a_note_past_its_bound_when_deciding_then_it_is_refused_not_a_crash() -> None:
    note = "n" * (MAX_NOTE_CHARS + 1)
    approval = decide_approval(state_with("paused", CALL), "call-1", True, note, event_id="e", now_ms=5)
    assert approval == Refused(f"the note has {MAX_NOTE_CHARS + 1:,} characters; at most {MAX_NOTE_CHARS:,} are taken")
    assert isinstance(decide_resume(state_with("failed"), note, event_id="e", now_ms=5), Refused)


def test_given_a_call_whose_arguments_fill_an_input_when_approved_then_they_are_cut_to_fit_with_the_note() -> None:
    huge = ToolCall(call_id="call-1", name="send_email", arguments="a" * MAX_CONTENT_CHARS)
    decided = decide_approval(state_with("paused", huge), "call-1", True, "go", event_id="e", now_ms=5)
    assert isinstance(decided, Operation) and isinstance(decided.event, InputInjected)
    assert len(decided.event.content) == MAX_CONTENT_CHARS and decided.event.content.endswith("…. Note: go")


def test_given_a_decision_waiting_for_its_claim_when_another_one_comes_then_it_is_refused_and_a_repeat_is_not() -> None:
    # Given an approval written and not claimed yet (the fold keeps the first input of an id
    # and dead-letters a different one, so a second decision would silently do nothing)
    state = state_with("paused", CALL)
    first = decide_approval(state, "call-1", True, "ok", event_id="e1", now_ms=5)
    assert isinstance(first, Operation)
    assert apply_event(state, first.event) is None
    # When the same decision comes again, it is the same input (a duplicate the fold ignores)
    again = decide_approval(state, "call-1", True, "ok", event_id="e2", now_ms=6)
    assert isinstance(again, Operation) and again.event.content == first.event.content
    # When a different one comes (a denial, another note), it is refused, naming the call
    for approved, note in ((False, None), (True, "other")):
        refused = decide_approval(state, "call-1", approved, note, event_id="e3", now_ms=7)
        assert refused == Refused(
            "a decision on call 'call-1' of turn t1 is already on the log, waiting for its claim; the first one stands"
        )
    # And so for a resume request with another note
    failed = state_with("failed")
    resumed = decide_resume(failed, "try again", event_id="e4", now_ms=5)
    assert isinstance(resumed, Operation)
    assert apply_event(failed, resumed.event) is None
    other = decide_resume(failed, None, event_id="e5", now_ms=6)
    assert isinstance(other, Refused) and "a resume request of turn t1 with another note" in other.reason


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnstile.streams.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, check=False)


async def serve_until(agent: Agent, data: Path, done: Callable[[Event], bool]) -> None:
    log = FileLog(data, Topics())
    stop = asyncio.Event()
    serving = asyncio.create_task(agent.serve(LogPlace(data=data), stop=stop, worker={"drain_grace_s": 0}))
    try:
        async with asyncio.timeout(30):
            # from_end is read before the served worker first runs: only what it writes now counts
            async for record in log.follow(log.topics.events, from_end=True):
                if done(decode(record.value)):  # type: ignore[arg-type]
                    break
    finally:
        stop.set()
    assert await asyncio.wait_for(serving, 10) == 0


def test_approve_on_the_command_line_names_the_turn_the_configured_claims_give(tmp_path: Path) -> None:
    # Given a paused call and two more messages pending, and workers that claim one input a turn
    call = TestModel.calls("send_email", '{"to": "a@b.c"}')
    agent = Agent("mail", model=TestModel(replies=[call]))

    @agent.tool(side_effect=True, needs_approval=True)
    def send_email(to: str) -> str:
        """Send an e-mail."""
        return f"sent to {to}"

    data = tmp_path / "log"
    paused = asyncio.run(agent.answer("mail me", data=data))
    assert isinstance(paused.outcome, TurnPaused)
    log = FileLog(data, Topics())
    for n in (2, 3):
        message = MessageReceived(event_id=f"e{n}", conversation_id="c1", occurred_at=n, message_id=f"m{n}",
                                  content="and then")  # fmt: skip
        asyncio.run(log.append(log.topics.events, "c1", encode(message)))
    config = tmp_path / "turnstile.toml"
    config.write_text("[debounce]\nmax_batch = 1\n")
    # When the call is approved, then the turn named is the third claim: the decision alone
    approved = cli("approve", "c1", "call-1", "--data", str(data), "--config", str(config))
    assert approved.returncode == 0, approved.stderr
    key = f"approval:{paused.outcome.turn_id}:call-1"
    assert approved.stdout.split("new logical turn ")[1].strip() == logical_turn_id([key])


def test_approve_on_the_command_line_lets_the_paused_call_run_in_the_turn_it_names(tmp_path: Path) -> None:
    sent: list[str] = []
    # The call, paused; after the approval the model makes it again (then it runs), and answers.
    call = TestModel.calls("send_email", '{"to": "a@b.c"}')
    model = TestModel(replies=[call, call, "Sent."])
    agent = Agent("mail", model=model)

    @agent.tool(side_effect=True, needs_approval=True)
    def send_email(to: str) -> str:
        """Send an e-mail."""
        sent.append(to)
        return f"sent to {to}"

    log = FileLog(tmp_path, Topics())
    message = MessageReceived(event_id="e1", conversation_id="c1", occurred_at=1, message_id="m1", content="mail me")
    asyncio.run(log.append(log.topics.events, "c1", encode(message)))
    asyncio.run(serve_until(agent, tmp_path, lambda e: isinstance(e, TurnPaused)))
    assert sent == []

    where = ["--data", str(tmp_path)]
    wrong = cli("approve", "c1", "call-9", *where)
    assert (wrong.returncode, wrong.stdout) == (1, "")
    assert wrong.stderr.strip().startswith("turnstile approve: turn ") and "not 'call-9'" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1
    approved = cli("approve", "c1", "call-1", "--note", "fine", *where)
    assert approved.returncode == 0, approved.stderr
    new_turn = approved.stdout.split("new logical turn ")[1].strip()

    asyncio.run(serve_until(agent, tmp_path, lambda e: isinstance(e, TurnCompleted)))
    assert sent == ["a@b.c"]
    events = events_of(log, "c1")
    claims = [e.turn_id for e in events if isinstance(e, TurnClaimed)]
    assert claims[-1] == new_turn
    assert [e.result for e in events if isinstance(e, ToolCallFinished)] == ["sent to a@b.c"]
    # The same command again: harmless, as the README says, and said so (it was exit 1, "nothing
    # paused"); the other decision is refused, naming the first
    again = cli("approve", "c1", "call-1", *where)
    assert again.returncode == 0, again.stderr
    assert f"is on the log already, and turn {new_turn[:12]} took it: nothing written" in again.stdout
    assert len(events_of(log, "c1")) == len(events)
    changed = cli("deny", "c1", "call-1", *where)
    assert changed.returncode == 1 and "was approved already" in changed.stderr
    nothing = cli("resume", "c1", *where)
    assert nothing.returncode == 1 and "has nothing to resume: its last turn" in nothing.stderr

"""Resume from the journal: the pure decision (`handlers.resume.next_step`) and the fold's
acceptance of a resumed attempt, given/when/then."""

from __future__ import annotations

import asyncio

import pytest
from builders import CONV, claim, eid, message, started
from loop_harness import Transfer

from turnstile.events import (
    STOPPED_MID_ATTEMPT,
    AttemptFailed,
    AttemptStarted,
    ModelResponded,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    Usage,
    encode,
)
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, plan_claim
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ModelReply
from turnstile.handlers.resume import Recovery, Resume, StartOver, Unresumable, idempotency_key, next_step
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.projections import apply_event, new_state
from turnstile.projections.audit import audit, render
from turnstile.streams.log import Record
from turnstile.streams.turn_runner import TurnRunner, TurnSettings

TURN = claim(["m1"], 1, 0)
PRICES = {"m": ModelPrice(input_per_mtok=1.0, output_per_mtok=2.0)}
ENV = {"conversation_id": CONV, "turn_id": TURN.turn_id, "run_id": "run-1", "attempt": 1}


def responded(iteration: int, *calls: tuple[str, str]) -> ModelResponded:
    tool_calls = tuple(ToolCall(call_id=c, name=n, arguments="{}") for c, n in calls)
    return ModelResponded(event_id=eid(), occurred_at=2, **ENV, iteration=iteration, model="m", tool_calls=tool_calls)


def tool_started(call_id: str, tool: str, side_effect: bool, key: str | None = None) -> ToolCallStarted:
    return ToolCallStarted(
        event_id=eid(), occurred_at=3, **ENV, iteration=1, call_id=call_id, tool=tool, arguments="{}",
        side_effect=side_effect, idempotency_key=key,
    )


def finished(call_id: str, result: str = "done") -> ToolCallFinished:
    return ToolCallFinished(event_id=eid(), occurred_at=4, **ENV, iteration=1, call_id=call_id, ok=True, result=result)


def recovery(how: Recovery):  # type: ignore[no-untyped-def]
    return lambda _start: how


def test_an_empty_journal_starts_over():
    assert next_step([], recovery("none")) == StartOver()


def test_a_final_reply_without_its_outcome_is_asked_again_but_earlier_steps_are_kept():
    first, final = responded(1, ("c1", "search")), responded(2)
    step = next_step([first, tool_started("c1", "search", False), finished("c1"), final], recovery("none"))
    assert isinstance(step, Resume) and step.steps == (first,) and step.iteration == 1
    assert set(step.results) == {"c1"} and step.in_doubt == {}


def test_a_model_step_whose_tool_never_started_resumes_at_that_tool():
    first = responded(1, ("c1", "transfer"))
    step = next_step([first], recovery("none"))
    assert isinstance(step, Resume) and step.steps == (first,) and step.results == {} and step.in_doubt == {}


def test_a_finished_side_effect_keeps_its_recorded_result():
    journal = [responded(1, ("c1", "transfer")), tool_started("c1", "transfer", True), finished("c1", "sent")]
    step = next_step(journal, recovery("none"))
    assert isinstance(step, Resume) and step.results["c1"].result == "sent" and step.in_doubt == {}


def test_an_unfinished_read_only_call_runs_again():
    step = next_step([responded(1, ("c1", "search")), tool_started("c1", "search", False)], recovery("none"))
    assert isinstance(step, Resume) and step.in_doubt == {"c1": "rerun"}


def test_an_unfinished_side_effect_is_settled_as_its_tool_says():
    journal = [responded(1, ("c1", "transfer")), tool_started("c1", "transfer", True)]
    for how in ("idempotent", "reconcile"):
        step = next_step(journal, recovery(how))
        assert isinstance(step, Resume) and step.in_doubt == {"c1": how}


def test_an_unfinished_side_effect_of_a_tool_that_cannot_settle_it_is_unresumable():
    start = tool_started("c1", "transfer", True)
    assert next_step([responded(1, ("c1", "transfer")), start], recovery("none")) == Unresumable(start)


def test_the_idempotency_key_is_stable_per_call_and_differs_between_calls_turns_and_conversations():
    # Turn ids repeat across conversations (both sent message "1") and call ids may too
    # (a server numbering them): a payment API deduplicating on the key must still see two.
    assert idempotency_key("alice", "t1", "c1") == idempotency_key("alice", "t1", "c1")
    keys = {idempotency_key(*ids) for ids in [("alice", "t1", "c1"), ("alice", "t1", "c2"), ("alice", "t2", "c1"),
                                              ("bob", "t1", "c1")]}  # fmt: skip
    assert len(keys) == 4


# -- the fold --------------------------------------------------------------------------------


def _interrupted(side_effect_key: str | None):  # type: ignore[no-untyped-def]
    state = new_state(CONV)
    for event in (message("m1", 0), TURN, started(TURN, 1), responded(1, ("c1", "transfer")),
                  tool_started("c1", "transfer", True, side_effect_key)):
        assert apply_event(state, event) is None
    failed = AttemptFailed(event_id=eid(), occurred_at=5, **ENV, reason=STOPPED_MID_ATTEMPT, retryable=False)
    assert apply_event(state, failed) is None
    return state


def resumed(resumes: str | None) -> AttemptStarted:
    return AttemptStarted(
        event_id=eid(), conversation_id=CONV, occurred_at=6, turn_id=TURN.turn_id, run_id="run-2", attempt=2,
        model="m", resumes_run_id=resumes,
    )


def test_the_fold_accepts_a_resumed_attempt_after_a_side_effect_and_keeps_its_journal():
    state = _interrupted("k")
    assert apply_event(state, resumed("run-1")) is None
    assert state.active is not None and state.active.iterations == 1
    assert [e.type for e in state.active.journal] == ["ModelResponded", "ToolCallStarted"]


def test_the_fold_still_refuses_a_fresh_attempt_after_a_side_effect_and_a_resume_of_another_run():
    assert apply_event(_interrupted(None), resumed(None)) is not None
    assert apply_event(_interrupted(None), resumed("run-0")) is not None


def test_a_resumed_attempt_may_not_repeat_a_model_step_or_rerun_a_side_effect_without_its_key():
    state = _interrupted(None)
    assert apply_event(state, resumed("run-1")) is None
    env2 = {**ENV, "run_id": "run-2", "attempt": 2}
    again = ModelResponded(event_id=eid(), occurred_at=7, **env2, iteration=1, model="m")
    assert apply_event(state, again) is not None
    rerun = ToolCallStarted(
        event_id=eid(), occurred_at=7, **env2, iteration=1, call_id="c1", tool="transfer", arguments="{}",
        side_effect=True,
    )
    assert apply_event(state, rerun) is not None
    assert apply_event(state, rerun.model_copy(update={"idempotency_key": "k"})) is None


# -- the auditor -------------------------------------------------------------------------------


def _records(*events):  # type: ignore[no-untyped-def]
    return [Record(0, i, CONV.encode(), encode(e)) for i, e in enumerate(events)]


def _journal_then_resume(*after):  # type: ignore[no-untyped-def]
    failed = AttemptFailed(event_id=eid(), occurred_at=5, **ENV, reason=STOPPED_MID_ATTEMPT, retryable=False)
    head = (message("m1", 0), TURN, started(TURN, 1), responded(1, ("c1", "transfer")),
            tool_started("c1", "transfer", True, "k"), failed, resumed("run-1"))  # fmt: skip
    return audit(_records(*head, *after))


ENV2 = {**ENV, "run_id": "run-2", "attempt": 2}


def test_the_auditor_passes_a_resume_that_reruns_an_idempotent_call_with_its_key_and_asks_the_next_step():
    rerun = ToolCallStarted(event_id=eid(), occurred_at=7, **ENV2, iteration=1, call_id="c1", tool="transfer",
                            arguments="{}", side_effect=True, idempotency_key="k")  # fmt: skip
    done = ToolCallFinished(event_id=eid(), occurred_at=8, **ENV2, iteration=1, call_id="c1", ok=True, result="ok")
    step2 = ModelResponded(event_id=eid(), occurred_at=9, **ENV2, iteration=2, model="m", text="Sent.")
    report = _journal_then_resume(rerun, done, step2)
    assert report.rule("resume").checked == 2 and report.rule("resume").violations == [], render(report)


def test_the_auditor_flags_a_resume_that_asks_a_recorded_model_step_again():
    again = ModelResponded(event_id=eid(), occurred_at=7, **ENV2, iteration=1, model="m")
    report = _journal_then_resume(again)
    assert [f.detail for f in report.rule("resume").violations] == [
        "model step 1 asked again; the journal already holds it"
    ]


# -- a run stopped while its ToolCallStarted is acknowledged (issue 15, item 4) ----------------


class _OneToolCall:
    """A provider whose one reply asks for a transfer."""

    family = "openai"

    async def complete(self, request, stream=None):  # type: ignore[no-untyped-def]
        call = ToolCall(call_id="c1", name="transfer", arguments='{"to": "bob", "amount": 5}')
        return ModelReply("m", None, (call,), Usage(), "tool_calls", "tool_use")

    async def aclose(self) -> None: ...


async def test_a_run_stopped_before_its_tool_body_began_records_that_the_call_did_not_start():
    ran: list[str] = []

    async def transfer(args: Transfer) -> str:
        ran.append(args.to)
        return "sent"

    written: list[object] = []

    async def append(event, wait=True, value=None):  # type: ignore[no-untyped-def]
        written.append(event)
        if isinstance(event, ToolCallStarted):
            raise asyncio.CancelledError("revoked while the start was being acknowledged")

    state = new_state(CONV)
    assert apply_event(state, message("m1", 0)) is None
    plan = plan_claim(state, 10_000, DebouncePolicy(0, 0))
    assert isinstance(plan, ClaimPlan)
    ids = iter(f"id-{n}" for n in range(100))
    tools = ToolRegistry([Tool("transfer", "Send money.", Transfer, transfer, "side_effect")])
    turn = TurnSettings(model="m", tools=tools, prices=PRICES)
    runner = TurnRunner(state, append, _OneToolCall(), turn, lambda: 10_000, lambda: next(ids))  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await runner.claim_and_run(plan)
    assert ran == []
    last = written[-1]
    assert isinstance(last, ToolCallFinished) and (last.call_id, last.ok) == ("c1", False)
    assert "did not start" in last.result
    # The next owner reads a failed call that did not run, not one in doubt.
    step = next_step(state.active.journal, recovery("none"))  # type: ignore[union-attr]
    assert isinstance(step, Resume) and step.in_doubt == {} and not step.results["c1"].ok

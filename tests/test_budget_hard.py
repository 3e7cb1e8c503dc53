"""Hard budgets hold for the step in flight, not only at its start (issue 14): each case
runs one turn in-process with an injected clock (see budget_harness)."""

from __future__ import annotations

import pytest
from budget_harness import START, Harness, Step, conversation, of_type, resume

from turnstile.events import Event, TurnPaused
from turnstile.handlers.budget import (
    MIN_REPLY_TOKENS,
    Limit,
    Spent,
    TurnBudget,
    input_token_bound,
    output_allowance,
    time_left_s,
)
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ChatMessage, ToolSpec
from turnstile.projections import apply_event

# $0.01 for a reply of 1,000 output tokens; input is cheap but not free.
PRICE = ModelPrice(input_per_mtok=1.0, output_per_mtok=10.0)
SEARCH = ("search", 0)


def fold_all(state, events: list[Event]) -> None:
    for event in events:
        assert apply_event(state, event) is None


# -- the pure decisions -------------------------------------------------------------------


def test_the_output_allowance_is_cut_so_the_worst_case_fits_the_cost_left():
    budget = TurnBudget(max_cost_usd=0.035)
    # given $0.03 spent, when a request of 1,000 input tokens may want 1,000 output tokens
    allowance = output_allowance(Spent(3, 0, 0.03, 0), budget, "m", PRICE, 1000, 1000)
    # then its worst case (input $0.001, output at $10/Mtok) fits the $0.005 left
    assert allowance == 399
    assert 0.03 + 1000 * 1.0 / 1e6 + allowance * 10.0 / 1e6 <= 0.035
    # and with plenty left the allowance is what was asked for
    assert output_allowance(Spent(0, 0, 0.0, 0), budget, "m", PRICE, 1000, 1000) == 1000


def test_no_request_when_even_a_minimal_reply_cannot_fit():
    limit = output_allowance(Spent(3, 0, 0.03, 0), TurnBudget(max_cost_usd=0.03012), "m", PRICE, 0, 1000)
    assert isinstance(limit, Limit) and limit.dimension == "cost" and "too little" in limit.reason
    assert MIN_REPLY_TOKENS * 10.0 / 1e6 > 0.00012


def test_the_dearest_input_price_counts_and_an_unpriced_model_keeps_its_allowance():
    dear_cache = ModelPrice(input_per_mtok=1.0, output_per_mtok=10.0, cache_write_per_mtok=100.0)
    # 100 input tokens that might all be cache writes: $0.01, leaving nothing of $0.01
    assert isinstance(
        output_allowance(Spent(0, 0, 0.0, 0), TurnBudget(max_cost_usd=0.01), "m", dear_cache, 100, 50), Limit
    )
    assert output_allowance(Spent(0, 0, 0.0, 0), TurnBudget(max_cost_usd=0.01), "m", None, 100, 50) == 50
    unknown = output_allowance(Spent(1, 0, None, 0), TurnBudget(), "m", PRICE, 100, 50)
    assert isinstance(unknown, Limit) and "unknown" in unknown.reason


def test_the_input_bound_counts_every_byte_sent():
    messages = [ChatMessage("user", "héllo"), ChatMessage("assistant", "", ())]
    assert input_token_bound(messages, ()) == 6 + 8 + 8
    assert input_token_bound(messages, (ToolSpec("t", "d"),)) > input_token_bound(messages, ()) + 512


def test_time_left_before_the_deadline():
    budget = TurnBudget(deadline_ms=1500)
    assert time_left_s(Spent(0, 0, 0.0, 1200), budget) == pytest.approx(0.3)
    assert time_left_s(Spent(0, 0, 0.0, 1600), budget) == 0


# -- the runner carries them out ------------------------------------------------------------


async def test_the_cost_limit_holds_in_the_outcome_when_the_last_request_is_cut_to_fit():
    # given $0.01 replies and a $0.035 limit (the case: the 4th reply made $0.04)
    h = Harness(script=[Step(output_tokens=1000, calls=(SEARCH,)) for _ in range(5)])
    settings = h.settings(TurnBudget(max_cost_usd=0.035), PRICE)
    # when the turn runs
    outcome = await h.run_turn(conversation(), settings)
    # then the 4th request may write only what the cost left pays for, and the outcome holds
    assert [r.max_output_tokens for r in h.requests][:3] == [1000, 1000, 1000]
    assert h.requests[3].max_output_tokens < 500
    assert outcome.metrics.cost_usd <= 0.035
    assert outcome.type == "TurnExhausted" and outcome.allowance == "output_tokens"


async def test_no_request_is_made_when_the_cost_left_cannot_pay_for_a_minimal_reply():
    h = Harness(script=[Step(output_tokens=1000, calls=(SEARCH,)) for _ in range(5)])
    # input is free here, so only the output allowance decides: $0.0001 left pays for 10 tokens
    price = ModelPrice(input_per_mtok=0.0, output_per_mtok=10.0)
    outcome = await h.run_turn(conversation(), h.settings(TurnBudget(max_cost_usd=0.0301), price))
    assert len(h.requests) == 3
    assert isinstance(outcome, TurnPaused) and outcome.reason == "cost" and outcome.metrics.cost_usd <= 0.0301


async def test_no_tool_runs_past_the_deadline_a_read_only_one_is_cancelled_and_recorded():
    # given a 1.5 s deadline and 0.6 s tools (the case: the third ran to 1.8 s)
    h = Harness(script=[Step(calls=(("search", 600), ("search", 600), ("search", 600), ("transfer", 1)))])
    outcome = await h.run_turn(conversation(), h.settings(TurnBudget(deadline_ms=1500), PRICE))
    # then the third is cancelled at the deadline, recorded as failed, and the turn pauses
    assert h.ran == ["search", "search"] and h.cancelled == ["search"]
    finished = of_type(h.events, "ToolCallFinished")
    assert [f.ok for f in finished] == [True, True, False] and "deadline" in finished[-1].result
    assert all(e.occurred_at - START <= 1500 for e in h.events)
    assert isinstance(outcome, TurnPaused) and outcome.reason == "deadline"
    assert [c.name for c in outcome.blocked_calls] == ["transfer"]  # the call after it did not run


async def test_a_side_effecting_tool_the_deadline_finds_running_runs_to_its_end_then_the_turn_pauses():
    # (cut off at the deadline it was in doubt for good: cancelling cannot stop a thread, and
    # the model of a resume could make the call again under a new idempotency key)
    h = Harness(script=[Step(calls=(("search", 600), ("transfer", 600), ("search", 1)))])
    outcome = await h.run_turn(conversation(), h.settings(TurnBudget(deadline_ms=1000), PRICE))
    assert h.ran == ["search", "transfer"] and h.cancelled == []
    transfer = of_type(h.events, "ToolCallFinished")[-1]
    assert transfer.ok and transfer.occurred_at - START == 1200  # past the deadline, by its own length
    assert isinstance(outcome, TurnPaused) and outcome.reason == "deadline"
    assert [(o.tool, o.status) for o in outcome.operations] == [("search", "succeeded"), ("transfer", "succeeded")]
    assert [c.name for c in outcome.blocked_calls] == ["search"]  # nothing new starts past the deadline


async def test_a_model_request_is_cancelled_at_the_deadline():
    # given a model call started at 900 ms that would take 800 ms, with a 1 s deadline
    h = Harness(script=[Step(ms=900, calls=(SEARCH,)), Step(ms=800)])
    outcome = await h.run_turn(conversation(), h.settings(TurnBudget(deadline_ms=1000), PRICE))
    assert h.cancelled == ["request 2"]
    assert h.requests[1].time_left_s == pytest.approx(0.1)
    assert isinstance(outcome, TurnPaused) and outcome.reason == "deadline"
    assert "during a model request" in outcome.resume_hint
    assert outcome.occurred_at - START == 1000


async def test_blocked_calls_are_kept_in_the_pause_and_seen_by_the_resumed_turn():
    # given a tool call allowance of 1 and a reply asking for three calls
    h = Harness(script=[Step(calls=(SEARCH, ("transfer", 0), ("search", 5)))])
    state = conversation()
    paused = await h.run_turn(state, h.settings(TurnBudget(max_tool_calls=1), PRICE))
    # then the two not run are in the pause, with their arguments and call ids
    assert isinstance(paused, TurnPaused) and paused.reason == "tool_calls"
    assert [(c.call_id, c.name, c.arguments) for c in paused.blocked_calls] == [
        ("call_1_1", "transfer", '{"ms": 0}'),
        ("call_1_2", "search", '{"ms": 5}'),
    ]
    # when the user resumes, the new turn's history shows them
    assert apply_event(state, resume(paused.turn_id, h.clock.now)) is None
    h.script = [Step(text="done")]
    resumed = await h.run_turn(state, h.settings(TurnBudget(), PRICE))
    assert resumed.type == "TurnCompleted"
    seen = "\n".join(m.content for m in h.requests[-1].messages)
    assert 'transfer({"ms": 0}) [call call_1_1]' in seen and 'search({"ms": 5}) [call call_1_2]' in seen


# -- a resume must name a paused, failed or exhausted turn of its conversation -----------------------------------


def test_a_resume_of_no_paused_turn_is_refused_with_its_reason():
    from turnstile.handlers.claim import DoubleTextPolicy, refusal_on_arrival, rejection_event

    state = conversation()
    # given a conversation with no turn named no-such-turn-id
    bogus = resume("no-such-turn-id", START, "r1")
    assert apply_event(state, bogus) is None
    # when the resume arrives, then it is refused, naming the turn it asked for
    refusal = refusal_on_arrival(DoubleTextPolicy(), state, bogus)
    assert refusal is not None and refusal.reason == "resume_invalid" and refusal.turn_id == "no-such-turn-id"
    assert "not a turn of this conversation" in refusal.text
    event = rejection_event(state, "r1", refusal, event_id="e-x", now_ms=START)
    assert event.resumes_turn_id == "no-such-turn-id" and event.active_turn_id is None
    # and the fold takes the refusal: the resume leaves the pending set, never claimed
    assert apply_event(state, event) is None and "r1" not in state.pending and state.active is None


async def test_a_resume_of_a_completed_turn_is_refused_and_a_paused_one_accepted():
    from turnstile.handlers.claim import DoubleTextPolicy, refusal_on_arrival

    h = Harness(script=[Step(calls=(SEARCH, SEARCH))])
    state = conversation()
    paused = await h.run_turn(state, h.settings(TurnBudget(max_tool_calls=1), PRICE))
    good = resume(paused.turn_id, h.clock.now, "r1")
    assert apply_event(state, good) is None and refusal_on_arrival(DoubleTextPolicy(), state, good) is None
    h.script = [Step(text="done")]
    completed = await h.run_turn(state, h.settings(TurnBudget(), PRICE))
    again = resume(completed.turn_id, h.clock.now, "r2")
    assert apply_event(state, again) is None
    refusal = refusal_on_arrival(DoubleTextPolicy(), state, again)
    assert refusal is not None and "completed: only a paused, failed or exhausted turn is resumed" in refusal.text


async def test_the_worker_refuses_a_bogus_resume_on_the_log_and_never_answers_it(tmp_path):
    from loop_harness import World as LoopWorld
    from loop_harness import config, inject, outcomes_of, settings
    from worker_harness import events_of, running, until

    from turnstile.handlers.providers.scripted import ScriptedProvider
    from turnstile.streams.file_log import FileLog

    world = LoopWorld(log=FileLog(tmp_path))
    assert world.log is not None
    async with running(world.log, ScriptedProvider(), config(settings(world, model="scripted-1"))):
        await inject(world.log, resume("no-such-turn-id", START, "r1"))
        await until(lambda: any(e.type == "MessageRejected" for e in events_of(world.log, "c1")), 20)
    [rejected] = of_type(events_of(world.log, "c1"), "MessageRejected")
    assert rejected.reason == "resume_invalid" and rejected.message_id == "r1"
    assert "no-such-turn-id" in rejected.text
    assert of_type(events_of(world.log, "c1"), "TurnClaimed") == [] and outcomes_of(world.log) == []


@pytest.mark.parametrize("limit", [float("inf"), float("nan")])
def test_an_infinite_or_nan_cost_limit_is_refused_when_the_agent_is_made(limit):
    # Given an unbounded cost limit, the output allowance (cost left / price) has no finite
    # value: it crashed the turn with an internal error; now it is refused up front.
    with pytest.raises(ValueError, match="max_cost_usd must be a finite number"):
        TurnBudget(max_cost_usd=limit)


def test_a_deadline_of_no_time_is_refused_when_the_agent_is_made():
    # (every turn paused at its start, "time limit (0 s)", with nothing said before)
    with pytest.raises(ValueError, match="deadline_ms must be at least 1"):
        TurnBudget(deadline_ms=0)


async def test_a_turn_failed_on_a_provider_outage_is_resumed_by_the_operation_and_answered(tmp_path):
    from loop_harness import World as LoopWorld
    from loop_harness import config, inject, outcomes, say, settings
    from worker_harness import events_of, running

    from turnstile.events import TurnClaimed
    from turnstile.handlers.operations import Operation, decide_resume
    from turnstile.handlers.provider import ModelRequest, ProviderError
    from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider, echo_reply
    from turnstile.projections import new_state
    from turnstile.projections.audit import audit
    from turnstile.streams.file_log import FileLog

    down = [True]

    def script(request: ModelRequest) -> Scripted:
        if down[0]:
            return Scripted(ProviderError("server_error", "the provider is down", retryable=False, status=500))
        return Scripted(echo_reply(request))

    world, provider = LoopWorld(log=FileLog(tmp_path)), ScriptedProvider(script)
    assert world.log is not None
    async with running(world.log, provider, config(settings(world, model="scripted-1"))):
        # given a turn that failed while the provider was down
        await say(world.log, "book the flight", "m1")
        [failed] = await outcomes(world.log, 1)
        assert failed.type == "TurnFailed"
        # when the provider is back and an operator resumes it
        down[0] = False
        state = new_state("c1")
        for event in events_of(world.log, "c1"):
            apply_event(state, event)
        operation = decide_resume(state, None, event_id="e-resume", now_ms=failed.occurred_at + 1)
        assert isinstance(operation, Operation), operation
        await inject(world.log, operation.event)
        # then a new turn claims the resume, sees the failed one, and is answered
        answered = (await outcomes(world.log, 2))[1]
    assert answered.type == "TurnCompleted"
    claims = [e for e in events_of(world.log, "c1") if isinstance(e, TurnClaimed)]
    assert claims[-1].input_ids == (f"resume:{failed.turn_id}",) and claims[-1].turn_id == operation.turn_id
    sent = [m.content for m in provider.requests[-1].messages]
    assert "book the flight" in sent and any("This turn failed" in m for m in sent) and sent[-1] == "Continue."
    report = audit(world.log.read_all(world.log.topics.events))
    assert report.ok, report
    assert of_type(events_of(world.log, "c1"), "MessageRejected") == []


def test_a_resume_of_a_turn_the_model_refused_is_refused_asking_for_a_new_message():
    from builders import claim, refused, started

    from turnstile.handlers.claim import DoubleTextPolicy, refusal_on_arrival
    from turnstile.handlers.operations import Refused, decide_resume

    # Given a conversation whose last turn the model refused (its input is withheld since)
    state = conversation("the words the model refused")
    c1 = claim(["m1"], START + 5, 0, conv=state.conversation_id)
    for event in (c1, started(c1, START + 6), refused(c1, START + 900)):
        assert apply_event(state, event) is None
    # When an operator asks to resume it, then it is refused: nothing would be continued
    decided = decide_resume(state, None, event_id="e-r", now_ms=START + 1000)
    assert isinstance(decided, Refused) and "send a new message instead" in decided.reason
    # and a resume written straight to the log is refused on arrival, saying the same
    raw = resume(c1.turn_id, START + 1000, "r1")
    assert apply_event(state, raw) is None
    refusal = refusal_on_arrival(DoubleTextPolicy(), state, raw)
    assert refusal is not None and refusal.reason == "resume_invalid"
    assert "the model refused: its inputs are no longer sent" in refusal.text


def test_a_resume_of_a_turn_paused_for_an_approval_is_refused_the_approval_decides_it():
    from turnstile.events import ToolCall
    from turnstile.handlers.claim import DoubleTextPolicy, refusal_on_arrival
    from turnstile.projections.state import TurnRecord

    state = conversation()
    call = ToolCall(call_id="call_1", name="transfer", arguments="{}")
    state.turns["t-approval"] = TurnRecord("t-approval", ("m0",), "paused", 1, call)
    raw = resume("t-approval", START, "r1")  # written by a producer, not by `turnstile resume`
    assert apply_event(state, raw) is None
    refusal = refusal_on_arrival(DoubleTextPolicy(), state, raw)
    # (accepted, it left the call's approval open after a turn that never decided it)
    assert refusal is not None and "waits for the approval of call call_1: approve or deny it" in refusal.text

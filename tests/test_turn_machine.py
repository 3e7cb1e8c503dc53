"""The turn's state machine, given/when/then: no worker, no provider server, no sleeps.
Time is the observation's; ids come from a counter. Each test feeds observations to
`decide` and reads the commands (the events to append, the one effect) it returns."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import zlib
from dataclasses import dataclass

import orjson
import pytest
from builders import message
from pydantic import BaseModel, ConfigDict, SecretStr

from turnstile.events import (
    STOPPED_MID_ATTEMPT,
    AttemptFailed,
    AttemptStarted,
    Event,
    FallbackEngaged,
    InputInjected,
    ModelResponded,
    ProtocolFailure,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnExhausted,
    TurnFailed,
    TurnPaused,
    Usage,
    decode,
    encode,
)
from turnstile.events.inputs import Approval
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, plan_claim
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ModelReply, ProtocolFamily, ProviderError
from turnstile.handlers.resume import Resume, next_step
from turnstile.handlers.tools import NOT_RUN, Tool, ToolRegistry
from turnstile.handlers.turn_machine import TurnMachine, decide, machine_for
from turnstile.handlers.turn_rules import STOPS_ALLOWED, result_cut_to_fit
from turnstile.handlers.turn_settings import Route, TurnSettings
from turnstile.handlers.turn_steps import (
    Append,
    CallModel,
    Claimed,
    Command,
    Crashed,
    Finish,
    ModelAnswered,
    ModelCutOff,
    ModelFailed,
    Reconcile,
    Reconciled,
    RunTool,
    SleepUntil,
    TakenOver,
    ToolNotStarted,
    ToolRaised,
    ToolReturned,
    Woke,
)
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.projections.snapshot import Snapshot, decode_snapshot, encode_snapshot

CONV = "conv-1"
T0 = 1_000_000
PRICES = {"m": ModelPrice(1.0, 2.0), "m2": ModelPrice(1.0, 2.0)}


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    q: str = ""


async def _never(args: Args, key: str | None = None) -> str:  # the machine never runs a tool
    raise AssertionError("decide ran a tool")


async def _no_answer(call: ToolCall) -> str | None:
    raise AssertionError("decide ran a reconciler")


TOOLS = ToolRegistry(
    [
        Tool("search", "Search.", Args, _never),
        Tool("send", "Send.", Args, _never, "side_effect"),
        Tool("pay", "Pay.", Args, _never, "side_effect", idempotent=True),
        Tool("book", "Book.", Args, _never, "side_effect", reconcile=_no_answer),
        Tool("wire", "Wire money.", Args, _never, "side_effect", needs_approval=True),
    ]
)


@dataclass(frozen=True)
class _Family:
    family: ProtocolFamily


def settings(**overrides: object) -> TurnSettings:
    base: dict[str, object] = {"model": "m", "system_prompt": None, "tools": TOOLS, "prices": PRICES}
    return TurnSettings(**{**base, **overrides})  # type: ignore[arg-type]


def machine(turn: TurnSettings | None = None, state: ConversationState | None = None) -> TurnMachine:
    """A machine for a new conversation (one pending message), or one taking `state` over."""
    prefix = "id" if state is None else "next-owner"
    if state is None:
        state = new_state(CONV)
        assert apply_event(state, message("m1", T0 - 5_000, "hello")) is None
    ids = (f"{prefix}-{n}" for n in itertools.count())
    return machine_for(state, turn or settings(), "openai", lambda: next(ids))


def claimed(m: TurnMachine, at: int = T0) -> tuple[Command, ...]:
    plan = plan_claim(m.state, at, DebouncePolicy(0, 0))
    assert isinstance(plan, ClaimPlan)
    return decide(m, Claimed(plan, at))


def reply(text: str | None = "done", *calls: tuple[str, str, str], stop: str = "end", out: int = 10) -> ModelReply:
    tool_calls = tuple(ToolCall(call_id=c, name=n, arguments=a) for c, n, a in calls)
    kind = "tool_use" if tool_calls else stop
    return ModelReply("m", text, tool_calls, Usage(input_tokens=100, output_tokens=out), "stop", kind)  # type: ignore[arg-type]


def events(commands: tuple[Command, ...]) -> list[Event]:
    return [c.event for c in commands if isinstance(c, Append)]


def types(commands: tuple[Command, ...]) -> list[str]:
    return [c.event.type if isinstance(c, Append) else type(c).__name__ for c in commands]


def effect(commands: tuple[Command, ...]) -> Command:
    assert not isinstance(commands[-1], Append), "a step ends with its effect or Finish"
    return commands[-1]


# -- the happy path -------------------------------------------------------------------------
def test_a_claim_writes_the_claim_and_the_first_attempt_then_asks_the_model():
    m = machine()
    commands = claimed(m)
    assert types(commands) == ["TurnClaimed", "AttemptStarted", "CallModel"]
    claim, start = events(commands)
    assert isinstance(claim, TurnClaimed) and claim.input_ids == ("m1",)
    assert isinstance(start, AttemptStarted) and start.run_id == claim.run_id and start.attempt == 1
    assert isinstance(commands[0], Append) and commands[0].wait is False  # one round trip for both
    call = effect(commands)
    assert isinstance(call, CallModel) and call.iteration == 1 and call.route == 0
    assert call.request.messages[-1].content == "hello"  # the claimed input is the final user input


def test_a_final_reply_completes_the_turn_in_the_same_round_trip():
    m = machine()
    claimed(m)
    commands = decide(m, ModelAnswered(reply("hi there"), T0 + 100))
    assert types(commands) == ["ModelResponded", "TurnCompleted", "Finish"]
    _responded, outcome = events(commands)
    assert isinstance(commands[0], Append) and commands[0].wait is False
    assert isinstance(outcome, TurnCompleted) and outcome.reply == "hi there"
    assert outcome.metrics.duration_ms == 100 and outcome.statuses == {"m1": "answered"}
    assert m.state.active is None and m.state.turns[outcome.turn_id].outcome == "completed"


def test_the_same_observations_decide_the_same_commands():
    def run() -> list[object]:
        m = machine()
        return [*claimed(m), *decide(m, ModelAnswered(reply("x", ("c1", "search", '{"q": "a"}')), T0 + 5))]

    assert run() == run()


# -- tools ----------------------------------------------------------------------------------
def test_a_tool_call_is_on_the_log_before_the_tool_runs_and_its_result_goes_back_to_the_model():
    m = machine()
    claimed(m)
    commands = decide(m, ModelAnswered(reply("looking", ("c1", "search", '{"q": "a"}')), T0 + 10))
    assert types(commands) == ["ModelResponded", "ToolCallStarted", "RunTool"]
    run = effect(commands)
    assert isinstance(run, RunTool) and run.started.call_id == "c1" and run.arguments == Args(q="a")
    after = decide(m, ToolReturned("found it", T0 + 20))
    assert types(after) == ["ToolCallFinished", "CallModel"]
    request = effect(after)
    assert isinstance(request, CallModel) and request.iteration == 2
    assert request.request.messages[-1].content == "found it" and request.request.messages[-1].tool_call_id == "c1"



def test_a_call_id_the_server_gives_again_is_renamed_so_each_call_keeps_its_own_name():
    # Given a server that names every call `call_0` (within a reply and at every step)
    m = machine()
    claimed(m)
    both = reply("", ("call_0", "search", '{"q": "a"}'), ("call_0", "search", '{"q": "b"}'))
    first = decide(m, ModelAnswered(both, T0))
    started = [e.call_id for e in events(first) if isinstance(e, ToolCallStarted)]
    assert started == ["call_0"]  # the second waits its turn, under its own name
    second = decide(m, ToolReturned("a found", T0 + 1))
    assert [e.call_id for e in events(second) if isinstance(e, ToolCallStarted)] == ["call_0-2"]
    request = effect(decide(m, ToolReturned("b found", T0 + 2)))
    assert isinstance(request, CallModel)
    # a later step's `call_0` is a new call too: it runs, where the fold refused it ("started again")
    later = decide(m, ModelAnswered(reply("", ("call_0", "search", '{"q": "c"}')), T0 + 3))
    assert [e.call_id for e in events(later) if isinstance(e, ToolCallStarted)] == ["call_0-3"]
    # and the transcript sent back names each call as the log does
    sent = [c.call_id for msg in request.request.messages for c in msg.tool_calls]
    assert sent == ["call_0", "call_0-2"]


def test_a_renamed_call_is_renamed_in_the_providers_own_blocks_and_stays_a_valid_id():
    m = machine(settings(), None)
    claimed(m)
    longest = "t" * 256  # an id may have 256 characters: the renamed one too
    blocks = ({"type": "text", "text": "x"}, {"type": "tool_use", "id": longest, "name": "search", "input": {}},
              {"type": "tool_use", "id": longest, "name": "search", "input": {"q": "b"}})  # fmt: skip
    calls = (ToolCall(call_id=longest, name="search", arguments="{}"),
             ToolCall(call_id=longest, name="search", arguments='{"q": "b"}'))  # fmt: skip
    answer = ModelReply("m", "x", calls, Usage(input_tokens=1, output_tokens=1), "tool_use", "tool_use", blocks)
    first = decide(m, ModelAnswered(answer, T0))
    [responded] = [e for e in events(first) if isinstance(e, ModelResponded)]
    renamed = responded.tool_calls[1].call_id
    assert renamed == "t" * 254 + "-2" and decode(encode(responded)) == responded  # every reader reads it
    decide(m, ToolReturned("a", T0 + 1))
    request = effect(decide(m, ToolReturned("b", T0 + 2)))
    assert isinstance(request, CallModel)
    [assistant] = [msg for msg in request.request.messages if msg.native]
    assert [b.get("id") for b in assistant.native or () if b.get("type") == "tool_use"] == [longest, renamed]


def test_an_id_of_a_call_that_was_refused_is_not_given_to_a_later_call():
    # a refused call never starts, but a takeover's journal keys its refusal by its id
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("call_0", "no_such_tool", "{}")), T0))  # refused: unknown tool
    later = decide(m, ModelAnswered(reply("", ("call_0", "search", "{}")), T0 + 1))
    assert [e.call_id for e in events(later) if isinstance(e, ToolCallStarted)] == ["call_0-2"]

def test_what_a_tool_returns_is_normalised_to_text():
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "search", "{}"), ("c2", "search", '{"q": "b"}')), T0))
    first = events(decide(m, ToolReturned(None, T0, returned="dict")))
    assert isinstance(first[0], ToolCallFinished) and not first[0].ok
    assert first[0].result == "error: the tool returned dict, not text"
    second = events(decide(m, ToolRaised("KeyError: 'x'", T0)))
    assert isinstance(second[0], ToolCallFinished) and second[0].result == "error: KeyError: 'x'"


def test_an_unknown_tool_is_a_protocol_failure_the_model_reads_and_a_repeat_stops_the_turn():
    m = machine()
    claimed(m)
    commands = decide(m, ModelAnswered(reply("", ("c1", "nope", "{}")), T0))
    assert types(commands) == ["ModelResponded", "ProtocolFailure", "CallModel"]
    assert "not available" in effect(commands).request.messages[-1].content  # type: ignore[union-attr]
    decide(m, ModelAnswered(reply("", ("c2", "nope", "{}")), T0))
    stopped = decide(m, ModelAnswered(reply("", ("c3", "nope", " {} ")), T0))
    assert types(stopped)[-4:] == ["ProtocolFailure", "ProtocolFailure", "TurnFailed", "Finish"]
    repeat = events(stopped)[-2]
    assert isinstance(repeat, ProtocolFailure) and repeat.kind == "repeated_call"
    outcome = events(stopped)[-1]
    assert isinstance(outcome, TurnFailed) and "3 times" in outcome.error


def test_a_call_needing_approval_pauses_with_the_exact_call_and_the_ones_after_it_kept_as_blocked():
    m = machine()
    claimed(m)
    commands = decide(m, ModelAnswered(reply("", ("c1", "wire", '{"q": "bob"}'), ("c2", "search", "{}")), T0))
    assert types(commands) == ["ModelResponded", "TurnPaused", "Finish"]
    paused = events(commands)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "approval"
    assert paused.pending_call is not None and paused.pending_call.call_id == "c1"
    assert [c.call_id for c in paused.blocked_calls] == ["c2"]
    assert "turnstile approve|deny conv-1 c1" in paused.resume_hint


# -- attempts -------------------------------------------------------------------------------
def test_a_retryable_provider_error_fails_the_attempt_and_waits_the_backoff_before_the_next():
    m = machine(settings(backoff_base_ms=200))
    claimed(m)
    commands = decide(m, ModelFailed(ProviderError("server_error", "500", retryable=True, status=500), T0 + 50))
    assert types(commands) == ["AttemptFailed", "SleepUntil"]
    failed = events(commands)[0]
    assert isinstance(failed, AttemptFailed) and failed.retryable
    assert effect(commands) == SleepUntil(T0 + 50 + 200)
    again = decide(m, Woke(T0 + 250))
    assert types(again) == ["AttemptStarted", "CallModel"]
    start = events(again)[0]
    assert isinstance(start, AttemptStarted) and start.attempt == 2 and start.run_id != failed.run_id


@pytest.mark.parametrize("retry_after_s", [12.0, 2.95])  # the wait reaches the deadline, or just does
def test_a_backoff_that_would_reach_the_deadline_is_not_slept_the_turn_pauses_on_it_at_once(retry_after_s: float):
    m = machine(settings(budget=TurnBudget(deadline_ms=5_000)))
    claimed(m, at=T0)
    busy = ProviderError("rate_limited", "HTTP 429", retryable=True, status=429, retry_after_s=retry_after_s)
    commands = decide(m, ModelFailed(busy, T0 + 2_050))
    assert types(commands) == ["TurnPaused", "Finish"]  # the pause closes the attempt
    paused = events(commands)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "deadline" and paused.occurred_at == T0 + 2_050
    said = f"HTTP 429; no fallback model left; the time limit (5 s) comes before the next try, in {retry_after_s:g} s"
    assert said in paused.resume_hint


def test_no_new_attempt_once_a_side_effect_started():
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "send", "{}")), T0))
    decide(m, ToolReturned("sent", T0))
    commands = decide(m, ModelFailed(ProviderError("timeout", "slow", retryable=True), T0))
    assert types(commands) == ["AttemptFailed", "TurnFailed", "Finish"]
    failed, outcome = events(commands)
    assert isinstance(failed, AttemptFailed) and not failed.retryable
    assert isinstance(outcome, TurnFailed) and "side effects had already run" in outcome.error


def test_a_takeover_after_the_owner_decided_to_fail_the_turn_does_not_run_it_on():
    # Given an owner that failed its attempt after a side effect (AttemptFailed, not
    # retryable) and stopped before its TurnFailed (a revoke holds a turn at that boundary),
    # when the next owner takes the turn over, then it writes that TurnFailed, with the
    # attempt's reason, and nothing else: no new attempt, no model request (rule 9).
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "send", "{}")), T0))
    decide(m, ToolReturned("sent", T0))
    before = copy.deepcopy(m.state)
    failed = events(decide(m, ModelFailed(ProviderError("timeout", "slow", retryable=True), T0)))[0]
    assert isinstance(failed, AttemptFailed) and not failed.retryable
    assert apply_event(before, failed) is None
    commands = decide(machine(state=before), TakenOver(T0 + 1_000))
    assert types(commands) == ["TurnFailed", "Finish"]
    outcome = events(commands)[0]
    assert isinstance(outcome, TurnFailed) and outcome.run_id == failed.run_id
    assert failed.reason in outcome.error and "side effects had already run" in outcome.error


def _backing_off(backoff_base_ms: int = 2_000) -> ConversationState:
    """A turn whose owner recorded a search step, then failed its attempt retryably at
    T0 + 100 and died during the backoff."""
    m = machine(settings(backoff_base_ms=backoff_base_ms))
    claimed(m)
    decide(m, ModelAnswered(reply("looking", ("c1", "search", "{}")), T0 + 50))
    decide(m, ToolReturned("found", T0 + 60))
    commands = decide(m, ModelFailed(ProviderError("server_error", "500", retryable=True, status=500), T0 + 100))
    assert effect(commands) == SleepUntil(T0 + 100 + backoff_base_ms)
    failed = events(commands)[0]
    assert isinstance(failed, AttemptFailed) and failed.retryable and failed.occurred_at == T0 + 100
    return m.state


def test_a_takeover_during_the_backoff_waits_it_out_by_event_time_then_starts_over():
    # Given an owner that died backing off after a retryable failure, when the next owner
    # takes over before the backoff (counted from the AttemptFailed's time) is over, then
    # it writes nothing and waits until it is; then it starts a fresh attempt from the
    # inputs, as the dead owner would have -- not a resume of the failed attempt's journal.
    state = _backing_off()
    first_request = machine()
    request = effect(claimed(first_request))
    taken = machine(settings(backoff_base_ms=2_000), state=state)
    assert decide(taken, TakenOver(T0 + 1_000)) == (SleepUntil(T0 + 2_100),)
    again = decide(taken, Woke(T0 + 2_100))
    assert types(again) == ["AttemptStarted", "CallModel"]
    start = events(again)[0]
    assert isinstance(start, AttemptStarted) and start.attempt == 2 and start.resumes_run_id is None
    retry = effect(again)
    assert isinstance(retry, CallModel) and isinstance(request, CallModel)
    assert retry.request.messages == request.request.messages  # the inputs, no kept step


def test_a_takeover_during_a_backoff_that_reaches_the_deadline_waits_only_until_the_deadline_then_pauses():
    state = _backing_off()  # failed at T0 + 100, next attempt due at T0 + 2_100
    taken = machine(settings(backoff_base_ms=2_000, budget=TurnBudget(deadline_ms=1_500)), state=state)
    assert decide(taken, TakenOver(T0 + 1_000)) == (SleepUntil(T0 + 1_500),)  # the deadline, not T0 + 2_100
    at_deadline = decide(taken, Woke(T0 + 1_500))
    assert types(at_deadline) == ["AttemptStarted", "TurnPaused", "Finish"]
    paused = events(at_deadline)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "deadline" and paused.occurred_at == T0 + 1_500


def test_a_takeover_after_the_backoff_is_over_starts_the_next_attempt_at_once():
    state = _backing_off(backoff_base_ms=200)
    commands = decide(machine(settings(backoff_base_ms=200), state=state), TakenOver(T0 + 10_000))
    assert types(commands) == ["AttemptStarted", "CallModel"]  # no second AttemptFailed
    start = events(commands)[0]
    assert isinstance(start, AttemptStarted) and start.attempt == 2 and start.resumes_run_id is None


def _owner(n: int, state: ConversationState) -> TurnMachine:
    """The machine of the n-th worker to own the turn (each draws its own ids)."""
    ids = (f"owner-{n}-{k}" for k in itertools.count())
    return machine_for(state, settings(), "openai", lambda: next(ids))


def _stopped(times: int) -> TurnMachine:
    """A turn whose model call a rolling deploy's rebalances cut `times` times: each next
    owner closed the stopped run and started the next attempt."""
    m = machine()
    claimed(m)
    for n in range(2, 2 + times):
        m = _owner(n, m.state)
        commands = decide(m, TakenOver(T0 + 1_000 * n))
        assert types(commands) == ["AttemptFailed", "AttemptStarted", "CallModel"], n
    return m


def test_workers_stopping_mid_call_use_none_of_the_models_attempts_up_to_a_bound_on_such_stops():
    # Given a turn cut by its workers stopping as often as is taken over, when one more
    # owner takes it over, then the turn fails, saying why (not "the maximum number of
    # attempts": the model failed none).
    m = _owner(99, _stopped(STOPS_ALLOWED).state)
    commands = decide(m, TakenOver(T0 + 60_000))
    assert types(commands) == ["AttemptFailed", "TurnFailed", "Finish"]
    failed = events(commands)[-1]
    assert isinstance(failed, TurnFailed) and f"stopped mid-attempt {STOPS_ALLOWED + 1} times" in failed.error
    assert failed.metrics.attempt == 1 + STOPS_ALLOWED


def test_a_turn_read_from_a_snapshot_older_than_stops_is_taken_over_as_its_events_say():
    # Given the turn cut by three stops, snapshotted by a worker of the version before v4
    # (its active turn without the stops), when a worker of this version takes it over
    folded = _stopped(3).state
    head, body = encode_snapshot(folded, 99).split(b"\n", 1)
    state = orjson.loads(zlib.decompress(body))
    state[4] = state[4][:22]  # v3's active turn
    body = zlib.compress(orjson.dumps(state))
    v3 = orjson.dumps({**orjson.loads(head), "snapshot": 3, "crc": zlib.crc32(body)}) + b"\n" + body
    snapshot = decode_snapshot(v3)
    assert isinstance(snapshot, Snapshot) and snapshot.state.active is not None
    assert snapshot.state.active.stops == 3  # (the earlier attempts, read as stopped)
    # Then it goes on as from the events, not failed "after the maximum number of attempts"
    for state_ in (folded, snapshot.state):
        commands = decide(_owner(50, copy.deepcopy(state_)), TakenOver(T0 + 50_000))
        assert types(commands) == ["AttemptFailed", "AttemptStarted", "CallModel"]


def test_a_turn_its_workers_stopped_still_has_all_of_the_models_attempts():
    # Given a turn cut by three stops (attempt 4 running), when the model fails retryably,
    # then it is retried with the first backoff, as a turn never stopped would be, and
    # only its third failure of the model's (3 attempts allowed) fails it.
    m = _stopped(3)
    assert m.state.active is not None and (m.state.active.attempt, m.state.active.stops) == (4, 3)
    error = ProviderError("rate_limited", "429", retryable=True, status=429)
    at = T0 + 10_000
    for attempt in (4, 5):
        commands = decide(m, ModelFailed(error, at))
        assert types(commands) == ["AttemptFailed", "SleepUntil"], attempt
        assert effect(commands) == SleepUntil(at + settings().backoff_s(attempt - 3) * 1000)
        started = events(decide(m, Woke(at + 5_000)))[0]
        assert isinstance(started, AttemptStarted) and started.attempt == attempt + 1
        at += 10_000
    commands = decide(m, ModelFailed(error, at))
    assert types(commands) == ["AttemptFailed", "TurnFailed", "Finish"]
    failed = events(commands)[-1]
    assert isinstance(failed, TurnFailed) and "on all 3 attempts" in failed.error


def test_a_takeover_whose_attempts_are_used_up_fails_instead_of_retrying():
    # Given an owner that died backing off before its last attempt, when the next owner
    # runs with fewer attempts allowed, then the turn fails rather than going past them.
    state = _backing_off()
    commands = decide(machine(settings(max_attempts=1), state=state), TakenOver(T0 + 10_000))
    assert types(commands) == ["TurnFailed", "Finish"]
    outcome = events(commands)[0]
    assert isinstance(outcome, TurnFailed) and "maximum number of attempts" in outcome.error


def test_a_takeover_of_a_run_another_takeover_closed_resumes_its_journal():
    # Given a takeover that closed a stopped run (STOPPED_MID_ATTEMPT) and died before its
    # next attempt, when a third owner takes over, then it goes on from the journal as the
    # second would have: no second AttemptFailed, no model step asked again.
    state = _journaled()
    second = machine(state=state)
    closing = events(decide(second, TakenOver(T0 + 1_000)))[0]
    assert isinstance(closing, AttemptFailed) and closing.reason == STOPPED_MID_ATTEMPT
    third_state = _journaled()
    assert apply_event(third_state, closing) is None
    commands = decide(machine(state=third_state), TakenOver(T0 + 2_000))
    assert types(commands) == ["AttemptStarted", "ToolCallStarted", "RunTool"]
    start = events(commands)[0]
    assert isinstance(start, AttemptStarted) and start.resumes_run_id == closing.run_id


def test_a_failing_model_falls_back_within_its_family_with_the_same_transcript():
    backup = Route("m2", _Family("openai"))  # type: ignore[arg-type]
    m = machine(settings(fallbacks=(backup,)))
    first = effect(claimed(m))
    commands = decide(m, ModelFailed(ProviderError("overloaded", "busy", retryable=True), T0))
    assert types(commands) == ["FallbackEngaged", "CallModel"]
    engaged, request = events(commands)[0], effect(commands)
    assert isinstance(engaged, FallbackEngaged) and (engaged.from_model, engaged.to_model) == ("m", "m2")
    assert isinstance(request, CallModel) and isinstance(first, CallModel)
    assert request.route == 1 and request.request.messages == first.request.messages


def test_a_billed_malformed_reply_of_an_unpriced_model_pauses_the_turn_on_cost_naming_that_model():
    backup = Route("m2", _Family("openai"))  # type: ignore[arg-type]
    m = machine(settings(fallbacks=(backup,), prices={"m2": PRICES["m2"]}))  # "m" has no price
    claimed(m)
    billed = ProviderError("malformed_response", "choices is empty", retryable=False, usage=Usage(input_tokens=900))
    commands = decide(m, ModelFailed(billed, T0))
    assert types(commands) == ["ProtocolFailure", "FallbackEngaged", "TurnPaused", "Finish"]
    failure, _, paused = events(commands)
    assert isinstance(failure, ProtocolFailure) and (failure.usage, failure.cost_usd) == (Usage(input_tokens=900), None)
    assert isinstance(paused, TurnPaused) and paused.reason == "cost" and paused.metrics.cost_usd is None
    assert "the price of model 'm' is unknown" in paused.resume_hint  # not the priced backup's


def test_no_fallback_to_another_protocol_family():
    other = Route("claude", _Family("anthropic"))  # type: ignore[arg-type]
    m = machine(settings(fallbacks=(other,), max_attempts=1))
    claimed(m)
    commands = decide(m, ModelFailed(ProviderError("overloaded", "busy", retryable=True), T0))
    failed = events(commands)[0]
    assert isinstance(failed, AttemptFailed) and "anthropic protocol" in failed.reason


# -- budgets --------------------------------------------------------------------------------
def test_the_iteration_allowance_ends_the_turn_exhausted_without_running_the_tools():
    m = machine(settings(budget=TurnBudget(max_iterations=1)))
    claimed(m)
    commands = decide(m, ModelAnswered(reply("half", ("c1", "search", "{}")), T0))
    assert types(commands) == ["ModelResponded", "TurnExhausted", "Finish"]
    outcome = events(commands)[-1]
    assert isinstance(outcome, TurnExhausted) and outcome.last_text == "half"


def test_the_deadline_during_a_model_request_pauses_the_turn_keeping_the_work():
    m = machine(settings(budget=TurnBudget(deadline_ms=1_000)))
    claimed(m)
    decide(m, ModelAnswered(reply("step one", ("c1", "search", "{}")), T0 + 100))
    decide(m, ToolReturned("result one", T0 + 200))
    commands = decide(m, ModelCutOff(T0 + 1_000))
    paused = events(commands)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "deadline"
    assert "search({}) -> ok: result one" in paused.kept and "step one" in paused.kept


def test_a_request_may_run_only_until_the_deadline():
    m = machine(settings(budget=TurnBudget(deadline_ms=10_000)))
    request = effect(claimed(m, at=T0))
    later = effect(decide(m, ModelAnswered(reply("", ("c1", "search", "{}")), T0 + 4_000)))
    assert isinstance(later, RunTool) and later.timeout_s == 6.0 and later.at_deadline
    assert isinstance(request, CallModel) and request.request.time_left_s == 10.0


@pytest.mark.parametrize(
    ("tool_timeout_s", "deadline_ms", "runs_for_s", "at_deadline"),
    [
        (None, 120_000, 60.0, False),
        (300.0, 600_000, 300.0, False),
        (300.0, 120_000, 120.0, True),
        (0.5, 120_000, 0.5, False),
    ],
)
def test_a_call_may_run_for_its_tools_own_timeout_or_else_the_workers_and_never_past_the_deadline(
    tool_timeout_s: float | None, deadline_ms: int, runs_for_s: float, at_deadline: bool
):
    report = Tool("report", "Build the report.", Args, _never, timeout_s=tool_timeout_s)
    m = machine(settings(tools=ToolRegistry([report]), budget=TurnBudget(deadline_ms=deadline_ms)))
    claimed(m, at=T0)
    run = effect(decide(m, ModelAnswered(reply("", ("c1", "report", "{}")), T0)))
    assert isinstance(run, RunTool) and (run.timeout_s, run.at_deadline) == (runs_for_s, at_deadline)


def test_a_side_effecting_call_is_not_cut_off_at_the_deadline_but_at_its_own_timeout():
    pay = Tool("pay", "Pay.", Args, _never, "side_effect", timeout_s=300.0)
    m = machine(settings(tools=ToolRegistry([pay]), budget=TurnBudget(deadline_ms=120_000)))
    claimed(m, at=T0)
    run = effect(decide(m, ModelAnswered(reply("", ("c1", "pay", "{}")), T0 + 100_000)))
    assert isinstance(run, RunTool) and (run.timeout_s, run.at_deadline) == (300.0, False)
    # Its result recorded past the deadline, the turn pauses there, the call done.
    commands = decide(m, ToolReturned("paid", T0 + 130_000))
    assert types(commands) == ["ToolCallFinished", "TurnPaused", "Finish"]
    paused = events(commands)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "deadline"
    assert [(o.tool, o.status) for o in paused.operations] == [("pay", "succeeded")]


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, math.inf, math.nan, True, "30"])
def test_a_tool_timeout_that_is_not_a_positive_number_of_seconds_is_refused_when_registered(timeout_s: object):
    with pytest.raises(ValueError, match="timeout_s is a number of seconds over 0"):
        ToolRegistry([Tool("report", "Build the report.", Args, _never, timeout_s=timeout_s)])


# -- taking over ----------------------------------------------------------------------------
def _journaled() -> ConversationState:
    """A conversation whose turn's run stopped after a step calling search and pay."""
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("checking", ("c1", "search", "{}"), ("c2", "pay", "{}")), T0))
    return m.state


def test_a_takeover_resumes_the_journal_without_asking_the_model_again():
    state = _journaled()
    m = machine(state=state)
    commands = decide(m, TakenOver(T0 + 1_000))
    # The dead run is closed, a new attempt resumes it, and the first call in doubt
    # (read-only, started) runs again: no CallModel for the recorded step.
    assert types(commands) == ["AttemptFailed", "AttemptStarted", "ToolCallStarted", "RunTool"]
    start = events(commands)[1]
    assert isinstance(start, AttemptStarted) and start.resumes_run_id is not None
    after = decide(m, ToolReturned("found", T0 + 1_100))
    run = effect(after)  # the idempotent call runs with its stable key
    assert isinstance(run, RunTool) and run.started.tool == "pay" and run.started.idempotency_key is not None


def test_an_idempotent_call_run_again_presents_the_key_its_first_run_was_given():
    # Given a pay call started by a worker of the version before (its key derived without
    # the conversation id, as on its ToolCallStarted), when the next owner runs it again,
    # then it presents that key, not the one this version derives: one effect, not two.
    m = machine()
    claimed(m)
    commands = decide(m, ModelAnswered(reply("paying", ("c2", "pay", "{}")), T0))
    first = effect(commands)
    assert isinstance(first, RunTool) and first.started.idempotency_key is not None
    turn = m.state.active
    assert turn is not None and turn.journal[-1] == first.started
    turn.journal[-1] = first.started.model_copy(update={"idempotency_key": "key-of-the-version-before"})
    taken = machine(state=m.state)
    again = effect(decide(taken, TakenOver(T0 + 1_000)))
    assert isinstance(again, RunTool) and again.started.idempotency_key == "key-of-the-version-before"



class Token(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: SecretStr


SECRET_TOOLS = ToolRegistry(
    [
        Tool("look_up", "Look up with a token.", Token, _never),
        Tool("charge", "Charge with a token.", Token, _never, "side_effect", idempotent=True),
    ]
)


def test_a_takeover_does_not_run_a_call_from_the_log_whose_secret_it_keeps_redacted():
    # Given a run that stopped with a read-only call with a secret argument left to run
    m = machine(settings(tools=SECRET_TOOLS))
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "look_up", '{"token": "tok-123"}')), T0))
    # when another owner takes it over: the log has the call as {"token": "[redacted]"}, so
    # the journal is not continued (the call would get "[redacted]"): the model is asked again
    commands = decide(machine(settings(tools=SECRET_TOOLS), state=m.state), TakenOver(T0 + 1_000))
    assert types(commands) == ["AttemptFailed", "AttemptStarted", "CallModel"]
    start = events(commands)[1]
    assert isinstance(start, AttemptStarted) and start.resumes_run_id is None


def test_a_takeover_of_an_idempotent_side_effect_with_a_secret_in_doubt_fails_visibly():
    # (run again with its key, it would act with "[redacted]" for the secret)
    m = machine(settings(tools=SECRET_TOOLS))
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "charge", '{"token": "tok-123"}')), T0))
    commands = decide(machine(settings(tools=SECRET_TOOLS), state=m.state), TakenOver(T0 + 1_000))
    outcome = events(commands)[-1]
    assert isinstance(outcome, TurnFailed) and "cannot be run again safely" in outcome.error
    assert not any(isinstance(c, RunTool) for c in commands)


def test_a_cut_off_reply_with_calls_goes_with_its_outcome_and_a_takeover_never_runs_its_calls():
    m = machine()
    claimed(m)
    cut = ModelReply("m", "I'll search", (ToolCall(call_id="c1", name="send", arguments='{"q": "a"}'),),
                     Usage(input_tokens=1, output_tokens=1), "length", "truncated")  # fmt: skip
    commands = decide(m, ModelAnswered(cut, T0))
    assert types(commands) == ["ModelResponded", "TurnExhausted", "Finish"]
    assert [c.wait for c in commands if isinstance(c, Append)] == [False, True]  # one round trip for both
    # a run that stopped with only the reply on the log: the next owner asks the model again
    only_reply = machine()
    claimed(only_reply)
    state = only_reply.state
    assert apply_event(state, events(commands)[0]) is None
    taken = decide(machine(state=state), TakenOver(T0 + 1_000))
    assert types(taken) == ["AttemptFailed", "AttemptStarted", "CallModel"]

def test_a_takeover_of_a_side_effect_in_doubt_with_a_reconciler_asks_it():
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "book", "{}")), T0))
    taken = machine(state=m.state)
    commands = decide(taken, TakenOver(T0 + 1_000))
    assert types(commands) == ["AttemptFailed", "AttemptStarted", "Reconcile"]
    unknown = decide(taken, Reconciled(None, T0 + 1_100))
    outcome = events(unknown)[-1]
    assert isinstance(outcome, TurnFailed) and "reconciler could not tell" in outcome.error


def test_a_call_its_reconciler_knows_had_no_effect_is_recorded_as_not_run_and_the_model_is_asked():
    # Given a booking in doubt after its worker stopped, when the reconciler finds nothing
    # under the call's id, then the call is finished as not run (no second ToolCallStarted:
    # it is not run again under that id) and the model reads that, free to book again.
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "book", "{}")), T0))
    taken = machine(state=m.state)
    decide(taken, TakenOver(T0 + 1_000))
    commands = decide(taken, Reconciled(NOT_RUN, T0 + 1_100))
    assert types(commands) == ["ToolCallFinished", "CallModel"]
    finished = events(commands)[0]
    assert isinstance(finished, ToolCallFinished) and not finished.ok and finished.reconciled
    assert finished.result.startswith("error: this call did not run")
    request = effect(commands)
    assert isinstance(request, CallModel) and finished.result in request.request.messages[-1].content


@pytest.mark.parametrize(("tool_timeout_s", "asked_for_s"), [(None, 60.0), (5.0, 5.0), (300.0, 300.0)])
def test_a_reconciler_may_run_as_long_as_its_tool_may(tool_timeout_s: float | None, asked_for_s: float):
    book = Tool("book", "Book.", Args, _never, "side_effect", reconcile=_no_answer, timeout_s=tool_timeout_s)
    turn = settings(tools=ToolRegistry([book]))
    m = machine(turn)
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "book", "{}")), T0))
    reconcile = effect(decide(machine(turn, state=m.state), TakenOver(T0 + 1_000)))
    assert isinstance(reconcile, Reconcile) and reconcile.timeout_s == asked_for_s


def test_a_takeover_of_a_side_effect_in_doubt_without_a_way_to_settle_it_fails_visibly():
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "send", "{}")), T0))
    commands = decide(machine(state=m.state), TakenOver(T0 + 1_000))
    assert types(commands) == ["AttemptFailed", "TurnFailed", "Finish"]
    outcome = events(commands)[-1]
    assert isinstance(outcome, TurnFailed) and "send, call c1" in outcome.error
    assert [(o.call_id, o.status) for o in outcome.operations] == [("c1", "unknown")]


def test_a_run_stopped_while_its_tool_start_was_acknowledged_records_that_it_did_not_start():
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "send", "{}")), T0))
    commands = decide(m, ToolNotStarted(T0 + 5))
    assert types(commands) == ["ToolCallFinished", "Finish"]
    finished = events(commands)[0]
    assert isinstance(finished, ToolCallFinished) and not finished.ok and "did not start" in finished.result


def test_a_call_run_again_whose_new_start_was_cut_short_stays_in_doubt_not_recorded_as_without_effect():
    # Given an idempotent pay call its first run started (and may have made: the worker
    # died in it), and the next owner running it again with its key, when that owner is
    # stopped while its own start is acknowledged, then it writes no "did not start; it had
    # no effect": the first run's may have acted. The call stays in doubt for the owner after
    # (again with its key), where the model had been told to make it anew (an outside crash
    # hunt: one SMS sent, recorded as never sent).
    m = machine()
    claimed(m)
    first = effect(decide(m, ModelAnswered(reply("paying", ("c2", "pay", "{}")), T0)))
    assert isinstance(first, RunTool)
    taken = machine(state=m.state)
    again = effect(decide(taken, TakenOver(T0 + 1_000)))
    assert isinstance(again, RunTool) and again.started.run_id != first.started.run_id
    assert types(decide(taken, ToolNotStarted(T0 + 1_005))) == ["Finish"]
    turn = taken.state.active
    assert turn is not None
    step = next_step(turn.journal, lambda _start: "idempotent")
    assert isinstance(step, Resume) and step.in_doubt == {"c2": "idempotent"} and step.results == {}
    third = effect(decide(_owner(3, taken.state), TakenOver(T0 + 2_000)))
    assert isinstance(third, RunTool) and third.started.idempotency_key == first.started.idempotency_key


def test_a_read_only_call_stopped_before_it_began_is_left_for_the_next_owner_to_run():
    # Given a run stopped while a read-only call's start was being acknowledged, when the
    # machine hears of it, then it writes nothing: the next owner runs that call again
    # (a recorded "did not start" would be the result the model reads instead).
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("", ("c1", "search", "{}")), T0))
    assert types(decide(m, ToolNotStarted(T0 + 5))) == ["Finish"]
    step = next_step(m.turn.journal, lambda _start: "none")
    assert isinstance(step, Resume) and step.in_doubt == {"c1": "rerun"} and step.results == {}


def test_an_internal_error_still_ends_the_turn_failed():
    m = machine()
    claimed(m)
    commands = decide(m, Crashed("RuntimeError: the log went away", T0 + 5))
    assert types(commands) == ["Report", "AttemptFailed", "TurnFailed", "Finish"]
    outcome = events(commands)[-1]
    assert isinstance(outcome, TurnFailed) and "internal error" in outcome.error


def test_an_observation_that_does_not_fit_the_state_is_an_internal_error_not_a_crash():
    m = machine()
    claimed(m)
    commands = decide(m, Reconciled("what call?", T0))  # nothing was in doubt
    assert isinstance(commands[-1], Finish) and isinstance(events(commands)[-1], TurnFailed)
    # The outcome is decided: a later error writes nothing more.
    assert types(decide(m, Crashed("again", T0))) == ["Report", "Finish"]


@pytest.mark.parametrize(
    ("prices", "named", "cost"),
    [
        ({"m": ModelPrice(1.0, 2.0)}, "m-2025-01-01", (100 * 1 + 10 * 2) / 1e6),  # a dated variant of the one asked
        ({"m": ModelPrice(30.0, 180.0), "cheap": ModelPrice(0.1, 0.4)}, "cheap", (100 * 30 + 10 * 180) / 1e6),
        ({"cheap": ModelPrice(0.1, 0.4)}, "cheap", None),  # the model asked has no price: unknown, fail closed
    ],
)
def test_a_reply_is_priced_as_the_model_asked_for_whatever_model_it_names(
    prices: dict[str, ModelPrice], named: str, cost: float | None
):
    m = machine(settings(prices=prices))
    claimed(m)  # its output allowance was cut at the price of "m", the model asked
    answer = dataclasses.replace(reply("x"), model=named)
    [responded, _] = events(decide(m, ModelAnswered(answer, T0)))
    assert isinstance(responded, ModelResponded) and responded.model == named
    assert responded.cost_usd == (None if cost is None else pytest.approx(cost))


def test_the_pause_on_an_unknown_price_names_the_model_asked_not_the_one_the_reply_names():
    m = machine(settings(prices={"gpt-4o-2024-08-06": ModelPrice(2.5, 10.0)}))  # "m", the model asked, has none
    claimed(m)
    answer = dataclasses.replace(reply("looking", ("c1", "search", "{}")), model="gpt-4o-2024-08-06")
    paused = events(decide(m, ModelAnswered(answer, T0)))[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "cost"
    assert "the price of model 'm' is unknown" in paused.resume_hint  # the name to add a price for


def test_a_reply_that_reports_no_usage_has_an_unknown_cost_and_the_turn_pauses_on_cost_at_once():
    m = machine()
    claimed(m)
    silent = dataclasses.replace(reply("looking", ("c1", "search", "{}")), usage=Usage(), usage_reported=False)
    commands = decide(m, ModelAnswered(silent, T0))
    assert types(commands) == ["ModelResponded", "TurnPaused", "Finish"]  # nothing more is spent on a guess
    responded, paused = events(commands)
    assert isinstance(responded, ModelResponded) and responded.cost_usd is None  # never 0
    assert isinstance(paused, TurnPaused) and paused.reason == "cost" and paused.metrics.cost_usd is None
    assert "a reply of model 'm' reported no usage, so the turn's cost cannot be bounded" in paused.resume_hint


def test_model_responded_is_recorded_with_its_cost():
    m = machine()
    claimed(m)
    responded = events(decide(m, ModelAnswered(reply("x", out=1000), T0)))[0]
    assert isinstance(responded, ModelResponded) and responded.cost_usd == pytest.approx((100 * 1 + 1000 * 2) / 1e6)



# -- the log's size limit ---------------------------------------------------------------------
def answered_under(limit: int | None, text: str) -> tuple[Command, ...]:
    """A final reply of `text`, decided by a machine whose log takes events of `limit` bytes."""
    m = machine()
    m.max_event_bytes = limit
    claimed(m)
    return decide(m, ModelAnswered(reply(text, out=1000), T0 + 5))


def sizes(commands: tuple[Command, ...]) -> dict[str, int]:
    return {c.event.type: len(c.value) for c in commands if isinstance(c, Append)}


def test_each_event_is_written_as_the_bytes_the_machine_measured():
    commands = answered_under(None, "a long answer " * 100)
    assert all(c.value == encode(c.event) for c in commands if isinstance(c, Append))


def test_a_reply_exactly_at_the_logs_limit_is_recorded_and_completes_the_turn():
    whole = sizes(answered_under(None, "a long answer " * 100))
    assert whole["TurnCompleted"] > whole["ModelResponded"]  # the outcome carries the reply too
    assert types(answered_under(whole["TurnCompleted"], "a long answer " * 100)) == [
        "ModelResponded", "TurnCompleted", "Finish"
    ]  # fmt: skip


def test_a_reply_a_byte_over_the_limit_is_not_written_and_the_turn_fails_at_once_saying_what_it_cost():
    whole = sizes(answered_under(None, "a long answer " * 100))
    commands = answered_under(whole["ModelResponded"] - 1, "a long answer " * 100)
    assert types(commands) == ["Report", "AttemptFailed", "TurnFailed", "Finish"]
    failed_attempt, outcome = events(commands)
    assert isinstance(failed_attempt, AttemptFailed) and not failed_attempt.retryable  # not asked again
    assert isinstance(outcome, TurnFailed) and outcome.error == (
        "The model's reply is too large to record (1,000 output tokens, $0.0021): as ModelResponded it is "
        f"{whole['ModelResponded']:,} bytes, over the {whole['ModelResponded'] - 1:,} the events topic takes "
        "(at most about 1 MiB, a producer request). Ask for a shorter answer."
    )


def test_a_reply_recorded_whose_outcome_is_over_the_limit_fails_the_turn_instead_of_completing_it():
    whole = sizes(answered_under(None, "a long answer " * 100))
    commands = answered_under(whole["TurnCompleted"] - 1, "a long answer " * 100)
    # the reply is on the log with its cost; the outcome that would carry it again is not
    assert types(commands) == ["ModelResponded", "Report", "AttemptFailed", "TurnFailed", "Finish"]
    outcome = events(commands)[-1]
    assert isinstance(outcome, TurnFailed)
    assert outcome.error.startswith(
        "The turn's outcome, which carries the model's reply again, is too large to record: as TurnCompleted it is"
    )


def searched_under(limit: int | None, result: str) -> tuple[Command, ...]:
    """The commands after a tool returned `result`, under a log that takes `limit` bytes."""
    m = machine()
    claimed(m)
    decide(m, ModelAnswered(reply("looking", ("c1", "search", '{"q": "a"}')), T0 + 10))
    m.max_event_bytes = limit
    return decide(m, ToolReturned(result, T0 + 20))


def test_a_tool_result_exactly_at_the_logs_limit_is_recorded_whole():
    result = "found ☃ \x00" * 300
    whole = sizes(searched_under(None, result))["ToolCallFinished"]
    commands = searched_under(whole, result)
    assert types(commands) == ["ToolCallFinished", "CallModel"]
    assert events(commands)[0].result == result


@pytest.mark.parametrize("over", [1, 40_000])
def test_a_tool_result_over_the_limit_is_cut_to_fit_and_the_turn_goes_on_with_what_was_kept(over: int):
    result = "found ☃ \x00" * 3_000  # 3 bytes a snowman, 6 a NUL escaped: cut by bytes, not characters
    whole = sizes(searched_under(None, result))["ToolCallFinished"]
    commands = searched_under(whole - over, result)
    assert types(commands) == ["ToolCallFinished", "CallModel"]  # the tool acted: its result is kept, in part
    [finished] = events(commands)
    assert isinstance(finished, ToolCallFinished) and finished.ok
    assert whole - over - 6 <= len(encode(finished)) <= whole - over  # as much as fits (a char is at most 6 bytes)
    kept, note = finished.result.rsplit("\n", 1)
    assert result.startswith(kept) and note == "[truncated: the result had 27000 characters]"
    request = effect(commands)
    assert isinstance(request, CallModel) and request.request.messages[-1].content == finished.result  # as recorded


def test_a_result_is_not_cut_below_its_note_saying_so():
    [finished] = events(searched_under(None, "found " * 1_000))
    assert isinstance(finished, ToolCallFinished)
    noted = len(encode(finished.model_copy(update={"result": "\n[truncated: the result had 6000 characters]"})))
    assert result_cut_to_fit(finished, finished.result, noted) is not None
    assert result_cut_to_fit(finished, finished.result, noted - 1) is None  # the turn then fails, naming the result


# -- more budgets and approvals -------------------------------------------------------------
def test_the_tool_call_allowance_pauses_before_the_next_call_keeping_it_as_blocked():
    m = machine(settings(budget=TurnBudget(max_tool_calls=1)))
    claimed(m)
    commands = decide(m, ModelAnswered(reply("two", ("c1", "search", "{}"), ("c2", "search", '{"q": "b"}')), T0))
    assert types(commands) == ["ModelResponded", "ToolCallStarted", "RunTool"]
    after = decide(m, ToolReturned("one", T0 + 10))
    assert types(after) == ["ToolCallFinished", "TurnPaused", "Finish"]
    paused = events(after)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "tool_calls"
    assert [c.call_id for c in paused.blocked_calls] == ["c2"] and "search({}) -> ok: one" in paused.kept


def test_a_pause_quotes_large_arguments_in_part_so_it_fits_the_log_with_its_calls_whole():
    m = machine(settings(budget=TurnBudget(max_tool_calls=1)))
    m.max_event_bytes = 1_048_446  # a default broker's, as on the embedded log
    claimed(m)
    big = [(f"c{n}", "search", orjson.dumps({"q": "x" * 150_000}).decode()) for n in range(4)]
    decide(m, ModelAnswered(reply("", *big), T0))
    after = decide(m, ToolReturned("one", T0 + 10))
    assert types(after) == ["ToolCallFinished", "TurnPaused", "Finish"]  # not a TurnFailed for its size
    paused = events(after)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "tool_calls"
    assert [c.arguments for c in paused.blocked_calls] == [a for _, _, a in big[1:]]  # whole, to run on resume
    assert 'search({"q":"xxx' in paused.kept and len(paused.kept) < 2_000


def test_a_pause_whose_work_listed_in_full_would_not_fit_the_log_keeps_it_in_brief_and_stays_a_pause():
    # Given a reply of 2,000 calls (its ModelResponded fits the log) of which the budget lets
    # one run: the pause would carry the other 1,999 twice (whole, and quoted in `kept`)
    m = machine(settings(budget=TurnBudget(max_tool_calls=1)))
    m.max_event_bytes = 1_048_446
    claimed(m)
    calls = [(f"c{n}", "search", orjson.dumps({"q": f"{n:04d}" + "x" * 300}).decode()) for n in range(2_000)]
    commands = decide(m, ModelAnswered(reply("Looking.", *calls), T0))
    assert types(commands)[:2] == ["ModelResponded", "ToolCallStarted"]
    after = decide(m, ToolReturned("one", T0 + 10))
    # Then it is a pause the operator can resume, not a failure after a tool ran
    assert types(after) == ["ToolCallFinished", "TurnPaused", "Finish"]
    paused = events(after)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "tool_calls" and paused.blocked_calls == ()
    assert paused.kept.startswith("Looking.") and "1 operation(s) completed and 1999 call(s)" in paused.kept


def test_an_approval_pause_quotes_large_arguments_in_part_so_it_fits_the_log_with_its_call_whole():
    m = machine()
    m.max_event_bytes = 1_048_446
    claimed(m)
    big = [(f"c{n}", "wire", orjson.dumps({"q": "x" * 190_000}).decode()) for n in range(5)]
    commands = decide(m, ModelAnswered(reply("", *big), T0))
    assert types(commands) == ["ModelResponded", "TurnPaused", "Finish"]  # not a TurnFailed for its size
    paused = events(commands)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "approval"
    assert paused.pending_call is not None and paused.pending_call.arguments == big[0][2]  # whole, to approve
    assert len(paused.kept) < 3_000


def test_a_request_whose_worst_case_does_not_fit_the_cost_left_is_not_sent():
    m = machine(settings(budget=TurnBudget(max_cost_usd=0.0001)))
    commands = claimed(m)
    assert types(commands) == ["TurnClaimed", "AttemptStarted", "TurnPaused", "Finish"]
    paused = events(commands)[-1]
    assert isinstance(paused, TurnPaused) and paused.reason == "cost" and paused.metrics.iterations == 0


def test_past_the_soft_threshold_older_tool_exchanges_are_compacted_before_the_next_request():
    m = machine(settings(budget=TurnBudget(max_iterations=4, soft_fraction=0.5)))
    claimed(m)
    for n in (1, 2):
        decide(m, ModelAnswered(reply("", (f"c{n}", "search", f'{{"q": "{n}"}}')), T0))
        last = decide(m, ToolReturned(f"result {n} " * 40, T0))
    assert types(last) == ["ToolCallFinished", "ContextCompacted", "CallModel"]
    request = effect(last)
    assert isinstance(request, CallModel) and request.iteration == 3
    assert [m.content.startswith("[compacted") for m in request.request.messages if m.role == "tool"] == [True, False]


def test_an_approved_call_runs_once_and_a_denied_one_is_reported_to_the_model():
    grant_state = new_state(CONV)
    paused_turn = machine(state=grant_state)  # a conversation whose first turn paused on `wire`
    assert apply_event(grant_state, message("m1", T0 - 5_000, "wire bob")) is None
    claimed(paused_turn)
    pause = events(decide(paused_turn, ModelAnswered(reply("", ("c1", "wire", '{"q": "bob"}')), T0)))[-1]
    assert isinstance(pause, TurnPaused) and pause.pending_call is not None
    for approved, seen in ((True, "RunTool"), (False, "CallModel")):
        state = copy.deepcopy(grant_state)
        decision = Approval(turn_id=pause.turn_id, call_id="c1", approved=approved)
        approval = InputInjected(
            event_id=f"a-{approved}", conversation_id=CONV, occurred_at=T0 + 100, occurrence_key=f"approval-{approved}",
            source="approval", content="decided", approval=decision,
        )  # fmt: skip
        assert apply_event(state, approval) is None
        m = machine(state=state)
        claimed(m, at=T0 + 5_000)
        commands = decide(m, ModelAnswered(reply("", ("c9", "wire", '{ "q":"bob" }')), T0 + 5_100))
        assert type(effect(commands)).__name__ == seen
        if not approved:
            assert "denied" in effect(commands).request.messages[-1].content  # type: ignore[union-attr]
            continue
        decide(m, ToolReturned("wired", T0 + 5_200))
        again = decide(m, ModelAnswered(reply("", ("c10", "wire", '{"q": "bob"}')), T0 + 5_300))
        assert events(again)[-1].type == "TurnPaused"  # one approval lets one call run

"""When a conversation is claimed, what the claim holds, and what the model is sent."""

from __future__ import annotations

import hashlib

import pytest
from builders import CONV, claim, completed, message, started

from turnstile.events import encode, logical_turn_id
from turnstile.handlers.claim import CLAIM_IDS_BYTES, ClaimPlan, DebouncePolicy, WaitUntil, claim_event, plan_claim
from turnstile.handlers.context import build_context, render_pending
from turnstile.projections import apply_event, new_state

POLICY = DebouncePolicy(quiet_ms=1000, max_wait_ms=3000, max_batch=20)


def state_of(*events):
    state = new_state(CONV)
    for e in events:
        assert apply_event(state, e) is None
    return state


def test_a_batch_of_ids_too_long_for_one_claim_is_claimed_in_turns_that_each_fit():
    # Given 1,000 pending messages whose ids are 256 control characters (six bytes each, as
    # a claim writes them) and a batch of 1,000 allowed
    ids = [f"{n:04d}" + "\x01" * 252 for n in range(1_000)]
    state = state_of(*(message(i, 1_000 + n) for n, i in enumerate(ids)))
    plan = plan_claim(state, 10_000, DebouncePolicy(quiet_ms=0, max_wait_ms=0, max_batch=1_000))
    # When the claim is planned, then it takes the oldest that fit the claim's bytes, in
    # order, and its event can be written (the 1.5 MB claim of them all never could)
    assert isinstance(plan, ClaimPlan) and 0 < len(plan.inputs) < 1_000
    assert plan.input_ids == tuple(ids[: len(plan.inputs)])
    claimed = encode(claim_event(state, plan, event_id="e", run_id="r", now_ms=10_000))
    assert CLAIM_IDS_BYTES < len(claimed) < CLAIM_IDS_BYTES + 2_000


@pytest.mark.parametrize(
    ("policy", "why"),
    [
        (dict(max_batch=10_001), "max_batch must be at most 10,000"),
        (dict(quiet_ms=86_400_001), "at most 86,400,000"),
        (dict(max_wait_ms=10**15), "at most 86,400,000"),
    ],
)
def test_a_debounce_that_could_never_claim_is_refused_where_it_is_made(policy, why):
    with pytest.raises(ValueError, match=why):
        DebouncePolicy(**policy)


def test_nothing_to_claim_without_pending_input():
    assert plan_claim(new_state(CONV), 0, POLICY) is None


def test_waits_for_one_quiet_second_then_claims():
    state = state_of(message("a", 1000))
    assert plan_claim(state, 1500, POLICY) == WaitUntil(2000)
    plan = plan_claim(state, 2000, POLICY)
    assert isinstance(plan, ClaimPlan) and plan.input_ids == ("a",)


def test_each_new_message_restarts_the_quiet_window_up_to_the_cap():
    state = state_of(message("a", 0), message("b", 900), message("c", 1800), message("d", 2700))
    assert plan_claim(state, 2800, POLICY) == WaitUntil(3000)  # cap: 3 s after the first
    assert isinstance(plan_claim(state, 3000, POLICY), ClaimPlan)



@pytest.mark.parametrize("stamp", [10_000 + 3_001, 10_000 + 3_600_000, 2**53 - 1])
def test_an_input_stamped_ahead_of_the_clock_by_more_than_the_wait_is_claimed_at_once(stamp):
    # a producer's clock an hour ahead, or a stamp that is no time at all: waiting for its
    # quiet window would hold the conversation that long (for ever at 2**53 - 1)
    state = state_of(message("a", stamp))
    plan = plan_claim(state, 10_000, POLICY)
    assert isinstance(plan, ClaimPlan) and plan.input_ids == ("a",)


def test_inputs_stamped_up_to_the_wait_ahead_keep_their_debounce():
    # (a producer's clock a second or three ahead: a burst still becomes one turn)
    assert plan_claim(state_of(message("a", 11_000)), 10_000, POLICY) == WaitUntil(12_000)
    burst = state_of(message("a", 13_000), message("b", 13_500))  # the oldest just at the wait ahead
    assert plan_claim(burst, 10_000, POLICY) == WaitUntil(14_500)

def test_three_rapid_messages_become_one_turn_listing_all_three_in_order():
    state = state_of(message("a", 0, "check the dates"), message("b", 300, "and times"), message("c", 600, "thanks"))
    plan = plan_claim(state, 1600, POLICY)
    assert isinstance(plan, ClaimPlan)
    assert plan.input_ids == ("a", "b", "c")
    assert plan.turn_id == logical_turn_id(["c", "b", "a"])
    assert apply_event(state, claim_event(state, plan, event_id="e", run_id="r", now_ms=1600)) is None
    final = build_context(state.history, state.active.history_boundary, state.active.inputs, None)[-1]
    assert final.role == "user"
    assert final.content == (
        "## Unanswered messages\n\n[00:00] check the dates\n\n[00:00] and times\n\n[00:00] thanks"
    )


def test_a_burst_is_split_into_bounded_turns_without_waiting():
    state = state_of(*[message(f"m{i:02}", i) for i in range(25)])
    plan = plan_claim(state, 30, POLICY)
    assert isinstance(plan, ClaimPlan) and plan.input_ids == tuple(f"m{i:02}" for i in range(20))


def test_inputs_are_ordered_by_their_timestamps_not_their_arrival():
    state = state_of(message("late", 500), message("early", 100))
    plan = plan_claim(state, 5000, POLICY)
    assert isinstance(plan, ClaimPlan) and plan.input_ids == ("early", "late")


def test_two_messages_ten_seconds_apart_during_a_turn_make_two_turns_each_answered_once():
    """Given "check the dates" claimed and its model call running,
    when "also compare the refund rules" arrives 10 s later,
    then it waits for the first outcome, gets its own turn, and nothing is answered twice."""
    first = claim(["dates"], 1000, 0)
    state = state_of(message("dates", 0, "check the dates"), first, started(first, 1000))
    assert apply_event(state, message("refunds", 10_000, "also compare the refund rules")) is None
    assert plan_claim(state, 20_000, POLICY) is None  # a turn is active: the follow-up stays pending
    assert apply_event(state, completed(first, 12_000, "The dates match.")) is None

    plan = plan_claim(state, 12_000, POLICY)
    assert isinstance(plan, ClaimPlan) and plan.input_ids == ("refunds",)
    second = claim_event(state, plan, event_id="e2", run_id="run-2", now_ms=12_000)
    assert apply_event(state, second) is None
    context = build_context(state.history, second.history_boundary, state.active.inputs, "sys")
    assert [(m.role, m.content) for m in context] == [
        ("system", "sys"),
        ("user", "check the dates"),
        ("assistant", "The dates match."),
        ("user", "also compare the refund rules"),
    ]
    assert apply_event(state, started(second, 12_001)) is None
    assert apply_event(state, completed(second, 13_000, "Refund rules compared.")) is None
    assert sorted(state.claimed_by.items()) == [("dates", first.turn_id), ("refunds", second.turn_id)]
    assert [h.content for h in state.history if h.role == "assistant"] == ["The dates match.", "Refund rules compared."]
    assert plan_claim(state, 99_000, POLICY) is None


def test_history_stops_at_the_boundary():
    first = claim(["a"], 10, 0)
    state = state_of(message("a", 0), first, started(first, 10), completed(first, 20, "r1"), message("b", 30))
    ctx = build_context(state.history, 0, list(state.pending.values()), None)
    assert [m.content for m in ctx] == ["text of b"]


def test_a_single_input_is_sent_as_it_is():
    state = state_of(message("a", 0, "just this"))
    assert render_pending(list(state.pending.values())) == "just this"


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError):
        DebouncePolicy(quiet_ms=-1)


def test_a_rendered_cache_kept_across_turns_gives_the_same_context_and_grows_with_history():
    first = claim(["a"], 10, 0)
    state = state_of(message("a", 0), first, started(first, 10), completed(first, 20, "r1"), message("b", 30))
    inputs = list(state.pending.values())
    cache: list = []
    assert build_context(state.history, 0, inputs, "sys", cache) == build_context(state.history, 0, inputs, "sys")
    assert cache == []
    assert build_context(state.history, 2, inputs, "sys", cache) == build_context(state.history, 2, inputs, "sys")
    assert [(m.role, m.content) for m in cache] == [("user", "text of a"), ("assistant", "r1")]
    kept = list(cache)
    assert build_context(state.history, 1, inputs, None, cache) == build_context(state.history, 1, inputs, None)
    assert cache == kept  # entries are rendered once and reused


def test_inputs_whose_ids_hold_a_newline_never_share_a_turn_id_with_others():
    # {"a\nb"} and {"a", "b"} were one text, so one turn id: two turns, two outcomes, one id
    # (an outside hunt: a consumer keeping one outcome per turn id dropped an answer).
    assert logical_turn_id(["a\nb"]) != logical_turn_id(["a", "b"])
    assert logical_turn_id(["b", "a\nb"]) != logical_turn_id(["a", "b\nb"])
    # Every other set keeps the id it always had: sha256 of the sorted ids, one per line.
    assert logical_turn_id(["m2", "m1"]) == hashlib.sha256(b"m1\nm2").hexdigest()


def test_both_turns_of_ids_a_newline_once_merged_are_claimed_and_answered_apart():
    first = claim(["a\nb"], 2, 0)
    answered = (message("a\nb", 1), first, started(first, 3), completed(first, 4))
    state = state_of(*answered, message("a", 5), message("b", 6))

    plan = plan_claim(state, 10_000, DebouncePolicy(quiet_ms=0, max_wait_ms=0))

    assert isinstance(plan, ClaimPlan) and plan.turn_id != first.turn_id
    second = claim_event(state, plan, event_id="e-2", run_id="r-2", now_ms=10_000)
    assert apply_event(state, second) is None and state.active is not None
    assert state.active.turn_id not in state.turns


def test_a_claim_written_with_the_old_id_of_ids_holding_a_newline_still_folds():
    # A log written before the fix: its claim's id is sha256 of the ids one per line.
    old = claim(["a\nb"], 2, 0).model_copy(update={"turn_id": hashlib.sha256(b"a\nb").hexdigest()})
    state = state_of(message("a\nb", 1))

    assert apply_event(state, old) is None and state.active is not None

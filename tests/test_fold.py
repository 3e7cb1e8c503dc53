"""The conversation fold: pending set, claims, history boundaries, idempotency, replay."""

from __future__ import annotations

from builders import CONV, claim, completed, eid, message, started

from turnstile.events import STOPPED_MID_ATTEMPT, AttemptFailed, ToolCallStarted, TurnFailed, decode, encode
from turnstile.events.outcomes import OperationRecord
from turnstile.projections import apply_event, new_state


def fold(events):
    state = new_state(CONV)
    verdicts = [apply_event(state, e) for e in events]
    return state, verdicts


def test_messages_are_pending_in_arrival_order_with_their_times():
    state, _ = fold([message("a", 100), message("b", 200)])
    assert [(p.input_id, p.occurred_at) for p in state.pending.values()] == [("a", 100), ("b", 200)]
    assert state.active is None


def test_republishing_a_message_is_harmless():
    state, verdicts = fold([message("a", 100, "hi"), message("a", 150, "hi")])
    assert list(state.pending) == ["a"]
    assert verdicts[1] is not None and not verdicts[1].conflict


def test_reusing_a_message_id_for_other_content_is_a_conflict_and_changes_nothing():
    state, verdicts = fold([message("a", 100, "hi"), message("a", 150, "something else")])
    assert verdicts[1] is not None and verdicts[1].conflict
    assert state.pending["a"].content == "hi"


def test_claim_moves_exact_inputs_to_the_active_turn_and_leaves_later_ones_pending():
    c = claim(["a"], 1000, 0)
    state, verdicts = fold([message("a", 100), c, message("b", 1500)])
    assert verdicts == [None, None, None]
    assert state.active is not None and state.active.input_ids == ("a",)
    assert list(state.pending) == ["b"]


def test_a_message_is_claimed_by_at_most_one_turn():
    first = claim(["a"], 1000, 0)
    again = claim(["a"], 5000, 2, run_id="run-2")
    state, verdicts = fold([message("a", 100), first, started(first, 1001), completed(first, 2000), again])
    assert verdicts[-1] is not None and "not pending" in verdicts[-1].reason
    assert state.claimed_by == {"a": first.turn_id}


def test_no_second_claim_while_a_turn_is_active():
    first = claim(["a"], 1000, 0)
    second = claim(["b"], 1100, 0, run_id="run-2")
    state, verdicts = fold([message("a", 100), message("b", 150), first, second])
    assert verdicts[-1] is not None and "active" in verdicts[-1].reason
    assert list(state.pending) == ["b"]


def test_outcome_appends_claimed_inputs_then_the_reply_to_history():
    """The seed's bug: a message that arrived mid-turn must not land before the reply."""
    c = claim(["a"], 1000, 0)
    state, _ = fold([message("a", 100), c, started(c, 1001), message("b", 1500), completed(c, 3000, "dates ok")])
    assert [(h.role, h.content) for h in state.history] == [("user", "text of a"), ("assistant", "dates ok")]
    assert list(state.pending) == ["b"]
    assert state.active is None


def test_events_of_a_run_that_is_not_active_are_ignored():
    c = claim(["a"], 1000, 0)
    stale = completed(c, 2000, run_id="someone-else")
    state, verdicts = fold([message("a", 100), c, started(c, 1001), stale])
    assert verdicts[-1] is not None
    assert state.active is not None


def test_a_claim_must_name_its_logical_turn_and_the_current_boundary():
    c = claim(["a"], 1000, boundary=3)
    state, verdicts = fold([message("a", 100), c])
    assert verdicts[-1] is not None and state.active is None


def test_replay_from_the_log_gives_the_same_state_as_live_folding():
    c1 = claim(["a"], 1000, 0)
    c2 = claim(["b"], 3100, 2, run_id="run-2")
    events = [message("a", 100), c1, started(c1, 1001), message("b", 1500), completed(c1, 3000),
              c2, started(c2, 3101), completed(c2, 5000)]
    live, _ = fold(events)
    replayed, _ = fold([decode(encode(e)) for e in events])
    assert replayed == live
    assert len(live.turns) == 2 and not live.pending


def test_a_run_closed_by_attempt_failed_cannot_complete_the_turn():
    """Given a takeover closed run-1, when run-1 (still alive somewhere) writes TurnCompleted,
    then the fold ignores it: the turn stays active for the owner that closed the run."""
    c = claim(["a"], 1000, 0)
    closed = AttemptFailed(
        event_id=eid(), conversation_id=c.conversation_id, occurred_at=1200, turn_id=c.turn_id,
        run_id=c.run_id, attempt=1, reason="the worker running this attempt stopped", retryable=True,
    )  # fmt: skip
    state, verdicts = fold([message("a", 100), c, started(c, 1001), closed, completed(c, 1300)])
    assert verdicts[:4] == [None, None, None, None]
    assert verdicts[4] is not None and "already closed" in verdicts[4].reason
    assert state.active is not None and state.active.turn_id == c.turn_id
    assert state.turns == {}


def test_attempts_closed_because_their_worker_stopped_are_counted_apart_from_the_models():
    # Given attempt 1 closed by a takeover (its worker stopped) and attempt 2 failed by the
    # model, when both are folded, then the turn has made 3 attempts, 1 of them stopped,
    # and the model's allowance has used 2.
    c = claim(["a"], 1000, 0)

    def failed(run_id: str, attempt: int, reason: str, at: int) -> AttemptFailed:
        return AttemptFailed(
            event_id=eid(), conversation_id=c.conversation_id, occurred_at=at, turn_id=c.turn_id,
            run_id=run_id, attempt=attempt, reason=reason, retryable=True,
        )  # fmt: skip

    events = [
        message("a", 100), c, started(c, 1001), failed(c.run_id, 1, STOPPED_MID_ATTEMPT, 1100),
        started(c, 1101, "run-2", 2), failed("run-2", 2, "HTTP 500", 1200), started(c, 1300, "run-3", 3),
    ]  # fmt: skip
    state, verdicts = fold(events)
    assert verdicts == [None] * len(events)
    turn = state.active
    assert turn is not None and (turn.attempt, turn.stops, turn.model_attempts) == (3, 1, 2)


def test_a_failed_turn_tells_later_turns_which_side_effects_it_made():
    # Given a turn that sent an email, started a transfer that never finished, and failed
    c = claim(["a"], 1000, 0)
    ops = (
        OperationRecord(call_id="c1", tool="send_email", side_effect=True, status="succeeded"),
        OperationRecord(call_id="c2", tool="search", side_effect=False, status="succeeded"),
        OperationRecord(call_id="c3", tool="transfer", side_effect=True, status="unknown"),
    )
    done = completed(c, 3000)
    failed = TurnFailed(**done.model_dump(include={"event_id", "conversation_id", "occurred_at", "turn_id", "run_id",
                                                   "attempt", "metrics"}),
                        statuses={"a": "failed"}, operations=ops, error="the provider could not be reached")
    sent = ToolCallStarted(**done.model_dump(include={"conversation_id", "turn_id", "run_id", "attempt"}),
                           event_id=eid(), occurred_at=1500, iteration=1, call_id="c1", tool="send_email",
                           arguments='{"to": "ann"}', side_effect=True)  # fmt: skip
    state, _ = fold([message("a", 100), c, started(c, 1001), sent, failed])
    # then what a resume (or the user's "try again") is sent names them, not only the failure
    closing = state.history[-1].content
    assert closing.startswith("[This turn failed: the provider could not be reached]")
    # (with its arguments when the journal has its start; not the transfer's: not started here)
    assert '- send_email({"to": "ann"}) (call c1): done' in closing and "- transfer(…) (call c3): may have" in closing
    assert "search" not in closing  # read-only calls are no side effects

"""The auditor on hand-built logs: a clean log passes, and each kind of violation is found,
named by its rule and located by partition@offset. Notices (stale runs, duplicates, open
turns, undecodable values) are reported without failing the audit."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path

from builders import CONV, claim, message, started
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.events import (
    NOT_STARTED,
    STOPPED_MID_ATTEMPT,
    AttemptFailed,
    AttemptStarted,
    DeadLetter,
    Event,
    MessageReceived,
    MessageRejected,
    ModelResponded,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnFailed,
    TurnMetrics,
    encode,
    logical_turn_id,
    partition_for,
)
from turnstile.events.outcomes import OperationRecord
from turnstile.projections import ConversationState
from turnstile.projections.audit import RULES, AuditLimits, Auditor, AuditReport, audit, render
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Record, Topics

_eids = itertools.count(1)


def eid() -> str:
    return f"audit-evt-{next(_eids)}"


def records(*items: Event | bytes | tuple[int, Event], partition: int = 0) -> list[Record]:
    """A partition of the events topic: offsets in order, keyed by conversation id.
    Raw bytes are written as they are; (partition, event) puts an event elsewhere."""
    out = []
    offsets: dict[int, int] = {}
    for item in items:
        p, value = (item if isinstance(item, tuple) else (partition, item))
        offset = offsets.get(p, 0)
        offsets[p] = offset + 1
        if isinstance(value, bytes):
            out.append(Record(p, offset, CONV.encode(), value))
        else:
            out.append(Record(p, offset, value.conversation_id.encode(), encode(value)))
    return out


def turn_fields(c: TurnClaimed, run_id: str | None = None, attempt: int = 1) -> dict[str, object]:
    return {
        "event_id": eid(), "conversation_id": c.conversation_id, "occurred_at": c.occurred_at + 1,
        "turn_id": c.turn_id, "run_id": run_id or c.run_id, "attempt": attempt,
    }  # fmt: skip


def responded(c: TurnClaimed, iteration: int = 1, run_id: str | None = None, attempt: int = 1,
              calls: tuple[ToolCall, ...] = (), cost: float | None = 0.001) -> ModelResponded:  # fmt: skip
    return ModelResponded(**turn_fields(c, run_id, attempt), iteration=iteration, model="m", tool_calls=calls,
                          cost_usd=cost)  # fmt: skip


def tool_started(c: TurnClaimed, call_id: str, side_effect: bool, run_id: str | None = None,
                 attempt: int = 1) -> ToolCallStarted:  # fmt: skip
    return ToolCallStarted(**turn_fields(c, run_id, attempt), iteration=1, call_id=call_id, tool="transfer",
                           arguments="{}", side_effect=side_effect)  # fmt: skip


def tool_finished(c: TurnClaimed, call_id: str, run_id: str | None = None) -> ToolCallFinished:
    return ToolCallFinished(**turn_fields(c, run_id), iteration=1, call_id=call_id, ok=True, result="done")


def attempt_failed(c: TurnClaimed, run_id: str | None = None, attempt: int = 1, retryable: bool = True
                   ) -> AttemptFailed:  # fmt: skip
    return AttemptFailed(**turn_fields(c, run_id, attempt), reason="timeout", retryable=retryable)


def metrics(**overrides: object) -> TurnMetrics:
    values: dict[str, object] = {
        "model": "m", "attempt": 1, "iterations": 0, "tool_calls": 0, "input_tokens": 0, "output_tokens": 0,
        "cost_usd": 0.0, "fallbacks": 0, "duration_ms": 0,
    }  # fmt: skip
    return TurnMetrics.model_validate(values | overrides)


def outcome(c: TurnClaimed, run_id: str | None = None, attempt: int = 1, statuses: dict[str, str] | None = None,
            operations: tuple[OperationRecord, ...] = (), **m: object) -> TurnCompleted:  # fmt: skip
    return TurnCompleted.model_validate({
        **turn_fields(c, run_id, attempt), "reply": "ok", "operations": operations,
        "statuses": statuses if statuses is not None else dict.fromkeys(c.input_ids, "answered"),
        "metrics": metrics(attempt=attempt, **m),
    })  # fmt: skip


def violations(report: AuditReport) -> dict[str, list[str]]:
    return {r.rule: [f"{v.where} {v.detail}" for v in r.violations] for r in report.rules if r.violations}


def one_turn(ids: tuple[str, ...] = ("m1",), at: int = 1000, boundary: int = 0) -> tuple[TurnClaimed, list[Event]]:
    c = claim(list(ids), at, boundary, run_id=f"run-{ids[0]}")
    return c, [c, started(c, at + 1), outcome(c, iterations=0)]


# -- a clean log ------------------------------------------------------------------------------


def test_a_clean_log_with_a_retry_tool_calls_and_two_turns_has_no_violation() -> None:
    m1, m2 = message("m1", 100), message("m2", 200)
    c = claim(["m1", "m2"], 1000, 0)
    call = ToolCall(call_id="call-1", name="search", arguments="{}")
    first_turn: list[Event] = [
        c, started(c, 1001),
        responded(c, calls=(call,)), tool_started(c, "call-1", side_effect=False), tool_finished(c, "call-1"),
        attempt_failed(c),  # the provider timed out: attempt 2, same turn id, new run id
        started(c, 1100, run_id="run-2", attempt=2),
        responded(c, iteration=1, run_id="run-2", attempt=2),
        outcome(c, run_id="run-2", attempt=2, iterations=1, tool_calls=1, cost_usd=0.002,
                operations=(OperationRecord(call_id="call-1", tool="transfer", side_effect=False,
                                            status="succeeded"),)),
    ]  # fmt: skip
    m3 = message("m3", 3000)
    c2 = claim(["m3"], 4000, 3, run_id="run-3")  # history: m1, m2 and the reply
    report = audit(records(m1, m2, *first_turn, m3, c2, started(c2, 4001), outcome(c2)))
    assert report.ok, render(report)
    assert report.rule("claim_once").checked == 3 and report.rule("attempts").checked == 3
    assert report.rule("one_outcome").checked == 2 and report.rule("budgets").checked == 2
    assert report.rule("no_replay_after_side_effect").checked == 2  # the failure and the retry
    assert report.outcomes == {"completed": 2, "failed": 0, "paused": 0, "exhausted": 0, "open": 0}
    assert not (report.stale or report.ignored or report.undecodable or report.open_turns)
    assert [r.rule for r in report.rules] == list(RULES)


# -- rule by rule ----------------------------------------------------------------------------


def test_a_message_claimed_by_two_logical_turns() -> None:
    c1, turn1 = one_turn(("m1",))
    c2 = claim(["m1", "m2"], 2000, 2, run_id="run-x")
    report = audit(records(message("m1", 1), *turn1, message("m2", 1500), c2))
    assert violations(report) == {
        "claim_once": [f"0@5 message 'm1' already claimed by turn {c1.turn_id[:12]} (0@1)"]
    }


def test_a_claim_whose_turn_id_boundary_or_inputs_are_wrong() -> None:
    bad_id = TurnClaimed(event_id=eid(), conversation_id=CONV, occurred_at=10, turn_id="not-the-hash", run_id="r",
                         attempt=1, input_ids=("m1",), history_boundary=0)  # fmt: skip
    report = audit(records(message("m1", 1), bad_id))
    assert violations(report) == {"claim_exact": ["0@1 turn id is not sha256 of the sorted claimed ids"]}

    report = audit(records(message("m1", 1), claim(["m1"], 10, boundary=5)))
    assert violations(report) == {"claim_exact": ["0@1 history boundary 5 != history length 0"]}

    report = audit(records(message("m1", 1), claim(["m1", "ghost"], 10, 0)))
    assert violations(report) == {"claim_exact": ["0@1 claims inputs never received: ['ghost']"]}

    twice = TurnClaimed(event_id=eid(), conversation_id=CONV, occurred_at=10, turn_id=logical_turn_id(["m1", "m1"]),
                        run_id="r", attempt=1, input_ids=("m1", "m1"), history_boundary=0)  # fmt: skip
    report = audit(records(message("m1", 1), twice))
    assert violations(report) == {"claim_exact": ["0@1 names an input more than once"]}

    c1 = claim(["m1"], 10, 0)
    log = records(message("m1", 1), c1, started(c1, 11), message("m2", 12), refusal("m2", c1.turn_id), outcome(c1),
                  claim(["m2"], 30, 2, run_id="run-2"))  # fmt: skip
    assert violations(audit(log)) == {"claim_exact": ["0@6 claims inputs that are no longer pending: ['m2']"]}


def test_a_claim_while_another_turn_of_the_conversation_is_active() -> None:
    c1 = claim(["m1"], 10, 0)
    c2 = claim(["m2"], 20, 0, run_id="run-other")
    report = audit(records(message("m1", 1), message("m2", 2), c1, started(c1, 11), c2))
    assert violations(report) == {
        "one_active_turn": [f"0@4 claimed while turn {c1.turn_id[:12]} (claimed 0@2) is active"]
    }
    assert report.rule("one_active_turn").violations[0].turn_id == c2.turn_id


def test_attempts_must_have_new_run_ids_increasing_numbers_and_follow_a_failure() -> None:
    c = claim(["m1"], 10, 0)
    head: list[Event] = [message("m1", 1), c, started(c, 11), attempt_failed(c)]
    reused = audit(records(*head, started(c, 20, run_id=c.run_id, attempt=2)))
    assert violations(reused) == {"attempts": ["0@4 attempt 2 reuses run id run-1 of attempt 1"]}

    skipped = audit(records(*head, started(c, 20, run_id="run-3", attempt=3)))
    assert violations(skipped) == {"attempts": ["0@4 attempt 3 follows attempt 1"]}

    still_open = audit(records(message("m1", 1), c, started(c, 11), started(c, 20, run_id="run-2", attempt=2)))
    assert violations(still_open) == {"attempts": ["0@3 attempt 2 started while attempt 1 (run-1) had not failed"]}

    unclaimed = audit(records(message("m1", 1), started(c, 11)))
    assert violations(unclaimed) == {"attempts": ["0@1 attempt 1 of a turn that was never claimed"]}


def test_no_attempt_fresh_or_resuming_after_its_owner_failed_the_turn_for_good() -> None:
    # Given an attempt whose owner failed it, not retryable (here after a side effect), when
    # a next owner starts another attempt instead of writing the TurnFailed, then that is a
    # violation -- resuming the journal or not.
    c = claim(["m1"], 10, 0)
    head: list[Event] = [message("m1", 1), c, started(c, 11), attempt_failed(c, retryable=False)]
    fresh = audit(records(*head, started(c, 20, run_id="run-2", attempt=2)))
    resumed = AttemptStarted(**turn_fields(c, "run-2", 2), model="m", resumes_run_id=c.run_id)
    for report in (fresh, audit(records(*head, resumed))):
        assert violations(report) == {
            "attempts": ["0@4 attempt 2 started after attempt 1 (run-1) failed for good: timeout"]
        }
    # A takeover's closing of a stopped run is not its owner's verdict: resuming it is fine.
    closing = AttemptFailed(**turn_fields(c, None, 1), reason=STOPPED_MID_ATTEMPT, retryable=False)
    after_takeover = audit(records(message("m1", 1), c, started(c, 11), closing, resumed))
    assert after_takeover.ok, render(after_takeover)


def test_a_call_an_earlier_run_started_is_never_recorded_as_not_started() -> None:
    # Given a side-effecting call run 1 started (then its worker died), and run 2 resuming
    # it with its key, when run 2 records the call as never started, then that is a violation
    # of the resume rule: run 1 may have acted, and the model reads "it had no effect".
    c = claim(["m1"], 10, 0)
    first = tool_started(c, "call-1", side_effect=True, run_id=c.run_id).model_copy(update={"idempotency_key": "k"})
    closing = AttemptFailed(**turn_fields(c, None, 1), reason=STOPPED_MID_ATTEMPT, retryable=False)
    resumed = AttemptStarted(**turn_fields(c, "run-2", 2), model="m", resumes_run_id=c.run_id)
    again = tool_started(c, "call-1", side_effect=True, run_id="run-2", attempt=2).model_copy(
        update={"idempotency_key": "k"}
    )
    not_started = ToolCallFinished(**turn_fields(c, "run-2", 2), iteration=1, call_id="call-1", ok=False,
                                   result=NOT_STARTED)  # fmt: skip
    head = [message("m1", 1), c, started(c, 11), responded(c), first, closing, resumed, again]
    report = audit(records(*head, not_started))
    assert violations(report) == {
        "resume": ["0@8 call call-1 (transfer) recorded as never started, though run run-1 started it before: "
                   "it may have acted"]
    }  # fmt: skip
    # Once only, and not for a record of a run already closed, which every reader ignores
    twice = audit(records(*head, not_started, not_started))
    assert len(violations(twice)["resume"]) == 1
    closed = AttemptFailed(**turn_fields(c, "run-2", 2), reason=STOPPED_MID_ATTEMPT, retryable=False)
    late = audit(records(*head, closed, not_started))
    assert "resume" not in violations(late) and late.stale
    # Run 1's own start cut short is what NOT_STARTED is for.
    alone = ToolCallFinished(**turn_fields(c), iteration=1, call_id="call-1", ok=False, result=NOT_STARTED)
    assert audit(records(message("m1", 1), c, started(c, 11), responded(c), first, alone)).ok


def test_no_attempt_after_a_side_effect_started() -> None:
    c = claim(["m1"], 10, 0)
    log = records(
        message("m1", 1), c, started(c, 11), responded(c),
        tool_started(c, "call-1", side_effect=True),  # may have moved money: never replayed
        attempt_failed(c, retryable=True),
        started(c, 30, run_id="run-2", attempt=2),
    )  # fmt: skip
    report = audit(log)
    assert violations(report) == {
        "no_replay_after_side_effect": [
            "0@5 attempt failure marked retryable after a side-effecting tool started",
            "0@6 attempt 2 started after side-effecting tools started: transfer",
        ]
    }
    # A read-only tool does not forbid a retry.
    safe = audit(records(message("m1", 1), c, started(c, 11), tool_started(c, "call-1", side_effect=False),
                         attempt_failed(c), started(c, 30, run_id="run-2", attempt=2)))  # fmt: skip
    assert safe.ok, render(safe)


def test_exactly_one_outcome_per_claimed_turn() -> None:
    c, turn = one_turn()
    second = TurnFailed.model_validate({**turn_fields(c), "error": "again", "statuses": {"m1": "failed"},
                                        "metrics": metrics()})  # fmt: skip
    report = audit(records(message("m1", 1), *turn, second))
    assert violations(report) == {"one_outcome": ["0@4 second outcome TurnFailed; the first was TurnCompleted at 0@3"]}

    # The same record republished (same event id) is a duplicate, not a second outcome.
    report = audit(records(message("m1", 1), *turn, turn[-1]))
    assert report.ok and [f.detail for f in report.ignored] == ["TurnCompleted republished (same event id)"]

    report = audit(records(message("m1", 1), outcome(c)))
    assert violations(report) == {"one_outcome": ["0@1 TurnCompleted of a turn that was never claimed"]}

    report = audit(records(message("m1", 1), c, started(c, 11), outcome(c, statuses={"m9": "answered"})))
    assert violations(report) == {"one_outcome": ["0@3 statuses for ['m9'] but the turn claimed ['m1']"]}

    # An outcome with no attempt started: the engine writes a claim and its first attempt
    # together, so this one was written by something else (it passed as clean before).
    report = audit(records(message("m1", 1), c, outcome(c)))
    never = "0@2 TurnCompleted of attempt 1, which never started (no AttemptStarted)"
    assert violations(report) == {"attempts": [never]}


def refusal(message_id: str, turn_id: str) -> MessageRejected:
    return MessageRejected(event_id=eid(), conversation_id=CONV, occurred_at=50, message_id=message_id,
                           reason="turn_active", active_turn_id=turn_id, text="busy")  # fmt: skip


def test_a_double_text_refusal_names_the_turn_its_message_arrived_during() -> None:
    c1 = claim(["m1"], 10, 0)
    head: list[Event] = [message("m1", 1), c1, started(c1, 11), message("m2", 12)]  # m2 arrives mid-turn
    # The refusal may land after the outcome: what counts is when the message arrived.
    ok = audit(records(*head, outcome(c1), refusal("m2", c1.turn_id)))
    assert ok.ok and ok.rule("double_text").checked == 1, render(ok)

    wrong_turn = audit(records(*head, refusal("m2", "some-other-turn")))
    assert violations(wrong_turn) == {
        "double_text": [f"0@4 names turn some-other-t; 'm2' arrived during {c1.turn_id[:12]}"]
    }
    idle = audit(records(message("m1", 1), refusal("m1", c1.turn_id)))
    assert violations(idle) == {"double_text": ["0@1 refuses message 'm1', which arrived while no turn was active"]}
    never = audit(records(*head, refusal("m9", c1.turn_id)))
    assert violations(never) == {"double_text": ["0@4 refuses message 'm9', which was never received"]}
    claimed = audit(records(*head, refusal("m1", c1.turn_id)))
    assert violations(claimed) == {
        "double_text": [f"0@4 refuses message 'm1', which turn {c1.turn_id[:12]} claimed"]
    }
    twice = audit(records(*head, refusal("m2", c1.turn_id), refusal("m2", c1.turn_id)))
    assert twice.ok and [f.detail for f in twice.stale] == ["message 'm2' refused again"]


def test_open_turns_are_reported_and_are_violations_only_when_strict() -> None:
    c = claim(["m1"], 10, 0)
    log = records(message("m1", 1), c, started(c, 11))
    report = audit(log)
    assert report.ok
    assert [(f.where, f.turn_id) for f in report.open_turns] == [("0@1", c.turn_id)]
    assert report.outcomes["open"] == 1
    strict = audit(log, strict=True)
    assert not strict.ok and strict.violations == 1


def test_outcome_metrics_must_match_the_events() -> None:
    c = claim(["m1"], 10, 0)
    log = records(message("m1", 1), c, started(c, 11), responded(c), tool_started(c, "call-1", side_effect=False),
                  outcome(c, iterations=1, tool_calls=0, cost_usd=0.001))  # fmt: skip
    [line] = violations(audit(log))["budgets"]
    assert line.startswith("0@5 TurnCompleted metrics disagree with the log: tool_calls 0 (log: 1)")
    assert "operations [] (log: [('call-1', 'transfer', False, 'unknown')])" in line


def test_budget_limits_when_given() -> None:
    c = claim(["m1"], 10, 0)
    log = records(
        message("m1", 1), c, started(c, 11),
        responded(c, 1, cost=0.3), tool_started(c, "a", side_effect=False), tool_finished(c, "a"),
        responded(c, 2, cost=0.3), tool_started(c, "b", side_effect=False), tool_finished(c, "b"),
        responded(c, 3, cost=0.3),
    )  # fmt: skip
    assert audit(log).ok  # without limits only the metrics are checked (and this turn is still open)
    report = audit(log, AuditLimits(max_iterations=2, max_tool_calls=1, max_cost_usd=0.5))
    assert violations(report) == {
        "budgets": [
            "0@7 tool call 2 (transfer) beyond the limit of 1",
            "0@9 iteration 3 beyond the limit of 2",
            "0@9 a model request after $0.600000 was spent (limit $0.500000)",
        ]
    }


def test_a_conversation_in_two_partitions() -> None:
    report = audit(records((0, message("m1", 1)), (1, message("m2", 2))))
    assert violations(report) == {"one_partition": ["1@0 event in partition 1; the conversation's first was in 0"]}


# -- notices -----------------------------------------------------------------------------------


def test_events_of_a_stale_run_are_reported_not_violations() -> None:
    """Worker A's attempt was taken over (AttemptFailed, attempt 2 by B); A, a zombie, still
    writes. Every reader ignores A's events; the auditor lists them."""
    c = claim(["m1"], 10, 0)
    log = records(
        message("m1", 1), c, started(c, 11),
        attempt_failed(c), started(c, 30, run_id="run-B", attempt=2),
        responded(c),  # from run-1, the zombie
        tool_started(c, "call-z", side_effect=True),  # the zombie even starts a side effect
        responded(c, run_id="run-B", attempt=2),
        outcome(c, run_id="run-B", attempt=2, iterations=1, cost_usd=0.001),
        outcome(c),  # the zombie's outcome, ignored
    )  # fmt: skip
    report = audit(log)
    assert report.ok, render(report)
    assert [f.where for f in report.stale] == ["0@5", "0@6", "0@9"]
    assert "side-effecting tool, transfer, started in a stale run" in report.stale[1].detail
    assert "not the run that ended the turn" in report.stale[2].detail


def test_duplicates_conflicts_and_undecodable_values_are_notices() -> None:
    c, turn = one_turn()
    log = records(
        message("m1", 1), message("m1", 1),  # republished: harmless
        message("m1", 1, content="other text"),  # id reused: a conflict the workers dead-letter
        b"not json", b'{"type": "MessageReceived"}',
        *turn, c,  # the same claim again: the first claim won
    )  # fmt: skip
    log.append(Record(0, len(log), b"wrong-key", encode(message("m2", 5))))
    log.append(Record(0, len(log), None, None, unreadable="a header name is not UTF-8"))  # (the client's stand-in)
    report = audit(log)
    assert report.ok, render(report)
    assert [f.detail.split(":")[0] for f in report.ignored] == ["MessageReceived ignored", "MessageReceived conflict"]
    assert [f.where for f in report.undecodable] == ["0@3", "0@4", "0@9", "0@10"]
    assert report.undecodable[2].detail.startswith("key_mismatch")
    assert report.undecodable[3].detail == "unreadable: a header name is not UTF-8"  # not a tombstone
    assert [f.where for f in report.stale] == ["0@8"] and "another claim" in report.stale[0].detail


def test_given_the_dlq_when_audited_then_its_letters_and_the_values_never_dead_lettered_are_findings() -> None:
    log = records(message("m1", 1), b"not json", b"\xff" * 5000, b"[1]")
    letters = [
        DeadLetter.of("turnstile.events", 0, 1, CONV.encode(), b"not json", "not_json", "bad", None),
        DeadLetter.of("turnstile.events", 0, 2, CONV.encode(), b"\xff" * 5000, "not_json", "bad", 1000),
    ]
    report = Auditor().feed_all(log).feed_dead_letters(letters).report()
    assert [f.where for f in report.dead_letters] == ["0@1", "0@2"]
    assert "a prefix of 5000 bytes, sha256 " in report.dead_letters[1].detail
    assert [f.where for f in report.not_dead_lettered] == ["0@3"]  # no worker got past it
    text = render(report)
    assert "2 letters on the dead-letter topic" in text and "1 undecodable values with no dead letter" in text
    assert report.to_json()["not_dead_lettered"][0]["at"] == "0@3"


def test_given_no_dlq_read_when_audited_then_nothing_is_said_of_letters() -> None:
    report = audit(records(b"not json"))
    assert report.dead_letters == [] and report.not_dead_lettered == []


def test_given_inputs_unclaimed_while_their_partition_went_on_when_audited_then_the_conversation_is_stalled() -> None:
    waiting = message("m1", 1_000, conv="quiet")
    busy = [message(f"b{i}", 91_000, conv=f"busy-{i}") for i in range(3)]  # the partition goes on, 90 s later
    report = Auditor().feed_all(records(waiting, *busy)).report(stall_after_s=60)
    assert [(f.where, f.conversation_id) for f in report.stalled] == [("0@0", "quiet")]  # the busy ones just arrived
    assert "1 input(s) pending with no claim for 90 s" in report.stalled[0].detail
    assert report.ok  # a finding, not a violation ...
    assert not Auditor().feed_all(records(waiting, *busy)).report(strict=True, stall_after_s=120).stalled
    strict = Auditor().feed_all(records(waiting, *busy)).report(strict=True, stall_after_s=60)
    assert strict.violations == 1  # ... unless --strict
    assert "not progressing: 1 stalled conversation(s)" in render(report)


def test_given_a_conversation_whose_turn_answered_its_inputs_when_audited_then_it_is_not_stalled() -> None:
    _, turn = one_turn()
    later = message("other", 500_000, conv="other")
    assert Auditor().feed_all(records(message("m1", 1), *turn, later)).report(stall_after_s=60).stalled == []


def test_given_the_workers_committed_offsets_when_audited_then_a_partition_stuck_at_a_poison_value_is_named() -> None:
    log = records(message("m1", 1), message("m2", 2), b"not json", message("m3", 4), message("m4", 5))
    stuck = Auditor().feed_all(log).feed_committed({0: 2}).report()
    [finding] = stuck.not_committed_past
    assert finding.where == "0@2" and "3 record(s) behind the end" in finding.detail
    assert "the record there does not decode (not_json" in finding.detail
    assert Auditor().feed_all(log).feed_committed({0: 2}).report(strict=True).violations == 1
    caught_up = Auditor().feed_all(log).feed_committed({0: 5}).report()
    assert caught_up.not_committed_past == [] and caught_up.poisoned
    verdict = "no violation; poisoned: 1 value(s) that do not decode, 0 dead letter(s)"
    assert render(caught_up).rstrip().endswith(verdict)
    assert Auditor().feed_all(log).report().not_committed_past == []  # no offsets given: not reported


def test_an_input_the_workers_committed_past_without_claiming_it_is_stalled_even_at_the_logs_end() -> None:
    # Given an input at the end of a quiet log (its partition does not go on), when the
    # workers' group has committed past it and it is still not claimed a minute later
    log = records(message("m1", 1_000))
    passed = Auditor().feed_all(log).feed_committed({0: 1})
    [stalled] = passed.report(stall_after_s=60, now_ms=62_000).stalled
    assert stalled.where == "0@0" and "pending with no claim for 61 s though the workers' group committed past" in (
        stalled.detail
    )
    assert passed.report(strict=True, stall_after_s=60, now_ms=62_000).violations == 1
    # (not before the stall age, and not when the group has not read it yet: it may be on its way)
    assert passed.report(stall_after_s=60, now_ms=30_000).stalled == []
    assert Auditor().feed_all(log).feed_committed({0: 0}).report(stall_after_s=60, now_ms=62_000).stalled == []


def test_a_strict_audit_does_not_call_a_log_clean_when_the_workers_committed_nothing(tmp_path: Path) -> None:
    # Given a clean log that no worker of the named group has committed on
    _, turn = one_turn()
    write_file_log(tmp_path, records(message("m1", 1), *turn))
    # when audited strictly, then every partition is behind from offset 0, which fails the audit
    result = turnstile_audit("--data", str(tmp_path), "--json", "--strict")
    assert result.returncode == 1, result.stdout + result.stderr
    [finding] = json.loads(result.stdout)["not_committed_past"]
    assert finding["at"] == "0@0" and "--strict counts every partition" in result.stderr
    # and once the worker has committed to the end the same audit passes
    asyncio.run(FileLog(tmp_path).commit({0: 1 + len(turn)}))
    assert turnstile_audit("--data", str(tmp_path), "--strict").returncode == 0


def test_turnstile_audit_reads_how_far_the_embedded_worker_committed(tmp_path: Path) -> None:
    write_file_log(tmp_path, records(message("m1", 1), b"not json", message("m2", 3)))
    asyncio.run(FileLog(tmp_path).commit({0: 1}))
    result = turnstile_audit("--data", str(tmp_path), "--json", "--strict")
    assert result.returncode == 1, result.stdout + result.stderr
    [finding] = json.loads(result.stdout)["not_committed_past"]
    assert finding["at"] == "0@1" and "does not decode" in finding["detail"]


def answered(conv: str, message_id: str, at: int, boundary: int = 0) -> list[Event]:
    """A message and the turn that answers it, `at` ms into the log's time."""
    c = claim([message_id], at + 10, boundary, run_id=f"run-{conv}-{message_id}", conv=conv)
    return [message(message_id, at, conv=conv), c, started(c, at + 11), outcome(c, iterations=0)]


def two_answered_turns() -> tuple[list[Record], list[Event]]:
    """A log of two answered turns, and the two outcomes a worker publishes for it."""
    first, second = answered(CONV, "m1", 1_000), answered(CONV, "m2", 5_000, boundary=2)
    return records(*first, *second), [first[-1], second[-1]]


def published(*outcomes: Event, partition: int = 0) -> list[tuple[int, bytes | None, int | None]]:
    """Outcome records as the worker writes them, each written when it occurred."""
    return [(partition, encode(e), e.occurred_at) for e in outcomes]


def test_given_the_outcomes_topic_when_an_outcome_committed_past_is_missing_then_it_is_named() -> None:
    log, (first, second) = two_answered_turns()  # the outcomes at 0@3 and 0@7

    def audited(outcomes: list[Event], committed: int, start: int = 0) -> AuditReport:
        auditor = Auditor().feed_all(log).feed_committed({0: committed})
        return auditor.feed_outcomes(published(*outcomes), {0: start}).report()

    assert audited([first, second], committed=8).unpublished == []
    [missing] = audited([first], committed=8).unpublished
    assert (missing.where, missing.turn_id) == ("0@7", second.turn_id)
    assert "TurnCompleted the workers' group committed past is not on the outcomes topic" in missing.detail
    assert audited([first], committed=7).unpublished == []  # not committed past: may still be on its way
    # Retention deleted the oldest: judged from the oldest record the partition still holds.
    assert audited([], committed=8, start=5).unpublished == []  # all deleted: no verdict
    assert audited([second], committed=8, start=1).unpublished == []
    assert [f.where for f in audited([first], committed=8, start=1).unpublished] == ["0@7"]
    report = audited([first], committed=8)
    assert report.ok and not audited([first], committed=8).strict
    strict = Auditor().feed_all(log).feed_committed({0: 8}).feed_outcomes(published(first), {0: 0}).report(strict=True)
    assert strict.violations == 1 and strict.outcomes_due == 2  # a finding, a violation with --strict
    # A worker that published nothing at all is caught: an empty topic is judged.
    nothing = Auditor().feed_all(log).feed_committed({0: 8}).feed_outcomes([], {0: 0}).report(strict=True)
    assert [f.where for f in nothing.unpublished] == ["0@3", "0@7"] and not nothing.ok
    assert "the outcomes topic holds no outcome at all: none was published, or it is not this log's" in render(nothing)
    assert render(report).rstrip().endswith("no violation; 1 outcome(s) missing from the outcomes topic")
    assert Auditor().feed_all(log).feed_outcomes([], {0: 0}).report().unpublished == []  # no offsets: not judged
    # An incremental audit reports them whole: one still on its way last time is not skipped.
    assert [f.where for f in report.since({0: 8}).unpublished] == ["0@7"]
    # A topic holding outcomes, none of them this log's, is another log's (the default one,
    # read by an audit that named only its events topic): said, not judged.
    other = answered("other-log", "m9", 9_000)[-1]
    foreign = Auditor().feed_all(log).feed_committed({0: 8}).feed_outcomes(published(other), {0: 0}).report(strict=True)
    assert foreign.ok and foreign.outcomes_topic_foreign and foreign.unpublished == []
    assert "the outcomes topic holds none of the 2 outcomes the workers committed past" in render(foreign)


def test_given_retention_per_partition_when_one_partition_lost_old_outcomes_then_only_its_own_age_counts() -> None:
    # Kafka deletes each partition's segments on its own: a quiet partition still holds an
    # old outcome while a busy one lost newer ones. Conversations x and y are in different
    # partitions of a 2-partition outcomes topic.
    x, y = "conv-a", "conv-b"
    px, py = partition_for(x, 2), partition_for(y, 2)
    assert px != py
    old_y, lost_x, kept_x = answered(y, "y1", 1_000), answered(x, "x1", 3_000), answered(x, "x2", 6_000, boundary=2)
    log = records(*old_y, *lost_x, *kept_x)

    def unpublished(outcomes: list[tuple[int, bytes | None, int | None]], x_start: int) -> list[str]:
        auditor = Auditor().feed_all(log).feed_committed({0: len(log)})
        report = auditor.feed_outcomes(outcomes, {py: 0, px: x_start}).report()
        return [f"{f.conversation_id}@{f.offset}" for f in report.unpublished]

    kept = published(old_y[-1], partition=py) + published(kept_x[-1], partition=px)
    assert unpublished(kept, x_start=1) == []  # x1's outcome is older than what x's partition kept
    assert unpublished(kept, x_start=0) == [f"{x}@7"]  # nothing deleted there: x1's is lost
    # When a record was written is Kafka's timestamp, not its event's: an old outcome written
    # again long after (a takeover publishes once more) does not pull the partition's age back.
    early_x = answered(x, "x0", 2_000)[-1]
    again = [*kept, (px, encode(early_x), 9_000)]
    assert unpublished(again, x_start=1) == []


def test_given_a_refused_outcome_record_when_its_letter_says_so_then_it_is_not_missing() -> None:
    log, (first, second) = two_answered_turns()
    letter = DeadLetter.of("turnstile.events", 0, 7, CONV.encode(), encode(second), "effect_skipped", "too big", None)
    auditor = Auditor().feed_all(log).feed_committed({0: 8}).feed_dead_letters([letter])
    noise = [(0, b"not an outcome", None), (0, b"[1]", None)]
    report = auditor.feed_outcomes([*published(first), *noise], {0: 0}).report()
    assert report.unpublished == [] and [f.where for f in report.dead_letters] == ["0@7"]


def test_a_value_never_dead_lettered_that_the_workers_committed_past_is_said_so() -> None:
    log = records(message("m1", 1), b"not json", b"[1]")
    report = Auditor().feed_all(log).feed_dead_letters([]).feed_committed({0: 2}).report()
    past, ahead = report.not_dead_lettered
    assert past.where == "0@1" and "though the workers' group committed past it" in past.detail
    assert ahead.where == "0@2" and "no worker got past it yet)" in ahead.detail
    unknown = Auditor().feed_all(log).feed_dead_letters([]).report().not_dead_lettered
    assert all("no worker got past it yet?)" in f.detail for f in unknown)  # how far they got is not known


def test_turnstile_audit_reads_the_embedded_outcomes_topic(tmp_path: Path) -> None:
    log, (first, _second) = two_answered_turns()
    write_file_log(tmp_path, log)
    file_log = FileLog(tmp_path, Topics())
    asyncio.run(file_log.append(Topics().outcomes, CONV, encode(first)))
    asyncio.run(file_log.commit({0: 8}))
    result = turnstile_audit("--data", str(tmp_path), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [f["at"] for f in json.loads(result.stdout)["unpublished"]] == ["0@7"]


# -- report ------------------------------------------------------------------------------------


def bad_log() -> list[Record]:
    c1 = claim(["m1"], 10, 0)
    c2 = claim(["m2"], 20, 0, run_id="run-other")
    return records(message("m1", 1), message("m2", 2), c1, started(c1, 11), c2)


def test_render_names_each_rule_with_counts_and_places() -> None:
    text = render(audit(bad_log()))
    assert "FAIL one_active_turn" in text and "0@4" in text
    assert "ok   claim_once" in text
    assert text.rstrip().endswith("1 violation(s)")
    assert render(audit(records(message("m1", 1)))).rstrip().endswith("no violation; the log is clean")


def test_json_report_and_incremental_reporting() -> None:
    report = audit(bad_log())
    data = json.loads(json.dumps(report.to_json()))
    assert data["ok"] is False and data["violations"] == 1
    rule = next(r for r in data["rules"] if r["rule"] == "one_active_turn")
    assert rule["violations"][0]["at"] == "0@4" and rule["checked"] == 2
    assert not report.since({0: 5}).rule("one_active_turn").violations  # reported by an earlier audit
    assert "clean" not in render(report.since({0: 5})).splitlines()[-1]  # no verdict on what it did not judge
    assert report.since({0: 4}).violations == 1 and report.since({1: 9}).violations == 1


# -- the command on the embedded log -----------------------------------------------------------

ROOT = Path(__file__).parent.parent


def write_file_log(directory: Path, log: list[Record]) -> None:
    file_log = FileLog(directory, Topics())

    async def write() -> None:
        for r in log:
            assert r.key is not None and r.value is not None
            await file_log.append(Topics().events, r.key.decode(), r.value, r.partition)

    asyncio.run(write())


def turnstile_audit(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "turnstile.streams.cli", "audit", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_turnstile_audit_on_the_embedded_log_exits_1_on_a_violation(tmp_path: Path) -> None:
    write_file_log(tmp_path / "bad", bad_log())
    result = turnstile_audit("--data", str(tmp_path / "bad"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL one_active_turn" in result.stdout and "0@4" in result.stdout

    _, turn = one_turn()
    write_file_log(tmp_path / "good", records(message("m1", 1), *turn))
    result = turnstile_audit("--data", str(tmp_path / "good"), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["outcomes"]["completed"] == 1


def test_turnstile_audit_exits_2_when_there_is_no_log(tmp_path: Path) -> None:
    result = turnstile_audit("--data", str(tmp_path / "nothing-here"))
    assert result.returncode == 2 and "cannot read the log" in result.stderr


def test_a_zombie_that_starts_its_own_next_attempt_is_stale_not_a_second_outcome() -> None:
    """Seen on a real log after a rebalance: worker B took attempt 1 over and started
    attempt 2; the old owner A, not yet stopped, failed attempt 1 itself and started its own
    attempt 2, answered, and wrote an outcome after B's. The fold ignores all of A's."""
    c = claim(["m1"], 10, 0)
    log = records(
        message("m1", 1), c, started(c, 11),
        attempt_failed(c), started(c, 30, run_id="run-B", attempt=2),  # B takes over
        attempt_failed(c),  # A's own failure of attempt 1
        started(c, 31, run_id="run-Z", attempt=2),  # A's attempt 2: a zombie run
        responded(c, run_id="run-B", attempt=2),
        outcome(c, run_id="run-B", attempt=2, iterations=1, cost_usd=0.001),
        responded(c, run_id="run-Z", attempt=2),
        outcome(c, run_id="run-Z", attempt=2, iterations=1, cost_usd=0.001),
    )  # fmt: skip
    report = audit(log)
    assert report.ok, render(report)
    assert [f.where for f in report.stale] == ["0@5", "0@6", "0@9", "0@10"]
    assert "a worker that lost it?" in report.stale[1].detail
    # An attempt that skips a number is no zombie: a violation.
    skipped = audit(records(message("m1", 1), c, started(c, 11), attempt_failed(c),
                            started(c, 30, run_id="run-B", attempt=3)))  # fmt: skip
    assert violations(skipped) == {"attempts": ["0@4 attempt 3 follows attempt 1"]}


def test_the_fold_refuses_a_claim_that_names_an_input_twice_instead_of_crashing() -> None:
    from turnstile.projections import apply_event, new_state

    state = new_state(CONV)
    assert apply_event(state, message("m1", 1)) is None
    twice = TurnClaimed(event_id=eid(), conversation_id=CONV, occurred_at=10, turn_id=logical_turn_id(["m1", "m1"]),
                        run_id="r", attempt=1, input_ids=("m1", "m1"), history_boundary=0)  # fmt: skip
    rejection = apply_event(state, twice)
    assert rejection is not None and "more than once" in rejection.reason
    assert "m1" in state.pending and state.active is None


# -- any log ------------------------------------------------------------------------------------

_IDS = ("m1", "m2", "m3")
_RUNS = ("run-1", "run-2", "run-3")


def _allowed(state: ConversationState, arrived_during: dict[str, str | None]) -> list[str]:
    """What a correct engine may write next."""
    turn = state.active
    if turn is None:
        return ["message", "claim"] if state.pending else ["message"]
    out = ["message"]
    if any(arrived_during.get(i) == turn.turn_id for i in state.pending):
        out.append("refuse")
    retry = turn.verdict is not None and turn.verdict.retryable and not turn.side_effect_started
    if turn.attempt_state == "claimed" or (turn.attempt_state == "closed" and retry):
        out.append("start")
    if turn.attempt_state in ("claimed", "open"):
        out.append("fail")
    if turn.attempt_state == "open":
        out += ["respond", "tool", "end"]
        if any(op.status == "started" for op in turn.operations.values()):
            out.append("finish")
    return out


@st.composite
def any_log(draw: st.DrawFn, correct: bool = False) -> list[Event]:
    """A log that a plausible engine writes, folded as it is built so that most events are
    valid, with some drawn off course (other runs, attempt numbers, inputs, boundaries) —
    unless `correct`: then every event is one a correct engine could write."""
    from turnstile.projections import apply_event, new_state

    state = new_state(CONV)
    log: list[Event] = []
    runs = itertools.count(1)
    arrived_during: dict[str, str | None] = {}
    for _ in range(draw(st.integers(0, 30))):
        turn = state.active
        everything = ["message", "claim", "start", "fail", "respond", "tool", "finish", "end", "refuse"]
        action = draw(st.sampled_from(_allowed(state, arrived_during) if correct else everything))
        off = not correct and draw(st.integers(0, 5)) == 0  # one event in six goes astray
        ids = list(state.pending) or ["m-new"]
        if turn is None and action not in ("message", "claim", "refuse"):
            action = "message"
        if correct and action == "refuse":
            ids = [i for i in state.pending if turn and arrived_during.get(i) == turn.turn_id]
        if action == "message":
            event: Event = message(draw(st.sampled_from([*_IDS, f"m{len(log)}"])), len(log))
        elif action == "claim":
            chosen = ids[: draw(st.integers(1, len(ids)))] + (["m1"] if off else [])
            event = claim(chosen, len(log), len(state.history) + (1 if off else 0), run_id=f"run-{next(runs)}")
        elif action == "refuse":
            event = refusal(draw(st.sampled_from(ids)), turn.turn_id if turn else "no-turn")
        else:
            assert turn is not None
            c = claim(list(turn.input_ids), turn.claimed_at, turn.history_boundary, run_id=turn.run_id)
            run, attempt = turn.run_id, turn.attempt
            if off:
                run, attempt = draw(st.sampled_from(_RUNS)), draw(st.integers(1, 3))
            if action == "start":
                fresh = turn.attempt_state == "closed" and not off
                event = started(c, len(log), run_id=f"run-{next(runs)}" if fresh else run,
                                attempt=attempt + 1 if fresh else attempt)  # fmt: skip
            elif action == "fail":
                retryable = draw(st.booleans()) and not (correct and turn.side_effect_started)
                event = attempt_failed(c, run_id=run, attempt=attempt, retryable=retryable)
            elif action == "respond":
                event = responded(c, turn.iterations + 1, run_id=run, attempt=attempt)
            elif action == "tool":
                call = f"call-{len(log)}"
                event = tool_started(c, call, draw(st.booleans()), run_id=run, attempt=attempt)
            elif action == "finish":
                started_calls = [op.call_id for op in turn.operations.values() if op.status == "started"] or ["x"]
                event = tool_finished(c, draw(st.sampled_from(started_calls)), run_id=run)
            else:
                ops = tuple(
                    OperationRecord(call_id=o.call_id, tool=o.tool, side_effect=o.side_effect,
                                    status="unknown" if o.status == "started" else o.status)
                    for o in turn.operations.values()
                )  # fmt: skip
                event = outcome(c, run_id=run, attempt=attempt, operations=ops, iterations=turn.iterations,
                                tool_calls=turn.tool_calls + (1 if off else 0), cost_usd=turn.cost_usd,
                                model=turn.model or "m")  # fmt: skip
        if isinstance(event, MessageReceived) and event.message_id not in arrived_during:
            arrived_during[event.message_id] = turn.turn_id if turn else None
        apply_event(state, event)
        log.append(event)
    return log


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_log(), st.booleans())
def test_any_log_is_audited_without_raising_and_counts_add_up(events: list[Event], strict: bool) -> None:
    report = audit(records(*events), AuditLimits(2, 1, 0.001), strict=strict)
    assert report.events == len(events)
    assert report.outcomes["open"] == len(report.open_turns) <= 1
    if strict and report.open_turns:
        assert not report.ok
    render(report)
    json.dumps(report.to_json())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_log(correct=True))
def test_any_log_a_correct_engine_writes_has_no_violation(events: list[Event]) -> None:
    report = audit(records(*events))
    assert report.ok, render(report)
    assert not report.stale


def test_a_completion_from_a_run_its_attempt_failed_closed_is_stale() -> None:
    """A takeover wrote AttemptFailed(run-1) and then failed the turn visibly; run-1's late
    TurnCompleted is ignored by every reader and listed, never counted as the outcome."""
    c = claim(["m1"], 10, 0)
    failure = TurnFailed.model_validate({
        **turn_fields(c), "error": "A tool with side effects started before the worker stopped.",
        "statuses": {"m1": "failed"}, "metrics": metrics(),
    })  # fmt: skip
    log = records(message("m1", 1), c, started(c, 11), attempt_failed(c, retryable=False), outcome(c), failure)
    report = audit(log)
    assert report.ok, render(report)
    assert [f.where for f in report.stale] == ["0@4"]
    assert "after its AttemptFailed" in report.stale[0].detail


def test_cost_is_checked_by_the_recorded_outcome_and_time_by_the_deadline() -> None:
    c = claim(["m1"], 10, 0)
    at = lambda event, ms: event.model_copy(update={"occurred_at": c.occurred_at + ms})  # noqa: E731
    log = records(
        message("m1", 1), c, started(c, 11),
        at(responded(c, 1, cost=0.04), 100), at(tool_started(c, "a", side_effect=False), 1400),
        at(tool_finished(c, "a"), 1800),
        at(outcome(c, iterations=1, tool_calls=1, cost_usd=0.04, operations=(
            OperationRecord(call_id="a", tool="transfer", side_effect=False, status="succeeded"),)), 2600),
    )  # fmt: skip
    # the one request was made under the limit: only the outcome shows the overshoot
    report = audit(log, AuditLimits(max_cost_usd=0.035, deadline_s=1.5))
    assert violations(report) == {
        "budgets": [
            "0@6 TurnCompleted cost $0.040000, beyond the cost limit of $0.035000",
            "0@6 TurnCompleted recorded at 2600 ms, past the deadline of 1.5 s and its grace of 1000 ms",
        ]
    }
    # the tool started before the deadline and finished within its grace; a later start is a violation
    late = audit(log, AuditLimits(deadline_s=1.2))
    assert "0@4 ToolCallStarted started at 1400 ms, past the deadline of 1.2 s" in violations(late)["budgets"]
    assert audit(log, AuditLimits(max_cost_usd=0.04, deadline_s=2)).ok


def test_a_side_effecting_call_may_end_past_the_deadline_and_its_outcome_follow_it() -> None:
    # The engine does not cut a side effect off at the deadline (it would be in doubt for good):
    # it runs to its own timeout, and the pause follows its result.
    c = claim(["m1"], 10, 0)
    at = lambda event, ms: event.model_copy(update={"occurred_at": c.occurred_at + ms})  # noqa: E731
    head = (message("m1", 1), c, started(c, 11), at(responded(c, 1), 100),
            at(tool_started(c, "pay", side_effect=True), 900), at(tool_finished(c, "pay"), 4000))  # fmt: skip
    paid = OperationRecord(call_id="pay", tool="transfer", side_effect=True, status="succeeded")
    on_time = at(outcome(c, iterations=1, tool_calls=1, cost_usd=0.001, operations=(paid,)), 4100)
    assert audit(records(*head, on_time), AuditLimits(deadline_s=1.0)).ok
    # and when the call ends within the grace, what follows it has the grace after it too
    early = (*head[:-1], at(tool_finished(c, "pay"), 1900))
    after = at(outcome(c, iterations=1, tool_calls=1, cost_usd=0.001, operations=(paid,)), 2200)
    assert audit(records(*early, after), AuditLimits(deadline_s=1.0)).ok
    # what comes later than the grace after it is still past the deadline
    late = at(outcome(c, iterations=1, tool_calls=1, cost_usd=0.001, operations=(paid,)), 5200)
    report = audit(records(*head, late), AuditLimits(deadline_s=1.0))
    assert violations(report) == {
        "budgets": ["0@6 TurnCompleted recorded at 5200 ms, past the deadline of 1 s and its grace of 1000 ms"]
    }


def test_the_text_report_prints_ids_inert_and_lines_bounded() -> None:
    # (an escape sequence in a conversation id restyled the auditor's terminal; a 1 MB input
    # id made a 1 MB line)
    hostile = "esc-\x1b[41mDUP\x1b[0m"
    ghosts = [f"{n}-" + "g" * 250 for n in range(5)]
    bad = claim(["m1", *ghosts], 10, 0, conv=hostile)
    report = audit(records(message("m1", 1, conv=hostile), bad))

    text = render(report)

    assert "\x1b" not in text and "esc-\\x1b[41mDUP\\x1b[0m" in text
    [line] = [line for line in text.splitlines() if "claims inputs never received" in line]
    assert len(line) < 500 and line.endswith("characters; --json has it whole)")


def test_findings_on_a_partition_whose_first_events_are_gone_are_not_judged() -> None:
    # A turn whose messages expired (retention, deleted records): its claim names inputs this
    # log no longer holds. Read from offset 0 it is a violation; from where the partition now
    # starts, what came before is unknown (an outside hunt: 63 violations blamed the engine).
    c = claim(["m1"], 10, 0)
    whole = records(message("m1", 1), c, started(c, 11), outcome(c))
    kept = whole[1:]  # the message is gone: the partition starts at offset 1

    assert not audit(kept).ok
    report = Auditor().feed_all(kept).feed_starts({0: 1}).report()
    assert report.ok and report.truncated == {0: 1}
    assert report.not_judged[0].where == "0@1"  # and what follows from the claim refused
    assert "findings not judged: their partitions' first events are gone" in render(report)
    assert Auditor().feed_all(whole).feed_starts({0: 0}).report().ok  # a whole partition is judged as ever


def test_an_embedded_log_with_no_letter_yet_still_has_its_undecodable_values_checked(tmp_path: Path) -> None:
    # (its dead-letter folder is made with its first letter: read as "not checked", the value
    # with no letter went unreported -- an outside review caught it)
    write_file_log(tmp_path, records(message("m1", 1), b"not json"))
    result = turnstile_audit("--data", str(tmp_path), "--json")
    [value] = json.loads(result.stdout)["not_dead_lettered"]
    assert value["at"] == "0@1" and "dead letters are not checked" not in result.stderr


def test_a_letter_naming_another_topic_is_not_counted_as_this_logs(tmp_path: Path) -> None:
    from turnstile.events import DeadLetter

    write_file_log(tmp_path, records(message("m1", 1)))
    log = FileLog(tmp_path)
    theirs = DeadLetter.of("other.events", 0, 0, b"c9", b"x", "invalid_event", "forged or another log's")
    ours = DeadLetter.of(log.topics.events, 0, 0, CONV.encode(), b"x", "invalid_event", "one of ours")
    for letter in (theirs, ours):
        asyncio.run(log.append(log.topics.dead_letters, None, letter.model_dump_json().encode()))
    result = turnstile_audit("--data", str(tmp_path), "--json")
    assert [f["detail"] for f in json.loads(result.stdout)["dead_letters"]] == [
        "dead letter, invalid_event: one of ours"
    ]
    assert "1 dead letter(s) name another topic than 'turnstile.events' ('other.events' first)" in result.stderr

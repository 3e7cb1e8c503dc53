"""One realistic example of every event and of the dead letter, for the AsyncAPI document
and for people who want to see a value before they write one. Deterministic: the same
examples every time, so the generated contract does not drift on its own."""

from __future__ import annotations

from turnstile.events.dead_letter import DeadLetter
from turnstile.events.deltas import ReplyDelta
from turnstile.events.identity import logical_turn_id
from turnstile.events.inputs import Approval, InputInjected, MessageReceived, ResumeRequested
from turnstile.events.lifecycle import (
    AttemptFailed,
    AttemptStarted,
    ContextCompacted,
    FallbackEngaged,
    ModelResponded,
    ProtocolFailure,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnInterrupted,
    Usage,
)
from turnstile.events.outcomes import OperationRecord, TurnCompleted, TurnExhausted, TurnFailed, TurnMetrics, TurnPaused
from turnstile.events.rejections import MessageRejected
from turnstile.events.union import Event

CONVERSATION = "conv-42"
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
INPUTS = ("m-1", "m-2")
TURN = logical_turn_id(INPUTS)
RUN, RUN2 = "run-5b1e0c", "run-9d27aa"
_CALL = ToolCall(call_id="call_1", name="search_flights", arguments='{"date": "2026-01-09"}')


def _envelope(n: int, at: int) -> dict[str, object]:
    return {"event_id": f"evt-{n:04d}", "conversation_id": CONVERSATION, "occurred_at": T0 + at}


def _turn(n: int, at: int, run: str = RUN, attempt: int = 1) -> dict[str, object]:
    return {**_envelope(n, at), "turn_id": TURN, "run_id": run, "attempt": attempt}


def _metrics(**overrides: object) -> TurnMetrics:
    values: dict[str, object] = {
        "model": "gpt-4.1-mini",
        "attempt": 1,
        "iterations": 2,
        "tool_calls": 1,
        "input_tokens": 812,
        "output_tokens": 64,
        "cost_usd": 0.00043,
        "fallbacks": 0,
        "duration_ms": 2310,
    }
    return TurnMetrics.model_validate(values | overrides)


def event_examples() -> dict[str, Event]:
    """Event type -> one example of it."""
    statuses = dict.fromkeys(INPUTS, "answered")
    done = OperationRecord(call_id="call_1", tool="search_flights", side_effect=False, status="succeeded")
    examples: list[Event] = [
        MessageReceived(**_envelope(1, 0), message_id="m-1", content="check the dates"),
        InputInjected(
            **_envelope(2, 0),
            occurrence_key="daily-digest@2026-01-01T00:00Z",
            source="schedule",
            content="Send me today's digest.",
        ),
        ResumeRequested(**_envelope(3, 0), request_id="resume-1", resumes_turn_id=TURN),
        MessageRejected(
            **_envelope(17, 1500),
            message_id="m-3",
            reason="turn_active",
            active_turn_id=TURN,
            text="I'm still answering your earlier message; this one was not taken. Please send it again after.",
        ),
        TurnClaimed(**_turn(4, 1100), input_ids=INPUTS, history_boundary=6),
        AttemptStarted(**_turn(5, 1101), model="gpt-4.1-mini"),
        ModelResponded(
            **_turn(6, 1900),
            iteration=1,
            model="gpt-4.1-mini",
            tool_calls=(_CALL,),
            usage=Usage(input_tokens=400, output_tokens=20),
            cost_usd=0.0002,
            finish_reason="tool_calls",
        ),
        ToolCallStarted(
            **_turn(7, 1901),
            iteration=1,
            call_id="call_1",
            tool="search_flights",
            arguments=_CALL.arguments,
            side_effect=False,
        ),
        ToolCallFinished(
            **_turn(8, 2300),
            iteration=1,
            call_id="call_1",
            ok=True,
            result='{"flights": 3}',
        ),
        ProtocolFailure(
            **_turn(9, 2400),
            iteration=2,
            model="gpt-4.1-mini",
            kind="unknown_tool",
            detail="tool 'book_hotel' is not available",
            call_id="call_2",
            signature="book_hotel:4b1f0c2a9d3e7f60",
        ),
        ContextCompacted(
            **_turn(10, 2500),
            iteration=2,
            compacted_call_ids=("call_1",),
            dimension="tool_calls",
        ),
        FallbackEngaged(
            **_turn(11, 2600),
            from_model="gpt-4.1-mini",
            to_model="gpt-4.1",
            reason="HTTP 503 from the provider",
        ),
        AttemptFailed(**_turn(12, 2700), reason="provider timeout after 30 s", retryable=True),
        TurnInterrupted(**_turn(19, 1300), message_id="m-4"),
        TurnCompleted(
            **_turn(13, 3410),
            statuses=statuses,
            metrics=_metrics(),
            operations=(done,),
            reply="The 9th works; refunds are allowed up to 24 h before departure.",
        ),
        TurnFailed(
            **_turn(14, 3410, RUN2, 2),
            statuses=dict.fromkeys(INPUTS, "failed"),
            metrics=_metrics(attempt=2),
            operations=(OperationRecord(call_id="call_9", tool="transfer", side_effect=True, status="unknown"),),
            error="A transfer may have been made; it was not retried. Please check before asking again.",
        ),
        TurnPaused(
            **_turn(15, 3410),
            statuses=dict.fromkeys(INPUTS, "paused"),
            metrics=_metrics(),
            reason="approval",
            kept="I found three flights.",
            resume_hint="Approve or deny the transfer to continue.",
            pending_call=ToolCall(call_id="call_3", name="transfer", arguments='{"to": "bob", "amount": 5}'),
        ),
        TurnExhausted(
            **_turn(16, 3410),
            statuses=dict.fromkeys(INPUTS, "exhausted"),
            metrics=_metrics(iterations=8),
            last_text="Still comparing fares.",
        ),
        MessageRejected(
            **_envelope(18, 1500),
            message_id="m-3",
            reason="turn_active",
            active_turn_id=TURN,
            text="I'm still answering your previous message; please send this again when I'm done.",
        ),
    ]
    return {e.type: e for e in examples}


def approval_example() -> InputInjected:
    """The decision on a call that paused a turn for approval."""
    return InputInjected(
        **_envelope(17, 5000),
        occurrence_key="approval:call_3",
        source="approval",
        content="Approved: go ahead with the transfer.",
        approval=Approval(turn_id=TURN, call_id="call_3", approved=True),
    )


def dead_letter_example() -> DeadLetter:
    return DeadLetter.of(
        "turnstile.events",
        3,
        1187,
        CONVERSATION.encode(),
        b'{"type": "MessageReceived", "conversation_id": "conv-42"}',
        "invalid_event",
        "event_id: Field required; occurred_at: Field required",
    )


def delta_example() -> ReplyDelta:
    return ReplyDelta(
        conversation_id=CONVERSATION,
        turn_id=TURN,
        run_id=RUN,
        attempt=1,
        iteration=2,
        seq=3,
        occurred_at=1_767_225_602_150,
        text=" is 40 EUR cheaper",
    )

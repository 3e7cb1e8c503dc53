"""What the readers say of how a turn or an attempt ended: the same words wherever it is
shown (the timeline of `tail` and `inspect`, the turn's `outcome_detail` on HTTP and in
the console, the history later turns read)."""

from __future__ import annotations

from builders import claim, eid, message, started

from turnstile.events import STOPPED_MID_ATTEMPT, AttemptFailed, TurnExhausted, TurnMetrics, decode, encode
from turnstile.events.outcomes import ExhaustedAllowance
from turnstile.streams.log import Record
from turnstile.streams.timeline import describe
from turnstile.streams.views import build_view


def _exhausted(allowance: ExhaustedAllowance) -> list[Record]:
    c = claim(["m1"], 1_000, 0)
    out = TurnExhausted(
        event_id=eid(), conversation_id=c.conversation_id, occurred_at=1_500, turn_id=c.turn_id,
        run_id=c.run_id, attempt=1, last_text="The refund rules are", allowance=allowance,
        statuses={"m1": "answered"},
        metrics=TurnMetrics(model="m", attempt=1, iterations=1, tool_calls=0, input_tokens=1,
                            output_tokens=1, cost_usd=0.0, fallbacks=0, duration_ms=500),
    )  # fmt: skip
    events = [message("m1", 900), c, started(c, 1_001), out]
    return [Record(0, n, e.conversation_id.encode(), encode(e)) for n, e in enumerate(events)]


def test_a_reply_cut_off_at_its_output_limit_is_said_so_by_every_reader() -> None:
    # Given a turn whose reply stopped at the model's output token limit, when it is read,
    # then the turn's detail, its timeline line and the history say that -- not that the
    # iteration allowance was used.
    records = _exhausted("output_tokens")
    view = build_view("conv-1", records)
    turn = next(iter(view.turns.values()))
    assert turn.outcome == "exhausted"
    assert turn.outcome_detail == "the reply was cut off at its output token limit"
    assert describe(decode(records[-1].value)).endswith("EXHAUSTED: the reply was cut off at its output token limit")
    assert view.state.history[-1].content == (
        "The refund rules are\n[Stopped: the reply was cut off at its output token limit]"
    )
    iterations = build_view("conv-1", _exhausted("iterations"))
    assert next(iter(iterations.turns.values())).outcome_detail == "iteration allowance used without a final answer"


def test_an_attempt_closed_because_its_worker_stopped_is_not_called_final() -> None:
    # A takeover closes a stopped run not retryable once a side effect started, yet the
    # next owner goes on from the journal: the timeline must not read as the turn's end.
    c = claim(["m1"], 1_000, 0)
    closed = AttemptFailed(
        event_id=eid(), conversation_id=c.conversation_id, occurred_at=1_200, turn_id=c.turn_id,
        run_id=c.run_id, attempt=1, reason=STOPPED_MID_ATTEMPT, retryable=False,
    )  # fmt: skip
    line = describe(closed)
    assert "final" not in line and "its worker stopped; the next owner takes the turn over" in line
    assert "(final)" in describe(closed.model_copy(update={"reason": "HTTP 401"}))

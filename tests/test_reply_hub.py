"""The reply hub on its own: what a reader of `GET /conversations/{id}/stream` is told,
from deltas and events fed in the orders the two topics can deliver them."""

from __future__ import annotations

import asyncio

from builders import claim, completed

from turnstile.events import AttemptFailed, TurnInterrupted
from turnstile.events.deltas import ReplyDelta
from turnstile.streams.reply_hub import ReplyHub, StreamEvent

CLAIM = claim(["m1"], at=1000, boundary=0)
TURN, RUN, CONV = CLAIM.turn_id, CLAIM.run_id, CLAIM.conversation_id


def delta(
    text: str = "", seq: int = 0, run: str = RUN, attempt: int = 1, iteration: int = 1, **flags: bool
) -> ReplyDelta:
    return ReplyDelta(
        conversation_id=CONV, turn_id=TURN, run_id=run, attempt=attempt, iteration=iteration, seq=seq,
        occurred_at=1000, text=text, **flags,
    )  # fmt: skip


def failed(run: str = RUN) -> AttemptFailed:
    return AttemptFailed(
        event_id="e-f", conversation_id=CONV, occurred_at=2000, turn_id=TURN, run_id=run, attempt=1,
        reason="the worker running this attempt stopped before it ended", retryable=True,
    )  # fmt: skip


def drain(queue: asyncio.Queue[StreamEvent]) -> list[tuple[str, dict[str, object]]]:
    out = []
    while not queue.empty():
        event = queue.get_nowait()
        out.append(
            (event.kind, {k: v for k, v in event.data.items() if k in ("text", "iteration", "attempt", "reply")})
        )
    return out


async def test_a_reader_gets_the_deltas_in_order_then_the_outcome() -> None:
    hub = ReplyHub()
    queue = hub.subscribe(CONV)
    hub.on_delta(delta("The 9th", 0))
    hub.on_delta(delta(" is cheaper.", 1))
    hub.on_delta(delta(seq=2, done=True))
    hub.on_event(completed(CLAIM, 3000, "The 9th is cheaper."))

    assert drain(queue) == [
        ("delta", {"iteration": 1, "attempt": 1, "text": "The 9th"}),
        ("delta", {"iteration": 1, "attempt": 1, "text": " is cheaper."}),
        ("outcome", {"attempt": 1, "reply": "The 9th is cheaper."}),
    ]


async def test_a_reader_who_joins_mid_reply_gets_the_text_so_far_first() -> None:
    hub = ReplyHub()
    hub.on_delta(delta("The 9th", 0))
    hub.on_delta(delta(" is", 1))
    queue = hub.subscribe(CONV)
    hub.on_delta(delta(" cheaper.", 2))

    assert drain(queue) == [
        ("delta", {"iteration": 1, "attempt": 1, "text": "The 9th is"}),
        ("delta", {"iteration": 1, "attempt": 1, "text": " cheaper."}),
    ]


async def test_a_retried_request_restarts_the_iteration_and_a_dead_attempt_says_so() -> None:
    hub = ReplyHub()
    hub.on_delta(delta("Half", 0))
    hub.on_delta(delta(seq=1, restart=True))
    late_joiner_before_failure = hub.subscribe(CONV)  # the restart voided "Half": nothing to replay
    hub.on_delta(delta("Wh", 2))
    hub.on_event(failed())
    hub.on_delta(delta("ole", 3))  # late, from the dead run: ignored
    hub.on_delta(delta("Whole.", 0, run="run-2", attempt=2))

    assert drain(late_joiner_before_failure) == [
        ("delta", {"iteration": 1, "attempt": 1, "text": "Wh"}),
        ("interrupted", {"attempt": 1}),
        ("delta", {"iteration": 1, "attempt": 2, "text": "Whole."}),
    ]
    assert drain(hub.subscribe(CONV)) == [("delta", {"iteration": 1, "attempt": 2, "text": "Whole."})]


async def test_an_outcome_that_overtakes_its_last_deltas_waits_for_them() -> None:
    hub = ReplyHub(hold_s=60)
    queue = hub.subscribe(CONV)
    hub.on_delta(delta("The 9th", 0))
    hub.on_event(completed(CLAIM, 3000, "The 9th is cheaper."))
    assert [kind for kind, _ in drain(queue)] == ["delta"]  # held: the reply is not done

    hub.on_delta(delta(" is cheaper.", 1))
    hub.on_delta(delta(seq=2, done=True))

    assert [kind for kind, _ in drain(queue)] == ["delta", "outcome"]


async def test_an_outcome_read_before_any_of_its_deltas_waits_for_them_when_someone_reads() -> None:
    # (a reply streamed in one burst: the events topic was read first, the outcome ended the
    # stream at once and the seven deltas that followed were dropped as late)
    hub = ReplyHub(hold_s=60)
    queue = hub.subscribe(CONV)
    hub.on_event(completed(CLAIM, 3000, "The 9th is cheaper."))
    assert drain(queue) == []  # held

    hub.on_delta(delta("The 9th is cheaper.", 0))
    hub.on_delta(delta(seq=1, done=True))

    assert [kind for kind, _ in drain(queue)] == ["delta", "outcome"]


async def test_an_outcome_nobody_reads_is_not_held() -> None:
    hub = ReplyHub(hold_s=60)
    hub.on_event(completed(CLAIM, 3000, "The 9th is cheaper."))
    hub.on_delta(delta("The 9th", 0))  # late: its run has ended
    assert drain(hub.subscribe(CONV)) == []


async def test_a_held_outcome_is_released_when_its_deltas_never_come() -> None:
    hub = ReplyHub(hold_s=0.01)
    queue = hub.subscribe(CONV)
    hub.on_delta(delta("The 9th", 0))
    hub.on_event(completed(CLAIM, 3000, "The 9th is cheaper."))

    first = await queue.get()
    outcome = await asyncio.wait_for(queue.get(), 30)  # released by the hold timer, not by a delta

    assert (first.kind, outcome.kind) == ("delta", "outcome")


async def test_conversations_nobody_reads_are_forgotten_when_their_reply_ends() -> None:
    hub = ReplyHub()
    hub.on_delta(delta("x", 0))
    hub.on_delta(delta(seq=1, done=True))
    hub.on_event(completed(CLAIM, 3000, "x"))
    queue = hub.subscribe(CONV)

    assert drain(queue) == []  # the next reader waits for the next reply
    hub.unsubscribe(CONV, queue)
    assert hub.subscribe("another").empty()


async def test_a_turn_withdrawn_by_a_new_message_tells_its_readers_and_ignores_its_late_deltas() -> None:
    hub = ReplyHub()
    queue = hub.subscribe(CONV)
    hub.on_delta(delta("Checking the", 0))
    withdrawn = TurnInterrupted(
        event_id="e-i", conversation_id=CONV, occurred_at=2000, turn_id=TURN, run_id=RUN, attempt=1,
        message_id="m2",
    )  # fmt: skip
    hub.on_event(withdrawn)
    hub.on_delta(delta(" dates", 1))  # late, from the withdrawn run: ignored
    events = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [e.kind for e in events] == ["delta", "interrupted"]
    assert "m2" in str(events[1].data["reason"]) and events[1].data["retryable"] is True

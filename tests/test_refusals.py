"""The refusal queue on its own: what a `reject` conversation owes, when it holds the next
claim back, and what it drops, given/when/then on folded states (no log, no worker)."""

from __future__ import annotations

import asyncio

from builders import CONV, claim, eid, message, started

from turnstile.events import MessageRejected
from turnstile.handlers.claim import DoubleTextPolicy, Refusal, rejection_event
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.refusals import Refusals

TURN = claim(["m1"], 1, 0)


class Written:
    def __init__(self, fail: bool = False) -> None:
        self.events: list[MessageRejected] = []
        self.fail = fail
        self.retried: list[str] = []
        self.due: list[str] = []

    async def write(self, state: ConversationState, input_id: str, refusal: Refusal) -> None:
        if self.fail:
            raise ConnectionError("the log is away")
        self.events.append(rejection_event(state, input_id, refusal, event_id=eid(), now_ms=5))


def folded(refusals: Refusals, *events: object) -> ConversationState:
    state = new_state(CONV)
    for event in events:
        assert apply_event(state, event) is None  # type: ignore[arg-type]
        refusals.note(state, event)  # type: ignore[arg-type]
    return state


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def queue(written: Written, policy: str = "reject") -> Refusals:
    return Refusals(DoubleTextPolicy(policy), written.write, written.retried.append, written.due.append)  # type: ignore[arg-type]


async def test_a_message_during_a_turn_is_refused_and_holds_the_next_claim_back_until_folded_back():
    written = Written()
    refusals = queue(written)
    state = folded(refusals, message("m1", 1), TURN, started(TURN, 2), message("m2", 3))
    assert refusals.holds_back(state)
    await settle()
    [rejection] = written.events
    assert rejection.message_id == "m2" and written.due == [CONV]
    assert refusals.holds_back(state)  # written, not folded back yet: still pending
    assert not refusals.writers()  # and not written twice
    assert apply_event(state, rejection) is None
    refusals.note(state, rejection)
    assert not refusals.holds_back(state)


async def test_nothing_is_owed_under_enqueue_or_for_a_message_before_any_turn():
    written = Written()
    assert not queue(written, "enqueue").holds_back(
        folded(queue(written, "enqueue"), message("m1", 1), TURN, started(TURN, 2), message("m2", 3))
    )
    refusals = queue(written)
    assert not refusals.holds_back(folded(refusals, message("m1", 1)))
    assert written.events == []


async def test_a_refusal_no_longer_pending_is_dropped():
    written = Written()
    refusals = queue(written)
    state = folded(refusals, message("m1", 1), TURN, started(TURN, 2), message("m2", 3))
    state.pending.pop("m2")  # an earlier owner refused (or claimed) it: no longer pending
    assert not refusals.holds_back(state)
    await settle()
    assert written.events == []


async def test_a_failed_write_is_tried_again_later():
    written = Written(fail=True)
    refusals = queue(written)
    state = folded(refusals, message("m1", 1), TURN, started(TURN, 2), message("m2", 3))
    assert refusals.holds_back(state)
    await settle()
    assert written.retried == [CONV] and written.due == []
    written.fail = False
    assert refusals.holds_back(state)  # owed still: written now
    await settle()
    assert [e.message_id for e in written.events] == ["m2"]

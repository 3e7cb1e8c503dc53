"""The runner slot on its own: appends and their acknowledgements, the side-effect gate and
its own `Superseded`, suspension at step boundaries. No log, no worker: the slot's `send`
is a list the test acknowledges by hand."""

from __future__ import annotations

import asyncio

import pytest
from builders import CONV, claim, completed, eid, started

from turnstile.events import Event, ToolCallStarted, encode
from turnstile.streams.log import Acknowledged, Landed
from turnstile.streams.runner_slot import RunnerSlot

TURN = claim(["m1"], 1, 0)


def tool_started(side_effect: bool) -> ToolCallStarted:
    return ToolCallStarted(
        event_id=eid(), conversation_id=CONV, occurred_at=2, turn_id=TURN.turn_id, run_id="run-1", attempt=1,
        iteration=1, call_id="c1", tool="transfer", arguments="{}", side_effect=side_effect,
    )


class Log:
    """Sent records; each acknowledged when the test says so."""

    def __init__(self) -> None:
        self.sent: list[asyncio.Future[Acknowledged]] = []

    async def send(self, _value: bytes) -> asyncio.Future[Acknowledged]:
        self.sent.append(asyncio.get_running_loop().create_future())
        return self.sent[-1]

    def ack_all(self) -> None:
        for offset, ack in enumerate(self.sent):
            if not ack.done():
                ack.set_result(Landed(0, offset))


async def turn(slot: RunnerSlot, *events: Event) -> list[str]:
    """A runner that appends `events` in order; returns what it got through."""
    done: list[str] = []
    for event in events:
        await slot.append(event)
        done.append(event.type)
    return done


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_append_waits_for_its_acknowledgement_and_one_not_waited_for_rides_along():
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    await slot.append(TURN, wait=False)  # in the log's order, not acknowledged yet
    second = asyncio.create_task(slot.append(started(TURN, 2)))
    await settle()
    assert not second.done() and len(log.sent) == 2
    log.ack_all()
    await second
    assert slot.last_offset == 1 and slot.run_id == "run-1"


async def test_a_side_effect_runs_only_once_its_start_is_read_back_accepted():
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    start = tool_started(side_effect=True)
    task = slot.start(turn(slot, start))
    await settle()
    log.ack_all()
    await settle()
    assert slot.awaiting_read_back and not task.done()  # acknowledged is not enough
    assert slot.judged(start.event_id, accepted=True)
    await task
    assert not slot.awaiting_read_back


async def test_a_side_effect_refused_on_read_back_ends_the_run_quietly_with_superseded():
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    start = tool_started(side_effect=True)
    body_ran = False

    async def runner() -> None:
        nonlocal body_ran
        try:
            await slot.append(start)
        except Exception:  # the runner's catch-all for internal errors must not see it
            pytest.fail("Superseded reached the runner's error handling")
        body_ran = True

    task = slot.start(runner())
    await settle()
    log.ack_all()
    await settle()
    slot.judged(start.event_id, accepted=False)
    await task  # ends without an exception
    assert not body_ran and not task.cancelled()


async def test_a_refused_event_of_any_other_kind_stops_the_runner():
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    attempt = started(TURN, 2)
    task = slot.start(turn(slot, attempt, tool_started(side_effect=False)))
    await settle()
    slot.judged(attempt.event_id, accepted=False)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_suspended_runner_finishes_its_step_and_waits_at_the_next_boundary():
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    task = slot.start(turn(slot, started(TURN, 2), tool_started(side_effect=False)))
    await settle()
    slot.suspend()  # while its first append is in flight: the step in progress
    assert not slot.at_rest
    resting = asyncio.create_task(slot.until_at_rest())
    log.ack_all()
    await asyncio.wait_for(resting, 5)
    assert slot.at_rest and len(log.sent) == 1  # held before its next append
    slot.resume()
    await settle()
    log.ack_all()
    await task
    assert len(log.sent) == 2


async def test_an_outcome_is_no_boundary_and_a_read_back_in_progress_is_no_rest():
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    slot.suspend()
    task = slot.start(turn(slot, completed(TURN, 3)))
    await settle()
    log.ack_all()
    await task  # the turn is over: nothing to hold back
    assert slot.at_rest

    gated = RunnerSlot(CONV, 0, log.send)
    start = tool_started(side_effect=True)
    task = gated.start(turn(gated, start))
    await settle()
    log.ack_all()
    gated.suspend()
    await settle()
    assert gated.awaiting_read_back and not gated.at_rest  # the call is the step in progress
    gated.judged(start.event_id, accepted=True)
    await task


async def test_a_side_effect_sent_without_waiting_still_waits_for_its_read_back():
    # The gate is the slot's, not the caller's: `wait=False` on a side-effecting start
    # (which the machine never asks today) must not let its tool run unfenced.
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    start = tool_started(side_effect=True)
    task = slot.start(slot.append(start, wait=False))
    await settle()
    assert not task.done()  # not even acknowledged yet
    log.ack_all()
    await settle()
    assert slot.awaiting_read_back and not task.done()
    assert slot.judged(start.event_id, accepted=False)
    await task  # Superseded, ended quietly by the slot
    assert not slot.awaiting_read_back and slot.last_offset == 0


async def test_a_record_read_back_with_exactly_the_bytes_a_runner_wrote_is_its_event_once():
    log = Log()
    slot = RunnerSlot(CONV, 0, log.send)
    await slot.append(TURN, wait=False)
    mine = encode(TURN)
    assert slot.written_as(encode(started(TURN, 2))) is None  # bytes it did not write
    assert slot.written_as(mine[:-1] + b" }") is None  # an equal event in other bytes: parsed as any other
    assert slot.written_as(mine) is TURN
    assert slot.written_as(mine) is None  # read back once: a copy of it is parsed like any record

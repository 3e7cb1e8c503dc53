"""Schedules: pure occurrence arithmetic, stable occurrence keys, and end to end: a
schedule that fires twice for one occurrence yields one input and one logical turn, and
a scheduled turn is offered only the tools marked safe for isolated execution."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
from loop_harness import Query, Transfer
from worker_harness import FAST, events_of, running, until

from turnstile.events import (
    InputInjected,
    ProtocolFailure,
    ToolCall,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    Usage,
    logical_turn_id,
)
from turnstile.handlers.provider import ModelReply, ModelRequest
from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider, echo_reply
from turnstile.handlers.schedule import (
    Cron,
    Interval,
    Schedule,
    ScheduleError,
    due,
    injected,
    next_due,
    occurrence_key,
    parse_schedules,
)
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.streams.file_log import FileLog
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.scheduler import Scheduler


def ms(text: str) -> int:
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp() * 1000)


MIN = 60_000


def every(seconds: float, **kw: object) -> Schedule:
    return Schedule("tick", "c1", "tick!", Interval(round(seconds * 1000)), **kw)  # type: ignore[arg-type]


# -- pure ---------------------------------------------------------------------------------
def test_interval_occurrences_after_the_last_fired_one():
    s = every(60)
    now = ms("2026-03-01T10:05:30")
    assert due(s, ms("2026-03-01T10:03:00"), now) == (ms("2026-03-01T10:05:00"),)  # catch-up of 1: the latest
    wide = dataclasses.replace(s, max_catch_up=5)
    assert due(wide, ms("2026-03-01T10:03:00"), now) == (ms("2026-03-01T10:04:00"), ms("2026-03-01T10:05:00"))
    assert due(s, ms("2026-03-01T10:05:00"), now) == ()  # already fired
    assert due(s, None, now) == (ms("2026-03-01T10:05:00"),)  # first start: the latest occurrence only
    assert next_due(s, now) == ms("2026-03-01T10:06:00")
    assert due(s, None, ms("2026-03-01T10:05:00")) == (ms("2026-03-01T10:05:00"),)  # the boundary is due


def test_missed_occurrences_older_than_the_grace_period_are_skipped():
    s = every(3600, grace_ms=10 * MIN)
    assert due(s, None, ms("2026-03-01T10:30:00")) == ()
    assert due(s, None, ms("2026-03-01T10:09:00")) == (ms("2026-03-01T10:00:00"),)
    anchored = Schedule("a", "c1", "x", Interval(3600_000, anchor_ms=ms("2026-03-01T00:15:00")))
    assert due(anchored, None, ms("2026-03-01T10:20:00")) == (ms("2026-03-01T10:15:00"),)


def test_cron_fields_ranges_steps_and_lists():
    quarter = Cron("*/15 * * * *")
    got = list(quarter.between(ms("2026-03-01T10:00:00"), ms("2026-03-01T11:00:00")))
    assert got == [ms(f"2026-03-01T10:{m}:00") for m in ("15", "30", "45")] + [ms("2026-03-01T11:00:00")]
    weekdays = Cron("30 9 * * 1-5")  # 2026-03-06 is a Friday
    got = list(weekdays.between(ms("2026-03-06T00:00:00"), ms("2026-03-10T00:00:00")))
    assert got == [ms("2026-03-06T09:30:00"), ms("2026-03-09T09:30:00")]
    assert weekdays.next_after(ms("2026-03-06T09:30:00")) == ms("2026-03-09T09:30:00")
    # Both day fields restricted: either matches (the 1st, or any Sunday).
    either = Cron("0 0 1 * 0")
    got = list(either.between(ms("2026-02-27T00:00:00"), ms("2026-03-09T00:00:00")))
    assert got == [ms("2026-03-01T00:00:00"), ms("2026-03-08T00:00:00")]
    assert Cron("0 12 * * 7").next_after(ms("2026-03-02T00:00:00")) == ms("2026-03-08T12:00:00")  # 7 = Sunday
    assert Cron("@daily").next_after(ms("2026-03-02T05:00:00")) == ms("2026-03-03T00:00:00")
    assert Cron("0 0 30 2 *").next_after(ms("2026-03-02T05:00:00")) is None
    assert list(Cron("5,10 8-9/1 * 3 *").between(ms("2026-03-02T08:06:00"), ms("2026-03-02T09:06:00"))) == [
        ms("2026-03-02T08:10:00"), ms("2026-03-02T09:05:00")
    ]


@pytest.mark.parametrize("expression", ["* * * *", "60 * * * *", "*/0 * * * *", "a * * * *", "5-1 * * * *"])
def test_invalid_cron_expressions_are_refused_at_definition(expression: str):
    with pytest.raises(ScheduleError):
        Cron(expression)


def test_the_occurrence_key_is_the_schedule_id_and_the_occurrence_time():
    s = Schedule("daily-digest", "c1", "Send me today's digest.", Cron("0 9 * * *"))
    at = ms("2026-03-02T09:00:00")
    assert occurrence_key(s, at) == "daily-digest@2026-03-02T09:00:00Z"
    assert occurrence_key(s, at + 250) == "daily-digest@2026-03-02T09:00:00.250Z"
    one, two = injected(s, at, event_id="e1"), injected(s, at, event_id="e2")
    assert one.model_dump(exclude={"event_id"}) == two.model_dump(exclude={"event_id"})
    assert (one.source, one.occurrence_key, one.occurred_at) == ("schedule", "daily-digest@2026-03-02T09:00:00Z", at)


def test_schedules_from_json():
    [a, b] = parse_schedules([
        {"id": "digest", "conversation": "c1", "content": "digest please", "cron": "0 9 * * *"},
        {"id": "ping", "conversation": "c2", "content": "ping", "every_s": 30, "grace_s": 60, "max_catch_up": 2},
    ])
    assert a.timing == Cron("0 9 * * *") and b.timing == Interval(30_000)
    assert (b.grace_ms, b.max_catch_up) == (60_000, 2)
    for bad in (
        [{"id": "x", "conversation": "c", "content": "y"}],  # no timing
        [{"id": "x", "conversation": "c", "content": "y", "every_s": 5, "cron": "* * * * *"}],
        [{"id": "x@1", "conversation": "c", "content": "y", "every_s": 5}],
        [{"id": "x", "conversation": "c", "content": "y", "every_s": 0.1}],
        [{"id": "x", "conversation": "c", "content": "y", "every_s": 5, "colour": "red"}],
        [{"id": "x", "content": "y", "every_s": 5}],
        [{"id": "x", "conversation": "c", "content": "y", "every_s": 5}] * 2,
        {"id": "x"},
        # a grace under the moment a worker takes to wake for an occurrence dropped it
        [{"id": "x", "conversation": "c", "content": "y", "every_s": 5, "grace_s": 0}],
        [{"id": "x", "conversation": "c", "content": "y", "every_s": 5, "grace_s": 9.9}],
    ):
        with pytest.raises(ScheduleError):
            parse_schedules(bad)


# -- end to end ---------------------------------------------------------------------------
class ManualClock:
    def __init__(self, now: int) -> None:
        self.now = now

    def now_ms(self) -> int:
        return self.now


async def _search(args: Query) -> str:
    return f"results for {args.q}"


async def _transfer(args: Transfer) -> str:
    raise AssertionError("a scheduled turn must never reach the transfer tool")


TOOLS = ToolRegistry([
    Tool("search", "Search the web", Query, _search, isolated_ok=True),
    Tool("transfer", "Move money", Transfer, _transfer, kind="side_effect"),
])


def tool_script(offered: list[tuple[str, list[str]]]):
    """Records the tools each request offered; the first request of a turn whose input asks
    for it tries the transfer tool, then answers."""

    def script(request: ModelRequest) -> Scripted:
        last = request.messages[-1]
        offered.append((last.content, [t.name for t in request.tools]))
        if last.role == "user" and "digest" in last.content:
            call = ToolCall(call_id="call-1", name="transfer", arguments='{"to": "bob", "amount": 5}')
            return Scripted(ModelReply(request.model, None, (call,), Usage(), "tool_calls"))
        return Scripted(echo_reply(request))

    return script


async def test_a_schedule_fired_twice_for_one_occurrence_gives_one_input_and_one_turn_with_isolated_tools(tmp_path):
    log = FileLog(tmp_path)
    schedule = Schedule("digest", "c1", "Send me the digest.", Cron("0 9 * * *"))
    clock = ManualClock(ms("2026-03-02T09:00:20"))
    # Two schedulers (two workers, or a restart) fire the same occurrence.
    for _ in range(2):
        [event] = await Scheduler(log, [schedule], clock=clock).tick()
        assert event.occurrence_key == "digest@2026-03-02T09:00:00Z"
    assert sum(isinstance(e, InputInjected) for e in events_of(log, "c1")) == 2
    offered: list[tuple[str, list[str]]] = []
    config = dataclasses.replace(FAST, turn=dataclasses.replace(FAST.turn, tools=TOOLS))
    async with running(log, ScriptedProvider(tool_script(offered)), config) as worker:
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
        # A user's own message in the same conversation gets every tool.
        await publish(log, message_event("c1", "what can you do?", clock.now + 60_000, "m1"))
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "c1")) == 2)
        state = worker.states["c1"]
    events = events_of(log, "c1")
    claims = [e for e in events if isinstance(e, TurnClaimed)]
    assert [c.input_ids for c in claims] == [("digest@2026-03-02T09:00:00Z",), ("m1",)]
    assert claims[0].turn_id == logical_turn_id(["digest@2026-03-02T09:00:00Z"])
    assert list(state.seen_inputs).count("digest@2026-03-02T09:00:00Z") == 1
    # The scheduled turn saw only the isolated tool; its call to the other one was refused.
    assert offered[0] == ("Send me the digest.", ["search"])
    assert all(names == ["search"] for content, names in offered[:2])
    refused = [e for e in events if isinstance(e, ProtocolFailure)]
    assert [(r.kind, r.turn_id) for r in refused] == [("unknown_tool", claims[0].turn_id)]
    assert "scheduled turn" in refused[0].detail
    assert not any(isinstance(e, ToolCallStarted) for e in events)
    assert offered[-1] == ("what can you do?", ["search", "transfer"])


async def test_the_scheduler_beside_a_worker_skips_occurrences_already_on_the_log(tmp_path):
    log = FileLog(tmp_path)
    schedule = Schedule("ping", "c1", "ping", Interval(60_000))
    clock = ManualClock(ms("2026-03-02T09:00:10"))
    assert len(await Scheduler(log, [schedule], clock=clock).tick()) == 1  # an earlier process fired it
    async with running(log, ScriptedProvider()) as worker:
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
        beside = Scheduler(log, [schedule], worker=worker, clock=clock)
        assert await beside.tick() == []  # the fold already holds this occurrence
        clock.now += 60_000
        [fired] = await beside.tick()
        assert fired.occurrence_key == "ping@2026-03-02T09:01:00Z"
        assert await beside.tick() == []
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "c1")) == 2)
    keys = [e.occurrence_key for e in events_of(log, "c1") if isinstance(e, InputInjected)]
    assert keys == ["ping@2026-03-02T09:00:00Z", "ping@2026-03-02T09:01:00Z"]

"""Interrupt-and-merge, the third double-text policy: a message that arrives mid-turn
withdraws the turn (`TurnInterrupted`) if no side-effecting call has started, and the next
claim takes the old and new messages together, in order, as one final input; once a side
effect has started the message waits, as under `enqueue`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from builders import claim, message, started
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from pydantic import BaseModel
from worker_harness import FAST, events_of, running

from turnstile.events import (
    DecodeError,
    Event,
    ToolCall,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnInterrupted,
    Usage,
    decode,
)
from turnstile.events.examples import event_examples
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, DoubleTextPolicy, interrupts_on_arrival, plan_claim
from turnstile.handlers.context import build_context
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ModelReply, ModelRequest, ProtocolFamily, ReplyStream
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.handlers.turn_machine import decide, interruptible, machine_for
from turnstile.handlers.turn_settings import TurnSettings
from turnstile.handlers.turn_steps import Append, Claimed, Interrupted, ModelAnswered
from turnstile.projections import apply_event, new_state
from turnstile.projections.audit import audit
from turnstile.streams import cli
from turnstile.streams.file_log import FileLog
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.timeline import describe
from turnstile.streams.worker import WorkerConfig

NOW = SystemClock().now_ms
INTERRUPT = DoubleTextPolicy("interrupt")


def interrupted(c: TurnClaimed, message_id: str, at: int = 40, run_id: str | None = None) -> TurnInterrupted:
    return TurnInterrupted(
        event_id=f"int-{message_id}", conversation_id=c.conversation_id, occurred_at=at, turn_id=c.turn_id,
        run_id=run_id or c.run_id, attempt=1, message_id=message_id,
    )  # fmt: skip


def tool_started(c: TurnClaimed, side_effect: bool, at: int = 30) -> ToolCallStarted:
    return ToolCallStarted(
        event_id=f"start-{at}", conversation_id=c.conversation_id, occurred_at=at, turn_id=c.turn_id,
        run_id=c.run_id, attempt=1, iteration=1, call_id="call_1", tool="send", arguments="{}",
        side_effect=side_effect,
    )  # fmt: skip


# -- the fold, the policy and the machine -------------------------------------------------
def test_an_interruption_returns_the_claimed_messages_and_the_next_claim_takes_old_and_new_in_order():
    state = new_state("conv-1")
    c = claim(["m1"], 20, 0)
    for event in (message("m1", 10, "A"), c, started(c, 21), message("m2", 30, "B")):
        assert apply_event(state, event) is None
    arrived = message("m2", 30, "B")
    assert interrupts_on_arrival(INTERRUPT, state, arrived) == arrived
    assert apply_event(state, interrupted(c, "m2")) is None
    assert state.active is None and list(state.pending) == ["m1", "m2"]
    assert state.history == [] and c.turn_id not in state.turns  # no outcome, nothing in history
    plan = plan_claim(state, 10_000, DebouncePolicy())
    assert isinstance(plan, ClaimPlan) and plan.input_ids == ("m1", "m2")
    final = build_context(state.history, plan.history_boundary, plan.inputs, None)[-1]
    assert final.content.index("A") < final.content.index("B")  # one final input, in order
    merged = claim(["m1", "m2"], 10_000, 0, run_id="run-2")
    assert apply_event(state, merged) is None  # rule 1 counts claims that stand
    assert state.claimed_by == {"m1": merged.turn_id, "m2": merged.turn_id}


def test_a_turn_whose_side_effect_started_is_not_interrupted():
    state = new_state("conv-1")
    c = claim(["m1"], 20, 0)
    for event in (message("m1", 10), c, started(c, 21), tool_started(c, side_effect=True), message("m2", 35)):
        assert apply_event(state, event) is None
    rejection = apply_event(state, interrupted(c, "m2"))
    assert rejection is not None and "side-effecting" in rejection.reason
    assert state.active is not None and "m2" in state.pending  # it waits, as under enqueue


def test_a_read_only_call_does_not_prevent_an_interruption_but_a_stale_run_cannot_interrupt():
    state = new_state("conv-1")
    c = claim(["m1"], 20, 0)
    for event in (message("m1", 10), c, started(c, 21), tool_started(c, side_effect=False), message("m2", 35)):
        assert apply_event(state, event) is None
    assert apply_event(state, interrupted(c, "m2", run_id="run-zombie")) is not None
    assert apply_event(state, interrupted(c, "m2")) is None


def test_only_the_interrupt_policy_asks_and_only_while_a_turn_is_active():
    state = new_state("conv-1")
    assert apply_event(state, message("m1", 10)) is None
    assert interrupts_on_arrival(INTERRUPT, state, message("m1", 10)) is None  # no active turn
    c = claim(["m1"], 20, 0)
    assert apply_event(state, c) is None and apply_event(state, message("m2", 30)) is None
    assert interrupts_on_arrival(DoubleTextPolicy("enqueue"), state, message("m2", 30)) is None
    assert interrupts_on_arrival(DoubleTextPolicy("enqueue", {"conv-1": "interrupt"}), state, message("m2", 30))


class _Args(BaseModel):
    pass


async def _unused(args: _Args) -> str:
    raise AssertionError("decide never runs a tool")


def test_the_machine_withdraws_the_turn_until_it_decides_a_side_effect():
    tools = ToolRegistry([Tool("send", "Send.", _Args, _unused, "side_effect")])
    state = new_state("conv-1")
    assert apply_event(state, message("m1", 10)) is None
    ids = (f"id-{n}" for n in itertools.count())
    m = machine_for(state, TurnSettings(model="m", tools=tools), "openai", lambda: next(ids))
    plan = plan_claim(state, 5_000, DebouncePolicy())
    assert isinstance(plan, ClaimPlan)
    decide(m, Claimed(plan, 5_000))
    assert interruptible(m)
    # Given a step that decided a side-effecting call (not yet on the log), then the turn
    # can no longer be interrupted: the machine's state is ahead of the log.
    call = ToolCall(call_id="c1", name="send", arguments="{}")
    reply = ModelReply("m", "", (call,), Usage(), "tool_calls", "tool_use")
    decide(m, ModelAnswered(reply, 5_100))
    assert not interruptible(m)


def test_an_interruption_is_one_event_and_the_end_of_the_run():
    state = new_state("conv-1")
    assert apply_event(state, message("m1", 10)) is None
    ids = (f"id-{n}" for n in itertools.count())
    m = machine_for(state, TurnSettings(model="m"), "openai", lambda: next(ids))
    plan = plan_claim(state, 5_000, DebouncePolicy())
    assert isinstance(plan, ClaimPlan)
    decide(m, Claimed(plan, 5_000))
    # The message is on the log (the worker folded it); the runner's state learns it here.
    commands = decide(m, Interrupted(message("m2", 5_050), 5_100))
    assert [type(c).__name__ for c in commands] == ["Append", "Finish"]
    first = commands[0]
    assert isinstance(first, Append) and isinstance(first.event, TurnInterrupted)
    assert first.event.message_id == "m2" and m.state.active is None and list(m.state.pending) == ["m1", "m2"]


# -- end to end ------------------------------------------------------------------------
class _Held:
    """A model whose first request waits until released (or cancelled); later requests
    answer with the final user input they were sent. With `tool`, the first request asks
    for that tool instead of waiting."""

    family: ProtocolFamily = "scripted"

    def __init__(self, tool: str | None = None) -> None:
        self.requests: list[ModelRequest] = []
        self.release = asyncio.Event()
        self.cancelled = 0
        self.tool = tool

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        self.requests.append(request)
        if len(self.requests) == 1 and self.tool is not None:
            call = ToolCall(call_id="call_1", name=self.tool, arguments="{}")
            return ModelReply("m", "", (call,), Usage(input_tokens=5, output_tokens=5), "tool_calls", "tool_use")
        if len(self.requests) == 1:
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        final = request.messages[-1].content
        return ModelReply("m", f"answered: {final}", (), Usage(input_tokens=5, output_tokens=5), "stop", "end")

    async def aclose(self) -> None:
        return None


def _config(tools: ToolRegistry | None = None) -> WorkerConfig:
    prices = {"m": ModelPrice(1.0, 2.0)}
    turn = dataclasses.replace(FAST.turn, model="m", tools=tools or ToolRegistry(), prices=prices)
    return dataclasses.replace(FAST, double_text=INTERRUPT, turn=turn)


Read = Callable[[], Awaitable[list[Event]]]
Publish = Callable[[str, str], Awaitable[None]]


async def _eventually(read: Read, condition: Callable[[list[Event]], bool], timeout_s: float = 60) -> list[Event]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition(events := await read()):
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
    return events


async def _interrupt_and_merge(model: _Held, send: Publish, read: Read) -> list[Event]:
    """A, then B while the first request is held: the turn is withdrawn, one turn answers both."""
    await send("m1", "check the dates")
    await _eventually(read, lambda _: len(model.requests) == 1)
    await send("m2", "and the refund rules")
    events = await _eventually(read, lambda es: any(isinstance(e, TurnCompleted) for e in es))
    [cut] = [e for e in events if isinstance(e, TurnInterrupted)]
    claims = [e for e in events if isinstance(e, TurnClaimed)]
    assert cut.message_id == "m2" and cut.turn_id == claims[0].turn_id and model.cancelled == 1
    assert [c.input_ids for c in claims] == [("m1",), ("m1", "m2")]
    [done] = [e for e in events if isinstance(e, TurnCompleted)]
    assert done.turn_id == claims[1].turn_id and done.statuses == {"m1": "answered", "m2": "answered"}
    final = model.requests[-1].messages[-1].content
    assert final.index("check the dates") < final.index("and the refund rules")
    assert len(model.requests) == 2  # the withdrawn request and the merged one
    return events


def _on_file_log(log: FileLog) -> tuple[Publish, Read]:
    async def send(message_id: str, text: str) -> None:
        await publish(log, message_event("c1", text, NOW(), message_id))

    async def read() -> list[Event]:
        return events_of(log, "c1")

    return send, read


async def test_a_message_mid_turn_interrupts_and_merges_on_the_embedded_log(tmp_path):
    log, model = FileLog(tmp_path), _Held()
    send, read = _on_file_log(log)
    async with running(log, model, _config()):
        await _interrupt_and_merge(model, send, read)
    report = audit(log.read_all(log.topics.events))
    assert report.ok and report.rule("interrupt").checked == 1, report


def test_the_readers_show_an_interrupted_turn(tmp_path, capsys):
    asyncio.run(test_a_message_mid_turn_interrupts_and_merges_on_the_embedded_log(tmp_path))
    interrupted = next(e for e in events_of(FileLog(tmp_path), "c1") if isinstance(e, TurnInterrupted))
    data = ["--data", str(tmp_path)]
    assert cli.main(["tail", *data]) == 0
    assert "INTERRUPTED by message m2" in capsys.readouterr().out
    assert cli.main(["inspect", *data, "c1"]) == 0
    assert "INTERRUPTED by message m2" in capsys.readouterr().out
    page = tmp_path / "turn.html"
    assert cli.main(["export-turn", *data, "c1", interrupted.turn_id, "-o", str(page)]) == 0
    assert "TurnInterrupted" in page.read_text()


def test_every_event_type_has_a_timeline_line_naming_it():
    for name, event in event_examples().items():
        assert describe(event).startswith(name), name


class _Mailer:
    """A side-effecting tool that holds its call until released."""

    def __init__(self) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()
        self.ran: list[str] = []
        self.tools = ToolRegistry([Tool("send_email", "Send an email.", _Args, self.send_email, "side_effect")])

    async def send_email(self, args: _Args) -> str:
        self.entered.set()
        await self.release.wait()
        self.ran.append("send_email")
        return "sent"


async def _waits_after_a_side_effect(mailer: _Mailer, send: Publish, read: Read) -> list[Event]:
    """B arrives while the side-effecting tool runs: no interruption, B is the next turn."""
    await send("m1", "email bob")
    await asyncio.wait_for(mailer.entered.wait(), 30)
    await send("m2", "and cc alice")
    await _eventually(read, lambda es: any(getattr(e, "message_id", None) == "m2" for e in es))
    mailer.release.set()
    events = await _eventually(read, lambda es: sum(isinstance(e, TurnCompleted) for e in es) == 2)
    assert not any(isinstance(e, TurnInterrupted) for e in events) and mailer.ran == ["send_email"]
    assert [c.input_ids for c in events if isinstance(c, TurnClaimed)] == [("m1",), ("m2",)]
    return events


async def test_once_a_side_effect_started_the_message_waits_for_the_next_turn(tmp_path):
    log, mailer = FileLog(tmp_path), _Mailer()
    send, read = _on_file_log(log)
    async with running(log, _Held(tool="send_email"), _config(mailer.tools)):
        await _waits_after_a_side_effect(mailer, send, read)
    assert audit(log.read_all(log.topics.events)).ok


@contextlib.asynccontextmanager
async def _kafka_worker(
    bootstrap: str, topics: Topics, model: _Held, tools: ToolRegistry | None = None
) -> AsyncIterator[tuple[Publish, Read]]:
    from turnstile.streams.worker import Worker

    group = f"g-{uuid.uuid4().hex[:8]}"
    worker = Worker(KafkaLog(bootstrap, group, topics), model, _config(tools))
    publisher = KafkaLog(bootstrap, group, topics)
    await publisher.producer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))

    async def send(message_id: str, text: str) -> None:
        await publish(publisher, message_event("c1", text, NOW(), message_id))

    async def read() -> list[Event]:
        assert not task.done(), "the worker stopped"
        values = [decode(r.value) for r in await read_topic(bootstrap, topics.events)]
        return [e for e in values if not isinstance(e, DecodeError) and e.conversation_id == "c1"]

    try:
        yield send, read
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await publisher.producer.stop()


@pytest.mark.kafka
async def test_a_message_mid_turn_interrupts_and_merges_on_kafka(kafka_bootstrap: str, fresh_topics: Topics):  # noqa: F811
    model = _Held()
    async with _kafka_worker(kafka_bootstrap, fresh_topics, model) as (send, read):
        await _interrupt_and_merge(model, send, read)
    report = audit(await read_topic(kafka_bootstrap, fresh_topics.events))
    assert report.ok and report.rule("interrupt").checked == 1, report


@pytest.mark.kafka
async def test_once_a_side_effect_started_the_message_waits_on_kafka(kafka_bootstrap: str, fresh_topics: Topics):  # noqa: F811
    mailer = _Mailer()
    async with _kafka_worker(kafka_bootstrap, fresh_topics, _Held(tool="send_email"), mailer.tools) as (send, read):
        await _waits_after_a_side_effect(mailer, send, read)
    assert audit(await read_topic(kafka_bootstrap, fresh_topics.events)).ok


# -- where the policy is set -------------------------------------------------------------
def test_the_policy_is_taken_by_the_cli_the_config_file_and_the_agent():
    from turnstile import Agent, Model
    from turnstile.streams.cli import build_parser
    from turnstile.streams.config_file import DoubleTextConfig

    args = build_parser().parse_args(["run", "--double-text", "interrupt", "--double-text-for", "c1=enqueue"])
    assert args.double_text == "interrupt" and dict(args.double_text_for) == {"c1": "enqueue"}
    file_policy = DoubleTextConfig(default="enqueue", per_conversation={"support": "interrupt"}).policy()
    assert file_policy.of("support") == "interrupt" and file_policy.of("other") == "enqueue"
    assert Agent("a", model=Model("gpt"), double_text="interrupt").double_text_policy() == INTERRUPT
    with pytest.raises(ValueError):
        DoubleTextPolicy("merge")  # type: ignore[arg-type]


def test_a_turn_backing_off_between_attempts_is_not_interrupted():
    from turnstile.handlers.provider import ProviderError
    from turnstile.handlers.turn_steps import ModelFailed, SleepUntil, Woke

    state = new_state("conv-1")
    assert apply_event(state, message("m1", 10)) is None
    ids = (f"id-{n}" for n in itertools.count())
    m = machine_for(state, TurnSettings(model="m"), "openai", lambda: next(ids))
    plan = plan_claim(state, 5_000, DebouncePolicy())
    assert isinstance(plan, ClaimPlan)
    decide(m, Claimed(plan, 5_000))
    backoff = decide(m, ModelFailed(ProviderError("server_error", "500", retryable=True), 5_100))
    assert isinstance(backoff[-1], SleepUntil) and not interruptible(m)  # the run is closed
    decide(m, Woke(5_400))
    assert interruptible(m)  # the next attempt runs: it can be withdrawn again

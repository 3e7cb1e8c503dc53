"""The turns recorded in tests/replays/*.jsonl: each one a conversation, a scripted model,
tools and settings, and (for a takeover) the event after which the first owner dies.

`tests/replays/record.py` runs each scenario through the real executor
(`streams.turn_runner.TurnRunner`) on the embedded file log and writes its history;
`tests/test_replays.py` replays the histories through `decide` with the same settings.
Time is a clock the model and the tools advance, ids are counters: a re-recording of an
unchanged engine writes the same files."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict

from turnstile.events import DecodeError, Event, InputInjected, MessageReceived, ToolCall, Usage, decode, encode
from turnstile.events.inputs import Approval
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, plan_claim
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ModelReply, ModelRequest, ProtocolFamily, ProviderError, ReplyStream
from turnstile.handlers.replayer import step_json
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.handlers.turn_settings import Route, TurnSettings
from turnstile.handlers.turn_steps import Command, Observation
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.file_log import FileLog
from turnstile.streams.turn_runner import StepHook, TurnRunner

CONV = "replay-1"
T0 = 1_800_000_000_000
FAMILY: ProtocolFamily = "openai"
REPLAYS = Path(__file__).parent / "replays"


@dataclass
class Clock:
    now: int = T0

    def now_ms(self) -> int:
        return self.now


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    q: str = ""
    ms: int = 0  # clock time the call takes


# One scripted model step: a reply (text, calls as (id, tool, arguments)) or an error.
@dataclass(frozen=True)
class Say:
    text: str | None = None
    calls: tuple[tuple[str, str, str], ...] = ()
    ms: int = 100
    output_tokens: int = 20
    model: str = "m"


@dataclass(frozen=True)
class Fail:
    error: ProviderError
    ms: int = 50


@dataclass(frozen=True)
class Hold:
    """A request that never ends by itself (the test interrupts it)."""


@dataclass
class Model:
    """A Provider of family `openai` that answers from a script, advancing the clock."""

    clock: Clock
    script: list[Say | Fail | Hold]
    family: ProtocolFamily = FAMILY
    held: asyncio.Event = field(default_factory=asyncio.Event)

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        step = self.script.pop(0) if self.script else Say("Nothing more to add.")
        if isinstance(step, Hold):
            self.held.set()
            await asyncio.Event().wait()
        assert not isinstance(step, Hold)
        self.clock.now += step.ms
        if isinstance(step, Fail):
            raise step.error
        calls = tuple(ToolCall(call_id=c, name=n, arguments=a) for c, n, a in step.calls)
        usage = Usage(input_tokens=10 * len(request.messages), output_tokens=step.output_tokens)
        stop = "tool_use" if calls else "end"
        return ModelReply(step.model, step.text, calls, usage, "tool_calls" if calls else "stop", stop)

    async def aclose(self) -> None:
        return None


def tools(clock: Clock) -> ToolRegistry:
    def acting(name: str) -> Callable[..., Any]:
        async def run(args: Args, key: str | None = None) -> str:
            clock.now += args.ms
            return f"{name}: done for {args.q or 'you'}"

        return run

    async def booked(call: ToolCall) -> str | None:
        return "book: the booking is on record"

    return ToolRegistry(
        [
            Tool("search", "Search the web.", Args, acting("search")),
            Tool("send_email", "Send an email.", Args, acting("send_email"), "side_effect"),
            Tool("pay", "Pay an invoice.", Args, acting("pay"), "side_effect", idempotent=True),
            Tool("book", "Book a table.", Args, acting("book"), "side_effect", reconcile=booked),
            Tool("wire", "Wire money.", Args, acting("wire"), "side_effect", needs_approval=True),
        ]
    )


PRICES = {"m": ModelPrice(1.0, 4.0), "m-backup": ModelPrice(1.0, 4.0)}


@dataclass(frozen=True)
class Scenario:
    name: str
    script: tuple[Say | Fail | Hold, ...]
    text: str = "Please help."
    budget: TurnBudget = field(default_factory=TurnBudget)
    fallback: bool = False
    # A takeover: the first owner dies right after writing its `die_after`-th event of
    # that type; the recorded history is the next owner's.
    die_after: tuple[str, int] | None = None
    # Approved: the turn recorded is the one after a pause for approval, approved.
    approved: bool = False
    # Interrupt-and-merge: a second message arrives during the first request. "recorded":
    # the interrupted turn is the history; "before": the merged turn after it is.
    interrupted: Literal["recorded", "before"] | None = None

    def settings(self, clock: Clock, model: Model | None = None) -> TurnSettings:
        backup = (Route("m-backup", model or Model(clock, [])),) if self.fallback else ()
        return TurnSettings(
            model="m",
            system_prompt="You are a test assistant.",
            backoff_base_ms=5,
            budget=self.budget,
            prices=PRICES,
            tools=tools(clock),
            fallbacks=backup,
            max_output_tokens=200,
        )


def _search(call: str, q: str = "x", ms: int = 0) -> tuple[str, str, str]:
    return (call, "search", orjson.dumps({"q": q, "ms": ms}).decode())


SERVER_ERROR = ProviderError("server_error", "HTTP 500", retryable=True, status=500)
OVERLOADED = ProviderError("overloaded", "HTTP 529", retryable=True, status=529)
# An unusable reply the provider reported (and billed) tokens for.
BILLED_MALFORMED = ProviderError(
    "malformed_response", "choices is empty", retryable=False, usage=Usage(input_tokens=1000, output_tokens=10)
)

SCENARIOS = {
    s.name: s
    for s in (
        Scenario("completed", (Say("Looking.", (_search("c1", "dates"),)), Say("The dates are fine."))),
        Scenario(
            "paused_cost",
            (Say("Step.", (_search("c1"),), output_tokens=150), Say("Never sent.")),
            budget=TurnBudget(max_cost_usd=0.0022),
        ),
        Scenario(
            "paused_tool_calls",
            (Say("Two lookups.", (_search("c1", "a"), _search("c2", "b"))),),
            budget=TurnBudget(max_tool_calls=1),
        ),
        Scenario(
            "paused_deadline",
            (Say("A slow lookup.", (_search("c1", "slow", ms=6_000),)),),
            budget=TurnBudget(deadline_ms=5_000),
        ),
        Scenario("paused_approval", (Say("Wiring.", (("c1", "wire", '{"q": "bob"}'),)),)),
        Scenario(
            "approval",
            (
                Say("Wiring.", (("c1", "wire", '{"q": "bob"}'),)),
                Say("", (("c2", "wire", '{"q": "bob"}'),)),
                Say("Sent."),
            ),
            approved=True,
        ),
        Scenario(
            "exhausted",
            (Say("One.", (_search("c1", "1"),)), Say("Two.", (_search("c2", "2"),))),
            budget=TurnBudget(max_iterations=2),
        ),
        Scenario("fallback", (Fail(OVERLOADED), Say("The backup answers.", model="m-backup")), fallback=True),
        Scenario(
            "billed_malformed", (Fail(BILLED_MALFORMED), Say("The backup answers.", model="m-backup")), fallback=True
        ),
        Scenario(
            "protocol_failures",
            (
                Say("", (("c1", "nope", "{}"),)),
                Say("", (("c2", "search", "{not json"),)),
                Say("", (("c3", "nope", "{}"),)),
                Say("", (("c4", "nope", " {} "),)),
            ),
        ),
        Scenario("retried", (Fail(SERVER_ERROR), Say("Second attempt answers."))),
        Scenario(
            "crash_takeover",
            (Say("Looking.", (_search("c1"),)), Say("Started over.")),
            die_after=("AttemptStarted", 1),
        ),
        Scenario(
            "resume",
            (Say("Two things.", (_search("c1"), ("c2", "pay", '{"q": "invoice 7"}'))), Say("Paid.")),
            die_after=("ToolCallFinished", 1),
        ),
        Scenario(
            "resume_reconciled",
            (Say("Booking.", (("c1", "book", '{"q": "table for 2"}'),)), Say("Booked.")),
            die_after=("ToolCallStarted", 1),
        ),
        Scenario("interrupted", (Hold(),), interrupted="recorded"),
        Scenario("merged", (Hold(), Say("Both answered.")), interrupted="before"),
        # The owner failed its attempt for good (a side effect had run) and died before its
        # TurnFailed: the next owner writes it and calls nothing.
        Scenario(
            "takeover_after_failed",
            (Say("Emailing.", (("c1", "send_email", '{"q": "bob"}'),)), Fail(SERVER_ERROR)),
            die_after=("AttemptFailed", 1),
        ),
        # The owner failed its attempt retryably and died backing off: the next owner, past
        # the backoff, starts attempt 2 from the inputs (the search step is not resumed).
        Scenario(
            "takeover_in_backoff",
            (Say("Looking.", (_search("c1"),)), Fail(SERVER_ERROR), Say("Started over.")),
            die_after=("AttemptFailed", 1),
        ),
        Scenario(
            "takeover_unresumable",
            (Say("Emailing.", (("c1", "send_email", '{"q": "bob"}'),)),),
            die_after=("ToolCallStarted", 1),
        ),
    )
}


class Died(BaseException):
    """The first owner's process ends here (a SIGKILL: nothing more is written)."""


def fold(events: list[Event]) -> ConversationState:
    state = new_state(CONV)
    for event in events:
        apply_event(state, event)
    return state


def events_on(log: FileLog) -> list[Event]:
    out = []
    for record in log.read_all(log.topics.events):
        event = decode(record.value)
        assert not isinstance(event, DecodeError), event
        out.append(event)
    return out


async def record(scenario: Scenario, directory: Path) -> list[dict[str, Any]]:
    """Runs `scenario` on a file log in `directory`; its history as JSON lines."""
    log, clock = FileLog(directory), Clock()
    model = Model(clock, list(scenario.script))
    settings = scenario.settings(clock, model)
    await _put(log, _message(scenario.text, clock.now))
    clock.now += 2_000
    counter = itertools.count(1)

    def runner(prefix: str, on_step: StepHook | None, dies: bool) -> TurnRunner:
        written: dict[str, int] = {}

        async def append(event: Event, wait: bool = True, value: bytes | None = None) -> None:
            await _put(log, event)
            written[event.type] = written.get(event.type, 0) + 1
            if dies and scenario.die_after == (event.type, written[event.type]):
                raise Died

        def new_id() -> str:
            drawn.append(f"{prefix}-{next(counter)}")
            return drawn[-1]

        return TurnRunner(fold(events_on(log)), append, model, settings, clock.now_ms, new_id, on_step=on_step)

    drawn: list[str] = []
    steps: list[dict[str, Any]] = []

    async def interrupted_turn(prefix: str, on_step: StepHook | None) -> None:
        """The turn's first request is held; a second message arrives and interrupts it."""
        turn = runner(prefix, on_step, False)
        task = asyncio.create_task(turn.claim_and_run(_plan(events_on(log), clock)))
        await model.held.wait()
        clock.now += 500
        second = _message("And the refund rules?", clock.now, "m2", "in-2")
        await _put(log, second)
        assert turn.interrupt(second), "the turn could not be interrupted"
        await task
        clock.now += 2_000

    def on_step(seen: Observation, commands: tuple[Command, ...]) -> None:
        steps.append(step_json(seen, drawn, commands))
        drawn.clear()

    if scenario.approved:
        await runner("first", None, False).claim_and_run(_plan(events_on(log), clock))
        paused = fold(events_on(log)).turns
        turn_id, record_ = next(iter(paused.items()))
        assert record_.pending_call is not None
        approval = Approval(turn_id=turn_id, call_id=record_.pending_call.call_id, approved=True)
        await _put(log, _approval(approval, clock.now))
        clock.now += 2_000
    if scenario.interrupted == "before":
        await interrupted_turn("cut", None)
    if scenario.interrupted == "recorded":
        before = events_on(log)
        drawn.clear()
        await interrupted_turn("own", on_step)
    elif scenario.die_after is not None:
        try:
            await runner("dead", None, True).claim_and_run(_plan(events_on(log), clock))
        except Died:
            pass
        else:
            raise AssertionError(f"{scenario.name}: the first owner never reached {scenario.die_after}")
        clock.now += 10_000
        before = events_on(log)
        drawn.clear()
        await runner("next", on_step, False).recover()
    else:
        before = events_on(log)
        drawn.clear()
        await runner("own", on_step, False).claim_and_run(_plan(before, clock))
    header = {
        "conversation_id": CONV,
        "scenario": scenario.name,
        "recorded_by": f".venv/bin/python tests/replays/record.py {scenario.name}",
        "replayed_by": "tests/test_replays.py, through turnstile.handlers.replayer.replay",
    }
    return [header, *({"log": e.model_dump(mode="json")} for e in before), *steps]


def _plan(events: list[Event], clock: Clock) -> ClaimPlan:
    plan = plan_claim(fold(events), clock.now, DebouncePolicy())
    assert isinstance(plan, ClaimPlan), plan
    return plan


def _message(text: str, at: int, message_id: str = "m1", event_id: str = "in-1") -> MessageReceived:
    return MessageReceived(event_id=event_id, conversation_id=CONV, occurred_at=at, message_id=message_id, content=text)


def _approval(approval: Approval, at: int) -> InputInjected:
    return InputInjected(
        event_id="in-2",
        conversation_id=CONV,
        occurred_at=at,
        occurrence_key="approval-1",
        source="approval",
        content="Approved.",
        approval=approval,
    )


async def _put(log: FileLog, event: Event) -> None:
    await log.append(log.topics.events, event.conversation_id, encode(event))

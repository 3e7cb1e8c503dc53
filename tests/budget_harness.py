"""One turn run in-process with an injected clock: a scripted model that honours the
output allowance of each request, and tools whose running time is a number of clock
milliseconds. A step that would run past the deadline waits, with the clock at the
deadline, until the runner cancels it, as a real slow step would."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from turnstile.events import Event, ResumeRequested, ToolCall, Usage
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, plan_claim
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ModelReply, ModelRequest, ProtocolFamily, ReplyStream
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.turn_runner import TurnRunner, TurnSettings

CONV = "c1"
START = 1_000_000
MODEL = "m"


@dataclass
class Clock:
    now: int = START

    def now_ms(self) -> int:
        return self.now


@dataclass(frozen=True)
class Step:
    """One scripted model reply: it takes `ms` of clock time and would like to write
    `output_tokens` tokens; `calls` are (tool, ms the tool takes) pairs."""

    ms: int = 0
    output_tokens: int = 10
    calls: tuple[tuple[str, int], ...] = ()
    text: str = "working"


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ms: int


@dataclass
class Harness:
    clock: Clock = field(default_factory=Clock)
    script: list[Step] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requests: list[ModelRequest] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)  # call ids of tools that finished
    cancelled: list[str] = field(default_factory=list)  # tools cut off while running
    deadline_at: int = 0
    ids: itertools.count[int] = field(default_factory=itertools.count)

    async def _take(self, ms: int, what: str, past_deadline: bool = False) -> None:
        """Spend `ms` of clock time; past the deadline, wait at the deadline for the cancel
        (`past_deadline`: a side-effecting call, which the deadline does not cut off)."""
        if past_deadline or self.clock.now + ms <= self.deadline_at:
            self.clock.now += ms
            return
        self.clock.now = max(self.clock.now, self.deadline_at)
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.append(what)

    # The model: a Provider.
    family: ProtocolFamily = "scripted"

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        self.requests.append(request)
        step = self.script.pop(0) if self.script else Step(text="done")
        await self._take(step.ms, f"request {len(self.requests)}")
        # Input tokens: one per word, well inside the runner's bound of one per byte.
        words = sum(len(m.content.split()) + len(m.tool_calls) for m in request.messages)
        out = min(step.output_tokens, request.max_output_tokens)
        usage = Usage(input_tokens=words, output_tokens=out)
        if step.output_tokens > request.max_output_tokens:  # cut off at the allowance
            return ModelReply(MODEL, step.text, (), usage, "length", "truncated")
        n = len(self.requests)
        calls = tuple(
            ToolCall(call_id=f"call_{n}_{i}", name=name, arguments=f'{{"ms": {ms}}}')
            for i, (name, ms) in enumerate(step.calls)
        )
        return ModelReply(
            MODEL, step.text, calls, usage, "tool_calls" if calls else "stop", "tool_use" if calls else "end"
        )

    async def aclose(self) -> None:
        return None

    def tools(self) -> ToolRegistry:
        def make(name: str) -> object:
            async def run(args: Args) -> str:
                await self._take(args.ms, name, past_deadline=name == "transfer")
                self.ran.append(name)
                return f"{name} took {args.ms} ms"

            return run

        return ToolRegistry(
            [
                Tool("search", "Search.", Args, make("search"), "read_only"),  # type: ignore[arg-type]
                Tool("transfer", "Send money.", Args, make("transfer"), "side_effect"),  # type: ignore[arg-type]
            ]
        )

    def settings(self, budget: TurnBudget, price: ModelPrice, max_output_tokens: int = 1000) -> TurnSettings:
        self.deadline_at = START + budget.deadline_ms
        return TurnSettings(
            model=MODEL,
            system_prompt=None,
            budget=budget,
            prices={MODEL: price},
            tools=self.tools(),
            max_output_tokens=max_output_tokens,
        )

    async def run_turn(self, state: ConversationState, settings: TurnSettings) -> Event:
        """Claims what is pending and runs the turn to its outcome; returns the outcome."""
        plan = plan_claim(state, self.clock.now + 60_000, DebouncePolicy())
        assert isinstance(plan, ClaimPlan)
        self.deadline_at = self.clock.now + settings.budget.deadline_ms

        async def append(event: Event, wait: bool = True, value: bytes | None = None) -> None:
            self.events.append(event)

        runner = TurnRunner(state, append, self, settings, self.clock.now_ms, lambda: f"id-{next(self.ids)}")
        await runner.claim_and_run(plan)
        return self.events[-1]


def conversation(text: str = "do the work") -> ConversationState:
    from builders import message

    state = new_state(CONV)
    assert apply_event(state, message("m1", START - 60_000, text, conv=CONV)) is None
    return state


def resume(turn_id: str, at: int, request_id: str = "r1") -> ResumeRequested:
    return ResumeRequested(
        event_id=f"e-{request_id}", conversation_id=CONV, occurred_at=at, request_id=request_id, resumes_turn_id=turn_id
    )


def of_type(events: Sequence[Event], name: str) -> list[Event]:
    return [e for e in events if e.type == name]

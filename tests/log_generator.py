"""Random event logs for property tests: several conversations, interleaved, whose events
are mostly what an engine would write next (so the folded states reach every shape: open
attempts with tool calls and protocol failures, retries, paused turns waiting for an
approval, refused double texts) and sometimes what it would not (duplicates, conflicting
re-publishes, stale runs, claims of inputs that are not pending), which the fold refuses.

Deterministic for a given `random.Random`: hypothesis draws the seed and the sizes."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from turnstile.events import (
    REFUSAL_ERROR,
    Approval,
    AttemptFailed,
    AttemptStarted,
    ContextCompacted,
    Event,
    FallbackEngaged,
    InputInjected,
    MessageReceived,
    MessageRejected,
    ModelResponded,
    ProtocolFailure,
    ResumeRequested,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    Usage,
    logical_turn_id,
)
from turnstile.handlers import outcomes
from turnstile.projections import ConversationState, apply_event, new_state

T0 = 1_767_225_600_000


@dataclass
class _Writer:
    rng: random.Random
    conversation: str
    state: ConversationState
    n: int = 0
    at: int = T0
    contents: dict[str, str] = field(default_factory=dict)

    def next_id(self, kind: str) -> str:
        self.n += 1
        return f"{self.conversation}-{kind}{self.n}"

    def env(self) -> dict[str, object]:
        self.at += self.rng.randint(0, 50)
        return {"event_id": self.next_id("e"), "conversation_id": self.conversation, "occurred_at": self.at}

    def turn_env(self, run_id: str | None = None, attempt: int | None = None) -> dict[str, object]:
        turn = self.state.active
        assert turn is not None
        return {**self.env(), "turn_id": turn.turn_id, "run_id": run_id or turn.run_id,
                "attempt": attempt or turn.attempt}  # fmt: skip

    def stamp(self) -> outcomes.Stamp:
        env = self.env()
        return outcomes.Stamp(str(env["event_id"]), self.conversation, int(env["occurred_at"]))  # type: ignore[call-overload]

    # -- inputs --------------------------------------------------------------------------
    def message(self) -> Event:
        roll = self.rng.random()
        if self.contents and roll < 0.1:  # a re-publish: harmless, or an id reused for other content
            message_id = self.rng.choice(sorted(self.contents))
            content = self.contents[message_id] if self.rng.random() < 0.7 else "something else"
        else:
            message_id = self.next_id("m")
            content = self.contents[message_id] = f"message {message_id}: " + "x" * self.rng.randint(0, 40)
        return MessageReceived(**self.env(), message_id=message_id, content=content)  # type: ignore[arg-type]

    def injected(self) -> Event:
        paused = [t for t in self.state.turns.values() if t.pending_call is not None]
        if paused and self.rng.random() < 0.7:
            turn = self.rng.choice(paused)
            assert turn.pending_call is not None
            approval = Approval(turn_id=turn.turn_id, call_id=turn.pending_call.call_id,
                                approved=self.rng.random() < 0.5)  # fmt: skip
            return InputInjected(**self.env(), occurrence_key=self.next_id("a"), source="approval",  # type: ignore[arg-type]
                                 content="approved", approval=approval)  # fmt: skip
        return InputInjected(**self.env(), occurrence_key=self.next_id("s"), source="schedule", content="digest")  # type: ignore[arg-type]

    def resume(self) -> Event:
        turns = sorted(self.state.turns)
        return ResumeRequested(**self.env(), request_id=self.next_id("r"),  # type: ignore[arg-type]
                               resumes_turn_id=self.rng.choice(turns) if turns else "none")  # fmt: skip

    def claim(self) -> Event:
        pending = list(self.state.pending)
        if not pending or self.rng.random() < 0.05:
            inputs = [self.next_id("ghost")]  # not pending: refused
        else:
            inputs = pending[: self.rng.randint(1, len(pending))]
        return TurnClaimed(**self.env(), turn_id=logical_turn_id(inputs), run_id=self.next_id("run"), attempt=1,  # type: ignore[arg-type]
                           input_ids=tuple(inputs), history_boundary=len(self.state.history))  # fmt: skip

    def reject(self) -> Event | None:
        messages = [p.input_id for p in self.state.pending.values() if p.kind == "message"]
        if not messages or self.state.active is None:
            return None
        return MessageRejected(**self.env(), message_id=self.rng.choice(messages), reason="turn_active",  # type: ignore[arg-type]
                               active_turn_id=self.state.active.turn_id, text="busy, try again")  # fmt: skip

    # -- a turn ----------------------------------------------------------------------------
    def step(self) -> Event | None:
        turn = self.state.active
        assert turn is not None
        if turn.attempt_state == "claimed":
            return AttemptStarted(**self.turn_env(), model="m1")  # type: ignore[arg-type]
        if turn.attempt_state == "closed":
            if turn.side_effect_started or self.rng.random() < 0.2:
                return outcomes.failed(turn, self.stamp(), "gave up", "m1")
            return AttemptStarted(**self.turn_env(self.next_id("run"), turn.attempt + 1), model="m1")  # type: ignore[arg-type]
        roll = self.rng.random()
        iteration = turn.iterations + 1
        if roll < 0.05:
            return ModelResponded(**self.turn_env(self.next_id("stale")), iteration=iteration, model="m1")  # type: ignore[arg-type]
        if roll < 0.3:
            cost = None if self.rng.random() < 0.1 else self.rng.choice([0.0, 0.25, 0.001])
            return ModelResponded(**self.turn_env(), iteration=iteration, model=self.rng.choice(["m1", "m2"]),  # type: ignore[arg-type]
                                  text="thinking", usage=Usage(input_tokens=self.rng.randint(0, 99),
                                                               output_tokens=self.rng.randint(0, 99)),
                                  cost_usd=cost)  # fmt: skip
        if roll < 0.45:
            return ToolCallStarted(**self.turn_env(), iteration=max(1, turn.iterations), call_id=self.next_id("call"),  # type: ignore[arg-type]
                                   tool="transfer", arguments='{"to": "bob"}',
                                   side_effect=self.rng.random() < 0.3)  # fmt: skip
        if roll < 0.55:
            started = [op.call_id for op in turn.operations.values() if op.status == "started"]
            if not started:
                return None
            call_id = self.rng.choice(started)
            return ToolCallFinished(**self.turn_env(), iteration=max(1, turn.iterations),  # type: ignore[arg-type]
                                    call_id=call_id, ok=self.rng.random() < 0.7, result="ok")  # fmt: skip
        if roll < 0.62:
            return ProtocolFailure(**self.turn_env(), iteration=max(1, turn.iterations), model="m1",  # type: ignore[arg-type]
                                   kind=self.rng.choice(["unknown_tool", "repeated_call"]), detail="no such tool",
                                   signature=self.rng.choice(["sig-a", "sig-b", None]))  # fmt: skip
        if roll < 0.66:
            return FallbackEngaged(**self.turn_env(), from_model="m1", to_model="m2", reason="overloaded")  # type: ignore[arg-type]
        if roll < 0.69:
            return ContextCompacted(**self.turn_env(), iteration=max(1, turn.iterations), compacted_call_ids=(),  # type: ignore[arg-type]
                                    dimension="tokens")  # fmt: skip
        if roll < 0.76:
            return AttemptFailed(**self.turn_env(), reason="timeout", retryable=not turn.side_effect_started)  # type: ignore[arg-type]
        if roll < 0.85:
            return outcomes.completed(turn, self.stamp(), "done", "m1")
        if roll < 0.92:
            call = ToolCall(call_id=self.next_id("call"), name="transfer", arguments='{"to": "bob"}')
            return outcomes.paused(turn, self.stamp(), "approval", "kept text", "approve the call", "m1", call)
        if roll < 0.96:
            return outcomes.exhausted(turn, self.stamp(), self.rng.choice([None, "last"]), "m1")
        if roll < 0.98:  # the model refused: its inputs are withheld from later turns
            return outcomes.failed(turn, self.stamp(), f"{REFUSAL_ERROR}.", "m1", "refusal", "Sure")
        return outcomes.failed(turn, self.stamp(), "broken", "m1")

    def next_event(self) -> Event | None:
        roll = self.rng.random()
        if self.state.active is None:
            if roll < 0.45:
                return self.message()
            if roll < 0.5:
                return self.injected()
            if roll < 0.53:
                return self.resume()
            return self.claim()
        if roll < 0.12:
            return self.message()  # arrives mid-turn
        if roll < 0.16:
            return self.reject()
        return self.step()


def generated_log(rng: random.Random, conversations: int, events: int) -> list[Event]:
    """`events` events over `conversations` conversations (`gen-0`, `gen-1`, ...), interleaved."""
    writers = [_Writer(rng, f"gen-{i}", new_state(f"gen-{i}")) for i in range(conversations)]
    out: list[Event] = []
    while len(out) < events:
        writer = rng.choice(writers)
        event = writer.next_event()
        if event is not None:
            apply_event(writer.state, event)
            out.append(event)
    return out


def fold(events: list[Event]) -> dict[str, ConversationState]:
    states: dict[str, ConversationState] = {}
    for event in events:
        state = states.setdefault(event.conversation_id, new_state(event.conversation_id))
        apply_event(state, event)
    return states

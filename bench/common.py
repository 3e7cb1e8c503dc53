"""Shared pieces of the benchmarks: realistic event streams built with the engine's own
pure core (so every event is one the fold accepts), timing helpers and the table."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from turnstile.events import AttemptStarted, Event, MessageReceived, ModelResponded, Usage
from turnstile.handlers import outcomes
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, claim_event, plan_claim
from turnstile.projections import ConversationState, apply_event, new_state

T0_MS = 1_767_000_000_000  # a fixed epoch (ms): the streams are the same on every run
MODEL = "scripted-1"
NO_DEBOUNCE = DebouncePolicy(quiet_ms=0, max_wait_ms=0)


def message(conversation: str, i: int, at_ms: int) -> MessageReceived:
    return MessageReceived(
        event_id=f"{conversation}-e{i}",
        conversation_id=conversation,
        occurred_at=at_ms,
        message_id=f"{conversation}-m{i}",
        content=f"message {i}: please check the dates of my booking and compare the refund rules",
    )


def conversation_events(conversation: str, messages: int, turns: bool = True) -> Iterator[Event]:
    """One conversation of `messages` user messages, each answered by a completed turn
    (claim, attempt, model response, outcome) before the next arrives, as the worker
    would write them: history grows by two entries per message."""
    state = new_state(conversation)
    at = T0_MS
    for i in range(messages):
        at += 10
        batch: list[Event] = [message(conversation, i, at)]
        if turns:
            _fold(state, batch[0])
            plan = plan_claim(state, at, NO_DEBOUNCE)
            assert isinstance(plan, ClaimPlan)
            claim = claim_event(state, plan, event_id=f"{conversation}-c{i}", run_id=f"{conversation}-r{i}", now_ms=at)
            _fold(state, claim)
            stamp = {
                "conversation_id": conversation,
                "occurred_at": at + 1,
                "turn_id": claim.turn_id,
                "run_id": claim.run_id,
                "attempt": 1,
            }
            started = AttemptStarted(event_id=f"{conversation}-s{i}", model=MODEL, **stamp)
            _fold(state, started)
            reply = f"(scripted reply to) message {i}: the dates are fine and the refund rules are the same"
            responded = ModelResponded(
                event_id=f"{conversation}-p{i}",
                iteration=1,
                model=MODEL,
                text=reply,
                usage=Usage(input_tokens=20 * (i + 1), output_tokens=18),
                cost_usd=0.0,
                **stamp,
            )
            _fold(state, responded)
            assert state.active is not None
            done = outcomes.completed(
                state.active, outcomes.Stamp(f"{conversation}-o{i}", conversation, at + 2), reply, MODEL
            )
            _fold(state, done)
            batch += [claim, started, responded, done]
        yield from batch


def _fold(state: ConversationState, event: Event) -> None:
    rejection = apply_event(state, event)
    if rejection is not None:
        raise AssertionError(f"benchmark stream is invalid: {event.type}: {rejection.reason}")


@contextlib.contextmanager
def gc_restored() -> Iterator[None]:
    """Around a worker that runs with `WorkerGc` (process-wide, as `turnstile run` installs
    it): the collector's thresholds put back and what it froze unfrozen, so the next
    round's baseline runs under CPython's defaults."""
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def now_s() -> float:
    return time.perf_counter()


@dataclass
class Section:
    """One block of the printed report: a title, a header row and rows of text cells."""

    title: str
    header: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: str) -> None:
        self.rows.append(tuple(cells) + ("",) * (len(self.header) - len(cells)))

    def render(self) -> str:
        widths = [max(len(row[i]) for row in (self.header, *self.rows)) for i in range(len(self.header))]

        def line(row: tuple[str, ...]) -> str:
            first = row[0].ljust(widths[0])
            rest = [c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            return " | ".join([first, *rest]).rstrip()

        out = [self.title, line(self.header), "-+-".join("-" * w for w in widths)]
        out += [line(row) for row in self.rows]
        out += [f"  * {note}" for note in self.notes]
        return "\n".join(out)


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] in "-+<>~") and not cell.startswith("--")


def fmt(value: float, digits: int = 2) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"

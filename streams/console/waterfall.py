"""A turn's timeline as a waterfall: one span per attempt, model call and tool call, from
the turn's events in log order. A model call starts where its run's previous step ended
(the attempt's start, the last tool result or the previous response) and ends with its
`ModelResponded`; a tool call runs from its `ToolCallStarted` to its `ToolCallFinished`.
Events the fold ignored (a superseded run's) are left out: they are in the event table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from turnstile.events import (
    OUTCOME_TYPES,
    AttemptFailed,
    AttemptStarted,
    FallbackEngaged,
    ModelResponded,
    ProtocolFailure,
    ToolCallFinished,
    ToolCallStarted,
)
from turnstile.streams.views import TurnView

SpanKind = Literal["attempt", "model", "tool", "protocol"]


@dataclass(slots=True)
class Span:
    kind: SpanKind
    label: str
    start: int
    end: int | None = None  # None: still running
    status: str = "running"
    input_tokens: int | None = None
    output_tokens: int | None = None
    cost_usd: float | None = None
    # What the operator opens: the reply text, a tool's arguments and result, a failure.
    details: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class Waterfall:
    start: int
    end: int
    spans: list[Span]

    def position(self, span: Span) -> tuple[float, float]:
        """Left offset and width of the span's bar, in percent of the turn."""
        total = max(1, self.end - self.start)
        left = (span.start - self.start) / total * 100
        width = ((span.end if span.end is not None else self.end) - span.start) / total * 100
        return round(max(0.0, left), 2), round(max(0.4, width), 2)


def waterfall(turn: TurnView) -> Waterfall:
    spans: list[Span] = []
    attempts: dict[str, Span] = {}  # run id -> its attempt's span
    last_step: dict[str, int] = {}  # run id -> when its previous step ended
    tools: dict[str, Span] = {}  # call id -> its span
    end = turn.claimed_at
    for entry in turn.entries:
        end = max(end, entry.occurred_at)
        if entry.ignored is not None:
            continue
        event = entry.event
        at = event.occurred_at
        match event:
            case AttemptStarted():
                resumed = f", resumes {event.resumes_run_id[:8]}" if event.resumes_run_id else ""
                span = Span("attempt", f"attempt {event.attempt} · {event.model}{resumed}", at)
                attempts[event.run_id] = span
                spans.append(span)
                last_step[event.run_id] = at
            case ModelResponded():
                calls = ", ".join(c.name for c in event.tool_calls)
                span = Span("model", f"model {event.model} · iteration {event.iteration}",
                            last_step.get(event.run_id, at), at, event.finish_reason,
                            event.usage.input_tokens, event.usage.output_tokens, event.cost_usd)
                if event.text:
                    span.details.append(("reply", event.text))
                if calls:
                    span.details.append(("tool calls", calls))
                spans.append(span)
                last_step[event.run_id] = at
            case ToolCallStarted():
                kind = "side effect" if event.side_effect else "read-only"
                span = Span("tool", f"tool {event.tool} ({kind})", at)
                span.details.append(("arguments", event.arguments))
                tools[event.call_id] = span
                spans.append(span)
            case ToolCallFinished():
                span = tools.get(event.call_id) or Span("tool", f"tool call {event.call_id}", at)
                span.end, span.status = at, "ok" if event.ok else "failed"
                span.details.append(("result" if event.ok else "error", event.result))
                last_step[event.run_id] = at
            case ProtocolFailure():
                span = Span("protocol", f"protocol failure: {event.kind}", at, at, "failed")
                if event.usage is not None:  # an unusable reply, billed all the same
                    span.start = last_step.get(event.run_id, at)
                    span.input_tokens, span.output_tokens = event.usage.input_tokens, event.usage.output_tokens
                    span.cost_usd = event.cost_usd
                    last_step[event.run_id] = at
                span.details.append(("detail", event.detail))
                spans.append(span)
            case FallbackEngaged():
                attempt = attempts.get(event.run_id)
                if attempt is not None:
                    attempt.details.append(("fallback", f"{event.from_model} → {event.to_model}"))
            case AttemptFailed():
                attempt = attempts.get(event.run_id)
                if attempt is not None:
                    attempt.end, attempt.status = at, "retried" if event.retryable else "failed"
                    attempt.details.append(("failed", event.reason))
            case _ if isinstance(event, OUTCOME_TYPES):
                attempt = attempts.get(event.run_id)
                if attempt is not None and attempt.end is None:
                    attempt.end, attempt.status = at, event.type.removeprefix("Turn").lower()
                for span in tools.values():
                    if span.end is None:
                        span.status = "unknown"  # started, never finished: it may have happened
    return Waterfall(turn.claimed_at, end, spans)

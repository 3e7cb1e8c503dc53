"""OpenTelemetry spans of turns, attempts, model calls and tool calls, derived from the log.

Off by default (`WorkerConfig.tracing`). A worker that traces builds the spans from the
events it folds as new (the same events its metrics count), with the events' own times:
the log is the record, so a trace shows what the log says happened, including the attempts
of a worker that died (its successor folds them). Each model call spans from the event its
run wrote just before the request to its `ModelResponded`.

    turnstile.turn                  turnstile.conversation_id, turnstile.turn_id, turnstile.inputs, turnstile.outcome
      turnstile.attempt             turnstile.attempt, turnstile.run_id, gen_ai.request.model
        chat {model}                the GenAI semantic conventions: gen_ai.operation.name=chat, gen_ai.system,
                                    gen_ai.request.model, gen_ai.response.model, gen_ai.usage.input_tokens,
                                    gen_ai.usage.output_tokens, gen_ai.usage.cache_read.input_tokens,
                                    gen_ai.usage.cache_creation.input_tokens, gen_ai.response.finish_reasons,
                                    turnstile.cost_usd
        execute_tool {tool}         gen_ai.operation.name=execute_tool, gen_ai.tool.name, gen_ai.tool.call.id

A model request that got no usable reply is a failed `chat` span with `error.type` its
kind, read from the event that followed it (a malformed reply's `ProtocolFailure`, the
fallback it caused, or the attempt's failure).

Trace context travels from the publisher: `publish` puts the current span's W3C
`traceparent` in the record's headers (when OpenTelemetry is installed and a span is
active; the HTTP API's POST passes on its request's own when it has none), and the turn
span of the inputs it claims is that span's child (further inputs are links).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from turnstile.events import (
    INPUT_TYPES,
    OUTCOME_TYPES,
    AttemptFailed,
    AttemptStarted,
    Event,
    FallbackEngaged,
    ModelResponded,
    ProtocolFailure,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnEnvelope,
    TurnFailed,
    TurnInterrupted,
    TurnPaused,
    input_id,
)
from turnstile.handlers.fallback import failure_of
from turnstile.handlers.pauses import paused_because
from turnstile.handlers.provider import error_kind_of
from turnstile.projections import ConversationState

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

# Inputs whose trace context is remembered until a turn claims them; a bound, not a time.
INPUTS_KEPT = 100_000
Headers = Sequence[tuple[str, bytes | None]]


def trace_headers(incoming: Mapping[str, str] | None = None) -> dict[str, str]:
    """The trace context to put in a record's headers (W3C trace context): the current
    span's; else the one `incoming` carries (the headers of the HTTP request that asked for
    the publish, whose caller traces while this process does not); else none, and none
    when OpenTelemetry is not installed."""
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if carrier or incoming is None:
        return carrier
    context = propagate.extract(incoming)
    if trace.get_current_span(context).get_span_context().is_valid:
        propagate.inject(carrier, context=context)
    return carrier


def _ns(epoch_ms: int) -> int:
    return epoch_ms * 1_000_000


@dataclass(slots=True)
class _Run:
    span: Span
    model: str
    last_at: int  # occurred_at of the run's latest event: when its next request started
    failed_call_shown: bool = False  # the failed request's span is made (a malformed reply)


class TurnTracer:
    def __init__(self, family_of: Callable[[str], str], provider: TracerProvider | None = None) -> None:
        from opentelemetry import trace

        self._tracer: Tracer = trace.get_tracer("turnstile", tracer_provider=provider)
        self._family_of = family_of
        self._inputs: OrderedDict[tuple[str, str], Context] = OrderedDict()
        self._turns: dict[str, Span] = {}
        self._runs: dict[str, _Run] = {}
        self._tools: dict[tuple[str, str], Span] = {}

    def note_input(self, event: Event, headers: Headers) -> None:
        """Remembers the trace context an input was published with (replayed ones too): a
        message, or an operator's decision or resume through the HTTP API."""
        if not isinstance(event, INPUT_TYPES) or not headers:
            return
        from opentelemetry import propagate, trace

        carrier = {name: value.decode("latin-1") for name, value in headers if value is not None}
        context = propagate.extract(carrier)
        if not trace.get_current_span(context).get_span_context().is_valid:
            return
        self._inputs[(event.conversation_id, input_id(event))] = context
        while len(self._inputs) > INPUTS_KEPT:
            self._inputs.popitem(last=False)

    def on_event(self, state: ConversationState, event: Event) -> None:
        """`event` was folded into `state` as new."""
        if not isinstance(event, TurnEnvelope):
            return
        if isinstance(event, TurnClaimed):
            self._turn(state, event)
        elif isinstance(event, AttemptStarted):
            self._attempt(state, event)
        elif isinstance(event, ModelResponded):
            self._model_call(event)
        elif isinstance(event, ProtocolFailure) and event.kind == "malformed_response":
            self._model_call(event)  # a reply that could not be used (billed or not) is a failed call
        elif isinstance(event, ToolCallStarted):
            self._tool_started(event)
        elif isinstance(event, ToolCallFinished):
            self._tool_finished(event)
        elif isinstance(event, FallbackEngaged) and (run := self._runs.get(event.run_id)):
            failure = failure_of(event.reason) or "_OTHER"
            self._failed_call(event.run_id, failure, event.reason, event.occurred_at)
            run.model, run.failed_call_shown = event.to_model, False
        elif isinstance(event, AttemptFailed):
            self._if_a_failed_request(event.run_id, event.reason, event.occurred_at)
            self._end_run(event.run_id, event.occurred_at, error=event.reason)
        elif isinstance(event, TurnPaused) and event.reason == "deadline":
            # (a failed request whose retry would come after the deadline pauses the turn at once)
            why = paused_because(event.resume_hint)
            if why is not None:
                self._if_a_failed_request(event.run_id, why, event.occurred_at)
            self._outcome(event)
        elif isinstance(event, (*OUTCOME_TYPES, TurnInterrupted)):
            self._outcome(event)  # a withdrawn turn's span ends too, "interrupted"
        run = self._runs.get(event.run_id)
        if run is not None:
            run.last_at = event.occurred_at

    # -- spans ------------------------------------------------------------------------------------

    def _turn(self, state: ConversationState, event: TurnEnvelope) -> Span:
        span = self._turns.get(event.turn_id)
        if span is not None:
            return span
        from opentelemetry import trace

        active = state.active
        inputs = [i.input_id for i in active.inputs] if active is not None else []
        contexts = [c for i in inputs if (c := self._inputs.pop((event.conversation_id, i), None)) is not None]
        links = [trace.Link(trace.get_current_span(c).get_span_context()) for c in contexts[1:]]
        span = self._turns[event.turn_id] = self._tracer.start_span(
            "turnstile.turn",
            context=contexts[0] if contexts else None,
            links=links,
            start_time=_ns(event.occurred_at),
            attributes={
                "turnstile.conversation_id": event.conversation_id,
                "turnstile.turn_id": event.turn_id,
                "turnstile.inputs": len(inputs),
            },
        )
        return span

    def _attempt(self, state: ConversationState, event: AttemptStarted) -> None:
        from opentelemetry import trace

        turn = self._turn(state, event)
        span = self._tracer.start_span(
            "turnstile.attempt",
            context=trace.set_span_in_context(turn),
            start_time=_ns(event.occurred_at),
            attributes={
                "turnstile.attempt": event.attempt,
                "turnstile.run_id": event.run_id,
                "gen_ai.request.model": event.model,
            },
        )
        self._runs[event.run_id] = _Run(span, event.model, event.occurred_at)

    def _child(self, run_id: str, name: str, start_ms: int, kind: Any, attributes: Mapping[str, Any]) -> Span | None:
        from opentelemetry import trace

        run = self._runs.get(run_id)
        if run is None:
            return None
        return self._tracer.start_span(
            name,
            context=trace.set_span_in_context(run.span),
            kind=kind,
            start_time=_ns(start_ms),
            attributes=attributes,
        )

    def _model_call(self, event: ModelResponded | ProtocolFailure) -> None:
        from opentelemetry.trace import SpanKind

        run = self._runs.get(event.run_id)
        if run is None:
            return
        attributes = self._chat_attributes(run)
        attributes["gen_ai.response.model"] = event.model
        attributes["turnstile.iteration"] = event.iteration
        if (usage := event.usage) is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.input_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.output_tokens
            attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_input_tokens
            attributes["gen_ai.usage.cache_creation.input_tokens"] = usage.cache_write_tokens
        if isinstance(event, ModelResponded):
            attributes["gen_ai.response.finish_reasons"] = (event.finish_reason,)
        else:
            attributes["error.type"] = event.kind
            run.failed_call_shown = True
        if event.cost_usd is not None:
            attributes["turnstile.cost_usd"] = event.cost_usd
        span = self._child(event.run_id, f"chat {run.model}", run.last_at, SpanKind.CLIENT, attributes)
        if span is not None:
            if isinstance(event, ProtocolFailure):
                _fail(span, f"{event.kind}: {event.detail}")
            span.end(end_time=_ns(event.occurred_at))

    def _if_a_failed_request(self, run_id: str, reason: str, at_ms: int) -> None:
        kind = error_kind_of(reason)  # `ProviderError`'s text: a failed request
        if kind is not None:
            self._failed_call(run_id, kind, reason, at_ms)

    def _failed_call(self, run_id: str, error_type: str, description: str, at_ms: int) -> None:
        """A model request that got no reply (timeout, refusal, 5xx...), told by the event
        that followed it: the fallback it caused or the attempt's failure."""
        from opentelemetry.trace import SpanKind

        run = self._runs.get(run_id)
        if run is None or run.failed_call_shown:
            return
        attributes = {**self._chat_attributes(run), "error.type": error_type}
        span = self._child(run_id, f"chat {run.model}", run.last_at, SpanKind.CLIENT, attributes)
        if span is not None:
            _fail(span, description)
            span.end(end_time=_ns(at_ms))

    def _chat_attributes(self, run: _Run) -> dict[str, Any]:
        family = self._family_of(run.model)
        return {
            "gen_ai.operation.name": "chat",
            "gen_ai.system": family,
            "gen_ai.provider.name": family,
            "gen_ai.request.model": run.model,
        }

    def _tool_started(self, event: ToolCallStarted) -> None:
        from opentelemetry.trace import SpanKind

        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": event.tool,
            "gen_ai.tool.call.id": event.call_id,
            "turnstile.side_effect": event.side_effect,
        }
        span = self._child(event.run_id, f"execute_tool {event.tool}", event.occurred_at, SpanKind.INTERNAL, attributes)
        if span is not None:
            self._tools[(event.run_id, event.call_id)] = span

    def _tool_finished(self, event: ToolCallFinished) -> None:
        span = self._tools.pop((event.run_id, event.call_id), None)
        if span is None:
            return
        if not event.ok:
            _fail(span, event.result[:200])
        span.end(end_time=_ns(event.occurred_at))

    def _end_run(self, run_id: str, at_ms: int, error: str | None = None) -> None:
        run = self._runs.pop(run_id, None)
        for key in [k for k in self._tools if k[0] == run_id]:
            self._tools.pop(key).end(end_time=_ns(at_ms))  # started, never finished
        if run is None:
            return
        if error is not None:
            _fail(run.span, error)
        run.span.end(end_time=_ns(at_ms))

    def _outcome(self, event: Any) -> None:
        kind = event.type.removeprefix("Turn").lower()
        error = event.error if isinstance(event, TurnFailed) else None
        self._end_run(event.run_id, event.occurred_at, error)
        span = self._turns.pop(event.turn_id, None)
        if span is None:
            return
        span.set_attribute("turnstile.outcome", kind)
        if error is not None:
            _fail(span, error)
        span.end(end_time=_ns(event.occurred_at))


def _fail(span: Span, description: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description))

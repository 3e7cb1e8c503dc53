"""Prometheus metrics of a worker, served on its HTTP port at `/metrics`.

They are observed on the log as the worker folds it, once per event this worker treats as
new (at or past the committed offset; the same rule as the outcome records), so a replay
after a restart does not count history twice within one process:

* `turnstile_turns_total{outcome}`: terminal outcomes (completed, failed, paused, exhausted)
* `turnstile_turn_failures_total{reason}`: the failed ones by why: `refusal` (the model
  declined), `content_filter` (the provider's filter stopped the reply), `error` (anything
  else: a provider down past its retries, a rejected request, an internal error)
* `turnstile_claim_latency_seconds{kind}`: from an input's `occurred_at` to its turn's claim
* `turnstile_turn_iterations`, `turnstile_turn_cost_usd`, `turnstile_turn_duration_seconds`:
  per finished turn, from its outcome's metrics; `turnstile_cost_usd_total` sums the cost
  (`turnstile_turns_unpriced_total` counts turns whose cost is unknown)
* `turnstile_dead_letters_total{reason}`: values sent to the dead-letter topic
* `turnstile_effects_skipped_total{topic}`: one-time writes (outcome records, dead letters)
  the log refused for good (too large for the topic...), each marked on the dead-letter topic
* `turnstile_snapshots_ignored_total`: conversations found on assignment whose snapshots do
  not decode (each is replayed from the events instead)
* `turnstile_messages_rejected_total`: refusals of the double-text policy
* `turnstile_scheduled_inputs_total{schedule}`: occurrences the scheduler published
* `turnstile_consumer_lag{partition}`: end offset minus the worker's position, per owned
  partition, when the end offset is known (computed at scrape time)
* `turnstile_model_tokens_total{model,kind}`: tokens of every model response on the log, by
  kind (input, cached_input, cache_write, output, reasoning; the parts are also in the totals)
* `turnstile_provider_request_seconds{family,result}` and
  `turnstile_provider_errors_total{family,kind}`: every request this worker's provider made
  (retries of the transport included), timed where it is made: result `ok`, the error kind, or
  `cancelled` for one the turn stopped waiting for (its deadline, an interruption, a revoke;
  not counted as an error), or `internal` for a call of another provider that raised
  something else than a `ProviderError` (a bug of its own)

Each `Metrics` has its own registry, so several workers in one process (tests) do not mix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from turnstile.events import (
    OUTCOME_TYPES,
    AttemptStarted,
    Event,
    FallbackEngaged,
    MessageRejected,
    ModelResponded,
    ProtocolFailure,
    TurnClaimed,
    TurnFailed,
    TurnInterrupted,
)
from turnstile.handlers.provider import (
    ModelReply,
    ModelRequest,
    ProtocolFamily,
    Provider,
    ProviderError,
    ReplyStream,
)
from turnstile.projections import ConversationState
from turnstile.streams.provider_http import CANCELLED, HttpProvider

# Per owned partition, records of the events topic not yet consumed (what the worker knows).
LagSource = Callable[[], dict[int, int]]

CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_ASKED = 100_000  # turns in flight whose asked-for model is remembered
_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 10, 30, 60, 300)
_ITERATION_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_COST_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)
_DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 900)


class _LagCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "turnstile_consumer_lag",
            "Records of the events topic not yet consumed, per owned partition (end offset - position)",
            labels=["partition"],
        )
        lag = self.metrics.lag
        if lag is not None:
            for partition, records in sorted(lag().items()):
                family.add_metric([str(partition)], records)
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lag: LagSource | None = None
        # Conversation -> the model its turn in flight asked for last (until its outcome).
        self._asked: dict[str, str] = {}
        r = self.registry
        self.turns = Counter("turnstile_turns", "Terminal outcomes of turns", ["outcome"], registry=r)
        self.failures = Counter("turnstile_turn_failures", "Failed turns, by why", ["reason"], registry=r)
        self.claim_latency = Histogram(
            "turnstile_claim_latency_seconds",
            "From an input's occurred_at to the claim of the turn that takes it",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.iterations = Histogram(
            "turnstile_turn_iterations", "Model iterations of a finished turn", buckets=_ITERATION_BUCKETS, registry=r
        )
        self.cost = Histogram("turnstile_turn_cost_usd", "Cost of a finished turn", buckets=_COST_BUCKETS, registry=r)
        self.cost_total = Counter("turnstile_cost_usd", "Cost of every finished turn", registry=r)
        self.unpriced = Counter("turnstile_turns_unpriced", "Finished turns whose cost is unknown", registry=r)
        self.duration = Histogram(
            "turnstile_turn_duration_seconds", "Claim to outcome", buckets=_DURATION_BUCKETS, registry=r
        )
        self.dead_letters = Counter(
            "turnstile_dead_letters", "Values sent to the dead-letter topic", ["reason"], registry=r
        )
        self.effects_skipped = Counter(
            "turnstile_effects_skipped", "One-time writes the log refused for good", ["topic"], registry=r
        )
        self.snapshots_ignored = Counter(
            "turnstile_snapshots_ignored", "Conversations whose snapshots did not decode on assignment", registry=r
        )
        self.rejected = Counter("turnstile_messages_rejected", "Refusals of the double-text policy", registry=r)
        self.scheduled = Counter(
            "turnstile_scheduled_inputs", "Occurrences published by the scheduler", ["schedule"], registry=r
        )
        self.tokens = Counter(
            "turnstile_model_tokens", "Tokens of model responses, by kind", ["model", "kind"], registry=r
        )
        self.provider_seconds = Histogram(
            "turnstile_provider_request_seconds",
            "Model requests, from sending to the reply or the final error",
            ["family", "result"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.provider_errors = Counter(
            "turnstile_provider_errors", "Model requests that failed, by kind", ["family", "kind"], registry=r
        )
        r.register(_LagCollector(self))

    def report_lag(self, lag: LagSource) -> None:
        """Where the lag gauge reads the consumer lag at scrape time."""
        self.lag = lag

    def measured(self, provider: Provider) -> Provider:
        """`provider` with every request timed and counted here: an HTTP provider's each
        HTTP request (retries within a call included, the waits between them not), any other
        provider's each call. The provider itself is left as it is: it may serve others."""

        # (one measured by other metrics is measured here instead, not counted twice)
        return MeasuredProvider(provider.inner if isinstance(provider, MeasuredProvider) else provider, self)

    def on_request(self, family: ProtocolFamily, result: str, seconds: float) -> None:
        if result not in ("ok", CANCELLED):  # a request stopped by its caller is no provider's error
            self.provider_errors.labels(family, result).inc()
        self.provider_seconds.labels(family, result).observe(seconds)

    def on_event(self, state: ConversationState, event: Event) -> None:
        """Called after `event` was folded into `state`."""
        if isinstance(event, AttemptStarted | FallbackEngaged):
            # Tokens are counted under the model asked for, as they are priced: the name a
            # reply gives (a dated variant, a gateway's pick) would make a series per name.
            if len(self._asked) >= MAX_ASKED:  # turns moved away mid-way leave theirs: bounded
                self._asked.clear()
            self._asked[event.conversation_id] = event.model if isinstance(event, AttemptStarted) else event.to_model
        elif isinstance(event, TurnInterrupted):
            self._asked.pop(event.conversation_id, None)
        if isinstance(event, TurnClaimed):
            active = state.active
            for item in active.inputs if active is not None else ():
                self.claim_latency.labels(item.kind).observe(max(0, event.occurred_at - item.occurred_at) / 1000)
        elif isinstance(event, OUTCOME_TYPES):
            self._asked.pop(event.conversation_id, None)
            self.turns.labels(event.type.removeprefix("Turn").lower()).inc()
            if isinstance(event, TurnFailed):
                self.failures.labels(event.reason or "error").inc()
            self.iterations.observe(event.metrics.iterations)
            self.duration.observe(event.metrics.duration_ms / 1000)
            if event.metrics.cost_usd is None:
                self.unpriced.inc()
            else:
                self.cost.observe(event.metrics.cost_usd)
                self.cost_total.inc(event.metrics.cost_usd)
        elif isinstance(event, MessageRejected):
            self.rejected.inc()
        elif isinstance(event, ModelResponded | ProtocolFailure) and (usage := event.usage) is not None:
            # (a ProtocolFailure has usage when the provider billed a reply that was unusable)
            for kind, tokens in (
                ("input", usage.input_tokens),
                ("cached_input", usage.cached_input_tokens),
                ("cache_write", usage.cache_write_tokens),
                ("output", usage.output_tokens),
                ("reasoning", usage.reasoning_tokens),
            ):
                if tokens:
                    self.tokens.labels(self._asked.get(event.conversation_id, event.model), kind).inc(tokens)

    def on_dead_letter(self, reason: str) -> None:
        self.dead_letters.labels(reason).inc()

    def on_snapshots_ignored(self, conversations: int) -> None:
        self.snapshots_ignored.inc(conversations)

    def on_effect_skipped(self, topic: str) -> None:
        self.effects_skipped.labels(topic).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# The result of a call of a provider (not the HTTP transport) that raised something else
# than a `ProviderError`: its own bug, which the turn records as an internal error.
INTERNAL = "internal"


class MeasuredProvider:
    """A provider whose every request is timed and counted, here and not by whatever else
    shares it: an `HttpProvider` tells these metrics of each of its HTTP requests, any
    other provider is timed per call."""

    def __init__(self, inner: Provider, metrics: Metrics) -> None:
        self.inner = inner
        self._metrics = metrics
        self._http = inner if isinstance(inner, HttpProvider) else None

    @property
    def family(self) -> ProtocolFamily:
        return self.inner.family

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        if self._http is not None:
            return await self._http.complete(request, stream, on_request=self._metrics.on_request)
        started = time.monotonic()
        result = "ok"
        try:
            return await self.inner.complete(request, stream)
        except ProviderError as err:
            result = err.kind
            raise
        except asyncio.CancelledError:
            result = CANCELLED
            raise
        except Exception:
            result = INTERNAL  # the provider's own bug: the turn records it as an internal error
            raise
        finally:
            self._metrics.on_request(self.family, result, time.monotonic() - started)

    async def aclose(self) -> None:
        await self.inner.aclose()

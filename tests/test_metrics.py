"""Prometheus metrics, scraped after turns: outcomes, claim latency, iterations, cost,
dead letters, refusals and consumer lag."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
from builders import claim, message, started
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from prometheus_client.parser import text_string_to_metric_families
from worker_harness import FAST, events_of, until

from turnstile.events import TurnCompleted, encode
from turnstile.handlers.claim import DoubleTextPolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.handlers.turn_settings import Route
from turnstile.streams.file_log import FileLog
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import Topics
from turnstile.streams.metrics import Metrics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker, WorkerConfig

NOW = SystemClock().now_ms


def scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_after_turns_a_dead_letter_and_a_refusal(tmp_path):
    log = FileLog(tmp_path)
    metrics = Metrics()
    config: WorkerConfig = dataclasses.replace(FAST, double_text=DoubleTextPolicy("reject"))
    worker = Worker(log, ScriptedProvider(delay_s=0.5), config, metrics=metrics)
    # A turn whose owner died mid-attempt: this worker retries it (a second completed turn).
    dead = claim(["d1"], NOW(), 0, run_id="dead-run", conv="other")
    for event in (message("d1", NOW(), conv="other"), dead, started(dead, NOW())):
        await log.append(log.topics.events, "other", encode(event))
    await log.append(log.topics.events, "c1", b"not json at all")

    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        sent_at = NOW()
        await publish(log, message_event("c1", "check the dates", sent_at, "m1"))
        await until(lambda: "c1" in worker.states and worker.states["c1"].active is not None)
        await publish(log, message_event("c1", "and this?", NOW(), "m2"))  # refused: a turn is active
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
        await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "other")))
        await until(lambda: not worker.runners)
        samples = scrape(metrics)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)

    assert samples[("turnstile_turns_total", (("outcome", "completed"),))] == 2.0
    assert samples[("turnstile_claim_latency_seconds_count", (("kind", "message"),))] == 2.0
    # FAST debounces for 100 ms: the claim came no sooner, and well within the 3 s bound.
    latency = samples[("turnstile_claim_latency_seconds_sum", (("kind", "message"),))]
    assert 0.0 <= latency < 6.0
    assert samples[("turnstile_turn_iterations_count", ())] == 2.0
    assert samples[("turnstile_turn_iterations_sum", ())] == 2.0
    assert samples[("turnstile_turn_cost_usd_count", ())] + samples[("turnstile_turns_unpriced_total", ())] == 2.0
    assert samples[("turnstile_turn_duration_seconds_count", ())] == 2.0
    assert samples[("turnstile_dead_letters_total", (("reason", "not_json"),))] == 1.0
    assert samples[("turnstile_messages_rejected_total", ())] == 1.0
    lags = {labels: v for (name, labels), v in samples.items() if name == "turnstile_consumer_lag"}
    assert set(lags) == {(("partition", str(p)),) for p in range(log.partitions)}
    assert all(v == 0 for v in lags.values())


async def test_consumer_lag_is_end_offset_minus_position(tmp_path):
    log = FileLog(tmp_path, partitions=2)
    worker = Worker(log, ScriptedProvider(), FAST, metrics=Metrics())
    assert worker.consumer_lag() == {}  # nothing assigned yet
    for i in range(5):
        await publish(log, message_event("c1", f"text {i}", NOW(), f"m{i}"))
    await log.start(worker)  # assigned, nothing consumed yet
    mine = log.partition_for("c1")
    assert worker.consumer_lag() == {mine: 5, 1 - mine: 0}
    await publish(log, message_event("c1", "one more", NOW(), "m5"))
    assert worker.consumer_lag()[mine] == 6  # the end is the log's, read when asked
    await log.stop()


@pytest.mark.kafka
async def test_metrics_of_a_worker_on_kafka(kafka_bootstrap: str, fresh_topics: Topics):  # noqa: F811
    group = f"g-{uuid.uuid4().hex[:8]}"
    metrics = Metrics()
    worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(), FAST, metrics=metrics)
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.start_producer()
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await publish(publisher, message_event("k1", "hello", NOW(), "m1"))
        deadline = asyncio.get_running_loop().time() + 60
        while scrape(metrics).get(("turnstile_turns_total", (("outcome", "completed"),))) != 1.0:
            assert asyncio.get_running_loop().time() < deadline and not task.done(), "no completed turn in time"
            await asyncio.sleep(0.2)
        # Lag is reported for owned partitions once the consumer has seen their high watermark.
        while not (lags := worker.consumer_lag()):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.2)
        assert all(v >= 0 for v in lags.values()) and set(lags) <= set(range(8))
        samples = scrape(metrics)
        assert any(name == "turnstile_consumer_lag" for name, _ in samples)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await publisher.producer.stop()


async def _scraped_after_one_turn(
    tmp_path, *replies, outcome: str, retries: int = 0, fallback: bool = False, deadline_ms: int | None = None
) -> dict:
    """The worker's metrics once it has folded the outcome of one turn the model `replies` to
    (`fallback`: a second model, `gpt-backup`, served by the same provider, as `turnstile run`
    builds its fallbacks)."""
    from provider_server import ProviderServer

    from turnstile.handlers.pricing import ModelPrice
    from turnstile.handlers.providers.openai_chat import OpenAIChat
    from turnstile.handlers.retry import RetryPolicy
    from turnstile.streams.provider_http import HttpProvider

    log = FileLog(tmp_path)
    metrics = Metrics()
    turn = dataclasses.replace(FAST.turn, model="gpt-test", prices={"gpt-test": ModelPrice(1.0, 2.0)})
    if deadline_ms is not None:
        turn = dataclasses.replace(turn, budget=dataclasses.replace(turn.budget, deadline_ms=deadline_ms))
    with ProviderServer() as server:
        server.push(*replies)
        provider = HttpProvider(OpenAIChat(), server.base_url_openai, "k", retry=RetryPolicy(max_retries=retries))
        if fallback:
            turn = dataclasses.replace(turn, fallbacks=(Route("gpt-backup", provider),))
        worker = Worker(log, provider, dataclasses.replace(FAST, turn=turn), metrics=metrics)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            await publish(log, message_event("c1", "hi", NOW(), "m1"))
            # On the log is not yet folded by the worker, which counts what it folds.
            folded = ("turnstile_turns_total", (("outcome", outcome),))
            await until(lambda: folded in scrape(metrics))
            return scrape(metrics)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            await provider.aclose()


async def test_provider_requests_errors_and_tokens_by_kind(tmp_path):
    from provider_server import Raw, Reply

    replies = (Raw(503, {"error": {"message": "busy"}}), Reply(text="fine", usage=(40, 6)))
    samples = await _scraped_after_one_turn(tmp_path, *replies, outcome="completed")

    timed = "turnstile_provider_request_seconds_count"
    assert samples[("turnstile_provider_errors_total", (("family", "openai"), ("kind", "server_error")))] == 1
    assert samples[(timed, (("family", "openai"), ("result", "ok")))] == 1
    assert samples[(timed, (("family", "openai"), ("result", "server_error")))] == 1
    assert samples[("turnstile_model_tokens_total", (("kind", "input"), ("model", "gpt-test")))] == 40
    assert samples[("turnstile_model_tokens_total", (("kind", "output"), ("model", "gpt-test")))] == 6


async def test_every_http_request_is_counted_and_timed_its_retries_within_a_call_included(tmp_path):
    # Given a provider that answers 503 twice (asking for a 1 ms wait) before it answers,
    # within one model call of the transport's retries
    from provider_server import Raw, Reply

    busy = Raw(503, {"error": {"message": "busy"}}, {"retry-after-ms": "1"})
    samples = await _scraped_after_one_turn(tmp_path, busy, busy, Reply(text="fine"), outcome="completed", retries=2)
    # Then the three requests the server had are counted, not the one call
    timed = "turnstile_provider_request_seconds_count"
    assert samples[("turnstile_provider_errors_total", (("family", "openai"), ("kind", "server_error")))] == 2
    assert samples[(timed, (("family", "openai"), ("result", "server_error")))] == 2
    assert samples[(timed, (("family", "openai"), ("result", "ok")))] == 1


async def test_a_request_the_turns_deadline_cut_short_is_timed_as_cancelled_and_is_no_provider_error(tmp_path):
    # Given a model that answers after 2 s and a turn with 0.3 s to live
    from provider_server import Delay, Reply

    samples = await _scraped_after_one_turn(tmp_path, Delay(2.0, Reply(text="late")), outcome="paused", deadline_ms=300)
    # Then the request is on the timing histogram as cancelled, and no error is counted
    timed = "turnstile_provider_request_seconds_count"
    assert samples[(timed, (("family", "openai"), ("result", "cancelled")))] == 1
    assert not [name for name, _ in samples if name == "turnstile_provider_errors_total"]


async def test_a_call_of_another_provider_its_caller_stops_waiting_for_is_timed_as_cancelled_not_ok():
    from turnstile.handlers.provider import ChatMessage, ModelRequest
    from turnstile.handlers.providers.scripted import Scripted, echo_reply

    metrics = Metrics()
    slow = metrics.measured(ScriptedProvider(lambda request: Scripted(echo_reply(request), delay_s=30.0)))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await slow.complete(ModelRequest(model="scripted-1", messages=(ChatMessage("user", "hi"),)))
    timed = {labels: n for (name, labels), n in scrape(metrics).items() if name.endswith("request_seconds_count")}
    assert timed == {(("family", "scripted"), ("result", "cancelled")): 1}


async def test_a_call_of_another_provider_that_raises_a_bug_of_its_own_is_an_internal_error_not_ok():
    from turnstile.handlers.provider import ChatMessage, ModelRequest

    def broken(request: ModelRequest) -> str:
        raise KeyError("choices")

    metrics = Metrics()
    with pytest.raises(KeyError):
        await metrics.measured(ScriptedProvider(broken)).complete(
            ModelRequest(model="scripted-1", messages=(ChatMessage("user", "hi"),))
        )
    samples = scrape(metrics)
    assert samples[("turnstile_provider_request_seconds_count", (("family", "scripted"), ("result", "internal")))] == 1
    assert samples[("turnstile_provider_errors_total", (("family", "scripted"), ("kind", "internal")))] == 1


async def test_the_requests_of_a_fallback_model_are_counted_too(tmp_path):
    from provider_server import Raw, Reply

    replies = (Raw(500, {"error": {"message": "down"}}), Reply(text="fine", usage=(4, 1)))
    samples = await _scraped_after_one_turn(tmp_path, *replies, outcome="completed", fallback=True)

    timed = "turnstile_provider_request_seconds_count"
    assert samples[(timed, (("family", "openai"), ("result", "server_error")))] == 1  # gpt-test's
    assert samples[(timed, (("family", "openai"), ("result", "ok")))] == 1  # gpt-backup's


async def test_tokens_are_counted_under_the_model_asked_for_not_the_name_a_reply_gives(tmp_path):
    # A gateway answering under a dated or routed name would make a series per name.
    from provider_server import Reply

    reply = Reply(text="fine", usage=(40, 6), model="gpt-test-2026-c7cdf6")
    samples = await _scraped_after_one_turn(tmp_path, reply, outcome="completed")

    tokens = {labels for name, labels in samples if name == "turnstile_model_tokens_total"}
    assert tokens == {(("kind", "input"), ("model", "gpt-test")), (("kind", "output"), ("model", "gpt-test"))}


async def test_a_refused_turn_is_counted_as_a_failure_by_its_reason(tmp_path):
    # (an operator alerting on the refusal rate had nothing to read it from: failed and ok only)
    from provider_server import Raw
    from wire_harness import fixture

    samples = await _scraped_after_one_turn(tmp_path, Raw(200, fixture("openai", "refusal")), outcome="failed")

    assert samples[("turnstile_turn_failures_total", (("reason", "refusal"),))] == 1
    assert samples[("turnstile_turns_total", (("outcome", "failed"),))] == 1


async def test_the_tokens_of_a_malformed_reply_the_provider_billed_are_counted(tmp_path):
    from provider_server import Raw

    billed = {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}}
    samples = await _scraped_after_one_turn(tmp_path, Raw(200, billed), outcome="failed")

    assert samples[("turnstile_model_tokens_total", (("kind", "input"), ("model", "gpt-test")))] == 30
    assert samples[("turnstile_model_tokens_total", (("kind", "output"), ("model", "gpt-test")))] == 2


async def test_two_metrics_measuring_one_http_provider_each_count_only_their_own_requests():
    # (one provider shared by two workers of a process: the second's metrics took every request)
    from provider_server import ProviderServer, Reply

    from turnstile.handlers.provider import ChatMessage, ModelRequest
    from turnstile.handlers.providers.openai_chat import OpenAIChat
    from turnstile.streams.provider_http import HttpProvider

    request = ModelRequest(model="gpt-test", messages=(ChatMessage("user", "hi"),))
    timed = ("turnstile_provider_request_seconds_count", (("family", "openai"), ("result", "ok")))
    with ProviderServer() as server:
        server.push(Reply(text="one"), Reply(text="two"), Reply(text="three"))
        shared = HttpProvider(OpenAIChat(), server.base_url_openai, "test-key")
        first, second = Metrics(), Metrics()
        by_first, by_second = first.measured(shared), second.measured(shared)
        try:
            await by_first.complete(request)
            await by_second.complete(request)
            await by_second.complete(request)
        finally:
            await shared.aclose()
    assert (scrape(first)[timed], scrape(second)[timed]) == (1, 2)
    # Measured again by other metrics, it counts there alone from then on.
    third = Metrics()
    with ProviderServer() as server:
        server.push(Reply(text="four"))
        shared = HttpProvider(OpenAIChat(), server.base_url_openai, "test-key")
        try:
            await third.measured(first.measured(shared)).complete(request)
        finally:
            await shared.aclose()
    assert (scrape(first)[timed], scrape(third)[timed]) == (1, 1)

"""OpenTelemetry spans, checked with the SDK's in-memory exporter: one turn with a tool call,
through the real worker on the embedded log and the loopback provider, published inside a
span of the test's own (the publisher's trace context travels in the record's headers)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from loop_harness import ATTEMPTS_ONLY, World, config, outcomes, settings
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from provider_server import ProviderServer, Raw, Reply
from worker_harness import FAST, running, serving, until

from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.handlers.turn_settings import Route
from turnstile.streams.file_log import FileLog
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.publisher import KafkaPublisher, message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker

NOW = SystemClock().now_ms


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def traced_turn(
    tmp_path, spans, script, fallback: str | None = None, **overrides
) -> tuple[list[ReadableSpan], ReadableSpan]:
    provider, exporter = spans
    exporter.clear()
    world = World(log=FileLog(tmp_path))
    with ProviderServer() as server:
        server.push(*script)
        http = HttpProvider(OpenAIChat(), server.base_url_openai, "test-key", retry=ATTEMPTS_ONLY)
        fallbacks = [Route(fallback, http)] if fallback else []
        traced = dataclasses.replace(config(settings(world, fallbacks=fallbacks, **overrides)), tracing=True)
        async with running(world.log, http, traced, tracer_provider=provider):
            with provider.get_tracer("test").start_as_current_span("publish message") as publishing:
                await publish(world.log, message_event("c1", "compare the fares", NOW(), "m1"))
            await outcomes(world.log, 1)
        await http.aclose()
    finished = [s for s in exporter.get_finished_spans() if s.name != "publish message"]
    [root] = [s for s in exporter.get_finished_spans() if s.name == "publish message"]
    assert publishing.get_span_context().span_id == root.context.span_id
    return finished, root


def tracer_on_a_new_conversation(spans):  # type: ignore[no-untyped-def]
    """A tracer fed by hand (no worker), its conversation's state, and the exporter, cleared."""
    from turnstile.projections import new_state
    from turnstile.streams.tracing import TurnTracer

    provider, exporter = spans
    exporter.clear()
    return TurnTracer(lambda _model: "openai", provider), new_state("conv-1"), exporter


def folded(tracer, state, *events) -> None:  # type: ignore[no-untyped-def]
    """Each event folded, as the worker folds it, then told to the tracer."""
    from turnstile.projections import apply_event

    for event in events:
        assert apply_event(state, event) is None, event
        tracer.on_event(state, event)


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    return sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
        key=lambda s: s.start_time,
    )


async def test_a_turn_with_a_tool_call_yields_the_span_tree_with_genai_attributes(tmp_path, spans):
    script = [
        Reply(tool_calls=[("call_1", "search", '{"q": "fares"}')], usage=(30, 5)),
        Reply(text="The 9th is cheaper.", usage=(60, 8)),
    ]
    finished, root = await traced_turn(tmp_path, spans, script)

    [turn] = children(finished, root)  # the publisher's span is the turn's parent
    [attempt] = children(finished, turn)
    first, tool, second = children(finished, attempt)
    assert (turn.name, attempt.name) == ("turnstile.turn", "turnstile.attempt")
    assert (first.name, tool.name, second.name) == ("chat gpt-test", "execute_tool search", "chat gpt-test")
    assert len(finished) == 5 and {s.context.trace_id for s in finished} == {root.context.trace_id}
    assert dict(turn.attributes) == {
        "turnstile.conversation_id": "c1",
        "turnstile.turn_id": turn.attributes["turnstile.turn_id"],
        "turnstile.inputs": 1,
        "turnstile.outcome": "completed",
    }
    assert (attempt.attributes["turnstile.attempt"], attempt.attributes["gen_ai.request.model"]) == (1, "gpt-test")
    assert first.kind == SpanKind.CLIENT
    assert {k: first.attributes[k] for k in first.attributes if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "openai",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-test",
        "gen_ai.response.model": "gpt-test",
        "gen_ai.usage.input_tokens": 30,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.usage.cache_read.input_tokens": 0,
        "gen_ai.usage.cache_creation.input_tokens": 0,
        "gen_ai.response.finish_reasons": ("tool_calls",),
    }
    assert first.attributes["turnstile.cost_usd"] == pytest.approx((30 * 1.0 + 5 * 2.0) / 1e6)
    assert second.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert (tool.attributes["gen_ai.tool.name"], tool.attributes["gen_ai.tool.call.id"]) == ("search", "call_1")
    # In order and nested in time: the model, then the tool, then the model again.
    assert turn.start_time <= attempt.start_time <= first.start_time <= first.end_time <= tool.start_time
    assert tool.end_time <= second.start_time <= second.end_time <= attempt.end_time <= turn.end_time
    assert all(s.status.status_code == StatusCode.UNSET for s in finished)


async def test_an_invalid_call_runs_no_tool_and_a_refused_reply_fails_the_turn_span(tmp_path, spans):
    script = [Reply(tool_calls=[("call_1", "search", '{"q": 7}')]), Reply(text="")]
    finished, root = await traced_turn(tmp_path, spans, script)
    [turn] = children(finished, root)
    # An invalid call never runs: no tool span; the reply after it completes the turn.
    assert [s.name for s in children(finished, children(finished, turn)[0])] == ["chat gpt-test", "chat gpt-test"]

    refused = [Reply(text=None, finish_reason="content_filter")]
    finished, root = await traced_turn(tmp_path / "2", spans, refused)
    [turn] = children(finished, root)
    assert turn.status.status_code == StatusCode.ERROR and turn.attributes["turnstile.outcome"] == "failed"
    assert "content filter" in (turn.status.description or "")


async def test_a_billed_reply_that_could_not_be_used_is_a_failed_chat_span_with_its_usage(tmp_path, spans):
    billed = Raw(200, {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 2}})
    finished, root = await traced_turn(tmp_path, spans, [billed])
    [turn] = children(finished, root)
    [chat] = children(finished, children(finished, turn)[0])
    assert chat.name == "chat gpt-test" and chat.status.status_code == StatusCode.ERROR
    assert chat.status.description == "malformed_response: choices is empty"
    assert (chat.attributes["gen_ai.usage.input_tokens"], chat.attributes["gen_ai.usage.output_tokens"]) == (30, 2)
    assert chat.attributes["error.type"] == "malformed_response"
    assert chat.attributes["turnstile.cost_usd"] == pytest.approx((30 * 1.0 + 2 * 2.0) / 1e6)


async def test_a_request_that_got_no_reply_is_a_failed_chat_span_and_the_retry_its_own(tmp_path, spans):
    script = [Raw(500, {"error": {"message": "upstream", "type": "server_error"}}), Reply(text="ok", usage=(9, 1))]
    finished, root = await traced_turn(tmp_path, spans, script, max_attempts=2, backoff_base_ms=1)
    [turn] = children(finished, root)
    first, second = children(finished, turn)
    [failed] = children(finished, first)
    assert failed.name == "chat gpt-test" and failed.status.status_code == StatusCode.ERROR
    assert failed.attributes["error.type"] == "server_error" and "upstream" in (failed.status.description or "")
    assert not any(name.startswith("gen_ai.usage") for name in failed.attributes)  # nothing was billed
    assert first.start_time <= failed.start_time <= failed.end_time <= first.end_time
    [answered] = children(finished, second)
    assert answered.status.status_code == StatusCode.UNSET and turn.attributes["turnstile.outcome"] == "completed"


async def test_a_request_whose_retry_would_pass_the_deadline_is_a_failed_chat_span_of_the_paused_turn(
    tmp_path, spans
):
    from turnstile.handlers.budget import TurnBudget

    script = [Raw(500, {"error": {"message": "upstream"}})]
    overrides = {"max_attempts": 2, "backoff_base_ms": 60_000, "backoff_max_ms": 60_000,
                 "budget": TurnBudget(deadline_ms=5_000)}  # fmt: skip
    finished, root = await traced_turn(tmp_path, spans, script, **overrides)
    [turn] = children(finished, root)
    assert turn.attributes["turnstile.outcome"] == "paused"
    [failed] = children(finished, children(finished, turn)[0])
    assert failed.name == "chat gpt-test" and failed.attributes["error.type"] == "server_error"


async def test_a_request_a_fallback_model_took_over_is_a_failed_chat_span_beside_the_fallbacks(tmp_path, spans):
    script = [Raw(500, {"error": {"message": "upstream"}}), Reply(text="ok", usage=(9, 1))]
    finished, root = await traced_turn(tmp_path, spans, script, fallback="gpt-backup")
    [turn] = children(finished, root)
    [attempt] = children(finished, turn)  # one attempt: the fallback continued it
    failed, answered = children(finished, attempt)
    assert (failed.name, answered.name) == ("chat gpt-test", "chat gpt-backup")
    assert failed.status.status_code == StatusCode.ERROR and failed.attributes["error.type"] == "server_error"
    assert answered.status.status_code == StatusCode.UNSET and answered.start_time >= failed.end_time


async def test_a_malformed_reply_that_was_not_billed_is_a_failed_chat_span_once(tmp_path, spans):
    finished, root = await traced_turn(tmp_path, spans, [Raw(200, {"choices": []})])
    [turn] = children(finished, root)
    [chat] = children(finished, children(finished, turn)[0])  # once: not again for the attempt's failure
    assert chat.attributes["error.type"] == "malformed_response" and chat.status.status_code == StatusCode.ERROR
    assert not any(name.startswith("gen_ai.usage") for name in chat.attributes)


async def test_a_message_posted_over_http_continues_the_callers_trace(tmp_path, spans):
    provider, exporter = spans
    exporter.clear()
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # the caller's span, not ours
    worker = Worker(FileLog(tmp_path), ScriptedProvider(), dataclasses.replace(FAST, tracing=True),
                    tracer_provider=provider)  # fmt: skip
    async with serving(worker) as (_svc, client):
        headers = {"traceparent": caller, "tracestate": "vendor=1"}
        posted = await client.post("/conversations/c1/messages", json={"content": "hi"}, headers=headers)
        assert posted.status_code == 202, posted.text
        await until(lambda: any(s.name == "turnstile.turn" for s in exporter.get_finished_spans()))
    [turn] = [s for s in exporter.get_finished_spans() if s.name == "turnstile.turn"]
    assert turn.parent is not None and format(turn.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert format(turn.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_tracing_is_off_by_default():
    from turnstile.streams.worker import WorkerConfig

    assert WorkerConfig().tracing is False


@pytest.mark.kafka
async def test_on_kafka_the_trace_context_travels_in_the_record_headers(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    worker_log = KafkaLog(kafka_bootstrap, f"g-{uuid.uuid4().hex[:8]}", fresh_topics)
    worker = Worker(worker_log, ScriptedProvider(), dataclasses.replace(FAST, tracing=True), tracer_provider=provider)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with KafkaPublisher(kafka_bootstrap, fresh_topics) as publisher:
            with provider.get_tracer("test").start_as_current_span("publish message"):
                await publisher.publish(message_event("c1", "hi", NOW(), "m1"))
        deadline = asyncio.get_running_loop().time() + 60
        while not [s for s in exporter.get_finished_spans() if s.name == "turnstile.turn"]:
            assert asyncio.get_running_loop().time() < deadline and not task.done(), "no turn span"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)

    records = await read_topic(kafka_bootstrap, fresh_topics.events)
    [published] = [r for r in records if b'"MessageReceived"' in (r.value or b"")]
    assert [name for name, _ in published.headers] == ["traceparent"]
    assert all(r.headers == () for r in records if r is not published)  # the worker's own carry none
    [root] = [s for s in exporter.get_finished_spans() if s.name == "publish message"]
    [turn] = [s for s in exporter.get_finished_spans() if s.name == "turnstile.turn"]
    assert turn.parent is not None and turn.parent.span_id == root.context.span_id


def interrupted(c):  # type: ignore[no-untyped-def]
    from turnstile.events import TurnInterrupted

    return TurnInterrupted(
        event_id="e-i", conversation_id="conv-1", occurred_at=40, turn_id=c.turn_id, run_id=c.run_id, attempt=1,
        message_id="m2",
    )


def test_a_turn_withdrawn_by_a_new_message_ends_its_spans_as_interrupted(spans):
    from builders import claim, message, started

    tracer, state, exporter = tracer_on_a_new_conversation(spans)
    c = claim(["m1"], 20, 0)
    folded(tracer, state, message("m1", 10), c, started(c, 21), message("m2", 30), interrupted(c))
    finished = {s.name: s for s in exporter.get_finished_spans()}
    assert set(finished) == {"turnstile.turn", "turnstile.attempt"}
    assert finished["turnstile.turn"].attributes["turnstile.outcome"] == "interrupted"


def test_a_header_without_a_value_breaks_nothing_and_a_valid_one_beside_it_still_links(spans):
    # Kafka's header values are nullable (`kcat -H traceparent` sends one)
    from builders import claim, message, started

    tracer, state, exporter = tracer_on_a_new_conversation(spans)
    tracer.note_input(message("m0", 5), (("traceparent", None),))  # no context, no error
    valid = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    first = message("m1", 10)
    tracer.note_input(first, (("baggage", None), ("traceparent", valid)))
    c = claim(["m1"], 20, 0)
    folded(tracer, state, first, c, started(c, 21), message("m2", 30), interrupted(c))
    [turn] = [s for s in exporter.get_finished_spans() if s.name == "turnstile.turn"]
    assert format(turn.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"


def test_a_resume_requested_over_http_is_the_parent_of_the_turn_it_starts(spans):
    from builders import claim, completed, message

    from turnstile.events import ResumeRequested

    tracer, state, exporter = tracer_on_a_new_conversation(spans)
    first = claim(["m1"], 20, 0)
    resume = ResumeRequested(
        event_id="e-r", conversation_id="conv-1", occurred_at=50, request_id="r1", resumes_turn_id=first.turn_id,
    )  # fmt: skip
    caller = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    tracer.note_input(resume, (("traceparent", caller),))
    second = claim(["r1"], 60, 2, run_id="run-2")
    folded(tracer, state, message("m1", 10), first, completed(first, 30), resume, second, completed(second, 70))
    turns = {s.attributes["turnstile.turn_id"]: s for s in exporter.get_finished_spans() if s.name == "turnstile.turn"}
    assert turns[first.turn_id].parent is None
    parent = turns[second.turn_id].parent
    assert parent is not None and format(parent.span_id, "016x") == "00f067aa0ba902b7"

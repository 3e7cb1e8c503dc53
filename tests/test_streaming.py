"""Streamed replies end to end: a provider streaming server-sent events (the loopback
server, in each family's wire format), the real worker publishing deltas, the HTTP API
serving them as server-sent events. On the embedded log, and on the real broker with the
worker SIGKILLed mid-reply. The events topic still records each reply once, whole."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fault_audit import check_invariants, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from provider_server import ProviderServer, Raw, Streamed
from stream_client import StreamReader
from wire_harness import stream_fixture
from worker_harness import FAST, client_of, events_of, serving
from worker_process import WorkerProcess, worker_args, worker_env

from turnstile.events import AttemptFailed, ModelResponded, TurnCompleted, decode
from turnstile.events.deltas import decode_delta
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.providers.anthropic_messages import AnthropicMessages
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.retry import RetryPolicy
from turnstile.streams.file_log import FileLog
from turnstile.streams.http_api import HttpServer, build_app
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.reply_hub import ReplyHub
from turnstile.streams.runtime import SystemClock
from turnstile.streams.service import conversation_reader, reply_hub_sources
from turnstile.streams.worker import Worker

NOW = SystemClock().now_ms
PIECES = ["The ", "9th ", "is ", "cheaper ", "by ", "40 ", "euros."]
MODELS = {"openai": "gpt-test", "anthropic": "claude-test"}


@contextlib.asynccontextmanager
async def streaming_service(
    tmp_path: Path, server: ProviderServer, family: str, **settings: object
) -> AsyncIterator[tuple[FileLog, httpx.AsyncClient]]:
    wire = OpenAIChat() if family == "openai" else AnthropicMessages()
    base = server.base_url_openai if family == "openai" else server.base_url_anthropic
    provider = HttpProvider(wire, base, "test-key", timeout_s=10, retry=RetryPolicy(max_retries=0))
    model = MODELS[family]
    turn = dataclasses.replace(FAST.turn, model=model, prices={model: ModelPrice(1.0, 2.0)}, **settings)
    log = FileLog(tmp_path)
    worker = Worker(log, provider, dataclasses.replace(FAST, turn=turn, stream_replies=True))
    try:
        async with serving(worker) as (_svc, client):
            yield log, client
    finally:
        await provider.aclose()


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running:
        yield running


async def post(client: httpx.AsyncClient, text: str, message_id: str, conversation: str = "c1") -> None:
    response = await client.post(
        f"/conversations/{conversation}/messages", json={"message_id": message_id, "content": text}
    )
    assert response.status_code == 202, response.text


@pytest.mark.parametrize("family", ["openai", "anthropic"])
async def test_a_reader_sees_the_deltas_in_order_then_the_outcome(tmp_path, server, family):
    server.push(Streamed(PIECES, gap_s=0.02))
    async with streaming_service(tmp_path, server, family) as (log, client):
        reader = StreamReader()
        reading = asyncio.create_task(reader.read(client, "c1"))
        await reader.connected.wait()
        await post(client, "which day is cheaper?", "m1")
        await asyncio.wait_for(reading, 60)

    assert reader.kinds() == ["delta"] * len(PIECES) + ["outcome"]
    assert [d["text"] for _, d in reader.events[:-1]] == PIECES
    outcome = reader.events[-1][1]
    assert (outcome["type"], outcome["reply"]) == ("TurnCompleted", "".join(PIECES))
    # The durable log: the reply once, whole; no delta on it. The deltas went to their topic.
    events = events_of(log, "c1")
    [responded] = [e for e in events if isinstance(e, ModelResponded)]
    assert responded.text == "".join(PIECES) and server.requests[0].body["stream"] is True
    deltas = [decode_delta(r.value) for r in log.read_all(log.topics.deltas)]
    assert "".join(d.text for d in deltas if d is not None) == "".join(PIECES)


async def test_a_reader_who_joins_mid_reply_gets_the_text_so_far(tmp_path, server):
    server.push(Streamed(PIECES, gap_s=0.2))
    async with streaming_service(tmp_path, server, "openai") as (_log, client):
        early = StreamReader()
        early_task = asyncio.create_task(early.read(client, "c1"))
        await early.connected.wait()
        await post(client, "which day is cheaper?", "m1")
        await early.until(lambda r: r.deltas() >= 3)
        late = StreamReader()
        await asyncio.wait_for(late.read(client, "c1"), 60)
        await asyncio.wait_for(early_task, 60)

    first_kind, first = late.events[0]
    assert (
        first_kind == "delta" and "".join(PIECES).startswith(first["text"]) and len(first["text"]) >= len("The 9th is ")
    )
    assert late.text() == early.text() == "".join(PIECES)
    assert late.events[-1] == early.events[-1]


async def test_a_reply_that_fails_mid_stream_says_so_on_the_stream(tmp_path, server):
    broken = Raw(200, stream_fixture("anthropic", "stream_overloaded"), headers={"content-type": "text/event-stream"})
    server.push(broken)
    async with streaming_service(tmp_path, server, "anthropic", max_attempts=1) as (_log, client):
        reader = StreamReader()
        reading = asyncio.create_task(reader.read(client, "c1"))
        await reader.connected.wait()
        await post(client, "which day is cheaper?", "m1")
        await asyncio.wait_for(reading, 60)

    assert reader.kinds() == ["delta", "restart", "interrupted", "outcome"]
    assert reader.events[2][1]["retryable"] is False
    outcome = reader.events[-1][1]
    assert outcome["type"] == "TurnFailed" and outcome["error"] == "The model provider was overloaded."


async def test_without_streaming_the_stream_endpoint_says_so(tmp_path):
    from turnstile.handlers.providers.scripted import ScriptedProvider

    async with serving(Worker(FileLog(tmp_path), ScriptedProvider(), FAST)) as (_svc, client):
        response = await client.get("/conversations/c1/stream")

    assert response.status_code == 404 and "does not stream" in response.json()["error"]


# -- on the real broker ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def http_api_on_kafka(bootstrap: str, topics: Topics) -> AsyncIterator[httpx.AsyncClient]:
    """The HTTP API in a process of its own (here: the test's), reading the broker: it
    outlives the workers that are killed under it."""
    log = KafkaLog(bootstrap, "unused", topics)
    await log.start_producer()
    hub = ReplyHub()
    following = asyncio.create_task(hub.run(*reply_hub_sources(log, NOW())))
    http = HttpServer(build_app(log, conversation_reader(log), hub=hub), "127.0.0.1", 0)
    try:
        async with client_of(http, timeout_s=30) as client:
            yield client
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await log.producer.stop()


@pytest.mark.kafka
async def test_on_kafka_a_worker_killed_mid_reply_is_reported_and_the_log_keeps_its_shape(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
    server: ProviderServer,
    tmp_path: Path,
) -> None:
    # The first reply streams slowly (its worker dies in it); the retry streams it whole.
    server.push(Streamed(PIECES, gap_s=1.0), Streamed(PIECES, gap_s=0.01))
    tool_dir = tmp_path / "tools"
    tool_dir.mkdir()
    argv = worker_args(kafka_bootstrap, "g-stream", fresh_topics, server.base_url_openai, tool_dir, "--stream")
    procs = [WorkerProcess(argv, tmp_path / f"worker-{n}.log", worker_env("test-key")) for n in (1, 2)]
    try:
        async with http_api_on_kafka(kafka_bootstrap, fresh_topics) as client:
            first = procs[0].start()
            while not first.assigned():
                assert first.alive(), first.log_text()[-2000:]
                await asyncio.sleep(0.1)
            reader = StreamReader()
            reading = asyncio.create_task(reader.read(client, "conv-1"))
            await reader.connected.wait()
            publisher = KafkaLog(kafka_bootstrap, "unused", fresh_topics)
            await publisher.producer.start()
            await publish(publisher, message_event("conv-1", "which day is cheaper?", NOW(), "m1"))
            await publisher.producer.stop()
            await reader.until(lambda r: r.deltas() >= 2)
            first.kill()
            second = procs[1].start()
            await asyncio.wait_for(reading, 120)
            audit = await until_settled(kafka_bootstrap, fresh_topics, ["m1"], 120, lambda: None)
            second.stop()
    finally:
        for proc in procs:
            proc.kill()

    kinds = reader.kinds()
    interrupted = kinds.index("interrupted")
    assert 2 <= interrupted < len(PIECES) and kinds[-1] == "outcome"
    assert set(kinds[:interrupted]) == {"delta"} and set(kinds[interrupted + 1 : -1]) == {"delta"}
    assert "".join(PIECES).startswith(reader.text(attempt=1)) and reader.text(attempt=1) != "".join(PIECES)
    assert reader.text(attempt=2) == "".join(PIECES)
    assert reader.events[interrupted][1]["attempt"] == 1 and reader.events[-1][1]["reply"] == "".join(PIECES)
    # The log: attempt 1 failed with nothing recorded of its half reply; attempt 2 answered.
    check_invariants(audit)
    [failed] = audit.of_type(AttemptFailed)
    [responded] = audit.of_type(ModelResponded)
    [outcome] = audit.of_type(TurnCompleted)
    assert (failed.attempt, responded.attempt, outcome.attempt) == (1, 2, 2)
    assert responded.text == outcome.reply == "".join(PIECES)
    events = [decode(r.value) for r in await read_topic(kafka_bootstrap, fresh_topics.events)]
    assert not any(getattr(e, "type", None) == "ReplyDelta" for e in events)
    on_deltas_topic = [decode_delta(r.value) for r in await read_topic(kafka_bootstrap, fresh_topics.deltas)]
    assert {d.attempt for d in on_deltas_topic if d is not None} == {1, 2}

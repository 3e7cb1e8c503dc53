"""One end-to-end turn per terminal outcome on the real broker: the worker over Kafka, the
model on the loopback provider server, the verdict read back from the topics by an
independent consumer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from loop_harness import ATTEMPTS_ONLY, NOW, World, config, settings
from provider_server import ProviderServer, Raw, Reply, Step

from turnstile.events import OUTCOME_TYPES, DecodeError, Event, decode
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker

pytestmark = pytest.mark.kafka
TIMEOUT_S = 90


async def decoded(bootstrap: str, topic: str) -> list[Event]:
    return [e for r in await read_topic(bootstrap, topic) if not isinstance(e := decode(r.value), DecodeError)]


async def one_turn_on_kafka(
    bootstrap: str, topics: Topics, script: Sequence[Step], turn: TurnSettings
) -> tuple[list[Event], Event, ProviderServer]:
    group = f"g-{uuid.uuid4().hex[:8]}"
    with ProviderServer() as server:
        server.push(*script)
        provider = HttpProvider(OpenAIChat(), server.base_url_openai, "test-key", timeout_s=10.0, retry=ATTEMPTS_ONLY)
        worker = Worker(KafkaLog(bootstrap, group, topics), provider, config(turn))
        publisher = KafkaLog(bootstrap, group, topics)
        await publisher.producer.start()
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            await publish(publisher, message_event("conv-1", "pay bob 5 and confirm", NOW(), "m1"))
            deadline = asyncio.get_running_loop().time() + TIMEOUT_S
            while not (published := await decoded(bootstrap, topics.outcomes)):
                assert not task.done(), "the worker stopped"
                assert asyncio.get_running_loop().time() < deadline, "no outcome in time"
                await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await publisher.producer.stop()
            await provider.aclose()
        events = [e for e in await decoded(bootstrap, topics.events) if e.conversation_id == "conv-1"]
        [outcome] = published
        return events, outcome, server


def check_one_outcome(events: list[Event], outcome: Event) -> None:
    assert [e for e in events if isinstance(e, OUTCOME_TYPES)] == [outcome]
    [claim] = [e for e in events if e.type == "TurnClaimed"]
    assert claim.input_ids == ("m1",) and outcome.turn_id == claim.turn_id


async def test_completed_on_kafka(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    world = World()
    script = [Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]), Reply(text="Paid.")]
    events, outcome, _ = await one_turn_on_kafka(kafka_bootstrap, fresh_topics, script, settings(world))
    check_one_outcome(events, outcome)
    assert outcome.type == "TurnCompleted" and outcome.reply == "Paid."
    assert [e.type for e in events if e.type.startswith("ToolCall")] == ["ToolCallStarted", "ToolCallFinished"]
    assert len(world.transfers) == 1


async def test_failed_on_kafka(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    world = World()
    script = [Raw(503, b"down"), Raw(503, b"down")]
    turn = settings(world, max_attempts=2)
    events, outcome, _ = await one_turn_on_kafka(kafka_bootstrap, fresh_topics, script, turn)
    check_one_outcome(events, outcome)
    assert outcome.type == "TurnFailed" and outcome.metrics.attempt == 2
    assert [e.retryable for e in events if e.type == "AttemptFailed"] == [True, False]


async def test_paused_on_kafka(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    world = World()
    script = [Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')])]
    turn = settings(world, approval=True)
    events, outcome, _ = await one_turn_on_kafka(kafka_bootstrap, fresh_topics, script, turn)
    check_one_outcome(events, outcome)
    assert outcome.type == "TurnPaused" and outcome.reason == "approval"
    assert outcome.pending_call is not None and outcome.pending_call.name == "transfer"
    assert world.transfers == []


async def test_exhausted_on_kafka(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    world = World()
    script = [Reply(text="Searching.", tool_calls=[("call_1", "search", '{"q": "x"}')])]
    turn = settings(world, budget=TurnBudget(max_iterations=1))
    events, outcome, server = await one_turn_on_kafka(kafka_bootstrap, fresh_topics, script, turn)
    check_one_outcome(events, outcome)
    assert outcome.type == "TurnExhausted" and outcome.last_text == "Searching."
    assert len(server.requests) == 1

"""The real broker for integration tests. Under CI a missing broker is a failure, never a skip."""

from __future__ import annotations

import os
import uuid

import pytest

from turnstile.streams.kafka_reader import ensure_topics, reachable
from turnstile.streams.log import Topics

BOOTSTRAP = os.environ.get("TURNSTILE_KAFKA", "127.0.0.1:9092")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    if not reachable(BOOTSTRAP):
        message = f"Kafka is not reachable at {BOOTSTRAP}: start it with infra/kafka/start.sh"
        if os.environ.get("CI") or os.environ.get("TURNSTILE_REQUIRE_KAFKA"):
            pytest.fail(message)
        pytest.skip(message)
    return BOOTSTRAP


@pytest.fixture
async def fresh_topics(kafka_bootstrap: str) -> Topics:
    """Topics of this test alone, so tests never read each other's events."""
    suffix = uuid.uuid4().hex[:8]
    topics = Topics(f"t-{suffix}.events", f"t-{suffix}.outcomes", f"t-{suffix}.dlq", f"t-{suffix}.deltas")
    await ensure_topics(kafka_bootstrap, topics, partitions=8)
    return topics

"""A second consumer group of workers on one events topic runs every turn twice over: the
worker starting beside one says so, naming the group, what it does and the fix; a worker
joining its own group, or a group reading other topics, says nothing."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import PartitionStart, Topics
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig
from turnstile.streams.worker_groups import ConsumerGroup, GroupMember, beside_warning, groups_beside

EVENTS = "turnstile.events"


def group(group_id: str, *members: frozenset[str], host: str = "10.0.0.7") -> ConsumerGroup:
    return ConsumerGroup(group_id, "Stable", tuple(GroupMember("turnstile", host, topics) for topics in members))


# -- the decision ----------------------------------------------------------------------
def test_given_another_group_reading_the_events_topic_when_a_worker_starts_then_it_is_named():
    workers = group("turnstile-worker", frozenset({EVENTS}), frozenset({EVENTS}))
    assert groups_beside([workers], EVENTS, "turnstile-wroker") == [workers]


def test_given_only_the_workers_own_group_when_it_starts_then_nothing_is_beside_it():
    assert groups_beside([group("turnstile-worker", frozenset({EVENTS}))], EVENTS, "turnstile-worker") == []


def test_given_groups_of_other_topics_or_without_members_when_a_worker_starts_then_nothing_is_beside_it():
    groups = [
        group("billing", frozenset({"orders"})),
        group("gone"),
        group("outcomes-reader", frozenset({"x.outcomes"})),
    ]
    assert groups_beside(groups, EVENTS, "turnstile-worker") == []


def test_given_several_groups_beside_when_warned_then_each_is_named_with_its_members_and_the_fix():
    beside = groups_beside(
        [group("b", frozenset({EVENTS})), group("a", *[frozenset({EVENTS})] * 5, host="h\x1b[31m")], EVENTS, "c"
    )
    text = beside_warning(beside, EVENTS, "c")
    assert text.index("'a' (5 members on h\\x1b[31m)") < text.index("'b' (1 member on 10.0.0.7)")
    assert "each model call twice" in text and "--group" in text
    assert "\x1b" not in text  # a client's host name never restyles the operator's terminal


# -- on the broker ---------------------------------------------------------------------
@pytest.mark.kafka
async def test_a_worker_started_in_a_second_group_on_the_same_topics_warns_and_one_in_the_same_group_does_not(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
):
    running = f"g-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=0, max_wait_ms=0), turn=TurnSettings())
    first = Worker(KafkaLog(kafka_bootstrap, running, fresh_topics), ScriptedProvider(), config)
    stop = asyncio.Event()
    task = asyncio.create_task(first.run(stop))
    try:
        async with asyncio.timeout(60):
            while not first.assignment_received:  # noqa: ASYNC110  (a flag the worker sets, no event)
                await asyncio.sleep(0.1)
        with caplog.at_level(logging.WARNING, logger="turnstile.streams.worker_groups"):
            await _started_and_stopped(KafkaLog(kafka_bootstrap, running, fresh_topics))
            assert not [r for r in caplog.records if r.name == "turnstile.streams.worker_groups"]

            await _started_and_stopped(KafkaLog(kafka_bootstrap, running + "-typo", fresh_topics))
        [warning] = [r for r in caplog.records if r.name == "turnstile.streams.worker_groups"]
        assert warning.levelno == logging.ERROR
        assert f"{running!r} (1 member on " in warning.getMessage()
        assert f"consumer group '{running}-typo' is starting on {fresh_topics.events}" in warning.getMessage()
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


class _Quiet:
    """A rebalance listener that takes nothing: the log is started (the check) and stopped."""

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> Mapping[int, int]:
        return {}

    async def on_revoked(self, partitions: set[int]) -> None:
        return None


async def _started_and_stopped(log: KafkaLog) -> None:
    try:
        await log.start(_Quiet())
    finally:
        await log.stop()

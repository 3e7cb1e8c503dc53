"""A second consumer group of workers on one events topic runs every turn twice over: the
worker starting beside one says so, naming the group, what it does and the fix; a worker
joining its own group, or a group reading other topics, says nothing."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping

import pytest
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import PartitionStart, Topics
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig
from turnstile.streams.worker_groups import (
    ConsumerGroup,
    GroupMember,
    Survey,
    beside_warning,
    described_groups,
    groups_beside,
    warn_of_groups_beside,
)

EVENTS = "turnstile.events"


def group(group_id: str, *members: frozenset[str], host: str = "10.0.0.7") -> ConsumerGroup:
    return ConsumerGroup(group_id, "Stable", tuple(GroupMember(host, topics) for topics in members))


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


def test_given_a_describe_answer_when_read_then_members_topics_are_decoded_and_each_refusal_is_a_problem():
    subscribed = ConsumerProtocolMemberMetadata(0, [EVENTS], b"").encode()
    assigned = ConsumerProtocolMemberAssignment(0, [(EVENTS, [0, 1])], b"").encode()
    answer = {"groups": [
        {"error_code": 0, "group": "workers", "state": "Stable", "protocol_type": "consumer", "protocol": "roundrobin",
         "members": [{"member_id": "m-1", "client_id": "turnstile", "client_host": "/10.0.0.7",
                      "member_metadata": subscribed, "member_assignment": assigned},
                     {"member_id": "m-2", "client_id": "connect", "client_host": "/10.0.0.8",
                      "member_metadata": b"\x00", "member_assignment": b""}]},
        {"error_code": 30, "group": "billing", "state": "", "protocol_type": "", "protocol": "", "members": []},
    ]}  # fmt: skip
    groups, problems = described_groups(answer)
    members = (GroupMember("/10.0.0.7", frozenset({EVENTS})), GroupMember("/10.0.0.8", frozenset()))
    assert groups == [ConsumerGroup("workers", "Stable", members)]  # (a member of another protocol: no topics)
    assert problems == ["group 'billing': GroupAuthorizationFailedError (error 30)"]


async def test_when_the_admin_api_refuses_or_times_out_then_the_check_is_said_undone(
    caplog: pytest.LogCaptureFixture,
):
    no_rights = "group 'billing': GroupAuthorizationFailedError (error 30)"
    refused = Survey([group("workers", frozenset({EVENTS}))], [no_rights])
    rebalancing = ConsumerGroup("other", "PreparingRebalance", (GroupMember("/10.0.0.9", frozenset()),))

    async def partly(bootstrap: str, own: str) -> Survey:
        return Survey([*refused.groups, rebalancing], refused.problems)

    async def never(bootstrap: str, own: str) -> Survey:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    with caplog.at_level(logging.WARNING, logger="turnstile.streams.worker_groups"):
        beside = await warn_of_groups_beside("b:9092", EVENTS, "workers", survey=partly)
        assert beside == []  # its own group is no other
        await warn_of_groups_beside("b:9092", EVENTS, "workers", survey=never, timeout_s=0.01)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"could not check whether every other consumer group reads {EVENTS}: {no_rights}; "
        "group 'other' stayed PreparingRebalance (what it reads is not given)",
        f"could not check whether another consumer group reads {EVENTS}: TimeoutError()",
    ]


def test_given_the_workers_own_group_already_reads_the_topic_when_warned_then_no_group_is_called_right():
    # (a worker of the right group, restarted after a typo'd group came up, was told to join the typo)
    beside = [group("turnstile-wroker", frozenset({EVENTS}))]
    own = group("turnstile-worker", frozenset({EVENTS}), frozenset({EVENTS}))
    text = beside_warning(beside, EVENTS, "turnstile-worker", own)
    assert text.startswith(f"consumer group 'turnstile-worker' (2 members on 10.0.0.7) reads {EVENTS}")
    assert "one of the groups is misconfigured" in text and "give this worker their group" not in text


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
        assert warning.levelno == logging.WARNING
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

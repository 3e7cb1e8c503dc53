"""When a static member (`--instance-id`) stops because the group no longer knows it: only when
a commit it sent as the member the group had made is refused as from an unknown member, not
when aiokafka resent one as no member at all after a rebalance reset it (no broker: a stand-in
consumer answers as the broker and aiokafka would)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError, IllegalGenerationError, UnknownError, UnknownMemberIdError

from turnstile.streams.kafka_log import KafkaLog, Membership, MembershipLost
from turnstile.streams.log import Topics


@dataclass
class Coordinator:
    member_id: str
    generation: int


@dataclass
class Refusing:
    """A consumer whose commits the group refuses with `cause`, as aiokafka wraps it."""

    _coordinator: Coordinator
    cause: type[Exception]
    owned: set[TopicPartition] = field(default_factory=lambda: {TopicPartition("e", 0)})

    def assignment(self) -> set[TopicPartition]:
        return self.owned

    async def commit(self, offsets: object) -> None:
        # (aiokafka's text runs over several lines, advising max_poll_interval_ms)
        said = "Commit cannot be completed since the group has already\nrebalanced and assigned the partitions"
        raise CommitFailedError(said) from self.cause()

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[object, list[object]]:
        return {}


def polled_after_a_refused_commit(consumer: Refusing, instance_id: str | None = "pod-a") -> None:
    log = KafkaLog("127.0.0.1:9", "g", Topics("e"), membership=Membership(instance_id))
    log._consumer = consumer  # type: ignore[assignment]

    async def both() -> None:
        await log.commit({0: 5})
        await log.poll(0.0)

    asyncio.run(both())


def test_a_commit_refused_as_from_an_unknown_member_it_was_given_stops_a_static_member() -> None:
    with pytest.raises(MembershipLost, match="no longer knows this worker as --instance-id 'pod-a'") as caught:
        polled_after_a_refused_commit(Refusing(Coordinator("pod-a-2f9c", 4), UnknownMemberIdError))
    # One line, the error named in a few words (it carried aiokafka's whole advice).
    said = str(caught.value)
    assert "\n" not in said and said.endswith("[CommitFailedError (UnknownMemberIdError)]")


@pytest.mark.parametrize(
    ("coordinator", "cause", "instance_id"),
    [
        (Coordinator("", -1), UnknownMemberIdError, "pod-a"),  # resent as no member after a reset: a rebalance
        (Coordinator("pod-a-2f9c", 4), IllegalGenerationError, "pod-a"),  # the group moved on: a rebalance
        (Coordinator("w-2f9c", 4), UnknownMemberIdError, None),  # a dynamic member rejoins, as it always did
    ],
)
def test_a_rebalance_or_a_dynamic_member_goes_on(
    coordinator: Coordinator, cause: type[Exception], instance_id: str | None
) -> None:
    polled_after_a_refused_commit(Refusing(coordinator, cause), instance_id)  # no MembershipLost


@dataclass
class Fenced(Refusing):
    """A consumer whose rejoin the group answers FENCED_INSTANCE_ID, which aiokafka reads as unknown."""

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[object, list[object]]:
        raise UnknownError()


def test_a_rejoin_the_group_refuses_with_an_error_the_client_does_not_know_stops_a_static_member() -> None:
    consumer = Fenced(Coordinator("", -1), IllegalGenerationError)
    with pytest.raises(MembershipLost):
        polled_after_a_refused_commit(consumer)
    with pytest.raises(UnknownError):  # a dynamic member: the client's error, as before
        polled_after_a_refused_commit(consumer, None)

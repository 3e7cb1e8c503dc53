"""The Kafka log's rebalance listener without a broker: what the worker is told when an
assignment it was still taking is abandoned by the next rebalance."""

from __future__ import annotations

import asyncio

from turnstile.streams.kafka_log import KafkaLog, _Listener
from turnstile.streams.log import PartitionStart


class Told:
    """A worker whose assignment never ends; records the revokes it is told of."""

    def __init__(self) -> None:
        self.taking = asyncio.Event()
        self.revoked: list[set[int]] = []

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        self.taking.set()
        await asyncio.Event().wait()
        return {}

    async def on_revoked(self, partitions: set[int]) -> None:
        self.revoked.append(partitions)


async def test_given_an_assignment_still_being_taken_when_a_revoke_names_nothing_then_the_worker_is_told() -> None:
    # Given an assignment of nothing that the worker is still taking (its part runs beside
    # the group's protocol: here it never ends)
    told, log = Told(), KafkaLog("127.0.0.1:1")  # (never started: no broker is asked)
    listener = _Listener(log, told)
    try:
        await listener.on_partitions_assigned(set())
        await asyncio.wait_for(told.taking.wait(), 5)
        # When the next rebalance revokes that assignment (nothing)
        await listener.on_partitions_revoked(set())
        # Then the worker's part was cancelled and the worker told, though nothing is
        # revoked: what it held before that assignment and is not in it is no longer its own
        assert told.revoked == [set()]
        assert listener.assigning is None and listener.failure is None
        # ...and a revoke of nothing with no assignment in progress tells it nothing
        await listener.on_partitions_revoked(set())
        assert told.revoked == [set()]
    finally:
        await log.stop()

"""An assignment that gives a worker back the partitions it held and new ones too: the kept
partitions go on at once -- their messages claimed and answered -- while the new ones load
their snapshots (seconds at a million conversations), not after.

Staged on the embedded log, calling the worker's rebalance callbacks as the Kafka listener
does; the Kafka log's side (`KafkaLog.take`) is in `test_kafka_static_membership.py`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping

from worker_harness import FAST, ReplayCalls, events_of, running, until

from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import PartitionStart, Record, partition_for
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker

NOW = SystemClock().now_ms


class HeldLoad(FileLog):
    """Once `hold` is set, a load of snapshot heads waits until `release`."""

    hold = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.loading, self.release = asyncio.Event(), asyncio.Event()

    async def read_partitions(
        self, topic: str, partitions: list[int], starts: Mapping[int, int] | None = None
    ) -> AsyncGenerator[list[Record], None]:
        if self.hold and topic in (self.topics.heads, self.topics.snapshots):
            self.loading.set()
            await self.release.wait()
        async for chunk in super().read_partitions(topic, partitions, starts):
            yield chunk


def on(partition: int) -> str:
    """A conversation id of `partition` (of 2)."""
    return next(c for n in range(100) if partition_for(c := f"conv-{n}", 2) == partition)


async def assign(log: FileLog, worker: Worker, partitions: list[int]) -> None:
    """As the Kafka listener does: the worker says where to read each partition from."""
    starts = {p: PartitionStart(log.end_offset(p) or 0, committed=0) for p in partitions}
    for p, offset in (await worker.on_assigned(starts)).items():
        log.seek(p, offset)


def answered(log: FileLog, conversation: str) -> int:
    return sum(e.type == "TurnCompleted" for e in events_of(log, conversation))


async def test_given_kept_and_new_partitions_when_the_new_ones_load_then_the_kept_ones_go_on_meanwhile(
    tmp_path,
) -> None:
    log, hooks = HeldLoad(tmp_path, partitions=2), ReplayCalls()
    kept, moved = on(0), on(1)
    async with running(log, ScriptedProvider(), FAST, replay_hooks=hooks) as worker:
        await until(lambda: worker.partition_liveness() == {0: True, 1: True})
        # Given partition 1 moved away at one rebalance and comes back at the next, with 0 kept
        await worker.on_revoked({0, 1})
        await assign(log, worker, [0])
        await worker.on_revoked({0})
        # (the kept partition is behind the group's new end: it catches up during the load)
        await publish(log, message_event(kept, "first", NOW(), "m0"))
        log.hold = True
        assigning = asyncio.create_task(assign(log, worker, [0, 1]))
        await asyncio.wait_for(log.loading.wait(), 10)
        # When partition 1 loads: then the kept partition's waiting message is answered
        # meanwhile, and so is one that comes for it then
        await until(lambda: answered(log, kept) == 1, 20)
        await publish(log, message_event(kept, "hello", NOW(), "m1"))
        await until(lambda: answered(log, kept) == 2, 20)
        assert not assigning.done()
        # ... and the load is still a replay for the hooks (the collector held) until it ends
        assert hooks.calls[-1] == "replaying"
        # ...and once the load ends, the partition that came back goes on too
        log.release.set()
        await asyncio.wait_for(assigning, 10)
        await until(lambda: hooks.calls[-1] == "replayed")
        await publish(log, message_event(moved, "hello", NOW(), "m2"))
        await until(lambda: answered(log, moved) == 1, 20)
        assert worker.partition_liveness() == {0: True, 1: True}
        # The kept partition's records, read during the load and from the end's positions,
        # were folded once each: one message, one turn, nothing refused
        state = worker.state_of(kept)
        assert state is not None and [h.content for h in state.history if h.role == "user"] == ["first", "hello"]
        assert answered(log, kept) == 2 and worker.dead_letters == 0

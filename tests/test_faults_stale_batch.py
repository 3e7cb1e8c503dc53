"""A rebalance that runs while the consumer loop is still working through a polled batch.

The rebalance callbacks run beside the consumer loop: while the loop awaits an append (an
outcome record, a dead letter -- and during a broker outage that await lasts), the group
can revoke the partitions and assign them again, replaying from offset 0. The rest of the
batch polled before the rebalance is stale: folded into the freshly assigned partition it
would jump its position past the replay and make the worker decide on a state built from
a few records (a claim with the wrong history boundary, which every reader then refuses).

The rebalance is simulated on the embedded log, deterministically: the first outcome
record the worker appends triggers revoke + assign (seek to the beginning), exactly as the
Kafka listener calls them."""

from __future__ import annotations

from builders import claim, completed, message, started
from fault_audit import check_invariants, fold_records
from worker_harness import FAST, events_of, running, until

from events import TurnClaimed, TurnCompleted, encode
from handlers.providers.scripted import ScriptedProvider
from streams.file_log import FileLog, _PartitionReader
from streams.log import PartitionStart, RebalanceListener
from streams.runtime import SystemClock

NOW = SystemClock().now_ms


class RebalanceMidBatch(FileLog):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.listener: RebalanceListener | None = None
        self.armed = True

    async def start(self, listener: RebalanceListener) -> None:
        self.listener = listener
        await super().start(listener)

    async def append(self, topic: str, key: str, value: bytes, partition: int | None = None) -> tuple[int, int]:
        result = await super().append(topic, key, value, partition)
        if topic == self.topics.outcomes and self.armed and self.listener is not None:
            self.armed = False
            everything = set(range(self.partitions))
            await self.listener.on_revoked(everything)
            starts = {}
            for p in everything:  # assigned again, from the beginning
                self._readers[p] = _PartitionReader(self._file(self.topics.events, p).path)
                starts[p] = PartitionStart(self._file(self.topics.events, p).end_offset(), 0)
            await self.listener.on_assigned(starts)
        return result


async def test_the_rest_of_a_batch_polled_before_a_rebalance_is_not_folded(tmp_path) -> None:
    log = RebalanceMidBatch(tmp_path, partitions=1)
    t = NOW() - 60_000  # old enough that no debounce waits: m2 is claimable at once
    first = claim(["m1"], t, 0, conv="c1")
    # One batch: a finished turn (its outcome record triggers the rebalance), then m2.
    for event in (message("m1", t, conv="c1"), first, started(first, t), completed(first, t)):
        await log.append(log.topics.events, "c1", encode(event))
    await log.append(log.topics.events, "c1", encode(message("m2", t + 1, conv="c1")))
    provider = ScriptedProvider()
    async with running(log, provider, FAST):
        await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log, "c1")) == 2, 20)
    audit = fold_records(log.read_all(log.topics.events))
    check_invariants(audit)
    assert audit.ignored == []  # nothing written on a half-built state
    claims = [e for e in events_of(log, "c1") if isinstance(e, TurnClaimed)]
    assert [(c.input_ids, c.history_boundary) for c in claims] == [(("m1",), 0), (("m2",), 2)]
    assert len(provider.requests) == 1

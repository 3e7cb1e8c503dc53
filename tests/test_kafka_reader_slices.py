"""A whole-partition read on the Kafka client, without a broker: it hands the records on a
slice at a time, and ends where the partition ends even when its last offsets hold no record
(a compacted tail, transaction markers) and the client's last take returns nothing."""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord

from turnstile.streams.kafka_reader import READ_SLICE, _chunks_to_end

TP = TopicPartition("t", 0)


class Consumer:
    """The client's side of the read: `records` fetched, taken `max_records` at a time; once
    they are all taken, the position moves to `end` (the offsets after hold no record)."""

    def __init__(self, records: int, end: int) -> None:
        self.records = [
            ConsumerRecord("t", 0, offset, 0, 0, b"k", b"v", None, 1, 1, []) for offset in range(records)
        ]
        self.end, self.at = end, 0

    async def getmany(self, *partitions: TopicPartition, timeout_ms: int, max_records: int | None = None) -> Any:
        taken = self.records[self.at : None if max_records is None else self.at + max_records]
        if taken:
            self.at = taken[-1].offset + 1
            return {TP: taken}
        self.at = self.end  # past the offsets with no record: nothing to return
        return {}

    async def position(self, tp: TopicPartition) -> int:
        return self.at


async def _read(consumer: Consumer) -> list[list[int]]:
    chunks = _chunks_to_end(consumer, [TP], timeout_s=0, ends={TP: consumer.end})  # type: ignore[arg-type]
    return [[r.offset for r in chunk] async for chunk in chunks]


async def test_given_a_partition_of_many_records_when_read_whole_then_it_comes_a_slice_at_a_time() -> None:
    chunks = await _read(Consumer(records=2 * READ_SLICE + 5, end=2 * READ_SLICE + 5))
    assert [len(c) for c in chunks] == [READ_SLICE, READ_SLICE, 5]
    assert [o for c in chunks for o in c] == list(range(2 * READ_SLICE + 5))


async def test_given_a_partition_whose_last_offsets_hold_no_record_when_read_whole_then_the_read_ends_there() -> None:
    # Given 3 records then 2 offsets with none, the last take returning nothing
    # When the partition is read to its end (no time to wait: a timeout would raise at once)
    chunks = await _read(Consumer(records=3, end=5))
    # Then the read ends with the 3 records, not waiting out its timeout
    assert chunks == [[0, 1, 2]]

"""Point reads on the real broker (`KafkaLog.read_at`: how a new owner fetches the snapshots
of its conversations with something to decide, and an event of a conversation whose snapshot
has not arrived yet waits for one): exactly the records at the offsets asked, several from
one fetch; an offset with no record (past the end) is left out, never answered with another
record; one reader serves reads of other partitions and topics in turn."""

from __future__ import annotations

import pytest
from kafka_fixtures import kafka_bootstrap  # noqa: F401  (fixtures)
from test_kafka_append_batch import log, new_topic  # noqa: F401  (`log`: a fixture)

from turnstile.streams.kafka_log import KafkaLog

pytestmark = pytest.mark.kafka


async def _filled(to: KafkaLog, topic: str, partition: int, count: int) -> None:
    for n in range(count):
        await to.append(topic, f"key-{partition}-{n}", f"value {partition}/{n}".encode(), partition)


async def test_a_point_read_gets_exactly_the_records_at_the_offsets_asked(
    kafka_bootstrap: str,  # noqa: F811
    log: KafkaLog,  # noqa: F811
) -> None:
    topic = await new_topic(kafka_bootstrap)
    await _filled(log, topic, 3, 50)
    found = await log.read_at(topic, 3, [49, 0, 8, 7, 8])  # unordered, one twice
    assert sorted(found) == [0, 7, 8, 49]
    assert all(r.partition == 3 and r.offset == n and r.value == f"value 3/{n}".encode() for n, r in found.items())
    assert found[7].key == b"key-3-7"
    # Past the end: left out, not the last record instead
    assert sorted(await log.read_at(topic, 3, [49, 50, 10_000])) == [49]
    assert await log.read_at(topic, 3, []) == {}
    assert await log.read_at(topic, 4, [0]) == {}  # an empty partition


async def test_one_reader_serves_other_partitions_and_topics_in_turn(
    kafka_bootstrap: str,  # noqa: F811
    log: KafkaLog,  # noqa: F811
) -> None:
    first, second = await new_topic(kafka_bootstrap), await new_topic(kafka_bootstrap)
    await _filled(log, first, 0, 5)
    await _filled(log, first, 1, 5)
    await _filled(log, second, 0, 3)
    for topic, partition, offset in [(first, 0, 4), (first, 1, 2), (second, 0, 1), (first, 0, 0)]:
        record = (await log.read_at(topic, partition, [offset]))[offset]
        assert (record.partition, record.value) == (partition, f"value {partition}/{offset}".encode())

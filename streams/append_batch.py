"""The appends of one event-loop cycle, one produce per partition.

Many turn tasks append at once, each awaiting its own event. One `send_and_wait` per event
costs the producer's per-send machinery each time (metadata wait, serialisation, a batch
lookup, a future per record: about 16 µs of CPU here), and the engine is CPU-bound on it.
Here an append only queues its record for its (topic, partition) and gets a future. Each
partition with records queued has one sender task: it takes everything queued -- every record
appended in the loop cycle before it ran -- and hands it to the producer as one batch
(`create_batch` / `send_batch`); while the producer holds that batch back (the idempotent
producer has one batch of a partition in flight at a time, so `send_batch` waits for the
previous one to be sent), the records appended meanwhile queue up and form the next batch.
Each waiter's offset is its batch's base offset plus its record's place in it.

What does not change: an append still returns only once the broker has acknowledged its
record (acks=all, idempotent producer), so everything that waits on an append -- a
side-effecting tool waits for its ToolCallStarted to be read back as accepted, which needs
the record on the log first -- waits exactly as before. Order: the records of one partition
are written in the order of the append calls (one sender per partition, batches in turn).

A batch never holds more than the topic takes in one message (`limit`); a record too large
for that alone is for the caller to refuse (`fits`) before it reaches the producer. A batch
that fails fails every append in it, with the same error.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer

from turnstile.streams.log import Landed

# A record's bytes in a batch beyond its key and value (attributes, varints, headers count).
BATCHED_RECORD_OVERHEAD_BYTES = 64


@dataclass(slots=True)
class _Pending:
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]] | None
    done: asyncio.Future[Landed]


class AppendBatcher:
    def __init__(
        self,
        producer: Callable[[], AIOKafkaProducer],
        limit: Callable[[str], int],
        refused: Callable[[BaseException], BaseException],
    ) -> None:
        """`limit(topic)`: the most bytes of key and value one record of `topic` may carry
        alone (the batch's own overhead already set aside), and what a batch of several
        carries with `BATCHED_RECORD_OVERHEAD_BYTES` counted for each; `refused(exc)`: the error a
        failed send becomes for its waiters."""
        self._producer = producer
        self._limit = limit
        self._refused = refused
        self._queued: dict[tuple[str, int], list[_Pending]] = {}
        self._senders: dict[tuple[str, int], asyncio.Task[None]] = {}

    def fits(self, topic: str, key: bytes | None, value: bytes) -> bool:
        """Whether the record may be sent at all: in a batch of its own it is under the limit."""
        return len(value) + len(key or b"") <= self._limit(topic)

    def append(
        self, topic: str, partition: int, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None
    ) -> asyncio.Future[Landed]:
        """Queue the record; the future yields where it landed once acknowledged."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Landed] = loop.create_future()
        where = (topic, partition)
        self._queued.setdefault(where, []).append(_Pending(key, value, headers, done))
        if where not in self._senders:  # it runs from the next loop cycle: this cycle's records join
            self._senders[where] = loop.create_task(self._send(topic, partition), name="append batch")
        return done

    async def drain(self) -> None:
        """Everything queued so far handed to the producer (its flush then sends it)."""
        while self._senders:
            await asyncio.gather(*self._senders.values(), return_exceptions=True)

    async def _send(self, topic: str, partition: int) -> None:
        """The partition's sender: what is queued goes as one batch; while the producer holds
        it back (the idempotent producer has one batch of a partition in flight at a time)
        the records appended meanwhile queue up for the next one."""
        where = (topic, partition)
        unsent: list[_Pending] = []
        try:
            while unsent := self._queued.pop(where, []):
                producer = self._producer()
                for batch, group in self._batches(producer, topic, unsent):
                    try:
                        ack = await producer.send_batch(batch, topic, partition=partition)
                    except Exception as exc:
                        _fail(group, self._refused(exc))
                    else:
                        ack.add_done_callback(functools.partial(self._landed, group, partition))
                    unsent = unsent[len(group) :]
        finally:
            del self._senders[where]
            # Cancelled (the log stops): no waiter is left hanging.
            cut = ConnectionError(f"the append to {topic}[{partition}] was cut off by a stop")
            _fail(unsent + self._queued.pop(where, []), cut)

    def _landed(self, group: list[_Pending], partition: int, ack: asyncio.Future[Any]) -> None:
        if ack.cancelled():
            _fail(group, ConnectionError(f"the append to partition {partition} was cut off by a stop"))
        elif (exc := ack.exception()) is not None:
            _fail(group, self._refused(exc))
        else:
            base = ack.result().offset
            for place, item in enumerate(group):
                if not item.done.done():
                    item.done.set_result(Landed(partition, base + place))

    def _batches(
        self, producer: AIOKafkaProducer, topic: str, items: list[_Pending]
    ) -> list[tuple[Any, list[_Pending]]]:
        """The items in batches of at most `limit(topic)` bytes, in order."""
        limit = self._limit(topic)
        out: list[tuple[Any, list[_Pending]]] = []
        batch, group, size = producer.create_batch(), list[_Pending](), 0
        for item in items:
            cost = len(item.value) + len(item.key or b"") + BATCHED_RECORD_OVERHEAD_BYTES
            if group and size + cost > limit:
                out.append((batch, group))
                batch, group, size = producer.create_batch(), [], 0
            if batch.append(key=item.key, value=item.value, timestamp=None, headers=item.headers or []) is None:
                # The builder's own size bound, below ours: this batch is full (never when
                # empty: a builder takes its first record whatever its size).
                out.append((batch, group))
                batch, group, size = producer.create_batch(), [], 0
                batch.append(key=item.key, value=item.value, timestamp=None, headers=item.headers or [])
            group.append(item)
            size += cost
        if group:
            out.append((batch, group))
        return out


def _fail(group: list[_Pending], exc: BaseException) -> None:
    for item in group:
        if not item.done.done():
            item.done.set_exception(exc)

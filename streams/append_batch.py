"""The appends of one event-loop cycle, one produce per partition.

Many turn tasks append at once, each awaiting its own event. One `send_and_wait` per event
costs the producer's per-send machinery each time (metadata wait, serialisation, a batch
lookup, a future per record: about 16 µs of CPU here), and the engine is CPU-bound on it.
Here an append only queues its record for its (topic, partition) and gets a future; the
first append of a cycle schedules one flush with `call_soon`, which builds one batch per
partition (`create_batch` / `send_batch`) from every record queued in that cycle. Each
waiter's offset is the batch's base offset plus its record's place in it.

What does not change: an append still returns only once the broker has acknowledged its
record (acks=all, idempotent producer), so everything that waits on an append -- a
side-effecting tool waits for its ToolCallStarted to be read back as accepted, which needs
the record on the log first -- waits exactly as before. Order: the records of one partition
are written in the order of the append calls (a flush waits for the previous flush of the
partition to be handed to the producer, which keeps order per partition).

A batch never holds more than the topic takes in one message (`limit`); a record too large
for that alone is for the caller to refuse (`fits`) before it reaches the producer. A batch
that fails fails every append in it, with the same error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer

from turnstile.streams.log import Landed

# A record's bytes in a batch beyond its key and value (attributes, varints, headers count).
RECORD_OVERHEAD_BYTES = 64


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
        carries with `RECORD_OVERHEAD_BYTES` counted for each; `refused(exc)`: the error a
        failed send becomes for its waiters."""
        self._producer = producer
        self._limit = limit
        self._refused = refused
        self._queued: dict[tuple[str, int], list[_Pending]] = {}
        self._flush_scheduled = False
        # (topic, partition) -> set once the partition's last flush is with the producer.
        self._handed: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._sending: set[asyncio.Task[None]] = set()

    def fits(self, topic: str, key: bytes | None, value: bytes) -> bool:
        """Whether the record may be sent at all: in a batch of its own it is under the limit."""
        return len(value) + len(key or b"") <= self._limit(topic)

    def append(
        self, topic: str, partition: int, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None
    ) -> asyncio.Future[Landed]:
        """Queue the record; the future yields where it landed once acknowledged."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Landed] = loop.create_future()
        self._queued.setdefault((topic, partition), []).append(_Pending(key, value, headers, done))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return done

    async def drain(self) -> None:
        """Everything queued so far handed to the producer and acknowledged (or failed)."""
        self._flush()
        while self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, {}
        loop = asyncio.get_running_loop()
        for (topic, partition), items in queued.items():
            before = self._handed.get((topic, partition))
            handed = self._handed[(topic, partition)] = loop.create_future()
            task = loop.create_task(self._send(topic, partition, items, before, handed), name="append batch")
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(
        self,
        topic: str,
        partition: int,
        items: list[_Pending],
        before: asyncio.Future[None] | None,
        handed: asyncio.Future[None],
    ) -> None:
        acks: list[tuple[asyncio.Future[Any], list[_Pending]]] = []
        try:
            try:
                if before is not None:
                    await before  # the partition's previous flush is with the producer: order kept
                producer = self._producer()
                for batch, group in self._batches(producer, topic, items):
                    try:
                        acks.append((await producer.send_batch(batch, topic, partition=partition), group))
                    except Exception as exc:
                        _fail(group, self._refused(exc))
            finally:
                handed.set_result(None)
                if self._handed.get((topic, partition)) is handed:
                    del self._handed[(topic, partition)]
            for ack, group in acks:
                try:
                    meta = await ack
                except Exception as exc:
                    _fail(group, self._refused(exc))
                    continue
                for place, item in enumerate(group):
                    if not item.done.done():
                        item.done.set_result(Landed(partition, meta.offset + place))
        finally:  # cancelled (the log stops): no waiter is left hanging
            _fail(items, ConnectionError(f"the append to {topic}[{partition}] was cut off by a stop"))

    def _batches(
        self, producer: AIOKafkaProducer, topic: str, items: list[_Pending]
    ) -> list[tuple[Any, list[_Pending]]]:
        """The items in batches of at most `limit(topic)` bytes, in order."""
        limit = self._limit(topic)
        out: list[tuple[Any, list[_Pending]]] = []
        batch, group, size = producer.create_batch(), list[_Pending](), 0
        for item in items:
            cost = len(item.value) + len(item.key or b"") + RECORD_OVERHEAD_BYTES
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

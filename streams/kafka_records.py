"""Records aiokafka cannot read, surfaced instead of raised.

aiokafka decodes each record header's name as UTF-8 and raises `UnicodeDecodeError` on one
that is not, from inside the consumer's fetch. The broker does not check header names (Java
decodes them leniently; librdkafka, Go and kcat send any bytes), so one such record, from
any producer, made every `getmany` of its partition raise: the worker stopped at every start,
every member of the group alike, and every reader with it.

The consumer's per-partition record iterator is replaced (`install`, once per process) by
one that, when a batch of records cannot be read, yields a stand-in for each offset of that
batch it did not deliver: no key, no value, and one header naming why (`UNREADABLE`). The
batch's other offsets are not readable either (the client reads a batch in order), so they
come as stand-ins too. `record_of` turns a stand-in into a `Record` whose `unreadable` says
why; the worker dead-letters it (the letter cannot carry bytes the client could not read:
it names the offset to fetch with another client), every reader skips it, and the
partition moves on.

This leans on aiokafka 0.14's fetcher (`PartitionRecords`, looked up by name when a fetch
lands), which is why the dependency is pinned exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiokafka.consumer import fetcher
from aiokafka.structs import ConsumerRecord

# The header a stand-in carries, its value why the record could not be read. The NUL makes
# it a name no well-behaved producer uses; a stand-in also has neither key nor value.
UNREADABLE = "\x00turnstile.unreadable"


class _Batches:
    """The fetched records, remembering the batch last handed out (its offsets are what a
    failure inside it leaves unread)."""

    def __init__(self, records: Any) -> None:
        self._records = records
        self.batch: Any = None

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        self.batch = self._records.next_batch()
        return self.batch

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())


class _TolerantPartitionRecords(fetcher.PartitionRecords):  # type: ignore[misc]
    next_fetch_offset: int  # the base's: where the next fetch of the partition starts
    _tp: Any

    def __init__(self, tp: Any, records: Any, *rest: Any) -> None:
        self._batches = _Batches(records)
        super().__init__(tp, self._batches, *rest)

    def _unpack_records(self) -> Iterator[ConsumerRecord[Any, Any]]:
        while True:
            try:
                yield from super()._unpack_records()
                return
            except UnicodeDecodeError as exc:
                batch = self._batches.batch
                why = f"the Kafka client could not read this record: {exc}".encode()
                for offset in range(max(self.next_fetch_offset, batch.base_offset), batch.next_offset):
                    yield ConsumerRecord(
                        self._tp.topic, self._tp.partition, offset, batch.first_timestamp, 0, None, None, None,
                        -1, -1, ((UNREADABLE, why),),
                    )  # fmt: skip
                self.next_fetch_offset = batch.next_offset


def install() -> None:
    """From now on every consumer of this process surfaces unreadable records."""
    fetcher.PartitionRecords = _TolerantPartitionRecords


def unreadable(key: bytes | None, value: bytes | None, headers: tuple[tuple[str, bytes | None], ...]) -> str | None:
    """Why a record is a stand-in for one the client could not read, or None."""
    if key is None and value is None and len(headers) == 1 and headers[0][0] == UNREADABLE:
        return (headers[0][1] or b"").decode("utf-8", "replace")
    return None

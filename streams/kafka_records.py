"""Records aiokafka's reader refuses, read leniently instead of raised.

aiokafka decodes each record header's name as UTF-8 and raises `UnicodeDecodeError` on one
that is not, from inside the consumer's fetch. The broker does not check header names (Java
decodes them leniently; librdkafka, Go and kcat send any bytes), so one such record, from
any producer, made every `getmany` of its partition raise: the worker stopped at every start,
every member of the group alike, and every reader with it.

The consumer's fetched records and its per-partition record iterator are replaced (`install`,
once per process). When aiokafka cannot read a batch, that batch is read again from its bytes
by aiokafka's own pure-Python reader with header names decoded leniently (bytes that are not
UTF-8 as `\\xNN` escapes): every record of it is delivered, the odd header's record too (its
value is what the worker judges). Should even that fail, each offset of the batch not yet
delivered comes as a stand-in (no key, no value, one header naming why: `UNREADABLE`), which
`record_of` turns into a `Record` whose `unreadable` says why; the worker dead-letters it
with its offset and every reader passes it.

This leans on aiokafka 0.14's fetcher (`MemoryRecords` and `PartitionRecords`, looked up by
name when a fetch lands), which is why the dependency is pinned exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, SupportsIndex

from aiokafka.consumer import fetcher
from aiokafka.record.default_records import _DefaultRecordBatchPy
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import ConsumerRecord

# The header a stand-in carries, its value why the record could not be read. The NUL makes
# it a name no well-behaved producer uses; a stand-in also has neither key nor value.
UNREADABLE = "\x00turnstile.unreadable"


class _Fetched:
    """A partition's fetched records, keeping the bytes they came in and where the batch last
    handed out lies in them."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._records = MemoryRecords(raw)
        self._at = self._end = 0
        self.batch: Any = None

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        self.batch = self._records.next_batch()
        self._at = self._end  # batches come in the order of their bytes, none skipped
        self._end = self._at + 12 + int.from_bytes(self._raw[self._at + 8 : self._at + 12], "big", signed=True)
        return self.batch

    @property
    def batch_bytes(self) -> bytes:
        return bytes(self._raw[self._at : self._end])

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())


class _HeaderName(bytes):
    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes.decode(self, encoding, "backslashreplace")


class _LenientBuffer(bytearray):
    """What the pure-Python reader slices a header's name from: decodes leniently."""

    def __getitem__(self, index: SupportsIndex | slice) -> Any:
        got = bytearray.__getitem__(self, index)
        return _HeaderName(got) if isinstance(index, slice) else got


class _LenientBatch(_DefaultRecordBatchPy):  # type: ignore[misc]
    _buffer: bytearray

    def _maybe_uncompress(self) -> None:
        super()._maybe_uncompress()
        if type(self._buffer) is not _LenientBuffer:
            self._buffer = _LenientBuffer(self._buffer)


class _TolerantPartitionRecords(fetcher.PartitionRecords):  # type: ignore[misc]
    next_fetch_offset: int  # the base's: where the next fetch of the partition starts
    _tp: Any

    def __init__(self, tp: Any, records: Any, *rest: Any) -> None:
        self._fetched = records
        super().__init__(tp, records, *rest)

    def _unpack_records(self) -> Iterator[ConsumerRecord[Any, Any]]:
        while True:
            try:
                yield from super()._unpack_records()
                return
            except UnicodeDecodeError as exc:
                yield from self._read_leniently(exc)
                self.next_fetch_offset = self._fetched.batch.next_offset

    def _read_leniently(self, exc: UnicodeDecodeError) -> Iterator[ConsumerRecord[Any, Any]]:
        batch = self._fetched.batch
        try:
            records = list(_LenientBatch(self._fetched.batch_bytes))
        except Exception:  # not even so: the offsets not yet delivered are stand-ins
            why = f"the Kafka client could not read this record: {exc}".encode()
            for offset in range(max(self.next_fetch_offset, batch.base_offset), batch.next_offset):
                self.next_fetch_offset = offset + 1
                yield ConsumerRecord(
                    self._tp.topic, self._tp.partition, offset, batch.first_timestamp, 0, None, None, None,
                    -1, -1, ((UNREADABLE, why),),
                )  # fmt: skip
            return
        for record in records:
            if record.offset >= self.next_fetch_offset:
                self.next_fetch_offset = record.offset + 1
                yield self._consumer_record(self._tp, record)


def install() -> None:
    """From now on every consumer of this process reads what aiokafka's reader refuses."""
    fetcher.MemoryRecords = _Fetched
    fetcher.PartitionRecords = _TolerantPartitionRecords


def unreadable(key: bytes | None, headers: tuple[tuple[str, bytes | None], ...]) -> str | None:
    """Why a record without a value is a stand-in for one the client could not read, or None."""
    if key is None and len(headers) == 1 and headers[0][0] == UNREADABLE:
        return (headers[0][1] or b"").decode("utf-8", "replace")
    return None

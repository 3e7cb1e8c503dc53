"""The embedded log: Kafka's model (topics, partitions, offsets, keyed appends) on local
files, for one process and no broker.

Each partition is an append-only file of JSON lines; a record's offset is its line
number. Appends take an exclusive lock, so `turnstile send` in another process can
append while a worker tails. One process owns the log (folds it and writes its effects):
`start` takes an exclusive lock on `owner.lock` in the folder, holding the owner's pid, and
fails with `LogOwned` while another process holds it; readers and publishers take none.

Partitioning is Kafka's own (murmur2 of the key), so a conversation lands in the partition
Kafka would give it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from pathlib import Path

import orjson

from turnstile.streams.log import (
    BROKER_DEFAULT_MAX_MESSAGE_BYTES,
    Acknowledged,
    Landed,
    LogOwned,
    PartitionStart,
    ReadTooLarge,
    RebalanceListener,
    Record,
    RecordRefused,
    Topics,
    partition_for,
    value_limit,
)

__all__ = ["FileLog", "FileReader", "LogOwned", "partition_for"]

# Records one poll returns at most, over all partitions (each is decoded before the worker
# can yield), and the bytes a partition reader reads at a time.
POLL_RECORDS = 256
_READ_BYTES = 256 << 10
# Records a whole-partition read hands on at a time (`read_partitions`, `read_all`).
READ_CHUNK = 10_000


class _OwnerLock:
    """`owner.lock` in the log's folder, held (flock) by the one process that owns the log.
    The kernel lets it go when that process ends, however it ends: no stale lock to clear."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "owner.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise LogOwned(f"the embedded log {self.path.parent} is owned by another process (pid {owner})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


class _PartitionFile:
    """Appends to one partition file and knows how many records it holds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        self._scanned_bytes = 0
        self._count = 0

    def _catch_up(self) -> None:
        # Other processes may have appended since we last looked: count their lines.
        with open(self.path, "rb") as reader:
            reader.seek(self._scanned_bytes)
            tail = reader.read()
        complete = tail.rfind(b"\n") + 1
        self._count += tail.count(b"\n", 0, complete)
        self._scanned_bytes += complete

    def append(self, line: bytes) -> int:
        with open(self.path, "ab") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                self._catch_up()
                fh.write(line + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
                offset = self._count
                self._count += 1
                self._scanned_bytes += len(line) + 1
                return offset
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def end_offset(self) -> int:
        self._catch_up()
        return self._count


class _PartitionReader:
    """Tails one partition file from a given offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.position = 0
        self._byte_pos = 0

    def seek(self, offset: int) -> None:
        """Read on from record `offset` (or the end, if the file holds fewer)."""
        self.position = self._byte_pos = 0
        with open(self.path, "rb") as fh:
            for line in fh:
                if self.position >= offset or not line.endswith(b"\n"):
                    break
                self.position += 1
                self._byte_pos += len(line)

    def read(self, partition: int, limit: int) -> list[Record]:
        with open(self.path, "rb") as fh:
            fh.seek(self._byte_pos)
            chunk = fh.read(_READ_BYTES)
            while chunk and b"\n" not in chunk:  # one record longer than the read size
                more = fh.read(_READ_BYTES)
                if not more:
                    break
                chunk += more
        records: list[Record] = []
        start = 0
        while len(records) < limit:
            end = chunk.find(b"\n", start)
            if end < 0:
                break  # a line still being written is read next time
            key, value, headers = _decode_line(chunk[start:end])
            records.append(Record(partition, self.position, key, value, headers))
            self.position += 1
            start = end + 1
        self._byte_pos += start
        return records


def _encode_line(key: str | None, value: bytes, headers: Mapping[str, str] | None = None) -> bytes:
    row: dict[str, object] = {"key": key}
    try:
        row["value"] = value.decode("utf-8")
    except UnicodeDecodeError:
        row["value_b64"] = base64.b64encode(value).decode("ascii")
    if headers:
        row["headers"] = dict(headers)
    return orjson.dumps(row)


def _decode_line(line: bytes) -> tuple[bytes | None, bytes, tuple[tuple[str, bytes], ...]]:
    row = orjson.loads(line)
    value = row["value"].encode() if "value" in row else base64.b64decode(row["value_b64"])
    headers = tuple((name, text.encode()) for name, text in row.get("headers", {}).items())
    key = row["key"]
    return None if key is None else key.encode(), value, headers


class FileLog:
    """One consumer that owns every partition of the events topic, plus appends to any topic."""

    def __init__(self, directory: Path, topics: Topics = Topics(), partitions: int = 4) -> None:
        self.directory = directory
        self.topics = topics
        self.partitions = partitions
        self._files: dict[tuple[str, int], _PartitionFile] = {}
        self._readers: dict[int, _PartitionReader] = {}
        self._committed_path = directory / topics.events / "committed.json"
        self._owner = _OwnerLock(directory)

    def own(self) -> None:
        """Become the log's one owner, or raise `LogOwned` naming the owner's pid. `start`
        does it; a command may do it sooner, to refuse before it starts anything else."""
        self._owner.acquire()

    def _file(self, topic: str, partition: int) -> _PartitionFile:
        handle = self._files.get((topic, partition))
        if handle is None:
            handle = self._files[(topic, partition)] = _PartitionFile(self.directory / topic / f"{partition}.log")
        return handle

    def _partition_count(self, topic: str) -> int:
        return self.partitions if topic in (self.topics.events, self.topics.snapshots, self.topics.heads) else 1

    def partition_count(self) -> int:
        return self.partitions

    def partition_for(self, key: str) -> int:
        return partition_for(key, self.partitions)

    def end_offset(self, partition: int) -> int:
        return self._file(self.topics.events, partition).end_offset()

    async def read_position(self, partition: int) -> None:
        return None  # every offset of the embedded log is a record

    def reader(self) -> FileReader:
        return FileReader(self)

    async def start_producer(self) -> None:
        return None  # appends open their file each time; a publisher owns nothing

    async def start(self, listener: RebalanceListener) -> None:
        self.own()
        committed = self.committed_offsets()
        starts = {}
        for p in range(self.partitions):
            self._readers[p] = _PartitionReader(self._file(self.topics.events, p).path)
            starts[p] = PartitionStart(self._file(self.topics.events, p).end_offset(), committed.get(p, 0))
        self.take(await listener.on_assigned(starts))

    def seek(self, partition: int, offset: int) -> None:
        """Where `poll` reads the events partition from next (as Kafka's consumer seek)."""
        self._readers[partition].seek(offset)

    def take(self, positions: Mapping[int, int]) -> None:
        for p, offset in positions.items():
            self.seek(p, offset)

    async def poll(self, timeout_s: float) -> list[Record]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            # A poll is not a yield point of the consumer loop: decoding is bounded per poll.
            share = max(1, POLL_RECORDS // max(1, len(self._readers)))
            records = [r for p, reader in self._readers.items() for r in reader.read(p, share)]
            if records or asyncio.get_running_loop().time() >= deadline:
                return records
            await asyncio.sleep(min(0.02, max(0.0, deadline - asyncio.get_running_loop().time())))

    async def append(
        self,
        topic: str,
        key: str | None,
        value: bytes,
        partition: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, int]:
        if len(value) > (limit := self.max_value_bytes(topic, key)):
            raise RecordRefused(f"a record of {len(value):,} bytes is over what {topic} takes ({limit:,})")
        if partition is None:
            partition = partition_for(key or "", self._partition_count(topic))
        return partition, self._file(topic, partition).append(_encode_line(key, value, headers))

    def max_value_bytes(self, topic: str, key: str | None) -> int:
        # A line of a file could be any size; the limit is a default broker's, so that a value
        # taken here is one every reader (and Kafka) takes too.
        return value_limit(BROKER_DEFAULT_MAX_MESSAGE_BYTES, key)

    async def send(
        self, topic: str, key: str, value: bytes, partition: int | None = None
    ) -> asyncio.Future[Acknowledged]:
        acked: asyncio.Future[Acknowledged] = asyncio.get_running_loop().create_future()
        acked.set_result(Landed(*await self.append(topic, key, value, partition)))  # written at once
        return acked

    async def commit(self, offsets: dict[int, int]) -> None:
        merged = self.committed_offsets() | offsets
        self._committed_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._committed_path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps({str(k): v for k, v in merged.items()}))
        tmp.replace(self._committed_path)

    def committed_offsets(self) -> dict[int, int]:
        if not self._committed_path.exists():
            return {}
        return {int(k): v for k, v in orjson.loads(self._committed_path.read_bytes()).items()}

    async def flush(self) -> None:
        return None  # appends are written and fsynced before they return

    async def stop(self) -> None:
        self._readers.clear()
        self._owner.release()

    async def follow(self, topic: str, from_end: bool, poll_s: float = 0.02) -> AsyncIterator[Record]:
        """The records of `topic` as they are appended (from now on, or from its start),
        partition by partition, until cancelled; for readers beside the worker."""
        readers = [
            (p, _PartitionReader(self.directory / topic / f"{p}.log")) for p in range(self._partition_count(topic))
        ]
        if from_end:
            for p, reader in readers:
                while reader.path.exists() and reader.read(p, READ_CHUNK):
                    pass
        while True:
            quiet = True
            for p, reader in readers:
                if reader.path.exists() and (batch := reader.read(p, 1000)):
                    quiet = False
                    for record in batch:
                        yield record
            if quiet:
                await asyncio.sleep(poll_s)

    async def read_partitions(
        self, topic: str, partitions: list[int], starts: Mapping[int, int] | None = None
    ) -> AsyncGenerator[list[Record], None]:
        first = starts or {}
        for p in partitions:
            path = self.directory / topic / f"{p}.log"
            reader = _PartitionReader(path) if path.exists() else None
            while reader is not None and (batch := reader.read(p, READ_CHUNK)):
                if chunk := [r for r in batch if r.offset >= first.get(p, 0)]:
                    yield chunk

    async def read_at(self, topic: str, partition: int, offsets: list[int]) -> dict[int, Record]:
        wanted, out = set(offsets), dict[int, Record]()
        records = self.read_partitions(topic, [partition], {partition: min(wanted, default=0)})
        async with contextlib.aclosing(records):
            async for chunk in records:
                out.update((r.offset, r) for r in chunk if r.offset in wanted)
                if len(out) == len(wanted):
                    break
        return out

    def read_all(self, topic: str, partition: int | None = None) -> list[Record]:
        """Every record of a topic (or of one of its partitions), partition by partition."""
        out: list[Record] = []
        for p in range(self._partition_count(topic)) if partition is None else (partition,):
            path = self.directory / topic / f"{p}.log"
            if path.exists():
                reader = _PartitionReader(path)
                while batch := reader.read(p, READ_CHUNK):
                    out.extend(batch)
        return out

    def conversation_records(self, conversation_id: str) -> list[Record]:
        """The events topic's records of the conversation's partition."""
        return self.read_all(self.topics.events, self.partition_for(conversation_id))


class FileReader:
    """The embedded log's `LogReader`: reading files is blocking I/O, so whole reads run in
    a thread and the loop keeps serving."""

    def __init__(self, log: FileLog) -> None:
        self._log = log

    async def read(self, topic: str, timeout_s: float = 30.0) -> list[Record]:
        return await asyncio.to_thread(self._log.read_all, topic)

    async def conversation(self, conversation_id: str, timeout_s: float = 30.0) -> list[Record]:
        return await asyncio.to_thread(self._log.conversation_records, conversation_id)

    async def span(self, topic: str, partition: int, start: int, end: int, timeout_s: float = 30.0) -> list[Record]:
        records = await asyncio.to_thread(self._log.read_all, topic, partition)
        return [r for r in records if start <= r.offset < end]

    async def tail(
        self, topic: str, partition: int, start: int, max_records: int | None = None, timeout_s: float = 30.0
    ) -> list[Record]:
        # A partition file has no offset index: it is read whole (the embedded log is for one
        # process, whose worker serves its reads from memory) and the bound checked after.
        records = [r for r in await asyncio.to_thread(self._log.read_all, topic, partition) if r.offset >= start]
        if max_records is not None and len(records) > max_records:
            raise ReadTooLarge([partition], len(records), max_records)
        return records

    async def partition_of(self, conversation_id: str, timeout_s: float = 30.0) -> int:
        return self._log.partition_for(conversation_id)

    def follow(self, topic: str, since_ms: int) -> AsyncIterator[Record]:
        # One process, no record times: nothing it follows was written before it started.
        return self._log.follow(topic, from_end=True)

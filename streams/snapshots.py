"""Snapshots of conversation state on a compacted topic, the way Kafka Streams keeps a
state store: taking a partition over costs its snapshots plus the events since, not the
whole history.

The snapshot topic is co-partitioned with the events topic and keyed by conversation id;
compaction keeps the latest snapshot of each conversation. A snapshot is the folded state
and `covered`, an offset of the events partition: the state includes every event of its
conversation at or below it. Beside them each partition has a *watermark* record (empty
key): "every conversation with an event below W has a snapshot, written before this
record, that includes its events below W". A new owner

1. reads the snapshot partition (`PartitionLoad`): per conversation the decodable
   snapshot covering most (every writer folds the same log, so each is a true state at
   its offset), and the latest watermark;
2. reads the events partition from the watermark, skipping each event at or below its
   conversation's covered offset (`Loaded.folded_already`): the fold is applied once per
   offset, so an at-least-once snapshot never applies an event twice;
3. goes back further where the watermark cannot vouch for a conversation: one whose
   snapshots do not decode (folded from offset 0, counted and logged), or whose usable
   snapshot covers less than the watermark and was written after it or beside a broken
   one (compaction may have dropped the record the watermark vouched for).

Why a watermark and not only the smallest covered offset: a conversation idle for a month
has a month-old snapshot, and the minimum would drag every replay back a month.

Writing (`Snapshotter`) happens at the worker's checkpoints, never in a turn: a
conversation is due when it has been quiet for `idle_ms` or after `every_events` of its
events, and is taken only once the one-time effects (outcome records, dead letters) of all
its events are on the log -- a new owner skips what a snapshot covers, effects included.
The states are encoded on the loop (they are the loop's), the sends and acknowledgements
run in one background task, which writes a partition's watermark only once every snapshot
before it is acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from turnstile.events import Event
from turnstile.projections import ConversationState, Status, conversation_status
from turnstile.projections.snapshot import (
    WATERMARK_KEY,
    SnapshotError,
    decode_snapshot,
    decode_watermark,
    encode_snapshot,
    encode_watermark,
    peek_snapshot,
)
from turnstile.projections.snapshot_head import Head, decode_head, encode_head, head_of
from turnstile.streams.eviction import SETTLED
from turnstile.streams.log import EventLog, Record
from turnstile.streams.state_store import Checkpoint, StateStore, Stored

log = logging.getLogger(__name__)


# The longest a revoke or a stop waits for snapshots in flight.
DRAIN_S = 10.0
# Records (or rows of the store) a load takes in between two runs of the rest of the loop.
LOAD_SLICE = 1_000
# States a load decodes between two runs of the rest of the loop.
DECODES_A_SLICE = 100
# The unfilled rows a new owner puts in its store in one transaction: fewer a transaction cost
# more each (random keys: ≈ 22 µs a row at 1,000 against ≈ 14 at 5,000), ≈ 70 ms of loop each.
LOAD_PUT_ROWS = 5_000


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    enabled: bool = True
    # A conversation is snapshotted once it has been quiet this long, or after this many of
    # its events since its last snapshot, whichever comes first.
    idle_ms: int = 2_000
    every_events: int = 500
    # Encoding work per capture, on the event loop (every other task waits meanwhile): at most
    # this many snapshots and this long (None: no time bound); what is left is captured at
    # the worker's next steps, once the write before it is acknowledged. 4 ms: a GET that
    # waits for a capture must still be answered within 10 ms.
    max_per_checkpoint: int = 2_000
    max_capture_s: float | None = 0.004


# -- loading -----------------------------------------------------------------------------------
@dataclass(slots=True)
class Loaded:
    """What a newly assigned partition starts from."""

    seek: int  # read the events partition from here
    covered: dict[str, int]  # conversation -> the offset its snapshot covers
    # The states to hold in memory from the start: all of them without a local store, else
    # those with something to decide (the others wait in the store until an event comes).
    resident: dict[str, ConversationState]
    # The others (conversation, status), for the worker to tell its observers about once.
    stored: list[tuple[str, Status]]
    ignored: list[str]  # conversations whose snapshots did not decode (folded from offset 0)
    # The latest watermark read and its offset in the snapshot topic (-1: none).
    watermark: int = 0
    watermark_source: int = -1
    read_to: int = 0  # the snapshots (or heads) were read up to here
    restart: bool = False  # loaded from the local store's checkpoint and what followed it
    # Past this offset no snapshot covers anything: the skip test is over.
    _skip_until: int = -1

    def __post_init__(self) -> None:
        self._skip_until = max(self.covered.values(), default=-1)

    def folded_already(self, record: Record) -> bool:
        """The record is an event its conversation's snapshot includes."""
        if record.offset > self._skip_until:
            self.covered.clear()  # no longer needed: let it go
            return False
        return self.covers(record)

    def covers(self, record: Record) -> bool:
        """`folded_already`, asked ahead of the fold (it changes nothing)."""
        if record.offset > self._skip_until or record.key is None:
            return False
        covered = self.covered.get(record.key.decode("utf-8", "replace"))
        return covered is not None and record.offset <= covered


@dataclass(slots=True)
class _Found:
    """Of one conversation: its decodable snapshot (or head) covering most, so far."""

    covered: int = -1  # -1: none yet
    state: ConversationState | None = None  # None with a status: a head or a row of the store, not decoded
    value: bytes | None = None  # the snapshot (None: with a store, still on the snapshot topic)
    source: int = -1  # its offset in the topic read (the heads topic with a store, else the snapshot topic)
    broken: bool = False  # some record of it did not decode
    status: Status = "idle"
    fresh: bool = True  # read from the topic now (not a row the store holds already)
    head: Head | None = None  # with a store, until its row is put


class PartitionLoad:
    """A newly assigned partition's snapshot records, taken in chunk by chunk as they are read
    (put in `store`, if given): where its events partition must be read from, and the
    states it starts with (`finish`).

    With a store, the records are the *heads* topic's (`projections/snapshot_head.py`), not
    the snapshots: a settled conversation's head goes into the store as an unfilled row as
    soon as its chunk is read (its snapshot is fetched after the partition is live,
    `streams/snapshot_fill.py`), and only the conversations with something to decide need
    their snapshots before (`wanted`, `fetched`). So what the load reads grows with the
    conversations, not with their history. With the store's checkpoint `mark`, the heads are
    those from `mark.heads_to` on, over the rows the store holds (`take_stored`, a slice at
    a time before the heads). Without a store, every
    state is needed in memory: the snapshot topic is read and every snapshot decoded.
    """

    rows_slice = LOAD_SLICE  # rows of the store taken at a time (`take_stored`)

    def __init__(self, topic: str, partition: int, store: StateStore | None = None, mark: Checkpoint | None = None):
        self.topic, self.partition, self.store = topic, partition, store
        self.found: dict[str, _Found] = {}
        self.watermark, self.watermark_source = 0, -1
        self.read_to = mark.heads_to if mark is not None else 0  # past the last record taken in
        self.restart = mark is not None
        # From the store's checkpoint, its rows come first (`take_stored`), then the heads.
        self.rows_taken = store is None or mark is None
        self._rows_after: str | None = None  # the last of them taken
        self._unput: list[Stored] = []  # settled heads not in the store yet (`_put`)
        if store is not None and mark is not None:
            self.watermark, self.watermark_source = mark.watermark, mark.watermark_source

    def take_stored(self) -> None:
        """From the store's checkpoint: the next slice of the rows the store holds of the
        partition, `rows_taken` once it was the last."""
        assert self.store is not None and not self.rows_taken, "the store's rows are taken once, before the heads"
        rows = self.store.rows(self.partition, without_value=SETTLED, after=self._rows_after, limit=self.rows_slice)
        for row in rows:
            head = None if row.status in SETTLED else row.head  # what `wanted` needs of one to decode
            self.found[row.conversation] = _Found(row.covered, None, row.value, row.source, False, row.status,
                                                  False, head)  # fmt: skip
        self._rows_after = rows[-1].conversation if rows else self._rows_after
        self.rows_taken = len(rows) < self.rows_slice

    def add(self, records: list[Record]) -> None:
        """The next records of the partition, in its order (after the store's rows: a row
        taken later would replace a newer head with an older one)."""
        assert self.rows_taken, "the store's rows come before the heads that follow its checkpoint"
        if not records:
            return
        self.read_to = records[-1].offset + 1
        # With a store, only the snapshots' heads are read: a settled conversation stays out
        # of memory, so its state -- which grows with its transcript -- is not decoded at all.
        touched: dict[str, None] = {}
        self.watermark, self.watermark_source = _scan(
            self.topic, self.partition, records, self.found, self.watermark, self.watermark_source,
            heads=self.store is not None, touched=touched,
        )  # fmt: skip
        if self.store is not None:
            self._unput.extend(self._settled_in(touched))
            if len(self._unput) >= LOAD_PUT_ROWS:
                self._put()

    def _put(self) -> None:
        """The settled heads taken in so far, into the store (unfilled rows)."""
        assert self.store is not None
        unput, self._unput = self._unput, []
        self.store.put(unput)

    def _settled_in(self, conversations: Iterable[str]) -> Iterator[Stored]:
        """The unfilled rows of these conversations that are settled, each once; their
        heads leave `found` (what the seek needs of them stays)."""
        for key in conversations:
            entry = self.found.get(key)
            if entry is not None and entry.fresh and entry.head is not None and entry.status in SETTLED:
                yield Stored(entry.head, self.partition, entry.source, None)
                entry.head, entry.fresh = None, False

    def wanted(self) -> list[int]:
        """The snapshot-topic offsets of the snapshots to fetch before `finish`: those of the
        conversations with something to decide that are not here yet."""
        return [e.head.at for e in self.found.values() if e.head is not None and e.value is None and e.covered >= 0]

    def fetched(self, records: dict[int, Record]) -> None:
        """The records at the `wanted` offsets (one missing: not on the topic any more). A
        snapshot that is missing, does not decode or is not the one its head names makes its
        conversation one with no usable snapshot: it is folded from offset 0."""
        for key, entry in self.found.items():
            if entry.head is None or entry.value is not None or entry.covered < 0:
                continue
            record = records.get(entry.head.at)
            peeked = peek_snapshot(record.value, key) if record is not None else SnapshotError("not on the topic")
            if isinstance(peeked, SnapshotError) or peeked.covered != entry.covered:
                detail = peeked.detail if isinstance(peeked, SnapshotError) else f"it covers {peeked.covered}"
                log.warning("the snapshot of %r that its head names (partition %d @%d) is unusable: %s", key,
                            self.partition, entry.head.at, detail)  # fmt: skip
                entry.covered, entry.broken = -1, True
            else:
                entry.value = record.value if record is not None else None

    async def finish(self) -> Loaded:
        """Where the partition's events are read from and what it starts with. A walk of
        every conversation of the partition: the loop runs every `LOAD_SLICE` of them."""
        assert self.rows_taken, "the store's rows are part of the load"
        found, store, partition = self.found, self.store, self.partition
        if store is not None:
            self._put()
            decoded = 0
            for n, (key, entry) in enumerate(found.items(), 1):  # the rows that stay out of memory are not decoded
                if entry.state is None and entry.covered >= 0 and entry.status not in SETTLED:
                    _decode_row(self.topic, partition, key, entry)
                    decoded += 1
                    if decoded % DECODES_A_SLICE == 0:  # (a state decodes in 0.05-0.5 ms)
                        await asyncio.sleep(0)
                await _every_slice(n)
        watermark, watermark_source = self.watermark, self.watermark_source
        seek, ignored = watermark, []
        resident, stored = {}, []
        for n, (key, entry) in enumerate(found.items(), 1):
            if entry.covered < 0:
                ignored.append(key)
            elif store is None or entry.status not in SETTLED:
                if entry.state is not None:
                    resident[key] = entry.state
            else:
                stored.append((key, entry.status))
            seek = min(seek, _reads_from(entry, watermark, watermark_source))
            await _every_slice(n)
        if ignored:
            log.warning("%d conversation(s) of partition %d have no usable snapshot: replaying it from 0",
                        len(ignored), partition)  # fmt: skip
        # Only those the events read from `seek` on can hold an event a snapshot covers.
        covered = {}
        for n, (key, entry) in enumerate(found.items(), 1):
            if entry.covered >= seek:
                covered[key] = entry.covered
            await _every_slice(n)
        if store is None:
            return Loaded(seek, covered, resident, [], ignored, watermark, watermark_source, self.read_to)
        # A stored row of a conversation folded from 0 would be an older state than the
        # fold's: it goes, and with it the checkpoint, which would vouch for rows without it
        # to a load that follows this one before the partition is taken (a rebalance, a stop).
        if ignored:
            store.drop_checkpoint(partition)
        store.forget(ignored)
        store.put(Stored(e.head, partition, e.source, e.value) for e in found.values()
                  if e.covered >= 0 and e.fresh and e.head)  # fmt: skip
        return Loaded(seek, covered, resident, stored, ignored, watermark, watermark_source, self.read_to, self.restart)


async def _every_slice(n: int) -> None:
    """The loop runs once every `LOAD_SLICE` steps of a walk."""
    if n % LOAD_SLICE == 0:
        await asyncio.sleep(0)


def _decode_row(topic: str, partition: int, key: str, entry: _Found) -> None:
    """A snapshot (a stored row, or one whose head only was read) that must be in memory. One
    whose state does not decode (a damaged file) is dropped: the conversation is folded from
    the log instead."""
    snapshot = decode_snapshot(entry.value, key) if entry.value is not None else SnapshotError("not fetched")
    if isinstance(snapshot, SnapshotError):
        log.warning("the snapshot of %r (%s[%d]) does not decode: %s", key, topic, partition,
                    snapshot.detail)  # fmt: skip
        entry.covered, entry.broken = -1, True
    else:
        entry.state = snapshot.state


@dataclass(frozen=True, slots=True)
class Start:
    """Where a reader of one conversation begins: the state of its snapshot (None: a new
    state) and the events offset from which its partition is read."""

    state: ConversationState | None
    offset: int


def start_of(conversation: str, topic: str, partition: int, records: list[Record]) -> Start:
    """From the records of the conversation's partition of the snapshot topic, by the rule of
    `PartitionLoad`: its snapshot covering most, and where its events must be read from.
    Only its own snapshots are decoded."""
    entry, offset, _vouched = _one(conversation, topic, partition, records, heads=False)
    return Start(entry.state if entry is not None else None, offset)


def head_start(conversation: str, topic: str, partition: int, records: list[Record]) -> tuple[Head | None, int] | None:
    """From the records of the conversation's partition of the heads topic, by the rule of
    `PartitionLoad`: its head covering most (None: none, or none that decodes) and where its
    events must be read from (past what that head's snapshot covers). None when the heads
    have no watermark: nothing vouches that a conversation without a head has no snapshot
    (one written before heads existed, or by a worker without a local store)."""
    entry, offset, vouched = _one(conversation, topic, partition, records, heads=True)
    if not vouched:
        return None
    return entry.head if entry is not None else None, offset


def _one(
    conversation: str, topic: str, partition: int, records: list[Record], heads: bool
) -> tuple[_Found | None, int, bool]:
    """Of one conversation: what it has on the topic (None: nothing), where its events must be
    read from, and whether a watermark was found."""
    found: dict[str, _Found] = {}
    watermark, watermark_source = _scan(topic, partition, records, found, only=conversation, heads=heads)
    entry = found.get(conversation)
    if entry is None:
        return None, watermark, watermark_source >= 0  # the watermark vouches: it has no event below it
    return entry, _reads_from(entry, watermark, watermark_source), watermark_source >= 0


def _scan(
    topic: str,
    partition: int,
    records: list[Record],
    found: dict[str, _Found],
    watermark: int = 0,
    watermark_source: int = -1,
    only: str | None = None,
    heads: bool = False,
    touched: dict[str, None] | None = None,
) -> tuple[int, int]:
    """Into `found`, per conversation (or only `only`) its snapshot covering most; returns
    the latest watermark (else `watermark`) and its offset in the topic. `heads`: the
    records are the heads topic's (`projections/snapshot_head.py`), not snapshots.
    `touched`: gets the conversations whose entries these records changed."""
    for record in records:
        key = (record.key or b"").decode("utf-8", "replace")
        if key == WATERMARK_KEY:
            decoded = decode_watermark(record.value)
            if isinstance(decoded, SnapshotError):
                where = f"{topic}[{partition}]@{record.offset}"
                log.warning("ignored the watermark at %s: %s", where, decoded.detail)
            else:
                watermark, watermark_source = decoded, record.offset
            continue
        if only is not None and key != only:
            continue
        entry = found.get(key)
        if entry is None:
            entry = found[key] = _Found()
        snapshot = decode_head(record.value, key) if heads else decode_snapshot(record.value, key)
        if isinstance(snapshot, SnapshotError):
            log.warning(
                "ignored the snapshot of %r at %s[%d]@%d: %s", key, topic, partition, record.offset, snapshot.detail
            )
            entry.broken = True
        elif snapshot.covered >= entry.covered:
            entry.covered, entry.source, entry.fresh = snapshot.covered, record.offset, True
            if touched is not None:
                touched[key] = None
            if isinstance(snapshot, Head):
                entry.head, entry.status, entry.state, entry.value = snapshot, snapshot.status, None, None
            else:
                entry.state, entry.value = snapshot.state, record.value
                entry.status = conversation_status(snapshot.state)
    return watermark, watermark_source


def _reads_from(entry: _Found, watermark: int, watermark_source: int) -> int:
    """The first events offset a conversation needs beyond its snapshot. The watermark
    vouches for the events below it unless the snapshot that covers most was written after
    it, or beside a broken one (compaction may have dropped the one it vouched for)."""
    if entry.covered < 0:
        return 0  # no snapshot of it decodes: from the start
    if entry.covered < watermark - 1 and (entry.source > watermark_source or entry.broken):
        return entry.covered + 1
    return max(entry.covered + 1, watermark)


# -- writing -----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Dirty:
    """A conversation changed since its last snapshot."""

    first: int  # offset of its first event since then
    last: int  # and of its latest
    events: int
    last_ms: int  # when the latest was folded


@dataclass(slots=True)
class _Captured:
    conversation: str
    value: bytes
    dirty: _Dirty
    head: Head  # its `at` is known once the snapshot is on the topic


@dataclass(slots=True)
class _Partition:
    # In the order of `_Dirty.first`: a partition's records are folded in offset order, so
    # inserting keeps it (`Snapshotter._redo`, which puts older changes back, sorts again),
    # and the partition's watermark is its first entry's, not a scan of them all.
    dirty: dict[str, _Dirty] = field(default_factory=dict)
    watermark: int = 0  # the last one written (or found) for the partition
    # For the store's checkpoint: the snapshot-topic offset below which every record is one
    # the store holds (read at the assignment, or written by this worker and acknowledged:
    # a record of another writer in between -- a late one of the previous owner -- stops it
    # there, and the next assignment reads on from it); the acknowledged offsets beyond it.
    complete_to: int = 0
    acked: set[int] = field(default_factory=set)
    latest_watermark: tuple[int, int] = (0, -1)  # (watermark, its offset in the topic)
    # Conversations found over the snapshot topic's limit -> whether a turn was active then.
    # A state grows with its history, so one found so with no turn active is not tried again
    # while the partition is owned (encoding it at every capture cost a core and the capture's
    # time bound, starving the others); one with a turn active is tried again once the turn
    # has ended, which drops the turn's journal from the state.
    too_large: dict[str, bool] = field(default_factory=dict)

    def landed(self, offset: int) -> None:
        self.acked.add(offset)
        while self.complete_to in self.acked:
            self.acked.discard(self.complete_to)
            self.complete_to += 1


class Snapshotter:
    """Tracks which conversations changed since their snapshot and writes snapshots and
    watermarks at the worker's checkpoints."""

    def __init__(
        self,
        log_: EventLog,
        policy: SnapshotPolicy,
        now_ms: Callable[[], int],
        store: StateStore | None = None,
        monotonic: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.log = log_
        self.policy = policy
        self._now_ms = now_ms
        self._monotonic = monotonic  # the capture's time bound
        self.behind = False  # the last capture stopped at its bound with snapshots still due
        self._first = 0  # the partition a capture starts with, in turn: none starves the rest
        self.store = store  # gets every snapshot once it is on the topic
        self._flying: frozenset[str] = frozenset()  # captured, not acknowledged yet
        self._partitions: dict[int, _Partition] = {}
        self._writing: asyncio.Task[None] | None = None
        self.written = 0  # snapshots acknowledged
        self.ignored = 0  # conversations found on assignment with no snapshot that decodes
        self.seeks: dict[int, int] = {}  # partition -> where its last assignment started reading
        self.restarts = 0  # partitions loaded from the store's checkpoint rather than the topic

    async def load(self, partitions: list[int]) -> dict[int, Loaded]:
        """The partitions' snapshots (with a store: their heads), read chunk by chunk; none (a
        full replay) when they cannot be read: a snapshot topic that is away must cost time,
        never the assignment."""
        if not partitions:
            return {}
        # With a store, the heads: the states of settled conversations follow after the load.
        topic = self.log.topics.heads if self.store is not None else self.log.topics.snapshots
        # A checkpoint of the store (a clean stop's, on this machine): read only what follows.
        # It stays until the partition is taken (`Residency.restore`): a load cut off (a
        # rebalance, a stop) has put some of the heads that follow it into the rows, and reading
        # them again from the checkpoint on puts the same rows (each conversation's latest head
        # last), so the next load may still start from it, not from the whole heads topic.
        marks = {p: mark for p in partitions if self.store is not None and (mark := self.store.checkpoint(p))}
        starts = {p: mark.heads_to for p, mark in marks.items()}
        if self.store is not None:
            self.store.drop_partitions(p for p in partitions if p not in marks)  # refilled from the topic
        loads = {}
        for p in partitions:
            load = loads[p] = PartitionLoad(topic, p, self.store, marks.get(p))
            while not load.rows_taken:  # a slice at a time: the loop runs between
                load.take_stored()
                await asyncio.sleep(0)
        read = 0
        try:
            records = self.log.read_partitions(topic, partitions, starts)
            async with contextlib.aclosing(records):
                async for chunk in records:
                    read += len(chunk) if chunk[0].partition in marks else 0
                    # A slice at a time, the loop running between (the embedded log's chunks
                    # are larger than the Kafka client's).
                    for at in range(0, len(chunk), LOAD_SLICE):
                        loads[chunk[0].partition].add(chunk[at : at + LOAD_SLICE])
                        await asyncio.sleep(0)
            for p, load in loads.items():  # the states of the conversations with something to decide
                if wanted := load.wanted():
                    load.fetched(await self.log.read_at(self.log.topics.snapshots, p, wanted))
        except Exception as exc:
            log.warning("reading the snapshots of partitions %s failed, replaying them from 0: %r", partitions, exc)
            if self.store is not None:
                self.store.drop_partitions(partitions)
            loads, marks = {p: PartitionLoad(topic, p) for p in partitions}, {}
        out = {}
        for p, load in loads.items():
            out[p] = await load.finish()
            await asyncio.sleep(0)  # (between partitions too: one of under 1,000 never yields)
        if marks:
            log.info("partitions %s start from the local store's checkpoint: %d heads read since",
                     sorted(marks), read)  # fmt: skip
        return out

    def taken(self, partition: int, loaded: Loaded) -> None:
        """The worker took the partition as `loaded` says: its snapshots are written from now
        on. (A load whose assignment was abandoned registers nothing: a clean stop would
        write a checkpoint for rows the worker never took.)"""
        latest = (loaded.watermark, loaded.watermark_source)
        self._partitions[partition] = _Partition(watermark=loaded.seek, complete_to=loaded.read_to,
                                                 latest_watermark=latest)  # fmt: skip
        self.ignored += len(loaded.ignored)
        self.seeks[partition] = loaded.seek
        self.restarts += loaded.restart

    def write_checkpoints(self) -> None:
        """At a clean stop, once the writes are drained: each partition's checkpoint in the
        store, so that a restart on this machine reads only what was written after it."""
        if self.store is None:
            return
        for p, part in self._partitions.items():
            watermark, source = part.latest_watermark
            self.store.write_checkpoint(p, Checkpoint(part.complete_to, watermark, source))

    def handed_over(self, partitions: Iterable[int]) -> None:
        """The partitions moved to another member: forget their changes (the next owner
        folds them from the log) and their rows in the store."""
        for p in partitions:
            self._partitions.pop(p, None)
        if self.store is not None:
            self.store.drop_partitions(partitions)

    def clean(self, partition: int, conversation: str) -> bool:
        """Its latest state is on the snapshot topic (and in the store, if any)."""
        part = self._partitions.get(partition)
        return part is not None and conversation not in part.dirty and conversation not in self._flying

    async def drain(self) -> None:
        """Wait for the write in flight, for a while: a broker that is away must not hold up a
        revoke or a stop. One cut short writes no watermark; its snapshots that land later are
        still true states (a new owner takes the one covering most)."""
        if self._writing is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(self._writing, return_exceptions=True), DRAIN_S)

    def drained(self) -> bool:
        """No write in flight."""
        return self._writing is None or self._writing.done()

    def pending(self, partition: int) -> bool:
        """Some change of the partition is not on the snapshot topic yet."""
        part = self._partitions.get(partition)
        writing = self._writing is not None and not self._writing.done()
        return writing or (part is not None and bool(part.dirty))

    # -- the worker's fold observer: what changed since the last snapshots ----------------------
    def folded(self, record: Record, event: Event, state: ConversationState, ignored: str | None) -> None:
        part = self._partitions.get(record.partition)
        if part is None:
            return
        dirty = part.dirty.get(state.conversation_id)
        if dirty is None:
            part.dirty[state.conversation_id] = _Dirty(record.offset, record.offset, 1, self._now_ms())
        else:
            dirty.last, dirty.events, dirty.last_ms = record.offset, dirty.events + 1, self._now_ms()

    def changed(self, partition: int, conversation: str, first: int, last: int) -> None:
        """The conversation's state was made outside the fold (folded again from the log up
        to `last`): it is due a snapshot as if it had changed at `first` (at most the fold's
        position: what the fold appends later must sort after it)."""
        part = self._partitions.get(partition)
        if part is not None and conversation not in part.dirty:
            latest = next(reversed(part.dirty.values()), None)
            part.dirty[conversation] = _Dirty(first, last, 1, self._now_ms())
            if latest is not None and latest.first > first:  # folded on meanwhile: keep the order by first
                part.dirty = dict(sorted(part.dirty.items(), key=lambda item: item[1].first))

    def forgotten(self, partition: int, conversations: set[str]) -> None:
        pass  # their partitions' changes were dropped at the handover (`handed_over`)

    def restored(self, state: ConversationState) -> None:
        pass  # its snapshot is the one just read: nothing changed

    def evicted(self, conversation: str, status: Status) -> None:
        pass  # evicted only once its snapshot is written

    def stored(self, partition: int, conversations: list[tuple[str, Status]]) -> None:
        pass  # their snapshots are the ones just read

    def checkpoint(
        self,
        positions: dict[int, int],
        done: dict[int, int],
        now_ms: int,
        state_of: Callable[[str], ConversationState | None],
        ready: Callable[[str], bool],
        final: bool = False,
    ) -> None:
        """Capture the snapshots due now. `positions`: where each live partition's states are
        folded to; `done`: below it every record's one-time effects are on the log.
        `ready(c)`: the worker owes nothing for `c` that a new owner could not see in its
        state (a refusal not yet written). `final`: everything that changed is due."""
        if self._writing is not None and not self._writing.done():
            return  # one write at a time: its watermarks must follow its own snapshots
        budget = None if final else self.policy.max_per_checkpoint
        bound_s = None if final else self.policy.max_capture_s
        until = self._monotonic() + bound_s if bound_s is not None else None
        self.behind = False
        captured: dict[int, list[_Captured]] = {}
        watermarks: dict[int, int] = {}
        order = sorted(positions)
        self._first = first = (self._first + 1) % max(1, len(order))
        for p in order[first:] + order[:first]:
            position = positions[p]
            part = self._partitions.get(p)
            if part is None:
                continue
            items = captured[p] = []
            # Walked in place, not copied: a capture that stops at its bound costs what it
            # looked at, not the partition's whole backlog of changes. The changes not due yet
            # (conversations in use, at the front: their first change is the oldest) are passed
            # over before the bound is looked at, so they cannot use it up and starve the due
            # ones behind them.
            for conversation, dirty in () if self.behind else part.dirty.items():
                due = final or dirty.events >= self.policy.every_events or now_ms - dirty.last_ms >= self.policy.idle_ms
                if not due or dirty.last >= done.get(p, 0):
                    continue
                if (budget is not None and budget <= 0) or (until is not None and self._monotonic() > until):
                    self.behind = True
                    break
                active_then = part.too_large.get(conversation)
                if active_then is False:
                    continue
                state = state_of(conversation)
                if state is None or not ready(conversation) or (active_then and state.active is not None):
                    continue
                value = encode_snapshot(state, position - 1)
                if not self._fits(conversation, value):
                    part.too_large[conversation] = state.active is not None
                    continue
                part.too_large.pop(conversation, None)
                items.append(_Captured(conversation, value, dirty, head_of(state, position - 1, 0)))
                if budget is not None:
                    budget -= 1
            for item in items:
                del part.dirty[item.conversation]
            # Never past a record whose one-time effect is not on the log yet (a dead letter of
            # a record of no conversation, say): a new owner starting there would not redo it.
            oldest = next(iter(part.dirty.values()), None)
            watermark = min(position if oldest is None else oldest.first, done.get(p, 0))
            if watermark > part.watermark:
                watermarks[p] = watermark
        captured = {p: items for p, items in captured.items() if items}
        if captured or watermarks:
            self._flying = frozenset(c.conversation for items in captured.values() for c in items)
            # Whose they are: a write still in flight when its partition is handed over and taken
            # again counts for nothing in the new ownership (its rows and offsets are the load's).
            owners = {p: part for p in captured.keys() | watermarks.keys() if (part := self._partitions.get(p))}
            self._writing = asyncio.create_task(self._write(captured, watermarks, owners), name="snapshots")

    def _fits(self, conversation: str, value: bytes) -> bool:
        limit = self.log.max_value_bytes(self.log.topics.snapshots, conversation)
        if limit is None or len(value) <= limit:
            return True
        log.warning("no snapshot of %r: %d bytes is over the topic's limit of %d; the watermark waits for it, and "
                    "it stays in memory",
                    conversation, len(value), limit)  # fmt: skip
        return False

    async def _write(
        self, captured: dict[int, list[_Captured]], watermarks: dict[int, int], owners: dict[int, _Partition]
    ) -> None:
        try:
            await self._write_partitions(captured, watermarks, owners)
        finally:
            self._flying = frozenset()

    async def _write_partitions(
        self, captured: dict[int, list[_Captured]], watermarks: dict[int, int], owners: dict[int, _Partition]
    ) -> None:
        """Per partition: the snapshots, then their heads (each naming where its snapshot
        landed), then the watermark, each step once the one before is acknowledged -- a head
        never names a snapshot that is not on the topic, and a watermark never vouches for a
        head that is not."""
        topics = self.log.topics
        for p in captured.keys() | watermarks.keys():
            items = captured.get(p, [])
            landed = await self._sent(topics.snapshots, p, [(c.conversation, c.value) for c in items])
            on_topic = [(c, at) for c, at in zip(items, landed, strict=True) if at is not None]
            heads = {c.conversation: replace(c.head, at=at) for c, at in on_topic}
            sent = await self._sent(topics.heads, p, [(c, encode_head(h)) for c, h in heads.items()])
            on_heads = dict(zip(heads, sent, strict=True))
            done = [(c, heads[c.conversation], at) for c in items if (at := on_heads.get(c.conversation)) is not None]
            failed = [c for c in items if on_heads.get(c.conversation) is None]
            self.written += len(done)
            part = self._owned(p, owners)
            if part is not None:
                for _c, _head, at in done:
                    part.landed(at)
                if self.store is not None:
                    self.store.put(Stored(head, p, at, c.value) for c, head, at in done)
            if failed:
                log.warning("%d snapshot(s) of partition %d not written (tried again later)", len(failed), p)
                if part is not None:
                    self._redo(part, failed)
                continue  # no watermark over a snapshot that is not on the topic
            watermark = watermarks.get(p)
            if watermark is None or part is None:
                continue  # (handed over meanwhile: its next owner writes the watermarks)
            value = encode_watermark(watermark)
            # On the snapshot topic (what a worker without a store loads, and readers of one
            # conversation, `start_of`), and on the heads topic only from a worker with a
            # store: one without loaded the snapshot topic, where conversations snapshotted
            # before heads existed have no head, so it cannot vouch that all have one.
            topics_for = [topics.snapshots] + ([topics.heads] if self.store is not None else [])
            acks = await asyncio.gather(*(self._sent(t, p, [(WATERMARK_KEY, value)]) for t in topics_for))
            landed_at = [ack for (ack,) in acks]
            part = self._owned(p, owners)
            if part is None or None in landed_at:
                continue  # tried again at a later checkpoint
            part.watermark = max(part.watermark, watermark)
            if self.store is not None and (on_heads_at := landed_at[1]) is not None:
                part.landed(on_heads_at)
                part.latest_watermark = max(part.latest_watermark, (watermark, on_heads_at))

    async def _sent(self, topic: str, partition: int, records: list[tuple[str, bytes]]) -> list[int | None]:
        """Send the records to the partition in order; where each landed (None: not written,
        logged)."""
        if not records:
            return []
        try:
            sent = [await self.log.send(topic, key, value, partition) for key, value in records]
            acks = await asyncio.gather(*sent, return_exceptions=True)
        except Exception as exc:  # e.g. the broker went away: what was captured stays due
            acks = [exc] * len(records)
        errors = [a for a in acks if isinstance(a, BaseException)]
        if errors:
            log.warning("%d of %d record(s) to %s[%d] not written: %r", len(errors), len(records), topic, partition,
                        errors[0])  # fmt: skip
        return [None if isinstance(a, BaseException) else a.offset for a in acks]

    def _owned(self, partition: int, owners: dict[int, _Partition]) -> _Partition | None:
        """The partition as it was when its writes were captured, if it still is (None: it was
        handed over meanwhile -- the next owner folds those events -- or taken again since)."""
        part = self._partitions.get(partition)
        return part if part is not None and part is owners.get(partition) else None

    def _redo(self, part: _Partition, items: list[_Captured]) -> None:
        for c in items:
            newer = part.dirty.get(c.conversation)
            if newer is None:
                part.dirty[c.conversation] = c.dirty
            else:
                newer.first = min(newer.first, c.dirty.first)
                newer.events += c.dirty.events
        part.dirty = dict(sorted(part.dirty.items(), key=lambda item: item[1].first))

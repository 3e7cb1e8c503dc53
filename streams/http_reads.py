"""Where the HTTP API and the console get a conversation's view.

From the worker's read model (`streams.read_model`) for the conversations it owns: no log
read at all. For a conversation on a partition it does not own (or with no worker beside
the port), from its newest snapshot plus the tail of its one partition after it
(`PartitionReads.tail`): the heads partition says where that snapshot is (one read of it),
and the read grows with what happened since the snapshot, not with the partition's
history. A turn older than the snapshot (its timeline is not in a
snapshot) is read from the whole partition (`PartitionReads.whole`). Both reads are
bounded: past `max_records` records they are refused before they start and the client is
told to ask the partition's owner. A partition still replaying is a 503 with Retry-After:
its state is not the log's present yet.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from turnstile.projections.snapshot import SnapshotError, decode_snapshot
from turnstile.streams.log import LogReader, ReadTooLarge, Record, Topics
from turnstile.streams.read_model import Fetching, NotOwned, ReadModel, Replaying
from turnstile.streams.snapshots import Start, head_start, start_of
from turnstile.streams.views import ConversationView, TurnView, build_view, turn_named

log = logging.getLogger(__name__)

# The default bound of a read of a partition this worker does not own, in records and time.
BOUNDED_READ_RECORDS = 200_000
READ_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Tail:
    """A conversation's snapshot and the records of its partition after it, up to the
    partition's end when read."""

    partition: int
    start: Start
    records: list[Record]

    def view(self, conversation: str) -> ConversationView:
        return build_view(conversation, self.records, self.start.state)


class ConversationReads(Protocol):
    async def whole(self, conversation: str) -> list[Record]:
        """Every record of the conversation's partition (`ReadTooLarge` past the bound)."""
        ...

    async def tail(self, conversation: str) -> Tail:
        """Its snapshot and the partition after it (`ReadTooLarge` past the bound)."""
        ...


class PartitionReads:
    """`ConversationReads` of a log, by a reader in no consumer group."""

    def __init__(self, reader: LogReader, topics: Topics, max_records: int | None = BOUNDED_READ_RECORDS) -> None:
        self.reader, self.topics, self.max_records = reader, topics, max_records

    async def whole(self, conversation: str) -> list[Record]:
        partition = await self.reader.partition_of(conversation, READ_TIMEOUT_S)
        return await self.reader.tail(self.topics.events, partition, 0, self.max_records, READ_TIMEOUT_S)

    async def tail(self, conversation: str) -> Tail:
        partition = await self.reader.partition_of(conversation, READ_TIMEOUT_S)
        start = await self._from_heads(conversation, partition)
        if start is None:  # no heads (snapshots written before them): the snapshot partition
            try:  # compacted: about one record per conversation of the partition, plus watermarks
                snapshots = await self.reader.tail(self.topics.snapshots, partition, 0, timeout_s=READ_TIMEOUT_S)
            except Exception as exc:  # no snapshot topic (snapshots off), or it is away: read it all
                log.warning("no snapshots of partition %d for %r, reading it whole: %r", partition, conversation, exc)
                snapshots = []
            start = start_of(conversation, self.topics.snapshots, partition, snapshots)
        records = await self.reader.tail(self.topics.events, partition, start.offset, self.max_records, READ_TIMEOUT_S)
        return Tail(partition, start, records)

    async def _from_heads(self, conversation: str, partition: int) -> Start | None:
        """The conversation's start from the heads partition (≈ 100 B a conversation, whatever
        its history) and one read of the snapshot its head names; None (read the snapshot
        partition instead) when the heads cannot say: no heads watermark, or the snapshot is
        not where its head says."""
        try:
            heads = await self.reader.tail(self.topics.heads, partition, 0, timeout_s=READ_TIMEOUT_S)
            found = head_start(conversation, self.topics.heads, partition, heads)
            if found is None:
                return None
            head, offset = found
            if head is None:
                return Start(None, offset)
            named = await self.reader.span(self.topics.snapshots, partition, head.at, head.at + 1, READ_TIMEOUT_S)
        except Exception as exc:  # no heads topic, or it is away
            log.warning("no snapshot heads of partition %d for %r: %r", partition, conversation, exc)
            return None
        snapshot = decode_snapshot(named[0].value, conversation) if named else SnapshotError("not on the topic")
        if isinstance(snapshot, SnapshotError) or snapshot.covered != head.covered:
            log.warning("the snapshot of %r its head names (partition %d @%d) is unusable: reading the snapshots",
                        conversation, partition, head.at)  # fmt: skip
            return None
        return Start(snapshot.state, offset)


@dataclass(frozen=True, slots=True)
class Unavailable:
    status: int
    message: str
    retry_after_s: int | None = None


class Reads:
    def __init__(self, read_model: ReadModel | None, log_reads: ConversationReads) -> None:
        self.model = read_model
        self._log = log_reads

    async def conversation(self, conversation: str) -> ConversationView | Unavailable:
        found = self.model.lookup(conversation) if self.model is not None else NotOwned(None)
        if isinstance(found, Replaying):
            return Unavailable(503, f"partition {found.partition} is still replaying; try again shortly", 1)
        if isinstance(found, Fetching):
            return Unavailable(503, f"the state of {conversation!r} is on its way to this worker; try again shortly", 1)
        if isinstance(found, NotOwned):
            return await self._bounded(conversation, whole=False)
        if found is None:
            return Unavailable(404, f"no events of conversation {conversation!r}")
        return found

    async def turn(self, conversation: str, turn_id: str) -> tuple[ConversationView, TurnView] | Unavailable:
        view = await self.conversation(conversation)
        if isinstance(view, Unavailable):
            return view
        turn_id = turn_named(view, turn_id)
        turn = view.turns.get(turn_id)
        known = turn_id in view.state.turns or (view.state.active is not None and view.state.active.turn_id == turn_id)
        if known and (turn is None or turn.entries_dropped):  # older than the snapshot, or dropped from memory
            view = await self._bounded(conversation, whole=True)
            if isinstance(view, Unavailable):
                return view
            turn = view.turns.get(turn_id)
        if turn is None:
            return Unavailable(404, f"no turn {turn_id!r} in conversation {conversation!r}")
        return view, turn

    async def logged(self, conversation: str) -> ConversationView | Unavailable:
        """The conversation as its snapshot and the rest of its partition have it now, whoever
        owns it (never this worker's memory)."""
        return await self._bounded(conversation, whole=False)

    async def _bounded(self, conversation: str, whole: bool) -> ConversationView | Unavailable:
        try:
            if whole:
                records = await self._log.whole(conversation)
                view = await asyncio.to_thread(build_view, conversation, records)
            else:
                tail = await self._log.tail(conversation)
                # Folding a long tail is CPU work: in a thread, the loop keeps serving.
                view = await asyncio.to_thread(tail.view, conversation)
        except ReadTooLarge as exc:
            return Unavailable(
                503,
                f"conversation {conversation!r} is on partition {exc.partitions[0]}, which this worker does not"
                f" hold in memory, and its {exc.records} records exceed the bounded read ({exc.limit}); ask the"
                " worker that owns it (its /readyz lists its partitions)",
            )
        except TimeoutError:
            return Unavailable(503, f"the log did not answer a read of {conversation!r} within {READ_TIMEOUT_S:g} s", 1)
        if view.state.events_applied == 0:
            return Unavailable(404, f"no events of conversation {conversation!r}")
        return view

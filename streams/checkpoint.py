"""Where the worker stands on each partition it owns, the one-time effects of what it has
folded, and what it commits.

Committed consumer offsets do not say what was folded -- every owner replays a partition
it is given from offset 0, the events topic being the state's changelog -- but which
records' one-time effects (outcome records, dead letters) some owner has already written.
The commit protocol:

1. Records are folded in offset order; `advance` moves the partition's position past each
   and says whether the record is new to the group (at or past the committed offset).
2. A new record's one-time effects are started in the background (`effect`), so a slow or
   absent topic never holds up the fold.
3. An effect is written until the log acknowledges it, backing off while the log is away.
   One the log will never take (`RecordRefused`) is counted, logged, and a marker saying so
   goes to the dead-letter topic instead: one record never stops its partition.
4. A partition's commit offset is the lower of its position and the first record whose
   effect is still in flight: nothing is marked done before it is written.
5. Only partitions replayed to their end are committed: on the commit interval; at once on
   a revoke, after their effects in flight had a moment to land; on a clean stop, after
   every effect had a while to land. A stop after an error commits nothing (a position may
   be past an effect that failed mid-record): the next owner writes those effects again,
   so they are at least once -- outcome records are deduplicated on `turn_id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from turnstile.events import DeadLetter, DecodeError
from turnstile.streams.log import EventLog, PartitionStart, Record, RecordRefused

log = logging.getLogger(__name__)

# A write the log does not take is tried again after this, doubling up to the ceiling.
EFFECT_BACKOFF_S = 0.1
EFFECT_BACKOFF_MAX_S = 5.0
# How long effects in flight may take to land: before the last commit of a clean stop, and
# before a revoke's commit (the whole group waits for that one).
STOP_FLUSH_S = 5.0
REVOKE_FLUSH_S = 1.0


@dataclass(slots=True)
class Position:
    end_offset: int  # replay runs to here before any decision
    committed: int  # below this, one-time effects were already done by some owner
    position: int = 0  # the next offset to fold

    @property
    def live(self) -> bool:
        return self.position >= self.end_offset


@dataclass(frozen=True, slots=True)
class _Effect:
    partition: int
    offset: int
    write: asyncio.Future[None]


class Checkpoint:
    def __init__(self, log_: EventLog, commit_interval_s: float, on_skipped: Callable[[str], None]) -> None:
        self._log = log_
        self._interval_s = commit_interval_s
        self._on_skipped = on_skipped
        self._positions: dict[int, Position] = {}
        self._effects: list[_Effect] = []
        self._last_commit = float("-inf")  # the first is due at once, whatever the loop clock reads

    # -- positions -------------------------------------------------------------------------
    def assign(self, partition: int, start: PartitionStart, keep: bool = False) -> Position:
        """Where a newly assigned partition stands: from offset 0, or (`keep`, a partition
        held until the revoke before) where its fold stands, with the group's new end and
        committed offset."""
        at = self._positions.get(partition) if keep else None
        if at is None:
            at = self._positions[partition] = Position(start.end_offset, start.committed)
        else:
            at.end_offset, at.committed = start.end_offset, start.committed
        return at

    def drop(self, partition: int) -> None:
        self._positions.pop(partition, None)

    def advance(self, record: Record) -> bool:
        """Step 1: the partition's position moves past `record`; True if it is new to the group."""
        at = self._positions[record.partition]
        at.position = record.offset + 1
        return record.offset >= at.committed

    def pass_to(self, partition: int, offset: int) -> None:
        """The partition's position moves to `offset`, past offsets that hold no record the
        consumer delivers (transaction markers, aborted records): nothing there to fold."""
        at = self._positions[partition]
        at.position = max(at.position, offset)

    # -- effects ---------------------------------------------------------------------------
    def effect(self, topic: str, record: Record, value: bytes, error: DecodeError | None = None) -> None:
        """Step 2: start a one-time write for `record` (its outcome record; its dead letter
        when `error` is given)."""
        write = asyncio.ensure_future(self._write(topic, record, value, error))
        self._effects.append(_Effect(record.partition, record.offset, write))

    async def _write(self, topic: str, record: Record, value: bytes, error: DecodeError | None) -> None:
        """Step 3."""
        if error is not None:
            try:
                key, value = self._letter(record, value, error)
            except ValueError as exc:  # no letter fits the topic at all: said, never silent
                self._refused(topic, record, value, RecordRefused(str(exc)))
                return
        else:
            key = None if record.key is None else record.key.decode("utf-8", "replace")
        delay = EFFECT_BACKOFF_S
        while True:
            try:
                await self._log.append(topic, key, value)
                return
            except RecordRefused as exc:
                self._refused(topic, record, value, exc)
                return
            except Exception as exc:
                where = f"{record.partition}@{record.offset}"
                log.warning("writing to %s for the record at %s failed, again in %.1f s: %r", topic, where, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, EFFECT_BACKOFF_MAX_S)

    def _letter(self, record: Record, value: bytes, error: DecodeError) -> tuple[str | None, bytes]:
        """The dead letter of `record` (key, value), sized for the dead-letter topic: under
        the record's key, unless that key leaves no room for a letter beside it (the record
        goes unkeyed, its letter carrying a prefix of the key; the whole is on the events topic)."""
        topics = self._log.topics
        key = None if record.key is None else record.key.decode("utf-8", "backslashreplace")
        of = functools.partial(DeadLetter.of, topics.events, record.partition, record.offset, record.key, value,
                               error.reason, error.detail)  # fmt: skip
        try:
            return key, of(self._log.max_value_bytes(topics.dead_letters, key)).encode()
        except ValueError:
            return None, of(self._log.max_value_bytes(topics.dead_letters, None)).encode()

    def _refused(self, topic: str, record: Record, value: bytes, exc: RecordRefused) -> None:
        self._on_skipped(topic)
        where = f"{record.partition}@{record.offset}"
        log.error("skipped the write to %s for the record at %s, which the log refuses: %s", topic, where, exc)
        if topic != self._log.topics.dead_letters:  # else the marker would be refused alike
            detail = f"its record for {topic} ({len(value)} bytes) was refused: {exc}"
            self.effect(self._log.topics.dead_letters, record, value, DecodeError("effect_skipped", detail))

    # -- commits ---------------------------------------------------------------------------
    async def commit_due(self, partitions: Iterable[int]) -> dict[int, int] | None:
        """Step 5, on the interval: commit `partitions` (those not being revoked); returns the
        offsets committed (None: not due)."""
        now = asyncio.get_running_loop().time()
        if now - self._last_commit >= self._interval_s:
            self._last_commit = now
            return await self.commit(partitions)
        return None

    async def commit_revoked(self, partitions: Iterable[int]) -> None:
        """Step 5, on a revoke: their effects in flight get a moment to land, then commit."""
        wanted = set(partitions)
        writes = [e.write for e in self._effects if e.partition in wanted and not e.write.done()]
        if writes:
            await asyncio.wait(writes, timeout=REVOKE_FLUSH_S)
        await self.commit(wanted)

    async def close(self, clean: bool, partitions: Callable[[], Iterable[int]]) -> dict[int, int]:
        """Step 5, on stop: after a clean one, effects get a while to land and the offsets of
        `partitions()` -- asked then: those not being revoked, and a revoke may land during
        the wait -- are committed (returned); what is still unwritten then is cancelled (and
        not committed past)."""
        try:
            if clean:
                with contextlib.suppress(Exception):  # a failed last commit: the next owner redoes
                    writes = [e.write for e in self._effects]
                    if writes:
                        await asyncio.wait(writes, timeout=STOP_FLUSH_S)
                    return await self.commit(partitions())
            return {}
        finally:
            for effect in self._effects:
                effect.write.cancel()  # not committed past: the next owner redoes them

    async def commit(self, partitions: Iterable[int]) -> dict[int, int]:
        """Step 4: each live partition's offset, held below any effect still unwritten
        (returned: below them every record's effects are on the log)."""
        self._effects = [e for e in self._effects if not e.write.done()]
        unwritten: dict[int, int] = {}
        for e in self._effects:
            unwritten[e.partition] = min(unwritten.get(e.partition, e.offset), e.offset)
        offsets = {}
        for p in partitions:
            at = self._positions.get(p)
            if at is not None and at.live and at.position > 0:
                offsets[p] = min(at.position, unwritten.get(p, at.position))
        if offsets:
            await self._log.commit(offsets)
        return offsets

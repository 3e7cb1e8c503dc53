"""The snapshots a new owner did not fetch to go live: fetched after, into the local store.

An assignment with a local store reads the heads topic (`streams/snapshots.py`): each
settled conversation becomes an *unfilled* row, its head without its snapshot. Its state is
needed only when an event of it comes, or a read asks for it. So:

- in the background, once the partitions are live, `SnapshotFill` reads each partition's
  snapshot topic from its first unfilled row's snapshot on and fills the rows, a window of
  them at a time (memory holds a window of heads, not a partition's);
- an event of an unfilled conversation waits for `bring`: one point read of its snapshot
  (the fold of its partition waits meanwhile, a round trip, not the background pass);
- a snapshot that is not where its head says (compacted away after a writer died between
  a snapshot and its head, or damaged) is not guessed at: the conversation is folded from
  its partition's events, as a full replay would (`bring` returns that state). The
  background pass folds all the lost rows of a window in one read of the partition.

A read that fails (the broker away) is tried again, at growing intervals up to
`RETRY_MAX_S`: what waits for it cannot go on without it, and a partition handed over
meanwhile stops it (`forget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from turnstile.events import DecodeError, decode
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.projections.snapshot import SnapshotError, peek_snapshot
from turnstile.projections.snapshot_head import Head
from turnstile.streams.log import EventLog, Record
from turnstile.streams.state_store import StateStore, Unfilled

log = logging.getLogger(__name__)

# Unfilled rows held per partition while the background pass reads its snapshots.
WINDOW = 2_000
# Snapshot bytes the pass writes into the store in one transaction: the loop -- the worker's
# turns and GETs, live by now -- waits meanwhile (≈ 30 ms a MiB here).
FILL_BYTES = 512 << 10
# Between tries of a read that failed (the broker away), doubling up to the most: a warning
# is logged at each try, and the fold may be waiting (so the most stays a few seconds).
RETRY_S = 0.5
RETRY_MAX_S = 5.0


class SnapshotFill:
    def __init__(
        self,
        log_: EventLog,
        store: StateStore,
        max_value_bytes: int | None,
        lost: Callable[[int, list[Head]], Awaitable[None]],
        install: Callable[[str, int, ConversationState, int, object], bool],
        window: int = WINDOW,
    ) -> None:
        """`lost(partition, heads)`: the background pass has read past the snapshots these
        rows' heads name without finding them (the caller `rebuild`s those it does not hold).
        `install(conversation, partition, state, upto, token)`: a state folded from the log
        (its events below `upto`) for the caller to hold in memory -- if the partition is
        still the assignment `token` named when the bring began (returns whether it took
        it). It is called from the task
        that folded it, so a waiter that is cancelled cannot drop it; the row stays (unfilled)
        until the state's next snapshot replaces it."""
        self.log, self.store, self._lost, self._install = log_, store, lost, install
        self._max_value_bytes = max_value_bytes  # the fold's own limit: a record over it was never applied
        self._window = window
        self._unfilled: set[int] = set()  # partitions that may have unfilled rows
        self._task: asyncio.Task[None] | None = None
        self._bringing: dict[str, tuple[int, asyncio.Task[None]]] = {}
        self._stopped: set[asyncio.Task[None]] = set()  # brings `forget` cancelled, until they end
        self.filled = 0  # rows filled by the background pass
        self.brought = 0  # by point reads
        self.rebuilt = 0  # folded from the log: their snapshots were lost

    def start(self, partitions: Iterable[int]) -> None:
        """(Re)start the background pass over these partitions (those owned now)."""
        self._unfilled = {p for p in partitions if self.store.unfilled(p, 1)}
        if self._task is not None:
            self._task.cancel()
        self._task = None
        if self._unfilled:
            self._task = asyncio.create_task(self._fill_all(sorted(self._unfilled)), name="snapshot-fill")

    def unfilled(self, partition: int) -> bool:
        """Some rows of the partition may still be unfilled."""
        return partition in self._unfilled

    @property
    def done(self) -> bool:
        """The background pass has ended (or none is needed)."""
        return self._task is None or self._task.done()

    def forget(self, partition: int) -> None:
        """The partition was handed over: the brings of its conversations stop."""
        for conversation, (p, task) in list(self._bringing.items()):
            if p == partition:
                task.cancel()
                self._stopped.add(task)
                task.add_done_callback(self._stopped.discard)
                del self._bringing[conversation]

    async def close(self) -> None:
        """Stops the pass and every bring, and waits for them (and for those `forget` stopped)
        to end: none reads or writes after the store closes."""
        bringing = (task for _p, task in self._bringing.values())
        tasks = {t for t in (self._task, *bringing, *self._stopped) if t is not None}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task, self._bringing = None, {}

    # -- the background pass ---------------------------------------------------------------------
    async def _fill_all(self, partitions: list[int]) -> None:
        for p in partitions:
            # The broker away: tried again from the first unfilled row (events meanwhile bring their own).
            await retried(f"the snapshots of partition {p}", functools.partial(self._fill_partition, p))
            if not self.store.unfilled(p, 1):
                self._unfilled.discard(p)
        log.info("snapshots filled: %d in the background, %d by point reads, %d folded from the log",
                 self.filled, self.brought, self.rebuilt)  # fmt: skip

    async def _fill_partition(self, partition: int) -> None:
        await self._fill(partition)
        after = -1
        while lost := self.store.unfilled(partition, self._window, after):
            await self._lost(partition, lost)
            after = lost[-1].at

    async def _fill(self, partition: int) -> None:
        window = {h.at: h for h in self.store.unfilled(partition, self._window)}
        if not window:
            return
        last = max(window)
        records = self.log.read_partitions(self.log.topics.snapshots, [partition], {partition: min(window)})
        async with contextlib.aclosing(records):
            async for chunk in records:
                while True:
                    for piece in _pieces(chunk, FILL_BYTES):
                        self.filled += self.store.fill(partition, _matching(piece, window))
                        await asyncio.sleep(0)
                    if chunk[-1].offset < last:
                        break
                    # The window is read: the next one, from past it (a row whose snapshot was
                    # not there stays unfilled, for `bring`), and this chunk again for it.
                    window = {h.at: h for h in self.store.unfilled(partition, self._window, after=last)}
                    if not window:
                        return
                    last = max(window)

    # -- one conversation, now ----------------------------------------------------------------
    async def bring(self, conversation: str, partition: int, position: int, token: object) -> None:
        """Make an owned conversation's state local before an event of it at `position` is
        folded: its row filled, or, its snapshot lost, its state folded from the partition's
        events below `position` and handed to `install` with `token`."""
        if not self.store.waiting(conversation, partition):
            return  # filled, or no row (a new conversation): nothing to wait for
        found = self._bringing.get(conversation)
        if found is None:
            task = self._started(partition, [conversation], self._bring(conversation, partition, position, token))
        else:
            task = found[1]  # brought already, alone or with the lost rows of its window
        await _waited(task)

    async def rebuild(self, partition: int, heads: list[Head], position: int, token: object) -> None:
        """Fold these conversations, whose snapshots are lost, from one read of the partition's
        events below `position` (at least through what each head covers), and hand each state
        to `install` with `token`; those being brought already are left to their bring."""
        rows = [h for h in heads if h.conversation not in self._bringing]
        tasks = {self._bringing[h.conversation][1] for h in heads if h.conversation in self._bringing}
        if rows:
            folding = self._rebuilt(partition, rows, position, token)
            tasks.add(self._started(partition, [h.conversation for h in rows], folding))
        for task in tasks:  # (the pass is done only once every one of them is local)
            await _waited(task)

    def _started(self, partition: int, conversations: list[str], work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """`work` as the bring of each of `conversations`: an event of one of them waits for it."""
        task = asyncio.create_task(work)
        for conversation in conversations:
            self._bringing[conversation] = (partition, task)
        task.add_done_callback(lambda t: self._done_bringing(conversations, t))
        return task

    def _done_bringing(self, conversations: list[str], task: asyncio.Task[None]) -> None:
        for conversation in conversations:
            if (found := self._bringing.get(conversation)) is not None and found[1] is task:
                del self._bringing[conversation]

    async def _bring(self, conversation: str, partition: int, position: int, token: object) -> None:
        row = self.store.get(conversation, partition)
        if not isinstance(row, Unfilled):
            return  # filled meanwhile
        head = row.head
        found = await retried(f"the snapshot of {conversation!r}",
                               lambda: self.log.read_at(self.log.topics.snapshots, partition, [head.at]))  # fmt: skip
        if self.store.fill(partition, _matching(list(found.values()), {head.at: head})):
            self.brought += 1
            return
        if self.store.get(conversation, partition) != row:
            return  # filled, put again or dropped (the partition handed over) meanwhile
        await self._rebuilt(partition, [head], position, token)

    async def _rebuilt(self, partition: int, heads: list[Head], position: int, token: object) -> None:
        log.warning("the snapshots of %d conversations of partition %d (%s) are not where their heads say: "
                    "folding them from the log", len(heads), partition, _named(heads))  # fmt: skip
        # Up to the fold's position -- and at least through what each head covers: the fold
        # skips the events a head covers (`Loaded.folded_already`), lost snapshot or not.
        upto = {h.conversation: max(position, h.covered + 1) for h in heads}
        states = await retried(f"the events of partition {partition}", lambda: self._folded(partition, upto))
        for head in heads:
            conversation = head.conversation
            still = self.store.get(conversation, partition) == Unfilled(head)  # not filled, put again or dropped
            if still and self._install(conversation, partition, states[conversation], upto[conversation], token):
                self.rebuilt += 1

    async def _folded(self, partition: int, upto: dict[str, int]) -> dict[str, ConversationState]:
        """Each conversation's state from its partition's events below its offset in `upto`,
        as the worker's fold made it (the same size limit; refused events change nothing):
        one read of the partition for all of them."""
        states = {conversation: new_state(conversation) for conversation in upto}
        keys = {conversation.encode(): conversation for conversation in upto}
        end = max(upto.values())
        records = self.log.read_partitions(self.log.topics.events, [partition], {partition: 0})
        async with contextlib.aclosing(records):
            async for chunk in records:
                for record in chunk:
                    if record.offset >= end:
                        return states
                    conversation = keys.get(record.key) if record.key is not None else None
                    if conversation is None or record.offset >= upto[conversation]:
                        continue
                    event = decode(record.value, self._max_value_bytes)
                    if not isinstance(event, DecodeError):
                        apply_event(states[conversation], event)
                await asyncio.sleep(0)  # a long partition: the loop runs between chunks
        return states


_T = TypeVar("_T")


async def retried(
    what: str, read: Callable[[], Awaitable[_T]], sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
) -> _T:
    """`read()` until it succeeds (a broker away): what waits for it cannot go on without it.
    The intervals double up to `RETRY_MAX_S`; a cancellation (a partition handed over, a
    stop) ends it."""
    wait_s = RETRY_S
    while True:
        try:
            return await read()
        except Exception as exc:
            log.warning("reading %s failed (trying again in %.1f s): %r", what, wait_s, exc)
            await sleep(wait_s)
            wait_s = min(RETRY_MAX_S, wait_s * 2)


async def _waited(task: asyncio.Task[None]) -> None:
    """Until the bring `task` ends; one stopped (`forget`: its partition handed over) ends the
    wait too: the caller finds the rebalance and drops what it was about to fold."""
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # the waiter itself is cancelled


def _named(heads: list[Head], most: int = 3) -> str:
    names = ", ".join(repr(h.conversation) for h in heads[:most])
    return names + (f" and {len(heads) - most} more" if len(heads) > most else "")


def _pieces(records: list[Record], most_bytes: int) -> Iterator[list[Record]]:
    """The records in order, in pieces of at most `most_bytes` of values (a larger one alone)."""
    piece: list[Record] = []
    size = 0
    for record in records:
        value = len(record.value or b"")
        if piece and size + value > most_bytes:
            yield piece
            piece, size = [], 0
        piece.append(record)
        size += value
    if piece:
        yield piece


def _matching(records: list[Record], heads: dict[int, Head]) -> list[tuple[Head, bytes]]:
    """The records that are the snapshots these heads name (by offset), checked: the key,
    the checksum, the covered offset."""
    out = []
    for record in records:
        head = heads.get(record.offset)
        if head is None or record.value is None:
            continue
        peeked = peek_snapshot(record.value, head.conversation)
        if not isinstance(peeked, SnapshotError) and peeked.covered == head.covered:
            out.append((head, record.value))
    return out

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
  its partition's events, as a full replay would (`bring` returns that state).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from turnstile.events import DecodeError, decode
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.projections.snapshot import SnapshotError, peek_snapshot
from turnstile.projections.snapshot_head import Head
from turnstile.streams.log import EventLog, Record
from turnstile.streams.state_store import StateStore, Unfilled

log = logging.getLogger(__name__)

# Unfilled rows held per partition while the background pass reads its snapshots.
WINDOW = 2_000
# Between tries of a point read that failed (the broker away): the fold waits meanwhile.
RETRY_S = 0.5


class SnapshotFill:
    def __init__(
        self,
        log_: EventLog,
        store: StateStore,
        max_value_bytes: int | None,
        lost: Callable[[str, int], Awaitable[None]],
        install: Callable[[str, int, ConversationState, int, object], bool],
        window: int = WINDOW,
    ) -> None:
        """`lost(conversation, partition)`: called once the background pass has read past the
        snapshot a row's head names without finding it (the caller `bring`s it).
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
                del self._bringing[conversation]

    async def close(self) -> None:
        tasks = [t for t in (self._task, *(task for _p, task in self._bringing.values())) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task, self._bringing = None, {}

    # -- the background pass ---------------------------------------------------------------------
    async def _fill_all(self, partitions: list[int]) -> None:
        for p in partitions:
            while True:
                try:
                    await self._fill(p)
                    after = -1
                    while lost := self.store.unfilled(p, self._window, after):
                        for head in lost:
                            await self._lost(head.conversation, p)
                        after = lost[-1].at
                    break
                except Exception as exc:  # the broker away: tried again (events meanwhile bring their own)
                    log.warning("filling the snapshots of partition %d stopped (trying again): %r", p, exc)
                    await asyncio.sleep(RETRY_S)
            if not self.store.unfilled(p, 1):
                self._unfilled.discard(p)
        log.info("snapshots filled: %d in the background, %d by point reads, %d folded from the log",
                 self.filled, self.brought, self.rebuilt)  # fmt: skip

    async def _fill(self, partition: int) -> None:
        window = {h.at: h for h in self.store.unfilled(partition, self._window)}
        if not window:
            return
        last = max(window)
        records = self.log.read_partitions(self.log.topics.snapshots, [partition], {partition: min(window)})
        async with contextlib.aclosing(records):
            async for chunk in records:
                while True:
                    self.filled += self.store.fill(partition, _matching(chunk, window))
                    if chunk[-1].offset < last:
                        break
                    # The window is read: the next one, from past it (a row whose snapshot was
                    # not there stays unfilled, for `bring`), and this chunk again for it.
                    window = {h.at: h for h in self.store.unfilled(partition, self._window, after=last)}
                    if not window:
                        return
                    last = max(window)
                await asyncio.sleep(0)

    # -- one conversation, now ----------------------------------------------------------------
    async def bring(self, conversation: str, partition: int, position: int, token: object) -> None:
        """Make an owned conversation's state local before an event of it at `position` is
        folded: its row filled, or, its snapshot lost, its state folded from the partition's
        events below `position` and handed to `install` with `token`."""
        if not self.store.waiting(conversation, partition):
            return  # filled, or no row (a new conversation): nothing to wait for
        found = self._bringing.get(conversation)
        if found is None:
            task = asyncio.create_task(self._bring(conversation, partition, position, token))
            self._bringing[conversation] = (partition, task)
            task.add_done_callback(lambda t: self._done_bringing(conversation, t))
        else:
            task = found[1]
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the waiter itself is cancelled
            # The bring was stopped (`forget`: its partition handed over): the caller finds
            # the rebalance and drops what it was about to fold.

    def _done_bringing(self, conversation: str, task: asyncio.Task[None]) -> None:
        if (found := self._bringing.get(conversation)) is not None and found[1] is task:
            del self._bringing[conversation]

    async def _bring(self, conversation: str, partition: int, position: int, token: object) -> None:
        row = self.store.get(conversation, partition)
        if not isinstance(row, Unfilled):
            return  # filled meanwhile
        head = row.head
        found = await _retried(f"the snapshot of {conversation!r}",
                               lambda: self.log.read_at(self.log.topics.snapshots, partition, [head.at]))  # fmt: skip
        if self.store.fill(partition, _matching(list(found.values()), {head.at: head})):
            self.brought += 1
            return
        if self.store.get(conversation, partition) != row:
            return  # filled, put again or dropped (the partition handed over) meanwhile
        log.warning("the snapshot of %r (partition %d) is not where its head says (@%d): folding it from the log",
                    conversation, partition, head.at)  # fmt: skip
        # Up to the fold's position -- and at least through what the head covers: the fold
        # skips the events a head covers (`Loaded.folded_already`), lost snapshot or not.
        upto = max(position, head.covered + 1)
        state = await _retried(f"the events of {conversation!r}", lambda: self._folded(conversation, partition, upto))
        still = self.store.get(conversation, partition) == row  # not filled, put again or dropped meanwhile
        if still and self._install(conversation, partition, state, upto, token):
            self.rebuilt += 1

    async def _folded(self, conversation: str, partition: int, position: int) -> ConversationState:
        """The conversation's state from its partition's events below `position`, as the
        worker's fold made it (the same size limit; refused events change nothing)."""
        state, key = new_state(conversation), conversation.encode()
        records = self.log.read_partitions(self.log.topics.events, [partition], {partition: 0})
        async with contextlib.aclosing(records):
            async for chunk in records:
                for record in chunk:
                    if record.offset >= position:
                        return state
                    event = decode(record.value, self._max_value_bytes) if record.key == key else None
                    if event is not None and not isinstance(event, DecodeError):
                        apply_event(state, event)
        return state


_T = TypeVar("_T")


async def _retried(what: str, read: Callable[[], Awaitable[_T]]) -> _T:
    """`read()` until it succeeds (a broker away): what waits for it cannot go on without it."""
    while True:
        try:
            return await read()
        except Exception as exc:
            log.warning("reading %s failed (trying again): %r", what, exc)
            await asyncio.sleep(RETRY_S)


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

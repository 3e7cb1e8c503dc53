"""Which conversations of a worker's partitions are in memory, and how they come and go: a
newly assigned partition starts from its snapshots (`streams/snapshots.py`), an idle
conversation leaves for the local store (`streams/eviction.py`) and comes back on its next
event, and a partition handed over takes its conversations with it. The fold observers
hear of each of these moves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from turnstile.events import Event
from turnstile.projections import ConversationState, Status, conversation_status, new_state
from turnstile.projections.snapshot_head import Head
from turnstile.streams.eviction import EvictionPolicy, Evictor, NotLocal, settled
from turnstile.streams.heap import release_freed_memory
from turnstile.streams.log import EventLog, Record
from turnstile.streams.partitions import OwnedPartition, Partitions
from turnstile.streams.snapshot_fill import SnapshotFill
from turnstile.streams.snapshots import Loaded, SnapshotPolicy, Snapshotter
from turnstile.streams.state_store import StateStore

# An eviction pass that lets this many conversations go hands their memory back to the
# system (`streams/heap.py`); smaller ones leave it to be reused by the next ones in.
RELEASE_AFTER_EVICTIONS = 1_000


class FoldObserver(Protocol):
    """Told of every event the worker folds (after its fold; `ignored`: why the fold
    refused it) and of the conversations it forgets when their partition is revoked;
    e.g. `streams.read_model.WorkerReadModel`, which serves HTTP reads from this state."""

    def folded(self, record: Record, event: Event, state: ConversationState, ignored: str | None) -> None: ...

    def restored(self, state: ConversationState) -> None:
        """A conversation of a newly assigned partition starts from its snapshot (or an
        evicted one comes back): its events up to the snapshot are not folded (told) again."""
        ...

    def evicted(self, conversation: str, status: Status) -> None:
        """The conversation is out of memory (still owned: `Worker.state_of` reads it from the
        local store), with the status it left with."""
        ...

    def stored(self, partition: int, conversations: list[tuple[str, Status]]) -> None:
        """A newly assigned partition's conversations (with their statuses) that stay in the
        local store from the start: out of memory, as if evicted, in one call (a partition may
        hold a million of them)."""
        ...

    def forgotten(self, partition: int, conversations: set[str]) -> None:
        """The partition was handed over; `conversations`: its conversations in memory."""
        ...


class Closed(Exception):
    """The worker stopped while an assignment was loading its snapshots: it takes nothing."""


class Residency:
    def __init__(
        self,
        log_: EventLog,
        snapshots: SnapshotPolicy,
        eviction: EvictionPolicy,
        now_ms: Callable[[], int],
        partitions: Partitions,
        states: dict[str, ConversationState],
        observers: list[FoldObserver],
        max_value_bytes: int | None = None,
        ignored: Callable[[int], None] = lambda _n: None,
    ) -> None:
        """`states` and `observers` are the worker's own: this object keeps them in step.
        `max_value_bytes`: the fold's size limit (a conversation folded from the log by
        `SnapshotFill` must be folded as the worker folds). `ignored(n)`: n more
        conversations had no usable snapshot (folded from the log instead)."""
        self.partitions = partitions
        self.states = states
        self.observers = observers
        evicting = snapshots.enabled and eviction.enabled
        self.store = StateStore(eviction.state_dir, log_.topics.events) if evicting else None
        self.snapshots = Snapshotter(log_, snapshots, now_ms, self.store) if snapshots.enabled else None
        self.evictor = Evictor(eviction, self.store, now_ms) if self.store is not None else None
        self.fill = None
        if self.snapshots is not None and self.store is not None:  # (a store is falsy while empty)
            self.fill = SnapshotFill(log_, self.store, max_value_bytes, self._lost, self._install)
        self._ignored = ignored
        self._requested: set[asyncio.Task[None]] = set()  # brought because a read asked
        self._done: dict[int, int] = {}  # the offsets the last checkpoint committed
        # An assignment's load in flight (it runs in the log's assignment task, which may
        # outlast the worker's loop): a stop cancels it (`stop_loading`) before it closes the store.
        self._loading: asyncio.Task[dict[int, Loaded]] | None = None
        self._stopping = False  # the worker's loop has ended: nothing more is loaded or read
        self.observers.extend(o for o in (self.snapshots, self.evictor) if o is not None)

    async def load(self, partitions: list[int]) -> dict[int, Loaded]:
        """The snapshots of newly assigned partitions (none without snapshots). `Closed`: the
        worker is stopping (`stop_loading` cancelled the load, or came before it)."""
        if self._stopping:
            raise Closed("the worker has stopped")
        if self.snapshots is None:
            return {}
        self._loading = asyncio.ensure_future(self.snapshots.load(partitions))
        try:
            return await self._loading
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._stopping and (task is None or not task.cancelling()):
                raise Closed("the worker stopped while the assignment loaded its snapshots") from None
            raise
        finally:
            self._loading = None

    def drop(self, partition: int) -> None:
        """What the local store holds of `partition` goes (its snapshots stand for a log that
        is gone)."""
        if self.store is not None:
            self.store.drop_partitions([partition])

    def stop_loading(self) -> None:
        """The worker stops: an assignment's load in flight, and any after, end in `Closed`."""
        self._stopping = True
        if self._loading is not None:
            self._loading.cancel()

    def restore(self, partition: int, part: OwnedPartition, loaded: Loaded | None) -> None:
        """A new partition's conversations from their snapshots; it is read from after them."""
        if self.store is not None:  # its rows change from now on: no longer what the checkpoint says
            self.store.drop_checkpoint(partition)
        if loaded is None:
            return
        if self.snapshots is not None:
            self.snapshots.taken(partition, loaded)
        part.loaded = loaded
        part.at.position = loaded.seek
        for conversation, state in loaded.resident.items():
            self.states[conversation] = state
            self.partitions.place(conversation, partition)
            for observer in self.observers:
                observer.restored(state)
        if loaded.stored:  # waiting in the local store
            for observer in self.observers:
                observer.stored(partition, loaded.stored)
        loaded.stored = []

    def restored_all(self, loaded: dict[int, Loaded]) -> None:
        """The assignment's partitions are restored: what decoding their snapshots took
        beyond the states kept (every record, every settled state) goes back to the system,
        or the process would stay at that peak; the snapshots not fetched yet are fetched
        from now on."""
        if loaded:
            release_freed_memory()
        if self.fill is not None:
            self.fill.start(self.partitions)

    def fetching(self, partition: int) -> bool:
        """Some states of the partition may not be local yet (`bring` them before a fold)."""
        return self.fill is not None and self.fill.unfilled(partition)

    async def bring(self, conversation: str, partition: int, position: int) -> None:
        """Before an event of an owned conversation out of memory is folded: its state is
        made local (`SnapshotFill.bring`; a state folded from the log comes into memory)."""
        part = self.partitions.get(partition)
        if self.fill is not None and part is not None and conversation not in self.states:
            await self.fill.bring(conversation, partition, position, part)

    def _install(self, conversation: str, partition: int, state: ConversationState, upto: int, token: object) -> bool:
        """A state folded from the log (its snapshot lost), if the partition is still the
        assignment the bring began in (`token`) and nothing brought it meanwhile."""
        part = self.partitions.get(partition)
        if part is None or part is not token or conversation in self.states:
            return False
        if self.snapshots is not None:
            self.snapshots.ignored += 1
            # Its row is stale: snapshot it again. Due as of the fold's position at most
            # (the background pass may fold it ahead of a partition still replaying): the
            # changes are kept in the order of their first offsets, and the watermark is
            # the first's.
            self.snapshots.changed(partition, conversation, min(upto, part.at.position) - 1, upto - 1)
        self._ignored(1)
        self.states[conversation] = state
        self.partitions.place(conversation, partition)
        for observer in self.observers:
            observer.restored(state)
        return True

    def state_for(self, conversation: str, partition: int) -> ConversationState:
        """The conversation's state to fold an event of it into: in memory, back from the
        store, or a new one's."""
        state = self.states.get(conversation)
        if state is not None:
            return state
        state = self.evictor.reload(conversation, partition) if self.evictor is not None else None
        if state is None:
            state = new_state(conversation)
        else:
            for observer in self.observers:
                observer.restored(state)
        self.states[conversation] = state
        self.partitions.place(conversation, partition)
        return state

    async def _lost(self, partition: int, heads: list[Head]) -> None:
        """Rows whose snapshots are lost: those not in memory are folded from the log."""
        part = self.partitions.get(partition)
        if self.fill is not None and part is not None:
            away = [h for h in heads if h.conversation not in self.states]
            await self.fill.rebuild(partition, away, part.at.position, part)

    @property
    def local(self) -> bool:
        """Every owned conversation's state is here: none is still being fetched."""
        return self.fill is None or self.fill.done

    def stored(self, conversation: str, partition: int) -> ConversationState | None:
        """An owned conversation out of memory, read from the local store and left there.
        `NotLocal` when its snapshot is not fetched yet: it is fetched now, for the next ask;
        also once the worker stops (its store closes: the next owner answers)."""
        if self._stopping:
            raise NotLocal(conversation, partition, "is not here: the worker is stopping")
        try:
            return self.evictor.reload(conversation, partition) if self.evictor is not None else None
        except NotLocal:
            part = self.partitions.get(partition)
            if part is not None:
                task = asyncio.create_task(self.bring(conversation, partition, part.at.position))
                self._requested.add(task)
                task.add_done_callback(self._requested.discard)
            raise

    def snapshot(
        self, done: dict[int, int] | None, now_ms: int, owes_nothing: Callable[[str], bool], final: bool
    ) -> None:
        """Snapshots due at this checkpoint; `done`: the offsets just committed (None: between
        checkpoints, to go on with a capture that stopped at its bound, below the last ones)."""
        if self.snapshots is None:
            return
        if done is None:
            done = self._done
        self._done = done
        positions = {p: part.at.position for p, part in self.partitions.items() if part.deciding}
        self.snapshots.checkpoint(positions, done, now_ms, self.states.get, owes_nothing, final)

    @property
    def snapshots_behind(self) -> bool:
        """The last capture stopped at its bound while snapshots were still due."""
        return self.snapshots is not None and self.snapshots.behind

    def evict(self, idle: Callable[[str], bool]) -> list[str]:
        """Moves conversations out of memory; `idle(c)`: the worker has nothing under way or
        owed for it. Returns those that left."""
        if self.evictor is None:
            return []
        gone = self.evictor.evict(lambda c: self._evictable(c) and idle(c))
        for conversation in gone:
            status = conversation_status(self.states.pop(conversation))
            self.partitions.remove(conversation)
            for observer in self.observers:
                observer.evicted(conversation, status)
        if len(gone) >= RELEASE_AFTER_EVICTIONS:
            release_freed_memory()
        return gone

    def _evictable(self, conversation: str) -> bool:
        """Nothing to decide for it, and its latest state is in the store."""
        state = self.states.get(conversation)
        partition = self.partitions.home(conversation)
        part = self.partitions.get(partition)
        return (
            state is not None
            and part is not None
            and partition is not None
            and not part.suspended
            and settled(state)
            and self.snapshots is not None
            and self.snapshots.clean(partition, conversation)
        )

    def forget(self, partition: int, part: OwnedPartition) -> None:
        """The partition was handed over: its conversations leave memory for good."""
        if self.fill is not None:
            self.fill.forget(partition)
        for conversation in part.conversations:
            self.states.pop(conversation, None)
        for observer in self.observers:
            observer.forgotten(partition, part.conversations)

    async def close(self, clean: bool, done: dict[int, int], now_ms: int, owes_nothing: Callable[[str], bool]) -> None:
        """On stop; `done`: what the last commit committed (empty when the stop was not clean)."""
        self.stop_loading()
        if self._loading is not None:
            await asyncio.gather(self._loading, return_exceptions=True)
        for task in self._requested:
            task.cancel()
        await asyncio.gather(*self._requested, return_exceptions=True)
        if self.fill is not None:
            await self.fill.close()
        if self.snapshots is not None:
            if done:  # a clean stop: what changed is snapshotted now, for the next owner
                self.snapshot(done, now_ms, owes_nothing, final=True)
            await self.snapshots.drain()
            if clean and self.snapshots.drained():  # the store holds what the topic does
                self.snapshots.write_checkpoints()
        if self.store is not None:
            self.store.close()

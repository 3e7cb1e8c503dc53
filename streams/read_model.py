"""Reads served from a worker's folded state: the seam between the worker and its readers
(the HTTP API and the console).

`WorkerReadModel` is a fold observer of one worker (`Worker.fold_observers`): for every
event the worker folds it extends that conversation's view (turn summaries and timelines,
whose entries keep the record's bytes and are rendered only when a page asks) and moves
the conversation to the front of the recency order the list is paginated in. Nothing is
read from the log to answer: a GET costs the size of its answer, whatever the log's.

What it cannot answer it says, so the caller can choose: a conversation on a partition
this worker does not own (`NotOwned`: the caller does a bounded read of that partition, or
refers the client to the owner), one whose partition is still replaying (`Replaying`: the
state is not the log's present yet), and old turns whose timelines were dropped to bound
memory (`TurnView.entries_dropped`). The views share the worker's state objects, so they
must be read on the worker's event loop, as the HTTP handlers do.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Protocol

from turnstile.events import STEP_TYPES, Event, TurnClaimed, TurnEnvelope
from turnstile.projections import STATUSES, ConversationState, Status, conversation_status
from turnstile.streams.eviction import NotLocal
from turnstile.streams.log import Record
from turnstile.streams.state_store import LISTED_BY_THE_STORE
from turnstile.streams.views import ConversationView, turn_count

if TYPE_CHECKING:
    from turnstile.streams.worker import Worker

# Turns per conversation (the latest, the active one included) whose timelines stay in
# memory; older ones keep their summary and are read from the log on demand (a bounded read
# of their partition). The timelines hold the records' bytes: this bounds that memory.
TURN_DETAILS_KEPT = 10
# Live followers of one conversation are told at most this many events behind; a slower
# one gets `None` (re-read the page) instead of an unbounded queue.
FOLLOW_QUEUE = 256
# Evicted conversations whose places are written to the local store's listing in one go.
RELIST_BATCH = 250

STATUS_INDEX = {status: i for i, status in enumerate(STATUSES)}
# The one status the listing in memory has no index of: nearly every conversation's, so a page
# filtered by it walks the recency order and skips the few others.
WALKED: Status = "idle"


@dataclass(frozen=True, slots=True)
class NotOwned:
    """The conversation's partition (None when unknown) is not this worker's."""

    partition: int | None


@dataclass(frozen=True, slots=True)
class Replaying:
    """This worker owns the partition but has not replayed it to its end yet."""

    partition: int


@dataclass(frozen=True, slots=True)
class Fetching:
    """This worker owns the conversation, but its state is still being fetched to it (a
    partition taken over reads its conversations' heads to go live, their snapshots after)."""

    partition: int


Lookup = ConversationView | NotOwned | Replaying | Fetching | None  # None: owned, live, and no event of it


@dataclass(frozen=True, slots=True)
class ConversationRow:
    conversation_id: str
    status: Status
    last_event_at: int | None
    events: int
    turns: int
    pending: int


@dataclass(frozen=True, slots=True)
class ConversationPage:
    rows: list[ConversationRow]
    # Pass back as `before` for the next page; None on the last. Conversations that move
    # (a new event) while a client pages appear at the front again, not twice in one walk.
    next_cursor: int | None


@dataclass(frozen=True, slots=True)
class Folded:
    """What a live follower of a conversation is told about each event folded."""

    partition: int
    offset: int
    type: str
    turn_id: str | None
    status: Status


class ReadModel(Protocol):
    def lookup(self, conversation: str) -> Lookup: ...

    def page(
        self, *, contains: str = "", status: Status | None = None, before: int | None = None, limit: int = 50
    ) -> ConversationPage: ...

    def follow(self, conversation: str) -> asyncio.Queue[Folded | None]: ...

    def unfollow(self, conversation: str, queue: asyncio.Queue[Folded | None]) -> None: ...


class WorkerReadModel:
    def __init__(self, worker: Worker, turn_details_kept: int = TURN_DETAILS_KEPT) -> None:
        self._worker = worker
        self.turn_details_kept = turn_details_kept
        self._views: dict[str, ConversationView] = {}
        self._detailed: dict[str, deque[str]] = {}  # conversation -> turns with timelines, oldest first
        # conversation -> its last fold's sequence number and its status, packed in one int
        # (`_packed`), most recent last: all of them, and by status (a status changes only
        # when the conversation folds an event), so that a page filtered by status walks that
        # status's conversations only. Every conversation in memory is listed here, so a
        # listing is kept small: plain dicts keep insertion order at
        # ~90 B less per entry than OrderedDict's links (moving one to the end is a pop and an
        # insert), and the status rides in the int both dicts share instead of a dict of its
        # own. Idle, the status of nearly every conversation, has no index: a page of it walks
        # the recency order and skips the few others (those in memory, for the most part).
        self._recent: dict[str, int] = {}
        self._by_status: dict[Status, dict[str, int]] = {status: {} for status in STATUSES if status != WALKED}
        # Only conversations in memory are listed here. Those out of memory (evicted, or in
        # the local store since their partition was assigned) are listed by the store, each
        # at its place in the same order (`StateStore.listing`); one that comes back into
        # memory is listed here again, above, and its row in the store is skipped.
        self._next_sequence = LISTED_BY_THE_STORE
        self._seeded = False  # above the places the store holds (`_new_place`)
        # Moves of conversations in and out of memory, in order, whose rows in the store are
        # still to be written (`_relist`): True, evicted (listed here until its place is
        # written to its row); False, back in memory (its row is taken out of the top of the
        # store's listing, where every page would have to skip it).
        self._moves: deque[tuple[str, bool]] = deque()
        self._followers: dict[str, list[asyncio.Queue[Folded | None]]] = {}
        worker.fold_observers.append(self)

    # -- the worker's side ----------------------------------------------------------------
    def folded(self, record: Record, event: Event, state: ConversationState, ignored: str | None) -> None:
        conversation = state.conversation_id
        view = self._views.get(conversation)
        if view is None:
            view = self._views[conversation] = ConversationView(state)
        view.state = state  # the worker's, whichever object that is now
        view.add(record, event, ignored)
        if isinstance(event, TurnClaimed) and ignored is None:
            self._drop_old_details(view, event.turn_id)
        # The steps inside a turn (attempts, model and tool calls) leave its status as it was;
        # any other event (inputs, claims, outcomes, refusals, interrupts) may move it.
        status = self._moved(state, step=isinstance(event, STEP_TYPES))
        followers = self._followers.get(conversation)
        if followers:
            turn_id = event.turn_id if isinstance(event, TurnEnvelope) else None
            told = Folded(record.partition, record.offset, event.type, turn_id, status)
            for queue in followers:
                try:
                    queue.put_nowait(told)
                except asyncio.QueueFull:  # a slow follower: what it missed is in the state
                    while not queue.empty():
                        queue.get_nowait()
                    queue.put_nowait(None)

    def restored(self, state: ConversationState) -> None:
        """From its snapshot: the state, without the timelines of the turns it covers."""
        self._views[state.conversation_id] = ConversationView(state)
        self._moved(state)
        self._move(state.conversation_id, evicted=False)

    def stored(self, partition: int, conversations: list[tuple[str, Status]]) -> None:
        """A newly assigned partition's conversations that wait in the local store: listed
        by the store, without their views; their states are read back from the store when a
        page or a lookup shows them."""
        for conversation, _ in conversations:  # listed from an earlier ownership: the store's row holds
            if (packed := self._recent.pop(conversation, None)) is not None:
                self._unindexed(conversation, _status(packed))

    def evicted(self, conversation: str, status: Status) -> None:
        """Out of the worker's memory: its view goes, and its entry here leaves for the local
        store, which lists it at the same place (a client paging meanwhile sees it once) and
        from which its state is read when a page or a lookup shows it. Nothing of it stays in
        memory (a dict entry of ≈ 150 B did)."""
        self._views.pop(conversation, None)
        self._detailed.pop(conversation, None)
        if conversation not in self._recent:
            self._listed(conversation, status)
        self._move(conversation, evicted=True)

    def _move(self, conversation: str, evicted: bool) -> None:
        if self._worker.stored_listing is None:
            return  # no store (eviction needs one): every conversation is listed here
        self._moves.append((conversation, evicted))
        if len(self._moves) == 1:
            asyncio.get_running_loop().call_soon(self._relist)

    def _relist(self) -> None:
        """Writes up to `RELIST_BATCH` moves to the store, in order, and takes the evicted
        conversations out of the listing here; the rest in the loop's next cycle (a write
        costs ≈ 40 µs a conversation: a burst of evictions must not hold the loop)."""
        moves = self._moves
        batch = [moves.popleft() for _ in range(min(RELIST_BATCH, len(moves)))]
        if moves:
            asyncio.get_running_loop().call_soon(self._relist)
        store = self._worker.stored_listing
        if store is None or store.closed:
            return
        places: list[tuple[str, int | None]] = []
        for conversation, evicted in batch:
            # As things are now: out and listed here still (not back since, not handed over,
            # not out twice in this batch), or back in memory (not out again since).
            in_memory = conversation in self._views
            if evicted and not in_memory and (packed := self._recent.pop(conversation, None)) is not None:
                self._unindexed(conversation, _status(packed))
                places.append((conversation, packed >> _STATUS_BITS))
            elif not evicted and in_memory:
                places.append((conversation, None))
        store.relist(places)

    def _new_place(self) -> int:
        if not self._seeded:  # a restart on a persistent store: the places it gave stay below
            self._seeded = True
            store = self._worker.stored_listing
            if store is not None:
                self._next_sequence = max(self._next_sequence, store.last_listed() + 1)
        place = self._next_sequence
        self._next_sequence += 1
        return place

    def _moved(self, state: ConversationState, step: bool = False) -> Status:
        """Put the conversation first in the recency orders; returns its status (`step`: a
        step inside a turn, which leaves a known status as it was)."""
        was = self._status_of(state.conversation_id)
        return self._listed(state.conversation_id, was if step and was is not None else conversation_status(state))

    def _listed(self, conversation: str, status: Status) -> Status:
        if (was := self._recent.pop(conversation, None)) is not None:
            self._unindexed(conversation, _status(was))
        self._recent[conversation] = packed = _packed(self._new_place(), status)
        if status != WALKED:
            self._by_status[status][conversation] = packed
        return status

    def _unindexed(self, conversation: str, status: Status) -> None:
        if status != WALKED:
            del self._by_status[status][conversation]

    def _status_of(self, conversation: str) -> Status | None:
        packed = self._recent.get(conversation)
        return None if packed is None else _status(packed)

    def forgotten(self, partition: int, conversations: set[str]) -> None:
        # Its rows leave the store with it (`Snapshotter`); what is listed here goes too.
        partition_of = self._worker.log.partition_for
        conversations = conversations | {c for c in self._recent if partition_of(c) == partition}
        for conversation in conversations:
            self._views.pop(conversation, None)
            self._detailed.pop(conversation, None)
            if (packed := self._recent.pop(conversation, None)) is not None:
                self._unindexed(conversation, _status(packed))

    def _drop_old_details(self, view: ConversationView, claimed: str) -> None:
        detailed = self._detailed.setdefault(view.state.conversation_id, deque())
        detailed.append(claimed)
        while len(detailed) > self.turn_details_kept:
            turn = view.turns.get(detailed.popleft())
            if turn is not None:
                turn.entries.clear()
                turn.entries_dropped = True

    # -- the readers' side ----------------------------------------------------------------
    def lookup(self, conversation: str) -> Lookup:
        partition = self._worker.log.partition_for(conversation)
        live = self._worker.partition_liveness().get(partition) if partition is not None else None
        if live is None or partition is None:
            return NotOwned(partition)
        if not live:
            return Replaying(partition)
        view = self._views.get(conversation)
        if view is not None:
            return view
        try:
            state = self._worker.state_of(conversation)
        except NotLocal:
            return Fetching(partition)
        return None if state is None else ConversationView(state)  # out of memory: from the local store

    def page(
        self, *, contains: str = "", status: Status | None = None, before: int | None = None, limit: int = 50
    ) -> ConversationPage:
        """The conversations this worker owns, the most recently active first."""
        # Those listed here first, one more than the page holds: no row of the store below
        # the last of them can be on this page, so the store's walk stops there. Otherwise it
        # would pass over every stale row of a conversation in memory (the store keeps one for
        # each snapshot written) on its way to one that is not: all of them when every
        # conversation is in memory (44,000 of them: 2,000-4,000 rows read a page, 5-10 ms).
        here = list(itertools.islice(self._listed_here(status, before, contains), limit + 1))
        walks: list[Iterator[tuple[int, str, ConversationRow]]] = [iter(here)]
        store = self._worker.stored_listing
        if store is not None and not store.closed:  # a row of one in memory is stale: it is listed here
            in_memory, owned = self._recent, self._worker.partition_liveness()
            above = here[-1][0] if len(here) > limit else None
            listing = store.listing(owned, status, before, contains, above)
            # A row of the store: what a listing shows is in its head.
            walks.append(
                (r[0], r[1], ConversationRow(r[1], r[2], None, *r[3:])) for r in listing if r[1] not in in_memory
            )
        rows: list[ConversationRow] = []
        last_sequence: int | None = None
        for sequence, _conversation, row in heapq.merge(*walks, key=itemgetter(0), reverse=True):
            if len(rows) == limit:
                return ConversationPage(rows, last_sequence)
            rows.append(row)
            last_sequence = sequence
        return ConversationPage(rows, None)

    def _listed_here(
        self, status: Status | None, before: int | None, contains: str
    ) -> Iterator[tuple[int, str, ConversationRow]]:
        """(sequence, conversation, row) of those listed here, highest sequence first."""
        for sequence, conversation, listed in self._walk(status, before):
            if contains and contains not in conversation:
                continue
            if (row := self._row(conversation, listed)) is not None:
                yield sequence, conversation, row

    def _row(self, conversation: str, listed: Status) -> ConversationRow | None:
        """The row of one listed here: from its view, or (evicted, its place not in the store
        yet) from its state in the store."""
        view = self._views.get(conversation)
        state = view.state if view is not None else self._worker.state_of(conversation)
        if state is None:
            return None
        turns = turn_count(view if view is not None else ConversationView(state))
        last = view.last_event_at if view is not None else None
        return ConversationRow(conversation, listed, last, state.events_applied, turns, len(state.pending))

    def _walk(self, status: Status | None, before: int | None) -> Iterator[tuple[int, str, Status]]:
        """(sequence, conversation, status) of those listed here, highest sequence first, as
        `StateStore.listing` walks the others."""
        order = self._recent if status is None or status == WALKED else self._by_status[status]
        for conversation, packed in reversed(order.items()):
            sequence = packed >> _STATUS_BITS
            if before is not None and sequence >= before:
                continue
            if status is not None and _status(packed) != status:
                continue
            yield sequence, conversation, _status(packed)

    def follow(self, conversation: str) -> asyncio.Queue[Folded | None]:
        """A queue of the conversation's events as the worker folds them (`None`: some were
        missed, re-read the state)."""
        queue: asyncio.Queue[Folded | None] = asyncio.Queue(FOLLOW_QUEUE)
        self._followers.setdefault(conversation, []).append(queue)
        return queue

    def unfollow(self, conversation: str, queue: asyncio.Queue[Folded | None]) -> None:
        followers = self._followers.get(conversation, [])
        if queue in followers:
            followers.remove(queue)
        if not followers:
            self._followers.pop(conversation, None)


_STATUS_BITS = (len(STATUSES) - 1).bit_length()


def _packed(sequence: int, status: Status) -> int:
    return sequence << _STATUS_BITS | STATUS_INDEX[status]


def _status(packed: int) -> Status:
    return STATUSES[packed & ((1 << _STATUS_BITS) - 1)]

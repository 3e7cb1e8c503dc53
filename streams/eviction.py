"""Idle conversations leave memory: the worker's memory grows with the conversations in use,
not with every conversation it has seen.

A conversation leaves only when nothing is to be decided for it (no pending input, no turn,
nothing the worker is doing or owes for it) and its latest state is on the snapshot topic
and in the local store (`streams/state_store.py`); the next event of it brings that state
back (`reload`), so it is exactly the state it left with: the same decisions, the same claims,
once each. Which ones leave is least-recently-folded first: beyond `max_resident`, and any
untouched for `idle_ms`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from turnstile.events import Event
from turnstile.projections import STATUSES, ConversationState, Status
from turnstile.projections.snapshot import SnapshotError, decode_snapshot
from turnstile.streams.log import Record
from turnstile.streams.state_store import StateStore, Unfilled

log = logging.getLogger(__name__)


# How long a conversation stays in memory with nothing under way, by default: ten minutes.
DEFAULT_IDLE_MS = 600_000


@dataclass(frozen=True, slots=True)
class EvictionPolicy:
    """None turns a rule off; both off (or `enabled=False`) keeps every conversation in memory."""

    enabled: bool = True
    idle_ms: int | None = DEFAULT_IDLE_MS
    max_resident: int | None = None
    # The local store's folder (one SQLite file per events topic); None: a temporary folder.
    state_dir: Path | None = None
    # Conversations looked at per checkpoint (the scan runs on the loop).
    max_per_checkpoint: int = 10_000


class CorruptStore(RuntimeError):
    """A snapshot in the local store no longer decodes (it did when it was stored)."""


class NotLocal(LookupError):
    """The conversation's snapshot is not in the local store yet: only its head is (an
    unfilled row), and the snapshot is on its way (`streams/snapshot_fill.py`)."""

    def __init__(self, conversation: str, partition: int, why: str = "is still being fetched") -> None:
        super().__init__(f"the state of {conversation!r} (partition {partition}) {why}")
        self.conversation, self.partition = conversation, partition


def settled(state: ConversationState) -> bool:
    """Nothing to decide: no pending input and no turn."""
    return state.active is None and not state.pending


# The statuses of a settled conversation (`projections.status`: "active" is a turn, and
# "debouncing" pending inputs): what the local store's rows say without being decoded.
SETTLED: frozenset[str] = frozenset(STATUSES) - {"active", "debouncing"}


class Evictor:
    """The order conversations were last folded in (it observes the worker's fold), and the
    store they go to and come back from."""

    def __init__(self, policy: EvictionPolicy, store: StateStore, now_ms: Callable[[], int]) -> None:
        self.policy = policy
        self.store = store
        self._now_ms = now_ms
        self._touched: OrderedDict[str, int] = OrderedDict()  # least recently folded first
        self.evictions = 0
        self.reloads = 0

    # -- the worker's fold observer -----------------------------------------------------------
    def folded(self, record: Record, event: Event, state: ConversationState, ignored: str | None) -> None:
        self._touch(state.conversation_id)

    def restored(self, state: ConversationState) -> None:
        self._touch(state.conversation_id)

    def forgotten(self, partition: int, conversations: set[str]) -> None:
        for conversation in conversations:
            self._touched.pop(conversation, None)

    def evicted(self, conversation: str, status: Status) -> None:
        self._touched.pop(conversation, None)

    def stored(self, partition: int, conversations: list[tuple[str, Status]]) -> None:
        pass  # never in memory: nothing to evict

    def _touch(self, conversation: str) -> None:
        self._touched[conversation] = self._now_ms()
        self._touched.move_to_end(conversation)

    # -- in and out -----------------------------------------------------------------------------
    def reload(self, conversation: str, partition: int) -> ConversationState | None:
        """The conversation's state from the store (None: it has none there; `NotLocal`: its
        row is unfilled)."""
        value = self.store.get(conversation, partition)
        if value is None:
            return None
        if isinstance(value, Unfilled):
            raise NotLocal(conversation, partition)
        snapshot = decode_snapshot(value, conversation)
        if isinstance(snapshot, SnapshotError):
            # Never go on with a fresh state instead: that would forget its history. A restart
            # refills the store from the snapshot topic.
            raise CorruptStore(f"the stored snapshot of {conversation!r} in {self.store.path}: {snapshot.detail}")
        self.reloads += 1
        return snapshot.state

    def evict(self, evictable: Callable[[str], bool]) -> list[str]:
        """The conversations to move out of memory now, least recently folded first;
        `evictable(c)`: nothing to decide or do for it, and its latest state is stored."""
        now = self._now_ms()
        cutoff = None if self.policy.idle_ms is None else now - self.policy.idle_ms
        limit = self.policy.max_resident
        over = 0 if limit is None else len(self._touched) - limit
        out: list[str] = []
        # Walked in place, not copied: a pass costs the conversations it looks at, not all of
        # those in memory (a copy of 45,000 took 4-6 ms, at every step of the worker).
        for looked, (conversation, touched) in enumerate(self._touched.items()):
            stale = cutoff is not None and touched <= cutoff
            if looked >= self.policy.max_per_checkpoint or (len(out) >= over and not stale):
                break  # in touch order: nothing after this one is staler
            if evictable(conversation):
                out.append(conversation)
        for conversation in out:
            del self._touched[conversation]
        self.evictions += len(out)
        return out

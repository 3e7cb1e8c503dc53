"""The worker: folds the events topic into conversation state and runs the turns it claims.

One loop consumes; turns run as tasks beside it, so a slow model call for one
conversation never holds up the other conversations of its partition. A conversation is
"busy" from the moment the worker decides to claim it until the consumer has read back
every event its runner wrote, outcome included: that is what keeps messages that arrive
mid-turn pending until the outcome is on the log (rule 3), and what makes at most one
turn run per conversation (rule 5).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import heapq
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from turnstile.events import (
    OUTCOME_TYPES,
    DecodeError,
    Event,
    MessageRejected,
    decode,
    encode,
)
from turnstile.handlers.claim import (
    ClaimPlan,
    DebouncePolicy,
    DoubleTextPolicy,
    Refusal,
    WaitUntil,
    interrupts_on_arrival,
    plan_claim,
    rejection_event,
)
from turnstile.handlers.provider import ChatMessage, Provider
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.checkpoint import Checkpoint, Position
from turnstile.streams.eviction import EvictionPolicy, Evictor, settled
from turnstile.streams.log import Acknowledged, EventLog, PartitionStart, Record
from turnstile.streams.metrics import Metrics
from turnstile.streams.refusals import Refusals
from turnstile.streams.reply_deltas import DeltaPublisher
from turnstile.streams.runner_slot import RunnerSlot
from turnstile.streams.runtime import Clock, Ids, RandomIds, SystemClock
from turnstile.streams.snapshots import Loaded, SnapshotPolicy, Snapshotter
from turnstile.streams.state_store import StateStore
from turnstile.streams.turn_runner import TurnRunner, TurnSettings

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from turnstile.streams.tracing import TurnTracer

log = logging.getLogger(__name__)

# The longest the consumer folds without letting the rest of the loop run.
YIELD_AFTER_S = 0.02


class ReplayHooks(Protocol):
    """Told when the worker starts replaying (some assigned partition is not live yet),
    between slices of a replay (each time it lets the loop run), and when every assigned
    partition has turned live; e.g. `streams.replay_gc.ReplayGc`."""

    def replaying(self) -> None: ...

    def replay_slice(self) -> None: ...

    def replayed(self) -> None: ...


class FoldObserver(Protocol):
    """Told of every event the worker folds (after its fold; `ignored`: why the fold
    refused it) and of the conversations it forgets when their partition is revoked;
    e.g. `streams.read_model.WorkerReadModel`, which serves HTTP reads from this state."""

    def folded(self, record: Record, event: Event, state: ConversationState, ignored: str | None) -> None: ...

    def restored(self, state: ConversationState) -> None:
        """A conversation of a newly assigned partition starts from its snapshot (or an
        evicted one comes back): its events up to the snapshot are not folded (told) again."""
        ...

    def evicted(self, state: ConversationState) -> None:
        """The conversation is out of memory (still owned: `Worker.state_of` reads it from the
        local store); `state` is how it left, to look at now, not to keep."""
        ...

    def forgotten(self, conversations: set[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    debounce: DebouncePolicy = DebouncePolicy()
    turn: TurnSettings = TurnSettings()
    double_text: DoubleTextPolicy = DoubleTextPolicy()
    # Values longer than this are refused unread (too_large); None: whatever the events
    # topic accepted (its max.message.bytes) is read.
    max_value_bytes: int | None = None
    commit_interval_s: float = 1.0
    max_poll_wait_s: float = 0.1
    # On stop (SIGTERM, SIGINT): how long turns in flight may take to end before they are
    # cancelled and left to the next owner. 0 stops at once, as a crash would.
    drain_grace_s: float = 30.0
    # On a revoke: how long the steps in progress may take to finish before the group moves
    # on. It holds up the whole group's rebalance, so it must stay well inside the group's
    # rebalance timeout (the Kafka log's: the session timeout + 10 s), or the member is
    # dropped and its partitions move anyway; the rest leaves the flush and commit room.
    revoke_grace_s: float = 5.0
    # Stream the text of replies to the deltas topic as it arrives (providers then ask
    # for server-sent events); the events topic records each reply whole either way.
    stream_replies: bool = False
    # OpenTelemetry spans of turns, attempts, model and tool calls (`streams/tracing.py`),
    # to the global tracer provider unless the worker is given one.
    tracing: bool = False
    # Conversation states on the compacted snapshot topic (`streams/snapshots.py`): an
    # assignment folds only the events after them.
    snapshots: SnapshotPolicy = SnapshotPolicy()
    # Idle conversations leave memory for the local store (`streams/eviction.py`); needs snapshots.
    eviction: EvictionPolicy = EvictionPolicy()


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """How far the assigned partitions are replayed (`Worker.replay_progress`)."""

    partitions: int  # assigned
    replaying: int  # of them, not live yet
    events_done: int  # records read, up to each partition's replay end
    events_total: int  # records to read before every assigned partition is live


# A worker that rebuilds every partition from offset 0, as before snapshots (benchmarks of the replay).
FROM_THE_LOG = WorkerConfig(snapshots=SnapshotPolicy(enabled=False))


@dataclass(slots=True)
class _Partition:
    at: Position  # the checkpoint's: where its fold stands
    conversations: set[str] = field(default_factory=set)
    # Revoked, and not yet known to be ours again: nothing is decided or claimed for it.
    suspended: bool = False
    # Records are folded only from where the log was told to read it (after an assignment).
    reading: bool = True
    # Assigned with snapshots: which events of the partition they include already.
    loaded: Loaded | None = None

    @property
    def live(self) -> bool:
        return self.at.live


class Worker:
    def __init__(
        self,
        log_: EventLog,
        provider: Provider,
        config: WorkerConfig = WorkerConfig(),
        clock: Clock | None = None,
        ids: Ids | None = None,
        metrics: Metrics | None = None,
        replay_hooks: ReplayHooks | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.log = log_
        self.replay_hooks = replay_hooks
        self._replaying = False
        self.metrics: Metrics | None = None
        self.provider = provider
        if metrics is not None:
            self.measure(metrics)
        self.config = config
        self.clock = clock or SystemClock()
        self.ids = ids or RandomIds()
        self.replies = (
            DeltaPublisher(log_, log_.topics.deltas, self.clock.now_ms) if self.config.stream_replies else None
        )
        self.tracer = self._tracer(tracer_provider) if self.config.tracing else None
        self.states: dict[str, ConversationState] = {}
        self._partitions: dict[int, _Partition] = {}
        self.runners: dict[str, RunnerSlot] = {}
        self._partition_of: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._timers: list[tuple[int, str]] = []
        self._held_since = 0.0  # loop time the consumer last let the loop run
        self.checkpoint = Checkpoint(log_, self.config.commit_interval_s, self._effect_skipped)
        self.dead_letters = 0
        self.effects_skipped = 0  # one-time writes the log refused for good
        # Bumped by every rebalance callback: a batch polled before one is stale.
        self._rebalances = 0
        self.draining = False  # set once stop is asked: no new claims from then on
        # Refusals (double text, resumes of no paused turn) owed and not yet folded back.
        self.refusals = Refusals(self.config.double_text, self._write_refusal, self._retry_soon, self._due)
        # Per conversation, its history rendered as prompt messages, kept across its turns
        # (history is append-only): a turn start then does not re-render all of it.
        self._rendered: dict[str, list[ChatMessage]] = {}
        self.fold_observers: list[FoldObserver] = []
        evicting = config.snapshots.enabled and config.eviction.enabled
        self._store = StateStore(config.eviction.state_dir, log_.topics.events) if evicting else None
        self.snapshots = (
            Snapshotter(log_, config.snapshots, self.clock.now_ms, self._store) if config.snapshots.enabled else None
        )
        self.evictor = Evictor(config.eviction, self._store, self.clock.now_ms) if self._store is not None else None
        self.fold_observers.extend(o for o in (self.snapshots, self.evictor) if o is not None)

    # -- what others may ask -----------------------------------------------------------
    def measure(self, metrics: Metrics) -> None:
        """Report to `metrics` from now on: what is folded as new, this worker's consumer lag,
        and the provider's requests (timed from here on)."""
        self.metrics = metrics
        self.provider = metrics.measured(self.provider)
        metrics.report_lag(self.consumer_lag)

    def state_of(self, conversation_id: str) -> ConversationState | None:
        """The conversation as this worker has folded it (None: not on a partition it owns);
        one out of memory is read from the local store, and left there."""
        state = self.states.get(conversation_id)
        partition = self.log.partition_for(conversation_id)
        if state is None and self.evictor is not None and partition in self._partitions:
            return self.evictor.reload(conversation_id, partition)
        return state

    def live_here(self, conversation_id: str) -> bool:
        """Whether the conversation's partition is assigned here and replayed to its present."""
        partition = self.log.partition_for(conversation_id)
        part = self._partitions.get(partition) if partition is not None else None
        return part is not None and part.live

    def partition_liveness(self) -> dict[int, bool]:
        """Each partition assigned here: True once replayed to the end it had when assigned."""
        return {p: part.live for p, part in self._partitions.items()}

    def consumer_lag(self) -> dict[int, int]:
        """End offset minus position for each owned partition whose end the log knows."""
        out: dict[int, int] = {}
        for partition, part in list(self._partitions.items()):
            end = self.log.end_offset(partition)
            if end is not None:
                out[partition] = max(0, end - part.at.position)
        return out

    # -- rebalance -------------------------------------------------------------------
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        """Take the partitions the group gives us; returns the offset to read each from.
        A partition we held until the revoke just before stays as folded (read on from its
        position) and its suspended turns go on once it is live again; a partition that
        moved away drops its turns (at rest at a step boundary) and its state; a new one is
        replayed from offset 0."""
        self._rebalances += 1
        moved = [p for p, part in self._partitions.items() if part.suspended and p not in partitions]
        await self._hand_over(moved)
        fresh_parts = [p for p in partitions if (part := self._partitions.get(p)) is None or not part.suspended]
        loaded = await self._load_snapshots(fresh_parts)
        # Nothing awaits from here to the return: the log seeks to the returned offsets before
        # the consumer loop runs again, so no record read from elsewhere is folded.
        kept = []
        for p, start in partitions.items():
            part = self._partitions.get(p)
            if part is not None and part.suspended:
                self.checkpoint.assign(p, start, keep=True)
                part.reading = True
                kept.append(p)
            else:
                part = self._partitions[p] = _Partition(self.checkpoint.assign(p, start))
                self._start_from(p, part, loaded.get(p))
        for p in kept:
            if self._partitions[p].live:
                self._continue_kept(p)
        fresh = sorted(set(partitions) - set(kept))
        starts = {p: self._partitions[p].at.position for p in partitions}
        log.info("assigned partitions %s: kept %s, replaying %s from %s", sorted(partitions), kept, fresh, starts)
        self._note_replay()
        return starts

    async def _load_snapshots(self, partitions: list[int]) -> dict[int, Loaded]:
        if self.snapshots is None:
            return {}
        loaded = await self.snapshots.load(partitions)
        ignored = sum(len(one.ignored) for one in loaded.values())
        if ignored and self.metrics is not None:
            self.metrics.on_snapshots_ignored(ignored)
        return loaded

    def _start_from(self, p: int, part: _Partition, loaded: Loaded | None) -> None:
        """A new partition's conversations from their snapshots; it is read from after them."""
        if loaded is None:
            return
        part.loaded = loaded
        part.at.position = loaded.seek
        for conversation, state in loaded.resident.items():
            self.states[conversation] = state
            self._partition_of[conversation] = p
            part.conversations.add(conversation)
            for observer in self.fold_observers:
                observer.restored(state)
        for state in loaded.stored:  # waiting in the local store
            for observer in self.fold_observers:
                observer.evicted(state)
        loaded.stored = []
        if part.live:
            self._went_live(part)

    def _went_live(self, part: _Partition) -> None:
        # Decisions were held while replaying: every conversation of the partition is due
        # one now, not only those a later event happens to touch.
        self._dirty.update(part.conversations)
        part.loaded = None  # its snapshots cover less than the end the partition was live at

    async def on_revoked(self, partitions: set[int]) -> None:
        """Before the group moves partitions: let the step in progress of each turn on them
        finish (a model reply recorded, a tool call and its ToolCallFinished), hold each turn
        at its next step boundary, write the effects due and commit. Whether a partition
        really moves is known only at the assignment that follows (aiokafka's rebalances are
        eager: every member revokes everything), so nothing is dropped here."""
        self._rebalances += 1
        revoked = {p: part for p in partitions if (part := self._partitions.get(p)) is not None}
        for part in revoked.values():
            # From here no decision is taken for them: a runner started now would outlive the
            # revoke and might write to a partition another worker owns.
            part.suspended, part.reading = True, False
        slots = [slot for slot in self.runners.values() if slot.partition in revoked]
        for slot in slots:
            slot.suspend()
        deadline = asyncio.get_running_loop().time() + self.config.revoke_grace_s
        await self._read_back_now(slots, deadline)
        refusals = self.refusals.writers(c for part in revoked.values() for c in part.conversations)
        waits = [asyncio.ensure_future(slot.until_at_rest()) for slot in slots] + refusals
        if waits:
            left = max(0.0, deadline - asyncio.get_running_loop().time())
            _done, late = await asyncio.wait(waits, timeout=left)
            busy = [slot for slot in slots if not slot.at_rest]
            for task in [*late, *(slot.task for slot in busy if slot.task is not None)]:
                task.cancel()  # outlasted the grace: left to whoever owns the partition next
            if busy:
                grace = self.config.revoke_grace_s
                log.warning("revoke: %d steps outlasted %.1f s; the next owner resumes them", len(busy), grace)
            await asyncio.gather(*late, *(slot.task for slot in busy if slot.task is not None), return_exceptions=True)
        # A cancelled append may still be in the producer's buffer: let it land now, before
        # the next owner replays, rather than after it has taken the conversation over.
        await self.log.flush()
        await self.checkpoint.commit_revoked(revoked)
        if self.snapshots is not None:
            await self.snapshots.drain()  # on the topic before the next owner reads it
        log.info("revoked partitions %s", sorted(partitions))

    async def _read_back_now(self, slots: list[RunnerSlot], deadline: float) -> None:
        """The consumer reads nothing while the group rebalances, so a side-effecting call
        waiting for its read-back would wait out the revoke and be cut off before its body.
        Read those records here instead, as the consumer would have: the fold's verdict
        decides whether the call runs (it is the step in progress), exactly as it would."""
        ends: dict[int, int] = {}
        for slot in slots:
            if slot.awaiting_read_back:
                ends[slot.partition] = max(ends.get(slot.partition, 0), slot.last_offset + 1)
        reader = self.log.reader()
        try:
            async with asyncio.timeout_at(deadline):
                for p, end in ends.items():
                    part = self._partitions[p]
                    for record in await reader.span(self.log.topics.events, p, part.at.position, end):
                        self._fold(record, part)
        except Exception as exc:  # cut off at the grace like the call itself (did not start)
            log.warning("revoke: the read-back of started calls failed: %r", exc)

    async def _hand_over(self, partitions: list[int]) -> None:
        """Drop partitions that moved to another member: their turns, at rest at a step
        boundary, are cancelled there (the new owner resumes them from the journal)."""
        if not partitions:
            return
        stopping = [s.task for s in self.runners.values() if s.partition in partitions and s.task is not None]
        stopping += self.refusals.writers(c for p in partitions for c in self._partitions[p].conversations)
        for task in stopping:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)
        await self.log.flush()
        if self.snapshots is not None:
            self.snapshots.handed_over(partitions)
        for p in partitions:
            part = self._partitions.pop(p)
            self.checkpoint.drop(p)
            for conversation in part.conversations:
                self.states.pop(conversation, None)
                self.runners.pop(conversation, None)
                self._partition_of.pop(conversation, None)
                self._dirty.discard(conversation)
                self.refusals.forget(conversation)
                self._rendered.pop(conversation, None)
            for observer in self.fold_observers:
                observer.forgotten(part.conversations)
        log.info("handed over partitions %s", sorted(partitions))

    def _continue_kept(self, partition: int) -> None:
        """A partition that stayed ours is live again: its suspended turns go on where they
        stopped -- unless the log now shows another run (another owner took over while this
        member was out of the group), then they stop and the fold's present decides. A run
        closed meanwhile but still current goes on too: every reader refuses what it writes
        next, and its read-back stops it."""
        part = self._partitions[partition]
        part.suspended = False
        for conversation, slot in list(self.runners.items()):
            if slot.partition != partition or not slot.suspended:
                continue
            active = self.states[conversation].active
            if active is not None and active.run_id == slot.run_id:
                slot.resume()
            elif slot.task is not None:
                slot.task.cancel()
        self._dirty.update(part.conversations)

    def replay_progress(self) -> ReplayProgress:
        """Read-only, for progress reports (`streams/replay_progress.py`)."""
        parts = list(self._partitions.values())
        return ReplayProgress(
            len(parts),
            sum(not part.live for part in parts),
            sum(min(part.at.position, part.at.end_offset) for part in parts),
            sum(part.at.end_offset for part in parts),
        )

    def _note_replay(self) -> None:
        """Tell the replay hooks when replaying starts and when every partition is live."""
        replaying = any(not part.live for part in self._partitions.values())
        if replaying == self._replaying:
            return
        self._replaying = replaying
        if self.replay_hooks is not None:
            if replaying:
                self.replay_hooks.replaying()
            else:
                self.replay_hooks.replayed()

    # -- main loop -------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await self.log.start(self)
        stopped_cleanly = False
        try:
            while not stop.is_set():
                await self._step()
            await self._drain()
            stopped_cleanly = True
        finally:
            tasks = [r.task for r in self.runners.values() if r.task is not None] + self.refusals.writers()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            done = await self.checkpoint.close(clean=stopped_cleanly)
            if self.snapshots is not None:
                if done:  # a clean stop: what changed is snapshotted now, for the next owner
                    self._snapshot(done, final=True)
                await self.snapshots.drain()
            if self._store is not None:
                self._store.close()
            if self.replies is not None:
                await self.replies.aclose()
            await self.log.stop()

    async def _step(self) -> None:
        """One turn of the consumer loop: fold what arrived, decide, commit when due."""
        records = await self.log.poll(self._poll_wait_s())
        polled_at = self._rebalances
        for record in records:
            if self._rebalances != polled_at:
                # A rebalance ran while we awaited an append: what is left of the batch
                # predates it. An assignment replays from offset 0, so drop it here.
                break
            await self._consume(record)
            await self._let_the_loop_run()
        self._decide()
        done = await self.checkpoint.commit_due(p for p, part in self._partitions.items() if not part.suspended)
        if done is not None:
            self._snapshot(done)
            self._evict()

    def _snapshot(self, done: dict[int, int], final: bool = False) -> None:
        """Snapshots due at this checkpoint; `done`: the offsets just committed."""
        if self.snapshots is None:
            return
        positions = {p: part.at.position for p, part in self._partitions.items() if part.live and not part.suspended}
        self.snapshots.checkpoint(positions, done, self.clock.now_ms(), self.states.get, self._owes_nothing, final)

    def _owes_nothing(self, conversation: str) -> bool:
        """No refusal is owed for it: one not yet on the log is the worker's alone, so a
        snapshot would hide it from the next owner (a full replay would not)."""
        return not self.refusals.owes(conversation)

    def _back_from_store(self, conversation: str, partition: int) -> ConversationState:
        """An evicted conversation's state, or a new one's."""
        state = self.evictor.reload(conversation, partition) if self.evictor is not None else None
        if state is None:
            return new_state(conversation)
        for observer in self.fold_observers:
            observer.restored(state)
        return state

    def _evict(self) -> None:
        if self.evictor is None:
            return
        for conversation in self.evictor.evict(self._evictable):
            state = self.states.pop(conversation)
            part = self._partitions.get(self._partition_of.pop(conversation, -1))
            if part is not None:
                part.conversations.discard(conversation)
            self._rendered.pop(conversation, None)
            for observer in self.fold_observers:
                observer.evicted(state)

    def _evictable(self, conversation: str) -> bool:
        """Nothing to decide or under way for it, and its latest state is in the store."""
        state = self.states.get(conversation)
        partition = self._partition_of.get(conversation)
        part = self._partitions.get(partition) if partition is not None else None
        return (
            state is not None
            and part is not None
            and partition is not None
            and not part.suspended
            and settled(state)
            and conversation not in self.runners
            and conversation not in self._dirty
            and self._owes_nothing(conversation)
            and self.snapshots is not None
            and self.snapshots.clean(partition, conversation)
        )

    async def _let_the_loop_run(self) -> None:
        """Folding awaits nothing real, and neither does a poll with records at hand: a
        replay would hold the loop (the HTTP port and its probes with it) for as long as it
        lasts. Past the budget, across steps, let the loop run once."""
        now = asyncio.get_running_loop().time()
        if now - self._held_since > YIELD_AFTER_S:
            if self._replaying and self.replay_hooks is not None:
                self.replay_hooks.replay_slice()
            await asyncio.sleep(0)
            self._held_since = asyncio.get_running_loop().time()

    async def _drain(self) -> None:
        """Stop claiming, and keep consuming -- runners wait for their own events to be read
        back -- until every turn in flight has ended and been folded, or the grace is over.
        What is still running then is cancelled by `run` and resumed by the next owner."""
        self.draining = True
        if not self.runners:
            return
        grace = self.config.drain_grace_s
        log.warning("stopping: %d turns in flight may take up to %.0f s to end", len(self.runners), grace)
        deadline = asyncio.get_running_loop().time() + grace
        while self.runners and asyncio.get_running_loop().time() < deadline:
            await self._step()
        if self.runners:
            log.warning("stopping: grace over, %d turns left to the next owner", len(self.runners))
    def _tracer(self, provider: TracerProvider | None) -> TurnTracer:
        from turnstile.streams.tracing import TurnTracer

        families = {route.model: route.provider.family for route in self.config.turn.fallbacks}
        families[self.config.turn.model] = self.provider.family
        return TurnTracer(lambda model: families.get(model, self.provider.family), provider)

    def _poll_wait_s(self) -> float:
        wait = self.config.max_poll_wait_s
        if self._timers:
            wait = min(wait, max(0.0, (self._timers[0][0] - self.clock.now_ms()) / 1000))
        return 0.0 if self._dirty else wait

    async def _consume(self, record: Record) -> None:
        part = self._partitions.get(record.partition)
        if part is not None and part.reading:  # else revoked while this batch was in flight
            self._fold(record, part)

    def _fold(self, record: Record, part: _Partition) -> None:
        if record.offset < part.at.position:
            return  # folded already (read back while the partition was being revoked)
        was_live = part.live
        effects = self.checkpoint.advance(record)
        in_snapshot = part.loaded is not None and part.loaded.folded_already(record)
        if not was_live and part.live:
            self._went_live(part)
            if part.suspended:
                self._continue_kept(record.partition)
            self._note_replay()
        if in_snapshot:
            return
        event = decode(record.value, self.config.max_value_bytes)
        if isinstance(event, DecodeError):
            self._dead_letter(record, event, effects)
            return
        key = record.key.decode("utf-8", "replace") if record.key is not None else None
        if key != event.conversation_id:
            err = DecodeError("key_mismatch", f"key {key!r} is not the conversation id {event.conversation_id!r}")
            self._dead_letter(record, err, effects)
            return
        conversation = event.conversation_id
        state = self.states.get(conversation)
        if state is None:
            state = self.states[conversation] = self._back_from_store(conversation, record.partition)
            self._partition_of[conversation] = record.partition
            part.conversations.add(conversation)
        rejection = apply_event(state, event)
        for observer in self.fold_observers:
            observer.folded(record, event, state, None if rejection is None else rejection.reason)
        self._read_back(conversation, event, rejection is None)
        if rejection is not None:
            if rejection.conflict:
                self._dead_letter(record, DecodeError("conflicting_duplicate", rejection.reason), effects)
            else:
                log.debug("ignored %s at %s/%s: %s", event.type, record.partition, record.offset, rejection.reason)
            return
        self.refusals.note(state, event)
        self._interrupt_on_arrival(state, event)
        if effects and self.metrics is not None:
            self.metrics.on_event(state, event)
        if self.tracer is not None:
            self.tracer.note_input(event, record.headers)
            if effects:
                self.tracer.on_event(state, event)
        if effects and isinstance(event, (*OUTCOME_TYPES, MessageRejected)):
            self.checkpoint.effect(self.log.topics.outcomes, record, encode(event))
        self._dirty.add(conversation)

    def _interrupt_on_arrival(self, state: ConversationState, event: Event) -> None:
        """Interrupt-and-merge: a message mid-turn asks the running turn to withdraw."""
        message = interrupts_on_arrival(self.config.double_text, state, event)
        slot = self.runners.get(state.conversation_id)
        if message is not None and slot is not None and slot.task is not None and not slot.task.done():
            slot.interrupt(message)  # False (a side effect started): it runs on, as under enqueue

    def _dead_letter(self, record: Record, error: DecodeError, effects: bool) -> None:
        self.dead_letters += 1
        if effects and self.metrics is not None:
            self.metrics.on_dead_letter(error.reason)
        log.warning("dead-lettered %s/%s: %s", record.partition, record.offset, error.reason)
        if effects:
            self.checkpoint.effect(self.log.topics.dead_letters, record, record.value or b"", error)

    def _effect_skipped(self, topic: str) -> None:
        self.effects_skipped += 1
        if self.metrics is not None:
            self.metrics.on_effect_skipped(topic)

    # -- decisions -------------------------------------------------------------------
    def _decide(self) -> None:
        now = self.clock.now_ms()
        while self._timers and self._timers[0][0] <= now:
            self._dirty.add(heapq.heappop(self._timers)[1])
        # Within the same budget as the fold (a partition turning live makes every one of its
        # conversations due at once): what is left stays due for the next step.
        started = asyncio.get_running_loop().time()
        while self._dirty:
            self._decide_one(self._dirty.pop(), now)
            if asyncio.get_running_loop().time() - started > YIELD_AFTER_S:
                break

    def _decide_one(self, conversation: str, now: int) -> None:
        state = self.states.get(conversation)
        partition = self._partition_of.get(conversation)
        if state is None or partition is None:
            return
        part = self._partitions.get(partition)
        if part is None or not part.live or part.suspended:
            return  # being revoked, or still replaying: the state is not the log's present yet
        if self.refusals.holds_back(state):
            return  # refused messages leave the pending set before anything is claimed
        runner = self.runners.get(conversation)
        if runner is not None:
            if not runner.released(part.at.position):
                return
            del self.runners[conversation]
        if self.draining:
            return  # stopping: nothing new is claimed or taken over; the next owner will
        if state.active is not None:
            # Nobody here runs it, and this partition is ours: its owner is gone.
            self._start(conversation, partition, recover=True)
            return
        decision = plan_claim(state, now, self.config.debounce)
        if isinstance(decision, WaitUntil):
            heapq.heappush(self._timers, (decision.due_ms, conversation))
        elif isinstance(decision, ClaimPlan):
            self._start(conversation, partition, plan=decision)

    async def _write_refusal(self, state: ConversationState, input_id: str, refusal: Refusal) -> None:
        conversation = state.conversation_id
        event = rejection_event(state, input_id, refusal, event_id=self.ids.new(), now_ms=self.clock.now_ms())
        await self.log.append(self.log.topics.events, conversation, encode(event), self._partition_of[conversation])

    def _due(self, conversation: str) -> None:
        self._dirty.add(conversation)  # (`_decide` swaps the set: never bind its `add`)

    def _retry_soon(self, conversation: str) -> None:
        heapq.heappush(self._timers, (self.clock.now_ms() + 500, conversation))

    def _read_back(self, conversation: str, event: Event, accepted: bool) -> None:
        """A runner's own event, read back from the log: its slot learns the verdict."""
        runner = self.runners.get(conversation)
        if runner is not None:
            runner.judged(event.event_id, accepted)

    def _start(self, conversation: str, partition: int, plan: ClaimPlan | None = None, recover: bool = False) -> None:
        state = self.states[conversation]
        private = _private_copy(state, plan)

        def send(value: bytes) -> Awaitable[asyncio.Future[Acknowledged]]:
            return self.log.send(self.log.topics.events, conversation, value, partition)

        slot = self.runners[conversation] = RunnerSlot(conversation, partition, send)
        rendered = self._rendered.setdefault(conversation, [])
        turn, ids = self.config.turn, self.ids.new
        runner = TurnRunner(private, slot.append, self.provider, turn, self.clock.now_ms, ids, rendered, self.replies)
        work = runner.recover() if recover else runner.claim_and_run(plan)  # type: ignore[arg-type]
        slot.interrupt = runner.interrupt
        slot.start(work).add_done_callback(lambda _t: self._dirty.add(conversation))


def _private_copy(state: ConversationState, plan: ClaimPlan | None) -> ConversationState:
    """What a runner needs of the conversation: the history its turn may see and the
    turn's inputs. History entries are never mutated once appended, so sharing them is safe."""
    private = new_state(state.conversation_id)
    private.history = list(state.history)
    if plan is not None:
        private.pending = {i.input_id: dataclasses.replace(i) for i in plan.inputs}
    private.active = copy.deepcopy(state.active)
    return private

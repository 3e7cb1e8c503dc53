"""The worker: folds the events topic into conversation state and runs the turns it claims.

One loop consumes; turns run as tasks beside it, so a slow model call for one
conversation never holds up the other conversations of its partition. A conversation is
"busy" from the moment the worker decides to claim it until the consumer has read back
every event its runner wrote, outcome included: that is what keeps messages that arrive
mid-turn pending until the outcome is on the log (rule 3), and what makes at most one
turn run per conversation (rule 5).

What it carries out is split along its seams: `partitions.py` (the owned partitions and
their conversations), `checkpoint.py` (positions, one-time effects, commits),
`handover.py` (what a rebalance does to running turns), `residency.py` (snapshots and
eviction: which states are in memory), `refusals.py`, `runner_slot.py` and
`replay_pace.py` (a replay's share of the loop).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import heapq
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from turnstile.events import (
    OUTCOME_TYPES,
    DecodeError,
    Event,
    MessageRejected,
    decode_record,
    encode,
    misplaced,
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
from turnstile.streams.checkpoint import Checkpoint
from turnstile.streams.eviction import EvictionPolicy
from turnstile.streams.handover import Handover
from turnstile.streams.log import Acknowledged, EventLog, PartitionStart, Record
from turnstile.streams.metrics import Metrics
from turnstile.streams.partitions import OwnedPartition, Partitions, ReplayProgress
from turnstile.streams.refusals import Refusals
from turnstile.streams.replay_pace import YIELD_AFTER_S, ReplayHooks, ReplayPace
from turnstile.streams.reply_deltas import DeltaPublisher
from turnstile.streams.residency import Closed, FoldObserver, Residency
from turnstile.streams.runner_slot import RunnerSlot
from turnstile.streams.runtime import Clock, Ids, RandomIds, SystemClock
from turnstile.streams.snapshots import Loaded, SnapshotPolicy
from turnstile.streams.state_store import StateStore
from turnstile.streams.turn_runner import TurnRunner, TurnSettings

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from turnstile.streams.tracing import TurnTracer

log = logging.getLogger(__name__)


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
    # On stop (SIGTERM, SIGINT): how long turns in flight may take to end. Past it, each
    # still running finishes its step in progress (within `revoke_grace_s`) and is left at
    # its next step boundary to the next owner. 0 stops at once, as a crash would.
    drain_grace_s: float = 30.0
    # On a revoke: how long the steps in progress may take to finish before the group moves
    # on. It holds up the whole group's rebalance, so it must stay well inside the group's
    # rebalance timeout (the Kafka log's: the session timeout + 10 s), or the member is
    # dropped and its partitions move anyway; the rest leaves the flush and commit room.
    # A drain gives the steps still in progress when its grace is over the same bound.
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


# What a revoke takes beyond its grace: its effects' flush (`REVOKE_FLUSH_S`), its commit and
# its snapshots drained (`snapshots.DRAIN_S`), with room; a stop waits that long for one.
REVOKE_TAIL_S = 15.0

# A worker that rebuilds every partition from offset 0, as before snapshots (benchmarks of the replay).
FROM_THE_LOG = WorkerConfig(snapshots=SnapshotPolicy(enabled=False))


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
        self.pace = ReplayPace(replay_hooks)
        self.metrics: Metrics | None = None
        self.provider = provider
        self.config = config
        if metrics is not None:
            self.measure(metrics)
        self.clock = clock or SystemClock()
        self.ids = ids or RandomIds()
        self.replies = (
            DeltaPublisher(log_, log_.topics.deltas, self.clock.now_ms) if self.config.stream_replies else None
        )
        self.tracer = self._tracer(tracer_provider) if self.config.tracing else None
        self.states: dict[str, ConversationState] = {}
        self.partitions = Partitions()
        self.runners: dict[str, RunnerSlot] = {}
        self._dirty: set[str] = set()
        self._timers: list[tuple[int, str]] = []
        self.checkpoint = Checkpoint(log_, self.config.commit_interval_s, self._effect_skipped)
        self.dead_letters = 0
        self.effects_skipped = 0  # one-time writes the log refused for good
        # Bumped by every rebalance callback: a batch polled before one is stale.
        self._rebalances = 0
        # Whether the group has given this worker an assignment yet (an empty one counts):
        # before it, owning no partition says nothing of being ready.
        self.assignment_received = False
        self.draining = False  # set once stop is asked: no new claims from then on
        self._stopped = False  # set once the loop has ended: a rebalance after it changes nothing
        # Held by each rebalance callback (they run in the log's own task, beside the loop): a
        # stop lets the one in progress end before it closes what the callback uses.
        self._rebalancing = asyncio.Lock()
        self._loading = False  # an assignment is loading the snapshots of fresh partitions
        # Refusals (double text, resumes of no resumable turn) owed and not yet folded back.
        self.refusals = Refusals(self.config.double_text, self._write_refusal, self._retry_soon, self._due)
        # Per conversation, its history rendered as prompt messages, kept across its turns
        # (history is append-only): a turn start then does not re-render all of it.
        self._rendered: dict[str, list[ChatMessage]] = {}
        self.fold_observers: list[FoldObserver] = []
        self.residency = Residency(
            log_, config.snapshots, config.eviction, self.clock.now_ms, self.partitions, self.states,
            self.fold_observers, config.max_value_bytes, self._snapshots_ignored,
        )  # fmt: skip
        self.snapshots, self.evictor = self.residency.snapshots, self.residency.evictor
        self.handover = Handover(
            log_, self.partitions, self.runners, self.states, self.checkpoint, self.refusals, self.snapshots,
            config.revoke_grace_s, self._read_back_now, self._forget,
            lambda conversations: self._dirty.update(conversations),
        )  # fmt: skip

    # -- what others may ask -----------------------------------------------------------
    def measure(self, metrics: Metrics) -> None:
        """Report to `metrics` from now on: what is folded as new, this worker's consumer lag,
        and the provider's requests (timed from here on)."""
        self.metrics = metrics
        measured: dict[int, Provider] = {}  # a provider serving several routes, measured once

        def of(provider: Provider) -> Provider:
            if id(provider) not in measured:
                measured[id(provider)] = metrics.measured(provider)
            return measured[id(provider)]

        self.provider = of(self.provider)
        turn = self.config.turn
        fallbacks = tuple(dataclasses.replace(route, provider=of(route.provider)) for route in turn.fallbacks)
        self.config = dataclasses.replace(self.config, turn=dataclasses.replace(turn, fallbacks=fallbacks))
        metrics.report_lag(self.consumer_lag)

    def state_of(self, conversation_id: str) -> ConversationState | None:
        """The conversation as this worker has folded it (None: not on a partition it owns);
        one out of memory is read from the local store, and left there (`NotLocal`: its
        snapshot is still being fetched there)."""
        state = self.states.get(conversation_id)
        partition = self.log.partition_for(conversation_id)
        if state is None and partition is not None and partition in self.partitions:
            return self.residency.stored(conversation_id, partition)
        return state

    @property
    def states_local(self) -> bool:
        """Every owned conversation's state is in memory or in the local store: none is
        still being fetched (a partition taken over goes live on its snapshots' heads)."""
        return self.residency.local

    @property
    def stored_listing(self) -> StateStore | None:
        """The local store, which lists the owned conversations out of memory for the read
        model (`StateStore.listing`); None without one (no eviction)."""
        return self.residency.store

    def live_here(self, conversation_id: str) -> bool:
        """Whether the conversation's partition is assigned here and replayed to its present."""
        part = self.partitions.get(self.log.partition_for(conversation_id))
        return part is not None and part.live

    def folded_past(self, partition: int, offset: int) -> bool:
        """Whether the record at `offset` of `partition` (assigned here) is folded already."""
        part = self.partitions.get(partition)
        return part is not None and part.at.position > offset

    def partition_liveness(self) -> dict[int, bool]:
        """Each partition assigned here: True once replayed to the end it had when assigned."""
        return self.partitions.liveness()

    def consumer_lag(self) -> dict[int, int]:
        """End offset minus position for each owned partition whose end the log knows."""
        return self.partitions.lag(self.log.end_offset)

    def replay_progress(self) -> ReplayProgress:
        """Read-only, for progress reports (`streams/replay_progress.py`)."""
        return self.partitions.progress()

    # -- rebalance (what it does to running turns: `streams/handover.py`) ----------------
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        """Take the partitions the group gives us; returns the offset to read each from.
        A partition we held until the revoke just before stays as folded (read on from its
        position) and its suspended turns go on once it is live again; a partition that
        moved away drops its turns (at rest at a step boundary) and its state; a new one is
        replayed from offset 0 (or from its snapshots). The Kafka log calls it beside the
        group's protocol, the partitions paused until it returns (the kept ones until they
        are taken, at once: `EventLog.take`), and cancels it at the next rebalance if it has
        not returned by then: nothing fresh of that assignment is taken, and the revoke
        that follows holds the kept ones again."""
        async with self._rebalancing:
            if self._stopped:
                return {}  # the log's rebalance outlived the worker's loop: nothing is taken
            taken = await self._take(partitions)
            self.assignment_received = True
            return taken

    async def _take(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        self._rebalances += 1
        await self.handover.hand_over(self.handover.moved(partitions))
        fresh = [p for p in partitions if (part := self.partitions.get(p)) is None or not part.suspended]
        kept = [p for p in partitions if p not in fresh]
        # The kept partitions go on at once, not after the fresh ones have loaded (seconds at a
        # million conversations): their fold reads on from where it stands, and their turns
        # go on once it has caught up with the group's new end (`_fold`; one that another
        # owner took over meanwhile stops there). A rebalance during the load revokes them again.
        for p in kept:
            self.checkpoint.assign(p, partitions[p], keep=True)
            self.partitions[p].reading = True
            if self.partitions[p].live:
                self.handover.continue_kept(p)
        if kept:
            self.log.take({p: self.partitions[p].at.position for p in kept})
            self._rebalances += 1  # (a batch polled before: not from these positions)
        # Loading their snapshots is part of the fresh partitions' replay (for the hooks: the
        # GC held), though they are in no table until it ends.
        self._loading = bool(fresh)
        self.pace.note(self._replaying())
        try:
            loaded = await self.residency.load(fresh)
        except Closed:
            # A stop closed the local store while the log's rebalance loaded: the worker
            # takes nothing (its loop has ended; the log stops next).
            log.info("stopped while assigned partitions %s loaded their snapshots: not taken", sorted(partitions))
            return {}
        except asyncio.CancelledError:
            # A rebalance came first (the Kafka log takes an assignment beside the group's
            # protocol and abandons it at the next one): nothing fresh of it is taken.
            self.pace.note(self.partitions.replaying())
            raise
        finally:
            self._loading = False
        self._snapshots_ignored(sum(len(one.ignored) for one in loaded.values()))
        # Nothing awaits from here to the return: the log seeks to the returned offsets before
        # the consumer loop runs again, so no record read from elsewhere is folded.
        for p in fresh:
            start = partitions[p]
            seek = loaded[p].seek if p in loaded else 0
            if max(seek, start.committed) > start.end_offset:
                # Snapshots, the local store or the group's offsets cover offsets the partition
                # does not have: the topic was recreated since. Trusted, they would stand for a
                # log that is gone (its new records folded into old states, or never answered,
                # their outcome records taken as written): dropped, the partition is replayed and
                # its effects redone (at least once, as after any takeover).
                log.warning("partition %s: snapshots or commits cover offset %s, past its end %s: the topic was"
                            " recreated; replayed from 0", p, max(seek, start.committed), start.end_offset)
                self.residency.drop(p)
                loaded[p] = Loaded(seek=0, covered={}, resident={}, stored=[], ignored=[])  # (snapshotted anew)
                start = PartitionStart(start.end_offset, 0)
            self._start_from(p, start, loaded.get(p))
        self.residency.restored_all(loaded)
        starts = {p: self.partitions[p].at.position for p in partitions}
        fresh.sort()
        log.info("assigned partitions %s: kept %s, replaying %s from %s", sorted(partitions), kept, fresh, starts)
        self.pace.note(self.partitions.replaying())
        # Again at the end: a batch polled while this awaited (the snapshot load lets the loop
        # run) may hold records of these partitions read from their committed offsets, not
        # from `starts`; folded now, they would move a position past records not folded yet.
        self._rebalances += 1
        return starts

    def _replaying(self) -> bool:
        """Some assigned partition is not live yet (or an assignment's snapshots are loading)."""
        return self._loading or self.partitions.replaying()

    def _snapshots_ignored(self, count: int) -> None:
        if count and self.metrics is not None:
            self.metrics.on_snapshots_ignored(count)

    def _start_from(self, p: int, start: PartitionStart, loaded: Loaded | None) -> None:
        part = self.partitions.add(p, self.checkpoint.assign(p, start))
        self.residency.restore(p, part, loaded)
        if loaded is not None and part.live:
            self._went_live(part)

    def _went_live(self, part: OwnedPartition) -> None:
        # Decisions were held while replaying: every conversation of the partition is due
        # one now, not only those a later event happens to touch.
        self._dirty.update(part.conversations)
        part.loaded = None  # its snapshots cover less than the end the partition was live at

    async def on_revoked(self, partitions: set[int]) -> None:
        """Before the group moves partitions: the steps in progress finish and the turns
        wait at their next step boundary (`Handover.revoke`). Whether a partition really
        moves is known only at the assignment that follows, so nothing of `partitions` is
        dropped here; what is dropped is what an earlier revoke held and this one does not
        name (an assignment between was abandoned)."""
        self._rebalances += 1
        if not self._stopped:
            async with self._rebalancing:
                if not self._stopped:  # (the stop may come while this waits for the lock)
                    # Held since an earlier revoke and not in this one: the assignment between
                    # was not taken here (the Kafka log abandoned it), and another member may
                    # have owned them meanwhile -- resumed their turns, committed past this fold.
                    # They go now, or the next assignment would keep them as folded.
                    await self.handover.hand_over(self.handover.moved(partitions))
                    await self.handover.revoke(partitions)
                    return
        # After the loop its turns are cancelled and its store closes: nothing is awaited. The
        # partitions are no longer surely ours, so the stop's last commit and snapshots leave
        # them out (another member may own them already and commit past this fold).
        self.partitions.hold(partitions)

    def _forget(self, partition: int, part: OwnedPartition) -> None:
        """A partition handed over: what this worker holds of its conversations goes."""
        self.residency.forget(partition, part)
        for conversation in part.conversations:
            self._dirty.discard(conversation)
            self._rendered.pop(conversation, None)

    # -- main loop -------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        stopped_cleanly = False
        try:
            # Inside the cleanup: the embedded log's start runs the first assignment itself,
            # and one that fails there must still let go of the log and the local store.
            await self.log.start(self)
            while not stop.is_set():
                await self._step()
            await self._drain()
            stopped_cleanly = True
        finally:
            self._stopped = True
            self.residency.stop_loading()  # an assignment loading its snapshots takes nothing
            cancelled = await self._rebalance_ended()
            tasks = [r.task for r in self.runners.values() if r.task is not None] + self.refusals.writers()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            done = await self.checkpoint.close(stopped_cleanly, self.partitions.committable)
            await self.residency.close(stopped_cleanly, done, self.clock.now_ms(), self._owes_nothing)
            if self.replies is not None:
                await self.replies.aclose()
            await self.log.stop()
            if cancelled:
                raise asyncio.CancelledError

    async def _rebalance_ended(self) -> bool:
        """On stop, before anything closes: a revoke in progress ends first (its steps finish,
        its commit goes through), for as long as a revoke may take. A broker that is away can
        hold its flush and commit for ever: past that bound, or on a second stop (the task
        cancelled again), the stop goes on without it. Returns whether it was cancelled."""
        try:
            async with asyncio.timeout(self.config.revoke_grace_s + REVOKE_TAIL_S):
                async with self._rebalancing:
                    return False
        except TimeoutError:
            log.warning("stopping: a rebalance in progress did not end in time; closing without it")
        except asyncio.CancelledError:
            log.warning("stopping: cancelled while a rebalance was in progress; closing without it")
            return True
        return False

    async def _step(self) -> None:
        """One turn of the consumer loop: fold what arrived, decide, commit when due."""
        records = await self.log.poll(self._poll_wait_s())
        polled_at = self._rebalances
        replaying = self.partitions.replaying()  # (what this batch folds may be long-lived)
        for record in records:
            if self._rebalances != polled_at:
                # A rebalance ran while we awaited an append: what is left of the batch
                # predates it. An assignment replays from offset 0, so drop it here.
                break
            await self._consume(record)
            await self.pace.let_the_loop_run(replaying)
        idle = not records  # (a live partition is checked when idle only: the poll's hot path awaits nothing more)
        if (replaying or idle) and self._rebalances == polled_at:
            await self._past_undelivered(live_too=idle)
        self._decide()
        done = await self.checkpoint.commit_due(self.partitions.committable())
        if done is not None:
            self.residency.snapshot(done, self.clock.now_ms(), self._owes_nothing, final=False)
            for conversation in self.residency.evict(self._idle):
                self._rendered.pop(conversation, None)
        elif self.residency.snapshots_behind:
            # A capture is bounded in time (the loop's other tasks wait for it): it goes on
            # here, step by step, rather than a commit interval later.
            self.residency.snapshot(None, self.clock.now_ms(), self._owes_nothing, final=False)

    def _owes_nothing(self, conversation: str) -> bool:
        """No refusal is owed for it: one not yet on the log is the worker's alone, so a
        snapshot would hide it from the next owner (a full replay would not)."""
        return not self.refusals.owes(conversation)

    def _idle(self, conversation: str) -> bool:
        """Nothing under way, due or owed for it here (it may leave memory)."""
        return conversation not in self.runners and conversation not in self._dirty and self._owes_nothing(conversation)

    async def _drain(self) -> None:
        """Stop claiming, and keep consuming -- runners wait for their own events to be read
        back -- until every turn in flight has ended and been folded, or the grace is over.
        Then each turn still running finishes its step in progress (a model reply recorded, a
        tool call and its ToolCallFinished; within `revoke_grace_s`, as at a revoke) and waits
        at its next step boundary, where `run` cancels it: the next owner resumes it from the
        journal. A grace of 0 stops at once, as a crash would."""
        self.draining = True
        grace = self.config.drain_grace_s
        if not self.runners or grace <= 0:
            return
        log.warning("stopping: %s in flight may take up to %.0f s to end", _turns(len(self.runners)), grace)
        await self._step_until(lambda: not self.runners, grace)
        slots = list(self.runners.values())
        if not slots:
            return
        step_s = self.config.revoke_grace_s
        log.warning("stopping: grace over; the step in progress of %s may finish (up to %.0f s)", _turns(len(slots)),
                    step_s)  # fmt: skip
        await self._step_until(lambda: _held(slots), step_s)
        busy = sum(not slot.at_rest for slot in slots)
        log.warning("stopping: %s left to the next owner (%d cut off mid-step)", _turns(len(self.runners)), busy)

    async def _step_until(self, done: Callable[[], bool], within_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + within_s
        while not done() and asyncio.get_running_loop().time() < deadline:
            await self._step()

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
        part = self.partitions.get(record.partition)
        if part is None or not part.reading:  # revoked while this batch was in flight
            return
        if (conversation := self._to_bring(record, part)) is not None:
            rebalances = self._rebalances
            await self.residency.bring(conversation, record.partition, record.offset)
            if self._rebalances != rebalances or not part.reading:
                return  # the batch predates an assignment: dropped (see `_step`)
        self._fold(record, part)

    async def _read_back_now(self, record: Record, part: OwnedPartition) -> None:
        """A record a revoke reads back itself (`Handover`): folded as the consumer would."""
        if (conversation := self._to_bring(record, part)) is not None:
            await self.residency.bring(conversation, record.partition, record.offset)
        if self.partitions.get(record.partition) is part:
            self._fold(record, part)

    def _to_bring(self, record: Record, part: OwnedPartition) -> str | None:
        """The conversation to make local before `record` is folded, if any: while its
        partition's snapshots are being fetched, its state may be a head only in the local
        store, so it is fetched first (the partition's fold waits: its events must be folded
        in order). Checked without awaiting: most records need nothing."""
        if record.key is None or not self.residency.fetching(record.partition):
            return None
        if (part.loaded is not None and part.loaded.covers(record)) or record.offset < part.at.position:
            return None
        return record.key.decode("utf-8", "replace")

    async def _past_undelivered(self, live_too: bool) -> None:
        """A partition whose last offsets hold no record the consumer delivers (a
        transaction's commit or abort marker, an aborted transaction's records) is folded to
        its end all the same: the consumer's position has passed them, so the fold's does too.
        Otherwise a replay would wait for a record that may never come, and a live partition
        would show a lag (and commit a position) short of its end for good -- behind every
        transactional publisher's last commit marker."""
        for partition, part in self.partitions.items():
            if not part.reading or (part.live and not live_too):
                continue
            read = await self.log.read_position(partition)
            if read is not None and read > part.at.position and self.partitions.get(partition) is part:
                was_live = part.live
                self.checkpoint.pass_to(partition, read)
                self._maybe_live(part, partition, was_live)

    def _maybe_live(self, part: OwnedPartition, partition: int, was_live: bool) -> None:
        if not was_live and part.live:
            self._went_live(part)
            if part.suspended:
                self.handover.continue_kept(partition)
            self.pace.note(self._replaying())

    def _fold(self, record: Record, part: OwnedPartition) -> None:
        if record.offset < part.at.position:
            return  # folded already (read back while the partition was being revoked)
        was_live = part.live
        effects = self.checkpoint.advance(record)
        in_snapshot = part.loaded is not None and part.loaded.folded_already(record)
        self._maybe_live(part, record.partition, was_live)
        if in_snapshot:
            return
        event = self._decoded(record, effects)
        if event is None:
            return
        conversation = event.conversation_id
        state = self.residency.state_for(conversation, record.partition)
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

    def _decoded(self, record: Record, effects: bool) -> Event | None:
        """The record's event, or None once it is dead-lettered. A runner's own append read
        back is the event it wrote (its bytes exactly, within the size limit every reader
        applies): not parsed and validated a second time."""
        if record.unreadable is not None:
            self._dead_letter(record, DecodeError("unreadable", record.unreadable), effects)
            return None
        key = record.key.decode("utf-8", "replace") if record.key is not None else None
        value, limit = record.value, self.config.max_value_bytes
        slot = self.runners.get(key) if key is not None else None
        if slot is not None and value is not None and (limit is None or len(value) <= limit):
            own = slot.written_as(value)
            if own is not None:
                return own
        event = decode_record(record.key, value, limit)
        if isinstance(event, DecodeError):
            self._dead_letter(record, event, effects)
            return None
        if (wrong := self._misplaced(record, event)) is not None:
            self._dead_letter(record, wrong, effects)
            return None
        return event

    def _misplaced(self, record: Record, event: Event) -> DecodeError | None:
        if self.partitions.home(event.conversation_id) == record.partition:
            # Its first record here was checked (or its snapshot was this partition's): the
            # hash is not computed again for each of its events (3 µs each, on a replay too).
            return None
        return misplaced(event, record.partition, self.log.partition_count())

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
        partition = self.partitions.home(conversation)
        part = self.partitions.get(partition)
        if state is None or partition is None or part is None or not part.deciding:
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
            self._start(conversation, partition)  # no plan: take the active turn over
            return
        decision = plan_claim(state, now, self.config.debounce)
        if isinstance(decision, WaitUntil):
            heapq.heappush(self._timers, (decision.due_ms, conversation))
        elif isinstance(decision, ClaimPlan):
            self._start(conversation, partition, plan=decision)

    async def _write_refusal(self, state: ConversationState, input_id: str, refusal: Refusal) -> None:
        conversation = state.conversation_id
        event = rejection_event(state, input_id, refusal, event_id=self.ids.new(), now_ms=self.clock.now_ms())
        await self.log.append(self.log.topics.events, conversation, encode(event), self.partitions.home(conversation))

    def _due(self, conversation: str) -> None:
        self._dirty.add(conversation)  # (`_decide` swaps the set: never bind its `add`)

    def _retry_soon(self, conversation: str) -> None:
        heapq.heappush(self._timers, (self.clock.now_ms() + 500, conversation))

    def _read_back(self, conversation: str, event: Event, accepted: bool) -> None:
        """A runner's own event, read back from the log: its slot learns the verdict."""
        runner = self.runners.get(conversation)
        if runner is not None:
            runner.judged(event.event_id, accepted)

    def _start(self, conversation: str, partition: int, plan: ClaimPlan | None = None) -> None:
        state = self.states[conversation]
        private = _private_copy(state, plan)

        def send(value: bytes) -> Awaitable[asyncio.Future[Acknowledged]]:
            return self.log.send(self.log.topics.events, conversation, value, partition)

        slot = self.runners[conversation] = RunnerSlot(conversation, partition, send)
        rendered = self._rendered.setdefault(conversation, [])
        turn, ids = self.config.turn, self.ids.new
        limit = self.log.max_value_bytes(self.log.topics.events, conversation)
        runner = TurnRunner(
            private, slot.append, self.provider, turn, self.clock.now_ms, ids, rendered, self.replies, None, limit
        )
        work = runner.claim_and_run(plan) if plan is not None else runner.recover()
        slot.interrupt = runner.interrupt
        slot.start(work).add_done_callback(lambda _t: self._dirty.add(conversation))


def _turns(count: int) -> str:
    return "1 turn" if count == 1 else f"{count} turns"


def _held(slots: list[RunnerSlot]) -> bool:
    """Suspends each slot (again: a partition kept across a rebalance meanwhile lets its
    turns go on); True once every one is at rest."""
    for slot in slots:
        if not slot.suspended:
            slot.suspend()
    return all(slot.at_rest for slot in slots)


def _private_copy(state: ConversationState, plan: ClaimPlan | None) -> ConversationState:
    """What a runner needs of the conversation: the history its turn may see and the
    turn's inputs. History entries are never mutated once appended, so sharing them is safe."""
    private = new_state(state.conversation_id)
    private.history = list(state.history)
    if plan is not None:
        private.pending = {i.input_id: dataclasses.replace(i) for i in plan.inputs}
    private.active = copy.deepcopy(state.active)
    return private

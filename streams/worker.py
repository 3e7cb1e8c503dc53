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
import contextlib
import copy
import dataclasses
import heapq
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from turnstile.events import (
    OUTCOME_TYPES,
    DeadLetter,
    DecodeError,
    Event,
    MessageReceived,
    MessageRejected,
    ResumeRequested,
    ToolCallStarted,
    decode,
    encode,
)
from turnstile.handlers.claim import (
    ClaimPlan,
    DebouncePolicy,
    DoubleTextPolicy,
    Refusal,
    WaitUntil,
    plan_claim,
    refusal_on_arrival,
    rejection_event,
)
from turnstile.handlers.provider import ChatMessage, Provider
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.eviction import EvictionPolicy, Evictor, settled
from turnstile.streams.log import Acknowledged, EventLog, PartitionStart, Record, RecordRefused
from turnstile.streams.metrics import Metrics
from turnstile.streams.reply_deltas import DeltaPublisher
from turnstile.streams.runtime import Clock, Ids, RandomIds, SystemClock
from turnstile.streams.snapshots import Loaded, SnapshotPolicy, Snapshotter
from turnstile.streams.state_store import StateStore
from turnstile.streams.turn_runner import TurnRunner, TurnSettings

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from turnstile.streams.tracing import TurnTracer

log = logging.getLogger(__name__)

# A one-time write the log does not take is tried again after this, doubling up to the
# ceiling; on stop, writes in flight get the flush time to land before the last commit.
_EFFECT_BACKOFF_S = 0.1
_EFFECT_BACKOFF_MAX_S = 5.0
_EFFECT_FLUSH_S = 5.0


# The longest the consumer folds without letting the rest of the loop run.
YIELD_AFTER_S = 0.02


class ReplayHooks(Protocol):
    """Told when the worker starts replaying (some assigned partition is not live yet) and
    when every assigned partition has turned live; e.g. `streams.replay_gc.ReplayGc`."""

    def replaying(self) -> None: ...

    def replayed(self) -> None: ...


class FoldObserver(Protocol):
    """Told of every event the worker folds (after its fold; `ignored`: why the fold
    refused it) and of the conversations it forgets when their partition is revoked;
    e.g. `streams.read_model.WorkerReadModel`, which serves HTTP reads from this state."""

    def folded(self, record: Record, event: Event, state: ConversationState, ignored: str | None) -> None: ...

    def forgotten(self, conversations: set[str]) -> None: ...

    def restored(self, state: ConversationState) -> None:
        """A conversation of a newly assigned partition starts from its snapshot (or an
        evicted one comes back): its events up to the snapshot are not folded (told) again."""
        ...

    def evicted(self, state: ConversationState) -> None:
        """The conversation is out of memory (still owned: `Worker.state_of` reads it from the
        local store); `state` is how it left, to look at now, not to keep."""
        ...


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


@dataclass(slots=True)
class _Partition:
    end_offset: int  # replay runs to here before any decision
    committed: int  # below this, one-time effects were already done by some owner
    position: int = 0  # the next offset to fold; where reading starts on assignment
    conversations: set[str] = field(default_factory=set)
    # Assigned with snapshots: which events of the partition they include already.
    loaded: Loaded | None = None

    @property
    def live(self) -> bool:
        return self.position >= self.end_offset


@dataclass(slots=True)
class _Runner:
    task: asyncio.Task[None]
    partition: int
    last_offset: int = -1  # offset of the last event this runner appended
    # event id -> how the fold judged it when the consumer read it back (True: accepted).
    verdicts: dict[str, asyncio.Future[bool]] = field(default_factory=dict)

    def released(self, partition: _Partition) -> bool:
        """Done, and everything it wrote has been folded by the consumer."""
        return self.task.done() and partition.position > self.last_offset


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
        self.runners: dict[str, _Runner] = {}
        self._partition_of: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._timers: list[tuple[int, str]] = []
        self._last_commit = 0.0
        self._held_since = 0.0  # loop time the consumer last let the loop run
        # One-time writes in flight: (partition, offset of their record, the write).
        self._effects: list[tuple[int, int, asyncio.Future[None]]] = []
        self.dead_letters = 0
        self.effects_skipped = 0  # one-time writes the log refused for good
        # Bumped by every rebalance callback: a batch polled before one is stale.
        self._rebalances = 0
        self.draining = False  # set once stop is asked: no new claims from then on
        # Refusals (double text, resumes of no paused turn): input id -> the refusal still
        # to write; and the ids refused but not yet folded back, which block the next claim.
        self._to_reject: dict[str, dict[str, Refusal]] = {}
        self._refusing: dict[str, set[str]] = {}
        self._rejecting: dict[str, asyncio.Task[None]] = {}
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
                out[partition] = max(0, end - part.position)
        return out

    # -- rebalance -------------------------------------------------------------------
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        """Each partition starts from its snapshots, if any, and is read from where they
        leave off: returns that offset per partition."""
        self._rebalances += 1
        added = {p: _Partition(start.end_offset, start.committed) for p, start in partitions.items()}
        if self.snapshots is not None:
            for p, part in added.items():
                part.loaded = await self.snapshots.load(p)
                if part.loaded.ignored and self.metrics is not None:
                    self.metrics.on_snapshots_ignored(len(part.loaded.ignored))
                part.position = part.loaded.seek
                for conversation, state in part.loaded.resident.items():
                    self.states[conversation] = state
                    self._partition_of[conversation] = p
                    part.conversations.add(conversation)
                    for observer in self.fold_observers:
                        observer.restored(state)
                for state in part.loaded.stored:  # waiting in the local store
                    for observer in self.fold_observers:
                        observer.evicted(state)
                part.loaded.stored = []
        # Only now: records of these partitions fetched while the snapshots loaded are dropped.
        self._partitions.update(added)
        starts = {p: part.position for p, part in sorted(added.items())}
        log.info("assigned partitions %s; replaying them from %s", sorted(partitions), starts)
        for part in added.values():
            if part.live:
                self._went_live(part)
        self._note_replay()
        return starts

    async def on_revoked(self, partitions: set[int]) -> None:
        """Stop our turns on partitions we lose before the group moves them: the new
        owner rebuilds them from the log and takes over any attempt left open."""
        self._rebalances += 1
        # Forget the partitions first: while we await below, the consumer loop must neither
        # fold their records nor decide for them -- a runner started now (e.g. to take over
        # the turns we are cancelling) would outlive the revoke and write to a partition
        # another worker owns.
        leaving = [part for p in partitions if (part := self._partitions.pop(p, None)) is not None]
        stopping = [r.task for c, r in self.runners.items() if r.partition in partitions]
        stopping += [t for c, t in self._rejecting.items() if self._partition_of.get(c) in partitions]
        for task in stopping:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)
        if self.snapshots is not None:
            await self.snapshots.revoked(partitions)
        # A cancelled append may still be in the producer's buffer: let it land now, before
        # the next owner replays, rather than after it has taken the conversation over.
        await self.log.flush()
        for part in leaving:
            for conversation in part.conversations:
                self.states.pop(conversation, None)
                self.runners.pop(conversation, None)
                self._partition_of.pop(conversation, None)
                self._dirty.discard(conversation)
                self._to_reject.pop(conversation, None)
                self._refusing.pop(conversation, None)
                self._rendered.pop(conversation, None)
            for observer in self.fold_observers:
                observer.forgotten(part.conversations)
        log.info("revoked partitions %s", sorted(partitions))
        self._note_replay()

    def _went_live(self, part: _Partition) -> None:
        # Decisions were held while replaying: every conversation of the partition is due
        # one now, not only those a later event happens to touch.
        self._dirty.update(part.conversations)
        part.loaded = None  # its snapshots cover less than the end the partition was live at
        self._note_replay()

    def replay_progress(self) -> ReplayProgress:
        """Read-only, for progress reports (`streams/replay_progress.py`)."""
        parts = list(self._partitions.values())
        return ReplayProgress(
            len(parts),
            sum(not part.live for part in parts),
            sum(min(part.position, part.end_offset) for part in parts),
            sum(part.end_offset for part in parts),
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
            tasks = [r.task for r in self.runners.values()] + list(self._rejecting.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Positions run ahead of a record's one-time effects while they are written: after
            # an error (an append that failed mid-record) committing them would mark an effect
            # done that never happened. Then the next owner redoes it (at least once).
            if stopped_cleanly:
                with contextlib.suppress(Exception):
                    if self._effects:  # let the writes in flight land, for a little while
                        await asyncio.wait([e[2] for e in self._effects], timeout=_EFFECT_FLUSH_S)
                    await self._maybe_commit(force=True)
            for _p, _offset, effect in self._effects:
                effect.cancel()  # not committed past: the next owner redoes them
            if self.snapshots is not None:
                await self.snapshots.drain()
            if self.replies is not None:
                await self.replies.aclose()
            await self.log.stop()
            if self._store is not None:
                self._store.close()

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
        await self._maybe_commit()

    async def _let_the_loop_run(self) -> None:
        """Folding awaits nothing real, and neither does a poll with records at hand: a
        replay would hold the loop (the HTTP port and its probes with it) for as long as it
        lasts. Past the budget, across steps, let the loop run once."""
        now = asyncio.get_running_loop().time()
        if now - self._held_since > YIELD_AFTER_S:
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
        if part is None or record.offset < part.position:
            return  # a record of a partition revoked while this batch was in flight, or before its start
        was_live = part.live
        part.position = record.offset + 1
        in_snapshot = part.loaded is not None and part.loaded.folded_already(record)
        if not was_live and part.live:
            self._went_live(part)
        if in_snapshot:
            return
        effects = record.offset >= part.committed
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
        self._note_double_text(state, event)
        if effects and self.metrics is not None:
            self.metrics.on_event(state, event)
        if self.tracer is not None:
            self.tracer.note_input(event, record.headers)
            if effects:
                self.tracer.on_event(state, event)
        if effects and isinstance(event, (*OUTCOME_TYPES, MessageRejected)):
            self._effect(self.log.topics.outcomes, record, encode(event))
        self._dirty.add(conversation)

    def _dead_letter(self, record: Record, error: DecodeError, effects: bool) -> None:
        self.dead_letters += 1
        if effects and self.metrics is not None:
            self.metrics.on_dead_letter(error.reason)
        log.warning("dead-lettered %s/%s: %s", record.partition, record.offset, error.reason)
        if effects:
            self._effect(self.log.topics.dead_letters, record, record.value or b"", error)

    def _letter(self, record: Record, value: bytes, error: DecodeError) -> tuple[str | None, bytes]:
        """The dead letter of `record` (key, value), sized for the dead-letter topic."""
        key = None if record.key is None else record.key.decode("utf-8", "backslashreplace")
        limit = self.log.max_value_bytes(self.log.topics.dead_letters, key)
        where = (self.log.topics.events, record.partition, record.offset)
        letter = DeadLetter.of(*where, record.key, value, error.reason, error.detail, limit)
        return key, letter.encode()

    def _effect(self, topic: str, record: Record, value: bytes, error: DecodeError | None = None) -> None:
        """Start a one-time write for `record` (its outcome record; its dead letter when
        `error` is given) without holding up the consumer loop; `_maybe_commit` commits
        no offset past a record whose effect is not written yet."""
        task = asyncio.ensure_future(self._write_effect(topic, record, value, error))
        self._effects.append((record.partition, record.offset, task))

    async def _write_effect(self, topic: str, record: Record, value: bytes, error: DecodeError | None) -> None:
        """Write until the log acknowledges, backing off while it is away. A record the log
        will never accept is recorded (metric, log line, a marker on the dead-letter topic)
        and skipped: one record must not stop its partition, or the worker."""
        if error is not None:
            key, value = self._letter(record, value, error)
        else:
            key = None if record.key is None else record.key.decode("utf-8", "replace")
        delay = _EFFECT_BACKOFF_S
        while True:
            try:
                await self.log.append(topic, key, value)
                return
            except RecordRefused as exc:
                self._effect_refused(topic, record, value, exc)
                return
            except Exception as exc:
                where = f"{record.partition}@{record.offset}"
                log.warning("writing to %s for the record at %s failed, again in %.1f s: %r", topic, where, delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _EFFECT_BACKOFF_MAX_S)

    def _effect_refused(self, topic: str, record: Record, value: bytes, exc: RecordRefused) -> None:
        self.effects_skipped += 1
        if self.metrics is not None:
            self.metrics.on_effect_skipped(topic)
        where = f"{record.partition}@{record.offset}"
        log.error("skipped the write to %s for the record at %s, which the log refuses: %s", topic, where, exc)
        if topic != self.log.topics.dead_letters:  # else the marker would be refused alike
            detail = f"its record for {topic} ({len(value)} bytes) was refused: {exc}"
            self._effect(self.log.topics.dead_letters, record, value, DecodeError("effect_skipped", detail))

    # -- decisions -------------------------------------------------------------------
    def _decide(self) -> None:
        now = self.clock.now_ms()
        while self._timers and self._timers[0][0] <= now:
            self._dirty.add(heapq.heappop(self._timers)[1])
        dirty, self._dirty = self._dirty, set()
        for conversation in dirty:
            self._decide_one(conversation, now)

    def _decide_one(self, conversation: str, now: int) -> None:
        state = self.states.get(conversation)
        partition = self._partition_of.get(conversation)
        if state is None or partition is None:
            return
        part = self._partitions.get(partition)
        if part is None or not part.live:
            return  # being revoked, or still replaying: the state is not the log's present yet
        if self._refusals_pending(conversation, state, partition):
            return  # refused messages leave the pending set before anything is claimed
        runner = self.runners.get(conversation)
        if runner is not None:
            if not runner.released(part):
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

    # -- double text -------------------------------------------------------------------
    def _note_double_text(self, state: ConversationState, event: Event) -> None:
        conversation = state.conversation_id
        refusal = refusal_on_arrival(self.config.double_text, state, event)
        if refusal is not None:
            assert isinstance(event, (MessageReceived, ResumeRequested))
            input_id = event.message_id if isinstance(event, MessageReceived) else event.request_id
            self._to_reject.setdefault(conversation, {})[input_id] = refusal
            self._refusing.setdefault(conversation, set()).add(input_id)
        elif isinstance(event, MessageRejected):
            self._to_reject.get(conversation, {}).pop(event.message_id, None)
            self._refusing.get(conversation, set()).discard(event.message_id)

    def _refusals_pending(self, conversation: str, state: ConversationState, partition: int) -> bool:
        """Writes the refusals still owed and says whether any is not yet folded back."""
        refusing = self._refusing.get(conversation)
        if refusing:
            refusing.intersection_update(state.pending)  # claimed or refused by an earlier owner
        if not refusing:
            self._to_reject.pop(conversation, None)
            self._refusing.pop(conversation, None)
            return False
        owed = {m: t for m, t in self._to_reject.get(conversation, {}).items() if m in refusing}
        if owed and conversation not in self._rejecting:
            work = self._write_refusals(conversation, partition, owed)
            task = asyncio.create_task(work, name=f"reject:{conversation}")
            self._rejecting[conversation] = task

            def done(t: asyncio.Task[None]) -> None:
                self._rejecting.pop(conversation, None)
                if not t.cancelled() and t.exception() is not None:
                    log.warning("writing refusals for %s failed (tried again soon): %r", conversation, t.exception())
                    heapq.heappush(self._timers, (self.clock.now_ms() + 500, conversation))
                else:
                    self._dirty.add(conversation)

            task.add_done_callback(done)
        return True

    async def _write_refusals(self, conversation: str, partition: int, owed: dict[str, Refusal]) -> None:
        state = self.states[conversation]
        for message_id, refusal in owed.items():
            event = rejection_event(state, message_id, refusal, event_id=self.ids.new(), now_ms=self.clock.now_ms())
            await self.log.append(self.log.topics.events, conversation, encode(event), partition)
            self._to_reject.get(conversation, {}).pop(message_id, None)

    def _read_back(self, conversation: str, event: Event, accepted: bool) -> None:
        """A runner's own event, read back from the log. If the fold refused it, another owner
        took the turn over (or won the claim) first: every reader ignores this run from here
        on, so the runner stops instead of calling the model or tools for nothing."""
        runner = self.runners.get(conversation)
        verdict = runner.verdicts.pop(event.event_id, None) if runner is not None else None
        if runner is None or verdict is None:
            return
        if not verdict.done():
            verdict.set_result(accepted)
        if not accepted and not runner.task.done():
            log.warning("%s of %s refused on the log: its run was superseded; stopping it", event.type, conversation)
            runner.task.cancel()

    def _start(self, conversation: str, partition: int, plan: ClaimPlan | None = None, recover: bool = False) -> None:
        state = self.states[conversation]
        private = _private_copy(state, plan)
        slot: _Runner

        unacked: list[asyncio.Future[Acknowledged]] = []

        async def append(event: Event, wait: bool = True) -> None:
            """`wait=False` returns once the event is in the log's order; the next append
            that waits also waits for its acknowledgement (one round trip for both)."""
            verdict = slot.verdicts[event.event_id] = asyncio.get_running_loop().create_future()
            unacked.append(await self.log.send(self.log.topics.events, conversation, encode(event), partition))
            if not wait:
                return
            acks = unacked[:]
            unacked.clear()
            for ack in acks:
                slot.last_offset = max(slot.last_offset, (await ack).offset)
            # Fencing a side effect: the tool runs only once its ToolCallStarted is read back
            # as accepted. Written after another owner's takeover, it is ignored by every
            # reader -- and the tool must not run either (the zombie case).
            if isinstance(event, ToolCallStarted) and event.side_effect and not await verdict:
                raise asyncio.CancelledError(f"run {event.run_id} was superseded before its side effect")

        rendered = self._rendered.setdefault(conversation, [])
        runner = TurnRunner(
            private, append, self.provider, self.config.turn, self.clock.now_ms, self.ids.new, rendered, self.replies
        )
        work = runner.recover() if recover else runner.claim_and_run(plan)  # type: ignore[arg-type]
        task = asyncio.create_task(work, name=f"turn:{conversation}")
        slot = self.runners[conversation] = _Runner(task, partition)
        task.add_done_callback(lambda _t: self._dirty.add(conversation))

    async def _maybe_commit(self, force: bool = False) -> None:
        loop_time = asyncio.get_running_loop().time()
        if not force and loop_time - self._last_commit < self.config.commit_interval_s:
            return
        self._last_commit = loop_time
        # A record's one-time effects must be on the log before an offset past it is
        # committed: else nobody would redo one that never got written.
        unwritten: dict[int, int] = {}
        self._effects = [e for e in self._effects if not e[2].done()]
        for p, offset, _write in self._effects:
            unwritten[p] = min(unwritten.get(p, offset), offset)
        parts = {p: part for p, part in self._partitions.items() if part.live and part.position > 0}
        offsets = {p: min(part.position, unwritten.get(p, part.position)) for p, part in parts.items()}
        if offsets:
            await self.log.commit(offsets)
        if self.snapshots is not None:
            # Only the consumer loop folds, and it is here: the partitions still ours (not
            # reassigned while the commit was awaited) are folded to exactly their positions.
            positions = {p: part.position for p, part in parts.items() if self._partitions.get(p) is part}
            self.snapshots.checkpoint(positions, offsets, self.clock.now_ms(), self.states.get, self._owes_nothing,
                                      final=force)  # fmt: skip
        self._evict()

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
        return (
            state is not None
            and partition is not None
            and settled(state)
            and conversation not in self.runners
            and conversation not in self._dirty
            and self._owes_nothing(conversation)
            and self.snapshots is not None
            and self.snapshots.clean(partition, conversation)
        )

    def _owes_nothing(self, conversation: str) -> bool:
        """No refusal is owed for it: one not yet on the log is the worker's alone, so a
        snapshot would hide it from the next owner (a full replay would not)."""
        return not self._refusing.get(conversation) and conversation not in self._rejecting

def _private_copy(state: ConversationState, plan: ClaimPlan | None) -> ConversationState:
    """What a runner needs of the conversation: the history its turn may see and the
    turn's inputs. History entries are never mutated once appended, so sharing them is safe."""
    private = new_state(state.conversation_id)
    private.history = list(state.history)
    if plan is not None:
        private.pending = {i.input_id: dataclasses.replace(i) for i in plan.inputs}
    private.active = copy.deepcopy(state.active)
    return private

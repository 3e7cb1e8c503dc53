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

from events import OUTCOME_TYPES, DeadLetter, DecodeError, Event, decode, encode
from handlers.claim import ClaimPlan, DebouncePolicy, WaitUntil, plan_claim
from handlers.provider import Provider
from projections import ConversationState, apply_event, new_state
from streams.log import EventLog, PartitionStart, Record
from streams.runtime import Clock, Ids, RandomIds, SystemClock
from streams.turn_runner import TurnRunner, TurnSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    debounce: DebouncePolicy = DebouncePolicy()
    turn: TurnSettings = TurnSettings()
    max_value_bytes: int = 1_000_000
    commit_interval_s: float = 1.0
    max_poll_wait_s: float = 0.1


@dataclass(slots=True)
class _Partition:
    end_offset: int  # replay runs to here before any decision
    committed: int  # below this, one-time effects were already done by some owner
    position: int = 0
    conversations: set[str] = field(default_factory=set)

    @property
    def live(self) -> bool:
        return self.position >= self.end_offset


@dataclass(slots=True)
class _Runner:
    task: asyncio.Task[None]
    partition: int
    last_offset: int = -1  # offset of the last event this runner appended

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
    ) -> None:
        self.log = log_
        self.provider = provider
        self.config = config
        self.clock = clock or SystemClock()
        self.ids = ids or RandomIds()
        self.states: dict[str, ConversationState] = {}
        self.partitions: dict[int, _Partition] = {}
        self.runners: dict[str, _Runner] = {}
        self._partition_of: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._timers: list[tuple[int, str]] = []
        self._last_commit = 0.0
        self.dead_letters = 0

    # -- rebalance -------------------------------------------------------------------
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> None:
        for p, start in partitions.items():
            self.partitions[p] = _Partition(start.end_offset, start.committed)
        log.info("assigned partitions %s; replaying them from the beginning", sorted(partitions))

    async def on_revoked(self, partitions: set[int]) -> None:
        """Stop our turns on partitions we lose before the group moves them: the new
        owner rebuilds them from the log and takes over any attempt left open."""
        stopping = [r.task for c, r in self.runners.items() if r.partition in partitions]
        for task in stopping:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)
        # A cancelled append may still be in the producer's buffer: let it land now, before
        # the next owner replays, rather than after it has taken the conversation over.
        await self.log.flush()
        for p in partitions:
            part = self.partitions.pop(p, None)
            for conversation in part.conversations if part else ():
                self.states.pop(conversation, None)
                self.runners.pop(conversation, None)
                self._partition_of.pop(conversation, None)
                self._dirty.discard(conversation)
        log.info("revoked partitions %s", sorted(partitions))

    # -- main loop -------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await self.log.start(self)
        try:
            while not stop.is_set():
                records = await self.log.poll(self._poll_wait_s())
                for record in records:
                    await self._consume(record)
                self._decide()
                await self._maybe_commit()
        finally:
            tasks = [r.task for r in self.runners.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._maybe_commit(force=True)
            await self.log.stop()

    def _poll_wait_s(self) -> float:
        wait = self.config.max_poll_wait_s
        if self._timers:
            wait = min(wait, max(0.0, (self._timers[0][0] - self.clock.now_ms()) / 1000))
        return 0.0 if self._dirty else wait

    async def _consume(self, record: Record) -> None:
        part = self.partitions.get(record.partition)
        if part is None:
            return  # a record of a partition revoked while this batch was in flight
        part.position = record.offset + 1
        effects = record.offset >= part.committed
        event = decode(record.value, self.config.max_value_bytes)
        if isinstance(event, DecodeError):
            await self._dead_letter(record, event, effects)
            return
        key = record.key.decode("utf-8", "replace") if record.key is not None else None
        if key != event.conversation_id:
            err = DecodeError("key_mismatch", f"key {key!r} is not the conversation id {event.conversation_id!r}")
            await self._dead_letter(record, err, effects)
            return
        conversation = event.conversation_id
        state = self.states.get(conversation)
        if state is None:
            state = self.states[conversation] = new_state(conversation)
            self._partition_of[conversation] = record.partition
            part.conversations.add(conversation)
        rejection = apply_event(state, event)
        if rejection is not None:
            if rejection.conflict:
                await self._dead_letter(record, DecodeError("conflicting_duplicate", rejection.reason), effects)
            else:
                log.debug("ignored %s at %s/%s: %s", event.type, record.partition, record.offset, rejection.reason)
            return
        if effects and isinstance(event, OUTCOME_TYPES):
            await self.log.append(self.log.topics.outcomes, conversation, encode(event))
        self._dirty.add(conversation)

    async def _dead_letter(self, record: Record, error: DecodeError, effects: bool) -> None:
        self.dead_letters += 1
        log.warning("dead-lettered %s/%s: %s", record.partition, record.offset, error.reason)
        if effects:
            letter = DeadLetter.of(
                self.log.topics.events,
                record.partition,
                record.offset,
                record.key,
                record.value,
                error.reason,
                error.detail,
            )
            await self.log.append(self.log.topics.dead_letters, letter.key or "", letter.encode())

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
        part = self.partitions[partition]
        if not part.live:
            return  # still replaying: the state is not the log's present yet
        runner = self.runners.get(conversation)
        if runner is not None:
            if not runner.released(part):
                return
            del self.runners[conversation]
        if state.active is not None:
            # Nobody here runs it, and this partition is ours: its owner is gone.
            self._start(conversation, partition, recover=True)
            return
        decision = plan_claim(state, now, self.config.debounce)
        if isinstance(decision, WaitUntil):
            heapq.heappush(self._timers, (decision.due_ms, conversation))
        elif isinstance(decision, ClaimPlan):
            self._start(conversation, partition, plan=decision)

    def _start(self, conversation: str, partition: int, plan: ClaimPlan | None = None, recover: bool = False) -> None:
        state = self.states[conversation]
        private = _private_copy(state, plan)
        slot: _Runner

        async def append(event: Event) -> None:
            _, offset = await self.log.append(self.log.topics.events, conversation, encode(event), partition)
            slot.last_offset = max(slot.last_offset, offset)

        runner = TurnRunner(private, append, self.provider, self.config.turn, self.clock.now_ms, self.ids.new)
        work = runner.recover() if recover else runner.claim_and_run(plan)  # type: ignore[arg-type]
        task = asyncio.create_task(work, name=f"turn:{conversation}")
        slot = self.runners[conversation] = _Runner(task, partition)
        task.add_done_callback(lambda _t: self._dirty.add(conversation))

    async def _maybe_commit(self, force: bool = False) -> None:
        loop_time = asyncio.get_running_loop().time()
        if not force and loop_time - self._last_commit < self.config.commit_interval_s:
            return
        self._last_commit = loop_time
        offsets = {p: part.position for p, part in self.partitions.items() if part.live and part.position > 0}
        if offsets:
            await self.log.commit(offsets)


def _private_copy(state: ConversationState, plan: ClaimPlan | None) -> ConversationState:
    """What a runner needs of the conversation: the history its turn may see and the
    turn's inputs. History entries are never mutated once appended, so sharing them is safe."""
    private = new_state(state.conversation_id)
    private.history = list(state.history)
    if plan is not None:
        private.pending = {i.input_id: dataclasses.replace(i) for i in plan.inputs}
    private.active = copy.deepcopy(state.active)
    return private

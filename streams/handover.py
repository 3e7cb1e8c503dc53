"""What a rebalance does to the turns running on a worker: a revoke lets each turn's step in
progress finish and holds the turn at its next step boundary; the assignment after it says
which partitions stayed (their turns go on where they stopped) and which moved (their
turns, at rest, are cancelled there and their conversations forgotten: the new owner
resumes them from the journal).

aiokafka's rebalances are eager -- every member revokes everything -- so whether a
partition really moves is known only at the assignment that follows a revoke: nothing it
names is dropped at the revoke itself. The worker calls `revoke`, then `hand_over` with the
partitions the assignment did not give back, then `continue_kept` for each partition that
came back once it is live. (A revoke also hands over what an earlier revoke held and it
does not name: the assignment between was abandoned, `Worker.on_revoked`.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from turnstile.projections import ConversationState
from turnstile.streams.checkpoint import Checkpoint
from turnstile.streams.log import EventLog, Record
from turnstile.streams.partitions import OwnedPartition, Partitions
from turnstile.streams.refusals import Refusals
from turnstile.streams.runner_slot import RunnerSlot
from turnstile.streams.snapshots import Snapshotter

log = logging.getLogger(__name__)


class Handover:
    def __init__(
        self,
        log_: EventLog,
        partitions: Partitions,
        runners: dict[str, RunnerSlot],
        states: Mapping[str, ConversationState],
        checkpoint: Checkpoint,
        refusals: Refusals,
        snapshots: Snapshotter | None,
        grace_s: float,
        fold: Callable[[Record, OwnedPartition], Awaitable[None]],
        forget: Callable[[int, OwnedPartition], None],
        due: Callable[[Iterable[str]], None],
    ) -> None:
        """`fold`: the worker's fold of one record of an owned partition (its conversation's
        state made local first); `forget`: drop what
        the worker holds of a partition's conversations (their states, prompts, observers);
        `due`: conversations to decide for at the next step. `grace_s`: how long the steps in
        progress may take at a revoke (see `WorkerConfig.revoke_grace_s`)."""
        self.log = log_
        self.partitions = partitions
        self.runners = runners
        self.states = states
        self.checkpoint = checkpoint
        self.refusals = refusals
        self.snapshots = snapshots
        self.grace_s = grace_s
        self._fold = fold
        self._forget = forget
        self._due = due

    async def revoke(self, partitions: set[int]) -> None:
        """Before the group moves partitions: let the step in progress of each turn on them
        finish (a model reply recorded, a tool call and its ToolCallFinished), hold each turn
        at its next step boundary, write the effects due and commit."""
        # From here no decision is taken for them: a runner started now would outlive the
        # revoke and might write to a partition another worker owns.
        revoked = self.partitions.hold(partitions)
        slots = [slot for slot in self.runners.values() if slot.partition in revoked]
        for slot in slots:
            slot.suspend()
        deadline = asyncio.get_running_loop().time() + self.grace_s
        await self._read_back_now(slots, deadline)
        refusals = self.refusals.writers(c for part in revoked.values() for c in part.conversations)
        busy = await until_at_rest(slots, refusals, deadline)
        if busy:
            log.warning("revoke: %d steps outlasted %.1f s; the next owner resumes them", busy, self.grace_s)
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
                    part = self.partitions[p]
                    for record in await reader.span(self.log.topics.events, p, part.at.position, end):
                        await self._fold(record, part)
        except Exception as exc:  # cut off at the grace like the call itself (did not start)
            log.warning("revoke: the read-back of started calls failed: %r", exc)

    def moved(self, assigned: Iterable[int]) -> list[int]:
        """Partitions revoked and not given back by the assignment `assigned`."""
        back = set(assigned)
        return [p for p in self.partitions.suspended() if p not in back]

    async def hand_over(self, partitions: list[int]) -> None:
        """Drop partitions that moved to another member: their turns, at rest at a step
        boundary, are cancelled there (the new owner resumes them from the journal)."""
        if not partitions:
            return
        stopping = [s.task for s in self.runners.values() if s.partition in partitions and s.task is not None]
        stopping += self.refusals.writers(c for p in partitions for c in self.partitions[p].conversations)
        for task in stopping:
            task.cancel()
        await asyncio.gather(*stopping, return_exceptions=True)
        await self.log.flush()
        if self.snapshots is not None:
            self.snapshots.handed_over(partitions)
        for p in partitions:
            part = self.partitions.drop(p)
            self.checkpoint.drop(p)
            for conversation in part.conversations:
                self.runners.pop(conversation, None)
                self.refusals.forget(conversation)
            self._forget(p, part)
        log.info("handed over partitions %s", sorted(partitions))

    def continue_kept(self, partition: int) -> None:
        """A partition that stayed ours is live again: its suspended turns go on where they
        stopped -- unless the log now shows another run (another owner took over while this
        member was out of the group), then they stop and the fold's present decides. A run
        closed meanwhile but still current goes on too: every reader refuses what it writes
        next, and its read-back stops it."""
        part = self.partitions[partition]
        part.suspended = False
        for conversation, slot in list(self.runners.items()):
            if slot.partition != partition or not slot.suspended:
                continue
            active = self.states[conversation].active
            if active is not None and active.run_id == slot.run_id:
                slot.resume()
            elif slot.task is not None:
                slot.task.cancel()
        self._due(part.conversations)


async def until_at_rest(slots: list[RunnerSlot], others: list[asyncio.Task[None]], deadline: float) -> int:
    """Wait, until the loop time `deadline`, for each suspended slot's step in progress to end
    and for `others`; whatever outlasts it is cancelled (left to whoever resumes it next).
    Returns how many slots were still busy then."""
    waits = [asyncio.ensure_future(slot.until_at_rest()) for slot in slots] + others
    if not waits:
        return 0
    left = max(0.0, deadline - asyncio.get_running_loop().time())
    _done, late = await asyncio.wait(waits, timeout=left)
    busy = [slot.task for slot in slots if not slot.at_rest and slot.task is not None]
    for task in [*late, *busy]:
        task.cancel()
    await asyncio.gather(*late, *busy, return_exceptions=True)
    return len(busy)

"""A revoke lets the step in progress finish and holds the turn at its next step boundary;
the assignment after it decides: a partition that stayed continues its turns where they
stopped (no interrupted attempt, nothing asked or run again), one that moved drops them
at rest for the next owner to resume from the journal.

Staged exactly on the embedded log: the test calls the worker's rebalance callbacks as the
Kafka listener does (revoke everything, then assign), while a side-effecting tool is
running. The same behaviour on the real broker is `test_kafka_scale_out.py`."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import pytest
from loop_harness import Transfer
from worker_harness import FAST, events_of, running, until

from turnstile.events import (
    AttemptFailed,
    AttemptStarted,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnCompleted,
    Usage,
)
from turnstile.handlers.provider import ModelReply, ModelRequest, ReplyStream
from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider, echo_reply
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import PartitionStart, Record
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.snapshots import SnapshotPolicy
from turnstile.streams.worker import Worker, WorkerConfig

NOW = SystemClock().now_ms


def script(request: ModelRequest) -> Scripted:
    """model -> transfer -> "Sent." """
    if request.messages[-1].role == "tool":
        return Scripted(ModelReply(request.model, "Sent.", (), Usage(input_tokens=1, output_tokens=1), "stop"))
    call = ToolCall(call_id="call_1", name="transfer", arguments='{"to": "bob", "amount": 1}')
    return Scripted(ModelReply(request.model, None, (call,), Usage(input_tokens=1, output_tokens=1), "tool_calls"))


class Transfers:
    """A side-effecting tool the test holds inside its body until it lets it finish."""

    def __init__(self) -> None:
        self.runs = 0
        self.inside = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, args: Transfer) -> str:
        self.runs += 1
        self.inside.set()
        await self.release.wait()
        return f"sent {args.amount} to {args.to}"

    def registry(self) -> ToolRegistry:
        return ToolRegistry([Tool("transfer", "Send money.", Transfer, self, "side_effect")])


def config_for(transfers: Transfers, revoke_grace_s: float = 5.0) -> WorkerConfig:
    turn = dataclasses.replace(FAST.turn, tools=transfers.registry())
    return dataclasses.replace(FAST, turn=turn, revoke_grace_s=revoke_grace_s)


async def assign(log: FileLog, worker: Worker, end: int) -> Mapping[int, int]:
    """The partition assigned again, as the Kafka listener does it: read on from where the
    worker says."""
    positions = await worker.on_assigned({0: PartitionStart(end, committed=0)})
    log.seek(0, positions[0])
    return positions


def types(log: FileLog) -> list[str]:
    return [e.type for e in events_of(log, "c1")]


async def revoke_mid_transfer(log: FileLog, worker: Worker, transfers: Transfers) -> asyncio.Task[None]:
    """Run the worker, start a turn, and revoke while its transfer is inside its body."""
    await publish(log, message_event("c1", "pay bob", NOW() - 60_000, "m1"))
    await asyncio.wait_for(transfers.inside.wait(), 20)
    return asyncio.create_task(worker.on_revoked({0}))


async def test_a_revoke_finishes_the_tool_in_progress_and_a_partition_that_stays_goes_on(tmp_path) -> None:
    log, transfers, provider = FileLog(tmp_path, partitions=1), Transfers(), ScriptedProvider(script)
    async with running(log, provider, config_for(transfers)) as worker:
        revoking = await revoke_mid_transfer(log, worker, transfers)
        await asyncio.sleep(0)  # the revoke has begun: it waits for the step in progress
        assert not revoking.done()
        transfers.release.set()
        await asyncio.wait_for(revoking, 10)
        # The revoke returned once the step was on the log; the next step is held back.
        assert types(log)[-1] == "ToolCallFinished"
        assert len(provider.requests) == 1

        end = log.end_offset(0)
        positions = await assign(log, worker, end)
        assert 0 < positions[0] <= end  # kept: read on from where its fold stands, no replay
        await until(lambda: "TurnCompleted" in types(log), 20)
    events = events_of(log, "c1")
    assert [e.type for e in events if isinstance(e, (AttemptStarted, AttemptFailed))] == ["AttemptStarted"]
    assert sum(isinstance(e, ToolCallStarted) for e in events) == sum(isinstance(e, ToolCallFinished) for e in events)
    assert transfers.runs == 1 and len(provider.requests) == 2
    assert [e.reply for e in events if isinstance(e, TurnCompleted)] == ["Sent."]


async def revoked_at_rest(log: FileLog, worker: Worker, transfers: Transfers) -> int:
    """`revoke_mid_transfer`, the transfer let finish: the turn at rest, the revoke done.
    Returns how many events of c1 are on the log then."""
    revoking = await revoke_mid_transfer(log, worker, transfers)
    transfers.release.set()
    await asyncio.wait_for(revoking, 10)
    return len(types(log))


def resumed_from_the_journal(log: FileLog, transfers: Transfers) -> None:
    """The interrupted attempt was continued by a new one, and the transfer did not run again."""
    events = events_of(log, "c1")
    assert [type(e).__name__ for e in events if isinstance(e, (AttemptStarted, AttemptFailed))] == [
        "AttemptStarted",
        "AttemptFailed",
        "AttemptStarted",
    ]
    assert transfers.runs == 1
    assert [e.reply for e in events if isinstance(e, TurnCompleted)] == ["Sent."]


async def test_a_partition_held_since_a_revoke_that_the_next_revoke_does_not_name_is_dropped_there(tmp_path) -> None:
    log, transfers = FileLog(tmp_path, partitions=1), Transfers()
    async with running(log, ScriptedProvider(script), config_for(transfers)) as worker:
        written = await revoked_at_rest(log, worker, transfers)
        # The assignment after that revoke gave the partition to another member, and was
        # abandoned before the worker heard of it (on Kafka: a rebalance came first), so the
        # next revoke names nothing: the partition is dropped there, its turn at rest.
        await worker.on_revoked(set())
        assert worker.state_of("c1") is None and worker.partition_liveness() == {}
        assert len(types(log)) == written
        # Given back, it is taken as new -- the other member may have resumed its turns and
        # committed past this fold -- not kept: the turn is resumed from the journal.
        await assign(log, worker, log.end_offset(0))
        await until(lambda: "TurnCompleted" in types(log), 20)
    resumed_from_the_journal(log, transfers)


async def test_a_partition_that_moved_drops_its_turns_at_rest_and_the_next_owner_resumes_them(tmp_path) -> None:
    log, transfers = FileLog(tmp_path, partitions=1), Transfers()
    async with running(log, ScriptedProvider(script), config_for(transfers)) as worker:
        written = await revoked_at_rest(log, worker, transfers)
        await worker.on_assigned({})  # the group gave the partition to another member
        assert worker.state_of("c1") is None and worker.partition_liveness() == {}
        assert len(types(log)) == written  # cancelled between steps: nothing more written

    # The next owner continues the interrupted attempt from the journal: the transfer, on
    # the log with its result, does not run again.
    provider = ScriptedProvider(script)
    async with running(FileLog(tmp_path, partitions=1), provider, config_for(transfers)):
        await until(lambda: "TurnCompleted" in types(log), 20)
    resumed_from_the_journal(log, transfers)
    assert len(provider.requests) == 1


async def test_a_step_that_outlasts_the_revoke_grace_is_cancelled_and_resumed_when_the_partition_stays(
    tmp_path,
) -> None:
    log, transfers = FileLog(tmp_path, partitions=1), Transfers()
    async with running(log, ScriptedProvider(script), config_for(transfers, revoke_grace_s=0.1)) as worker:
        revoking = await revoke_mid_transfer(log, worker, transfers)
        await asyncio.wait_for(revoking, 10)  # the transfer is still inside its body: cut off
        transfers.release.set()
        await assign(log, worker, log.end_offset(0))
        await until(lambda: "TurnFailed" in types(log) or "TurnCompleted" in types(log), 20)
    # The cut-off transfer is in doubt and not idempotent: the turn fails visibly, once.
    assert types(log).count("AttemptFailed") == 1 and types(log).count("TurnFailed") == 1
    assert transfers.runs == 1


class StalledConsumer(FileLog):
    """Reads nothing from the moment a side-effecting call is started until `resume`: as
    aiokafka's consumer reads nothing while its group rebalances."""

    stalled = False

    async def send(self, topic: str, key: str, value: bytes, partition: int | None = None):  # type: ignore[no-untyped-def]
        sent = await super().send(topic, key, value, partition)
        self.stalled = self.stalled or b'"ToolCallStarted"' in value
        return sent

    async def poll(self, timeout_s: float) -> list:  # type: ignore[type-arg]
        if self.stalled:
            await asyncio.sleep(timeout_s)
            return []
        return await super().poll(timeout_s)


async def test_a_revoke_reads_back_a_started_call_itself_so_the_call_runs_in_it(tmp_path) -> None:
    log, transfers, provider = StalledConsumer(tmp_path, partitions=1), Transfers(), ScriptedProvider(script)
    async with running(log, provider, config_for(transfers)) as worker:
        await publish(log, message_event("c1", "pay bob", NOW() - 60_000, "m1"))
        await until(lambda: "ToolCallStarted" in types(log), 20)
        assert transfers.runs == 0  # its read-back never comes while the consumer stalls
        revoking = asyncio.create_task(worker.on_revoked({0}))
        await asyncio.wait_for(transfers.inside.wait(), 20)  # the revoke read it back: it runs
        transfers.release.set()
        await asyncio.wait_for(revoking, 10)
        assert types(log)[-1] == "ToolCallFinished"
        log.stalled = False
        await assign(log, worker, log.end_offset(0))
        await until(lambda: "TurnCompleted" in types(log), 20)
    assert "AttemptFailed" not in types(log) and transfers.runs == 1


class NewOwnerLog(StalledConsumer):
    """A new owner's log whose background pass of snapshots never gets its read (a row stays
    unfilled: its conversation's state is a head only, in the local store)."""

    async def read_partitions(self, topic: str, partitions: list[int], starts=None):  # type: ignore[no-untyped-def]
        if topic == self.topics.snapshots:
            await asyncio.Event().wait()
        async for chunk in super().read_partitions(topic, partitions, starts):
            yield chunk

    async def read_at(self, topic: str, partition: int, offsets: list[int]) -> dict[int, Record]:
        return {r.offset: r for r in self.read_all(topic, partition) if r.offset in offsets}  # point reads still work


async def test_a_revoke_reading_back_an_event_of_a_conversation_not_fetched_yet_brings_it_first(tmp_path) -> None:
    transfers = Transfers()
    config = dataclasses.replace(config_for(transfers), snapshots=SnapshotPolicy(idle_ms=0))
    # An earlier owner answered c0 and left its snapshot and head on the log.
    first = FileLog(tmp_path, partitions=1)
    async with running(first, ScriptedProvider(), config):
        await publish(first, message_event("c0", "hello", NOW() - 60_000, "m1"))
        await until(lambda: any(r.key == b"c0" for r in first.read_all(first.topics.heads)), 20)
    log = NewOwnerLog(tmp_path, partitions=1)

    class Provider(ScriptedProvider):
        async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
            if request.messages[-1].content == "pay bob":
                # From here the consumer reads nothing (a rebalance begins), and c0 speaks
                # again before c1's call is started: its event is in what the revoke reads back.
                log.stalled = True
                await publish(log, message_event("c0", "one more thing", NOW() - 60_000, "m2"))
            return await super().complete(request, stream)

    def answer(request: ModelRequest) -> Scripted:  # c1 pays bob; c0 is answered in words
        return script(request) if request.messages[-1].content == "pay bob" else Scripted(echo_reply(request))

    async with running(log, Provider(answer), config) as worker:
        await until(lambda: worker.partition_liveness() == {0: True}, 20)
        await publish(log, message_event("c1", "pay bob", NOW() - 60_000, "m1"))
        await until(lambda: "ToolCallStarted" in types(log), 20)
        revoking = asyncio.create_task(worker.on_revoked({0}))
        await asyncio.wait_for(transfers.inside.wait(), 20)  # read back through c0's event
        transfers.release.set()
        await asyncio.wait_for(revoking, 10)
        log.stalled = False
        await assign(log, worker, log.end_offset(0))
        # c0's message was folded onto its history (its state brought from the snapshot topic
        # first), not passed over: the partition stayed, and c0 is answered in full
        await until(lambda: len(getattr(worker.state_of("c0"), "turns", ())) == 2, 20)
        state = worker.state_of("c0")
        assert state is not None and not state.pending
        assert [h.content for h in state.history if h.role == "user"] == ["hello", "one more thing"]


async def stopped_mid_revoke(
    log: FileLog, transfers: Transfers
) -> tuple[Worker, asyncio.Task[None], asyncio.Task[None]]:
    """A worker revoking while its transfer is inside its body, stopped (SIGTERM while the
    group rebalances): its loop has ended (no drain grace here). Returns it, its run and
    the revoke."""
    worker = Worker(log, ScriptedProvider(script), config_for(transfers))
    run = asyncio.create_task(worker.run(stop := asyncio.Event()))
    revoking = await revoke_mid_transfer(log, worker, transfers)
    stop.set()
    await until(lambda: worker.draining)
    return worker, run, revoking


async def test_a_stop_during_a_revoke_lets_the_revoke_finish_its_step_and_commit_first(tmp_path) -> None:
    log, transfers = FileLog(tmp_path, partitions=1), Transfers()
    _worker, run, revoking = await stopped_mid_revoke(log, transfers)
    # The transfer in progress still finishes and is recorded: the stop waits for the revoke
    # (before, it cancelled the turn mid-call and closed the checkpoint under it)
    assert not run.done()
    transfers.release.set()
    await asyncio.wait_for(revoking, 10)
    await asyncio.wait_for(run, 10)
    assert types(log)[-1] == "ToolCallFinished" and transfers.runs == 1
    # committed through what the revoke read back (the call's start), not through its finish,
    # which no one read: the next owner folds it
    assert log.committed_offsets() == {0: log.end_offset(0) - 1}


async def test_a_second_stop_during_a_revoke_closes_at_once_and_still_lets_go_of_everything(tmp_path) -> None:
    log, transfers = FileLog(tmp_path, partitions=1), Transfers()
    worker, run, revoking = await stopped_mid_revoke(log, transfers)
    assert not run.done()  # waiting for the revoke...
    run.cancel()  # ...when a second signal comes: the stop waits no more
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 10)
    # and it still closed what it holds: the local store, and the log (another owner may open it)
    store = worker.stored_listing
    assert store is not None and store.closed
    FileLog(tmp_path, partitions=1).own()
    transfers.release.set()
    await asyncio.wait_for(revoking, 10)


class RevokedAtTheStop:
    """A model call that never answers. When the stop cancels it, the group revokes the
    partition -- a rebalance landing while the worker closes."""

    family = "scripted"

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.called = asyncio.Event()
        self.revoking: asyncio.Future[None] | None = None

    async def complete(self, request: ModelRequest, stream: ReplyStream | None = None) -> ModelReply:
        self.called.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            assert self.worker is not None
            self.revoking = asyncio.ensure_future(self.worker.on_revoked({0}))  # before the stop's last commit
            raise
        raise AssertionError("never answered")


async def test_a_partition_revoked_while_the_worker_stops_is_left_out_of_its_last_commit(tmp_path) -> None:
    # Given a worker that has folded records it has not committed yet
    log, provider = FileLog(tmp_path, partitions=1), RevokedAtTheStop()
    worker = Worker(log, provider, dataclasses.replace(FAST, commit_interval_s=3600))
    provider.worker = worker
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await publish(log, message_event("c1", "hello", NOW() - 60_000, "m1"))
    await asyncio.wait_for(provider.called.wait(), 20)
    await until(lambda: worker.folded_past(0, 2))  # the turn's claim and attempt read back
    before = log.committed_offsets()
    assert before.get(0, 0) < 3  # (its first commit came before them)
    # When the group revokes its partition while it stops (the revoke changes nothing else
    # once the loop has ended)
    stop.set()
    await run
    assert provider.revoking is not None and provider.revoking.done()
    # Then its last commit leaves that partition out: another member may own it already and
    # have committed past this worker's fold
    assert log.committed_offsets() == before

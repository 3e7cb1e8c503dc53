"""A rolling deploy under a steady stream of turns with a side effect, on the real broker.

Two workers in one group; each turn is model -> `transfer` (side effect) -> model answer.
In the middle of the stream worker 1 is stopped (as SIGTERM stops it: a drain) and
started again, then worker 2 (or: worker 1 dies; or: a third worker joins). The figures
come from the topics, read afterwards by an independent reader, and from a counter
inside the tool. Used by `test_kafka_rolling_deploy.py`, `test_kafka_scale_out.py`
(assert the counts) and `bench/deploy.py` (prints them against a run with no deploy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from loop_harness import Transfer
from worker_harness import until

from turnstile.events import (
    OUTCOME_TYPES,
    AttemptFailed,
    DecodeError,
    Event,
    ModelResponded,
    ToolCall,
    TurnClaimed,
    TurnFailed,
    Usage,
    decode,
)
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.provider import ModelReply, ModelRequest
from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.streams.kafka_log import KafkaLog, Membership
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import PartitionStart, Topics, partition_for
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig

PARTITIONS = 8  # of the events topic the scenario runs on


@dataclass(frozen=True, slots=True)
class Shape:
    messages: int = 120
    conversations: int = 60
    over_s: float = 8.0
    model_s: float = 0.2
    transfer_s: float = 0.5
    # rolling: each worker drained and started again in turn; crash: worker 1 stops dead
    # (cancelled, nothing drained or committed; a static member does not leave the group,
    # so the group sees what SIGKILL shows it) and is not started again; scale-out: a
    # third worker joins (an eager rebalance: every member revokes every partition).
    deploy: Literal["none", "rolling", "crash", "scale-out"] = "rolling"
    static: bool = True  # workers carry an instance id (static membership)
    drain_grace_s: float = 10.0


@dataclass(slots=True)
class Figures:
    answered: int = 0
    unanswered: int = 0
    turns_failed: int = 0
    attempts_interrupted: int = 0
    # Of those, on partitions no other worker (by name) was given during the deploy.
    attempts_interrupted_unmoved: int = 0
    partitions_moved: int = 0
    model_requests_repeated: int = 0
    outcome_records_duplicated: int = 0
    transfers_run_twice: int = 0
    longest_silence_s: float = 0.0
    takeover_s: float | None = None  # crash: until the survivor owns every partition, live
    latencies_s: list[float] = field(default_factory=list)


def _script(model_s: float) -> Callable[[ModelRequest], Scripted]:
    def script(request: ModelRequest) -> Scripted:
        last = request.messages[-1]
        if last.role == "tool":
            reply = ModelReply(request.model, "Sent.", (), Usage(input_tokens=10, output_tokens=1), "stop")
        else:
            call = ToolCall(call_id="call_1", name="transfer", arguments=f'{{"to": "{last.content}", "amount": 1}}')
            reply = ModelReply(request.model, None, (call,), Usage(input_tokens=10, output_tokens=5), "tool_calls")
        return Scripted(reply, model_s)

    return script


async def rolling_deploy(bootstrap: str, topics: Topics, shape: Shape) -> Figures:
    runs: Counter[str] = Counter()  # the transfer bodies that ran, by the message they answer

    async def transfer(args: Transfer) -> str:
        runs[args.to] += 1
        await asyncio.sleep(shape.transfer_s)
        return f"sent {args.amount} to {args.to}"

    turn = TurnSettings(tools=ToolRegistry([Tool("transfer", "Send money.", Transfer, transfer, "side_effect")]))
    config = WorkerConfig(
        debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=200),
        turn=dataclasses.replace(turn, backoff_base_ms=10, backoff_max_ms=50),
        drain_grace_s=shape.drain_grace_s,
    )
    group = f"deploy-{uuid.uuid4().hex[:8]}"

    def worker(name: str) -> Worker:
        membership = Membership(name if shape.static else None, session_timeout_ms=10_000)
        return Worker(
            KafkaLog(bootstrap, group, topics, membership=membership), ScriptedProvider(_script(shape.model_s)), config
        )

    running: dict[str, tuple[Worker, asyncio.Event, asyncio.Task[None]]] = {}

    # Every assignment, by worker name: a partition that moved and came back has moved.
    assignments: list[tuple[str, set[int]]] = []

    def start(name: str) -> Worker:
        w, stop = worker(name), asyncio.Event()
        assign = w.on_assigned

        async def recorded(partitions: dict[int, PartitionStart]) -> dict[int, int]:
            assignments.append((name, set(partitions)))
            return await assign(partitions)

        w.on_assigned = recorded  # type: ignore[method-assign]
        running[name] = (w, stop, asyncio.create_task(w.run(stop)))
        return w

    async def restart(name: str) -> None:
        _, stop, task = running.pop(name)
        stop.set()
        await task  # the drain
        fresh = start(name)
        await until(lambda: bool(fresh.partition_liveness()), 60)

    crash_at: list[float] = []
    survivor_live: list[float] = []

    async def crash() -> None:
        _, _, task = running.pop("worker-1")
        crash_at.append(time.monotonic())
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        survivor = running["worker-2"][0]
        await until(lambda: len(live := survivor.partition_liveness()) == PARTITIONS and all(live.values()), 60)
        survivor_live.append(time.monotonic())

    def settled() -> bool:
        # Both members hold a share, disjoint and live: the group's first rebalance is over.
        owned = [set(w.partition_liveness()) for w, _, _ in running.values()]
        live = all(live for w, _, _ in running.values() for live in w.partition_liveness().values())
        return all(owned) and len(set.union(*owned)) == sum(map(len, owned)) == PARTITIONS and live

    async def rolling() -> None:
        await restart("worker-1")
        await restart("worker-2")

    async def scale_out() -> None:
        start("worker-3")
        await until(lambda: len(running) == 3 and settled(), 60)

    def owners() -> dict[int, str]:
        return {p: name for name, (w, _, _) in running.items() for p in w.partition_liveness()}

    deploys = {"rolling": rolling, "crash": crash, "scale-out": scale_out}

    publisher = KafkaLog(bootstrap, group, topics)
    await publisher.start_producer()
    published: dict[str, float] = {}
    try:
        start("worker-1")
        start("worker-2")
        await until(settled, 60)
        before, seen = owners(), len(assignments)
        deploy: asyncio.Task[None] | None = None
        for i in range(shape.messages):
            if shape.deploy != "none" and i == shape.messages // 4:
                deploy = asyncio.create_task(deploys[shape.deploy]())
            event = message_event(f"conv-{i % shape.conversations}", f"m{i}", int(time.time() * 1000), f"m{i}")
            published[event.message_id] = time.time()
            await publish(publisher, event)
            await asyncio.sleep(shape.over_s / shape.messages)
        if deploy is not None:
            await deploy
        events = await _until_answered(bootstrap, topics, set(published))
    finally:
        for _, stop, _ in running.values():
            stop.set()
        await asyncio.gather(*(task for _, _, task in running.values()), return_exceptions=True)
        await publisher.stop()
    outcome_records = Counter(
        e.turn_id
        for r in await read_topic(bootstrap, topics.outcomes)
        if isinstance(e := decode(r.value), OUTCOME_TYPES)
    )
    figures = _figures(events, published, runs, outcome_records)
    # Moved: given to another worker, or taken from its owner (an assignment without it). The
    # second catches a partition whose new owner's assignment a further rebalance abandoned
    # before the worker was told of it (not recorded), where the partition did move.
    moved = {
        p
        for name, partitions in assignments[seen:]
        for p in range(PARTITIONS)
        if (p in partitions) != (before.get(p) == name)
    }
    figures.partitions_moved = len(moved)
    figures.attempts_interrupted_unmoved = sum(
        isinstance(e, AttemptFailed) and partition_for(e.conversation_id, PARTITIONS) not in moved for e in events
    )
    if crash_at and survivor_live:
        figures.takeover_s = survivor_live[0] - crash_at[0]
    return figures


async def _until_answered(bootstrap: str, topics: Topics, sent: set[str], timeout_s: float = 120.0) -> list[Event]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = [
            e for r in await read_topic(bootstrap, topics.events) if not isinstance(e := decode(r.value), DecodeError)
        ]
        claimed = {i for e in events if isinstance(e, TurnClaimed) for i in e.input_ids}
        open_turns = {e.turn_id for e in events if isinstance(e, TurnClaimed)} - {
            e.turn_id for e in events if isinstance(e, OUTCOME_TYPES)
        }
        if (claimed >= sent and not open_turns) or time.monotonic() > deadline:
            return events
        await asyncio.sleep(0.5)


def _figures(events: list[Event], published: dict[str, float], runs: Counter[str], records: Counter[str]) -> Figures:
    figures = Figures()
    inputs_of = {e.turn_id: e.input_ids for e in events if isinstance(e, TurnClaimed)}
    outcomes = [e for e in events if isinstance(e, OUTCOME_TYPES)]
    answered = {i for o in outcomes for i in inputs_of.get(o.turn_id, ())}
    figures.answered, figures.unanswered = len(answered & set(published)), len(set(published) - answered)
    figures.turns_failed = sum(isinstance(o, TurnFailed) for o in outcomes)
    figures.attempts_interrupted = sum(isinstance(e, AttemptFailed) for e in events)
    requests = Counter((e.turn_id, e.iteration) for e in events if isinstance(e, ModelResponded))
    figures.model_requests_repeated = sum(n - 1 for n in requests.values())
    figures.outcome_records_duplicated = sum(n - 1 for n in records.values())
    figures.transfers_run_twice = sum(n > 1 for n in runs.values())
    # From the first outcome on: before it, the wait is the first turn's own length.
    done_at = sorted(o.occurred_at / 1000 for o in outcomes)
    figures.longest_silence_s = max((b - a for a, b in itertools.pairwise(done_at)), default=0.0)
    for o in outcomes:
        for i in inputs_of.get(o.turn_id, ()):
            if i in published:
                figures.latencies_s.append(o.occurred_at / 1000 - published[i])
    return figures

"""Issue #6 item 5: replay. Rebuild every conversation's state from offset 0 of an events
topic, against raw consumption of the same records in the same run.

The topic is filled once, fast: conversations of a realistic mix of lengths (each message
answered by a completed turn: MessageReceived, TurnClaimed, AttemptStarted, ModelResponded,
TurnCompleted), built with the engine's own builders (`bench.common.conversation_events`)
as templates, one per length, and copied under new conversation ids. A copy renames the
conversation in the template's bytes and puts in the turn ids of its own inputs (sha256 of
the claimed message ids, which carry the conversation id): the rebuild folds every copy and
counts rejections, so a bad copy would show. The records are written with aiokafka's batch
API (`create_batch` / `send_batch`, 512 KiB batches), each conversation on the partition
the engine's own producer would pick for its key (murmur2), conversations interleaved.

Then, each pass with its own consumer (no group, all partitions assigned, from offset 0 to
the end offsets read before the pass; same fetch settings):
* raw consume: `getmany` only (the floor: aiokafka's fetch and record parsing);
* consume + `orjson.loads` of every value;
* rebuild: consume + `events.decode` (pydantic) + key check + `apply_event` into one state
  per conversation, as the worker's replay does with one-time effects off;
* rebuild through the worker itself (optional): every record through `Worker._consume` with
  every offset below the committed one (no appends), i.e. the engine's own replay path.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.partitioner import murmur2

from bench.common import Section, conversation_events
from bench.kafka import PARTITIONS, Broker
from turnstile.events import DecodeError, decode, encode
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.log import PartitionStart, Record, Topics
from turnstile.streams.worker import FROM_THE_LOG, Worker
from turnstile.streams.worker_gc import WorkerGc

MAX_MESSAGES = 40  # longest conversation in the mix
CONCURRENT = 1_000  # conversations interleaved on the log at a time
BATCH_BYTES = 512 * 1024
FETCH = {"max_partition_fetch_bytes": 4 * 1024 * 1024, "fetch_max_bytes": 64 * 1024 * 1024}


# -- the topic --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Template:
    """One conversation of `messages` messages as encoded bytes, with what a copy renames."""

    name: bytes
    values: list[tuple[bytes, int]]  # (encoded event, index of the message whose turn it is, or -1)
    turn_ids: list[bytes]


def conversation_name(c: int) -> str:
    """The id of the benchmark's `c`-th conversation: 12 characters, in no order (real ids --
    UUIDs, a service's own keys -- are not inserted into the local store's B-trees in key
    order; `conv-0000001`, … was, which made the store's inserts about a third cheaper)."""
    return "c" + hashlib.blake2b(c.to_bytes(8, "big"), digest_size=8).hexdigest()[:11]


def _template(messages: int) -> _Template:
    name = f"conv-T{messages:06d}"  # 12 characters, as the copies' names
    values, turn_ids = [], []
    for event in conversation_events(name, messages):
        turn = getattr(event, "turn_id", None)
        if turn is not None and (not turn_ids or turn_ids[-1] != turn.encode()):
            turn_ids.append(turn.encode())
        values.append((encode(event), len(turn_ids) - 1 if turn is not None else -1))
    return _Template(name.encode(), values, turn_ids)


def _copy(template: _Template, name: str) -> list[bytes]:
    new = name.encode()
    turns = [hashlib.sha256(f"{name}-m{i}".encode()).hexdigest().encode() for i in range(len(template.turn_ids))]
    out = []
    for value, turn in template.values:
        value = value.replace(template.name, new)
        if turn >= 0:
            value = value.replace(template.turn_ids[turn], turns[turn])
        out.append(value)
    return out


def _lengths(events: int, seed: int = 6) -> list[int]:
    """Messages per conversation (5 events each), long-tailed: most are short, a few reach
    MAX_MESSAGES; the last one is cut so the total is exactly `events` whole turns (rounded
    down to a multiple of 5)."""
    rng = random.Random(seed)
    lengths, left = [], events // 5
    while left > 0:
        n = min(left, MAX_MESSAGES, 1 + int(rng.expovariate(1 / 4)))
        lengths.append(n)
        left -= n
    return lengths


@dataclass(frozen=True)
class Filled:
    topic: str
    events: int
    conversations: int
    bytes: int
    seconds: float


async def fill(broker: Broker, events: int, per_conversation: int | None = None) -> Filled:
    """`per_conversation`: every conversation that many messages (5 events each) instead of
    the long-tailed mix."""
    topics = await broker.fresh_topics("replay")
    lengths = _lengths(events) if per_conversation is None else [per_conversation] * (events // 5 // per_conversation)
    templates = {n: _template(n) for n in set(lengths)}
    producer = AIOKafkaProducer(
        bootstrap_servers=broker.bootstrap, acks="all", linger_ms=50, max_batch_size=BATCH_BYTES
    )
    await producer.start()
    started = time.perf_counter()
    written = size = 0
    try:
        batches = [producer.create_batch() for _ in range(PARTITIONS)]
        futures = []

        async def put(partition: int, key: bytes, value: bytes) -> None:
            nonlocal written, size
            while batches[partition].append(key=key, value=value, timestamp=None) is None:
                futures.append(await producer.send_batch(batches[partition], topics.events, partition=partition))
                batches[partition] = producer.create_batch()
            written += 1
            size += len(value) + len(key)

        for first in range(0, len(lengths), CONCURRENT):
            group = []
            for c in range(first, min(first + CONCURRENT, len(lengths))):
                name = conversation_name(c)
                key = name.encode()
                partition = (murmur2(key) & 0x7FFFFFFF) % PARTITIONS
                group.append((partition, key, _copy(templates[lengths[c]], name)))
            # interleaved: round-robin over the group, each conversation's events in order
            for i in range(max(len(values) for _, _, values in group)):
                for partition, key, values in group:
                    if i < len(values):
                        await put(partition, key, values[i])
        for partition, batch in enumerate(batches):
            if batch.record_count():
                futures.append(await producer.send_batch(batch, topics.events, partition=partition))
        await asyncio.gather(*futures)
        seconds = time.perf_counter() - started
    finally:
        await producer.stop()
    return Filled(topics.events, written, len(lengths), size, seconds)


class _GcTimer:
    """Wall time spent in the cyclic garbage collector while it is installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:  # type: ignore[type-arg]
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> _GcTimer:
        gc.collect()
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


# -- the passes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pass:
    label: str
    records: int
    seconds: float
    cpu_s: float
    gc_s: float = 0.0  # of the wall time, in cyclic garbage collections
    conversations: int = 0
    turns: int = 0  # completed turns in the rebuilt states
    rejected: int = 0
    undecodable: int = 0
    decode_s: float = 0.0  # of the wall time, in events.decode (rebuild only)
    fold_s: float = 0.0  # of the wall time, in apply_event and the state lookup (rebuild only)

    @property
    def per_s(self) -> float:
        return self.records / self.seconds


Handler = Callable[[TopicPartition, list[ConsumerRecord]], Awaitable[None]]  # type: ignore[type-arg]


async def _read(
    bootstrap: str,
    topic: str,
    handle: Handler,
    timeout_s: float = 300,
    ready: Callable[[dict[TopicPartition, int]], Awaitable[None]] | None = None,
) -> tuple[int, float, float, float]:
    """Every record from offset 0 to the end, handed to `handle(tp, records)` a fetch at a
    time. Returns (records, wall s, process CPU s, wall s in gc) from the first getmany to
    the last record handled. `ready(end offsets)` is awaited before the clock starts."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_poll_records=None,
        **FETCH,
    )
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        remaining = {tp for tp in partitions if ends[tp] > 0}
        if ready is not None:
            await ready(ends)
        count = 0
        with _GcTimer() as gc_timer:
            started, cpu0 = time.perf_counter(), time.process_time()
            deadline = started + timeout_s
            while remaining:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"replay read {count:,} records of {topic} in {timeout_s} s")
                batches = await consumer.getmany(*remaining, timeout_ms=200)
                for tp, records in batches.items():
                    await handle(tp, records)
                    count += len(records)
                    if records[-1].offset + 1 >= ends[tp]:
                        remaining.discard(tp)
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
        return count, wall, cpu, gc_timer.seconds
    finally:
        await consumer.stop()


async def raw_consume(bootstrap: str, topic: str) -> Pass:
    async def handle(tp: TopicPartition, records: list[ConsumerRecord]) -> None:  # type: ignore[type-arg]
        return None

    return Pass("raw consume (aiokafka getmany only)", *await _read(bootstrap, topic, handle))


async def consume_loads(bootstrap: str, topic: str) -> Pass:
    loads = orjson.loads

    async def handle(tp: TopicPartition, records: list[ConsumerRecord]) -> None:  # type: ignore[type-arg]
        for m in records:
            loads(m.value)

    return Pass("consume + orjson.loads", *await _read(bootstrap, topic, handle))


def _turns(states: Iterable[ConversationState]) -> int:
    """Completed turns in the rebuilt states; every conversation must end idle."""
    total = 0
    for state in states:
        if state.active is not None or state.pending:
            raise AssertionError(f"conversation {state.conversation_id} did not rebuild to idle")
        total += len(state.turns)
    return total


async def rebuild(bootstrap: str, topic: str, gc_off: bool = False) -> Pass:
    """The projection rebuild, inline: decode, key check, fold into per-conversation states.
    Times decode and fold separately (3 perf_counter calls per event, ≈ 0.1 µs). `gc_off`
    (what-if): the cyclic garbage collector disabled for the pass, as a replay could do (the
    states it builds are long-lived and hold no reference cycles), enabled again after."""
    states: dict[str, ConversationState] = {}
    counts = {"rejected": 0, "undecodable": 0}
    spent = [0.0, 0.0]  # decode, fold
    clock = time.perf_counter

    async def handle(tp: TopicPartition, records: list[ConsumerRecord]) -> None:  # type: ignore[type-arg]
        decode_s = fold_s = 0.0
        for m in records:
            t0 = clock()
            event = decode(m.value)
            t1 = clock()
            decode_s += t1 - t0
            if isinstance(event, DecodeError) or m.key is None or m.key.decode() != event.conversation_id:
                counts["undecodable"] += 1
                continue
            conversation = event.conversation_id
            state = states.get(conversation)
            if state is None:
                state = states[conversation] = new_state(conversation)
            if apply_event(state, event) is not None:
                counts["rejected"] += 1
            fold_s += clock() - t1
        spent[0] += decode_s
        spent[1] += fold_s

    if gc_off:
        gc.disable()
    try:
        records, wall, cpu, gc_s = await _read(bootstrap, topic, handle)
    finally:
        gc.enable()
    return Pass(
        "what-if: rebuild with cyclic gc off for the pass"
        if gc_off
        else "rebuild: consume + decode + fold (apply_event)",
        records,
        wall,
        cpu,
        gc_s,
        len(states),
        _turns(states.values()),
        counts["rejected"],
        counts["undecodable"],
        decode_s=spent[0],
        fold_s=spent[1],
    )


class _NoAppends:
    topics = Topics()

    async def append(self, topic: str, key: str, value: bytes, partition: int | None = None) -> tuple[int, int]:
        raise AssertionError("a replay below the committed offsets must not append")


async def worker_rebuild(bootstrap: str, topic: str, replay_gc: bool = True) -> Pass:
    """The same, through the engine's Worker._consume (replay path, no one-time effects),
    with the replay hooks `turnstile run` installs (`streams.worker_gc.WorkerGc`: the cyclic
    GC eased while partitions replay, the state frozen once all are live -- inside the
    window). `replay_gc=False` (what-if): without them, as before they existed."""
    hooks = WorkerGc() if replay_gc else None
    worker = Worker(_NoAppends(), ScriptedProvider(), FROM_THE_LOG, replay_hooks=hooks)  # type: ignore[arg-type]
    big = 10**12

    async def ready(ends: dict[TopicPartition, int]) -> None:
        # Each partition turns live at its real end, as on a restart; every offset is below
        # the committed one, so nothing is appended.
        await worker.on_assigned({tp.partition: PartitionStart(end, committed=big) for tp, end in ends.items()})

    async def handle(tp: TopicPartition, records: list[ConsumerRecord]) -> None:  # type: ignore[type-arg]
        for m in records:
            await worker._consume(Record(tp.partition, m.offset, m.key, m.value))
        worker._dirty.clear()  # the benchmark measures the replay, not the decisions after it

    try:
        records, wall, cpu, gc_s = await _read(bootstrap, topic, handle, ready=ready)
        if worker._replaying:
            raise AssertionError("the worker's partitions did not all turn live")
    finally:
        gc.unfreeze()  # the passes after this one start from the same collector state
    return Pass(
        "rebuild through Worker._consume (the engine's replay path)"
        if replay_gc
        else "what-if: through Worker._consume without the replay gc hooks",
        records,
        wall,
        cpu,
        gc_s,
        len(worker.states),
        _turns(worker.states.values()),
        undecodable=worker.dead_letters,
    )


@dataclass(frozen=True)
class ReplayResult:
    filled: Filled
    passes: list[Pass]


async def replay(
    broker: Broker, events: int = 1_000_000, through_worker: bool = True, what_if: bool = False
) -> ReplayResult:
    filled = await fill(broker, events)
    passes = [await raw_consume(broker.bootstrap, filled.topic), await consume_loads(broker.bootstrap, filled.topic)]
    passes.append(await rebuild(broker.bootstrap, filled.topic))
    gc.collect()
    if through_worker:
        passes.append(await worker_rebuild(broker.bootstrap, filled.topic))
        gc.collect()
    if what_if:
        passes.append(await rebuild(broker.bootstrap, filled.topic, gc_off=True))
        gc.collect()
        if through_worker:
            passes.append(await worker_rebuild(broker.bootstrap, filled.topic, replay_gc=False))
            gc.collect()
    return ReplayResult(filled, passes)


def _short(p: Pass) -> str:
    if p.label.startswith("what-if: through"):
        return "Worker._consume, no replay gc hooks (what-if)"
    if p.label.startswith("what-if"):
        return "rebuild, gc off (what-if)"
    return p.label.split(":")[0].split(" (")[0]


def replay_section(result: ReplayResult) -> Section:
    filled, passes = result.filled, result.passes
    raw, loads = passes[0], passes[1]
    header = ("6. replay from offset 0 (issue item 5)", "events/s", "wall", "CPU", "vs raw consume", "vs consume+loads")
    section = Section("", (*header, "goal"))
    for p in passes:
        goal = ""
        if p.label.startswith(("rebuild", "what-if")):
            goal = ">= 1x raw " + ("met" if p.per_s >= raw.per_s else "MISSED")
        section.add(
            p.label,
            f"{p.per_s:,.0f}/s",
            f"{p.seconds:.1f} s",
            f"{p.cpu_s / p.seconds:.0%}",
            f"{p.per_s / raw.per_s:.2f}x",
            f"{p.per_s / loads.per_s:.2f}x",
            goal,
        )
    for p in passes:
        section.add(f"CPU µs per event: {_short(p)}", f"{p.cpu_s / p.records * 1e6:.1f} µs")
    rebuilt = next((p for p in passes if p.decode_s and not p.label.startswith("what-if")), None)
    if rebuilt is not None:
        per = 1e6 / rebuilt.records
        rest = rebuilt.seconds - rebuilt.decode_s - rebuilt.fold_s
        section.add(
            "rebuild wall µs per event: decode / fold / consume+rest",
            f"{rebuilt.decode_s * per:.1f} / {rebuilt.fold_s * per:.1f} / {rest * per:.1f}",
            f"{rebuilt.seconds * per:.1f} µs",
            "",
            f"gc inside them: {rebuilt.gc_s * per:.1f} µs",
        )
    section.add(
        "wall s in cyclic gc, per pass in the order above",
        " / ".join(f"{p.gc_s:.1f}" for p in passes),
        "",
        "",
        " / ".join(f"{p.gc_s / p.seconds:.0%}" for p in passes),
    )
    section.notes.append(
        f"{filled.events:,} events ({filled.conversations:,} conversations of 1-{MAX_MESSAGES} messages, each "
        f"answered by a completed turn: 5 events per message; {filled.bytes / filled.events:.0f} B per record) on "
        f"{PARTITIONS} partitions, written once in {filled.seconds:.1f} s ({filled.events / filled.seconds:,.0f}/s, "
        "aiokafka create_batch/send_batch, 512 KiB batches)"
    )
    for p in passes:
        if p.conversations:
            section.notes.append(
                f"{_short(p)}: {p.records:,} events read, {p.conversations:,} conversation states, all idle, "
                f"{p.turns:,} completed turns ({filled.events // 5:,} expected), {p.rejected} rejected by the fold, "
                f"{p.undecodable} undecodable/dead letters"
            )
    section.notes.append(
        "one pass each, in this order, each with its own consumer (no group, from offset 0 to the end offsets, "
        f"max_partition_fetch_bytes {FETCH['max_partition_fetch_bytes'] >> 20} MiB); wall = first getmany to the "
        "last record handled; CPU = process CPU / wall (the broker shares the same cores)"
    )
    return section

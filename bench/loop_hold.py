"""11. How long the worker's replay holds the event loop (issue 10 item 4: never more than
~50 ms, so `/healthz` and every other task keep being served while partitions replay).

A probe task -- a callback that reschedules itself, so it runs once per loop iteration --
records the gap between its runs while a real `Worker.run` replays a log to live (with the
process entry's `WorkerGc`, as `turnstile run` installs it): the embedded log, and the
events topic on the broker (its group's offsets committed at the end first, so that the
replay writes no one-time effects, as a restart's would not). The longest gap is what the
worker (or a garbage collection, or the machine) held the loop for. Figures, not a test:
on a loaded machine a gap also counts the time the process waited for a core.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.common import Section, conversation_events, fmt, percentile
from bench.kafka import PARTITIONS, Broker
from bench.replay import fill
from turnstile.events import encode
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.file_log import FileLog
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import EventLog, Topics, partition_for
from turnstile.streams.worker import Worker, WorkerConfig
from turnstile.streams.worker_gc import WorkerGc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the probe is a test helper
from loop_probe import LoopProbe

MESSAGES = 10  # per conversation: 50 events each
FILE_PARTITIONS = 4


async def _replay(log: EventLog) -> tuple[float, LoopProbe]:
    worker = Worker(log, ScriptedProvider(), WorkerConfig(), replay_hooks=WorkerGc())
    stop, probe = asyncio.Event(), LoopProbe()
    probe.start()
    started = time.perf_counter()
    task = asyncio.create_task(worker.run(stop))
    try:
        while not ((live := worker.partition_liveness()) and all(live.values())):
            if task.done():
                await task  # its error
            await asyncio.sleep(0.005)
        return time.perf_counter() - started, probe
    finally:
        probe.stop()
        stop.set()
        await task


async def _embedded(events: int, folder: Path) -> tuple[float, LoopProbe]:
    log = FileLog(folder, partitions=FILE_PARTITIONS)
    lines: dict[int, list[bytes]] = {p: [] for p in range(FILE_PARTITIONS)}
    for c in range(events // (5 * MESSAGES)):
        conversation = f"conv-{c}"
        p = partition_for(conversation, FILE_PARTITIONS)
        # The embedded log's line format: the key, and the value as text.
        rows = conversation_events(conversation, MESSAGES)
        lines[p] += [orjson.dumps({"key": conversation, "value": encode(e).decode()}) for e in rows]
    for p, rows in lines.items():  # written as files, not as that many fsynced appends
        path = folder / log.topics.events / f"{p}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\n".join(rows) + b"\n")
    await log.commit({p: len(rows) for p, rows in lines.items()})  # a restart: no effects again
    return await _replay(log)


async def _kafka(broker: Broker, events: int) -> tuple[float, LoopProbe]:
    filled = await fill(broker, events)
    prefix = filled.topic.removesuffix(".events")
    topics = Topics(filled.topic, f"{prefix}.out", f"{prefix}.dlq", f"{prefix}.deltas")
    group = f"bench-loop-{uuid.uuid4().hex[:8]}"
    committer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=group, enable_auto_commit=False)
    await committer.start()
    try:
        partitions = [TopicPartition(filled.topic, p) for p in range(PARTITIONS)]
        committer.assign(partitions)
        await committer.commit(await committer.end_offsets(partitions))
    finally:
        await committer.stop()
    return await _replay(KafkaLog(broker.bootstrap, group, topics))


def _row(section: Section, name: str, events: int, seconds: float, probe: LoopProbe) -> None:
    gaps_ms = [g * 1000 for g in probe.gaps_s] or [0.0]
    section.add(
        name,
        f"{events:,}",
        fmt(seconds),
        f"{max(gaps_ms):.0f}",
        f"{percentile(gaps_ms, 99.9):.1f}",
        str(sum(g > 50 for g in gaps_ms)),
    )


async def loop_hold(broker: Broker | None, events: int = 150_000) -> Section:
    section = Section(
        "11. event loop held during a worker's replay (probe task; goal: never more than ~50 ms)",
        ("log", "events", "replay s", "longest hold ms", "p99.9 ms", "holds > 50 ms"),
    )
    with tempfile.TemporaryDirectory() as folder:
        seconds, probe = await _embedded(events, Path(folder))
        _row(section, "embedded (4 partitions)", events, seconds, probe)
    if broker is not None:
        seconds, probe = await _kafka(broker, events)
        _row(section, "Kafka (8 partitions)", events, seconds, probe)
    section.notes.append("a hold is the gap between two runs of a callback that reschedules itself every iteration")
    return section


"""Issue #13 item 5 (c): HTTP GET latency, served from the worker's state, at two log sizes.

At each size the events topic is filled as the replay benchmark fills it (`replay.fill`:
conversations of a realistic mix of lengths, each message answered by a completed turn);
the worker's group is committed at the end beforehand (history, not new work: no one-time
effects are redone), and a real `Worker` on `KafkaLog`, behind its `Service` HTTP port and
with the replay GC hooks `turnstile run` uses, replays it. Once every partition is live
(`/readyz`), from one keep-alive httpx client on loopback, in turn:
after 50 untimed GETs (warm-up):
* `GET /conversations/{id}` of random conversations (the state as JSON),
* `GET /conversations/{id}/turns/{turn_id}` of one of their last 10 turns (a timeline
  held in memory, decoded on demand), and of a few first turns of conversations longer
  than that (dropped from memory: one bounded read of the partition),
* `GET /conversations?limit=50` (the first page of the list) and `?status=paused` (a
  filter no conversation matches: the whole list is walked, the worst case);
* baseline, same run: the read the API did before, a read and fold of the conversation's
  partition (`service.conversation_reader` without a bound), a few times.
Latency is the client's (request to last byte). Nothing here asserts on timings.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition

from bench.common import Section, fmt, percentile
from bench.kafka import PARTITIONS, Broker
from bench.replay import conversation_name, fill
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import Topics
from turnstile.streams.read_model import TURN_DETAILS_KEPT
from turnstile.streams.service import Service, conversation_reader
from turnstile.streams.views import build_view
from turnstile.streams.worker import Worker, WorkerConfig
from turnstile.streams.worker_gc import WorkerGc

# GETs timed of each kind: a p99 of 100 would be the slowest one alone (nearest rank).
SAMPLES = 400
BASELINE_SAMPLES = 3
WARM_UP = 50


async def _commit_at_end(bootstrap: str, topic: str, group: str) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(partitions)
        ends = await consumer.end_offsets(partitions)
        await consumer.commit(dict(ends))
    finally:
        await consumer.stop()


async def _timed(client: httpx.AsyncClient, paths: list[str]) -> list[float]:
    out = []
    for path in paths:
        started = time.perf_counter()
        response = await client.get(path)
        out.append((time.perf_counter() - started) * 1000)
        if response.status_code != 200:
            raise AssertionError(f"GET {path}: {response.status_code} {response.text[:200]}")
    return out


async def _at(broker: Broker, events: int) -> dict[str, list[float] | float]:
    filled = await fill(broker, events)
    prefix = filled.topic.removesuffix(".events")
    topics = Topics(filled.topic, f"{prefix}.out", f"{prefix}.dlq", f"{prefix}.deltas")
    group = f"{prefix}-reads"
    await _commit_at_end(broker.bootstrap, topics.events, group)
    conversations = [conversation_name(c) for c in range(filled.conversations)]
    log = KafkaLog(broker.bootstrap, group, topics)
    worker = Worker(log, ScriptedProvider(), WorkerConfig(), replay_hooks=WorkerGc())
    service = Service(worker, http=("127.0.0.1", 0))
    stop, ready = asyncio.Event(), asyncio.Event()
    running = asyncio.create_task(service.run(stop, ready))
    try:
        await ready.wait()
        async with httpx.AsyncClient(base_url=service.url or "", timeout=120) as client:
            started = time.perf_counter()
            while True:  # polled over HTTP, as a readiness probe does
                probe = await client.get("/readyz")
                if probe.status_code == 200 and probe.json()["partitions"]:
                    break
                await asyncio.sleep(0.2)
            replayed_s = time.perf_counter() - started
            rng = random.Random(13)
            # Warm-up (connection, first-use allocations, the worker's first decisions once live): untimed.
            await _timed(client, [f"/conversations/{rng.choice(conversations)}" for _ in range(WARM_UP)])
            picked = [rng.choice(conversations) for _ in range(SAMPLES)]
            turns, old_turns = [], []
            for conversation in picked:
                state = (await client.get(f"/conversations/{conversation}")).json()
                held = state["turns"][-TURN_DETAILS_KEPT:]  # the turns whose timelines are in memory
                turns.append(f"/conversations/{conversation}/turns/{rng.choice(held)['turn_id']}")
                if len(state["turns"]) > TURN_DETAILS_KEPT and len(old_turns) < BASELINE_SAMPLES:
                    old_turns.append(f"/conversations/{conversation}/turns/{state['turns'][0]['turn_id']}")
            results: dict[str, list[float] | float] = {
                "conversation": await _timed(client, [f"/conversations/{c}" for c in picked]),
                "turn": await _timed(client, turns),
                "list": await _timed(client, ["/conversations?limit=50"] * SAMPLES),
                "list walked": await _timed(client, ["/conversations?status=paused"] * 10),
                "old turn": await _timed(client, old_turns),
            }
        read = conversation_reader(log, max_records=None)
        baseline = []
        for conversation in picked[:BASELINE_SAMPLES]:
            started = time.perf_counter()
            build_view(conversation, await read.whole(conversation))
            baseline.append((time.perf_counter() - started) * 1000)
        results["baseline"] = baseline
        results["filled_s"], results["replayed_s"] = filled.seconds, replayed_s
        results["conversations"] = float(filled.conversations)
        results["replayed_plain_s"] = await _replay_without_reads(broker, topics)
        return results
    finally:
        stop.set()
        await running


class _Replayed(WorkerGc):
    """`turnstile run`'s replay hooks, which also say when every partition is live."""

    def __init__(self, live: asyncio.Event) -> None:
        super().__init__()
        self.live = live

    def replayed(self) -> None:
        super().replayed()
        self.live.set()


async def _replay_without_reads(broker: Broker, topics: Topics) -> float:
    """Seconds from start to live of the same worker on the same topic with no HTTP port
    (hence no read model): what serving reads from state costs the replay."""
    group = f"{topics.events}-plain"
    await _commit_at_end(broker.bootstrap, topics.events, group)
    live = asyncio.Event()
    hooks = _Replayed(live)
    worker = Worker(KafkaLog(broker.bootstrap, group, topics), ScriptedProvider(), WorkerConfig(), replay_hooks=hooks)
    stop = asyncio.Event()
    started = time.perf_counter()
    running = asyncio.create_task(Service(worker).run(stop))
    try:
        await live.wait()
        return time.perf_counter() - started
    finally:
        stop.set()
        await running


async def http_reads(broker: Broker, sizes: tuple[int, ...] = (10_000, 1_000_000)) -> Section:
    section = Section(
        "10. HTTP GET latency, served from the worker's state (ms, client side)",
        ("log", "conversations", "GET conversation p50 / p99", "GET turn p50 / p99", "list page p50 / p99",
         "list, walk all p50", "old turn (bounded read) p50", "baseline: read+fold the partition p50"),
    )
    for events in sizes:
        r = await _at(broker, events)

        def pp(name: str, r: dict[str, list[float] | float] = r) -> str:
            values = r[name]
            assert isinstance(values, list)
            return f"{fmt(percentile(values, 50))} / {fmt(percentile(values, 99))}"

        walked, old, baseline = r["list walked"], r["old turn"], r["baseline"]
        assert isinstance(walked, list) and isinstance(old, list) and isinstance(baseline, list)
        section.add(
            f"{events:,} events", f"{int(r['conversations']):,}", pp("conversation"), pp("turn"), pp("list"),
            fmt(percentile(walked, 50)), fmt(percentile(old, 50)) if old else "-", fmt(percentile(baseline, 50)),
        )
        section.notes.append(
            f"{events:,} events: log written in {r['filled_s']:.0f} s, replayed to live in {r['replayed_s']:.1f} s"
            f" with the read model, {r['replayed_plain_s']:.1f} s without an HTTP port (no read model), same topic"
        )
    section.notes.append("goal (issue 13): GET p99 <= 10 ms, flat from 10k to 1M events")
    return section



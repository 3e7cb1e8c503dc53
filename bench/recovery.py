"""Issue 13 item 5 (a) and (b): assignment -> live with and without snapshots, at N events
and at 10x the history over the same conversations; and the resident memory of a worker
that owns many conversations of which 1,000 are active.

The topic is filled as for the replay benchmark (`bench.replay.fill`: every conversation the
same number of messages, each answered by a completed turn, 5 events per message). Then, each
pass a fresh `Worker` on the real broker (`KafkaLog`, its own consumer group), draining from
the start so it only folds, never claims:
* *writer* (not timed): snapshots on; it replays, writes the one-time effects (outcome
  records) and commits, snapshots every conversation (`max_per_checkpoint` of them per
  checkpoint) and stays until they and the watermarks are written;
* *full replay*: snapshots off, from offset 0 (the baseline, as before snapshots);
* *with snapshots*: snapshots on, from the writer's snapshot heads and watermark, with an
  empty local store (a partition that moved to a new machine): it goes live on the heads
  and fetches the snapshots into its store after (the time until every state is local is
  printed too);
* *restart on its store*: the writer's own local store, which outlived it (a volume) and
  which its clean stop checkpointed: only the heads written since are read.
Every pass runs with the garbage collector held while it replays (`WorkerGc`, as `turnstile
run` does; loading the snapshots counts as replaying). All passes share one consumer group,
so the timed ones start as a restart does (committed offsets at the end). The window is
from the worker's `on_assigned` being called to every assigned partition being live
(polled every 5 ms), the same for both; the group join before it is not counted.

Memory (b): after the with-snapshots pass has gone live, 1,000 of the conversations get a
message (they come back from the local store and stay pending: the worker is draining);
resident set size of the process (VmRSS, after gc) is read then, against a full-replay worker
that holds every conversation, and again with the HTTP port's read model beside the worker
(`turnstile run` has one: it lists every conversation it owns), each measured in a
subprocess of its own so none inherits another's heap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Section, percentile
from bench.kafka import Broker
from bench.replay import conversation_name, fill
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.eviction import EvictionPolicy
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import PartitionStart, Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.read_model import WorkerReadModel
from turnstile.streams.runtime import SystemClock
from turnstile.streams.snapshots import SnapshotPolicy
from turnstile.streams.worker import FROM_THE_LOG, Worker, WorkerConfig
from turnstile.streams.worker_gc import WorkerGc

FULL = FROM_THE_LOG
# Every settled conversation leaves memory once its snapshot is written.
SNAPSHOTS = WorkerConfig(snapshots=SnapshotPolicy(idle_ms=0), eviction=EvictionPolicy(idle_ms=0))
ACTIVE = 1_000
WRITER_BATCH = 25_000  # snapshots the writer pass encodes per checkpoint
TIMEOUT_S = 900


class _Timed(Worker):
    """A worker that notes when its partitions are handed to it."""

    assigned_at: float | None = None

    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        if self.assigned_at is None:
            self.assigned_at = time.perf_counter()
        return await super().on_assigned(partitions)


@dataclass(frozen=True)
class Pass:
    label: str
    seconds: float  # assignment -> live
    seek: int  # events the worker skipped thanks to the snapshots (sum of seek offsets)
    rss_mb: float
    # With the read model: ms per list page of 50, p50 and p99 (nearly all listed by the store).
    page_ms: tuple[float, float] | None = None
    hold_s: float = 0.0  # the longest the event loop was held, assignment -> live
    # Assignment -> every state local: a new owner goes live on the heads, and fetches the
    # settled conversations' snapshots into its store after.
    local_s: float = 0.0


def _rss_mb() -> float:
    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _group(topics: Topics) -> str:
    """One consumer group per topic: after the writer's pass its committed offsets are at the
    end, so the timed passes start as a restart does, with every one-time effect done."""
    return f"bench-recovery-{topics.events}"


async def _pass(
    broker: Broker,
    topics: Topics,
    config: WorkerConfig,
    label: str,
    active: int = 0,
    write: bool = False,
    read_model: bool = False,
) -> Pass:
    """`write`: stay until every change is on the snapshot topic, watermarks included;
    `read_model`: with the HTTP port's read model beside the worker, as `turnstile run` has."""
    # With the collector held while it replays, as `turnstile run` gives it (`serving.py`).
    log_ = KafkaLog(broker.bootstrap, _group(topics), topics)
    worker = _Timed(log_, ScriptedProvider(), config, replay_hooks=WorkerGc())
    reads = WorkerReadModel(worker) if read_model else None
    worker.draining = True  # it only folds: the log stays as filled
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    held = [0.0]
    probe = asyncio.create_task(_probe(held))
    try:
        deadline = time.perf_counter() + TIMEOUT_S
        while not ((p := worker.replay_progress()).partitions and p.replaying == 0):
            if task.done() or time.perf_counter() > deadline:
                raise TimeoutError(f"{label}: not live in {TIMEOUT_S} s ({p})")
            await asyncio.sleep(0.005)
        assert worker.assigned_at is not None
        seconds = time.perf_counter() - worker.assigned_at
        probe.cancel()
        while not worker.states_local:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{label}: states not local in {TIMEOUT_S} s")
            await asyncio.sleep(0.005)
        local_s = time.perf_counter() - worker.assigned_at
        seek = sum(worker.snapshots.seeks.values()) if worker.snapshots is not None else 0
        snapshots = worker.snapshots
        while write and snapshots is not None and any(snapshots.pending(p) for p in worker.partition_liveness()):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{label}: snapshots not written in {TIMEOUT_S} s")
            await asyncio.sleep(0.1)
        if active:
            now = SystemClock().now_ms()
            for i in range(active):
                await publish(worker.log, message_event(conversation_name(i), "one more question", now, f"active-{i}"))
            # the active ones folded, and (with eviction) every settled one out of memory
            while sum(1 for s in worker.states.values() if s.pending) < active or (
                worker.evictor is not None and len(worker.states) > active
            ):
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{label}: the {active} active conversations did not arrive")
                await asyncio.sleep(0.05)
        rss = _rss_mb()
        page_ms = _page_ms(reads) if reads is not None else None
    finally:
        probe.cancel()
        stop.set()
        await asyncio.wait_for(task, TIMEOUT_S)
    del reads
    return Pass(label, seconds, seek, rss, page_ms, held[0], local_s)


async def _probe(held: list[float], every_s: float = 0.01) -> None:
    """Sleeps `every_s` over and over; how much later than asked it woke, at most, in `held`."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(every_s)
        held[0] = max(held[0], time.perf_counter() - asked - every_s)


def _page_ms(reads: WorkerReadModel, samples: int = 100) -> tuple[float, float]:
    """The read model's list pages of 50 (the first, one further down by its cursor, and the
    `paused` filter, which nothing matches: the worst case), timed on the loop's thread."""
    cursor = reads.page(limit=500).next_cursor
    times = []
    for i in range(samples):
        query: dict[str, Any] = ({}, {"before": cursor}, {"status": "paused"})[i % 3]
        start = time.perf_counter()
        reads.page(limit=50, **query)
        times.append((time.perf_counter() - start) * 1000)
    return percentile(times, 50), percentile(times, 99)


@dataclass(frozen=True)
class Scale:
    events: int
    conversations: int
    full: Pass
    snapshots: Pass
    restart: Pass


async def _scale(broker: Broker, events: int, conversations: int) -> tuple[Scale, str]:
    filled = await fill(broker, events, per_conversation=max(1, events // 5 // conversations))
    topics = Topics(filled.topic, filled.topic.removesuffix(".events") + ".out")
    with tempfile.TemporaryDirectory(prefix="bench-state-") as folder:
        # The writer's local store outlives it (as a volume would): its clean stop checkpoints it.
        kept = dataclasses.replace(SNAPSHOTS, eviction=dataclasses.replace(SNAPSHOTS.eviction, state_dir=Path(folder)))
        # The writer is set-up, not timed: it encodes more per checkpoint than a serving
        # worker would (2,000 a second would take 500 s for a million conversations).
        eager = dataclasses.replace(kept.snapshots, max_per_checkpoint=WRITER_BATCH, max_capture_s=None)
        writer = dataclasses.replace(kept, snapshots=eager)
        await _pass(broker, topics, writer, "writer", write=True)  # its one-time effects, then its snapshots
        full = await _pass(broker, topics, FULL, "full replay")
        with_snapshots = await _pass(broker, topics, SNAPSHOTS, "with snapshots")  # a new machine: an empty store
        restart = await _pass(broker, topics, kept, "restart on its store")
    return Scale(filled.events, filled.conversations, full, with_snapshots, restart), filled.topic


@dataclass(frozen=True)
class Recovery:
    scales: list[Scale]
    memory: Memory


async def recovery(broker: Broker, events: int, conversations: int, scale: int) -> Recovery:
    first, topic = await _scale(broker, events, conversations)
    scales = [first]
    if scale > 1:
        scales.append((await _scale(broker, events * scale, conversations))[0])
    return Recovery(scales, await memory(broker.bootstrap, topic, first.conversations))


def recovery_section(scales: list[Scale]) -> Section:
    section = Section(
        "12. assignment -> live (8 partitions, one worker)",
        ("log", "full replay", "with snapshots", "ratio", "restart on its local store", "ratio", "events skipped",
         "goal"),
    )  # fmt: skip
    for i, s in enumerate(scales):
        ratio, restart = s.snapshots.seconds / s.full.seconds, s.restart.seconds / s.full.seconds
        goal = f"<= 1/10 of full: new machine {_met(ratio <= 0.1)}, restart {_met(restart <= 0.1)}"
        if i > 0:
            growth = s.snapshots.seconds / scales[0].snapshots.seconds - 1
            growth_restart = s.restart.seconds / scales[0].restart.seconds - 1
            goal += f"; flat at {s.events // scales[0].events}x history: new machine {growth:+.0%} "
            goal += f"{_met(abs(growth) <= 0.2)}, restart {growth_restart:+.0%} {_met(abs(growth_restart) <= 0.2)}"
        section.add(
            f"{s.events:,} events / {s.conversations:,} conversations",
            f"{s.full.seconds:.2f} s",
            f"{s.snapshots.seconds:.2f} s",
            f"{ratio:.3f}",
            f"{s.restart.seconds:.2f} s",
            f"{restart:.3f}",
            f"{s.snapshots.seek:,}",
            goal,
        )
    for s in scales:
        holds = ", ".join(f"{p.label} {p.hold_s:.2f} s" for p in (s.full, s.snapshots, s.restart))
        section.notes.append(f"{s.events:,} events: longest event-loop hold from start to live: {holds}")
        local = ", ".join(f"{p.label} {p.local_s:.2f} s" for p in (s.snapshots, s.restart))
        section.notes.append(f"{s.events:,} events: assignment -> every state local (snapshots fetched): {local}")
    section.notes.append("with snapshots: a fresh worker with an empty local store (a partition moved to a new "
                         "machine) reads the heads partition and goes live, then fetches the snapshots; restart: "
                         "the writer's store, checkpointed by its clean stop, reads only the heads written since")
    return section


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


@dataclass(frozen=True)
class Memory:
    conversations: int
    full_mb: float
    snapshots_mb: float
    served_mb: float  # snapshots + eviction, with the HTTP port's read model
    page_ms: tuple[float, float]  # its list pages of 50, p50 / p99


async def memory(bootstrap: str, topic: str, conversations: int) -> Memory:
    """(b): each worker in a process of its own (`python -m bench.recovery`)."""

    async def run(mode: str) -> list[float]:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.recovery", bootstrap, topic, mode, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(child.communicate(), TIMEOUT_S)
        if child.returncode != 0:
            raise RuntimeError(f"the {mode} memory run exited with {child.returncode}")
        return [float(figure) for figure in out.decode().splitlines()[-1].split()]

    full, snapshots, (served, p50, p99) = await run("full"), await run("snapshots"), await run("served")
    return Memory(conversations, full[0], snapshots[0], served, (p50, p99))


def memory_section(m: Memory) -> Section:
    section = Section(
        f"13. resident memory, {m.conversations:,} conversations of which {ACTIVE:,} active",
        ("worker", "RSS", "goal"),
    )
    section.add("every conversation in memory (no snapshots; baseline)", f"{m.full_mb:.0f} MB", "")
    for label, mb in (
        ("snapshots + eviction (settled ones in the local store)", m.snapshots_mb),
        ("the same with the HTTP port's read model, as `turnstile run`", m.served_mb),
    ):
        section.add(label, f"{mb:.0f} MB", f"<= 300 MB: {'met' if mb <= 300 else 'MISSED'}")
    page = f"{m.page_ms[0]:.2f} / {m.page_ms[1]:.2f} ms"
    section.add("its list pages of 50, p50 / p99 (nearly all listed by the local store)", page)
    section.notes.append("VmRSS after gc, once live and the active conversations' messages are folded")
    return section


async def _one_memory_run(bootstrap: str, topic: str, mode: str) -> None:
    topics = Topics(topic, topic.removesuffix(".events") + ".out")
    config = FULL if mode == "full" else SNAPSHOTS
    result = await _pass(Broker(bootstrap), topics, config, mode, active=ACTIVE, read_model=mode == "served")
    print(" ".join(f"{figure:.2f}" for figure in (result.rss_mb, *(result.page_ms or ()))))


if __name__ == "__main__":
    asyncio.run(_one_memory_run(sys.argv[1], sys.argv[2], sys.argv[3]))

"""Two HTTP ports on one broker, sharing nothing in memory: a worker's own port (it owns
every partition) and a port with no worker (it owns none, as a second process would). A
message id used twice with other content is answered 202 for the use that comes first on
the log and 409 for the other, whichever port gets which, in either order or at once; and
the port that owns nothing reads a conversation from its snapshot plus the tail of its one
partition, with the owner's answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from worker_harness import client_of, until

from turnstile.events import MessageReceived, decode
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections import apply_event, new_state
from turnstile.projections.snapshot import WATERMARK_KEY, encode_snapshot, encode_watermark
from turnstile.projections.snapshot_head import Head, encode_head, head_of
from turnstile.streams import http_reads
from turnstile.streams.http_api import HttpServer, build_app
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics, partition_for
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.service import Service, conversation_reader
from turnstile.streams.snapshots import SnapshotPolicy, Start
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
CONFIG = WorkerConfig(
    debounce=DebouncePolicy(quiet_ms=0, max_wait_ms=0),
    commit_interval_s=0.05,
    snapshots=SnapshotPolicy(idle_ms=0, every_events=1),  # every change snapshotted at the next checkpoint
)


@contextlib.asynccontextmanager
async def two_ports(
    bootstrap: str, topics: Topics
) -> AsyncIterator[tuple[Worker, httpx.AsyncClient, httpx.AsyncClient]]:
    """(the worker, a client of its port, a client of the port that owns nothing)."""
    worker = Worker(KafkaLog(bootstrap, f"g-{uuid.uuid4().hex[:8]}", topics), ScriptedProvider(), CONFIG)
    svc = Service(worker, http=("127.0.0.1", 0))
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(svc.run(stop, ready))
    elsewhere = KafkaLog(bootstrap, f"api-{uuid.uuid4().hex[:8]}", topics)
    await elsewhere.start_producer()
    server = HttpServer(build_app(elsewhere, conversation_reader(elsewhere)), "127.0.0.1", 0)
    try:
        await asyncio.wait_for(ready.wait(), 30)
        await until(lambda: len(worker.partition_liveness()) == 8 and all(worker.partition_liveness().values()), 30)
        async with (
            client_of(server, 30) as other,
            httpx.AsyncClient(base_url=svc.url or "", timeout=30) as owner,
        ):
            yield worker, owner, other
    finally:
        await elsewhere.stop()
        stop.set()
        await asyncio.wait_for(task, 30)


def post(client: httpx.AsyncClient, conversation: str, content: str) -> asyncio.Task[httpx.Response]:
    body = {"message_id": "m1", "content": content}
    return asyncio.create_task(client.post(f"/conversations/{conversation}/messages", json=body))


async def first_uses(bootstrap: str, topics: Topics) -> dict[str, str]:
    """Per conversation, the content of the first MessageReceived of m1 on the log."""
    out: dict[str, str] = {}
    for record in await read_topic(bootstrap, topics.events):
        event = decode(record.value)
        if isinstance(event, MessageReceived) and event.message_id == "m1":
            out.setdefault(event.conversation_id, event.content)
    return out


async def test_a_reused_id_is_judged_by_log_order_on_every_port(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    async with two_ports(kafka_bootstrap, fresh_topics) as (worker, owner, other):
        # In turn, each port first: the second use is a 409 on the other port.
        for conversation, (a, b) in {"seq-1": (other, owner), "seq-2": (owner, other)}.items():
            assert (await post(a, conversation, "first")).status_code == 202
            clash = await post(b, conversation, "second")
            assert clash.status_code == 409 and "already used for other content" in clash.json()["error"]
        # At once: one of each, and the 202 is the use the log has first.
        raced = {
            f"race-{i}": (post(owner, f"race-{i}", "owner's"), post(other, f"race-{i}", "other's")) for i in range(6)
        }
        answers = {c: (await o, await t) for c, (o, t) in raced.items()}
        firsts = await first_uses(kafka_bootstrap, fresh_topics)
        for conversation, (by_owner, by_other) in answers.items():
            assert sorted([by_owner.status_code, by_other.status_code]) == [202, 409], conversation
            winner = "owner's" if by_owner.status_code == 202 else "other's"
            assert firsts[conversation] == winner
        # Each conversation answered once, to its first use.
        conversations = ["seq-1", "seq-2", *answers]
        await until(lambda: all((s := worker.state_of(c)) is not None and s.turns for c in conversations), 30)
        for conversation in conversations:
            state = worker.state_of(conversation)
            assert state is not None
            [turn] = state.turns.values()
            assert turn.input_ids == ("m1",)
            assert state.history[0].content == firsts[conversation]


async def test_a_port_that_owns_nothing_reads_the_snapshot_and_the_tail_of_one_partition(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
) -> None:
    async with two_ports(kafka_bootstrap, fresh_topics) as (worker, owner, other):
        for conversation in ("k1", "k2", "k3"):
            assert (await post(owner, conversation, f"hello {conversation}")).status_code == 202
        await until(lambda: all((s := worker.state_of(c)) is not None and s.turns for c in ("k1", "k2", "k3")), 30)
        reads = conversation_reader(worker.log)

        async def snapshotted() -> bool:
            tail = await reads.tail("k1")
            return tail.start.state is not None and tail.start.state.turns != {}

        deadline = asyncio.get_running_loop().time() + 30
        while not await snapshotted():
            assert asyncio.get_running_loop().time() < deadline, "no snapshot of k1 was written"
            await asyncio.sleep(0.1)
        tail = await reads.tail("k1")
        whole = await reads.whole("k1")
        assert tail.start.offset > 0 and all(r.offset >= tail.start.offset for r in tail.records)
        assert len(tail.records) < len(whole)  # what the snapshot covers is not read again
        assert {r.partition for r in tail.records} <= {tail.partition}

        mine, theirs = (await owner.get("/conversations/k1")).json(), (await other.get("/conversations/k1")).json()
        for field in ("conversation_id", "events_applied", "history", "pending", "rejected", "active"):
            assert theirs[field] == mine[field], field
        # The turns the snapshot covers have no timeline on the other port; none is made up.
        assert {t["turn_id"] for t in theirs["turns"]} <= {t["turn_id"] for t in mine["turns"]}
        [turn_id] = worker.state_of("k1").turns  # type: ignore[union-attr]
        timeline = await other.get(f"/conversations/k1/turns/{turn_id}")  # older than the snapshot: the partition
        assert timeline.status_code == 200 and timeline.json()["outcome"] == "completed"
        assert (await other.get("/conversations/k1/turns/no-such-turn")).status_code == 404


async def test_a_snapshot_that_does_not_decode_is_read_around(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    # Given a partition whose watermark vouches for everything below it, k1 with events below
    # it and only a snapshot that does not decode, and k2 with no snapshot at all:
    log = KafkaLog(kafka_bootstrap, f"w-{uuid.uuid4().hex[:8]}", fresh_topics)
    await log.start_producer()
    try:
        partition = await log.reader().partition_of("k1")
        k2 = next(c for c in (f"k2-{i}" for i in range(1000)) if partition_for(c, 8) == partition)
        for i, conversation in enumerate(("k1", "k1", k2)):
            await publish(log, message_event(conversation, f"question {i}", 1_000 + i, f"m{i}"))
        end = 3
        await log.append(fresh_topics.snapshots, WATERMARK_KEY, encode_watermark(end), partition=partition)
        await log.append(fresh_topics.snapshots, "k1", b"\x00 not a snapshot", partition=partition)
        reads = conversation_reader(log)
        # When they are read: k1 from the start of its partition, k2 from the watermark.
        k1 = await reads.tail("k1")
        assert k1.start == Start(None, 0) and [r.offset for r in k1.records] == [0, 1, 2]
        assert (await reads.tail(k2)).start == Start(None, end)
        async with client_of(HttpServer(build_app(log, reads), "127.0.0.1", 0), 30) as client:
            found = (await client.get("/conversations/k1")).json()
    finally:
        await log.stop()
    # Then k1's view is its fold from the log, the broken snapshot ignored.
    assert [p["content"] for p in found["pending"]] == ["question 0", "question 1"]


async def test_a_head_names_the_snapshot_a_port_reads_and_one_not_there_is_read_around(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
) -> None:
    # Given k1 with two events and a snapshot covering the first, named by its head; and k3,
    # on the same partition, whose head names a record that is not its snapshot (k1's):
    log = KafkaLog(kafka_bootstrap, f"w-{uuid.uuid4().hex[:8]}", fresh_topics)
    await log.start_producer()
    try:
        partition = await log.reader().partition_of("k1")
        k3 = next(c for c in (f"k3-{i}" for i in range(1000)) if partition_for(c, 8) == partition)
        first = message_event("k1", "question 0", 1_000, "m0")
        for event in (first, message_event("k1", "question 1", 1_001, "m1"), message_event(k3, "q", 1_002, "m2")):
            await publish(log, event)
        state = new_state("k1")
        assert apply_event(state, first) is None
        _, at = await log.append(fresh_topics.snapshots, "k1", encode_snapshot(state, 0), partition)
        await log.append(fresh_topics.heads, "k1", encode_head(head_of(state, 0, at)), partition)
        await log.append(fresh_topics.heads, k3, encode_head(Head(k3, 2, "debouncing", at, 1, 0, 1)), partition)
        reads = conversation_reader(log)
        others = [c for c in (f"k4-{i}" for i in range(1000)) if partition_for(c, 8) == partition]
        # Without a watermark on the heads, a conversation without a head may have a snapshot
        # older than the heads: its start is the snapshot partition's (none here: offset 0)
        assert (await reads.tail(others[0])).start == Start(None, 0)
        # With one (every conversation with an event below 1 has a head):
        await log.append(fresh_topics.heads, WATERMARK_KEY, encode_watermark(1), partition)
        # When they are read: k1 from its snapshot and the events after it; k3, whose head
        # names a record that is not its snapshot, as the snapshot partition has it (from 0);
        # one with no head and no event, from the watermark
        k1 = await reads.tail("k1")
        assert k1.start == Start(state, 1) and [r.offset for r in k1.records] == [1, 2]
        assert k1.view("k1").state.events_applied == 2
        assert (await reads.tail(k3)).start == Start(None, 0)
        assert (await reads.tail(others[0])).start == Start(None, 1)
    finally:
        await log.stop()


async def test_without_a_snapshot_topic_the_tail_is_the_whole_partition_within_the_read_bound(
    kafka_bootstrap: str,  # noqa: F811
    fresh_topics: Topics,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_reads, "READ_TIMEOUT_S", 1.0)  # the missing topic's metadata wait
    topics = dataclasses.replace(fresh_topics, snapshots=f"absent-{uuid.uuid4().hex[:8]}.snapshots")
    log = KafkaLog(kafka_bootstrap, f"w-{uuid.uuid4().hex[:8]}", topics)
    await log.start_producer()
    try:
        await publish(log, message_event("k1", "question", 1_000, "m1"))
        tail = await conversation_reader(log).tail("k1")
    finally:
        await log.stop()
    assert tail.start == Start(None, 0) and [r.offset for r in tail.records] == [0]
    assert tail.view("k1").state.pending["m1"].content == "question"

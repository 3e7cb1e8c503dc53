"""`turnstile audit` on the real broker: a log written by real workers (two in one group,
a rebalance mid-run, slow model calls, double texts) has no violation; a log with a
violation makes the command exit 1 and name the offset; the auditor's own consumer group
remembers what it reported."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import OUTCOME_TYPES, DecodeError, TurnClaimed, decode, encode
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.provider import ModelRequest
from turnstile.handlers.providers.scripted import Scripted, ScriptedProvider, echo_reply
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker, WorkerConfig

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).parent.parent
NOW = SystemClock().now_ms
CONVERSATIONS = 12


def turnstile_audit(bootstrap: str, topics: Topics, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "turnstile.streams.cli", "audit", "--broker", f"kafka://{bootstrap}",
               "--events-topic", topics.events, "--outcomes-topic", topics.outcomes, "--dlq-topic", topics.dead_letters,
               *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)


def slow_for_some(request: ModelRequest) -> Scripted:
    return Scripted(echo_reply(request), delay_s=1.0 if "[slow]" in request.messages[-1].content else 0.05)


async def test_a_log_written_by_real_workers_has_no_violation(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    group = f"g-{uuid.uuid4().hex[:8]}"
    config = WorkerConfig(debounce=DebouncePolicy(quiet_ms=150, max_wait_ms=500))
    publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
    await publisher.producer.start()
    stops: list[asyncio.Event] = []
    workers: list[Worker] = []

    def start_worker() -> asyncio.Task[None]:
        worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), ScriptedProvider(slow_for_some), config)
        workers.append(worker)
        stops.append(asyncio.Event())
        return asyncio.create_task(worker.run(stops[-1]))

    tasks = [start_worker()]
    sent = set()
    try:
        for round_ in range(3):  # later messages often land mid-turn: they wait for the next turn
            for i in range(CONVERSATIONS):
                text = f"question {round_} of {i}" + (" [slow]" if i % 3 == 0 else "")
                event = message_event(f"conv-{i}", text, NOW(), f"c{i}-m{round_}")
                await publish(publisher, event)
                sent.add(event.message_id)
            await asyncio.sleep(0.4)
            if round_ == 0:
                tasks.append(start_worker())  # a rebalance while turns are in flight
        deadline = asyncio.get_running_loop().time() + 90
        while True:
            events = [e for r in await read_topic(kafka_bootstrap, fresh_topics.events)
                      if not isinstance(e := decode(r.value), DecodeError)]  # fmt: skip
            claimed = {i for e in events if isinstance(e, TurnClaimed) for i in e.input_ids}
            claims = {e.turn_id for e in events if isinstance(e, TurnClaimed)}
            ended = {e.turn_id for e in events if isinstance(e, OUTCOME_TYPES)}
            if claimed == sent and claims == ended:
                break
            assert asyncio.get_running_loop().time() < deadline, f"{len(sent - claimed)} unclaimed"
            await asyncio.sleep(1.0)
    finally:
        # One after the other, as a rolling stop does, each once the rest are live again: two
        # members leaving at once rebalance each other's partitions mid-drain, and a partition
        # still replaying is not committed (its next owner re-reads a few records), which the
        # strict audit rightly reports as behind.
        for i, (stop, task) in enumerate(zip(stops, tasks, strict=True)):
            stop.set()
            await task
            if i + 1 < len(workers):
                await _live_on_every_partition(workers[i + 1])
        await publisher.producer.stop()

    audit_group = f"audit-{uuid.uuid4().hex[:8]}"
    result = turnstile_audit(kafka_bootstrap, fresh_topics, "--from-beginning", "--strict", "--json",
                             "--group", audit_group, "--worker-group", group, "--max-iterations", "8",
                             "--max-tool-calls", "16")  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["violations"] == 0
    assert report["conversations"] == CONVERSATIONS and report["outcomes"]["open"] == 0
    assert report["outcomes"]["completed"] == len(claims)
    checked = {r["rule"]: r["checked"] for r in report["rules"]}
    assert checked["claim_once"] == len(sent) and checked["one_outcome"] == len(claims)
    assert not report["undecodable"]
    assert report["unpublished"] == []  # every outcome the workers committed past is on the outcomes topic

    text = turnstile_audit(kafka_bootstrap, fresh_topics, "--from-beginning", "--group", audit_group)
    assert text.returncode == 0 and text.stdout.rstrip().endswith("no violation; the log is clean"), text.stdout


async def _live_on_every_partition(worker: Worker, within_s: float = 60) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not ((live := worker.partition_liveness()) and len(live) == 8 and all(live.values())):
        assert asyncio.get_running_loop().time() < deadline, f"not live on every partition: {live}"
        await asyncio.sleep(0.05)


async def test_a_violation_on_kafka_exits_1_and_is_reported_once_per_group(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    from test_audit import bad_log  # hand-built: a claim while another turn is active, at 0@4

    publisher = KafkaLog(kafka_bootstrap, "unused", fresh_topics)
    await publisher.producer.start()
    try:
        where = set()
        for record in bad_log():
            event = decode(record.value)
            assert not isinstance(event, DecodeError)
            where.add(await publisher.append(fresh_topics.events, event.conversation_id, encode(event)))
    finally:
        await publisher.producer.stop()
    [partition] = {p for p, _ in where}

    group = f"audit-{uuid.uuid4().hex[:8]}"
    first = turnstile_audit(kafka_bootstrap, fresh_topics, "--group", group)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "FAIL one_active_turn" in first.stdout and f"{partition}@4" in first.stdout
    # The same group has reported it: an incremental audit has nothing new (and says only
    # that, never that the log is clean); a full one reports it again.
    again = turnstile_audit(kafka_bootstrap, fresh_topics, "--group", group)
    assert again.returncode == 0, again.stdout
    assert again.stdout.rstrip().endswith("no new violation since this auditor group's last run (--from-beginning "
                                          "judges the whole log)")  # fmt: skip
    full = turnstile_audit(kafka_bootstrap, fresh_topics, "--group", group, "--from-beginning")
    assert full.returncode == 1 and f"{partition}@4" in full.stdout


def test_a_topic_that_is_not_there_is_said_at_once_and_a_missing_dlq_leaves_letters_out_saying_so(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    # a dead-letter topic that does not exist: the audit goes on without letters, saying so
    # (it said nothing: 0 letters and 0 values missing one read as checked)
    no_dlq_topic = f"nosuch-{uuid.uuid4().hex[:8]}"
    no_dlq = turnstile_audit(kafka_bootstrap, fresh_topics, "--from-beginning", "--group", "g-a",
                             "--dlq-topic", no_dlq_topic)  # fmt: skip
    assert no_dlq.returncode == 0 and "no violation" in no_dlq.stdout, no_dlq.stdout + no_dlq.stderr
    assert f"topic '{no_dlq_topic}' does not exist" in no_dlq.stderr and "dead letters are not checked" in no_dlq.stderr
    assert "undecodable values with no dead letter -- NOT CHECKED" in no_dlq.stdout
    assert "ERROR" not in no_dlq.stderr  # (a subscription to it logged an error per metadata refresh)
    # an outcomes topic that does not exist: the audit goes on, saying what it did not check
    no_outcomes = f"nosuch-{uuid.uuid4().hex[:8]}"
    unchecked = turnstile_audit(kafka_bootstrap, fresh_topics, "--from-beginning", "--group", "g-a",
                                "--outcomes-topic", no_outcomes)  # fmt: skip
    assert unchecked.returncode == 0, unchecked.stdout + unchecked.stderr
    assert f"topic '{no_outcomes}' does not exist" in unchecked.stderr
    assert "what the outcomes topic's consumers see is not checked" in unchecked.stderr
    # a mistyped events topic: one line, the log cannot be read
    missing = Topics(f"nosuch-{uuid.uuid4().hex[:8]}", fresh_topics.outcomes, fresh_topics.dead_letters)
    wrong = turnstile_audit(kafka_bootstrap, missing, "--from-beginning", "--group", "g-a")
    assert wrong.returncode == 2 and "does not exist" in wrong.stderr, wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr


async def test_a_partition_whose_first_records_were_deleted_is_audited_from_where_it_starts(
    kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    # (an outside hunt: kafka-delete-records up to an offset made the audit blame the engine
    # with 63 violations -- claims of inputs "never received", history boundaries, stalls)
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
    from builders import claim, completed, message, started

    first = claim(["m1"], 10, 0)
    log = (message("m1", 1), first, started(first, 11), completed(first, 12))
    publisher = KafkaLog(kafka_bootstrap, "unused", fresh_topics)
    await publisher.producer.start()
    try:
        landed = [await publisher.append(fresh_topics.events, e.conversation_id, encode(e)) for e in log]
    finally:
        await publisher.producer.stop()
    [partition] = {p for p, _ in landed}
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:  # the message is gone, as retention would have it
        await admin.delete_records({TopicPartition(fresh_topics.events, partition): RecordsToDelete(landed[1][1])})
    finally:
        await admin.close()

    audited = turnstile_audit(kafka_bootstrap, fresh_topics, "--from-beginning", "--json")
    assert audited.returncode == 0, audited.stdout + audited.stderr
    report = json.loads(audited.stdout)
    assert report["truncated_partitions"] == {str(partition): landed[1][1]}
    assert report["not_judged"] and report["violations"] == 0

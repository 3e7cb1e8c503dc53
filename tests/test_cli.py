"""The `turnstile` command as a user runs it: separate processes, the embedded log and Kafka."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.streams.log import Topics

CLI = [sys.executable, "-m", "turnstile.streams.cli"]
ROOT = Path(__file__).parent.parent


def turnstile(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False, env=env
    )


def test_demo_shows_the_follow_up_answered_in_its_own_turn_once_and_leaves_no_folder(tmp_path):
    result = turnstile("demo", timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: each message was claimed by exactly one turn and answered once" in result.stdout
    assert result.stdout.count("TurnCompleted") == 2
    assert list(tmp_path.iterdir()) == []  # its temporary log is removed


def test_the_demo_runs_again_on_a_folder_it_kept(tmp_path):
    for _ in range(2):  # the second run said UNEXPECTED: it sent the first run's message ids again
        result = turnstile("demo", "--data", str(tmp_path / "kept"), timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("TurnCompleted") == 2 and "+-" not in result.stdout


def run_worker_until(where: list[str], conversation: str, completions: int, *run_args: str) -> str:
    worker = subprocess.Popen(
        [*CLI, "run", *where, "--quiet-ms", "100", *run_args], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            out = turnstile("tail", *where, "--conversation", conversation).stdout
            if out.count("TurnCompleted") >= completions or time.monotonic() > deadline:
                return out
            time.sleep(0.5)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.stderr.read() if worker.stderr else ""


def test_send_run_and_tail_on_the_embedded_log(tmp_path):
    where = ["--data", str(tmp_path)]
    for n in range(2):  # the same message id twice: answered once
        sent = turnstile("send", *where, "--conversation", "c1", "--text", "hello", "--message-id", "m1")
        assert sent.returncode == 0 and "sent message m1" in sent.stdout
        # The first send starts the log, and says where: a worker on another folder never sees it.
        started = f"no embedded log in {tmp_path.resolve()} yet: starting one there"
        assert (started in sent.stderr) == (n == 0), sent.stderr
    out = run_worker_until(where, "c1", 1)
    assert out.count("TurnCompleted") == 1
    assert "claims ['m1']" in out


@pytest.mark.kafka
def test_send_run_tail_and_audit_on_kafka(kafka_bootstrap: str, fresh_topics: Topics, tmp_path: Path):  # noqa: F811
    where = [
        "--broker", f"kafka://{kafka_bootstrap}",
        "--events-topic", fresh_topics.events,
        "--outcomes-topic", fresh_topics.outcomes,
        "--dlq-topic", fresh_topics.dead_letters,
    ]
    sent = turnstile("send", *where, "--conversation", "c1", "--text", "check the dates", "--message-id", "m1")
    assert sent.returncode == 0, sent.stderr
    group = f"g-{os.getpid()}-{time.time_ns()}"
    out = run_worker_until(where, "c1", 1, "--group", group)
    assert "COMPLETED {'m1': 'answered'}" in out
    # An auditor beside that deployment names it as every command does: a --config file, or
    # TURNSTILE_* (its topics, and the workers' group whose commits it checks).
    config = tmp_path / "turnstile.toml"
    config.write_text(
        f'broker = "kafka://{kafka_bootstrap}"\ngroup = "{group}"\n[topics]\nevents = "{fresh_topics.events}"\n'
        f'outcomes = "{fresh_topics.outcomes}"\ndead_letters = "{fresh_topics.dead_letters}"\n'
    )
    env = {
        **os.environ, "TURNSTILE_BROKER": f"kafka://{kafka_bootstrap}", "TURNSTILE_GROUP": group,
        "TURNSTILE_TOPICS_EVENTS": fresh_topics.events, "TURNSTILE_TOPICS_OUTCOMES": fresh_topics.outcomes,
        "TURNSTILE_TOPICS_DEAD_LETTERS": fresh_topics.dead_letters,
    }  # fmt: skip
    for audited in (turnstile("audit", "--config", str(config), "--from-beginning", "--strict"),
                    turnstile("audit", "--from-beginning", "--strict", env=env)):  # fmt: skip
        assert audited.returncode == 0, audited.stdout + audited.stderr
        assert "1 turn" in audited.stdout and "no committed offsets" not in audited.stderr


def test_a_second_run_on_one_embedded_log_exits_at_once_naming_the_owner_and_readers_still_work(tmp_path):
    where = ["--data", str(tmp_path)]
    owner = subprocess.Popen([*CLI, "run", *where, "--quiet-ms", "100"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / "owner.lock"
        deadline = time.monotonic() + 30
        while not (lock.exists() and lock.read_text().strip() == str(owner.pid)):
            assert owner.poll() is None and time.monotonic() < deadline, "the first worker did not take the log"
            time.sleep(0.1)
        second = turnstile("run", *where, timeout=30)  # returns on its own: it must not start
        assert second.returncode == 3
        assert second.stderr.strip().splitlines() == [
            f"turnstile run: the embedded log {tmp_path} is owned by another process (pid {owner.pid})"
        ]
        sent = turnstile("send", *where, "--conversation", "c1", "--text", "hello", "--message-id", "m1")
        assert sent.returncode == 0, sent.stderr
        deadline = time.monotonic() + 60
        while "TurnCompleted" not in (out := turnstile("tail", *where, "--conversation", "c1").stdout):
            assert time.monotonic() < deadline, out
            time.sleep(0.3)
        inspected = turnstile("inspect", *where, "c1")
        assert inspected.returncode == 0 and "hello" in inspected.stdout, inspected.stderr
        audited = turnstile("audit", *where)
        assert audited.returncode == 0, audited.stdout + audited.stderr
        assert owner.poll() is None
    finally:
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=30) == 0, owner.stderr.read() if owner.stderr else ""
    again = subprocess.Popen([*CLI, "run", *where], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:  # the owner gone, the log is free again
        deadline = time.monotonic() + 30
        while lock.read_text().strip() != str(again.pid):
            assert again.poll() is None and time.monotonic() < deadline, again.stderr.read() if again.stderr else ""
            time.sleep(0.1)
    finally:
        again.kill()  # it may not have set its signal handlers yet; its exit is not the point
        again.wait(timeout=30)


@pytest.mark.kafka
def test_topics_creates_what_a_deployment_needs_and_run_names_it_when_missing(kafka_bootstrap: str):  # noqa: F811
    # (the refusal pointed at infra/kafka/start.sh, which a wheel does not have)
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    where = ["--broker", f"kafka://{kafka_bootstrap}", "--events-topic", f"{prefix}.events", "--outcomes-topic",
             f"{prefix}.outcomes", "--dlq-topic", f"{prefix}.dlq", "--deltas-topic", f"{prefix}.deltas"]  # fmt: skip
    refused = turnstile("send", *where, "--conversation", "c1", "--text", "hi")
    assert refused.returncode == 2 and "with `turnstile topics --broker ...`" in refused.stderr, refused.stderr
    made = turnstile("topics", *where, "--partitions", "4")
    assert made.returncode == 0, made.stderr
    names = [f"{prefix}.{t}" for t in ("events", "outcomes", "dlq", "deltas", "snapshots", "snapshots.heads")]
    assert made.stdout.splitlines() == [f"{name}: created" for name in names]
    again = turnstile("topics", *where, "--partitions", "8")
    assert again.stdout.splitlines() == [f"{name}: already there" for name in names]
    assert f"{prefix}.events has 4 partitions, not 8: kept as it is" in again.stderr
    # The log and its letters are kept forever (the outcomes as the broker keeps topics)
    assert asyncio.run(_retention(kafka_bootstrap, [names[0], names[2]])) == {names[0]: "-1", names[2]: "-1"}
    sent = turnstile("send", *where, "--conversation", "c1", "--text", "hi")
    assert sent.returncode == 0, sent.stderr
    embedded = turnstile("topics", "--data", "somewhere")
    assert embedded.returncode == 2 and "the embedded log makes its topics itself" in embedded.stderr
    # A refusal of the broker's is said, topic by topic (it answers in the response, not by raising)
    other = f"t-{uuid.uuid4().hex[:8]}"
    refused = turnstile("topics", "--broker", f"kafka://{kafka_bootstrap}", "--events-topic", f"{other}.events",
                        "--replication-factor", "3")  # fmt: skip
    assert refused.returncode == 73, refused.stdout + refused.stderr
    assert f"the broker refused to create '{other}.events': " in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.kafka
def test_topics_made_beside_an_events_topic_have_its_partition_count(kafka_bootstrap: str):  # noqa: F811
    # (a deployment from before snapshots: its snapshot topics must be co-partitioned with it)
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    asyncio.run(_create(kafka_bootstrap, f"{prefix}.events", 3))
    made = turnstile("topics", "--broker", f"kafka://{kafka_bootstrap}", "--events-topic", f"{prefix}.events",
                     "--outcomes-topic", f"{prefix}.outcomes", "--dlq-topic", f"{prefix}.dlq",
                     "--deltas-topic", f"{prefix}.deltas")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert f"{prefix}.events has 3 partitions, not 8: kept as it is, and the topics made beside it" in made.stderr
    from turnstile.streams.kafka_reader import partition_count

    assert asyncio.run(partition_count(kafka_bootstrap, f"{prefix}.snapshots")) == 3


async def _create(bootstrap: str, name: str, partitions: int) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


async def _retention(bootstrap: str, names: list[str]) -> dict[str, str]:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name) for name in names])
    finally:
        await admin.close()
    out = {}
    for response in described:
        for _code, _message, _type, name, entries in response.resources:
            out[name] = next(value for key, value, *_ in entries if key == "retention.ms")
    return out

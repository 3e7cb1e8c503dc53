"""A non-Python producer and consumer: `kcat` publishes a MessageReceived as one line of
JSON, a worker (`turnstile run`, a separate process) answers it, and `kcat` reads the
outcome back from the outcomes topic as JSON. The commands are the README's; so is the
Python publisher example, run here as written (on this test's topics)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jsonschema
import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)

from turnstile.events import logical_turn_id
from turnstile.streams.file_log import partition_for
from turnstile.streams.log import Topics

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="session")
def kcat() -> str:
    found = shutil.which("kcat")
    if found is None:
        message = "kcat is not installed: apt-get install -y kcat (tests/run.sh does)"
        if os.environ.get("CI") or os.environ.get("TURNSTILE_REQUIRE_KAFKA"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def kcat_publish(kcat: str, bootstrap: str, topic: str, key: str, value: dict[str, object], *options: str) -> None:
    """The README's command: key and value on one line, split at the first '|'. Kafka's
    default partitioner (murmur2) must be asked for: librdkafka's default is another hash,
    and a conversation must land where the workers write its events."""
    line = f"{key}|{json.dumps(value)}\n"
    command = [kcat, "-P", "-b", bootstrap, "-t", topic, "-K", "|", "-X", "topic.partitioner=murmur2_random", *options]
    subprocess.run(command, input=line, text=True, check=True, timeout=30)


def kcat_read(kcat: str, bootstrap: str, topic: str) -> list[dict[str, object]]:
    """`kcat -C -J`: one JSON envelope per record (topic, partition, offset, key, payload)."""
    command = [kcat, "-C", "-b", bootstrap, "-t", topic, "-o", "beginning", "-e", "-q", "-J"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_kcat_publishes_a_message_a_worker_answers_it_kcat_reads_the_outcome(
    kcat: str, kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    conversation, message_id = f"kcat-{uuid.uuid4().hex[:6]}", "kcat-m1"
    where = ["--broker", f"kafka://{kafka_bootstrap}", "--events-topic", fresh_topics.events,
             "--outcomes-topic", fresh_topics.outcomes, "--dlq-topic", fresh_topics.dead_letters]  # fmt: skip
    group = ["--group", f"g-{uuid.uuid4().hex[:8]}"]
    worker = subprocess.Popen(
        [sys.executable, "-m", "turnstile.streams.cli", "run", *where, *group, "--quiet-ms", "100"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        message = {
            "type": "MessageReceived",
            "event_id": uuid.uuid4().hex,
            "conversation_id": conversation,
            "occurred_at": int(time.time() * 1000),
            "message_id": message_id,
            "content": "hello from kcat",
        }
        kcat_publish(kcat, kafka_bootstrap, fresh_topics.events, conversation, message)
        deadline = time.monotonic() + 60
        while not (outcomes := kcat_read(kcat, kafka_bootstrap, fresh_topics.outcomes)):
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else "the worker stopped"
            assert time.monotonic() < deadline, "no outcome in time"
            time.sleep(0.5)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, worker.stderr.read() if worker.stderr else ""

    [record] = outcomes
    assert record["key"] == conversation
    outcome = json.loads(str(record["payload"]))
    assert outcome["type"] == "TurnCompleted"
    assert outcome["turn_id"] == logical_turn_id([message_id])
    assert outcome["statuses"] == {message_id: "answered"}
    assert "hello from kcat" in outcome["reply"]
    assert outcome["metrics"]["attempt"] == 1
    # A consumer in any language validates it with the published schema.
    published = json.loads((ROOT / "events" / "schemas" / "outcome.schema.json").read_text())
    jsonschema.validate(outcome, published, cls=jsonschema.Draft7Validator)

    # The message went where Kafka's default partitioner puts the key, beside the worker's events.
    events = kcat_read(kcat, kafka_bootstrap, fresh_topics.events)
    assert {e["partition"] for e in events} == {partition_for(conversation, 8)}
    assert json.loads(str(events[0]["payload"]))["type"] == "MessageReceived"

    audit = subprocess.run(
        [sys.executable, "-m", "turnstile.streams.cli", "audit", "--broker", f"kafka://{kafka_bootstrap}",
         "--events-topic", fresh_topics.events, "--outcomes-topic", fresh_topics.outcomes, "--from-beginning",
         "--strict", "--worker-group", group[1]],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_the_readme_python_publisher_example_runs_as_written(
    kcat: str, kafka_bootstrap: str, fresh_topics: Topics, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## For publishers") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    assert 'KafkaPublisher("127.0.0.1:9092")' in code
    code = code.replace('KafkaPublisher("127.0.0.1:9092")', "KafkaPublisher(BOOTSTRAP, TOPICS)")
    exec(compile(code, "README.md", "exec"), {"BOOTSTRAP": kafka_bootstrap, "TOPICS": fresh_topics})
    partition, offset = ast.literal_eval(capsys.readouterr().out.strip())
    assert (partition, offset) == (partition_for("c1", 8), 0)
    [record] = kcat_read(kcat, kafka_bootstrap, fresh_topics.events)
    assert record["key"] == "c1" and json.loads(str(record["payload"]))["message_id"] == "m-1"


def start_worker(bootstrap: str, topics: Topics) -> subprocess.Popen[str]:
    """`turnstile run` on these topics, in a group of its own, claiming without a debounce."""
    where = ["--broker", f"kafka://{bootstrap}", "--events-topic", topics.events, "--outcomes-topic", topics.outcomes,
             "--dlq-topic", topics.dead_letters, "--deltas-topic", topics.deltas]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "turnstile.streams.cli", "run", *where, "--group", f"g-{uuid.uuid4().hex[:8]}",
         "--quiet-ms", "0"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def stop_worker(worker: subprocess.Popen[str]) -> None:
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.stderr.read() if worker.stderr else ""


def test_a_message_a_producer_compressed_with_any_kafka_codec_is_answered(
    kcat: str, kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    """Many producers compress (Java's `compression.type=lz4` or `zstd` is a common default of
    a platform team): the broker keeps the producer's batches as they came, so the engine's
    consumer must decode every codec Kafka has. The content is a few kB of repeated text,
    since librdkafka sends a batch uncompressed when compression would not shrink it."""
    codecs = ["none", "gzip", "snappy", "lz4", "zstd"]
    worker = start_worker(kafka_bootstrap, fresh_topics)
    try:
        for codec in codecs:
            conversation = f"zip-{codec}-{uuid.uuid4().hex[:6]}"
            message = {
                "type": "MessageReceived",
                "event_id": uuid.uuid4().hex,
                "conversation_id": conversation,
                "occurred_at": int(time.time() * 1000),
                "message_id": f"m-{codec}",
                "content": f"sent with {codec}: " + "the same words again " * 200,
            }
            kcat_publish(kcat, kafka_bootstrap, fresh_topics.events, conversation, message, "-z", codec)
        deadline = time.monotonic() + 60
        while len(outcomes := kcat_read(kcat, kafka_bootstrap, fresh_topics.outcomes)) < len(codecs):
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else "the worker stopped"
            assert time.monotonic() < deadline, f"{len(outcomes)} of {len(codecs)} answered in time"
            time.sleep(0.5)
    finally:
        stop_worker(worker)
    answered = {json.loads(str(r["payload"]))["statuses"].popitem()[0] for r in outcomes}
    assert answered == {f"m-{codec}" for codec in codecs}
    assert kcat_read(kcat, kafka_bootstrap, fresh_topics.dead_letters) == []


def test_a_record_whose_header_name_is_not_utf8_is_read_and_answered_as_any_other(
    kcat: str, kafka_bootstrap: str, fresh_topics: Topics  # noqa: F811
) -> None:
    """Kafka does not check header names (librdkafka, Go and kcat send any bytes), while the
    Python client decodes them as UTF-8: one such record made every read of its partition
    raise, the worker stop at every start and every reader with it. Its batch is now read
    leniently: alone in its batch, or with others in one (kcat batches the lines of one run)."""
    conversation = f"hdr-{uuid.uuid4().hex[:6]}"

    def message(message_id: str) -> str:
        event = {"type": "MessageReceived", "event_id": uuid.uuid4().hex, "conversation_id": conversation,
                 "occurred_at": int(time.time() * 1000), "message_id": message_id, "content": f"this is {message_id}"}
        return f"{conversation}|{json.dumps(event)}\n"  # fmt: skip

    publish = [kcat, "-P", "-b", kafka_bootstrap, "-t", fresh_topics.events, "-K", "|", "-X",
               "topic.partitioner=murmur2_random"]  # fmt: skip
    subprocess.run(publish, input=message("a1").encode(), check=True, timeout=30)
    subprocess.run([*publish, "-H", b"\xff\xfe=x"], input=message("a2").encode(), check=True, timeout=30)
    batch = "".join(message(f"b{i}") for i in range(3)).encode()
    subprocess.run([*publish, "-H", b"\xff=y"], input=batch, check=True, timeout=30)
    subprocess.run(publish, input=message("a3").encode(), check=True, timeout=30)
    sent = {"a1", "a2", "b0", "b1", "b2", "a3"}
    worker = start_worker(kafka_bootstrap, fresh_topics)

    def answered() -> set[str]:
        outcomes = kcat_read(kcat, kafka_bootstrap, fresh_topics.outcomes)
        return {message_id for r in outcomes for message_id in json.loads(str(r["payload"]))["statuses"]}

    try:
        deadline = time.monotonic() + 60
        while answered() != sent:
            assert worker.poll() is None, worker.stderr.read() if worker.stderr else "the worker stopped"
            assert time.monotonic() < deadline, f"answered {sorted(answered())} of {sorted(sent)} in time"
            time.sleep(0.5)
    finally:
        stop_worker(worker)
    assert kcat_read(kcat, kafka_bootstrap, fresh_topics.dead_letters) == []
    # and a reader reads the partition through them
    tail = subprocess.run(
        [sys.executable, "-m", "turnstile.streams.cli", "tail", "--broker", f"kafka://{kafka_bootstrap}",
         "--events-topic", fresh_topics.events],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert tail.returncode == 0 and all(f"this is {m}" in tail.stdout for m in sent), tail.stderr

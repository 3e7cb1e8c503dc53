"""Scenario 4: the broker stops for about 20 s while turns run, then comes back with its
data. Two worker processes ride it out: they reconnect, and every message is answered
exactly once in effect (idempotent producer; the fold ignores what is stale or duplicate).

This test starts its OWN broker (infra/kafka/start.sh with KAFKA_RUN_DIR in the test's
temporary folder and other ports), never touching the shared one on 9092. It needs what
the shared broker needs: Java 17 and the jars start.sh fetched."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fault_audit import check_invariants, counts, dead_letters, record, until_settled
from kafka_fixtures import kafka_bootstrap  # noqa: F401  (the shared broker must be up: jars and java are there)
from provider_server import Delay, ProviderServer, Reply
from test_faults_crash import Fleet, check_no_secret, server, until  # noqa: F401  (fixtures)

from turnstile.events import AttemptStarted
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import ensure_topics
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock

pytestmark = pytest.mark.kafka
NOW = SystemClock().now_ms
ROOT = Path(__file__).resolve().parent.parent
CONVERSATIONS = 16
OUTAGE_S = 20


class OwnBroker:
    def __init__(self, run_dir: Path, port: int) -> None:
        self.run_dir, self.port = run_dir, port
        self.bootstrap = f"127.0.0.1:{port}"

    def _script(self, name: str, keep_data: bool = False) -> None:
        env = dict(os.environ)
        env.update(
            KAFKA_PORT=str(self.port),
            KAFKA_CONTROLLER_PORT=str(self.port + 1),
            KAFKA_RUN_DIR=str(self.run_dir),
            KAFKA_KEEP_DATA="1" if keep_data else "0",
        )
        done = subprocess.run(
            ["bash", str(ROOT / "infra" / "kafka" / f"{name}.sh")],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{name}.sh failed:\n{done.stdout}\n{done.stderr}"

    async def start(self, keep_data: bool = False) -> None:
        await asyncio.to_thread(self._script, "start", keep_data)

    async def stop(self) -> None:
        await asyncio.to_thread(self._script, "stop")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port_pair() -> int:
    """Two consecutive free ports below the ephemeral range (so no client socket takes one
    between now and the broker's bind), picked at random: other sessions on this machine
    may run brokers of their own."""
    for _ in range(200):
        port = random.randrange(20_000, 32_000, 2)
        if _port_free(port) and _port_free(port + 1):
            return port
    raise RuntimeError("no free port pair for the test's own broker")


@pytest.fixture
async def own_broker(kafka_bootstrap: str, tmp_path: Path) -> AsyncIterator[OwnBroker]:  # noqa: F811
    broker = OwnBroker(tmp_path / "kafka-run", _free_port_pair())
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


async def slow_turns_on(
    broker: OwnBroker, model: ProviderServer, tmp_path: Path, name: str, replies: int
) -> tuple[Topics, Fleet, KafkaLog]:
    """Topics on the test's own broker, `replies` slow model replies (3 s each: an outage
    starts with turns in flight), the fleet of worker processes and a started publisher."""
    topics = Topics(f"{name}.events", f"{name}.outcomes", f"{name}.dlq")
    await ensure_topics(broker.bootstrap, topics, partitions=8)
    model.push(*[Delay(3.0, Reply(text="answer", usage=(10, 2))) for _ in range(replies)])
    publisher = KafkaLog(broker.bootstrap, "unused", topics)
    await publisher.producer.start()
    return topics, Fleet(broker.bootstrap, topics, model, tmp_path), publisher


async def test_broker_down_for_20_seconds_while_turns_run_loses_and_repeats_nothing(
    own_broker: OwnBroker, server: ProviderServer, tmp_path: Path  # noqa: F811
) -> None:
    topics, fleet, publisher = await slow_turns_on(own_broker, server, tmp_path, "outage", 200)
    try:
        w1, w2 = fleet.start(), fleet.start()
        await until(lambda: w1.assigned() and w2.assigned(), 90, "both workers' assignments")
        sent = []
        for i in range(CONVERSATIONS):
            event = message_event(f"conv-{i}", f"first question of {i}", NOW(), f"c{i}-m0")
            await publish(publisher, event)
            sent.append(event.message_id)
        await until(lambda: len(server.requests) >= 4, 90, "model calls in flight")

        await own_broker.stop()
        await asyncio.sleep(OUTAGE_S)  # turns finish their model calls and cannot write
        fleet.check_alive(w1, w2)()
        await own_broker.start(keep_data=True)

        for i in range(CONVERSATIONS):
            event = message_event(f"conv-{i}", f"second question of {i}", NOW(), f"c{i}-m1")
            await publish(publisher, event)
            sent.append(event.message_id)
        audit = await until_settled(own_broker.bootstrap, topics, sent, 300, fleet.check_alive(w1, w2))
        w1.stop()
        w2.stop()
    finally:
        await publisher.producer.stop()
        for proc in fleet.procs:
            proc.kill()

    check_invariants(audit)
    letters = await dead_letters(own_broker.bootstrap, topics)
    result = record(counts(f"4. broker down {OUTAGE_S} s mid-turn, restarted", audit, len(letters), sent))
    assert (result.answered, result.answered_twice, result.lost, result.dlq) == (len(sent), 0, 0, 0)
    retried = [s for s in audit.of_type(AttemptStarted) if s.attempt > 1]
    print(f"attempts retried after the outage: {len(retried)}")
    await check_no_secret(fleet)


async def test_a_worker_told_to_stop_while_the_broker_is_away_stops(
    own_broker: OwnBroker, server: ProviderServer, tmp_path: Path  # noqa: F811
) -> None:
    # (an outside hunt: its commit looked for the group's coordinator without end, and its
    # clients' stop waited for a broker that was not there: SIGTERM, then a second, did
    # nothing until the broker came back)
    _topics, fleet, publisher = await slow_turns_on(own_broker, server, tmp_path, "away", 20)
    try:
        worker = fleet.start()
        await until(worker.assigned, 90, "the worker's assignment")
        for i in range(4):
            await publish(publisher, message_event(f"conv-{i}", "a question", NOW(), f"c{i}-m0"))
        await until(lambda: len(server.requests) >= 1, 90, "a model call in flight")
    finally:
        await publisher.producer.stop()
    await own_broker.stop()
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)
    try:
        # A bound for the test only (the drain's 30 s, then each wait on the broker 10 s):
        # a worker that hangs fails here rather than holding the suite.
        code = await asyncio.to_thread(worker.proc.wait, 180)
    finally:
        worker.kill()
    assert code == 0, worker.log_text()[-3000:]
    assert "the broker did not answer the stop within 10 s" in worker.log_text()

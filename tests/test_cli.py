"""The `turnstile` command as a user runs it: separate processes, the embedded log and Kafka."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from turnstile.streams.log import Topics

CLI = [sys.executable, "-m", "turnstile.streams.cli"]
ROOT = Path(__file__).parent.parent


def turnstile(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def test_demo_shows_the_follow_up_answered_in_its_own_turn_once():
    result = turnstile("demo", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: each message was claimed by exactly one turn and answered once" in result.stdout
    assert result.stdout.count("TurnCompleted") == 2


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
    for _ in range(2):  # the same message id twice: answered once
        sent = turnstile("send", *where, "--conversation", "c1", "--text", "hello", "--message-id", "m1")
        assert sent.returncode == 0 and "sent message m1" in sent.stdout
    out = run_worker_until(where, "c1", 1)
    assert out.count("TurnCompleted") == 1
    assert "claims ['m1']" in out


@pytest.mark.kafka
def test_send_run_and_tail_on_kafka(kafka_bootstrap: str, fresh_topics: Topics):  # noqa: F811
    where = [
        "--broker", f"kafka://{kafka_bootstrap}",
        "--events-topic", fresh_topics.events,
        "--outcomes-topic", fresh_topics.outcomes,
        "--dlq-topic", fresh_topics.dead_letters,
    ]
    sent = turnstile("send", *where, "--conversation", "c1", "--text", "check the dates", "--message-id", "m1")
    assert sent.returncode == 0, sent.stderr
    out = run_worker_until(where, "c1", 1, "--group", f"g-{os.getpid()}-{time.time_ns()}")
    assert "COMPLETED {'m1': 'answered'}" in out

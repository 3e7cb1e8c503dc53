"""Scenarios 1 and 2 of the fault suite, on the real broker: a worker process is SIGKILLed
mid-turn and another one takes over. Verdicts come from folding the topic with an
independent reader (fault_audit), never from a worker's memory.

1. Killed in the middle of a model call: the new owner records AttemptFailed for the dead
   run and tries again -- same logical turn id, new run id, attempt 2 -- with one outcome.
2. Killed after ToolCallStarted of a side-effecting tool (neither idempotent nor with a
   reconciler) and before ToolCallFinished: the turn is not resumed; it fails with that
   operation `unknown`, and the tool body ran once (case (d) of tests/test_faults_resume.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from fault_audit import (
    all_topic_bytes,
    check_invariants,
    counts,
    dead_letters,
    record,
    until,
    until_settled,
)
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from provider_server import Delay, ProviderServer, Raw, Reply
from worker_process import WorkerProcess, worker_args, worker_env

from turnstile.events import (
    OUTCOME_TYPES,
    AttemptFailed,
    AttemptStarted,
    ModelResponded,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnCompleted,
    TurnFailed,
    decode,
    logical_turn_id,
)
from turnstile.projections.audit import audit as audit_log
from turnstile.projections.audit import render
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock

pytestmark = pytest.mark.kafka
NOW = SystemClock().now_ms
# The provider key of these tests: it must show up in no event, dead letter or log line.
API_KEY = "sk-turnstile-FAULT-SECRET-" + "7f3a9c2e51d04b8b"
TIMEOUT_S = 120


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running:
        yield running


class Fleet:
    """Worker processes of one test: started on demand, all killed at the end."""

    def __init__(self, bootstrap: str, topics: Topics, server: ProviderServer, tmp: Path) -> None:
        self.group = f"g-{uuid.uuid4().hex[:8]}"
        self.bootstrap, self.topics, self.server, self.tmp = bootstrap, topics, server, tmp
        self.tool_dir = tmp / "tools"
        self.tool_dir.mkdir()
        self.procs: list[WorkerProcess] = []

    def start(self, *extra: str) -> WorkerProcess:
        argv = worker_args(
            self.bootstrap, self.group, self.topics, self.server.base_url_openai, self.tool_dir, *extra
        )
        proc = WorkerProcess(argv, self.tmp / f"worker-{len(self.procs)}.log", worker_env(API_KEY))
        self.procs.append(proc.start())
        return proc

    def logs(self) -> str:
        return "\n".join(p.log_text() for p in self.procs)

    def tool_runs(self) -> int:
        path = self.tool_dir / "transfer.count"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def check_alive(self, *procs: WorkerProcess) -> Callable[[], None]:
        def check() -> None:
            for p in procs:
                assert p.alive(), f"worker {p.pid} died:\n{p.log_text()[-3000:]}"

        return check


@pytest.fixture
async def fleet(
    kafka_bootstrap: str, fresh_topics: Topics, server: ProviderServer, tmp_path: Path  # noqa: F811
) -> AsyncIterator[Fleet]:
    running = Fleet(kafka_bootstrap, fresh_topics, server, tmp_path)
    try:
        yield running
    finally:
        for proc in running.procs:
            proc.kill()


@pytest.fixture
async def publisher(kafka_bootstrap: str, fresh_topics: Topics) -> AsyncIterator[KafkaLog]:  # noqa: F811
    log = KafkaLog(kafka_bootstrap, "unused", fresh_topics)
    await log.producer.start()
    try:
        yield log
    finally:
        await log.producer.stop()


async def until_on_log(bootstrap: str, topics: Topics, kind: type, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not any(isinstance(decode(r.value), kind) for r in await read_topic(bootstrap, topics.events)):
        assert asyncio.get_running_loop().time() < deadline, f"no {kind.__name__} on the log in time"
        await asyncio.sleep(0.2)


async def check_no_secret(fleet: Fleet) -> None:
    blob = await all_topic_bytes(fleet.bootstrap, fleet.topics)
    assert API_KEY.encode() not in blob
    assert API_KEY not in fleet.logs()
    # ... while the key really was in use: every model request carried it.
    assert fleet.server.requests and all(API_KEY in r.headers.get("authorization", "") for r in fleet.server.requests)


async def test_worker_killed_during_a_model_call_is_retried_as_attempt_2_of_the_same_turn(
    fleet: Fleet, publisher: KafkaLog, server: ProviderServer
) -> None:
    # The first model call hangs (the worker dies in it); the next one answers.
    server.push(Delay(600, Reply(text="too late")), Reply(text="The dates are fine.", usage=(10, 5)))
    first = fleet.start()
    await until(first.assigned, 60, "the first worker's assignment")
    await publish(publisher, message_event("conv-1", "check the dates", NOW(), "m1"))
    await until(lambda: len(server.requests) >= 1, 60, "the model call")
    first.kill()

    second = fleet.start()
    audit = await until_settled(fleet.bootstrap, fleet.topics, ["m1"], TIMEOUT_S, fleet.check_alive(second))
    check_invariants(audit)
    [claim] = audit.of_type(TurnClaimed)
    starts = audit.of_type(AttemptStarted)
    [failed] = audit.of_type(AttemptFailed)
    [outcome] = audit.of_type(TurnCompleted)
    assert claim.turn_id == logical_turn_id(["m1"])
    assert [(s.turn_id, s.attempt) for s in starts] == [(claim.turn_id, 1), (claim.turn_id, 2)]
    assert starts[0].run_id == claim.run_id != starts[1].run_id
    assert (failed.run_id, failed.retryable) == (claim.run_id, True)
    assert (outcome.turn_id, outcome.run_id, outcome.attempt) == (claim.turn_id, starts[1].run_id, 2)
    assert outcome.reply == "The dates are fine." and outcome.statuses == {"m1": "answered"}
    assert len(server.requests) == 2
    second.stop()
    letters = await dead_letters(fleet.bootstrap, fleet.topics)
    result = record(counts("1. SIGKILL mid model call, restart", audit, len(letters), ["m1"]))
    assert (result.answered, result.answered_twice, result.lost, result.dlq) == (1, 0, 0, 0)
    outcomes_topic = await read_topic(fleet.bootstrap, fleet.topics.outcomes)
    assert len(outcomes_topic) == 1
    await check_no_secret(fleet)


async def test_worker_killed_inside_a_side_effecting_tool_is_not_replayed(
    fleet: Fleet, publisher: KafkaLog, server: ProviderServer
) -> None:
    server.push(
        Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]),
        Reply(text="must never be asked for"),
    )
    first = fleet.start()
    await until(first.assigned, 60, "the first worker's assignment")
    await publish(publisher, message_event("conv-1", "pay bob 5", NOW(), "m1"))
    # The tool body has run its side effect and now hangs, ToolCallStarted on the log.
    await until(lambda: fleet.tool_runs() == 1, 60, "the tool body")
    await until_on_log(fleet.bootstrap, fleet.topics, ToolCallStarted, 30)
    first.kill()
    (fleet.tool_dir / "release").touch()  # a replayed tool would now run to the end: visible

    second = fleet.start()
    audit = await until_settled(fleet.bootstrap, fleet.topics, ["m1"], TIMEOUT_S, fleet.check_alive(second))
    check_invariants(audit)
    [claim] = audit.of_type(TurnClaimed)
    [outcome] = audit.of_type(TurnFailed)
    assert outcome.turn_id == claim.turn_id and outcome.statuses == {"m1": "failed"}
    assert [(o.call_id, o.tool, o.side_effect, o.status) for o in outcome.operations] == [
        ("call_1", "transfer", True, "unknown")
    ]
    assert [s.attempt for s in audit.of_type(AttemptStarted, accepted=False)] == [1]
    [failed] = audit.of_type(AttemptFailed)
    assert failed.retryable is False
    assert len(audit.of_type(ToolCallStarted, accepted=False)) == 1
    assert audit.of_type(ToolCallFinished, accepted=False) == []
    assert len(audit.of_type(ModelResponded)) == 1
    assert len(server.requests) == 1  # the model was not asked again
    assert "cannot be run again safely" in outcome.error  # type: ignore[attr-defined]
    report = audit_log(await read_topic(fleet.bootstrap, fleet.topics.events))
    assert report.ok, render(report)
    second.stop()
    assert fleet.tool_runs() == 1  # the side effect happened once, never replayed
    letters = await dead_letters(fleet.bootstrap, fleet.topics)
    result = record(
        counts("2. SIGKILL inside a side-effecting tool", audit, len(letters), ["m1"], tool_runs=fleet.tool_runs())
    )
    assert (result.answered, result.answered_twice, result.lost, result.side_effects_replayed) == (1, 0, 0, 0)
    await check_no_secret(fleet)


async def test_the_provider_key_appears_in_no_event_dead_letter_or_log_line(
    fleet: Fleet, publisher: KafkaLog, server: ProviderServer
) -> None:
    """The key travels in every request's header; servers that echo it back in error
    bodies (retryable, rate-limited, malformed) must not get it onto the log or into a log
    line. The whole of every topic and every line the workers logged (at DEBUG for
    turnstile and the HTTP client) is searched for it."""
    echo = f"invalid request for key {API_KEY} (Bearer {API_KEY})"
    server.push(
        Raw(503, {"error": {"message": echo}}),  # retryable: AttemptFailed quotes the body
        Raw(200, f"not json at all {API_KEY}"),  # malformed: ProtocolFailure + TurnFailed quote it
        Raw(429, {"error": echo}, headers={"retry-after": "0"}),
        Reply(text="fine"),
    )
    worker = fleet.start()
    await until(worker.assigned, 60, "the worker's assignment")
    await publish(publisher, message_event("conv-1", "first", NOW(), "m1"))
    audit = await until_settled(fleet.bootstrap, fleet.topics, ["m1"], TIMEOUT_S, fleet.check_alive(worker))
    await publish(publisher, message_event("conv-2", "second", NOW(), "m2"))
    await publisher.append(fleet.topics.events, "conv-2", b'{"type": "MessageReceived", "content": "x"')
    audit = await until_settled(fleet.bootstrap, fleet.topics, ["m1", "m2"], TIMEOUT_S, fleet.check_alive(worker))
    deadline = asyncio.get_running_loop().time() + 60
    while not (letters := await dead_letters(fleet.bootstrap, fleet.topics)):
        assert asyncio.get_running_loop().time() < deadline, "no dead letter"
        await asyncio.sleep(0.5)
    worker.stop()
    kinds = sorted(type(o).__name__ for o in audit.of_type(OUTCOME_TYPES))
    assert kinds == ["TurnCompleted", "TurnFailed"]
    assert any("[redacted]" in getattr(e, "reason", "") for e in audit.of_type(AttemptFailed))
    assert len(server.requests) == 4
    await check_no_secret(fleet)
    record(counts("8. secrets: key echoed by the provider", audit, len(letters), ["m1", "m2"]))

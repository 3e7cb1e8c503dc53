"""Drain on SIGTERM, on the real broker, as a user runs a worker: `turnstile run MODULE:AGENT`
in its own process, the agent a module written here with the public API only, its model a
loopback server in the OpenAI wire format (which counts the requests: what was paid).

* SIGTERM while a side-effecting, non-idempotent tool runs and outlasts the drain grace:
  the tool finishes and its `ToolCallFinished` is on the log before the process exits 0;
  the turn is left at that step boundary, and a second worker completes it with the tool
  run once and no model call repeated.
* SIGTERM during a model call that outlasts the grace: the reply is recorded before the
  process exits 0, so after the restart the model was asked exactly as often as the turn
  has `ModelResponded` events.
* SIGTERM while the tool runs, within the grace: the turn reaches its outcome on the
  stopping worker.

Nothing here sleeps as proof: each step waits for what the process writes (its tool's
records, its stderr, the log).
"""

# ruff: noqa: F811  (fixtures are imported by name, then requested as parameters)
from __future__ import annotations

import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from subprocess import STDOUT, Popen

import pytest
from fault_audit import audit_log, check_invariants, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from provider_server import Gated, ProviderServer, Reply
from test_faults_crash import NOW, publisher, until  # noqa: F401  (publisher is a fixture)

from turnstile.events import (
    OUTCOME_TYPES,
    AttemptStarted,
    ModelResponded,
    ToolCallFinished,
    TurnCompleted,
    TurnFailed,
)
from turnstile.projections.audit import audit, render
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.log import Topics
from turnstile.streams.publisher import message_event, publish

pytestmark = pytest.mark.kafka

SHORT_GRACE_S = 2  # --drain-grace-s of the cases whose step outlasts it
EXIT_S = 60  # how long a stopping worker may take before the test gives up on it
# What the worker says on stderr when its drain begins, and when the grace is over.
DRAINING, GRACE_OVER = "in flight may take up to", "stopping: grace over"

# The agent a user would write. Its side-effecting tool records each run; it then holds
# until the test lets it go (after the worker has said its grace is over), so it runs
# across the SIGTERM and past the grace whatever the machine's speed.
AGENT = '''
import asyncio
import os
from pathlib import Path

from turnstile import Agent, DebouncePolicy, Model, ModelPrice

HERE = Path(os.environ["DRAIN_TEST_DIR"])

agent = Agent(
    "drain",
    model=Model("gpt-test", base_url=os.environ["DRAIN_TEST_BASE_URL"], price=ModelPrice(1.0, 2.0)),
    debounce=DebouncePolicy(quiet_ms=50, max_wait_ms=200),
)


def record(name: str, line: str) -> None:
    with open(HERE / name, "a") as fh:
        fh.write(line + "\\n")
        fh.flush()
        os.fsync(fh.fileno())


@agent.tool(side_effect=True)
async def transfer(to: str, amount: int) -> str:
    """Send money. Not idempotent: every run sends it again."""
    record("transfer.runs", f"{os.getpid()} {to} {amount}")
    for _ in range(1200):  # at most 60 s: never hangs a test run
        if (HERE / "release").exists():
            break
        await asyncio.sleep(0.05)
    record("transfer.done", str(os.getpid()))
    return f"sent {amount} to {to}"


@agent.tool
async def lookup(q: str) -> str:
    """Look up the notes."""
    record("lookup.runs", f"{os.getpid()} {q}")
    return f"notes on {q}"
'''

PAY = ("call_1", "transfer", '{"to": "bob", "amount": 5}')


class Run:
    """One `turnstile run drain_agent:agent` process; output to a file, signalled by pid."""

    def __init__(self, tmp: Path, topics: Topics, bootstrap: str, group: str, server: ProviderServer, grace_s: float):
        self.tmp = tmp
        self.argv = [
            sys.executable, "-m", "turnstile.streams.cli", "run", "drain_agent:agent",
            "--broker", f"kafka://{bootstrap}", "--group", group,
            "--events-topic", topics.events, "--outcomes-topic", topics.outcomes,
            "--dlq-topic", topics.dead_letters, "--deltas-topic", topics.deltas,
            "--drain-grace-s", str(grace_s), "--no-stream",
        ]  # fmt: skip
        self.env = {
            **os.environ,
            "TURNSTILE_API_KEY": "sk-drain-test",
            "DRAIN_TEST_DIR": str(tmp),
            "DRAIN_TEST_BASE_URL": server.base_url_openai,
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: list[tuple[Popen[bytes], Path]] = []

    def start(self) -> Popen[bytes]:
        out = self.tmp / f"worker-{len(self.procs)}.log"
        with open(out, "ab") as fh:
            proc = Popen(self.argv, stdout=fh, stderr=STDOUT, env=self.env, cwd=self.tmp)
        self.procs.append((proc, out))
        return proc

    def output(self, proc: Popen[bytes]) -> str:
        path = next(p for each, p in self.procs if each is proc)
        return path.read_text(errors="replace")

    def lines(self, name: str) -> list[str]:
        path = self.tmp / name
        return path.read_text().splitlines() if path.exists() else []

    def stop(self, proc: Popen[bytes]) -> int:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(EXIT_S)

    def kill_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running:
        yield running


def runs(tmp: Path, topics: Topics, bootstrap: str, server: ProviderServer, grace_s: float) -> Run:
    (tmp / "drain_agent.py").write_text(AGENT)
    return Run(tmp, topics, bootstrap, f"g-{uuid.uuid4().hex[:8]}", server, grace_s)


async def events(bootstrap: str, topics: Topics) -> list[object]:
    return [e for _, e in (await audit_log(bootstrap, topics)).accepted]


async def sigterm_when(
    run: Run, publisher: KafkaLog, text: str, started: Callable[[], bool], said: str
) -> Popen[bytes]:
    """Start a worker, send it one message, SIGTERM it once `started` holds, and return it
    once it has said `said` on stderr (the drain began, or its grace is over)."""
    first = run.start()
    await publish(publisher, message_event("conv-1", text, NOW(), "m1"))
    await until(started, 90, "the step to be under way")
    first.send_signal(signal.SIGTERM)
    await until(lambda: said in run.output(first), 60, f"the worker to say {said!r}")
    return first


def of(kind: type | tuple[type, ...], seen: list[object]) -> list[object]:
    return [e for e in seen if isinstance(e, kind)]


async def test_sigterm_inside_a_side_effecting_tool_finishes_it_and_the_next_worker_completes_the_turn(
    kafka_bootstrap: str, fresh_topics: Topics, server: ProviderServer, publisher: KafkaLog, tmp_path: Path
) -> None:
    run = runs(tmp_path, fresh_topics, kafka_bootstrap, server, SHORT_GRACE_S)
    server.push(Reply(tool_calls=[PAY], usage=(10, 5)), Reply(text="Sent 5 to bob.", usage=(20, 5)))
    try:
        first = await sigterm_when(run, publisher, "pay bob 5", lambda: bool(run.lines("transfer.runs")), GRACE_OVER)
        (tmp_path / "release").touch()  # the tool outlasted the grace; now it finishes
        assert first.wait(EXIT_S) == 0, run.output(first)
        # Drained: the tool finished and its ToolCallFinished is on the log; the turn was
        # left at that step boundary, with no model call begun after it.
        seen = await events(kafka_bootstrap, fresh_topics)
        assert [(f.call_id, f.ok) for f in of(ToolCallFinished, seen)] == [("call_1", True)]  # type: ignore[attr-defined]
        assert of(OUTCOME_TYPES, seen) == [] and len(server.requests) == 1
        assert run.lines("transfer.done") == [str(first.pid)]

        second = run.start()
        log = await until_settled(kafka_bootstrap, fresh_topics, ["m1"], 120)
        assert run.stop(second) == 0, run.output(second)
    finally:
        run.kill_all()
    check_invariants(log)
    [outcome] = log.of_type(OUTCOME_TYPES)
    assert isinstance(outcome, TurnCompleted) and outcome.reply == "Sent 5 to bob."
    assert len(run.lines("transfer.runs")) == 1  # the side effect ran once, on the first worker
    assert len(server.requests) == len(log.of_type(ModelResponded)) == 2  # no model call paid twice
    starts = log.of_type(AttemptStarted)
    assert [(s.attempt, s.resumes_run_id) for s in starts] == [(1, None), (2, starts[0].run_id)]
    report = audit(await read_topic(kafka_bootstrap, fresh_topics.events))
    assert report.ok, render(report)


async def test_sigterm_during_a_model_call_records_its_reply_so_the_call_is_not_paid_twice(
    kafka_bootstrap: str, fresh_topics: Topics, server: ProviderServer, publisher: KafkaLog, tmp_path: Path
) -> None:
    run = runs(tmp_path, fresh_topics, kafka_bootstrap, server, SHORT_GRACE_S)
    answer = threading.Event()
    server.push(
        Gated(answer, Reply(tool_calls=[("call_1", "lookup", '{"q": "bob"}')], usage=(10, 5))),
        Reply(text="Bob is fine.", usage=(20, 5)),
    )
    try:
        first = await sigterm_when(run, publisher, "how is bob", lambda: bool(server.requests), GRACE_OVER)
        answer.set()  # the call outlasted the grace; now the model answers
        assert first.wait(EXIT_S) == 0, run.output(first)
        seen = await events(kafka_bootstrap, fresh_topics)
        assert len(of(ModelResponded, seen)) == 1 and of(OUTCOME_TYPES, seen) == []

        second = run.start()
        log = await until_settled(kafka_bootstrap, fresh_topics, ["m1"], 120)
        assert run.stop(second) == 0, run.output(second)
    finally:
        answer.set()
        run.kill_all()
    check_invariants(log)
    [outcome] = log.of_type(OUTCOME_TYPES)
    assert isinstance(outcome, TurnCompleted) and outcome.reply == "Bob is fine."
    assert len(server.requests) == len(log.of_type(ModelResponded)) == 2  # the first call was not asked again
    assert len(run.lines("lookup.runs")) == 1
    report = audit(await read_topic(kafka_bootstrap, fresh_topics.events))
    assert report.ok, render(report)


async def test_sigterm_inside_a_tool_within_the_grace_lets_the_turn_reach_its_outcome(
    kafka_bootstrap: str, fresh_topics: Topics, server: ProviderServer, publisher: KafkaLog, tmp_path: Path
) -> None:
    run = runs(tmp_path, fresh_topics, kafka_bootstrap, server, 30)
    server.push(Reply(tool_calls=[PAY], usage=(10, 5)), Reply(text="Sent 5 to bob.", usage=(20, 5)))
    try:
        first = await sigterm_when(run, publisher, "pay bob 5", lambda: bool(run.lines("transfer.runs")), DRAINING)
        (tmp_path / "release").touch()
        assert first.wait(EXIT_S) == 0, run.output(first)
    finally:
        run.kill_all()
    log = await until_settled(kafka_bootstrap, fresh_topics, ["m1"], 60)
    check_invariants(log)
    assert [type(o) for o in log.of_type(OUTCOME_TYPES)] == [TurnCompleted]  # on the stopping worker
    assert log.of_type(TurnFailed) == [] and len(run.lines("transfer.runs")) == 1
    assert len(server.requests) == len(log.of_type(ModelResponded)) == 2

"""Resume from the journal on the real broker: a worker process is SIGKILLed mid-turn and a
second one takes the turn over. It continues the interrupted attempt where the journal
ends -- counted at the provider server (model requests) and inside the tools (executions):

(a) killed after ModelResponded, before its side-effecting tool ran: no model step asked
    again, the transfer runs once (the read-only lookup it hung in, never finished, runs again);
(b) killed after the side-effecting ToolCallFinished: the transfer does not run again;
(c) killed inside an idempotent side-effecting tool: it runs again with the same
    idempotency key, and its effect happens once;
(d) killed inside a non-idempotent one without a reconciler fails visibly: that is
    `test_worker_killed_inside_a_side_effecting_tool_is_not_replayed` in test_faults_crash.

`turnstile audit` passes on every log.
"""

# ruff: noqa: F811  (the crash tests' fixtures are imported by name, then requested as parameters)
from __future__ import annotations

from pathlib import Path

import pytest
from fault_audit import check_invariants, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from provider_server import ProviderServer, Reply
from test_faults_crash import NOW, TIMEOUT_S, Fleet, fleet, publisher, server, until  # noqa: F401

from turnstile.events import AttemptStarted, ModelResponded, ToolCallFinished, TurnCompleted, decode
from turnstile.projections.audit import audit, render
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.kafka_reader import read_topic
from turnstile.streams.publisher import message_event, publish

pytestmark = pytest.mark.kafka

LOOKUP = ("call_1", "lookup", '{"q": "bob"}')
PAY = ("call_2", "transfer", '{"to": "bob", "amount": 5}')


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def take_over(fleet: Fleet, publisher: KafkaLog, killed_when: object) -> TurnCompleted:
    """Publish one message, SIGKILL the first worker once `killed_when` holds, let a second
    one finish the turn; the resumed attempt and a clean audit are checked here."""
    first = fleet.start()
    await until(first.assigned, 60, "the first worker's assignment")
    await publish(publisher, message_event("conv-1", "pay bob 5", NOW(), "m1"))
    await until(killed_when, 60, "the moment to kill")  # type: ignore[arg-type]
    first.kill()
    (fleet.tool_dir / "release").touch()
    (fleet.tool_dir / "release-lookup").touch()
    second = fleet.start()
    log = await until_settled(fleet.bootstrap, fleet.topics, ["m1"], TIMEOUT_S, fleet.check_alive(second))
    check_invariants(log)
    second.stop()
    [outcome] = log.of_type(TurnCompleted)
    starts = log.of_type(AttemptStarted)
    assert [(s.attempt, s.resumes_run_id) for s in starts] == [(1, None), (2, starts[0].run_id)]
    assert outcome.run_id == starts[1].run_id
    # Every model step is on the log once: none was asked again.
    assert [m.iteration for m in log.of_type(ModelResponded)] == [1, 2]
    report = audit(await read_topic(fleet.bootstrap, fleet.topics.events))
    assert report.ok, render(report)
    assert report.rule("resume").checked >= 1
    return outcome  # type: ignore[return-value]


async def test_a_takeover_after_a_model_step_runs_its_tools_without_asking_the_model_again(
    fleet: Fleet, publisher: KafkaLog, server: ProviderServer
) -> None:
    server.push(Reply(tool_calls=[LOOKUP, PAY]), Reply(text="Paid bob."), Reply(text="must never be asked for"))
    outcome = await take_over(fleet, publisher, lambda: len(lines(fleet.tool_dir / "lookup.count")) == 2)
    assert outcome.reply == "Paid bob."
    assert len(server.requests) == 2
    assert fleet.tool_runs() == 1  # the transfer had not run; it ran once
    # The lookup hung and never finished: read-only, it ran again (one run per worker).
    assert len(lines(fleet.tool_dir / "lookup.count")) == 4  # "pid q" per run


async def test_a_takeover_after_a_finished_side_effect_does_not_run_it_again(
    fleet: Fleet, publisher: KafkaLog, server: ProviderServer
) -> None:
    (fleet.tool_dir / "release").touch()  # the transfer finishes; the lookup after it hangs
    server.push(Reply(tool_calls=[PAY, LOOKUP]), Reply(text="Paid bob."), Reply(text="must never be asked for"))
    await take_over(fleet, publisher, lambda: len(lines(fleet.tool_dir / "lookup.count")) == 2)
    finished = [f for f in (await _events(fleet)) if isinstance(f, ToolCallFinished) and f.call_id == "call_2"]
    assert len(finished) == 1 and finished[0].ok
    assert len(server.requests) == 2
    assert fleet.tool_runs() == 1  # the side effect ran once, before the crash


async def test_a_takeover_inside_an_idempotent_side_effect_runs_it_again_with_the_same_key(
    fleet: Fleet, publisher: KafkaLog, server: ProviderServer
) -> None:
    pay_once = ("call_1", "transfer_once", '{"to": "bob", "amount": 5}')
    server.push(Reply(tool_calls=[pay_once]), Reply(text="Paid bob."), Reply(text="must never be asked for"))
    await take_over(fleet, publisher, lambda: len(lines(fleet.tool_dir / "idem.count")) == 1)
    keys = lines(fleet.tool_dir / "idem.count")
    assert len(keys) == 2 and keys[0] == keys[1]  # run twice, with the same idempotency key
    assert lines(fleet.tool_dir / "idem.effects") == keys[:1]  # the effect happened once
    assert len(server.requests) == 2


async def _events(fleet: Fleet) -> list[object]:
    return [decode(r.value) for r in await read_topic(fleet.bootstrap, fleet.topics.events)]

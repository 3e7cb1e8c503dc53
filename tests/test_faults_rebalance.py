"""Scenario 3 on the real broker: two worker processes in one group; one is SIGKILLed while
its turns run and a third joins mid-turn (a rebalance while the survivor has turns in
flight). The new owners rebuild their partitions from the log and continue.

The proof is the whole log folded by an independent reader: per conversation the accepted
claims and outcomes alternate (never two active turns), every claimed input has exactly
one accepted claim and its turn exactly one accepted outcome. Raw claims are counted too:
a claim the fold refused would show up as `refused_claims`."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fault_audit import audit_log, check_invariants, counts, dead_letters, record, until_settled
from kafka_fixtures import fresh_topics, kafka_bootstrap  # noqa: F401  (fixtures)
from loop_harness import World, config, settings
from provider_server import Delay, ProviderServer, Reply
from test_faults_crash import Fleet, check_no_secret, fleet, publisher, server, until  # noqa: F401  (fixtures)

from turnstile.events import (
    OUTCOME_TYPES,
    AttemptFailed,
    AttemptStarted,
    ModelResponded,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    encode,
)
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import Topics
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import SystemClock
from turnstile.streams.worker import Worker

pytestmark = pytest.mark.kafka
NOW = SystemClock().now_ms
CONVERSATIONS = 24


async def test_a_worker_killed_and_a_worker_joining_mid_turn_never_make_two_active_turns(
    fleet: Fleet, publisher: KafkaLog, server: ProviderServer  # noqa: F811
) -> None:
    # Every model call takes a while, so kills and joins land mid-turn; every third answer
    # calls the side-effecting `transfer` (which returns at once: its release file exists).
    transfer = '{"to": "bob", "amount": 1}'
    server.push(
        *[
            Delay(1.0, Reply(tool_calls=[(f"call_{i}", "transfer", transfer)], usage=(10, 2)))
            if i % 3 == 0
            else Delay(1.5, Reply(text="answer", usage=(10, 2)))
            for i in range(600)
        ]
    )
    (fleet.tool_dir / "release").touch()
    w1, w2 = fleet.start(), fleet.start()
    await until(lambda: w1.assigned() and w2.assigned(), 90, "both workers' assignments")
    sent = []
    for i in range(CONVERSATIONS):
        event = message_event(f"conv-{i}", f"first question of {i}", NOW(), f"c{i}-m0")
        await publish(publisher, event)
        sent.append(event.message_id)
    # httpcore logs (DEBUG) a request body sent before its answer: w1 waits on a model call.
    await until(lambda: "send_request_body.complete" in w1.log_text(), 90, "a model call of w1 in flight")
    w1.kill()  # mid-turn: its attempts are left open on the log
    for i in range(CONVERSATIONS):  # arrive while turns run (or are orphaned)
        event = message_event(f"conv-{i}", f"second question of {i}", NOW(), f"c{i}-m1")
        await publish(publisher, event)
        sent.append(event.message_id)
    w3 = fleet.start()  # joins while w2 has turns in flight: a rebalance mid-turn

    def alive() -> None:
        fleet.check_alive(w2, w3)()

    audit = await until_settled(fleet.bootstrap, fleet.topics, sent, 300, alive)
    w2.stop()
    w3.stop()
    check_invariants(audit)
    raw_claims = audit.of_type(TurnClaimed, accepted=False)
    accepted_claims = audit.of_type(TurnClaimed)
    # Takeovers happened (the killed worker's open attempts were failed and retried) ...
    assert any(isinstance(e, AttemptFailed) for e in audit.of_type(AttemptFailed))
    assert any(s.attempt > 1 for s in audit.of_type(AttemptStarted))
    letters = await dead_letters(fleet.bootstrap, fleet.topics)
    scenario = "3. two workers, one SIGKILLed, a third joins"
    result = record(counts(scenario, audit, len(letters), sent, tool_runs=fleet.tool_runs()))
    assert (result.answered, result.answered_twice, result.lost, result.side_effects_replayed) == (len(sent), 0, 0, 0)
    assert fleet.tool_runs() > 0  # side effects really ran in this scenario
    print(f"raw claims {len(raw_claims)}, accepted {len(accepted_claims)}, transfer runs {fleet.tool_runs()}")
    await check_no_secret(fleet)


async def test_a_superseded_run_never_starts_a_side_effect(kafka_bootstrap: str, fresh_topics: Topics) -> None:  # noqa: F811
    """The zombie case, made deterministic: while worker A waits on its model, another owner
    takes the turn over on the log (AttemptFailed for A's run, then its own attempt). The
    model then tells A to call a side-effecting tool. A's ToolCallStarted lands after the
    takeover, so every reader ignores it -- and A must not run the tool either: a side
    effect runs only once its ToolCallStarted has been read back as accepted."""
    world = World()
    group = f"g-{uuid.uuid4().hex[:8]}"
    with ProviderServer() as provider_server:
        provider_server.push(
            # Long enough for the takeover below to land first, even on a loaded machine.
            Delay(8.0, Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')])),
            Reply(text="Done after the takeover."),
        )
        provider = HttpProvider(OpenAIChat(), provider_server.base_url_openai, "test-key", timeout_s=30)
        worker = Worker(KafkaLog(kafka_bootstrap, group, fresh_topics), provider, config(settings(world)))
        publisher = KafkaLog(kafka_bootstrap, group, fresh_topics)
        await publisher.producer.start()
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            await publish(publisher, message_event("conv-1", "pay bob 5", NOW(), "m1"))
            deadline = asyncio.get_running_loop().time() + 60
            while not (starts := (await audit_log(kafka_bootstrap, fresh_topics)).of_type(AttemptStarted)):
                assert asyncio.get_running_loop().time() < deadline, "no attempt started"
                await asyncio.sleep(0.1)
            [first] = starts
            # Another owner takes the turn over while A still waits on the model.
            common = {"conversation_id": "conv-1", "turn_id": first.turn_id}
            for event in (
                AttemptFailed(event_id="takeover-1", occurred_at=NOW(), run_id=first.run_id, attempt=1,
                              reason="owner presumed dead", retryable=True, **common),
                AttemptStarted(event_id="takeover-2", occurred_at=NOW(), run_id="other-owner", attempt=2,
                               model="gpt-test", **common),
            ):  # fmt: skip
                await publisher.append(fresh_topics.events, "conv-1", encode(event))

            def alive() -> None:
                assert not task.done(), "the worker stopped"

            audit = await until_settled(kafka_bootstrap, fresh_topics, ["m1"], 90, alive)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            await publisher.producer.stop()
            await provider.aclose()

    check_invariants(audit)
    assert world.transfers == []  # the superseded run did not touch the world
    # What A wrote after the takeover is on the log, and ignored by every reader.
    stale = [e for _, e, _ in audit.ignored if getattr(e, "run_id", None) == first.run_id]
    # A stopped run also says its call never started (a ToolCallFinished that is stale too).
    assert stale and all(
        isinstance(e, ModelResponded | ToolCallStarted)
        or (isinstance(e, ToolCallFinished) and not e.ok and "did not start" in e.result)
        for e in stale
    )
    [outcome] = audit.of_type(OUTCOME_TYPES)
    assert outcome.type == "TurnCompleted" and outcome.operations == ()
    letters = await dead_letters(kafka_bootstrap, fresh_topics)
    result = record(
        counts("3b. superseded run (zombie) told to run a side effect", audit, len(letters), ["m1"],
               tool_runs=len(world.transfers))
    )  # fmt: skip
    assert (result.answered, result.answered_twice, result.lost, result.side_effects_replayed) == (1, 0, 0, 0)

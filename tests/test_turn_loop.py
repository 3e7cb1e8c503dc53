"""The turn loop through the real worker, the embedded log and the loopback provider
server: every verdict is read from the log.

One section per rule: tools (registry, schemas, validation), protocol failures and
repeats (rule 8), the loop's events, budgets (rule 7), retries (rule 9), fallback
(rule 10), approval, and the four outcomes (rule 11)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
from loop_harness import (
    ATTEMPTS_ONLY,
    NOW,
    Query,
    Transfer,
    World,
    config,
    inject,
    of_type,
    outcomes,
    outcomes_of,
    say,
    settings,
)
from provider_server import Delay, Drop, ProviderServer, Raw, Reply
from worker_harness import events_of, running, until

from turnstile.events import Approval, InputInjected, ResumeRequested, ToolCall, Usage, encode
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.providers.anthropic_messages import AnthropicMessages
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.tools import Tool, ToolRegistry
from turnstile.streams.file_log import FileLog
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.turn_runner import Route, TurnSettings
from turnstile.streams.worker import Worker

KEY = "test-key"


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running_server:
        yield running_server


@pytest.fixture
async def openai(server: ProviderServer) -> AsyncIterator[HttpProvider]:
    provider = HttpProvider(OpenAIChat(), server.base_url_openai, KEY, timeout_s=5.0, retry=ATTEMPTS_ONLY)
    yield provider
    await provider.aclose()


@pytest.fixture
async def backup(server: ProviderServer) -> AsyncIterator[Route]:
    """A fallback route, gpt-backup, on the same loopback server."""
    provider = HttpProvider(OpenAIChat(), server.base_url_openai, KEY, timeout_s=5.0, retry=ATTEMPTS_ONLY)
    yield Route("gpt-backup", provider)
    await provider.aclose()


@pytest.fixture
def world(tmp_path) -> World:
    return World(log=FileLog(tmp_path))


def tool_messages(body: dict) -> list[dict]:
    return [m for m in body["messages"] if m["role"] == "tool"]


# -- 1. tools: registry, schemas, validation before running ---------------------------------


async def test_tools_are_offered_with_their_schema_and_a_valid_call_runs_between_its_events(server, openai, world):
    server.push(
        Reply(tool_calls=[("call_1", "search", '{"q": "refund rules"}')], usage=(100, 10)),
        Reply(text="The refund window is 30 days.", usage=(150, 20)),
    )
    log = world.log
    async with running(log, openai, config(settings(world))):
        await say(log, "compare the refund rules", "m1")
        [outcome] = await outcomes(log, 1)

    events = events_of(log, "c1")
    assert [e.type for e in events] == [
        "MessageReceived",
        "TurnClaimed",
        "AttemptStarted",
        "ModelResponded",
        "ToolCallStarted",
        "ToolCallFinished",
        "ModelResponded",
        "TurnCompleted",
    ]
    tools = {t["function"]["name"]: t["function"] for t in server.requests[0].body["tools"]}
    assert tools["search"]["parameters"]["properties"]["q"]["type"] == "string"
    assert tools["search"]["parameters"]["required"] == ["q"]
    assert tools["transfer"]["parameters"]["properties"]["amount"]["exclusiveMinimum"] == 0
    started, finished = of_type(events, "ToolCallStarted")[0], of_type(events, "ToolCallFinished")[0]
    assert (started.tool, started.side_effect, finished.ok) == ("search", False, True)
    assert world.searches == ["refund rules"]
    assert tool_messages(server.requests[1].body) == [
        {"role": "tool", "tool_call_id": "call_1", "content": "3 results for refund rules"}
    ]
    assert outcome.type == "TurnCompleted" and outcome.reply == "The refund window is 30 days."
    m = outcome.metrics
    assert (m.model, m.attempt, m.iterations, m.tool_calls, m.input_tokens, m.output_tokens, m.fallbacks) == (
        "gpt-test",
        1,
        2,
        1,
        250,
        30,
        0,
    )
    assert m.cost_usd == pytest.approx((250 * 1.0 + 30 * 2.0) / 1e6)
    responded = of_type(events, "ModelResponded")
    assert [r.cost_usd for r in responded] == pytest.approx([120 / 1e6, 190 / 1e6])
    # Metrics, never prompt text.
    assert b"compare the refund rules" not in encode(outcome)


async def test_a_side_effecting_tool_runs_only_after_its_start_is_on_the_log(server, openai, world):
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]), Reply(text="Sent."))
    async with running(world.log, openai, config(settings(world))):
        await say(world.log, "pay bob 5", "m1")
        [outcome] = await outcomes(world.log, 1)
    assert outcome.type == "TurnCompleted"
    assert world.seen_started == [True]
    assert [(o.tool, o.side_effect, o.status) for o in outcome.operations] == [("transfer", True, "succeeded")]


async def test_a_scheduled_turn_is_offered_only_isolated_tools(server, openai, world):
    server.push(
        Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]),
        Reply(text="Could not pay; here is the digest."),
    )
    async with running(world.log, openai, config(settings(world))):
        await inject(
            world.log,
            InputInjected(
                event_id="e1",
                conversation_id="c1",
                occurred_at=NOW(),
                occurrence_key="daily-digest@2026-12-02",
                source="schedule",
                content="Send the daily digest.",
            ),
        )
        [outcome] = await outcomes(world.log, 1)
    assert [t["function"]["name"] for t in server.requests[0].body["tools"]] == ["search"]
    [failure] = of_type(events_of(world.log, "c1"), "ProtocolFailure")
    assert failure.kind == "unknown_tool" and "scheduled" in failure.detail
    assert world.transfers == [] and outcome.type == "TurnCompleted"


# -- 2. protocol failures (rule 8) ------------------------------------------------------------


async def test_unknown_tools_and_invalid_arguments_are_recorded_and_sent_back_never_run(server, openai, world):
    server.push(
        Reply(
            tool_calls=[
                ("call_1", "delete_everything", "{}"),
                ("call_2", "search", '{"q": "dates"'),  # truncated JSON
                ("call_3", "transfer", '{"to": "bob", "amount": "lots"}'),  # wrong type
            ]
        ),
        Reply(text="Sorry, I could not do that."),
    )
    async with running(world.log, openai, config(settings(world))):
        await say(world.log, "do things", "m1")
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    failures = of_type(events, "ProtocolFailure")
    assert [(f.kind, f.call_id, f.model, f.iteration) for f in failures] == [
        ("unknown_tool", "call_1", "gpt-test", 1),
        ("malformed_arguments", "call_2", "gpt-test", 1),
        ("malformed_arguments", "call_3", "gpt-test", 1),
    ]
    assert "amount" in failures[2].detail
    assert of_type(events, "ToolCallStarted") == [] and world.searches == [] and world.transfers == []
    results = tool_messages(server.requests[1].body)
    assert [r["tool_call_id"] for r in results] == ["call_1", "call_2", "call_3"]
    assert all(r["content"].startswith("error: ") for r in results)
    assert outcome.type == "TurnCompleted"


async def test_a_malformed_response_is_recorded_and_ends_the_turn_visibly_and_the_worker_goes_on(server, openai, world):
    server.push(Raw(200, {"id": "x", "choices": []}), Reply(text="fine"))
    async with running(world.log, openai, config(settings(world))):
        await say(world.log, "first", "m1", conv="c1")
        [failed] = await outcomes(world.log, 1, conv="c1")
        await say(world.log, "second", "m2", conv="c2")
        [completed] = await outcomes(world.log, 1, conv="c2")
    events = events_of(world.log, "c1")
    [failure] = of_type(events, "ProtocolFailure")
    assert (failure.kind, failure.model, failure.iteration) == ("malformed_response", "gpt-test", 1)
    [attempt_failed] = of_type(events, "AttemptFailed")
    assert not attempt_failed.retryable
    assert failed.type == "TurnFailed" and "could not be used: choices is empty" in failed.error
    assert completed.type == "TurnCompleted"


async def test_the_same_invalid_call_repeated_gets_a_strategy_change_then_stops_the_turn(server, openai, world):
    # The same call three times, spaced and ordered differently: one canonical signature.
    server.push(
        Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": "lots"}')]),
        Reply(tool_calls=[("call_2", "transfer", '{"amount":"lots","to":"bob"}')]),
        Reply(tool_calls=[("call_3", "transfer", '{ "to" : "bob" , "amount" : "lots" }')]),
        Reply(text="never requested"),
    )
    async with running(world.log, openai, config(settings(world))):
        await say(world.log, "pay bob", "m1")
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    failures = of_type(events, "ProtocolFailure")
    assert [f.kind for f in failures] == [
        "malformed_arguments",
        "malformed_arguments",
        "repeated_call",
        "malformed_arguments",
        "repeated_call",
    ]
    assert len({f.signature for f in failures}) == 1
    first, second = tool_messages(server.requests[1].body)[-1], tool_messages(server.requests[2].body)[-1]
    assert "change strategy" not in first["content"]
    assert "change strategy" in second["content"]
    assert len(server.requests) == 3 and server.pending == 1
    assert outcome.type == "TurnFailed"
    assert "transfer" in outcome.error and '"amount" : "lots"' in outcome.error and "3 times" in outcome.error
    assert world.transfers == []


# -- 4. budgets (rule 7) ------------------------------------------------------------------------


async def test_the_tool_call_limit_pauses_before_the_next_side_effect_keeping_the_work_and_resume_is_a_new_turn(
    server, openai, world
):
    server.push(
        Reply(text="Looking it up.", tool_calls=[("call_1", "search", '{"q": "invoice 7"}')]),
        Reply(tool_calls=[("call_2", "transfer", '{"to": "bob", "amount": 5}')]),
    )
    turn = settings(world, budget=TurnBudget(max_tool_calls=1))
    async with running(world.log, openai, config(turn)):
        await say(world.log, "pay invoice 7", "m1")
        [paused] = await outcomes(world.log, 1)
        assert paused.type == "TurnPaused" and paused.reason == "tool_calls"
        assert world.transfers == []  # paused before the side effect
        assert "Looking it up." in paused.kept and "3 results for invoice 7" in paused.kept
        assert "ResumeRequested" in paused.resume_hint and paused.turn_id in paused.resume_hint
        assert paused.statuses == {"m1": "paused"}
        assert [(o.tool, o.status) for o in paused.operations] == [("search", "succeeded")]

        server.push(Reply(text="Resumed and done."))
        await inject(
            world.log,
            ResumeRequested(
                event_id="e-r",
                conversation_id="c1",
                occurred_at=NOW(),
                request_id="r1",
                resumes_turn_id=paused.turn_id,
            ),
        )
        _, resumed = await outcomes(world.log, 2)
    assert resumed.type == "TurnCompleted" and resumed.turn_id != paused.turn_id
    history = server.requests[-1].body["messages"]
    assert any("3 results for invoice 7" in (m["content"] or "") for m in history)  # the kept work
    assert history[-1] == {"role": "user", "content": "Continue."}


async def test_the_cost_limit_pauses_before_a_tool(server, openai, world):
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')], usage=(600_000, 0)))
    async with running(world.log, openai, config(settings(world, budget=TurnBudget(max_cost_usd=0.5)))):
        await say(world.log, "pay bob", "m1")
        [paused] = await outcomes(world.log, 1)
    assert paused.type == "TurnPaused" and paused.reason == "cost"
    assert "cost limit" in paused.resume_hint
    assert paused.metrics.cost_usd == pytest.approx(0.6)
    assert world.transfers == []


async def test_an_unknown_price_fails_closed_on_cost(server, openai, world):
    server.push(Reply(tool_calls=[("call_1", "search", '{"q": "x"}')], usage=(10, 1)))
    async with running(world.log, openai, config(settings(world, model="gpt-unpriced"))):
        await say(world.log, "look it up", "m1")
        [paused] = await outcomes(world.log, 1)
    [responded] = of_type(events_of(world.log, "c1"), "ModelResponded")
    assert responded.cost_usd is None
    assert paused.type == "TurnPaused" and paused.reason == "cost"
    assert "price of model 'gpt-unpriced' is unknown" in paused.resume_hint
    assert paused.metrics.cost_usd is None
    assert world.searches == []


async def test_the_deadline_pauses_before_a_tool(server, openai, world):
    # The reply takes longer than the whole turn may: the deadline has passed when it lands.
    server.push(Delay(0.5, Reply(tool_calls=[("call_1", "search", '{"q": "x"}')])))
    async with running(world.log, openai, config(settings(world, budget=TurnBudget(deadline_ms=200)))):
        await say(world.log, "look it up", "m1")
        [paused] = await outcomes(world.log, 1)
    assert paused.type == "TurnPaused" and paused.reason == "deadline"
    assert world.searches == []


async def test_the_iteration_allowance_used_without_an_answer_is_exhausted(server, openai, world):
    server.push(
        Reply(text="Step one.", tool_calls=[("call_1", "search", '{"q": "a"}')]),
        Reply(text="Step two.", tool_calls=[("call_2", "search", '{"q": "b"}')]),
    )
    async with running(world.log, openai, config(settings(world, budget=TurnBudget(max_iterations=2)))):
        await say(world.log, "research", "m1")
        [outcome] = await outcomes(world.log, 1)
    assert outcome.type == "TurnExhausted" and outcome.last_text == "Step two."
    assert outcome.metrics.iterations == 2 and outcome.statuses == {"m1": "exhausted"}
    assert world.searches == ["a"]  # no iteration was left to read b's result


async def test_past_the_soft_threshold_older_tool_exchanges_are_compacted_before_the_next_request(
    server, openai, world
):
    long = "x" * 500
    server.push(
        Reply(tool_calls=[("call_1", "search", orjson.dumps({"q": "a" + long}).decode())]),
        Reply(tool_calls=[("call_2", "search", '{"q": "b"}')]),
        Reply(tool_calls=[("call_3", "search", '{"q": "c"}')]),
        Reply(text="done"),
    )
    budget = TurnBudget(max_iterations=8, soft_fraction=0.25)  # soft at 2 iterations
    async with running(world.log, openai, config(settings(world, budget=budget))):
        await say(world.log, "research", "m1")
        [outcome] = await outcomes(world.log, 1)
    compactions = of_type(events_of(world.log, "c1"), "ContextCompacted")
    assert [(c.iteration, c.compacted_call_ids, c.dimension) for c in compactions] == [
        (3, ("call_1",), "iterations"),
        (4, ("call_2",), "iterations"),
    ]
    third, fourth = tool_messages(server.requests[2].body), tool_messages(server.requests[3].body)
    assert third[0]["content"].startswith("[compacted result: ") and len(third[0]["content"]) < 150
    assert third[1]["content"] == "3 results for b"
    assert [m["content"].startswith("[compacted") for m in fourth] == [True, True, False]
    assert outcome.type == "TurnCompleted"


# -- 5. retries (rule 9) ------------------------------------------------------------------------


@pytest.mark.parametrize("failure", [Raw(500, b"boom"), Raw(429, b"slow down"), Drop()], ids=["500", "429", "drop"])
async def test_a_retryable_error_before_any_side_effect_is_a_new_attempt_of_the_same_turn(
    server, openai, world, failure
):
    server.push(failure, Reply(text="second time lucky"))
    async with running(world.log, openai, config(settings(world))):
        await say(world.log, "hi", "m1")
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    starts = of_type(events, "AttemptStarted")
    [attempt_failed] = of_type(events, "AttemptFailed")
    assert attempt_failed.retryable and attempt_failed.attempt == 1
    assert [(s.turn_id, s.attempt) for s in starts] == [(outcome.turn_id, 1), (outcome.turn_id, 2)]
    assert starts[0].run_id != starts[1].run_id == outcome.run_id
    assert outcome.type == "TurnCompleted" and outcome.metrics.attempt == 2


async def test_retries_are_bounded_then_the_turn_fails(server, openai, world):
    server.push(Raw(503, b"down"), Raw(503, b"down"), Raw(503, b"down"), Reply(text="too late"))
    async with running(world.log, openai, config(settings(world, max_attempts=3))):
        await say(world.log, "hi", "m1")
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    assert [f.retryable for f in of_type(events, "AttemptFailed")] == [True, True, False]
    assert outcome.type == "TurnFailed" and "3 attempts" in outcome.error and outcome.metrics.attempt == 3
    assert server.pending == 1


async def test_a_client_error_is_not_retried(server, openai, world):
    server.push(Raw(400, {"error": "bad request"}), Reply(text="never"))
    async with running(world.log, openai, config(settings(world))):
        await say(world.log, "hi", "m1")
        [outcome] = await outcomes(world.log, 1)
    assert outcome.type == "TurnFailed" and len(of_type(events_of(world.log, "c1"), "AttemptStarted")) == 1


async def test_after_a_side_effect_succeeded_a_provider_failure_fails_the_turn_with_the_operation_record(
    server, openai, world
):
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]), Raw(500), Reply(text="x"))
    async with running(world.log, openai, config(settings(world))):
        await say(world.log, "pay bob", "m1")
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    [attempt_failed] = of_type(events, "AttemptFailed")
    assert not attempt_failed.retryable
    assert len(of_type(events, "AttemptStarted")) == 1
    assert outcome.type == "TurnFailed" and "side effects" in outcome.error
    assert [(o.call_id, o.tool, o.side_effect, o.status) for o in outcome.operations] == [
        ("call_1", "transfer", True, "succeeded")
    ]
    assert len(world.transfers) == 1


async def test_a_side_effect_started_but_not_finished_when_the_worker_stopped_is_never_replayed(
    server, openai, world, tmp_path
):
    world.block = asyncio.Event()  # the transfer hangs until the worker is gone
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]), Reply(text="x"))
    turn = settings(world)
    async with running(world.log, openai, config(turn)):
        await say(world.log, "pay bob", "m1")
        await until(lambda: bool(world.seen_started))  # inside the tool's body
    assert world.transfers == []  # cancelled mid-tool, as a crash would leave it
    async with running(FileLog(tmp_path), openai, config(turn)):
        [outcome] = await outcomes(world.log, 1)
    assert outcome.type == "TurnFailed" and "cannot be run again safely" in outcome.error
    assert [(o.tool, o.status) for o in outcome.operations] == [("transfer", "unknown")]
    assert len(server.requests) == 1  # the model was not asked again
    assert len(of_type(events_of(world.log, "c1"), "AttemptStarted")) == 1


def _reconciled(world: World, answer: str | None) -> TurnSettings:
    """A transfer whose reconciler answers `answer` (None: it cannot tell)."""

    async def reconcile(call: ToolCall) -> str | None:
        world.reconciled.append(call.call_id)
        return answer

    transfer = Tool("transfer", "Send money.", Transfer, world.transfer, "side_effect", reconcile=reconcile)
    return settings(world, tools=ToolRegistry([transfer]))


async def test_a_takeover_inside_a_side_effect_with_a_reconciler_continues_with_its_answer(
    server, openai, world, tmp_path
):
    world.block = asyncio.Event()  # the transfer hangs until the worker is gone
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]), Reply(text="Paid bob."))
    turn = _reconciled(world, "sent 5 to bob (found in the ledger)")
    async with running(world.log, openai, config(turn)):
        await say(world.log, "pay bob", "m1")
        await until(lambda: bool(world.seen_started))
    async with running(FileLog(tmp_path), openai, config(turn)):
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    [finished] = of_type(events, "ToolCallFinished")
    assert (finished.call_id, finished.ok, finished.reconciled) == ("call_1", True, True)
    assert world.reconciled == ["call_1"] and world.transfers == []  # asked, not run again
    assert outcome.type == "TurnCompleted" and outcome.reply == "Paid bob."
    assert len(server.requests) == 2  # the first model step was not asked again
    assert tool_messages(server.requests[1].body)[0]["content"] == "sent 5 to bob (found in the ledger)"
    [_, resumed] = of_type(events, "AttemptStarted")
    assert resumed.resumes_run_id == of_type(events, "AttemptFailed")[0].run_id


async def test_a_takeover_whose_reconciler_cannot_tell_fails_the_turn_visibly(server, openai, world, tmp_path):
    world.block = asyncio.Event()
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]), Reply(text="x"))
    turn = _reconciled(world, None)
    async with running(world.log, openai, config(turn)):
        await say(world.log, "pay bob", "m1")
        await until(lambda: bool(world.seen_started))
    async with running(FileLog(tmp_path), openai, config(turn)):
        [outcome] = await outcomes(world.log, 1)
    assert outcome.type == "TurnFailed" and "reconciler could not tell" in outcome.error
    assert [(o.tool, o.status) for o in outcome.operations] == [("transfer", "unknown")]
    assert world.reconciled == ["call_1"] and len(server.requests) == 1


async def test_a_stopping_worker_lets_the_turn_in_flight_finish_before_it_returns(server, openai, world):
    world.block = asyncio.Event()
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]), Reply(text="Sent."))
    worker = Worker(world.log, openai, dataclasses.replace(config(settings(world)), drain_grace_s=10.0))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await say(world.log, "pay bob", "m1")
    await until(lambda: bool(of_type(events_of(world.log, "c1"), "ToolCallStarted")))
    stop.set()  # SIGTERM while the transfer is under way
    await until(lambda: worker.draining)
    world.block.set()
    await asyncio.wait_for(task, 10)
    assert [t.amount for t in world.transfers] == [5]
    assert [e.type for e in outcomes_of(world.log)] == ["TurnCompleted"]
    assert len(of_type(events_of(world.log, "c1"), "ToolCallFinished")) == 1


async def test_a_drain_that_outlasts_its_grace_leaves_the_turn_to_the_next_owner(server, openai, world, tmp_path):
    world.block = asyncio.Event()  # never set: the transfer outlives the grace
    server.push(Reply(tool_calls=[("call_1", "transfer", '{"to": "bob", "amount": 5}')]))
    worker = Worker(world.log, openai, dataclasses.replace(config(settings(world)), drain_grace_s=0.2))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await say(world.log, "pay bob", "m1")
    await until(lambda: bool(of_type(events_of(world.log, "c1"), "ToolCallStarted")))
    stop.set()
    await asyncio.wait_for(task, 10)
    assert world.transfers == [] and outcomes_of(world.log) == []  # cancelled, nothing claimed done


# -- 6. fallback (rule 10) ------------------------------------------------------------------------


async def test_fallback_within_the_family_gets_the_exact_same_transcript(server, openai, backup, world):
    server.push(
        Reply(tool_calls=[("call_1", "search", '{"q": "dates"}')]),
        Raw(503, b"overloaded"),
        Reply(text="Done by the backup.", usage=(10, 2)),
    )
    async with running(world.log, openai, config(settings(world, fallbacks=[backup]))):
        await say(world.log, "check the dates", "m1")
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    [engaged] = of_type(events, "FallbackEngaged")
    assert (engaged.from_model, engaged.to_model) == ("gpt-test", "gpt-backup")
    failed_request, backup_request = server.requests[1].body, server.requests[2].body
    assert (failed_request["model"], backup_request["model"]) == ("gpt-test", "gpt-backup")
    assert backup_request["messages"] == failed_request["messages"]  # tool results included
    assert tool_messages(backup_request) == [
        {"role": "tool", "tool_call_id": "call_1", "content": "3 results for dates"}
    ]
    assert of_type(events, "AttemptFailed") == [] and len(of_type(events, "AttemptStarted")) == 1
    assert outcome.type == "TurnCompleted"
    assert (outcome.metrics.model, outcome.metrics.fallbacks) == ("gpt-backup", 1)


async def test_fallback_never_hands_a_transcript_to_another_protocol_family(server, openai, world):
    server.push(
        Reply(tool_calls=[("call_1", "search", '{"q": "dates"}')]),
        Raw(500, b"boom"),
        Reply(text="Answered on the retry."),  # attempt 2, the primary again, from the start
    )
    claude = HttpProvider(AnthropicMessages(), server.base_url_anthropic, KEY, timeout_s=5.0, retry=ATTEMPTS_ONLY)
    try:
        turn = settings(world, fallbacks=[Route("claude-test", claude)])
        async with running(world.log, openai, config(turn)):
            await say(world.log, "check the dates", "m1")
            [outcome] = await outcomes(world.log, 1)
    finally:
        await claude.aclose()
    events = events_of(world.log, "c1")
    assert of_type(events, "FallbackEngaged") == []
    assert all(r.path == "/v1/chat/completions" for r in server.requests)
    [attempt_failed] = of_type(events, "AttemptFailed")
    assert "refused" in attempt_failed.reason and "anthropic" in attempt_failed.reason and attempt_failed.retryable
    assert outcome.type == "TurnCompleted" and outcome.metrics.attempt == 2
    assert tool_messages(server.requests[2].body) == []  # a new attempt starts from the claim


# -- 7. approval ------------------------------------------------------------------------------------


async def approval_paused_turn(server, openai, world, log):
    server.push(Reply(text="I will pay bob.", tool_calls=[("call_9", "transfer", '{"to": "bob", "amount": 5}')]))
    await say(log, "pay bob 5", "m1")
    [paused] = await outcomes(log, 1)
    return paused


@pytest.mark.parametrize("approved", [True, False], ids=["approved", "denied"])
async def test_a_tool_needing_approval_pauses_and_the_decision_starts_a_turn_that_sees_the_call(
    server, openai, world, approved
):
    log = world.log
    async with running(log, openai, config(settings(world, approval=True))):
        paused = await approval_paused_turn(server, openai, world, log)
        assert paused.type == "TurnPaused" and paused.reason == "approval"
        assert paused.pending_call is not None and paused.pending_call.call_id == "call_9"
        assert "transfer" in paused.kept and '{"to": "bob", "amount": 5}' in paused.kept
        assert of_type(events_of(log, "c1"), "ToolCallStarted") == [] and world.transfers == []

        server.push(
            Reply(tool_calls=[("call_10", "transfer", '{"amount": 5, "to": "bob"}')]),
            Reply(text="Paid." if approved else "Not paid."),
        )
        decision = Approval(turn_id=paused.turn_id, call_id="call_9", approved=approved)
        await inject(
            log,
            InputInjected(
                event_id="e-a",
                conversation_id="c1",
                occurred_at=NOW(),
                occurrence_key=f"approval:{paused.turn_id}",
                source="approval",
                content="Approved." if approved else "Denied.",
                approval=decision,
            ),
        )
        _, outcome = await outcomes(log, 2)
    # The next turn's request carries the paused call's record in its history.
    history = server.requests[1].body["messages"]
    assert any("Waiting for approval to call transfer" in (m["content"] or "") for m in history)
    assert outcome.type == "TurnCompleted" and outcome.turn_id != paused.turn_id
    if approved:
        assert [(t.to, t.amount) for t in world.transfers] == [("bob", 5)]
        assert [(o.tool, o.status) for o in outcome.operations] == [("transfer", "succeeded")]
    else:
        assert world.transfers == [] and outcome.operations == ()
        assert "denied" in tool_messages(server.requests[2].body)[0]["content"]


async def test_an_approval_covers_only_the_call_it_names(server, openai, world):
    log = world.log
    async with running(log, openai, config(settings(world, approval=True))):
        paused = await approval_paused_turn(server, openai, world, log)
        server.push(Reply(tool_calls=[("call_10", "transfer", '{"to": "bob", "amount": 500}')]))
        decision = Approval(turn_id=paused.turn_id, call_id="call_9", approved=True)
        await inject(
            log,
            InputInjected(
                event_id="e-a",
                conversation_id="c1",
                occurred_at=NOW(),
                occurrence_key="approval-1",
                source="approval",
                content="Approved.",
                approval=decision,
            ),
        )
        _, outcome = await outcomes(log, 2)
    assert outcome.type == "TurnPaused" and outcome.reason == "approval"
    assert world.transfers == []


# -- both wire formats ---------------------------------------------------------------------------


async def test_the_loop_speaks_anthropic_messages_too(server, world):
    server.push(
        Reply(tool_calls=[("toolu_1", "search", '{"q": "dates"}')], usage=(30, 5)),
        Reply(text="Dates checked.", usage=(40, 6)),
    )
    claude = HttpProvider(AnthropicMessages(), server.base_url_anthropic, KEY, timeout_s=5.0, retry=ATTEMPTS_ONLY)
    try:
        async with running(world.log, claude, config(settings(world, model="claude-test"))):
            await say(world.log, "check the dates", "m1")
            [outcome] = await outcomes(world.log, 1)
    finally:
        await claude.aclose()
    assert outcome.type == "TurnCompleted" and outcome.reply == "Dates checked."
    second = server.requests[1].body
    assert second["tools"][0]["input_schema"]["properties"]["q"]["type"] == "string"
    result = second["messages"][-1]["content"][0]
    assert result == {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 results for dates"}
    assert outcome.metrics.cost_usd == pytest.approx((70 + 11 * 2) / 1e6)


async def test_an_approval_lets_one_call_run_not_a_series(server, openai, world):
    log = world.log
    async with running(log, openai, config(settings(world, approval=True))):
        paused = await approval_paused_turn(server, openai, world, log)
        server.push(
            Reply(tool_calls=[("call_10", "transfer", '{"to": "bob", "amount": 5}')]),
            Reply(tool_calls=[("call_11", "transfer", '{"to": "bob", "amount": 5}')]),
        )
        decision = Approval(turn_id=paused.turn_id, call_id="call_9", approved=True)
        await inject(
            log,
            InputInjected(
                event_id="e-a",
                conversation_id="c1",
                occurred_at=NOW(),
                occurrence_key="approval-1",
                source="approval",
                content="Approved.",
                approval=decision,
            ),
        )
        _, outcome = await outcomes(log, 2)
    assert outcome.type == "TurnPaused" and outcome.reason == "approval"
    assert outcome.pending_call.call_id == "call_11"
    assert len(world.transfers) == 1


async def test_a_malformed_response_moves_to_the_fallback_model(server, openai, backup, world):
    server.push(Raw(200, b"{not json"), Reply(text="The backup answered."))
    async with running(world.log, openai, config(settings(world, fallbacks=[backup]))):
        await say(world.log, "hi", "m1")
        [outcome] = await outcomes(world.log, 1)
    events = events_of(world.log, "c1")
    assert [e.type for e in events[3:]] == ["ProtocolFailure", "FallbackEngaged", "ModelResponded", "TurnCompleted"]
    assert outcome.type == "TurnCompleted" and outcome.metrics.fallbacks == 1


UNUSABLE_BUT_BILLED = {"id": "x", "choices": [], "usage": {"prompt_tokens": 400_000, "completion_tokens": 1_000}}


async def test_a_malformed_reply_the_provider_billed_counts_in_the_turns_usage_and_cost(
    server, openai, backup, world
):
    server.push(Raw(200, UNUSABLE_BUT_BILLED), Reply(text="The backup answered.", usage=(10, 2)))
    async with running(world.log, openai, config(settings(world, fallbacks=[backup]))):
        await say(world.log, "hi", "m1")
        [outcome] = await outcomes(world.log, 1)
    [failure] = of_type(events_of(world.log, "c1"), "ProtocolFailure")
    assert failure.usage == Usage(input_tokens=400_000, output_tokens=1_000)
    assert failure.cost_usd == pytest.approx(0.4 + 0.002)
    assert outcome.type == "TurnCompleted"
    assert (outcome.metrics.input_tokens, outcome.metrics.output_tokens) == (400_010, 1_002)
    assert outcome.metrics.cost_usd == pytest.approx(0.402 + 0.000_014)


async def test_a_malformed_reply_that_spent_the_cost_budget_pauses_the_turn_before_the_next_request(
    server, openai, backup, world
):
    server.push(Raw(200, UNUSABLE_BUT_BILLED))  # $0.402 of the turn's $0.40
    turn = settings(world, fallbacks=[backup], budget=TurnBudget(max_cost_usd=0.4))
    async with running(world.log, openai, config(turn)):
        await say(world.log, "hi", "m1")
        [outcome] = await outcomes(world.log, 1)
    assert outcome.type == "TurnPaused" and outcome.reason == "cost"
    assert outcome.metrics.cost_usd == pytest.approx(0.402)
    assert len(server.requests) == 1  # the backup was not asked: the budget was spent


async def test_a_huge_tool_result_is_truncated_to_fit_the_log(server, openai, tmp_path):
    async def dump(args: Query) -> str:
        return "y" * 300_000

    server.push(Reply(tool_calls=[("call_1", "dump", '{"q": "all"}')]), Reply(text="ok"))
    log = FileLog(tmp_path)
    turn = settings(World(), tools=ToolRegistry([Tool("dump", "Dump everything.", Query, dump)]))
    async with running(log, openai, config(turn)):
        await say(log, "dump", "m1")
        [outcome] = await outcomes(log, 1)
    [finished] = of_type(events_of(log, "c1"), "ToolCallFinished")
    assert len(finished.result) < 101_000 and "truncated" in finished.result
    assert outcome.type == "TurnCompleted"

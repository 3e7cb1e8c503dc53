"""Replay: what the runner believed at every step is exactly what the log says.

The turn's state machine folds each event it decides to write into its own state before
the executor appends it; once a step's events are on the log, folding the log from the
start, by any reader, must reach the same state, after every step and at the end."""

from __future__ import annotations

import copy

from loop_harness import ATTEMPTS_ONLY, NOW, World, config, outcomes, say, settings
from provider_server import ProviderServer, Raw, Reply
from worker_harness import events_of, running, until

from turnstile.events import Event, encode
from turnstile.handlers.claim import ClaimPlan, DebouncePolicy, plan_claim
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.streams.file_log import FileLog
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.runtime import RandomIds, SystemClock
from turnstile.streams.turn_runner import TurnRunner

SCRIPT = (
    Reply(
        text="Let me look.",
        tool_calls=[("call_1", "search", '{"q": "dates"}'), ("call_2", "nope", "{}")],
        usage=(100, 10),
    ),
    Raw(500, b"boom"),  # attempt 1 fails before any side effect: attempt 2
    Reply(tool_calls=[("call_3", "transfer", '{"to": "bob", "amount": 5}')], usage=(120, 12)),
    Reply(text="Paid bob.", usage=(140, 14)),
)


def fold(events: list[Event], conversation: str = "c1") -> ConversationState:
    state = new_state(conversation)
    for event in events:
        apply_event(state, event)
    return state


async def test_the_state_folded_from_the_log_equals_the_runners_state_after_every_step(tmp_path):
    log, world = FileLog(tmp_path), World()
    await publish(log, message_event("c1", "check the dates and pay bob", NOW(), "m1"))
    state = fold(events_of(log))
    plan = plan_claim(state, NOW() + 60_000, DebouncePolicy())
    assert isinstance(plan, ClaimPlan)

    # (events on the log, the runner's state) once each step's appends are done.
    snapshots: list[tuple[int, ConversationState]] = []
    runner: TurnRunner

    async def append(event: Event, wait: bool = True, value: bytes | None = None) -> None:
        await log.append(log.topics.events, event.conversation_id, encode(event))

    def step(_seen: object, _commands: object) -> None:
        snapshots.append((len(events_of(log, "c1")), copy.deepcopy(runner.state)))

    with ProviderServer() as server:
        server.push(*SCRIPT)
        provider = HttpProvider(OpenAIChat(), server.base_url_openai, "test-key", timeout_s=5.0, retry=ATTEMPTS_ONLY)
        clock, ids = SystemClock().now_ms, RandomIds().new
        runner = TurnRunner(state, append, provider, settings(world), clock, ids, on_step=step)
        await runner.claim_and_run(plan)
        await provider.aclose()

    events = events_of(log, "c1")
    assert events[-1].type == "TurnCompleted" and events[-1].metrics.attempt == 2
    assert len(events) >= 11 and len(snapshots) >= 6
    for count, snapshot in snapshots:
        assert fold(events[:count]) == snapshot, f"diverged after {events[count - 1].type}"
    assert fold(events) == runner.state
    assert runner.state.active is None and runner.state.turns[plan.turn_id].outcome == "completed"


async def test_the_worker_state_equals_a_fresh_fold_of_the_log_after_turns_of_every_kind(tmp_path):
    world = World(log=FileLog(tmp_path))
    with ProviderServer() as server:
        server.push(
            Reply(tool_calls=[("call_1", "search", '{"q": "x"}')]),
            Reply(text="done"),
            Raw(400, b"no"),
        )
        provider = HttpProvider(OpenAIChat(), server.base_url_openai, "test-key", timeout_s=5.0, retry=ATTEMPTS_ONLY)
        async with running(world.log, provider, config(settings(world))) as worker:
            await say(world.log, "one", "m1")
            await outcomes(world.log, 1)
            await say(world.log, "two", "m2")
            await outcomes(world.log, 2)
            # The consumer has folded the runner's events back in.
            await until(lambda: worker.states["c1"].events_applied == len(events_of(world.log, "c1")))
            held = copy.deepcopy(worker.states["c1"])
        await provider.aclose()
    assert fold(events_of(world.log, "c1")) == held
    assert [t.outcome for t in held.turns.values()] == ["completed", "failed"]

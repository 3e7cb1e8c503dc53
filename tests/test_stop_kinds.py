"""Why a reply ended decides how the turn ends: every stop kind of both families, through
the real worker on the embedded log, answered from the SDK-shaped fixtures by a mock API
that refuses (400) any request the real API would refuse."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from loop_harness import World, config, of_type, outcomes, say, settings
from wire_harness import API_KEY, MockApi, anthropic_api, fixture, openai_api, reply
from worker_harness import events_of, running

from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.context import WITHHELD_INPUT
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.providers.anthropic_messages import AnthropicMessages
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.streams.file_log import FileLog
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.views import build_view, state_json

MODELS = {"openai": "gpt-test", "anthropic": "claude-test"}


@pytest.fixture
def world(tmp_path) -> World:
    return World(log=FileLog(tmp_path))


class Api:
    """A family's mock API and a provider on it whose retries never wait."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.mock: MockApi = openai_api() if family == "openai" else anthropic_api()
        self.waits: list[float] = []

    async def _no_wait(self, seconds: float) -> None:
        self.waits.append(seconds)

    def provider(self, client: httpx.AsyncClient) -> HttpProvider:
        wire = OpenAIChat() if self.family == "openai" else AnthropicMessages()
        return HttpProvider(
            wire, "https://api.test/v1", API_KEY, client=client, sleep=self._no_wait, jitter=lambda: 0.0
        )

    def text(self, words: str) -> httpx.Response:
        """A plain completed reply saying `words`."""
        body = copy.deepcopy(fixture(self.family, "text"))
        if self.family == "openai":
            body["choices"][0]["message"]["content"] = words
        else:
            body["content"][0]["text"] = words
        return reply(body)


@pytest.fixture(params=["openai", "anthropic"])
async def api(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Api, HttpProvider]]:
    family = Api(request.param)
    async with family.mock.client() as client:
        yield family, family.provider(client)


async def one_turn(world: World, provider: HttpProvider, model: str, **overrides: Any) -> tuple[Any, list[Any]]:
    async with running(world.log, provider, config(settings(world, model=model, **overrides))):
        await say(world.log, "compare the fares", "m1")
        [outcome] = await outcomes(world.log, 1)
    return outcome, events_of(world.log, "c1")


def finish_reason(body: dict[str, Any]) -> str:
    return body["choices"][0]["finish_reason"] if "choices" in body else body["stop_reason"]


# (reason, TurnFailed.text, what the error says after "The model declined to answer")
REFUSALS = {
    ("openai", "refusal"): ("refusal", "I'm sorry, I can't help with that.", ": I'm sorry, I can't help with that."),
    ("openai", "content_filter"): ("content_filter", "Here is how", None),
    # Anthropic's text before a refusal is the answer begun, "not a refusal message".
    ("anthropic", "refusal"): ("refusal", "I can't help with that.", "."),
    ("anthropic", "refusal_explained"): ("refusal", "This could enable malware.", ": This could enable malware."),
    ("anthropic", "refusal_partial"): ("refusal", "Sure, here is how to", ": This could enable malware."),
}


@pytest.mark.parametrize(("family", "name"), list(REFUSALS))
async def test_a_refusal_or_content_filter_fails_visibly_keeping_the_providers_text(world, family, name):
    probe = Api(family)
    probe.mock.push(reply(fixture(family, name)))
    async with probe.mock.client() as client:
        outcome, events = await one_turn(world, probe.provider(client), MODELS[family])

    reason, text, declined = REFUSALS[family, name]
    assert outcome.type == "TurnFailed"
    assert (outcome.reason, outcome.text) == (reason, text)
    if declined is None:
        assert "content filter" in outcome.error
    else:
        assert outcome.error == f"The model declined to answer{declined}"
    assert outcome.statuses == {"m1": "failed"}
    [responded] = of_type(events, "ModelResponded")
    assert responded.finish_reason == finish_reason(fixture(family, name))


TRUNCATIONS = [
    ("openai", "length", "The fares on the 9th are: 1) 212 EUR, 2) 2"),
    ("anthropic", "max_tokens", "The fares on the 9th are: 1) 212 EUR, 2) 2"),
    ("anthropic", "context_window", "In summary, the"),
]


@pytest.mark.parametrize(("family", "name", "partial"), TRUNCATIONS)
async def test_a_reply_cut_off_by_its_output_allowance_is_exhausted_never_completed(world, family, name, partial):
    probe = Api(family)
    probe.mock.push(reply(fixture(family, name)))
    async with probe.mock.client() as client:
        outcome, _ = await one_turn(world, probe.provider(client), MODELS[family])

    assert outcome.type == "TurnExhausted"
    assert (outcome.allowance, outcome.last_text, outcome.statuses) == ("output_tokens", partial, {"m1": "exhausted"})


async def test_a_reply_cut_off_inside_a_tool_call_ends_exhausted_and_the_call_never_runs(world):
    # Asking again under the same allowance would be cut off again (and the model, told only
    # that the arguments are not JSON, repeats the call until the repeat policy blames it).
    probe = Api("openai")
    probe.mock.push(reply(fixture("openai", "cut_tool_arguments")))
    async with probe.mock.client() as client:
        outcome, events = await one_turn(world, probe.provider(client), "gpt-test")

    assert (outcome.type, outcome.allowance) == ("TurnExhausted", "output_tokens")
    assert outcome.statuses == {"m1": "exhausted"}
    assert world.searches == [] and of_type(events, "ProtocolFailure") == [] and len(probe.mock.bodies) == 1
    [responded] = of_type(events, "ModelResponded")  # what the model said, cut call and its cost included
    assert responded.tool_calls[0].arguments == '{"q": "fa' and responded.usage.output_tokens == 16


async def test_pause_turn_continues_with_the_paused_reply_sent_back(world):
    probe = Api("anthropic")
    paused = fixture("anthropic", "pause_turn")
    probe.mock.push(reply(paused), probe.text("The 9th is cheaper."))
    async with probe.mock.client() as client:
        outcome, events = await one_turn(world, probe.provider(client), "claude-test")

    assert outcome.type == "TurnCompleted"
    assert outcome.reply == "Searching the web. The 9th is cheaper."
    assert [e.finish_reason for e in of_type(events, "ModelResponded")] == ["pause_turn", "end_turn"]
    # The second request ends with the paused reply exactly as it came (server tool use
    # included), as the final assistant message the API continues from.
    assert probe.mock.bodies[1]["messages"][-1] == {"role": "assistant", "content": paused["content"]}


async def test_pause_turn_continuations_are_bounded_by_the_iteration_allowance(world):
    from turnstile.handlers.budget import TurnBudget

    probe = Api("anthropic")
    probe.mock.push(*[reply(fixture("anthropic", "pause_turn")) for _ in range(3)])
    async with probe.mock.client() as client:
        outcome, _ = await one_turn(world, probe.provider(client), "claude-test", budget=TurnBudget(max_iterations=3))

    assert outcome.type == "TurnExhausted" and outcome.allowance == "iterations"
    assert len(probe.mock.bodies) == 3


@pytest.mark.parametrize(
    ("family", "name"),
    [("anthropic", "empty_end_turn"), ("anthropic", "refusal"), ("openai", "refusal"), ("openai", "content_filter")],
)
async def test_a_conversation_with_an_empty_or_refused_reply_keeps_working_for_three_more_turns(world, family, name):
    probe = Api(family)
    probe.mock.push(reply(fixture(family, name)), *[probe.text(f"answer {n}") for n in (2, 3, 4)])
    async with (
        probe.mock.client() as client,
        running(world.log, probe.provider(client), config(settings(world, model=MODELS[family]))),
    ):
        for n in (1, 2, 3, 4):
            await say(world.log, f"question {n}", f"m{n}")
            found = await outcomes(world.log, n)

    first = "TurnCompleted" if name == "empty_end_turn" else "TurnFailed"
    assert [o.type for o in found] == [first] + ["TurnCompleted"] * 3
    assert [o.reply for o in found[1:]] == ["answer 2", "answer 3", "answer 4"]
    # Every request was one the real API accepts (the mock answers 400 otherwise), and the
    # last one still carries the whole conversation, the first reply included.
    assert len(probe.mock.bodies) == 4
    assert [m["role"] for m in probe.mock.bodies[-1]["messages"] if m["role"] != "system"] == [
        "user",
        "assistant",
    ] * 3 + ["user"]


REFUSED = [("anthropic", "refusal"), ("anthropic", "refusal_partial"), ("openai", "refusal")]


@pytest.mark.parametrize(("family", "name"), REFUSED)
async def test_a_refused_input_is_not_sent_again_but_stays_in_the_conversations_history(world, family, name):
    # Anthropic: "Attempting to continue without resetting will result in continued refusals."
    probe = Api(family)
    probe.mock.push(reply(fixture(family, name)), probe.text("Paris is sunny."))
    async with (
        probe.mock.client() as client,
        running(world.log, probe.provider(client), config(settings(world, model=MODELS[family]))),
    ):
        await say(world.log, "the words the model refused", "m1")
        await outcomes(world.log, 1)
        await say(world.log, "What about Paris?", "m2")
        found = await outcomes(world.log, 2)

    assert [o.type for o in found] == ["TurnFailed", "TurnCompleted"]
    later = json.dumps(probe.mock.bodies[1])
    assert "the words the model refused" not in later and WITHHELD_INPUT in later
    assert "What about Paris?" in later and found[0].error in later  # the model still reads how it ended
    # and the conversation as readers see it still holds the refused words, marked
    history = state_json(build_view("c1", world.log.conversation_records("c1")))["history"]
    assert [(h["content"], h["withheld"]) for h in history if h["role"] == "user"] == [
        ("the words the model refused", True), ("What about Paris?", False)
    ]


async def test_tool_errors_are_flagged_and_thinking_carries_across_the_tool_round(world):
    probe = Api("anthropic")
    thinking = copy.deepcopy(fixture("anthropic", "thinking_tool_use"))
    thinking["content"][3]["input"] = {"query": "not an argument of search"}
    probe.mock.push(reply(thinking), probe.text("The 9th is cheaper."))
    async with probe.mock.client() as client:
        outcome, _ = await one_turn(world, probe.provider(client), "claude-test")

    assert outcome.type == "TurnCompleted"
    second = probe.mock.bodies[1]["messages"]
    assert second[-2] == {"role": "assistant", "content": thinking["content"]}  # signature and all
    ok, bad = second[-1]["content"]
    assert ok == {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "3 results for fares 9th"}
    assert bad["tool_use_id"] == "toolu_01B" and bad["is_error"] is True and bad["content"].startswith("error: ")


async def test_cache_heavy_usage_is_recorded_and_priced_per_component(world):
    probe = Api("anthropic")
    probe.mock.push(reply(fixture("anthropic", "cache_usage")))
    price = ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.30, cache_write_per_mtok=3.75)
    async with probe.mock.client() as client:
        outcome, events = await one_turn(world, probe.provider(client), "claude-test", prices={"claude-test": price})

    [responded] = of_type(events, "ModelResponded")
    assert (responded.usage.input_tokens, responded.usage.cached_input_tokens, responded.usage.cache_write_tokens) == (
        12_050,
        10_000,
        2000,
    )
    assert responded.cost_usd == pytest.approx(0.01365)
    m = outcome.metrics
    assert (m.input_tokens, m.cached_input_tokens, m.cache_write_tokens, m.output_tokens) == (12_050, 10_000, 2000, 200)
    assert m.cost_usd == pytest.approx(0.01365)


async def test_a_provider_error_after_a_side_effect_is_retried_by_the_transport_not_failed(world):
    """The same request again is safe after a side effect (it repeats no tool); a new
    attempt of the turn would not be. So a passing 503 no longer fails such a turn."""
    probe = Api("openai")
    transfer = copy.deepcopy(fixture("openai", "parallel_tool_calls"))
    transfer["choices"][0]["message"]["tool_calls"] = [
        {
            "id": "call_t",
            "type": "function",
            "function": {"name": "transfer", "arguments": '{"to": "bob", "amount": 5}'},
        }
    ]
    busy = httpx.Response(503, json={"error": {"message": "busy"}}, headers={"retry-after-ms": "200"})
    probe.mock.push(reply(transfer), busy, probe.text("Paid."))
    async with probe.mock.client() as client:
        outcome, events = await one_turn(world, probe.provider(client), "gpt-test")

    assert outcome.type == "TurnCompleted" and outcome.reply == "Paid."
    assert (len(world.transfers), probe.waits, of_type(events, "AttemptFailed")) == (1, [0.2], [])


async def test_a_rate_limit_longer_than_the_turn_may_wait_fails_in_one_sentence(world):
    probe = Api("anthropic")
    probe.mock.push(
        httpx.Response(
            429,
            json={"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}},
            headers={"retry-after": "3600"},
        )
    )
    async with probe.mock.client() as client:
        outcome, events = await one_turn(world, probe.provider(client), "claude-test")

    assert outcome.type == "TurnFailed"
    assert outcome.error == (
        "The model provider is rate limiting requests and asked to wait 3600 s, longer than this turn may wait."
    )
    assert [f.retryable for f in of_type(events, "AttemptFailed")] == [False]
    assert probe.waits == []


async def test_a_rate_limit_asking_up_to_two_minutes_is_waited_for_as_openai_python_does(world):
    # openai-python's MAX_RETRY_AFTER_DELAY is 120 s (anthropic-sdk-python waits any): a
    # 90 s wait failed the turn when the bound was 60 s.
    probe = Api("openai")
    slow_down = httpx.Response(429, json={"error": {"message": "slow down"}}, headers={"retry-after": "90"})
    probe.mock.push(slow_down, probe.text("Done."))
    async with probe.mock.client() as client:
        outcome, _ = await one_turn(world, probe.provider(client), "gpt-test", budget=TurnBudget(deadline_ms=300_000))

    assert (outcome.type, probe.waits) == ("TurnCompleted", [90.0])

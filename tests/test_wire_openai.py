"""The OpenAI chat completions wire format, on httpx.MockTransport: replies shaped by the
official SDK's `ChatCompletion` model (fixtures/providers/openai), request bodies checked
against the JSON Schema extracted from the official OpenAPI document."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from wire_harness import API_KEY, MockApi, billed_usage, fixture, openai_api, openai_violations, reply

from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import ChatMessage, ModelRequest, ProviderError, ToolSpec
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.providers.wire import MISSING_RESULT
from turnstile.streams.provider_http import HttpProvider

BASE_URL = "https://api.openai.test/v1"
SEARCH = ToolSpec(
    name="search",
    description="Search the notes.",
    parameters={"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
)
HELLO = ModelRequest(model="gpt-4.1", messages=(ChatMessage("user", "Hello"),), max_output_tokens=64)


@pytest.fixture
def api() -> MockApi:
    return openai_api()


@pytest.fixture
async def provider(api: MockApi) -> AsyncIterator[HttpProvider]:
    async with api.client() as client:
        yield HttpProvider(OpenAIChat(), BASE_URL, API_KEY, client=client)


@pytest.mark.parametrize(
    ("name", "text", "stop", "calls", "usage"),
    [
        ("text", "The 9th is cheaper.", "end", (), Usage(input_tokens=52, output_tokens=7)),
        (
            "parallel_tool_calls",
            None,
            "tool_use",
            (("call_a1", "search", '{"q": "fares 9th"}'), ("call_b2", "search", '{"q": "fares 10th"}')),
            Usage(input_tokens=120, output_tokens=40),
        ),
        # content null, the refusal in its own field: the refusal text is the reply's text.
        ("refusal", "I'm sorry, I can't help with that.", "refusal", (), Usage(input_tokens=30, output_tokens=9)),
        ("content_filter", "Here is how", "content_filter", (), Usage(input_tokens=30, output_tokens=3)),
        (
            "length",
            "The fares on the 9th are: 1) 212 EUR, 2) 2",
            "truncated",
            (),
            Usage(input_tokens=40, output_tokens=16),
        ),
        # Cut off inside the arguments: the call is kept as said; the loop's validation answers it.
        (
            "cut_tool_arguments",
            None,
            "truncated",
            (("call_c3", "search", '{"q": "fa'),),
            Usage(input_tokens=40, output_tokens=16),
        ),
        (
            "cached_reasoning",
            "Take the 9th.",
            "end",
            (),
            Usage(input_tokens=2000, output_tokens=300, cached_input_tokens=1536, reasoning_tokens=192),
        ),
    ],
)
async def test_each_sdk_shaped_reply_parses_to_its_text_calls_usage_and_stop_kind(
    api: MockApi, provider: HttpProvider, name: str, text: str | None, stop: str, calls: tuple, usage: Usage
) -> None:
    body = fixture("openai", name)
    api.push(reply(body))

    parsed = await provider.complete(HELLO)

    assert (parsed.text, parsed.stop, parsed.usage) == (text, stop, usage)
    assert parsed.tool_calls == tuple(ToolCall(call_id=i, name=n, arguments=a) for i, n, a in calls)
    assert parsed.finish_reason == body["choices"][0]["finish_reason"]
    assert parsed.model == body["model"]


def test_a_prompt_written_to_the_cache_costs_the_input_price_openai_bills_it_at() -> None:
    from turnstile.handlers.pricing import ModelPrice, cost_usd
    from turnstile.streams.config_file import shipped_prices

    usage = OpenAIChat().parse_reply(fixture("openai", "cache_write"), "gpt-5.4").usage

    assert usage == Usage(input_tokens=100_000, output_tokens=1000)
    # 100,000 x $2.50 + 1,000 x $15.00 per million tokens: the write is no discount.
    assert cost_usd(shipped_prices().prices, "gpt-5.4", usage) == pytest.approx(0.265)
    # A price given without cache prices knows the cost all the same (no write price needed).
    assert cost_usd({"gpt-5.4": ModelPrice(2.5, 15.0)}, "gpt-5.4", usage) == pytest.approx(0.265)


async def test_the_request_is_current_with_the_openapi_document(api: MockApi, provider: HttpProvider) -> None:
    api.push(reply(fixture("openai", "text")))

    await provider.complete(HELLO)

    [body] = api.bodies
    assert body == {"model": "gpt-4.1", "messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 64}
    assert api.headers[0]["authorization"] == f"Bearer {API_KEY}"
    assert api.headers[0]["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("legacy", "model", "field"),
    [
        (frozenset({"llama-3"}), "llama-3", "max_tokens"),
        (frozenset({"llama-3"}), "gpt-4.1", "max_completion_tokens"),
        (frozenset({"*"}), "anything", "max_tokens"),
    ],
)
def test_servers_that_only_know_max_tokens_get_it_per_model(legacy: frozenset[str], model: str, field: str) -> None:
    body = OpenAIChat(legacy_max_tokens=legacy).request_body(ModelRequest(model, HELLO.messages, max_output_tokens=9))

    assert {k: v for k, v in body.items() if k.startswith("max")} == {field: 9}


def test_the_schema_check_would_catch_the_deprecated_and_the_malformed() -> None:
    """The check the other tests rely on is not vacuous."""
    good = OpenAIChat().request_body(HELLO)
    assert openai_violations(good) == []
    assert openai_violations({**good, "max_tokens": 9}) == ["max_tokens: deprecated in the OpenAPI document"]
    assert openai_violations({**good, "max_output_tokens": 9}) == [
        "max_output_tokens: not a CreateChatCompletionRequest field"
    ]
    broken = {**good, "messages": [{"role": "tool", "content": "x"}]}
    assert openai_violations(broken) != []


def test_a_tool_round_trip_is_a_valid_request_with_results_next_to_their_calls() -> None:
    calls = (
        ToolCall(call_id="call_1", name="search", arguments='{"q": "x"}'),
        ToolCall(call_id="call_2", name="search", arguments='{"q": "y"}'),
    )
    request = ModelRequest(
        model="gpt-4.1",
        messages=(
            ChatMessage("system", "Be terse."),
            ChatMessage("user", "Find x and y."),
            ChatMessage("assistant", "", tool_calls=calls),
            # Results out of order, one missing, one answering nothing, one stray elsewhere.
            ChatMessage("tool", "y is 2", tool_call_id="call_2"),
            ChatMessage("tool", "z is 3", tool_call_id="call_9"),
            ChatMessage("user", "Thanks."),
            ChatMessage("tool", "stray", tool_call_id="call_1"),
        ),
        tools=(SEARCH,),
        max_output_tokens=128,
    )

    body = OpenAIChat().request_body(request)

    assert openai_violations(body) == []
    assert body["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Find x and y."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"q": "y"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": MISSING_RESULT},
        {"role": "tool", "tool_call_id": "call_2", "content": "y is 2"},
        {"role": "user", "content": "Thanks."},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {"name": "search", "description": "Search the notes.", "parameters": SEARCH.parameters},
        }
    ]


@pytest.mark.parametrize(
    ("said", "sent"),
    [
        # Not JSON: OpenAI-compatible servers (vLLM, SGLang) answer 400 to it in a transcript.
        ('{"q": "x",', "{}"),
        ("", "{}"),
        ("[1]", "{}"),  # JSON, but no object: what no tool takes
        # An object goes back exactly as the model wrote it, spacing and all.
        ('{"q":  "x"}', '{"q":  "x"}'),
    ],
)
def test_arguments_go_back_as_said_unless_they_are_not_json(said: str, sent: str) -> None:
    call = ToolCall(call_id="call_1", name="search", arguments=said)
    messages = (
        ChatMessage("user", "x"),
        ChatMessage("assistant", "", (call,)),
        ChatMessage("tool", "error", tool_call_id="call_1"),
    )

    body = OpenAIChat().request_body(ModelRequest("gpt-4.1", messages))

    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == sent
    assert openai_violations(body) == []


def _completion(message: object, **usage: Any) -> dict[str, Any]:
    body = fixture("openai", "text")
    body["choices"][0]["message"] = message
    body["usage"].update(usage)
    return body


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"choices": []}, id="empty-choices"),
        pytest.param({"object": "chat.completion"}, id="no-choices"),
        pytest.param({"choices": [{"finish_reason": "stop"}]}, id="no-message"),
        pytest.param(["not", "an", "object"], id="not-an-object"),
        pytest.param(
            _completion({"content": None, "tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]}), id="no-name"
        ),
        pytest.param(
            _completion({"content": None, "tool_calls": [{"id": "c", "function": {"name": "s", "arguments": {}}}]}),
            id="args-not-str",
        ),
        pytest.param(
            _completion({"content": None, "tool_calls": [{"function": {"name": "s", "arguments": "{}"}}]}), id="no-id"
        ),
        pytest.param(_completion({"content": ["a", "list"]}), id="content-not-a-string"),
        pytest.param(_completion({"content": "x", "refusal": 7}), id="refusal-not-a-string"),
        pytest.param(_completion({"content": "x"}, prompt_tokens=-1), id="negative-tokens"),
        pytest.param(_completion({"content": "x"}, completion_tokens=10**12 + 1), id="tokens-past-a-trillion"),
        pytest.param(
            _completion({"content": "x"}, prompt_tokens_details={"cached_tokens": 10**6}), id="more-cached-than-input"
        ),
    ],
)
async def test_an_unusable_200_is_a_malformed_response(api: MockApi, provider: HttpProvider, body: Any) -> None:
    api.push(reply(body))

    with pytest.raises(ProviderError) as caught:
        await provider.complete(HELLO)

    assert (caught.value.kind, caught.value.retryable) == ("malformed_response", False)
    assert not caught.value.message.startswith("malformed_response")  # the kind is said once


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        pytest.param(_completion({"content": ["a", "list"]}), Usage(input_tokens=52, output_tokens=7), id="billed"),
        pytest.param({"choices": []}, None, id="no-usage"),
        pytest.param(_completion({"content": "x"}, prompt_tokens=-1), None, id="unreadable-usage"),
    ],
)
async def test_a_malformed_reply_carries_the_usage_it_was_billed_for_when_that_is_readable(
    api: MockApi, provider: HttpProvider, body: Any, usage: Usage | None
) -> None:
    assert await billed_usage(api, provider, HELLO, body) == usage  # counted in the turn's cost, never guessed

"""The Anthropic Messages wire format, on httpx.MockTransport: replies shaped by the
official SDK's `Message` model (fixtures/providers/anthropic), request bodies checked
against the API's documented message rules (anthropic_rules.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from anthropic_rules import violations
from wire_harness import API_KEY, MockApi, anthropic_api, billed_usage, fixture, reply

from turnstile.events import ToolCall, Usage
from turnstile.handlers.pricing import ModelPrice, cost_usd
from turnstile.handlers.provider import ChatMessage, ModelRequest, ProviderError, ToolSpec
from turnstile.handlers.providers.anthropic_messages import EMPTY_MESSAGE, EMPTY_REPLY, AnthropicMessages
from turnstile.handlers.providers.wire import MISSING_RESULT
from turnstile.streams.provider_http import HttpProvider

BASE_URL = "https://api.anthropic.test"
WIRE = AnthropicMessages()
SEARCH = ToolSpec(
    name="search",
    description="Search the notes.",
    parameters={"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
)
HELLO = ModelRequest(model="claude-sonnet-4-5", messages=(ChatMessage("user", "Hello"),), max_output_tokens=64)


@pytest.fixture
def api() -> MockApi:
    return anthropic_api()


@pytest.fixture
async def provider(api: MockApi) -> AsyncIterator[HttpProvider]:
    async with api.client() as client:
        yield HttpProvider(WIRE, BASE_URL, API_KEY, client=client)


@pytest.mark.parametrize(
    ("name", "text", "stop", "calls", "usage"),
    [
        ("text", "The 9th is cheaper.", "end", (), Usage(input_tokens=48, output_tokens=8)),
        (
            "thinking_tool_use",
            "Let me look both up.",
            "tool_use",
            (("toolu_01A", "search", '{"q":"fares 9th"}'), ("toolu_01B", "search", '{"q":"fares 10th"}')),
            Usage(input_tokens=300, output_tokens=90),
        ),
        ("refusal", "I can't help with that.", "refusal", (), Usage(input_tokens=30, output_tokens=6)),
        # No text at all; and text the classifier cut short, kept as the reply's text.
        ("refusal_explained", None, "refusal", (), Usage(input_tokens=30)),
        ("refusal_partial", "Sure, here is how to", "refusal", (), Usage(input_tokens=30, output_tokens=6)),
        (
            "max_tokens",
            "The fares on the 9th are: 1) 212 EUR, 2) 2",
            "truncated",
            (),
            Usage(input_tokens=40, output_tokens=16),
        ),
        ("context_window", "In summary, the", "truncated", (), Usage(input_tokens=199_000, output_tokens=1000)),
        ("pause_turn", "Searching the web. ", "pause", (), Usage(input_tokens=500, output_tokens=40)),
        # input_tokens on this wire excludes the cache; Usage counts the whole prompt.
        (
            "cache_usage",
            "Here is the summary.",
            "end",
            (),
            Usage(input_tokens=12_050, output_tokens=200, cached_input_tokens=10_000, cache_write_tokens=2000),
        ),
        ("empty_end_turn", None, "end", (), Usage(input_tokens=60, output_tokens=1)),
    ],
)
async def test_each_sdk_shaped_reply_parses_to_its_text_calls_usage_and_stop_kind(
    api: MockApi, provider: HttpProvider, name: str, text: str | None, stop: str, calls: tuple, usage: Usage
) -> None:
    body = fixture("anthropic", name)
    api.push(reply(body))

    parsed = await provider.complete(HELLO)

    assert (parsed.text, parsed.stop, parsed.usage) == (text, stop, usage)
    assert parsed.tool_calls == tuple(ToolCall(call_id=i, name=n, arguments=a) for i, n, a in calls)
    assert (parsed.finish_reason, parsed.model) == (body["stop_reason"], body["model"])
    assert parsed.native == tuple(body["content"])


MALWARE = "This could enable malware."


@pytest.mark.parametrize(
    ("name", "words"),
    [("refusal", None), ("refusal_explained", MALWARE), ("refusal_partial", MALWARE)],
)
def test_a_refusals_words_are_its_explanation_never_the_text_it_cut_short(name: str, words: str | None) -> None:
    assert WIRE.parse_reply(fixture("anthropic", name), "m").refusal == words


def test_the_issues_cache_heavy_reply_costs_what_the_price_table_says() -> None:
    usage = WIRE.parse_reply(fixture("anthropic", "cache_usage"), "claude-sonnet-4-5").usage
    price = ModelPrice(input_per_mtok=3.0, output_per_mtok=15.0, cached_input_per_mtok=0.30, cache_write_per_mtok=3.75)

    # 50 x $3 + 2000 x $3.75 + 10000 x $0.30 + 200 x $15, per million tokens.
    assert cost_usd({"claude-sonnet-4-5": price}, "claude-sonnet-4-5", usage) == pytest.approx(0.01365)
    # Without a cache price the cost is unknown (the budget fails closed), not under-counted.
    assert cost_usd({"claude-sonnet-4-5": ModelPrice(3.0, 15.0)}, "claude-sonnet-4-5", usage) is None


async def test_headers_and_the_minimal_body(api: MockApi, provider: HttpProvider) -> None:
    api.push(reply(fixture("anthropic", "text")))

    await provider.complete(HELLO)

    [body], [headers] = api.bodies, api.headers
    assert body == {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "user", "content": "Hello"}]}
    assert (headers["x-api-key"], headers["anthropic-version"]) == (API_KEY, "2023-06-01")
    assert "authorization" not in headers


def tool_round(native: tuple[dict[str, Any], ...] | None, *results: ChatMessage) -> ModelRequest:
    calls = (
        ToolCall(call_id="toolu_01A", name="search", arguments='{"q": "fares 9th"}'),
        ToolCall(call_id="toolu_01B", name="search", arguments='{"q": "fares 10th"}'),
    )
    return ModelRequest(
        model="claude-sonnet-4-5",
        messages=(
            ChatMessage("system", "Be terse."),
            ChatMessage("user", "Compare the 9th and the 10th."),
            ChatMessage("assistant", "Let me look both up.", calls, native=native),
            *results,
        ),
        tools=(SEARCH,),
        max_output_tokens=128,
    )


def test_thinking_blocks_go_back_verbatim_and_errors_are_flagged() -> None:
    """Extended thinking with tools: the thinking block (and its signature) must be sent
    back unchanged with the tool results; a failed call's result carries is_error."""
    native = tuple(fixture("anthropic", "thinking_tool_use")["content"])
    request = tool_round(
        native,
        ChatMessage("tool", "212 EUR", tool_call_id="toolu_01A"),
        ChatMessage("tool", "error: the search timed out", tool_call_id="toolu_01B", is_error=True),
    )

    body = WIRE.request_body(request)

    assert violations(body) == []
    assert body["system"] == "Be terse."
    assert body["messages"][1] == {"role": "assistant", "content": list(native)}
    assert body["messages"][2] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "212 EUR"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_01B",
                "content": "error: the search timed out",
                "is_error": True,
            },
        ],
    }
    assert body["tools"] == [{"name": "search", "description": "Search the notes.", "input_schema": SEARCH.parameters}]


def test_without_native_blocks_calls_are_rebuilt_and_results_paired() -> None:
    request = tool_round(
        None,
        ChatMessage("tool", "stray", tool_call_id="toolu_99"),
        ChatMessage("tool", "212 EUR", tool_call_id="toolu_01A"),
        ChatMessage("user", "And the 11th?"),
    )

    body = WIRE.request_body(request)

    assert violations(body) == []
    assert body["messages"][1:] == [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look both up."},
                {"type": "tool_use", "id": "toolu_01A", "name": "search", "input": {"q": "fares 9th"}},
                {"type": "tool_use", "id": "toolu_01B", "name": "search", "input": {"q": "fares 10th"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "212 EUR"},
                {"type": "tool_result", "tool_use_id": "toolu_01B", "content": MISSING_RESULT, "is_error": True},
                {"type": "text", "text": "And the 11th?"},
            ],
        },
    ]


def test_malformed_arguments_in_history_become_an_empty_input() -> None:
    broken = ToolCall(call_id="call_1", name="search", arguments='{"q": "x",')
    messages = (
        ChatMessage("user", "x"),
        ChatMessage("assistant", "", (broken,)),
        ChatMessage("tool", "e", tool_call_id="call_1"),
    )

    body = WIRE.request_body(ModelRequest("claude-sonnet-4-5", messages))

    assert body["messages"][1] == {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "call_1", "name": "search", "input": {}}],
    }
    assert violations(body) == []


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        pytest.param(
            [("user", "hi"), ("assistant", ""), ("user", "still there?")],
            [("user", "hi"), ("assistant", EMPTY_REPLY), ("user", "still there?")],
            id="empty-reply-in-history",
        ),
        pytest.param(
            [("user", "hi"), ("assistant", " \n"), ("user", "")],
            [("user", "hi"), ("assistant", EMPTY_REPLY), ("user", EMPTY_MESSAGE)],
            id="whitespace-reply-and-empty-message",
        ),
        pytest.param(
            [("user", "hi"), ("assistant", "The answer is ")],
            [("user", "hi"), ("assistant", "The answer is")],
            id="final-assistant-without-trailing-whitespace",
        ),
        pytest.param([("user", "hi"), ("assistant", "")], [("user", "hi")], id="empty-final-assistant-left-out"),
    ],
)
def test_the_transcript_keeps_the_apis_rules(history: list[tuple[str, str]], expected: list[tuple[str, str]]) -> None:
    messages = tuple(ChatMessage(role, content) for role, content in history)  # type: ignore[arg-type]

    body = WIRE.request_body(ModelRequest("claude-sonnet-4-5", messages))

    assert [(m["role"], m["content"]) for m in body["messages"]] == expected
    assert violations(body) == []


def test_the_rules_check_knows_the_error_that_broke_conversations_forever() -> None:
    """The body the old code sent after one empty reply, and the real API's answer to it."""
    naive = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "?"}]

    assert violations({"model": "m", "max_tokens": 1, "messages": naive}) == [
        "messages.1: all messages must have non-empty content except for the optional final assistant message"
    ]


def _message(content: object) -> dict[str, object]:
    return {"type": "message", "role": "assistant", "content": content, "stop_reason": "end_turn"}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"type": "message", "role": "assistant", "stop_reason": "end_turn"}, id="no-content"),
        pytest.param(_message("just a string"), id="content-not-a-list"),
        pytest.param(_message([{"type": "text"}]), id="text-block-without-text"),
        pytest.param(_message([{"type": "tool_use", "id": "t1", "input": {}}]), id="tool-use-without-name"),
        pytest.param(_message([{"type": "tool_use", "name": "s", "input": {}}]), id="tool-use-without-id"),
        pytest.param(_message([{"type": "tool_use", "id": "t1", "name": "s", "input": "{}"}]), id="input-not-object"),
        pytest.param({**_message([]), "usage": {"input_tokens": "many"}}, id="tokens-not-a-number"),
        pytest.param(["not", "an", "object"], id="not-an-object"),
    ],
)
async def test_an_unusable_200_is_a_malformed_response(api: MockApi, provider: HttpProvider, body: Any) -> None:
    api.push(reply(body))

    with pytest.raises(ProviderError) as caught:
        await provider.complete(HELLO)

    assert (caught.value.kind, caught.value.retryable) == ("malformed_response", False)


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        pytest.param(
            {**_message([{"type": "text"}]), "usage": fixture("anthropic", "text")["usage"]},
            Usage(input_tokens=48, output_tokens=8),
            id="billed",
        ),
        pytest.param(_message([{"type": "text"}]), None, id="no-usage"),
        pytest.param({**_message([]), "usage": {"input_tokens": "many"}}, None, id="unreadable-usage"),
    ],
)
async def test_a_malformed_reply_carries_the_usage_it_was_billed_for_when_that_is_readable(
    api: MockApi, provider: HttpProvider, body: Any, usage: Usage | None
) -> None:
    assert await billed_usage(api, provider, HELLO, body) == usage  # counted in the turn's cost, never guessed

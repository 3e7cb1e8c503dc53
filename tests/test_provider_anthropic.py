"""AnthropicMessagesProvider against the loopback provider server: wire format and error mapping."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import pytest
from provider_server import Delay, Drop, ProviderServer, Raw, Reply, Step
from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import ChatMessage, ModelRequest, ProviderError, ToolSpec
from turnstile.handlers.providers.anthropic_messages import AnthropicMessagesProvider
from turnstile.handlers.providers.http_errors import RateLimitedError

API_KEY = "sk-ant-test-0123456789abcdef"
REQUEST = ModelRequest(model="claude-test", messages=(ChatMessage("user", "Hello"),), max_output_tokens=64)
SEARCH = ToolSpec(
    name="search",
    description="Search the notes.",
    parameters={"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
)


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running:
        yield running


@pytest.fixture
async def provider(server: ProviderServer) -> AsyncIterator[AnthropicMessagesProvider]:
    client = AnthropicMessagesProvider(server.base_url_anthropic, API_KEY, timeout_s=2.0)
    yield client
    await client.aclose()


async def failure(provider: AnthropicMessagesProvider, request: ModelRequest = REQUEST) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await provider.complete(request)
    return caught.value


async def test_text_reply_with_usage(server: ProviderServer, provider: AnthropicMessagesProvider) -> None:
    server.push(Reply(text="Hi there", usage=(12, 4), model="claude-test-20250101"))

    reply = await provider.complete(REQUEST)

    assert reply.text == "Hi there"
    assert reply.tool_calls == ()
    assert reply.usage == Usage(input_tokens=12, output_tokens=4)
    assert reply.model == "claude-test-20250101"
    assert reply.finish_reason == "end_turn"
    [sent] = server.requests
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == API_KEY
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.headers["content-type"] == "application/json"
    assert "authorization" not in sent.headers
    assert sent.body == {"model": "claude-test", "max_tokens": 64, "messages": [{"role": "user", "content": "Hello"}]}


async def test_missing_usage_is_zero_and_model_falls_back_to_requested(
    server: ProviderServer, provider: AnthropicMessagesProvider
) -> None:
    server.push(Raw(200, {"content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn"}))

    reply = await provider.complete(REQUEST)

    assert reply.text == "ok"
    assert reply.usage == Usage()
    assert reply.model == "claude-test"


async def test_tool_call_round_trip_sends_exact_wire_body(
    server: ProviderServer, provider: AnthropicMessagesProvider
) -> None:
    calls = (
        ToolCall(call_id="toolu_1", name="search", arguments='{"q": "x"}'),
        ToolCall(call_id="toolu_2", name="search", arguments='{"q": "y"}'),
    )
    request = ModelRequest(
        model="claude-test",
        messages=(
            ChatMessage("system", "Be terse."),
            ChatMessage("user", "Find x and y."),
            ChatMessage("assistant", "Searching both.", tool_calls=calls),
            ChatMessage("tool", "x is 1", tool_call_id="toolu_1"),
            ChatMessage("tool", "y is 2", tool_call_id="toolu_2"),
            ChatMessage("user", "And z?"),
        ),
        tools=(SEARCH,),
        max_output_tokens=128,
    )
    server.push(Reply(text="Let me look.", tool_calls=[("toolu_3", "search", '{"q": "z"}')], usage=(50, 7)))

    reply = await provider.complete(request)

    assert reply.text == "Let me look."
    assert reply.tool_calls == (ToolCall(call_id="toolu_3", name="search", arguments='{"q":"z"}'),)
    assert reply.finish_reason == "tool_use"
    assert server.requests[0].body == {
        "model": "claude-test",
        "max_tokens": 128,
        "system": "Be terse.",
        "messages": [
            {"role": "user", "content": "Find x and y."},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Searching both."},
                    {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "x"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "search", "input": {"q": "y"}},
                ],
            },
            # Both results and the next user message are one user turn: roles must alternate.
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x is 1"},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "y is 2"},
                    {"type": "text", "text": "And z?"},
                ],
            },
        ],
        "tools": [{"name": "search", "description": "Search the notes.", "input_schema": SEARCH.parameters}],
    }


async def test_malformed_arguments_in_history_become_an_empty_input(
    server: ProviderServer, provider: AnthropicMessagesProvider
) -> None:
    broken = ToolCall(call_id="call_1", name="search", arguments='{"q": "x",')
    request = ModelRequest(
        model="claude-test",
        messages=(
            ChatMessage("user", "Find x."),
            ChatMessage("assistant", "", tool_calls=(broken,)),
            ChatMessage("tool", "error: arguments are not valid JSON", tool_call_id="call_1"),
        ),
    )
    server.push(Reply(text="Sorry."))

    await provider.complete(request)

    assistant = server.requests[0].body["messages"][1]
    assert assistant == {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "call_1", "name": "search", "input": {}}],
    }


async def test_text_blocks_are_joined_and_other_blocks_ignored(
    server: ProviderServer, provider: AnthropicMessagesProvider
) -> None:
    content = [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "text", "text": "Hello, "},
        {"type": "text", "text": "world."},
    ]
    server.push(Raw(200, {"model": "claude-test", "content": content, "stop_reason": "end_turn"}))

    reply = await provider.complete(REQUEST)

    assert reply.text == "Hello, world."


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
        pytest.param(["not", "an", "object"], id="not-an-object"),
        pytest.param("<html>Bad gateway</html>", id="not-json"),
    ],
)
async def test_unusable_200_is_malformed_response(
    server: ProviderServer, provider: AnthropicMessagesProvider, body: dict[str, object] | list[object] | str
) -> None:
    server.push(Raw(200, body))

    error = await failure(provider)

    assert (error.kind, error.retryable) == ("malformed_response", False)


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (429, "rate_limited", True),
        (503, "server_error", True),
        (529, "server_error", True),  # Anthropic's "overloaded"
        (400, "client_error", False),
    ],
)
async def test_http_status_mapping(
    server: ProviderServer, provider: AnthropicMessagesProvider, status: int, kind: str, retryable: bool
) -> None:
    server.push(Raw(status, {"type": "error", "error": {"type": "test_error", "message": "nope"}}))

    error = await failure(provider)

    assert (error.kind, error.retryable, error.status) == (kind, retryable, status)
    assert "nope" in str(error)


async def test_rate_limit_keeps_retry_after(server: ProviderServer, provider: AnthropicMessagesProvider) -> None:
    server.push(Raw(429, b"slow down", headers={"retry-after": "1.5"}))

    error = await failure(provider)

    assert isinstance(error, RateLimitedError)
    assert error.retry_after_s == 1.5


async def test_slow_response_times_out(server: ProviderServer) -> None:
    server.push(Delay(1.0, Reply(text="too late")))
    provider = AnthropicMessagesProvider(server.base_url_anthropic, API_KEY, timeout_s=0.2)
    started = time.monotonic()

    error = await failure(provider)
    await provider.aclose()

    assert (error.kind, error.retryable) == ("timeout", True)
    assert time.monotonic() - started < 0.9


async def test_dropped_connection_is_retryable(server: ProviderServer, provider: AnthropicMessagesProvider) -> None:
    server.push(Drop())

    error = await failure(provider)

    assert (error.kind, error.retryable) == ("connection", True)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Raw(401, {"type": "error", "error": {"message": f"invalid x-api-key {API_KEY}"}}), id="401"),
        pytest.param(Raw(503, f"{API_KEY} overloaded"), id="503"),
        pytest.param(Raw(200, f"<html>{API_KEY}</html>"), id="not-json"),
        pytest.param(Drop(), id="drop"),
        pytest.param(Delay(1.0, Reply(text="late")), id="timeout"),
    ],
)
async def test_api_key_is_sent_but_never_in_errors(server: ProviderServer, step: Step) -> None:
    server.push(step)
    provider = AnthropicMessagesProvider(server.base_url_anthropic, API_KEY, timeout_s=0.2)

    error = await failure(provider)
    await provider.aclose()

    assert server.requests[0].headers["x-api-key"] == API_KEY
    assert API_KEY not in str(error)
    assert API_KEY not in repr(error.args)

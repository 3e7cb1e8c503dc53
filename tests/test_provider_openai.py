"""OpenAIChatProvider against the loopback provider server: wire format and error mapping."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from provider_server import Delay, Drop, ProviderServer, Raw, Reply, Step
from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import ChatMessage, ModelRequest, ProviderError, ToolSpec
from turnstile.handlers.providers.http_errors import EXCERPT_CHARS, RateLimitedError
from turnstile.handlers.providers.openai_chat import OpenAIChatProvider

API_KEY = "sk-test-0123456789abcdef"
REQUEST = ModelRequest(model="gpt-test", messages=(ChatMessage("user", "Hello"),), max_output_tokens=64)
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
async def provider(server: ProviderServer) -> AsyncIterator[OpenAIChatProvider]:
    client = OpenAIChatProvider(server.base_url_openai, API_KEY, timeout_s=2.0)
    yield client
    await client.aclose()


async def failure(provider: OpenAIChatProvider, request: ModelRequest = REQUEST) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await provider.complete(request)
    return caught.value


async def test_text_reply_with_usage(server: ProviderServer, provider: OpenAIChatProvider) -> None:
    server.push(Reply(text="Hi there", usage=(10, 3), model="gpt-test-2024-01-01"))

    reply = await provider.complete(REQUEST)

    assert reply.text == "Hi there"
    assert reply.tool_calls == ()
    assert reply.usage == Usage(input_tokens=10, output_tokens=3)
    assert reply.model == "gpt-test-2024-01-01"
    assert reply.finish_reason == "stop"
    [sent] = server.requests
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    assert sent.headers["content-type"] == "application/json"
    assert sent.body == {"model": "gpt-test", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}


async def test_missing_usage_is_zero_and_model_falls_back_to_requested(
    server: ProviderServer, provider: OpenAIChatProvider
) -> None:
    server.push(Raw(200, {"choices": [{"message": {"role": "assistant", "content": "ok"}}]}))

    reply = await provider.complete(REQUEST)

    assert reply.text == "ok"
    assert reply.usage == Usage()
    assert reply.model == "gpt-test"
    assert reply.finish_reason == "unknown"


async def test_tool_call_round_trip_sends_exact_wire_body(
    server: ProviderServer, provider: OpenAIChatProvider
) -> None:
    calls = (
        ToolCall(call_id="call_1", name="search", arguments='{"q": "x"}'),
        ToolCall(call_id="call_2", name="search", arguments='{"q": "y"}'),
    )
    request = ModelRequest(
        model="gpt-test",
        messages=(
            ChatMessage("system", "Be terse."),
            ChatMessage("user", "Find x and y."),
            ChatMessage("assistant", "", tool_calls=calls),
            ChatMessage("tool", "x is 1", tool_call_id="call_1"),
            ChatMessage("tool", "y is 2", tool_call_id="call_2"),
        ),
        tools=(SEARCH,),
        max_output_tokens=128,
    )
    server.push(Reply(tool_calls=[("call_3", "search", '{"q": "z"}')], usage=(50, 7)))

    reply = await provider.complete(request)

    assert reply.text is None
    assert reply.tool_calls == (ToolCall(call_id="call_3", name="search", arguments='{"q": "z"}'),)
    assert reply.finish_reason == "tool_calls"
    assert server.requests[0].body == {
        "model": "gpt-test",
        "max_tokens": 128,
        "messages": [
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
            {"role": "tool", "tool_call_id": "call_1", "content": "x is 1"},
            {"role": "tool", "tool_call_id": "call_2", "content": "y is 2"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "search", "description": "Search the notes.", "parameters": SEARCH.parameters},
            }
        ],
    }


async def test_malformed_arguments_pass_through_raw(server: ProviderServer, provider: OpenAIChatProvider) -> None:
    server.push(Reply(tool_calls=[("call_1", "search", '{"q": "x",')]))

    reply = await provider.complete(REQUEST)

    assert reply.tool_calls == (ToolCall(call_id="call_1", name="search", arguments='{"q": "x",'),)


def _completion(message: object) -> dict[str, object]:
    return {"model": "gpt-test", "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"choices": []}, id="empty-choices"),
        pytest.param({"object": "chat.completion"}, id="no-choices"),
        pytest.param({"choices": [{"finish_reason": "stop"}]}, id="no-message"),
        pytest.param(["not", "an", "object"], id="not-an-object"),
        pytest.param(
            _completion({"content": None, "tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]}),
            id="tool-call-without-name",
        ),
        pytest.param(
            _completion({"content": None, "tool_calls": [{"id": "c1", "function": {"name": "s", "arguments": {}}}]}),
            id="arguments-not-a-string",
        ),
        pytest.param(
            _completion({"content": None, "tool_calls": [{"function": {"name": "s", "arguments": "{}"}}]}),
            id="tool-call-without-id",
        ),
        pytest.param(_completion({"content": ["a", "list"]}), id="content-not-a-string"),
        pytest.param("<html>Bad gateway</html>", id="not-json"),
    ],
)
async def test_unusable_200_is_malformed_response(
    server: ProviderServer, provider: OpenAIChatProvider, body: dict[str, object] | list[object] | str
) -> None:
    server.push(Raw(200, body))

    error = await failure(provider)

    assert (error.kind, error.retryable) == ("malformed_response", False)


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (429, "rate_limited", True),
        (500, "server_error", True),
        (503, "server_error", True),
        (400, "client_error", False),
        (404, "client_error", False),
    ],
)
async def test_http_status_mapping(
    server: ProviderServer, provider: OpenAIChatProvider, status: int, kind: str, retryable: bool
) -> None:
    server.push(Raw(status, {"error": {"message": "nope", "type": "test"}}))

    error = await failure(provider)

    assert (error.kind, error.retryable, error.status) == (kind, retryable, status)
    assert "nope" in str(error)


async def test_rate_limit_keeps_retry_after(server: ProviderServer, provider: OpenAIChatProvider) -> None:
    server.push(Raw(429, b"slow down", headers={"Retry-After": "7"}))

    error = await failure(provider)

    assert isinstance(error, RateLimitedError)
    assert error.retry_after_s == 7.0
    assert "retry after 7s" in str(error)


async def test_client_error_body_excerpt_is_truncated(
    server: ProviderServer, provider: OpenAIChatProvider
) -> None:
    server.push(Raw(400, "x" * 10_000))

    error = await failure(provider)

    assert error.kind == "client_error"
    assert len(str(error)) < EXCERPT_CHARS + 50


async def test_slow_response_times_out(server: ProviderServer) -> None:
    server.push(Delay(1.0, Reply(text="too late")))
    provider = OpenAIChatProvider(server.base_url_openai, API_KEY, timeout_s=0.2)
    started = time.monotonic()

    error = await failure(provider)
    await provider.aclose()

    assert (error.kind, error.retryable) == ("timeout", True)
    assert time.monotonic() - started < 0.9


async def test_dropped_connection_is_retryable(server: ProviderServer, provider: OpenAIChatProvider) -> None:
    server.push(Drop())

    error = await failure(provider)

    assert (error.kind, error.retryable) == ("connection", True)


async def test_refused_connection_is_retryable() -> None:
    with socket.socket() as probe:  # a port that nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    provider = OpenAIChatProvider(f"http://127.0.0.1:{port}/v1", API_KEY, timeout_s=1.0)

    error = await failure(provider)
    await provider.aclose()

    assert (error.kind, error.retryable) == ("connection", True)


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(Raw(401, {"error": {"message": f"Incorrect API key provided: {API_KEY}"}}), id="401"),
        pytest.param(Raw(429, f"key {API_KEY} is over quota"), id="429"),
        pytest.param(Raw(500, API_KEY * 50), id="500"),
        pytest.param(Raw(200, f"<html>{API_KEY}</html>"), id="not-json"),
        pytest.param(Drop(), id="drop"),
        pytest.param(Delay(1.0, Reply(text="late")), id="timeout"),
    ],
)
async def test_api_key_is_sent_but_never_in_errors(server: ProviderServer, step: Step) -> None:
    server.push(step)
    provider = OpenAIChatProvider(server.base_url_openai, API_KEY, timeout_s=0.2)

    error = await failure(provider)
    await provider.aclose()

    assert server.requests[0].headers["authorization"] == f"Bearer {API_KEY}"
    assert API_KEY not in str(error)
    assert API_KEY not in repr(error.args)


async def test_no_auth_header_without_key(server: ProviderServer) -> None:
    server.push(Reply(text="ok"))
    provider = OpenAIChatProvider(server.base_url_openai, None)

    await provider.complete(REQUEST)
    await provider.aclose()

    assert "authorization" not in server.requests[0].headers


async def test_injected_client_is_left_open(server: ProviderServer) -> None:
    server.push(Reply(text="ok"))
    async with httpx.AsyncClient() as client:
        provider = OpenAIChatProvider(server.base_url_openai, API_KEY, client=client)
        await provider.complete(REQUEST)
        await provider.aclose()

        assert not client.is_closed


async def test_exhausted_script_answers_500_naming_the_problem(provider: OpenAIChatProvider) -> None:
    error = await failure(provider)

    assert error.kind == "server_error"
    assert "script exhausted" in str(error)


def test_server_threads_stop_at_exit() -> None:
    before = set(threading.enumerate())
    with ProviderServer() as server, httpx.Client() as idle:
        server.push(Reply(text="ok"), Delay(30.0, Reply(text="never")))
        # One handler idles on a keep-alive connection, another sleeps in a Delay.
        idle.post(f"{server.base_url_openai}/chat/completions", json={"model": "m"})
        stuck = socket.create_connection(("127.0.0.1", server.port))
        stuck.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        while server.pending:
            time.sleep(0.01)
        started = time.monotonic()
    stuck.close()

    assert time.monotonic() - started < 1.0
    assert set(threading.enumerate()) - before == set()

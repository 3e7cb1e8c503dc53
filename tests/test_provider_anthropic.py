"""The Anthropic wire format over a real socket (the loopback provider server): headers as
sent, timeouts, dropped connections, the key kept out of errors. The wire format itself is
tested in test_wire_anthropic.py."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import pytest
from provider_server import Delay, Drop, ProviderServer, Raw, Reply, Step

from turnstile.events import Usage
from turnstile.handlers.provider import ChatMessage, ModelRequest, ProviderError
from turnstile.handlers.providers.anthropic_messages import AnthropicMessages
from turnstile.handlers.retry import RetryPolicy
from turnstile.streams.provider_http import HttpProvider

API_KEY = "sk-ant-test-0123456789abcdef"
REQUEST = ModelRequest(model="claude-test", messages=(ChatMessage("user", "Hello"),), max_output_tokens=64)
# Each request once: these tests are about one exchange on the socket.
ONCE = RetryPolicy(max_retries=0)


def anthropic_provider(base_url: str, api_key: str | None, **options: object) -> HttpProvider:
    return HttpProvider(AnthropicMessages(), base_url, api_key, retry=ONCE, **options)  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running:
        yield running


@pytest.fixture
async def provider(server: ProviderServer) -> AsyncIterator[HttpProvider]:
    client = anthropic_provider(server.base_url_anthropic, API_KEY, timeout_s=2.0)
    yield client
    await client.aclose()


async def failure(provider: HttpProvider, request: ModelRequest = REQUEST) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await provider.complete(request)
    return caught.value


async def test_text_reply_with_usage(server: ProviderServer, provider: HttpProvider) -> None:
    server.push(Reply(text="Hi there", usage=(12, 4), model="claude-test-20250101"))

    reply = await provider.complete(REQUEST)

    assert reply.text == "Hi there"
    assert reply.tool_calls == ()
    assert reply.usage == Usage(input_tokens=12, output_tokens=4)
    assert reply.model == "claude-test-20250101"
    assert (reply.finish_reason, reply.stop) == ("end_turn", "end")
    [sent] = server.requests
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == API_KEY
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.headers["content-type"] == "application/json"
    assert "authorization" not in sent.headers
    assert sent.body == {"model": "claude-test", "max_tokens": 64, "messages": [{"role": "user", "content": "Hello"}]}


async def test_slow_response_times_out(server: ProviderServer) -> None:
    server.push(Delay(1.0, Reply(text="too late")))
    provider = anthropic_provider(server.base_url_anthropic, API_KEY, timeout_s=0.2)
    started = time.monotonic()

    error = await failure(provider)
    await provider.aclose()

    assert (error.kind, error.retryable) == ("timeout", True)
    assert time.monotonic() - started < 0.9


async def test_dropped_connection_is_retryable(server: ProviderServer, provider: HttpProvider) -> None:
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
    provider = anthropic_provider(server.base_url_anthropic, API_KEY, timeout_s=0.2)

    error = await failure(provider)
    await provider.aclose()

    assert server.requests[0].headers["x-api-key"] == API_KEY
    assert API_KEY not in str(error)
    assert API_KEY not in repr(error.args)

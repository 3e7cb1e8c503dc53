"""The OpenAI wire format over a real socket (the loopback provider server): what only a
socket shows -- headers as sent, timeouts, dropped and refused connections, the key kept
out of errors, clean shutdown. The wire format itself is tested in test_wire_openai.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from provider_server import Delay, Drop, Gated, ProviderServer, Raw, Reply, Step

from turnstile.events import Usage
from turnstile.handlers.provider import ChatMessage, ModelRequest, ProviderError
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.retry import RetryPolicy
from turnstile.streams.provider_http import EXCERPT_CHARS, HttpProvider

API_KEY = "sk-test-0123456789abcdef"
REQUEST = ModelRequest(model="gpt-test", messages=(ChatMessage("user", "Hello"),), max_output_tokens=64)
# Each request once: these tests are about one exchange on the socket.
ONCE = RetryPolicy(max_retries=0)


def openai_provider(base_url: str, api_key: str | None, **options: object) -> HttpProvider:
    return HttpProvider(OpenAIChat(), base_url, api_key, retry=ONCE, **options)  # type: ignore[arg-type]


@pytest.fixture
def server() -> Iterator[ProviderServer]:
    with ProviderServer() as running:
        yield running


@pytest.fixture
async def provider(server: ProviderServer) -> AsyncIterator[HttpProvider]:
    client = openai_provider(server.base_url_openai, API_KEY, timeout_s=2.0)
    yield client
    await client.aclose()


async def failure(provider: HttpProvider, request: ModelRequest = REQUEST) -> ProviderError:
    with pytest.raises(ProviderError) as caught:
        await provider.complete(request)
    return caught.value


async def test_text_reply_with_usage(server: ProviderServer, provider: HttpProvider) -> None:
    server.push(Reply(text="Hi there", usage=(10, 3), model="gpt-test-2024-01-01"))

    reply = await provider.complete(REQUEST)

    assert reply.text == "Hi there"
    assert reply.tool_calls == ()
    assert reply.usage == Usage(input_tokens=10, output_tokens=3)
    assert reply.model == "gpt-test-2024-01-01"
    assert (reply.finish_reason, reply.stop) == ("stop", "end")
    [sent] = server.requests
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    assert sent.headers["content-type"] == "application/json"
    assert sent.body == {
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_completion_tokens": 64,
    }


async def test_slow_response_times_out(server: ProviderServer) -> None:
    server.push(Delay(1.0, Reply(text="too late")))
    provider = openai_provider(server.base_url_openai, API_KEY, timeout_s=0.2)
    started = time.monotonic()

    error = await failure(provider)
    await provider.aclose()

    assert (error.kind, error.retryable) == ("timeout", True)
    assert time.monotonic() - started < 0.9


async def test_a_timeout_says_which_bound_was_reached(server: ProviderServer) -> None:
    from wire_harness import Collected

    # A streamed request with no deadline: only the wait for each read bounds it.
    server.push(Delay(1.0, Reply(text="too late")))
    provider = openai_provider(server.base_url_openai, API_KEY, timeout_s=0.2)
    with pytest.raises(ProviderError) as caught:
        await provider.complete(REQUEST, Collected())
    await provider.aclose()

    assert caught.value.kind == "timeout"
    assert caught.value.message.startswith("the server sent nothing for 0.2 s")


async def test_a_request_may_take_the_sdks_600_s_and_5_s_to_connect() -> None:
    # (60 s cut a non-streamed reasoning reply, which was asked, and billed, again)
    seen: list[dict[str, float]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return httpx.Response(200, json={"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 1, "completion_tokens": 1}})  # fmt: skip

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        await HttpProvider(OpenAIChat(), "https://api.test/v1", API_KEY, client=client).complete(REQUEST)
    assert seen == [{"connect": 5.0, "read": 600.0, "write": 600.0, "pool": 600.0}]


async def test_dropped_connection_is_retryable(server: ProviderServer, provider: HttpProvider) -> None:
    server.push(Drop())

    error = await failure(provider)

    assert (error.kind, error.retryable) == ("connection", True)


async def test_a_dropped_connection_is_retried_on_a_new_one(server: ProviderServer) -> None:
    server.push(Drop(), Reply(text="second time"))
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    provider = HttpProvider(OpenAIChat(), server.base_url_openai, API_KEY, sleep=record, jitter=lambda: 0.0)
    reply = await provider.complete(REQUEST)
    await provider.aclose()

    assert (reply.text, waits, len(server.requests)) == ("second time", [0.5], 2)


async def test_client_error_body_excerpt_is_truncated(server: ProviderServer, provider: HttpProvider) -> None:
    server.push(Raw(400, "x" * 10_000))

    error = await failure(provider)

    assert error.kind == "bad_request"
    assert len(str(error)) < EXCERPT_CHARS + 50


async def test_refused_connection_is_retryable() -> None:
    with socket.socket() as probe:  # a port that nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    provider = openai_provider(f"http://127.0.0.1:{port}/v1", API_KEY, timeout_s=1.0)

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
    provider = openai_provider(server.base_url_openai, API_KEY, timeout_s=0.2)

    error = await failure(provider)
    await provider.aclose()

    assert server.requests[0].headers["authorization"] == f"Bearer {API_KEY}"
    assert API_KEY not in str(error)
    assert API_KEY not in repr(error.args)


async def test_no_auth_header_without_key(server: ProviderServer) -> None:
    server.push(Reply(text="ok"))
    provider = openai_provider(server.base_url_openai, None)

    await provider.complete(REQUEST)
    await provider.aclose()

    assert "authorization" not in server.requests[0].headers


async def test_injected_client_is_left_open(server: ProviderServer) -> None:
    server.push(Reply(text="ok"))
    async with httpx.AsyncClient() as client:
        provider = openai_provider(server.base_url_openai, API_KEY, client=client)
        await provider.complete(REQUEST)
        await provider.aclose()

        assert not client.is_closed


async def test_exhausted_script_answers_500_naming_the_problem(provider: HttpProvider) -> None:
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


async def test_more_model_calls_at_once_than_a_default_connection_pool_holds_are_all_in_flight(
    server: ProviderServer,
) -> None:
    # Given 130 turns calling a slow model at once (httpx's default pool holds 100
    # connections, and the 101st waited for one inside its own timeout)
    gate = threading.Event()
    server.push(*[Gated(gate, Reply(text="ok")) for _ in range(130)])
    provider = openai_provider(server.base_url_openai, API_KEY, timeout_s=20.0)
    calls = [asyncio.create_task(provider.complete(REQUEST)) for _ in range(130)]
    try:
        # When all are sent, then the server has every one at the same time
        deadline = time.monotonic() + 15
        while len(server.requests) < 130:
            assert time.monotonic() < deadline, f"only {len(server.requests)} requests in flight"
            await asyncio.sleep(0.05)
        gate.set()
        replies = await asyncio.gather(*calls)
    finally:
        gate.set()
        await provider.aclose()
    assert [r.text for r in replies] == ["ok"] * 130

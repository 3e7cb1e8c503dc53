"""The HTTP transport shared by every wire format: the retry policy of the official SDKs
(asserted on the schedule of waits, never on wall time), error kinds, one-sentence outcome
texts, and the API key kept out of every error and exception chain."""

from __future__ import annotations

import email.utils
import traceback
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from wire_harness import API_KEY, MockApi, fixture, reply

from turnstile.handlers.failure_text import provider_failure
from turnstile.handlers.provider import ChatMessage, ModelRequest, ProviderError
from turnstile.handlers.providers.anthropic_messages import AnthropicMessages
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.retry import GiveUp, Retry, RetryPolicy, backoff_s, next_retry, retryable_status, server_wait_s
from turnstile.streams.provider_http import HttpProvider

HELLO = ModelRequest(model="gpt-4.1", messages=(ChatMessage("user", "Hello"),))
NOW_S = 1_767_225_600.0


def error(status: int, message: str = "nope", headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": "test_error", "message": message}}, headers=headers)


class Transport:
    """A provider on a MockApi whose sleeps are recorded instead of waited."""

    def __init__(self, api: MockApi, client: httpx.AsyncClient, **options: object) -> None:
        self.sleeps: list[float] = []
        self.provider = HttpProvider(
            OpenAIChat(), "https://api.openai.test/v1", API_KEY, client=client,
            sleep=self._sleep, jitter=lambda: 0.0, now_s=lambda: NOW_S, **options,  # type: ignore[arg-type]
        )  # fmt: skip

    async def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)

    async def failure(self, request: ModelRequest = HELLO) -> ProviderError:
        with pytest.raises(ProviderError) as caught:
            await self.provider.complete(request)
        return caught.value


@pytest.fixture
def api() -> MockApi:
    return MockApi()


@pytest.fixture
async def make(api: MockApi) -> AsyncIterator[Callable[..., Transport]]:
    async with api.client() as client:
        yield lambda **options: Transport(api, client, **options)


# -- the policy, pure ---------------------------------------------------------------------------


def test_which_statuses_are_retried_and_the_servers_word_wins() -> None:
    assert [s for s in (400, 401, 403, 404, 408, 409, 422, 429, 500, 502, 503, 529) if retryable_status(s, {})] == [
        408, 409, 429, 500, 502, 503, 529,
    ]  # fmt: skip
    assert not retryable_status(503, {"x-should-retry": "false"})
    assert retryable_status(400, {"x-should-retry": "true"})


def test_the_wait_the_server_asks_for() -> None:
    assert server_wait_s({"retry-after-ms": "1500", "retry-after": "9"}, NOW_S) == 1.5  # ms first
    assert server_wait_s({"retry-after": "30"}, NOW_S) == 30.0
    assert server_wait_s({"retry-after": "0.25"}, NOW_S) == 0.25  # nonstandard floats, as the SDKs allow
    in_20s = email.utils.formatdate(NOW_S + 20, usegmt=True)
    assert server_wait_s({"retry-after": in_20s}, NOW_S) == pytest.approx(20.0)
    assert server_wait_s({"retry-after": "soon"}, NOW_S) is None
    assert server_wait_s({}, NOW_S) is None


def test_backoff_doubles_to_its_ceiling_minus_up_to_a_quarter_of_jitter() -> None:
    policy = RetryPolicy()
    assert [backoff_s(policy, n, 0.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff_s(policy, 0, 0.999) == pytest.approx(0.5 * 0.75, abs=1e-3)
    with pytest.raises(ValueError):
        backoff_s(policy, 0, 1.0)


def test_next_retry_decides_with_the_deadline_and_the_ceiling() -> None:
    policy = RetryPolicy(max_retries=2, max_retry_after_s=60)
    limited = ProviderError("rate_limited", "429", retryable=True, status=429, retry_after_s=30)
    assert next_retry(policy, 0, limited, 0.0, None) == Retry(30)
    assert next_retry(policy, 0, limited, 0.0, time_left_s=45) == Retry(30)
    # not final: the turn decides what a wait past its deadline means (it pauses on it)
    assert isinstance(late := next_retry(policy, 0, limited, 0.0, time_left_s=20), GiveUp) and not late.final
    assert "deadline" in late.reason
    too_long = ProviderError("rate_limited", "429", retryable=True, status=429, retry_after_s=61)
    assert next_retry(policy, 0, too_long, 0.0, None) == GiveUp(
        "the provider asked to wait 61 s, longer than the 60 s allowed", final=True
    )
    used = next_retry(policy, 2, limited, 0.0, None)
    assert isinstance(used, GiveUp) and not used.final and not used.told
    final = ProviderError("bad_request", "400", retryable=False, status=400)
    assert isinstance(next_retry(policy, 0, final, 0.0, None), GiveUp)


# -- the schedule the transport follows ----------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "sleeps"),
    [
        ({"retry-after-ms": "1500"}, [1.5]),
        ({"retry-after": "30"}, [30.0]),  # not cut to a backoff ceiling
        ({"retry-after": email.utils.formatdate(NOW_S + 12, usegmt=True)}, [12.0]),
        ({}, [0.5]),
        ({"retry-after": "0"}, [0.5]),  # "now" is not a wait: backoff
    ],
)
async def test_a_429_is_retried_after_the_wait_the_server_asked_for(
    api: MockApi, make: Callable[..., Transport], headers: dict[str, str], sleeps: list[float]
) -> None:
    api.push(error(429, "slow down", headers), reply(fixture("openai", "text")))
    transport = make()

    answer = await transport.provider.complete(HELLO)

    assert answer.text == "The 9th is cheaper."
    assert transport.sleeps == pytest.approx(sleeps)


@pytest.mark.parametrize("status", [408, 409, 500, 503, 529])
async def test_transient_statuses_back_off_exponentially_then_reach_the_turn(
    api: MockApi, make: Callable[..., Transport], status: int
) -> None:
    api.push(*[error(status)] * 4)
    transport = make(retry=RetryPolicy(max_retries=3))

    failure = await transport.failure()

    assert transport.sleeps == [0.5, 1.0, 2.0]
    assert len(api.bodies) == 4
    # Still retryable: a later attempt of the turn may succeed.
    assert failure.retryable and failure.status == status and "after 3 retries" in failure.message


async def test_connection_errors_are_retried(api: MockApi, make: Callable[..., Transport]) -> None:
    def refuse(body: object) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    api.push(refuse, reply(fixture("openai", "text")))
    transport = make()

    assert (await transport.provider.complete(HELLO)).text == "The 9th is cheaper."
    assert transport.sleeps == [0.5]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_request_errors_are_not_retried(api: MockApi, make: Callable[..., Transport], status: int) -> None:
    api.push(error(status))
    transport = make()

    failure = await transport.failure()

    assert (transport.sleeps, failure.retryable, failure.status) == ([], False, status)


async def test_x_should_retry_overrides_the_status(api: MockApi, make: Callable[..., Transport]) -> None:
    api.push(error(503, headers={"x-should-retry": "false"}))
    transport = make()
    failure = await transport.failure()
    assert (transport.sleeps, failure.retryable) == ([], False)

    api.push(error(400, headers={"x-should-retry": "true"}), reply(fixture("openai", "text")))
    transport = make()
    assert (await transport.provider.complete(HELLO)).text == "The 9th is cheaper."
    assert transport.sleeps == [0.5]


async def test_a_wait_longer_than_the_ceiling_or_the_deadline_fails_at_once_and_says_why(
    api: MockApi, make: Callable[..., Transport]
) -> None:
    api.push(error(429, headers={"retry-after": "120"}))
    transport = make(retry=RetryPolicy(max_retry_after_s=60))
    failure = await transport.failure()
    assert (transport.sleeps, failure.retryable, failure.retry_after_s) == ([], False, 120.0)
    assert "longer than the 60 s allowed" in failure.message

    api.push(error(429, headers={"retry-after": "30"}))
    transport = make()
    failure = await transport.failure(ModelRequest("gpt-4.1", HELLO.messages, time_left_s=10.0))
    assert (transport.sleeps, failure.retryable, failure.retry_after_s) == ([], True, 30.0)  # the turn pauses
    assert "would pass the turn's deadline" in failure.message


# -- kinds and the sentence the user reads -------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind", "sentence"),
    [
        (401, "authentication", "The model provider refused the credentials (HTTP 401): check the API key."),
        (403, "authentication", "The model provider refused the credentials (HTTP 403): check the API key."),
        (
            400,
            "bad_request",
            "The model provider rejected the request (HTTP 400): messages.1: all messages must have non-empty content.",
        ),
        (429, "rate_limited", "The model provider kept rate limiting requests (HTTP 429) on all 3 attempts."),
        (529, "overloaded", "The model provider was overloaded (HTTP 529) on all 3 attempts."),
        (500, "server_error", "The model provider failed (HTTP 500) on all 3 attempts."),
    ],
)
async def test_each_failure_ends_in_one_sentence_that_says_what_went_wrong(
    api: MockApi, make: Callable[..., Transport], status: int, kind: str, sentence: str
) -> None:
    api.push(error(status, "messages.1: all messages must have non-empty content"))
    transport = make(retry=RetryPolicy(max_retries=0))

    failure = await transport.failure()

    assert failure.kind == kind
    assert provider_failure(failure, attempts=3, side_effect_ran=False) == sentence


def test_the_other_sentences() -> None:
    def said(kind: str, message: str = "x", **extra: object) -> str:
        err = ProviderError(kind, message, retryable=extra.pop("retryable", True), **extra)  # type: ignore[arg-type]
        return provider_failure(err, attempts=2, side_effect_ran=False)

    assert said("timeout") == "The model provider did not answer in time on all 2 attempts."
    assert said("connection") == "The model provider could not be reached on all 2 attempts."
    assert said("malformed_response", "choices is empty", retryable=False) == (
        "The model provider sent a reply that could not be used: choices is empty."
    )
    assert said("rate_limited", retryable=False, status=429, retry_after_s=120.0) == (
        "The model provider is rate limiting requests and asked to wait 120 s, longer than this turn may wait."
    )
    assert said("bad_request", retryable=False, status=404) == (
        "The model provider rejected the request (HTTP 404): it gave no reason. Check the model's name and"
        " base_url (an OpenAI-compatible one ends in /v1; an Anthropic one does not: its requests go to"
        " {base_url}/v1/messages)."
    )
    unsafe = provider_failure(ProviderError("timeout", "x", retryable=True), attempts=1, side_effect_ran=True)
    assert unsafe.startswith("The model provider did not answer in time. A tool with side effects had already run")


# -- the key -------------------------------------------------------------------------------------


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(error(401, f"Incorrect API key provided: {API_KEY}"), id="401-echo"),
        pytest.param(error(400, f"bad key {API_KEY} " * 40), id="400-long-echo"),
        pytest.param(httpx.Response(200, text=f"<html>{API_KEY}</html>"), id="not-json"),
        pytest.param(httpx.ConnectError(f"refused for {API_KEY}"), id="connect-error"),
        pytest.param(httpx.ReadTimeout("timed out"), id="timeout"),
    ],
)
@pytest.mark.parametrize("wire", [OpenAIChat(), AnthropicMessages()], ids=["openai", "anthropic"])
async def test_no_error_or_exception_chain_keeps_the_key(
    api: MockApi, answer: httpx.Response | Exception, wire: OpenAIChat | AnthropicMessages
) -> None:
    def respond(body: object) -> httpx.Response:
        if isinstance(answer, Exception):
            raise answer
        return answer

    api.push(respond)
    async with api.client() as client:
        provider = HttpProvider(wire, "https://x.test", API_KEY, client=client, retry=RetryPolicy(max_retries=0))
        with pytest.raises(ProviderError) as caught:
            await provider.complete(HELLO)

    failure = caught.value
    sent = api.headers[0]
    assert API_KEY in (sent.get("authorization", "") + sent.get("x-api-key", ""))  # it was sent...
    assert _chain(failure) == [failure]  # ...no httpx exception (holding the request) is chained...
    printed = "".join(traceback.format_exception(failure))
    for text in (printed, str(failure), repr(failure.args), failure.provider_message or ""):
        assert API_KEY not in text  # ...and nothing quotes it.
    sentence = provider_failure(failure, attempts=1, side_effect_ran=False)
    assert API_KEY not in sentence and sentence.count(".") >= 1

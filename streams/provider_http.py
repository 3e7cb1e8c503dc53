"""The one HTTP transport for every provider wire format: httpx, timeouts, retries as the
official SDKs do them (`turnstile.handlers.retry`), and redaction.

The wire format (`turnstile.handlers.providers.*`) builds the request and parses the
reply; this module only moves bytes and turns what went wrong into a `ProviderError`.
Whatever an error quotes from a response body or an httpx exception has the API key
replaced, and no error raised here chains an httpx exception: those carry the request,
whose headers hold the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeGuard

import httpx
import orjson

from turnstile.handlers.provider import ModelReply, ModelRequest, ProtocolFamily, ProviderError, ReplyStream
from turnstile.handlers.providers.sse import SseDecoder
from turnstile.handlers.providers.wire import (
    ReplyAssembler,
    WireFormat,
    malformed,
    provider_error_message,
    status_kind,
    stream_error,
)
from turnstile.handlers.retry import (
    GiveUp,
    RetryPolicy,
    given_up,
    next_retry,
    retryable_break,
    retryable_status,
    server_wait_s,
)

log = logging.getLogger(__name__)
# Told of one HTTP request: the protocol family, its result ("ok", the error's kind or
# CANCELLED), seconds.
RequestListener = Callable[[ProtocolFamily, str, float], None]
# The result a listener is told of a request its caller stopped waiting for: no provider error.
CANCELLED = "cancelled"

# A reply bigger than this is not a chat completion; refuse it instead of buffering it.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
# Enough of an error body to tell an operator what the server objected to.
EXCERPT_CHARS = 300


class HttpProvider:
    """A `Provider` speaking `wire` over HTTP.

    Owns its `httpx.AsyncClient` unless one is injected; an injected client belongs to the
    caller and is left open by `aclose`. `sleep`, `jitter` and `now_s` are injectable so
    that a retry schedule can be observed without waiting.
    """

    def __init__(
        self,
        wire: WireFormat,
        base_url: str,
        api_key: str | None,
        *,
        timeout_s: float = 600.0,
        client: httpx.AsyncClient | None = None,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        jitter: Callable[[], float] = random.random,
        now_s: Callable[[], float] = time.time,
    ) -> None:
        self._wire = wire
        self._url = wire.url(base_url)
        self._headers = {"content-type": "application/json", **wire.headers(api_key)}
        self._secret = api_key
        self._timeout_s = timeout_s
        # The SDKs' timeouts (openai-python and anthropic-sdk-python: 600 s, connect 5 s): a
        # non-streamed reply of a reasoning model may take minutes, and one cut at 60 s was
        # asked (and billed) again. The turn's deadline bounds every request besides.
        self._timeouts = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))
        self._retry = retry
        self._sleep = sleep
        self._jitter = jitter
        self._now_s = now_s
        self._owns_client = client is None
        self._client = client if client is not None else _owned_client(self._timeouts)

    @property
    def family(self) -> ProtocolFamily:
        return self._wire.family

    async def complete(
        self, request: ModelRequest, stream: ReplyStream | None = None, on_request: RequestListener | None = None
    ) -> ModelReply:
        """With `stream`, the request asks for server-sent events and the reply's text goes
        to `stream` as it arrives; a retry after some text tells it to start over.
        `on_request` is told of every HTTP request this call makes, retries included: its
        result ("ok", the error's kind or `CANCELLED`) and how long it took, the waits between retries
        not counted (`Metrics`; per call, so one provider may serve several workers)."""
        content = orjson.dumps(self._wire.request_body(request, stream=stream is not None))
        started = time.monotonic()
        retries = 0
        while True:
            relay = None if stream is None else _Relay(stream, self._redact, self._secret)
            sent = time.monotonic()
            try:
                result = await self._try(content, request, relay)
            except asyncio.CancelledError:  # the turn's deadline, an interruption, a revoke
                if on_request is not None:
                    on_request(self.family, CANCELLED, time.monotonic() - sent)
                raise
            if on_request is not None:
                kind = "ok" if isinstance(result, ModelReply) else result.kind
                on_request(self.family, kind, time.monotonic() - sent)
            if isinstance(result, ModelReply):
                if relay is not None:
                    await relay.flush()
                return self._redact_reply(result)
            time_left = None if request.time_left_s is None else request.time_left_s - (time.monotonic() - started)
            decision = next_retry(self._retry, retries, result, self._jitter(), time_left)
            if isinstance(decision, GiveUp):
                # Raised outside any `except`: nothing from httpx is chained to it.
                raise given_up(result, decision, retries)
            log.warning(
                "%s request failed (%s); retry %d in %.2f s", self.family, result, retries + 1, decision.delay_s
            )
            await self._sleep(decision.delay_s)
            if relay is not None and relay.sent:
                await relay.stream.restart()
            retries += 1

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _try(self, content: bytes, request: ModelRequest, relay: _Relay | None) -> ModelReply | ProviderError:
        """One request: the reply, or what went wrong (returned, not raised, so that no
        httpx exception is left in an error's context)."""
        failure: ProviderError | None = None
        # httpx timeouts are per phase (connect, each read...); the outer deadline also
        # bounds a server that trickles bytes forever. A streamed reply may rightly take
        # longer than one response should: only the turn's deadline bounds it, and the
        # read timeout catches a server that stops sending.
        total_s = self._timeout_s if relay is None else request.time_left_s
        assembler = self._wire.assembler() if relay is not None else None
        began: list[httpx.Headers] = []  # the answer's headers, once it began
        try:
            async with asyncio.timeout(total_s):
                status, headers, payload, streamed = await self._send(content, relay, assembler, began)
        except (TimeoutError, httpx.TimeoutException) as exc:
            again = not began or retryable_break(began[0])  # (mid-answer, the server may have said not to)
            failure = ProviderError("timeout", self._timed_out(exc, total_s), retryable=again)
        except httpx.TransportError as exc:
            again = not began or retryable_break(began[0])
            failure = ProviderError("connection", self._describe(exc), retryable=again)
        except httpx.DecodingError as exc:
            failure = malformed(self._describe(exc))
        except ProviderError as exc:
            failure = exc
        if failure is not None:
            return failure
        if not 200 <= status < 300:
            return self._status_error(status, headers, payload)
        try:
            if assembler is not None and streamed:
                if not assembler.done:
                    again = retryable_break(headers)
                    return ProviderError("connection", "the stream ended before the reply did", retryable=again)
                return self._wire.parse_reply(assembler.payload(), request.model)
            parsed = orjson.loads(payload)  # (a server that answered a streamed request whole, too)
        except orjson.JSONDecodeError:
            return malformed(f"body is not JSON: {self._excerpt(payload)}")
        except ProviderError as exc:
            return exc
        if _error_body(parsed):  # an error answered with 200, as some gateways do
            return stream_error(parsed["error"], "in the answer")
        try:
            return self._wire.parse_reply(parsed, request.model)
        except ProviderError as exc:
            return exc

    async def _send(
        self, content: bytes, relay: _Relay | None, assembler: ReplyAssembler | None, began: list[httpx.Headers]
    ) -> tuple[int, httpx.Headers, bytes, bool]:
        """Status, headers, body and whether it was an event stream: a successful one goes to
        `assembler` as it arrives (and its text to `relay`) instead of the body. The headers
        go to `began` at once."""
        async with self._client.stream(
            "POST", self._url, content=content, headers=self._headers, timeout=self._timeouts
        ) as response:
            began.append(response.headers)
            asked = relay is not None and assembler is not None and 200 <= response.status_code < 300
            streaming = _event_stream(response.headers) if asked else False
            decoder = SseDecoder()
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise malformed(f"response body exceeds {MAX_RESPONSE_BYTES} bytes")
                if streaming is None:  # no content type: the first bytes tell
                    chunks.append(chunk)
                    head = chunk.lstrip()  # (the chunks before it were whitespace)
                    if not head:
                        continue
                    streaming = not head.startswith((b"{", b"["))  # a whole JSON reply, or events
                    if not streaming:
                        continue
                    chunk = b"".join(chunks)
                    chunks.clear()
                if not streaming:
                    chunks.append(chunk)
                    continue
                assert relay is not None and assembler is not None
                for event in decoder.feed(chunk):
                    text = assembler.feed(event)
                    if text:
                        await relay.delta(text)
            # Nothing but whitespace with no type: a stream that ended before the reply did
            # (another try may get it), as under the event-stream type.
            return response.status_code, response.headers, b"".join(chunks), streaming is not False

    def _status_error(self, status: int, headers: Mapping[str, str], payload: bytes) -> ProviderError:
        said = provider_error_message(payload)
        wait = server_wait_s(headers, self._now_s())
        detail = f"HTTP {status}: {self._excerpt(payload)}"
        if wait is not None:
            detail = f"HTTP {status} (retry after {wait:g} s): {self._excerpt(payload)}"
        return ProviderError(
            status_kind(status),
            detail,
            retryable=retryable_status(status, headers),
            status=status,
            retry_after_s=wait,
            provider_message=None if said is None else self._redact(said),
        )

    def _excerpt(self, payload: bytes) -> str:
        # Redact before truncating, so a cut can never leave part of the key behind.
        text = self._redact(" ".join(payload.decode("utf-8", errors="replace").split()))
        return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."

    def _timed_out(self, exc: Exception, total_s: float | None) -> str:
        """Which bound was reached: connecting, a read that waited too long, or the whole."""
        if isinstance(exc, httpx.ConnectTimeout):
            return f"could not connect within {self._timeouts.connect:g} s"
        if isinstance(exc, httpx.PoolTimeout):
            return f"no connection was free within {self._timeout_s:g} s"
        if isinstance(exc, httpx.WriteTimeout):
            return f"could not send the request within {self._timeout_s:g} s"
        if isinstance(exc, httpx.TimeoutException):
            return f"the server sent nothing for {self._timeout_s:g} s"
        if total_s is None:  # (only the bounds above apply: a TimeoutError from elsewhere)
            return self._describe(exc)
        return f"no whole response within {total_s:g} s"

    def _describe(self, exc: Exception) -> str:
        text = str(exc)
        return self._redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)

    def _redact(self, text: str) -> str:
        return text.replace(self._secret, "[redacted]") if self._secret else text

    def _redact_reply(self, reply: ModelReply) -> ModelReply:
        """A provider may echo the key (a prompt injection asks it to): no part of what is
        recorded -- the text, tool calls, the native blocks sent back next round -- keeps it."""
        if not self._secret:
            return reply
        calls = tuple(
            c.model_copy(update={"name": self._redact(c.name), "arguments": self._redact(c.arguments)})
            for c in reply.tool_calls
        )
        text = None if reply.text is None else self._redact(reply.text)
        native = None if reply.native is None else tuple(_scrub(block, self._redact) for block in reply.native)
        return dataclasses.replace(reply, text=text, tool_calls=calls, native=native)


def _scrub(value: Any, redact: Callable[[str], str]) -> Any:
    """Every string of a JSON-like value redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: _scrub(v, redact) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v, redact) for v in value]
    return value


class _Relay:
    """Passes text on to the caller's stream (redacted), remembering whether any went.
    The key may arrive split over deltas: text that ends with a beginning of the key is
    held back until the next delta (or the end) says whether the key follows."""

    def __init__(self, stream: ReplyStream, redact: Callable[[str], str], secret: str | None) -> None:
        self.stream = stream
        self.sent = False
        self._redact = redact
        self._secret = secret or ""
        self._held = ""

    async def delta(self, text: str) -> None:
        text = self._redact(self._held + text)
        keep = _key_start_at_end(text, self._secret)
        text, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if text:
            self.sent = True
            await self.stream.delta(text)

    async def flush(self) -> None:
        held, self._held = self._held, ""
        if held:
            self.sent = True
            await self.stream.delta(held)


def _key_start_at_end(text: str, secret: str) -> int:
    """How many characters at the end of `text` are a beginning of `secret` (0: none)."""
    for size in range(min(len(text), len(secret) - 1), 0, -1):
        if secret.startswith(text[-size:]):
            return size
    return 0


def _event_stream(headers: httpx.Headers) -> bool | None:
    """Whether an answer is server-sent events, as its content type says; None when it says
    none (the body's first bytes tell: a JSON value, or events). Any other type is a whole
    reply from a server that ignored `stream: true`: parsed as such, not read as a stream
    with no events (and retried, and paid again)."""
    kind = headers.get("content-type")
    if kind is None:
        return None
    return str(kind).split(";")[0].strip().lower() == "text/event-stream"


def _error_body(parsed: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict) and not (
        "choices" in parsed or "content" in parsed
    )


MAX_CONNECTIONS = 2_000
CONNECT_TIMEOUT_S = 5.0


def _owned_client(timeouts: httpx.Timeout) -> httpx.AsyncClient:
    # Each turn in flight has at most one request open: httpx's default of 100 connections
    # made the 101st call wait for a free one inside its own timeout (400 turns of 50 s calls:
    # 300 false timeouts). A bound stays, far above that, short of a process's open files.
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=100)
    return httpx.AsyncClient(timeout=timeouts, verify=_shared_ssl_context(), limits=limits)


@functools.cache
def _shared_ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes tens of milliseconds per client; one context serves all.
    return httpx.create_ssl_context()


# The providers' own endpoints. OpenAI's base URL ends with its /v1 (a request goes to
# `{base_url}/chat/completions`); Anthropic's does not (`{base_url}/v1/messages`): an
# OpenAI-compatible server is named as `http://host:port/v1`.
DEFAULT_BASE_URLS = {"openai": "https://api.openai.com/v1", "anthropic": "https://api.anthropic.com"}


def http_provider(
    family: str,
    base_url: str | None,
    api_key: str | None,
    key_env: str,
    legacy_max_tokens: frozenset[str] = frozenset(),
) -> HttpProvider:
    """The provider of a model of `family` ("openai" or "anthropic") at `base_url` (None: the
    provider's own); `key_env` names where the key was read from, for the warning when none was."""
    if not api_key:
        # A local OpenAI-compatible server may need none; a hosted API answers 401 to every turn.
        where = base_url or DEFAULT_BASE_URLS[family]
        log.warning("%s is not set (or empty): requests to %s carry no API key", key_env, where)
    if family == "anthropic":
        from turnstile.handlers.providers.anthropic_messages import AnthropicMessages

        if base_url is not None and base_url.rstrip("/").endswith("/v1"):  # every turn would get a 404
            log.warning("the Anthropic base_url %s ends in /v1: its requests go to %s, which is likely no endpoint "
                        "(give the host without /v1)", base_url, AnthropicMessages().url(base_url))  # fmt: skip

        return HttpProvider(AnthropicMessages(), base_url or DEFAULT_BASE_URLS[family], api_key)
    from turnstile.handlers.providers.openai_chat import OpenAIChat

    return HttpProvider(OpenAIChat(legacy_max_tokens=legacy_max_tokens), base_url or DEFAULT_BASE_URLS[family], api_key)

"""The HTTP transport both provider clients share, and the one place where transport
failures, HTTP statuses and unusable response bodies become `ProviderError`s.

Whatever an error message quotes from a response body or an httpx exception passes
through `_redact`, so the API key never reaches an error, a log line or an event, even
when a server echoes it back.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Mapping
from typing import Any

import httpx
import orjson
from pydantic import ValidationError
from turnstile.events import ToolCall, Usage
from turnstile.handlers.provider import ProviderError

# A reply bigger than this is not a chat completion; refuse it instead of buffering it.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
# Enough of an error body to tell an operator what the server objected to.
EXCERPT_CHARS = 300
# The events bound these fields; a hostile server must not make ModelResponded invalid.
MAX_FINISH_REASON_CHARS = 64
MAX_MODEL_CHARS = 256


class RateLimitedError(ProviderError):
    """A 429. `retry_after_s` is the server's Retry-After in seconds, when it sent one."""

    def __init__(self, message: str, *, status: int, retry_after_s: float | None) -> None:
        super().__init__("rate_limited", message, retryable=True, status=status)
        self.retry_after_s = retry_after_s


def malformed(detail: str) -> ProviderError:
    """A response we cannot use. Not retryable: the same request tends to get the same answer."""
    return ProviderError("malformed_response", detail, retryable=False)


class JsonHttp:
    """POSTs a JSON body and returns the parsed JSON reply, or raises `ProviderError`.

    Owns its `httpx.AsyncClient` unless one is injected; an injected client belongs to
    the caller and is left open by `aclose`.
    """

    def __init__(self, *, secret: str | None, timeout_s: float, client: httpx.AsyncClient | None) -> None:
        self._secret = secret
        self._timeout_s = timeout_s
        self._owns_client = client is None
        self._client = client if client is not None else _owned_client(timeout_s)

    async def post(self, url: str, headers: Mapping[str, str], body: Mapping[str, Any]) -> Any:
        try:
            # httpx timeouts are per phase (connect, each read...); the outer deadline also
            # bounds a server that trickles bytes forever.
            async with asyncio.timeout(self._timeout_s):
                status, response_headers, payload = await self._send(url, headers, body)
        except (TimeoutError, httpx.TimeoutException):
            raise ProviderError("timeout", f"no response within {self._timeout_s}s", retryable=True) from None
        except httpx.TransportError as exc:
            # `from None`: httpx exceptions carry the request, whose headers hold the key.
            raise ProviderError("connection", self._describe(exc), retryable=True) from None
        except httpx.DecodingError as exc:
            raise malformed(self._describe(exc)) from None
        self._raise_for_status(status, response_headers, payload)
        try:
            return orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise malformed(f"body is not JSON: {self._excerpt(payload)}") from None

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _send(
        self, url: str, headers: Mapping[str, str], body: Mapping[str, Any]
    ) -> tuple[int, httpx.Headers, bytes]:
        request_headers = {"content-type": "application/json", **headers}
        content = orjson.dumps(body)
        async with self._client.stream(
            "POST", url, content=content, headers=request_headers, timeout=self._timeout_s
        ) as response:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_RESPONSE_BYTES:
                    raise malformed(f"response body exceeds {MAX_RESPONSE_BYTES} bytes")
                chunks.append(chunk)
            return response.status_code, response.headers, b"".join(chunks)

    def _raise_for_status(self, status: int, headers: httpx.Headers, payload: bytes) -> None:
        if 200 <= status < 300:
            return
        detail = f"HTTP {status}: {self._excerpt(payload)}"
        if status == 429:
            retry_after_s = _retry_after_seconds(headers.get("retry-after"))
            if retry_after_s is not None:
                detail = f"HTTP 429 (retry after {retry_after_s:g}s): {self._excerpt(payload)}"
            raise RateLimitedError(detail, status=status, retry_after_s=retry_after_s)
        if status >= 500:
            raise ProviderError("server_error", detail, retryable=True, status=status)
        # Other 4xx (and unfollowed 1xx/3xx): the request itself is wrong; resending won't help.
        raise ProviderError("client_error", detail, retryable=False, status=status)

    def _excerpt(self, payload: bytes) -> str:
        # Redact before truncating, so a cut can never leave part of the key behind.
        text = self._redact(" ".join(payload.decode("utf-8", errors="replace").split()))
        return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."

    def _describe(self, exc: Exception) -> str:
        text = str(exc)
        return self._redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)

    def _redact(self, text: str) -> str:
        return text.replace(self._secret, "[redacted]") if self._secret else text


def _owned_client(timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout_s, verify=_shared_ssl_context())


@functools.cache
def _shared_ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes tens of milliseconds per client; one context serves all.
    return httpx.create_ssl_context()


def _retry_after_seconds(value: str | None) -> float | None:
    # Both OpenAI and Anthropic send delta-seconds; the HTTP-date form is ignored.
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


def expect_object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise malformed(f"{where} is not a JSON object")
    return value


def expect_list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise malformed(f"{where} is not a JSON array")
    return value


def build_tool_call(call_id: object, name: object, arguments: str, where: str) -> ToolCall:
    if not isinstance(call_id, str) or not call_id:
        raise malformed(f"{where} has no id")
    if not isinstance(name, str) or not name:
        raise malformed(f"{where} has no name")
    try:
        return ToolCall(call_id=call_id, name=name, arguments=arguments)
    except ValidationError as exc:
        # Over-long ids, names or arguments: the reply cannot be recorded as an event.
        fields = ", ".join(str(error["loc"][0]) for error in exc.errors())
        raise malformed(f"{where}: invalid {fields}") from None


def build_usage(usage: object, input_key: str, output_key: str) -> Usage:
    """Token counts from an optional usage object; absent counts are zero."""
    if usage is None:
        return Usage()
    fields = expect_object(usage, "usage")
    try:
        return Usage(input_tokens=fields.get(input_key) or 0, output_tokens=fields.get(output_key) or 0)
    except ValidationError:
        raise malformed(f"usage.{input_key}/{output_key} are not non-negative integers") from None


def reply_model(value: object, requested: str) -> str:
    """The model that answered; compatible servers may omit it, then it is the one asked for."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_MODEL_CHARS else requested


def finish_reason(value: object) -> str:
    if not isinstance(value, str) or not value:
        return "unknown"
    return value[:MAX_FINISH_REASON_CHARS]

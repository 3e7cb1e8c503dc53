"""Provider wire-format tests on `httpx.MockTransport`: the real `HttpProvider` and wire
formats, answered from the SDK-shaped fixtures in `fixtures/providers/`, with every request
body checked as the real API would check it (OpenAI: the JSON Schema extracted from the
official OpenAPI document; Anthropic: `anthropic_rules`). A body the API would refuse gets
the API's 400 back, so a test of a whole conversation fails the way production would."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from anthropic_rules import violations as anthropic_violations

from turnstile.events import Usage
from turnstile.handlers.provider import ModelRequest, ProviderError
from turnstile.streams.provider_http import HttpProvider

FIXTURES = Path(__file__).parent / "fixtures"
OPENAI_REQUEST_SCHEMA = json.loads((FIXTURES / "openai_create_chat_completion_request.schema.json").read_text())
_OPENAI_VALIDATOR = jsonschema.Draft202012Validator(OPENAI_REQUEST_SCHEMA)
API_KEY = "sk-test-0123456789abcdef"

Answer = httpx.Response | Callable[[dict[str, Any]], httpx.Response]


def fixture(family: str, name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / "providers" / family / f"{name}.json").read_text())


def openai_violations(body: dict[str, Any]) -> list[str]:
    """What the OpenAPI schema rejects, plus any field it does not define or marks deprecated
    (the schema itself allows unknown fields; the API does not)."""
    found = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _OPENAI_VALIDATOR.iter_errors(body)]
    properties = OPENAI_REQUEST_SCHEMA["properties"]
    for key in body:
        if key not in properties:
            found.append(f"{key}: not a CreateChatCompletionRequest field")
        elif properties[key].get("deprecated"):
            found.append(f"{key}: deprecated in the OpenAPI document")
    return found


def reply(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers)


@dataclass
class MockApi:
    """Answers each request with the next of `answers`; records every body and header set.
    With `check`, a body that breaks the API's rules is answered 400 as the API does."""

    answers: list[Answer] = field(default_factory=list)
    check: Callable[[dict[str, Any]], list[str]] | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[httpx.Headers] = field(default_factory=list)

    def push(self, *answers: Answer) -> None:
        self.answers.extend(answers)

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        self.headers.append(request.headers)
        problems = self.check(body) if self.check else []
        if problems:
            error = {"type": "invalid_request_error", "message": "; ".join(problems)}
            return httpx.Response(400, json={"type": "error", "error": error})
        assert self.answers, f"no answer queued for request #{len(self.bodies)}"
        answer = self.answers.pop(0)
        return answer if isinstance(answer, httpx.Response) else answer(body)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))


def openai_api() -> MockApi:
    return MockApi(check=openai_violations)


def anthropic_api() -> MockApi:
    return MockApi(check=anthropic_violations)


def stream_fixture(family: str, name: str) -> bytes:
    return (FIXTURES / "providers" / family / f"{name}.sse").read_bytes()


def streamed(body: bytes, chunk_bytes: int = 7) -> httpx.Response:
    """A 200 event stream delivered in small pieces, so events and UTF-8 sequences are cut
    across reads as on a real connection."""

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), chunk_bytes):
            yield body[start : start + chunk_bytes]

    return httpx.Response(200, content=pieces(), headers={"content-type": "text/event-stream"})


@dataclass
class Collected:
    """A ReplyStream that records what it was told, in order."""

    seen: list[str] = field(default_factory=list)

    async def delta(self, text: str) -> None:
        self.seen.append(text)

    async def restart(self) -> None:
        self.seen.append("<restart>")


async def billed_usage(api: MockApi, provider: HttpProvider, request: ModelRequest, body: Any) -> Usage | None:
    """The usage the malformed reply `body` is billed with, as its error carries it."""
    api.push(reply(body))
    with pytest.raises(ProviderError) as caught:
        await provider.complete(request)
    assert caught.value.kind == "malformed_response"
    return caught.value.usage


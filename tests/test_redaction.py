"""Secrets never reach the log: the API key, whatever a 200 reply echoes (its text, tool
calls, a streamed reply where the key arrives split over deltas), and tool arguments
declared secret (`SecretStr`), which the tool still receives in clear."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

from pydantic import BaseModel, SecretStr
from wire_harness import API_KEY, Collected, MockApi, fixture, reply, stream_fixture, streamed
from worker_harness import FAST, events_of, running, until

from turnstile.events import ModelResponded, ToolCall, ToolCallStarted, TurnCompleted, TurnPaused
from turnstile.handlers.budget import TurnBudget
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ChatMessage, ModelRequest
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.retry import RetryPolicy
from turnstile.handlers.tools import (
    REDACTED,
    Tool,
    ToolRegistry,
    ValidCall,
    redacted_arguments,
    secret_fields,
    validate_call,
)
from turnstile.streams.file_log import FileLog
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.publisher import message_event, publish

PRICES = {"gpt-4.1": ModelPrice(1.0, 2.0)}  # the model asked (the replies name a dated variant of it)
HELLO = ModelRequest(model="gpt-4.1", messages=(ChatMessage("user", "Hello"),))


def text_reply(text: str) -> dict:
    body = copy.deepcopy(fixture("openai", "text"))
    body["choices"][0]["message"]["content"] = text
    return body


def tool_reply(name: str, arguments: dict) -> dict:
    body = copy.deepcopy(fixture("openai", "parallel_tool_calls"))
    body["choices"][0]["message"]["tool_calls"] = [
        {"id": "call_a1", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    ]
    return body


def on_disk(directory: Path) -> bytes:
    """Every byte of the embedded log: events, outcomes, deltas, dead letters."""
    return b"".join(p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file())


async def run_turn(tmp_path: Path, api: MockApi, tools: ToolRegistry | None = None) -> FileLog:
    log = FileLog(tmp_path)
    async with api.client() as client:
        provider = HttpProvider(OpenAIChat(), "https://api.openai.test/v1", API_KEY, client=client,
                                retry=RetryPolicy(max_retries=0))
        config = dataclasses.replace(FAST, turn=dataclasses.replace(
            FAST.turn, model="gpt-4.1", tools=tools or ToolRegistry(), prices=PRICES
        ))
        async with running(log, provider, config):
            await publish(log, message_event("c1", "what is your key?", 1, "m1"))
            await until(lambda: any(isinstance(e, TurnCompleted) for e in events_of(log, "c1")))
    return log


async def test_a_reply_that_echoes_the_key_is_stored_redacted(tmp_path):
    api = MockApi()
    api.push(reply(text_reply(f"Sure! The key I was called with is {API_KEY}.")))
    log = await run_turn(tmp_path, api)
    assert api.headers[0]["authorization"] == f"Bearer {API_KEY}"  # it was sent...
    assert API_KEY.encode() not in on_disk(tmp_path)  # ...and is nowhere on the log
    [done] = [e for e in events_of(log, "c1") if isinstance(e, TurnCompleted)]
    assert done.reply == "Sure! The key I was called with is [redacted]."


async def test_a_key_in_tool_call_arguments_is_redacted():
    api = MockApi()
    api.push(reply(tool_reply("search", {"q": API_KEY})))
    async with api.client() as client:
        provider = HttpProvider(OpenAIChat(), "https://x.test/v1", API_KEY, client=client)
        got = await provider.complete(HELLO)
    assert [json.loads(c.arguments) for c in got.tool_calls] == [{"q": "[redacted]"}]


async def test_a_key_split_over_streamed_deltas_is_redacted():
    head, tail = API_KEY[:9], API_KEY[9:]
    body = stream_fixture("openai", "stream_text").replace(b'"The 9th"', f'"key: {head}"'.encode())
    body = body.replace(b'" is cheaper."', f'"{tail} -- done"'.encode())
    api = MockApi()
    api.push(streamed(body))
    seen = Collected()
    async with api.client() as client:
        provider = HttpProvider(OpenAIChat(), "https://x.test/v1", API_KEY, client=client)
        got = await provider.complete(HELLO, seen)
    assert got.text == "key: [redacted] -- done"
    assert "".join(seen.seen) == "key: [redacted] -- done" and all(API_KEY[:4] not in s for s in seen.seen)


# -- secret tool arguments ----------------------------------------------------------------------


class Login(BaseModel):
    password: SecretStr
    otp: SecretStr | None = None


class Plain(BaseModel):
    to: str


class SendMail(BaseModel):
    to: str
    body: str
    password: SecretStr
    logins: list[Login] = []


def test_which_fields_are_secret_and_how_they_are_redacted():
    assert secret_fields(SendMail) == {"password": True, "logins": {"password": True, "otp": True}}
    secrets = secret_fields(SendMail)
    sent = json.dumps({"to": "a@b.example", "body": "hi", "password": "hunter2",
                       "logins": [{"password": "p1", "otp": None}, {"password": "p2", "otp": "123"}]})
    assert json.loads(redacted_arguments(secrets, sent)) == {
        "to": "a@b.example", "body": "hi", "password": REDACTED,
        "logins": [{"password": REDACTED, "otp": None}, {"password": REDACTED, "otp": REDACTED}],
    }
    assert "hunter2" not in redacted_arguments(secrets, '{"password": "hunter2"')  # not JSON: redacted whole
    assert redacted_arguments(secret_fields(Plain), sent) == sent  # a model without secrets: as sent


def test_a_valid_call_runs_with_the_secret_and_records_it_redacted():
    async def send(args: SendMail) -> str:
        return "sent"

    registry = ToolRegistry([Tool("send_mail", "Send.", SendMail, send, kind="side_effect")])
    call = ToolCall(call_id="c1", name="send_mail", arguments='{"to": "x", "body": "y", "password": "hunter2"}')
    checked = validate_call(registry, call, isolated=False)
    assert isinstance(checked, ValidCall) and isinstance(checked.arguments, SendMail)
    assert checked.arguments.password.get_secret_value() == "hunter2"
    assert "hunter2" not in checked.call.arguments and REDACTED in checked.call.arguments


async def test_a_secret_tool_argument_is_redacted_on_the_log_and_given_to_the_tool(tmp_path):
    received: list[str] = []

    async def send(args: SendMail) -> str:
        received.append(args.password.get_secret_value())
        return f"sent to {args.to}"

    tools = ToolRegistry([Tool("send_mail", "Send an e-mail.", SendMail, send, kind="side_effect")])
    api = MockApi()
    api.push(reply(tool_reply("send_mail", {"to": "ann@example.com", "body": "hello", "password": "hunter2"})),
             reply(text_reply("Sent.")))
    log = await run_turn(tmp_path, api, tools)
    assert received == ["hunter2"]
    assert b"hunter2" not in on_disk(tmp_path)
    events = events_of(log, "c1")
    [started] = [e for e in events if isinstance(e, ToolCallStarted)]
    assert json.loads(started.arguments) == {"to": "ann@example.com", "body": "hello", "password": REDACTED}
    [asked, _final] = [e for e in events if isinstance(e, ModelResponded)]
    assert [json.loads(c.arguments)["password"] for c in asked.tool_calls] == [REDACTED]


async def test_secret_arguments_of_calls_a_pause_blocked_are_redacted_too(tmp_path):
    async def send(args: SendMail) -> str:
        return f"sent to {args.to}"

    # (a tool that needs approval may not take a secret: the pause here is the tool-call allowance's)
    mail = Tool("send_mail", "Send an e-mail.", SendMail, send, kind="side_effect")
    tools = ToolRegistry([mail])
    body = tool_reply("send_mail", {"to": "ann@example.com", "body": "hello", "password": "hunter2"})
    second = {**body["choices"][0]["message"]["tool_calls"][0], "id": "call_b2"}
    body["choices"][0]["message"]["tool_calls"].append(second)  # over the allowance of one call
    api = MockApi()
    api.push(reply(body))
    log = FileLog(tmp_path)
    async with api.client() as client:
        provider = HttpProvider(OpenAIChat(), "https://api.openai.test/v1", API_KEY, client=client,
                                retry=RetryPolicy(max_retries=0))
        config = dataclasses.replace(FAST, turn=dataclasses.replace(
            FAST.turn, model="gpt-4.1", tools=tools, prices=PRICES,
            budget=TurnBudget(max_tool_calls=1),
        ))
        async with running(log, provider, config):
            await publish(log, message_event("c1", "mail ann", 1, "m1"))
            await until(lambda: any(isinstance(e, TurnPaused) for e in events_of(log, "c1")))
    [paused] = [e for e in events_of(log, "c1") if isinstance(e, TurnPaused)]
    assert [c.call_id for c in paused.blocked_calls] == ["call_b2"]
    assert json.loads(paused.blocked_calls[0].arguments)["password"] == REDACTED
    assert b"hunter2" not in on_disk(tmp_path)

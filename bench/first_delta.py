"""8. Time to first delta: how long after the provider sends the first byte of a streamed
reply a reader of `GET /conversations/{id}/stream` has its first piece of text.

A loopback provider (aiohttp, OpenAI chat-completions event stream) stamps the moment it
writes the first event of each reply; the real worker streams it to the deltas topic; the
real HTTP API serves it; an httpx reader stamps the first `delta` event. Same process,
same clock. Baseline, same run: the provider's first byte to the first delta seen by the
transport itself (`HttpProvider` with a `ReplyStream`, no worker, log or HTTP API).
Measured on the embedded log, and on the broker when one is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from aiohttp import web

from bench.common import Section, fmt, percentile
from bench.kafka import Broker
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.pricing import ModelPrice
from turnstile.handlers.provider import ChatMessage, ModelRequest
from turnstile.handlers.providers.openai_chat import OpenAIChat
from turnstile.handlers.providers.sse import SseDecoder
from turnstile.streams.file_log import FileLog
from turnstile.streams.http_api import HttpServer
from turnstile.streams.kafka_log import KafkaLog
from turnstile.streams.log import EventLog
from turnstile.streams.provider_http import HttpProvider
from turnstile.streams.service import Service
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig

TURNS = 40
PIECES = ["The ", "9th ", "is ", "cheaper."]
GAP_S = 0.005
CONFIG = WorkerConfig(
    debounce=DebouncePolicy(quiet_ms=0, max_wait_ms=0),
    turn=TurnSettings(model="gpt-bench", prices={"gpt-bench": ModelPrice(0.0, 0.0)}),
    commit_interval_s=0.2,
    stream_replies=True,
)


@dataclass
class Provider:
    """Streams every reply; `first_byte[i]` is when it wrote the first event of reply i."""

    first_byte: list[float] = field(default_factory=list)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for index, piece in enumerate(PIECES):
            chunk = {
                "model": "gpt-bench",
                "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}],
            }
            if index:
                await asyncio.sleep(GAP_S)
            else:
                self.first_byte.append(time.perf_counter())
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        end = {"model": "gpt-bench", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await response.write(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
        return response


@contextlib.asynccontextmanager
async def provider_server() -> AsyncIterator[tuple[Provider, str]]:
    provider = Provider()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", provider.complete)
    server = HttpServer(app, "127.0.0.1", 0)
    await server.start()
    try:
        yield provider, f"{server.url}/v1"
    finally:
        await server.stop()


class _FirstDelta:
    def __init__(self) -> None:
        self.at: float | None = None

    async def delta(self, text: str) -> None:
        self.at = self.at or time.perf_counter()

    async def restart(self) -> None:
        return None


async def transport_only() -> list[float]:
    """The baseline: first byte -> the transport's first delta, ms."""
    async with provider_server() as (provider, url):
        http = HttpProvider(OpenAIChat(), url, None)
        out = []
        for _ in range(TURNS):
            first = _FirstDelta()
            await http.complete(ModelRequest("gpt-bench", (ChatMessage("user", "hi"),)), first)
            assert first.at is not None
            out.append((first.at - provider.first_byte[-1]) * 1000)
        await http.aclose()
        return out


async def through_the_engine(log: EventLog) -> list[float]:
    """First byte -> the first `delta` event at an HTTP reader, ms, one conversation per turn."""
    async with provider_server() as (provider, url):
        http = HttpProvider(OpenAIChat(), url, None)
        service = Service(Worker(log, http, CONFIG), http=("127.0.0.1", 0))
        stop, ready = asyncio.Event(), asyncio.Event()
        running = asyncio.create_task(service.run(stop, ready))
        await asyncio.wait_for(ready.wait(), 60)
        out: list[float] = []
        try:
            async with httpx.AsyncClient(base_url=service.url or "", timeout=60) as client:
                await asyncio.sleep(1.0)  # the hub's followers are positioned
                for n in range(TURNS):
                    out.append(await _one_turn(client, provider, f"bench-{uuid.uuid4().hex[:8]}-{n}"))
        finally:
            stop.set()
            await asyncio.wait_for(running, 60)
            await http.aclose()
        return out


async def _one_turn(client: httpx.AsyncClient, provider: Provider, conversation: str) -> float:
    seen_first: float | None = None
    connected = asyncio.Event()

    async def read() -> None:
        nonlocal seen_first
        decoder = SseDecoder()
        async with client.stream("GET", f"/conversations/{conversation}/stream") as response:
            connected.set()
            async for chunk in response.aiter_bytes():
                for event in decoder.feed(chunk):
                    if event.event == "delta" and seen_first is None:
                        seen_first = time.perf_counter()
                    if event.event == "outcome":
                        return

    reading = asyncio.create_task(read())
    await connected.wait()
    before = len(provider.first_byte)
    posted = await client.post(f"/conversations/{conversation}/messages", json={"content": "which day?"})
    assert posted.status_code == 202, posted.text
    await asyncio.wait_for(reading, 60)
    assert seen_first is not None and len(provider.first_byte) == before + 1
    return (seen_first - provider.first_byte[-1]) * 1000


async def first_delta(broker: Broker | None) -> Section:
    section = Section("", ("8. time to first delta, ms", "p50", "p95", "max", "n"))

    def row(label: str, values: list[float]) -> None:
        section.add(label, fmt(percentile(values, 50)), fmt(percentile(values, 95)), fmt(max(values)), str(len(values)))

    row("baseline: provider first byte -> transport's first delta", await transport_only())
    with tempfile.TemporaryDirectory() as folder:
        row(
            "provider first byte -> HTTP reader's first delta (embedded log)",
            await through_the_engine(FileLog(Path(folder))),
        )
    if broker is not None:
        topics = await broker.fresh_topics("first-delta")
        log = KafkaLog(broker.bootstrap, f"bench-first-delta-{uuid.uuid4().hex[:8]}", topics)
        row("provider first byte -> HTTP reader's first delta (Kafka)", await through_the_engine(log))
    section.notes.append(
        f"{TURNS} turns, each its own conversation, reader connected before the message is posted; the reply is "
        f"{len(PIECES)} pieces {GAP_S * 1000:g} ms apart; stamps in one process (time.perf_counter)"
    )
    return section

"""Runs a worker in the test's event loop until a condition on the log holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from turnstile.events import DecodeError, Event, decode
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.provider import Provider
from turnstile.projections import Status
from turnstile.streams.file_log import FileLog
from turnstile.streams.http_api import HttpServer
from turnstile.streams.read_model import ConversationRow, ReadModel
from turnstile.streams.service import Service
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig

FAST = WorkerConfig(
    debounce=DebouncePolicy(quiet_ms=100, max_wait_ms=300),
    turn=TurnSettings(backoff_base_ms=10, backoff_max_ms=20),
    commit_interval_s=0.05,
    drain_grace_s=0.0,  # a test's stop is a crash unless it tests the drain
)


def events_of(log: FileLog, conversation: str | None = None) -> list[Event]:
    out = []
    for record in log.read_all(log.topics.events):
        event = decode(record.value)
        if not isinstance(event, DecodeError) and conversation in (None, event.conversation_id):
            out.append(event)
    return out


@contextlib.asynccontextmanager
async def running(
    log: FileLog, provider: Provider, config: WorkerConfig = FAST, **options: Any
) -> AsyncIterator[Worker]:
    worker = Worker(log, provider, config, **options)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def client_of(server: HttpServer, timeout_s: float = 10) -> AsyncIterator[httpx.AsyncClient]:
    """The HTTP server started, and a client of it; stopped after."""
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url or "", timeout=timeout_s) as client:
            yield client
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def serving(worker: Worker, **options: Any) -> AsyncIterator[tuple[Service, httpx.AsyncClient]]:
    """The worker as a service with its HTTP port on a free loopback port, and a client of it."""
    svc = Service(worker, http=("127.0.0.1", 0), **options)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(svc.run(stop, ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        async with httpx.AsyncClient(base_url=svc.url or "", timeout=10) as client:
            yield svc, client
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


class ReplayCalls:
    """Replay hooks (`Worker(replay_hooks=...)`) that note when replay starts and ends."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def replaying(self) -> None:
        self.calls.append("replaying")

    def replay_slice(self) -> None:
        pass  # told between slices; the order of start and end is what the tests check

    def replayed(self) -> None:
        self.calls.append("replayed")


def every_row(model: ReadModel, limit: int, status: Status | None = None, contains: str = "") -> list[ConversationRow]:
    """Every row of the conversations list, paged through `limit` at a time by its cursors."""
    rows: list[ConversationRow] = []
    cursor = None
    while True:
        page = model.page(limit=limit, status=status, contains=contains, before=cursor)
        rows += page.rows
        if page.next_cursor is None:
            return rows
        cursor = page.next_cursor

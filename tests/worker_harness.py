"""Runs a worker in the test's event loop until a condition on the log holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from turnstile.events import DecodeError, Event, decode
from turnstile.handlers.claim import DebouncePolicy
from turnstile.handlers.provider import Provider
from turnstile.streams.file_log import FileLog
from turnstile.streams.turn_runner import TurnSettings
from turnstile.streams.worker import Worker, WorkerConfig

FAST = WorkerConfig(
    debounce=DebouncePolicy(quiet_ms=100, max_wait_ms=300),
    turn=TurnSettings(backoff_base_ms=10, backoff_max_ms=20),
    commit_interval_s=0.05,
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


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)

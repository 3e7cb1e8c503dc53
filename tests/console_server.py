"""A worker's service run in a thread with its own event loop, for tests whose client
blocks (a browser driven by selenium)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

from turnstile.streams.service import Service
from turnstile.streams.worker import Worker


@contextlib.contextmanager
def served_in_thread(make_worker: Callable[[], Worker], token: str | None = None) -> Iterator[str]:
    """The service's base URL while it runs; stopped (and its errors raised) after."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    url: list[str] = []
    failure: list[BaseException] = []
    stop: list[asyncio.Event] = []

    async def run() -> None:
        service = Service(make_worker(), http=("127.0.0.1", 0), http_token=token)
        stop.append(asyncio.Event())
        ready = asyncio.Event()
        task = asyncio.create_task(service.run(stop[0], ready))
        await asyncio.wait([task, asyncio.create_task(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
        url.append(service.url or "")
        started.set()
        await task

    def main() -> None:
        try:
            loop.run_until_complete(run())
        except BaseException as exc:  # raised in the test's thread below
            failure.append(exc)
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=main, name="console-service", daemon=True)
    thread.start()
    started.wait(30)
    try:
        if failure:
            raise failure[0]
        yield url[0]
    finally:
        if stop:
            loop.call_soon_threadsafe(stop[0].set)
        thread.join(30)
        if failure:
            raise failure[0]

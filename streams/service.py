"""One worker process: the worker, its scheduler and its HTTP port, started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from turnstile.handlers.schedule import Schedule
from turnstile.streams.http_api import HttpServer, build_app
from turnstile.streams.http_reads import BOUNDED_READ_RECORDS, PartitionReads
from turnstile.streams.log import EventLog
from turnstile.streams.metrics import Metrics
from turnstile.streams.read_model import WorkerReadModel
from turnstile.streams.reply_hub import Follow, ReplyHub
from turnstile.streams.scheduler import Scheduler
from turnstile.streams.worker import Worker


def conversation_reader(log: EventLog, max_records: int | None = BOUNDED_READ_RECORDS) -> PartitionReads:
    """How the HTTP views read one conversation from the log, independent of the worker: its
    snapshot and the rest of its partition, refused (`ReadTooLarge`) past `max_records`."""
    return PartitionReads(log.reader(), log.topics, max_records)


# How far back a freshly started reply hub reads both topics: replies that began earlier
# (and are still streaming) are joined from their next delta on.
HUB_LOOKBACK_MS = 10 * 60 * 1000


def reply_hub_sources(log: EventLog, now_ms: int) -> tuple[Follow, Follow]:
    """Followers of the deltas and the events topic for a `ReplyHub`, both read from the same
    moment, so that replies that ended meanwhile are known to have ended."""
    reader, topics, since = log.reader(), log.topics, now_ms - HUB_LOOKBACK_MS
    return (lambda: reader.follow(topics.deltas, since), lambda: reader.follow(topics.events, since))


class Service:
    def __init__(
        self,
        worker: Worker,
        *,
        schedules: Sequence[Schedule] = (),
        http: tuple[str, int] | None = None,
        http_token: str | None = None,
    ) -> None:
        self.worker = worker
        if worker.metrics is None and http is not None:
            worker.measure(Metrics())
        self.scheduler = (
            Scheduler(worker.log, schedules, worker=worker, clock=worker.clock, ids=worker.ids, metrics=worker.metrics)
            if schedules
            else None
        )
        self.http: HttpServer | None = None
        self.hub: ReplyHub | None = None
        self._hub_sources: tuple[Follow, Follow] | None = None
        if http is not None and worker.config.stream_replies:
            self.hub = ReplyHub()
            self._hub_sources = reply_hub_sources(worker.log, worker.clock.now_ms())
        self.read_model: WorkerReadModel | None = None
        if http is not None:
            self.read_model = WorkerReadModel(worker)
            app = build_app(
                worker.log,
                conversation_reader(worker.log),
                worker=worker,
                metrics=worker.metrics,
                clock=worker.clock,
                hub=self.hub,
                token=http_token,
                read_model=self.read_model,
            )
            self.http = HttpServer(app, *http, token=http_token)

    @property
    def url(self) -> str | None:
        return self.http.url if self.http is not None else None

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Until `stop` is set or the worker fails (its error is raised)."""
        inner = asyncio.Event()
        if self.http is not None:
            await self.http.start()
        tasks = [asyncio.create_task(self.worker.run(inner), name="worker")]
        if self.scheduler is not None:
            tasks.append(asyncio.create_task(self.scheduler.run(inner), name="scheduler"))
        hub = None
        if self.hub is not None and self._hub_sources is not None:
            hub = asyncio.create_task(self.hub.run(*self._hub_sources), name="reply-hub")
        stopping = asyncio.create_task(stop.wait())
        if ready is not None:
            ready.set()
        try:
            await asyncio.wait([tasks[0], stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            inner.set()
            stopping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stopping
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if self.http is not None:
                await self.http.stop()
            if hub is not None:
                hub.cancel()
                # A hub that failed (it said so when it did) only cost live readers their stream.
                await asyncio.gather(hub, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

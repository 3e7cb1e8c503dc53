"""Serving a worker until a signal: the one path `turnstile run` (flags or `module:agent`)
and `Agent.serve` share. The log is opened here, inside the running loop, so callers
build their configuration anywhere (aiokafka clients need a running loop)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from turnstile.handlers.pricing import unpriced
from turnstile.handlers.provider import Provider
from turnstile.handlers.schedule import Schedule
from turnstile.streams.eviction import EvictionPolicy
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import EventLog, LogOwned, Topics
from turnstile.streams.worker import Worker, WorkerConfig

if TYPE_CHECKING:
    from turnstile.streams.kafka_log import Membership

log_ = logging.getLogger(__name__)  # `log` is the event log in this module
DEFAULT_DATA = Path(".turnstile")


class WorkerOptions(TypedDict, total=False):
    """`WorkerConfig` fields about the process rather than the agent (`turnstile run` flags)."""

    drain_grace_s: float
    stream_replies: bool
    tracing: bool
    eviction: EvictionPolicy


@dataclass(frozen=True, slots=True)
class LogPlace:
    """Where the log is: a Kafka broker (`kafka://HOST:PORT[,HOST:PORT]` or `HOST:PORT`), or
    else the embedded file log in `data`."""

    broker: str | None = None
    data: Path = DEFAULT_DATA
    topics: Topics = field(default_factory=Topics)
    group: str = "turnstile-worker"
    # Kafka: static membership and session timeout of a worker (default: dynamic, 10 s).
    membership: Membership | None = None

    def __post_init__(self) -> None:
        """A folder may be given as text; an address is checked as `--broker` checks it."""
        object.__setattr__(self, "data", Path(self.data))
        if self.broker:
            from turnstile.streams.cli_errors import broker_url

            try:
                broker_url(self.broker)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(str(exc)) from None

    @property
    def bootstrap(self) -> str | None:
        if not self.broker:
            return None
        from turnstile.streams.kafka_log import bootstrap_of

        return bootstrap_of(self.broker)

    def open(self, group_id: str | None = None) -> EventLog:
        if self.bootstrap is not None:
            from turnstile.streams.kafka_log import KafkaLog, Membership

            membership = self.membership or Membership()
            return KafkaLog(self.bootstrap, group_id=group_id or self.group, topics=self.topics, membership=membership)
        return FileLog(self.data, self.topics)

    def __str__(self) -> str:
        return self.broker or str(self.data)


async def serve(
    place: LogPlace,
    provider: Provider,
    config: WorkerConfig,
    *,
    schedules: Sequence[Schedule] = (),
    http: tuple[str, int] | None = None,
    http_token: str | None = None,
    stop: asyncio.Event | None = None,
    signals: bool = True,
    effective_config: str | None = None,
    notes: Sequence[str] = (),
) -> int:
    """Runs the worker (with its scheduler and HTTP port) until `stop` is set or SIGINT/
    SIGTERM/SIGHUP: the first signal drains, a second stops at once (exit code 130). An embedded
    log another process owns is refused before anything starts (exit code 3). Logs
    `effective_config` (one line, secrets masked: `streams/run_config.py`) once it runs, and
    each of `notes` as a warning.
    Closes the provider and every fallback's provider on the way out."""
    from turnstile.streams.log_storms import limit_client_storms
    from turnstile.streams.replay_progress import ReplayReporter
    from turnstile.streams.replay_progress import report as report_replay
    from turnstile.streams.service import Service
    from turnstile.streams.worker_gc import WorkerGc

    if place.bootstrap is not None:
        limit_client_storms()  # (serve() run from a program's own main, not the CLI, too)
        # A worker on topics that are not there is assigned nothing and looks healthy: said at
        # once (`TopicMissing`, a LookupError) as `turnstile run` says it. The snapshot topics
        # it makes itself.
        from turnstile.streams.kafka_reader import require_topics

        topics = place.topics
        needed = [topics.events, topics.outcomes, topics.dead_letters]
        try:
            await require_topics(place.bootstrap, needed + ([topics.deltas] if config.stream_replies else []))
        except BaseException:
            await _close_providers(provider, config)
            raise
    log = place.open()
    try:
        log.own()  # before anything starts: a second worker on one embedded log must not run at all
    except LogOwned as exc:
        print(f"turnstile run: {exc}", file=sys.stderr)
        await _close_providers(provider, config)
        return 3
    if effective_config is not None:
        log_.info("%s", effective_config)
    for note in notes:
        log_.warning("%s", note)
    turn = config.turn
    for model in unpriced(turn.prices, [turn.model, *(route.model for route in turn.fallbacks)]):
        log_.warning(
            "model %s has no price: its cost is unknown, so each turn on it pauses on its cost budget before"
            " anything more is spent after its first reply; give it one: Model(price=ModelPrice(...)) in an"
            " Agent, [prices.\"%s\"] in turnstile.toml, or run --price %s=INPUT,OUTPUT (USD per million tokens)",
            model,
            model,
            model,
        )
    # Process-wide: the cyclic GC is eased while partitions replay (the replayed state frozen)
    # and, once live, collects every 20,000 allocations rather than every 700.
    worker = Worker(log, provider, config, replay_hooks=WorkerGc())
    service = Service(worker, schedules=schedules, http=http, http_token=http_token)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    # Through the log's formatter, as every other line: `--log-format json` is one object a line.
    reporter = ReplayReporter(lambda line: log_.info("%s", line))
    progress = asyncio.create_task(report_replay(worker, reporter, loop.time))
    ready = asyncio.Event()
    waiting = asyncio.create_task(ready.wait())
    running = asyncio.create_task(service.run(stop, ready))

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            running.cancel()  # the second signal: stop now, the next owner resumes the turns
        else:  # (said: a worker with no turn in flight stopped with not a line before)
            log_.info("%s: stopping; no new turn is claimed, those in flight may take up to %g s to end "
                      "(a second signal stops at once)", sig.name, config.drain_grace_s)  # fmt: skip
        stop.set()

    # SIGHUP (the terminal closed, or a supervisor's stop) drains as SIGTERM does: by default it
    # ended the process at once, with no drain and not a line said (exit 129). Unless it is
    # ignored (`nohup`): a worker started so must outlive its terminal.
    hangup = (signal.SIGHUP,) if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else ()
    handled = (signal.SIGINT, signal.SIGTERM, *hangup) if signals else ()
    for sig in handled:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        try:
            await asyncio.wait([running, waiting], return_when=asyncio.FIRST_COMPLETED)
            if ready.is_set():  # not when the service failed while starting: its error is raised below
                where = f"; HTTP on {service.url}" if service.url else ""
                log_.info("worker running on %s%s; Ctrl-C stops it", place, where)
            await running
            if stop.is_set():
                log_.info("stopped")
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                # Cancelled by its caller (a timeout, a task group, a host framework): the worker
                # stops at once, as on a second signal, and the cancellation goes on to the caller.
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                log_.warning("cancelled: stopped without draining; the turns in flight resume on the next worker")
                raise
            if not running.cancelled():
                raise
            log_.warning("stopped without draining: the turns in flight resume on the next worker")
            return 130
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        waiting.cancel()
        progress.cancel()
        await _close_providers(provider, config)
    return 0


async def _close_providers(provider: Provider, config: WorkerConfig) -> None:
    """The model's provider and every fallback's, each once (they may be one)."""
    providers = {id(p): p for p in (provider, *(r.provider for r in config.turn.fallbacks))}
    for each in providers.values():
        await each.aclose()

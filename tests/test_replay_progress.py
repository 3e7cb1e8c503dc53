"""A long replay says how far it is on stderr (partitions, events, events/s, time left), at
most once a second; a short one says nothing."""

from __future__ import annotations

from worker_harness import FAST, running, until

from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import PartitionStart
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.replay_progress import ReplayReporter, describe
from turnstile.streams.worker import ReplayProgress, Worker


def progress(done: int, total: int = 10_000, replaying: int = 2, partitions: int = 8) -> ReplayProgress:
    return ReplayProgress(partitions, replaying, done, total)


def test_a_replay_shorter_than_two_seconds_prints_nothing():
    said: list[str] = []
    reporter = ReplayReporter(said.append)
    for t, done in ((0.0, 0), (0.5, 3_000), (1.9, 9_000)):
        reporter.observe(progress(done), t)
    reporter.observe(progress(10_000, replaying=0), 2.1)
    assert said == []


def test_a_long_replay_reports_at_most_every_second_then_once_when_live():
    said: list[str] = []
    reporter = ReplayReporter(said.append)
    for t, done in ((0.0, 0), (1.0, 1_000), (2.0, 2_000), (2.25, 2_250), (2.5, 2_500), (3.0, 3_000), (3.5, 3_500)):
        reporter.observe(progress(done), t)
    assert said == [
        "replaying 2 of 8 partitions: 2,000 of 10,000 events, 1,000 events/s, about 8 s left",
        "replaying 2 of 8 partitions: 3,000 of 10,000 events, 1,000 events/s, about 7 s left",
    ]
    reporter.observe(progress(10_000, replaying=0), 10.0)
    assert said[-1] == "replayed 10,000 events of 8 partitions in 10 s; deciding"
    reporter.observe(progress(10_000, replaying=0), 11.0)
    assert len(said) == 3  # said once


def test_a_second_replay_after_a_rebalance_is_timed_on_its_own():
    said: list[str] = []
    reporter = ReplayReporter(said.append)
    reporter.observe(progress(0), 0.0)
    reporter.observe(progress(10_000, replaying=0), 1.0)
    reporter.observe(progress(10_000, total=20_000), 100.0)  # new partitions assigned
    reporter.observe(progress(11_000, total=20_000), 101.0)
    assert said == []
    reporter.observe(progress(12_000, total=20_000), 102.0)
    assert said == ["replaying 2 of 8 partitions: 12,000 of 20,000 events, 1,000 events/s, about 8 s left"]


def test_the_time_left_reads_in_minutes_and_hours():
    assert describe(progress(0, total=1_500_000), 10_000.0).endswith("about 2 min 30 s left")
    assert describe(progress(0, total=100_000_000), 10_000.0).endswith("about 2 h 46 min left")
    assert describe(progress(0), 0.0).endswith("0 events/s")  # stalled: no time left guessed


async def test_the_worker_tells_how_far_its_partitions_are_replayed(tmp_path):
    log = FileLog(tmp_path, partitions=1)
    for i in range(6):
        await publish(log, message_event(f"c{i}", "hello", 1_000, f"m{i}"))
    worker = Worker(log, ScriptedProvider(), FAST)
    await worker.on_assigned({0: PartitionStart(end_offset=6, committed=0)})
    assert worker.replay_progress() == ReplayProgress(1, 1, 0, 6)

    async with running(log, ScriptedProvider()) as live:
        await until(lambda: live.replay_progress().partitions == 1 and live.replay_progress().replaying == 0)
        assert live.replay_progress() == ReplayProgress(1, 0, 6, 6)  # its own turns' events are not replay

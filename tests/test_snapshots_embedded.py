"""Snapshots on the embedded log: a worker that restarts from them rebuilds exactly the state
a full replay of the log gives, reads only the events after them, and falls back to
replaying a conversation whose snapshot is corrupt or missing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import random
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from builders import claim, completed, message, started
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from log_generator import fold, generated_log
from worker_harness import FAST, ReplayCalls, events_of, every_row, running, until

from turnstile.events import DecodeError, Event, ModelResponded, TurnClaimed, TurnCompleted, decode, encode
from turnstile.handlers.providers.scripted import ScriptedProvider
from turnstile.projections import ConversationState
from turnstile.projections.audit import Auditor
from turnstile.streams import snapshots as snapshots_module
from turnstile.streams.eviction import EvictionPolicy, NotLocal
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import PartitionStart
from turnstile.streams.metrics import Metrics
from turnstile.streams.publisher import message_event, publish
from turnstile.streams.read_model import WorkerReadModel
from turnstile.streams.runtime import SystemClock
from turnstile.streams.snapshots import SnapshotPolicy
from turnstile.streams.state_store import StoreClosed
from turnstile.streams.views import ConversationView, state_json
from turnstile.streams.worker import Worker, WorkerConfig

# Every checkpoint snapshots whatever changed (idle_ms=0), as often as commits run.
EAGER = dataclasses.replace(FAST, snapshots=SnapshotPolicy(idle_ms=0))
PARTITIONS = 2
NOW = SystemClock().now_ms


async def _publish(log: FileLog, events: list[Event]) -> None:
    for event in events:
        await log.append(log.topics.events, event.conversation_id, encode(event))


def _log_states(log: FileLog) -> dict[str, ConversationState]:
    events = [e for r in log.read_all(log.topics.events) if not isinstance(e := decode(r.value), DecodeError)]
    return fold(events)


def _ends(log: FileLog) -> dict[int, int]:
    counts = {p: 0 for p in range(PARTITIONS)}
    for record in log.read_all(log.topics.events):
        counts[record.partition] += 1
    return counts


def assert_holds(worker: Worker, states: dict[str, ConversationState]) -> None:
    """The worker holds exactly these conversations, in memory or in its local store."""
    assert set(worker.states) <= set(states)
    assert {c: worker.state_of(c) for c in states} == states


class Run:
    """A worker that claims nothing (it is draining from the start), so the log changes only
    as the test says; it still folds, checkpoints and snapshots."""

    def __init__(self, log: FileLog, config: WorkerConfig = EAGER, metrics: Metrics | None = None) -> None:
        self.worker = Worker(log, ScriptedProvider(), config, metrics=metrics)
        self.worker.draining = True
        self.reads = WorkerReadModel(self.worker)
        self.log = log
        self.task: asyncio.Task[None] | None = None
        self.stop = asyncio.Event()

    async def __aenter__(self) -> Run:
        self.task = asyncio.create_task(self.worker.run(self.stop))
        await self.caught_up()
        return self

    async def caught_up(self) -> None:
        def done() -> bool:
            lag = self.worker.consumer_lag()
            return len(lag) == PARTITIONS and not any(lag.values()) and self.worker.states_local

        await until(done)

    async def snapshots_cover_everything(self) -> None:
        snapshots = self.worker.snapshots
        assert snapshots is not None
        await until(lambda: not any(snapshots.pending(p) for p in range(PARTITIONS)))

    def crash(self) -> None:
        assert self.task is not None
        self.task.cancel()

    async def __aexit__(self, *_: object) -> None:
        assert self.task is not None
        self.stop.set()
        await asyncio.gather(self.task, return_exceptions=True)


def _snapshot_lines(log: FileLog) -> list[Path]:
    return [log.directory / log.topics.snapshots / f"{p}.log" for p in range(PARTITIONS)]


def _corrupt(log: FileLog, rng: random.Random, share: float, state_only: bool = False) -> set[str]:
    """Overwrite the value of some snapshot records in place (the file log never compacts:
    a corrupt record stands for one compaction left as the only one of its key).
    `state_only`: damage the state behind an intact head, which a load reads alone."""
    hit: set[str] = set()
    for path in _snapshot_lines(log):
        if not path.exists():
            continue
        rows = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        for row in rows:
            if row["key"] and rng.random() < share:
                if state_only:  # a snapshot's value is binary (its state is deflated): base64 in the file
                    value = base64.b64decode(row["value_b64"])
                    row["value_b64"] = base64.b64encode(value[:-4] + bytes(4)).decode("ascii")
                else:
                    row.pop("value_b64", None)
                    row["value"] = "not a snapshot"
                hit.add(row["key"])
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return hit


class CountingLog(FileLog):
    """The embedded log, counting the snapshot records (and heads) an assignment reads."""

    snapshot_records_read = 0

    async def read_partitions(self, topic: str, partitions: list[int], starts=None):  # type: ignore[no-untyped-def]
        async for chunk in super().read_partitions(topic, partitions, starts):
            if topic in (self.topics.snapshots, self.topics.heads):
                self.snapshot_records_read += len(chunk)
            yield chunk


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32),
    sizes=st.tuples(st.integers(0, 150), st.integers(0, 80), st.integers(0, 80)),
    stop=st.sampled_from(["crash before catching up", "crash", "clean"]),
    kept_store=st.booleans(),
    damage=st.sampled_from(["none", "corrupt", "missing"]),
)
async def test_a_worker_restarting_from_snapshots_rebuilds_the_state_a_full_replay_gives(
    tmp_path_factory, seed: int, sizes: tuple[int, int, int], stop: str, kept_store: bool, damage: str
) -> None:
    # Given a worker whose local store is temporary or a folder that outlives it, stopped
    # cleanly (a kept store is then checkpointed) or crashed (no checkpoint: not trusted),
    # then more events, and the snapshot topic perhaps damaged meanwhile
    rng = random.Random(seed)
    events = generated_log(rng, 5, sum(sizes))
    a, b = sizes[0], sizes[0] + sizes[1]
    folder = tmp_path_factory.mktemp("log")
    config = EAGER
    if kept_store:
        config = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0, state_dir=folder / "state"))
    log = FileLog(folder, partitions=PARTITIONS)
    await _publish(log, events[:a])
    async with Run(log, config) as first:
        await first.snapshots_cover_everything()
        await _publish(log, events[a:b])  # folded (and perhaps snapshotted) or not, as it happens
        if stop != "crash before catching up":
            await first.caught_up()
        if stop != "clean":
            first.crash()
    if damage == "corrupt":
        _corrupt(log, rng, 0.5)
    elif damage == "missing":
        shutil.rmtree(log.directory / log.topics.snapshots, ignore_errors=True)
    await _publish(log, events[b:])
    # When it starts again (a new process), on the same folder
    log = CountingLog(folder, partitions=PARTITIONS)
    async with Run(log, config) as second:
        # Then it holds exactly what a full replay of the log gives
        assert_holds(second.worker, _log_states(log))
        # and from a kept store after a clean stop it read no snapshot written before that stop
        restarted = kept_store and stop == "clean"
        assert second.worker.snapshots is not None
        assert second.worker.snapshots.restarts == (PARTITIONS if restarted else 0)
        if restarted:
            assert log.snapshot_records_read == 0


async def test_a_restart_reads_only_the_events_after_the_snapshots(tmp_path: Path) -> None:
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(3), 6, 400))
    async with Run(log) as first:
        await first.snapshots_cover_everything()
    ends = _ends(log)
    log = FileLog(tmp_path, partitions=PARTITIONS)
    async with Run(log) as second:
        snapshots = second.worker.snapshots
        assert snapshots is not None and snapshots.seeks == ends  # nothing left to replay
        states = _log_states(log)
        assert_holds(second.worker, states)
        # reads from state see the conversations restored from their snapshots
        for conversation, state in states.items():
            view = second.reads.lookup(conversation)
            assert isinstance(view, ConversationView) and view.state == state
        assert len(second.reads.page(limit=100).rows) == len(states)


@pytest.mark.parametrize("state_only", [False, True], ids=["whole", "state behind its head"])
async def test_a_corrupt_snapshot_is_ignored_counted_and_its_conversation_replayed(
    tmp_path: Path, caplog, state_only: bool
) -> None:
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(5), 6, 300))
    async with Run(log) as first:
        await first.snapshots_cover_everything()
    corrupted = _corrupt(log, random.Random(1), 1.0, state_only)
    assert corrupted
    log = FileLog(tmp_path, partitions=PARTITIONS)
    metrics = Metrics()
    async with Run(log, metrics=metrics) as second:
        # (those with something to decide at the load, from offset 0; the others once the
        # background pass finds their snapshots unusable, each folded from the log)
        snapshots = second.worker.snapshots
        assert snapshots is not None and snapshots.ignored == len(corrupted)
        assert b"turnstile_snapshots_ignored_total %.1f" % len(corrupted) in metrics.exposition()
        assert_holds(second.worker, _log_states(log))
    assert "are not where their heads say" in caplog.text


class BreakingLog(FileLog):
    """The embedded log, whose heads topic (what a load with a local store reads) breaks after
    handing over its first chunk."""

    async def read_partitions(self, topic: str, partitions: list[int], starts=None):  # type: ignore[no-untyped-def]
        async for chunk in super().read_partitions(topic, partitions, starts):
            yield chunk
            if topic == self.topics.heads:
                raise OSError("the heads topic went away mid-read")


async def test_a_snapshot_read_that_breaks_midway_replays_everything_from_the_log(tmp_path: Path, caplog) -> None:
    # Given snapshots of every conversation on both partitions
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(8), 6, 300))
    async with Run(log) as first:
        await first.snapshots_cover_everything()
    # When a new owner's read of them breaks after one partition's chunk was taken in
    broken = BreakingLog(tmp_path, partitions=PARTITIONS)
    async with Run(broken) as second:
        # Then no partition starts from the half-read snapshots: both replay from 0, and the
        # worker holds exactly what the log folds to
        snapshots = second.worker.snapshots
        assert snapshots is not None and snapshots.seeks == {p: 0 for p in range(PARTITIONS)}
        assert_holds(second.worker, _log_states(broken))
    assert "went away mid-read" in caplog.text


async def test_loading_snapshots_is_part_of_the_replay_the_hooks_are_told_of(tmp_path: Path) -> None:
    # Given a log whose every event a snapshot covers
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(3), 4, 120))
    async with Run(log) as first:
        await first.snapshots_cover_everything()
    # when a new worker takes the partitions over (nothing left to fold after the snapshots)
    second = Run(FileLog(tmp_path, partitions=PARTITIONS))
    hooks = ReplayCalls()
    second.worker.pace.hooks = hooks
    async with second:
        pass
    # then its hooks heard of the load as a replay: the collector is held while it decodes
    assert hooks.calls == ["replaying", "replayed"]
    assert second.worker.snapshots is not None and second.worker.snapshots.seeks == _ends(log)


async def test_without_snapshots_the_worker_replays_from_the_beginning(tmp_path: Path) -> None:
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(8), 4, 200))
    off = dataclasses.replace(EAGER, snapshots=SnapshotPolicy(enabled=False))
    async with Run(log, off) as first:
        assert first.worker.snapshots is None
    assert not any(path.exists() for path in _snapshot_lines(log))
    async with Run(FileLog(tmp_path, partitions=PARTITIONS)) as second:
        snapshots = second.worker.snapshots
        assert snapshots is not None and snapshots.seeks == {p: 0 for p in range(PARTITIONS)}
        assert_holds(second.worker, _log_states(log))


async def test_a_message_for_an_evicted_conversation_is_claimed_once_and_every_rule_holds(tmp_path: Path) -> None:
    """Every conversation leaves memory as soon as its settled state is snapshotted; each new
    message brings it back from the local store, and its turn sees the whole history."""
    config = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0))
    log = FileLog(tmp_path, partitions=PARTITIONS)
    rounds, conversations = 3, 6
    async with running(log, ScriptedProvider(), config) as worker:
        evictor = worker.evictor
        assert evictor is not None
        for round_ in range(rounds):
            for i in range(conversations):
                await publish(log, message_event(f"c{i}", f"question {round_} of {i}", NOW(), f"c{i}-m{round_}"))
            done = conversations * (round_ + 1)
            await until(lambda: sum(isinstance(e, TurnCompleted) for e in events_of(log)) == done)  # noqa: B023
            await until(lambda: evictor.evictions >= done and not worker.states)  # noqa: B023
        assert evictor.reloads >= conversations * (rounds - 1)
    events = events_of(log)
    claims = Counter(i for e in events if isinstance(e, TurnClaimed) for i in e.input_ids)
    assert sorted(claims) == sorted(f"c{i}-m{r}" for i in range(conversations) for r in range(rounds))
    assert set(claims.values()) == {1}
    report = Auditor().feed_all(log.read_all(log.topics.events)).report()
    assert report.ok, report
    # each later turn was claimed at the full history length: its state came back whole
    boundaries = sorted(e.history_boundary for e in events if isinstance(e, TurnClaimed))
    assert boundaries == sorted(2 * r for r in range(rounds) for _ in range(conversations))


async def test_after_a_clean_stop_a_restart_on_its_store_reads_no_snapshot_and_no_event(tmp_path: Path) -> None:
    stored = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0, state_dir=tmp_path / "state"))
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(5), 6, 400))
    async with Run(log, stored) as first:
        await first.snapshots_cover_everything()
    ends = _ends(log)
    log = CountingLog(tmp_path, partitions=PARTITIONS)
    async with Run(log, stored) as second:
        snapshots = second.worker.snapshots
        assert snapshots is not None and snapshots.seeks == ends and log.snapshot_records_read == 0
        states = _log_states(log)
        assert_holds(second.worker, states)
        assert len(second.reads.page(limit=100).rows) == len(states)  # listed, though not decoded
    # And a crash of this second run takes the checkpoint with it: the next start reads the topic
    log = CountingLog(tmp_path, partitions=PARTITIONS)
    async with Run(log, stored) as third:
        third.crash()
    log = CountingLog(tmp_path, partitions=PARTITIONS)
    async with Run(log, stored) as fourth:
        assert fourth.worker.snapshots is not None and fourth.worker.snapshots.restarts == 0
        assert log.snapshot_records_read > 0
        assert_holds(fourth.worker, _log_states(log))


async def test_a_store_kept_across_a_log_recreated_from_scratch_is_not_trusted(tmp_path: Path) -> None:
    # Given a worker stopped cleanly (its store checkpointed) on a log that is then deleted
    # and made again, with fewer records than its store covers (topics recreated; a move to
    # another cluster), when it starts on the new log with the same store
    stored = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0, state_dir=tmp_path / "state"))
    log = FileLog(tmp_path / "log", partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(5), 6, 400))
    async with Run(log, stored) as first:
        await first.snapshots_cover_everything()
    shutil.rmtree(tmp_path / "log")
    log = FileLog(tmp_path / "log", partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(6), 6, 60))
    async with Run(log, stored) as second:
        # then it holds what the new log gives, not what the store said of the old one
        assert second.worker.snapshots is not None and second.worker.snapshots.restarts == 0
        assert_holds(second.worker, _log_states(log))
        await second.snapshots_cover_everything()
    # and snapshots the new log's partitions anew: a restart starts from them
    ends = _ends(log)
    log = CountingLog(tmp_path / "log", partitions=PARTITIONS)
    async with Run(log, stored) as third:
        assert third.worker.snapshots is not None and third.worker.snapshots.seeks == ends
        assert_holds(third.worker, _log_states(log))


async def test_snapshots_broken_at_a_first_start_are_not_forgotten_by_a_restart_on_its_store(tmp_path: Path) -> None:
    # Given a log whose every snapshot is broken when a worker with a kept store first starts
    stored = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0, state_dir=tmp_path / "state"))
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, generated_log(random.Random(8), 6, 300))
    async with Run(log) as writer:
        await writer.snapshots_cover_everything()
    _corrupt(log, random.Random(1), 1.0)
    log = FileLog(tmp_path, partitions=PARTITIONS)
    async with Run(log, stored) as first:  # every conversation folded from offset 0, then snapshotted
        assert first.worker.snapshots is not None and first.worker.snapshots.ignored > 0
        await first.snapshots_cover_everything()
    # When it restarts on its checkpointed store
    log = CountingLog(tmp_path, partitions=PARTITIONS)
    async with Run(log, stored) as second:
        # Then it holds what a full replay gives, from its store
        assert second.worker.snapshots is not None and second.worker.snapshots.restarts == PARTITIONS
        assert_holds(second.worker, _log_states(log))


async def test_a_capture_cut_short_goes_on_at_the_next_steps_not_a_commit_later(tmp_path: Path) -> None:
    """One snapshot a capture, one commit in 30 s: all 12 are written long before the next."""
    policy = SnapshotPolicy(idle_ms=0, max_per_checkpoint=1)
    config = dataclasses.replace(EAGER, snapshots=policy, commit_interval_s=30.0)
    log = FileLog(tmp_path, partitions=PARTITIONS)
    await _publish(log, [message_event(f"c{i}", "hello", NOW(), f"m{i}") for i in range(12)])
    async with Run(log, config) as run:
        snapshots = run.worker.snapshots
        assert snapshots is not None
        await until(lambda: snapshots.written == 12, timeout_s=10)
        assert not snapshots.behind


class _SmallSnapshotTopic(FileLog):
    """A snapshot topic whose limit is 3,000 bytes (as one made with a small max.message.bytes)."""

    def max_value_bytes(self, topic: str, key: str | None) -> int:
        return 3_000 if topic == self.topics.snapshots else super().max_value_bytes(topic, key)


async def test_a_conversation_too_large_to_snapshot_is_tried_once_and_holds_up_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given one conversation whose state is over the snapshot topic's limit, changed first,
    # and twelve small ones behind it, one snapshot a capture
    encoded: Counter[str] = Counter()
    real = snapshots_module.encode_snapshot

    def counting(state: ConversationState, covered: int) -> bytes:
        encoded[state.conversation_id] += 1
        return real(state, covered)

    monkeypatch.setattr(snapshots_module, "encode_snapshot", counting)
    log = _SmallSnapshotTopic(tmp_path, partitions=PARTITIONS)
    rng = random.Random(7)
    noise = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(20_000))
    await _publish(log, [message_event("big", noise, NOW(), "m-big")])
    await _publish(log, [message_event(f"c{i}", "hello", NOW(), f"m{i}") for i in range(12)])
    policy = SnapshotPolicy(idle_ms=0, max_per_checkpoint=1)
    async with Run(log, dataclasses.replace(EAGER, snapshots=policy)) as run:
        snapshots = run.worker.snapshots
        assert snapshots is not None
        # Then every small one is snapshotted, and the large one was encoded once, not at
        # every capture (a core's worth of work, and the capture's time bound used up)
        await until(lambda: snapshots.written == 12, timeout_s=20)
        # and while it goes on changing, captures pass over it without encoding it again
        beside = [c for c in (f"d{n}" for n in range(200)) if log.partition_for(c) == log.partition_for("big")][:4]
        for n, conversation in enumerate(beside, start=13):
            await _publish(log, [message_event("big", "and more", NOW(), f"m-big-{n}"),
                                 message_event(conversation, "hello", NOW(), f"m-{conversation}")])  # fmt: skip
            await until(lambda n=n: snapshots.written == n, timeout_s=20)
        assert encoded["big"] == 1


async def test_a_conversation_too_large_only_while_its_turn_ran_is_snapshotted_once_the_turn_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a turn whose journal (a long reply of the model's) puts its conversation over
    # the snapshot topic's limit while it runs
    log = _SmallSnapshotTopic(tmp_path, partitions=PARTITIONS)
    rng = random.Random(11)
    noise = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(20_000))
    c = claim(["m1"], NOW(), 0, conv="long")
    step = ModelResponded(event_id="e-step", conversation_id="long", occurred_at=NOW(), turn_id=c.turn_id,
                          run_id=c.run_id, attempt=1, iteration=1, model="m", text=noise)  # fmt: skip
    await _publish(log, [message("m1", NOW(), conv="long"), c, started(c, NOW()), step])
    async with Run(log) as run:
        snapshots = run.worker.snapshots
        assert snapshots is not None
        await until(lambda: "no snapshot of 'long'" in caplog.text)  # (too large: not written)
        assert snapshots.written == 0
        # When the turn ends (its journal leaves the state), then its snapshot is written
        await _publish(log, [completed(c, NOW(), reply="Done.")])
        await until(lambda: snapshots.written == 1, timeout_s=20)


@contextlib.asynccontextmanager
async def _restarted_on_its_store(tmp_path: Path, seed: int, conversations: int, events: int) -> AsyncIterator[Run]:
    """A generated log, snapshotted whole by a first worker with a kept local store, and the
    second worker that starts on that store (its idle conversations out of memory)."""
    stored = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0, state_dir=tmp_path / "state"))
    await _publish(FileLog(tmp_path, partitions=PARTITIONS), generated_log(random.Random(seed), conversations, events))
    async with Run(FileLog(tmp_path, partitions=PARTITIONS), stored) as first:
        await first.snapshots_cover_everything()
    async with Run(FileLog(tmp_path, partitions=PARTITIONS), stored) as second:
        yield second


async def test_a_restart_pages_through_its_stored_conversations_each_once_and_one_that_moves_comes_first(
    tmp_path: Path,
) -> None:
    """The conversations that wait in the local store from the start are listed by the store,
    beside those in memory: a client paging through them sees each once, and one that folds
    an event is listed again, first, and only there."""
    async with _restarted_on_its_store(tmp_path, 11, 30, 600) as second:
        log = second.log
        states = _log_states(log)

        def walk(limit: int) -> list[str]:
            return [row.conversation_id for row in every_row(second.reads, limit)]

        assert second.worker.states.keys() < states.keys()  # some wait in the store
        listed = walk(limit=4)
        assert sorted(listed) == sorted(states) and walk(limit=1) == listed
        stays = next(c for c in reversed(listed) if c not in second.worker.states)
        await _publish(log, [message_event(stays, "back again", NOW(), "back-1")])
        await second.caught_up()
        again = walk(limit=4)
        assert again[0] == stays and sorted(again) == sorted(states)
        assert second.reads.page(status="debouncing").rows[0].conversation_id == stays


async def test_after_a_restart_every_conversation_still_lists_every_turn_it_had(tmp_path: Path) -> None:
    """The turns folded before the snapshots a worker starts from are listed from the state
    (inputs, outcome, attempts; what the state does not keep is null), in claim order, in the
    conversation's JSON and in the list's count, whether it is in memory or in the store."""
    async with _restarted_on_its_store(tmp_path, 7, 12, 500) as second:
        states = _log_states(second.log)
        rows = {row.conversation_id: row.turns for row in second.reads.page(limit=500).rows}
        assert sum(len(state.turns) for state in states.values()) > 0
        for conversation, state in states.items():
            view = second.reads.lookup(conversation)
            assert isinstance(view, ConversationView)
            listed = state_json(view)["turns"]
            active = [] if state.active is None else [state.active.turn_id]
            assert [t["turn_id"] for t in listed] == [*state.turns, *active]
            for turn in listed[: len(state.turns)]:
                record = state.turns[turn["turn_id"]]
                assert (turn["outcome"], turn["attempts"], turn["input_ids"]) == (
                    record.outcome, record.attempts, list(record.input_ids),
                )  # fmt: skip
                assert turn["iterations"] is None and turn["claimed_at"] is None
            assert rows[conversation] == len(listed)


class LateAssignment(FileLog):
    """The embedded log assigning as Kafka's group does: later than `start`, from a task of
    its own (the test plays it), whose read of the heads waits for `gate`."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, partitions=PARTITIONS)
        self.listener: Any = None
        self.reading_heads, self.gate = asyncio.Event(), asyncio.Event()

    async def start(self, listener: Any) -> None:
        self.listener = listener
        await super().start(_NothingYet())

    async def read_partitions(self, topic: str, partitions: list[int], starts=None):  # type: ignore[no-untyped-def]
        if topic == self.topics.heads:
            self.reading_heads.set()
            await self.gate.wait()
        async for chunk in super().read_partitions(topic, partitions, starts):
            yield chunk


class _NothingYet:
    async def on_assigned(self, partitions: dict[int, PartitionStart]) -> dict[int, int]:
        return {}

    async def on_revoked(self, partitions: set[int]) -> None:
        return None


async def _started_with_a_store(
    log: LateAssignment, state_dir: Path, config: WorkerConfig | None = None
) -> tuple[Worker, asyncio.Event, asyncio.Task[None]]:
    """A worker with a local store running on `log` (a few messages on it), not assigned yet."""
    await _publish(log, [message_event(f"c{n}", "hi", NOW(), f"m{n}") for n in range(4)])
    config = config or dataclasses.replace(EAGER, eviction=EvictionPolicy(state_dir=state_dir))
    worker = Worker(log, ScriptedProvider(), config)
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await until(lambda: log.listener is not None)
    return worker, stop, run


async def test_a_stop_while_an_assignment_loads_its_heads_takes_nothing_and_leaves_the_store_closed(
    tmp_path: Path,
) -> None:
    log = LateAssignment(tmp_path / "log")
    worker, stop, run = await _started_with_a_store(log, tmp_path / "state")
    # The group assigns both partitions; the load of their heads is under way...
    assignment = asyncio.create_task(log.listener.on_assigned({p: PartitionStart(2, 0) for p in range(PARTITIONS)}))
    await log.reading_heads.wait()
    # ...when the worker is stopped: its loop ends and it closes its local store.
    stop.set()
    await run
    log.gate.set()
    # The assignment ends without an error (a failed one would make the stop fail) and takes
    # nothing: no partition, and the closed store is not written (or opened) again.
    assert await assignment == {}
    assert worker.partition_liveness() == {}
    store = worker.stored_listing
    assert store is not None and store.closed
    with pytest.raises(StoreClosed):
        len(store)


async def test_a_revoke_and_an_assignment_after_the_stop_change_nothing_and_do_not_fail(tmp_path: Path) -> None:
    log = LateAssignment(tmp_path / "log")
    log.gate.set()
    _worker, stop, run = await _started_with_a_store(log, tmp_path / "state")
    ends = {p: PartitionStart(log.end_offset(p), 0) for p in range(PARTITIONS)}
    assert set(await log.listener.on_assigned(ends)) == set(range(PARTITIONS))
    await log.listener.on_revoked(set(range(PARTITIONS)))
    stop.set()
    await run
    # The group's next rebalance comes after the loop ended (the log stops after the worker):
    # neither its revoke nor its assignment touches the closed store, and neither fails.
    await log.listener.on_revoked(set(range(PARTITIONS)))
    assert await log.listener.on_assigned({}) == {}


async def test_a_read_of_a_stored_conversation_once_the_worker_stopped_is_refused_as_not_here(tmp_path: Path) -> None:
    config = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0))
    log = FileLog(tmp_path, partitions=PARTITIONS)
    async with running(log, ScriptedProvider(), config) as worker:
        evictor = worker.evictor
        assert evictor is not None
        await publish(log, message_event("c0", "hello", NOW(), "m1"))
        await until(lambda: evictor.evictions >= 1 and not worker.states)
        stored = worker.state_of("c0")  # out of memory: read from the local store
        assert stored is not None and len(stored.turns) == 1
    # Its store is closed: a read (an HTTP GET while the service stops) is told the state is
    # not here -- the HTTP port answers 503 -- rather than failing on the closed store.
    with pytest.raises(NotLocal, match="the worker is stopping"):
        worker.state_of("c0")


class CutOffHeads(LateAssignment):
    """`LateAssignment` whose first read of the heads stops after its first chunk, for good
    (until the test cancels the assignment, as a rebalance does on Kafka)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.gate.set()
        self.cut = asyncio.Event()

    async def read_partitions(self, topic: str, partitions: list[int], starts=None):  # type: ignore[no-untyped-def]
        async for chunk in super().read_partitions(topic, partitions, starts):
            yield chunk
            if topic == self.topics.heads and not self.cut.is_set():
                self.cut.set()
                await asyncio.Event().wait()


async def test_a_load_cut_off_by_a_rebalance_leaves_the_store_checkpoint_for_the_next_load(tmp_path: Path) -> None:
    # Given a store checkpointed by a clean stop, and heads written after it by another worker
    stored = dataclasses.replace(EAGER, eviction=EvictionPolicy(idle_ms=0, state_dir=tmp_path / "state"))
    await _publish(FileLog(tmp_path / "log", partitions=PARTITIONS), generated_log(random.Random(3), 8, 300))
    async with Run(FileLog(tmp_path / "log", partitions=PARTITIONS), stored) as first:
        await first.snapshots_cover_everything()
    log = CutOffHeads(tmp_path / "log")
    await _publish(log, [message_event(f"gen-{i}", "again", NOW(), f"again-{i}") for i in range(0, 8, 2)])
    async with Run(FileLog(tmp_path / "log", partitions=PARTITIONS)) as other:
        await other.snapshots_cover_everything()
    # When the worker restarting on that store has its load cut off by a rebalance midway
    # (some heads after the checkpoint already in its rows)...
    worker, stop, run = await _started_with_a_store(log, tmp_path / "state", stored)
    worker.draining = True  # it claims nothing: the log changes only as the test says
    starts = {p: PartitionStart(log.end_offset(p), 0) for p in range(PARTITIONS)}
    abandoned = asyncio.create_task(log.listener.on_assigned(starts))
    await log.cut.wait()
    abandoned.cancel()
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    await log.listener.on_revoked(set(range(PARTITIONS)))
    assert worker.partition_liveness() == {}  # nothing of it taken
    # ...then the next assignment starts from the checkpoint still, and holds what the log says
    for p, offset in (await log.listener.on_assigned(starts)).items():
        log.seek(p, offset)
    snapshots = worker.snapshots
    assert snapshots is not None and snapshots.restarts == PARTITIONS
    await until(lambda: all(worker.partition_liveness().values()) and worker.states_local)
    assert_holds(worker, _log_states(log))
    stop.set()
    await run

"""A snapshot capture runs on the event loop, where every other task (HTTP reads, turns)
waits for it: it is bounded in time, and what it leaves is captured at the next steps."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from builders import message

from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.projections.snapshot import WATERMARK_KEY, decode_snapshot, decode_watermark
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Acknowledged, Record
from turnstile.streams.snapshots import SnapshotPolicy, Snapshotter
from turnstile.streams.state_store import StateStore


async def _taken(snapshots: Snapshotter) -> None:
    """Partition 0 loaded and taken, as the worker's assignment does it."""
    loaded = await snapshots.load([0])
    snapshots.taken(0, loaded[0])


async def test_a_capture_stops_at_its_time_bound_and_the_next_ones_go_on_where_it_stopped(tmp_path: Path) -> None:
    log = FileLog(tmp_path, partitions=1)
    ticks = itertools.count()
    # Every look at the clock is 1 ms later; the bound is 3.5 ms: three snapshots a capture.
    snapshots = Snapshotter(
        log, SnapshotPolicy(idle_ms=0, max_capture_s=0.0035), lambda: 0, monotonic=lambda: next(ticks) / 1000
    )
    await _taken(snapshots)
    states: dict[str, ConversationState] = {}
    for offset in range(10):
        conversation, event = f"c{offset}", message(f"m{offset}", 10, conv=f"c{offset}")
        states[conversation] = state = new_state(conversation)
        assert apply_event(state, event) is None
        snapshots.folded(Record(0, offset, conversation.encode(), b""), event, state, None)

    written = []
    while True:
        snapshots.checkpoint({0: 10}, {0: 10}, 0, states.get, lambda _c: True)
        await snapshots.drain()
        written.append(snapshots.written)
        if not snapshots.behind:
            break
    assert written == [3, 6, 9, 10]
    on_topic = {r.key.decode(): decode_snapshot(r.value) for r in log.read_all(log.topics.snapshots) if r.key}
    assert on_topic.keys() == states.keys() and not snapshots.pending(0)
    # The final capture of a stop has no bound: everything changed is due at once.
    for offset in range(10, 15):
        state = states[f"c{offset - 10}"]
        event = message(f"again-{offset}", 20, conv=state.conversation_id)
        assert apply_event(state, event) is None
        snapshots.folded(Record(0, offset, state.conversation_id.encode(), b""), event, state, None)
    snapshots.checkpoint({0: 15}, {0: 15}, 0, states.get, lambda _c: True, final=True)
    await snapshots.drain()
    assert snapshots.written == 15 and not snapshots.behind


class RefusingLog(FileLog):
    """The broker refuses the first snapshot write of one conversation."""

    def __init__(self, path: Path, refused: str) -> None:
        super().__init__(path, partitions=1)
        self.refused: str | None = refused

    async def send(
        self, topic: str, key: str, value: bytes, partition: int | None = None
    ) -> asyncio.Future[Acknowledged]:
        if topic == self.topics.snapshots and key == self.refused:
            self.refused = None
            raise OSError("the broker is briefly unavailable")
        return await super().send(topic, key, value, partition)


def _watermarks(log: FileLog) -> list[int]:
    return [w for r in log.read_all(log.topics.snapshots) if r.key == WATERMARK_KEY.encode()
            and isinstance(w := decode_watermark(r.value), int)]  # fmt: skip


async def test_a_snapshot_the_broker_refused_holds_the_watermark_below_its_events_though_newer_changes_came_first(
    tmp_path: Path,
) -> None:
    """A watermark says every conversation with an event below it has a snapshot of it: a
    refused snapshot is due again with its first event, older than changes made meanwhile."""
    log = RefusingLog(tmp_path, refused="a")
    snapshots = Snapshotter(log, SnapshotPolicy(idle_ms=0), lambda: 0)
    await _taken(snapshots)
    states = {c: new_state(c) for c in ("a", "b")}

    def fold(offset: int, conversation: str) -> None:
        event = message(f"m{offset}", 10, conv=conversation)
        assert apply_event(states[conversation], event) is None
        snapshots.folded(Record(0, offset, conversation.encode(), b""), event, states[conversation], None)

    fold(0, "a")
    snapshots.checkpoint({0: 1}, {0: 1}, 0, states.get, lambda _c: True)  # captures a; its write is refused
    fold(1, "b")  # a change made while that write is in flight
    await snapshots.drain()
    assert snapshots.written == 0 and snapshots.pending(0)
    # Neither can be taken now (the worker owes something for both): the watermark is a's event.
    snapshots.checkpoint({0: 2}, {0: 2}, 0, states.get, lambda _c: False)
    await snapshots.drain()
    assert _watermarks(log) == []
    snapshots.checkpoint({0: 2}, {0: 2}, 0, states.get, lambda _c: True)
    await snapshots.drain()
    assert snapshots.written == 2 and _watermarks(log) == [2]


async def test_conversations_in_use_at_the_front_do_not_use_up_a_capture_bound_the_due_ones_need(
    tmp_path: Path,
) -> None:
    log = FileLog(tmp_path, partitions=1)
    ticks = itertools.count()
    clock_ms = 0
    # Every look at the clock is 1 ms later; the bound is 3.5 ms: three snapshots a capture.
    snapshots = Snapshotter(
        log, SnapshotPolicy(idle_ms=1_000, max_capture_s=0.0035), lambda: clock_ms,
        monotonic=lambda: next(ticks) / 1000,
    )  # fmt: skip
    await _taken(snapshots)
    states: dict[str, ConversationState] = {}
    offsets = itertools.count()

    def fold(conversation: str) -> None:
        offset = next(offsets)
        event = message(f"m{offset}", 10, conv=conversation)
        state = states.setdefault(conversation, new_state(conversation))
        assert apply_event(state, event) is None
        snapshots.folded(Record(0, offset, conversation.encode(), b""), event, state, None)

    busy, quiet = [f"busy-{i}" for i in range(10)], [f"quiet-{i}" for i in range(3)]
    for conversation in busy + quiet:  # the busy ones' first changes are the oldest
        fold(conversation)
    clock_ms = 5_000
    for conversation in busy:  # ... and they are still in use
        fold(conversation)
    clock_ms = 5_500
    end = next(offsets)
    snapshots.checkpoint({0: end}, {0: end}, clock_ms, states.get, lambda _c: True)
    await snapshots.drain()
    on_topic = {r.key.decode() for r in log.read_all(log.topics.snapshots) if r.key and r.key != WATERMARK_KEY.encode()}
    assert on_topic == set(quiet)


async def test_only_a_worker_that_loaded_the_heads_vouches_for_them_with_a_watermark(tmp_path: Path) -> None:
    """A worker without a local store loads the snapshot topic, where a conversation
    snapshotted before heads existed has no head: its watermark goes to the snapshot topic
    only, or a new owner reading the heads would skip that conversation's events."""
    for with_store in (False, True):
        log = FileLog(tmp_path / str(with_store), partitions=1)
        store = StateStore(tmp_path / f"store-{with_store}", "events") if with_store else None
        snapshots = Snapshotter(log, SnapshotPolicy(idle_ms=0), lambda: 0, store)
        await _taken(snapshots)
        state = new_state("a")
        event = message("m0", 10, conv="a")
        assert apply_event(state, event) is None
        snapshots.folded(Record(0, 0, b"a", b""), event, state, None)
        snapshots.checkpoint({0: 1}, {0: 1}, 0, {"a": state}.get, lambda _c: True)
        await snapshots.drain()
        heads = [r.key for r in log.read_all(log.topics.heads)]
        assert _watermarks(log) == [1]  # on the snapshot topic either way, and a head for a
        assert heads == ([b"a", WATERMARK_KEY.encode()] if with_store else [b"a"])
        if store is not None:
            store.close()

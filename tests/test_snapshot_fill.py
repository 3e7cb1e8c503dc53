"""The snapshots a new owner did not fetch to go live (`streams/snapshot_fill.py`): filled
into the local store in the background, or brought by one point read when an event of the
conversation comes first, or -- a snapshot not where its head says -- the conversation
folded from its partition's events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
from builders import claim, completed, message, started
from worker_harness import until

from turnstile.events import Event, encode
from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.projections.snapshot import encode_snapshot
from turnstile.projections.snapshot_head import Head, encode_head, head_of
from turnstile.streams import snapshot_fill
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Record
from turnstile.streams.snapshot_fill import RETRY_MAX_S, RETRY_S, SnapshotFill, retried
from turnstile.streams.state_store import StateStore, Stored, Unfilled


def _events(conversation: str) -> list[Event]:
    m = message("m1", 1_000, f"hello from {conversation}", conv=conversation)
    c = claim(["m1"], 1_001, 0, conv=conversation)
    return [m, c, started(c, 1_002), completed(c, 1_003, reply=f"hi {conversation}")]


class Written:
    """Conversations on a one-partition embedded log as a worker leaves them: their events,
    then each one's snapshot and its head; in the store, their heads only (unfilled rows)."""

    def __init__(self, tmp_path: Path) -> None:
        self.log = FileLog(tmp_path / "log", partitions=1)
        self.store = StateStore(tmp_path, "events")
        self.states: dict[str, ConversationState] = {}
        self.snapshots: dict[str, bytes] = {}
        self.lost: list[str] = []
        self.installed: dict[str, tuple[ConversationState, int]] = {}

    async def write(self, conversations: list[str]) -> None:
        for conversation in conversations:
            state = self.states[conversation] = new_state(conversation)
            for event in _events(conversation):
                _, covered = await self.log.append(self.log.topics.events, conversation, encode(event), 0)
                assert apply_event(state, event) is None
        for conversation, state in self.states.items():
            covered = self.log.end_offset(0) - 1
            value = self.snapshots[conversation] = encode_snapshot(state, covered)
            _, at = await self.log.append(self.log.topics.snapshots, conversation, value, 0)
            head = head_of(state, covered, at)
            _, source = await self.log.append(self.log.topics.heads, conversation, encode_head(head), 0)
            self.store.put([Stored(head, 0, source, None)])

    @contextlib.asynccontextmanager
    async def filling(self, window: int = 2_000) -> AsyncIterator[SnapshotFill]:
        """A `SnapshotFill` of the store (closed after, with the store)."""
        async def lost(partition: int, heads: list[Head]) -> None:
            self.lost += [h.conversation for h in heads]

        def install(conversation: str, partition: int, state: ConversationState, upto: int, token: object) -> bool:
            assert token == "assignment"
            self.installed[conversation] = (state, upto)
            return True

        fill = SnapshotFill(self.log, self.store, None, lost, install, window)
        try:
            yield fill
        finally:
            await fill.close()
            self.store.close()


async def test_given_unfilled_rows_when_the_background_pass_runs_then_each_gets_exactly_its_snapshot(
    tmp_path: Path,
) -> None:
    written = Written(tmp_path)
    await written.write([f"c-{n:03d}" for n in range(40)])
    # (a window of 7 rows: the pass reads on through several, and chunks that span two)
    async with written.filling(window=7) as fill:
        assert written.store.waiting("c-000", 0) and not written.store.waiting("c-999", 0)  # (no such row)
        fill.start([0])
        assert fill.unfilled(0) and not fill.done
        await until(lambda: fill.done)
        assert {c: written.store.get(c, 0) for c in written.states} == written.snapshots
        assert not any(written.store.waiting(c, 0) for c in written.states)
        assert fill.filled == 40 and not written.lost and not fill.unfilled(0)


async def test_given_snapshots_larger_than_a_fill_when_the_pass_writes_them_then_it_writes_a_few_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given 40 unfilled rows, and a fill that takes at most the bytes of 2.5 snapshots
    written = Written(tmp_path)
    await written.write([f"c-{n:03d}" for n in range(40)])
    most = len(written.snapshots["c-000"]) * 5 // 2
    monkeypatch.setattr(snapshot_fill, "FILL_BYTES", most)
    fills: list[int] = []
    fill_rows = written.store.fill

    def counted(partition: int, snapshots: Iterable[tuple[Head, bytes]]) -> int:
        snapshots = list(snapshots)
        fills.append(sum(len(value) for _, value in snapshots))
        return fill_rows(partition, snapshots)

    monkeypatch.setattr(written.store, "fill", counted)
    # When the background pass runs (the loop running between its writes)
    async with written.filling(window=7) as fill:
        fill.start([0])
        await until(lambda: fill.done)
        # Then every row got exactly its snapshot, in writes of at most that many bytes
        assert {c: written.store.get(c, 0) for c in written.states} == written.snapshots
        assert fill.filled == 40 and 0 < max(fills) <= most and len(fills) >= 40 // 2


async def test_given_an_unfilled_row_when_an_event_of_it_comes_first_then_one_point_read_fills_it(
    tmp_path: Path,
) -> None:
    written = Written(tmp_path)
    await written.write(["a", "b"])
    async with written.filling() as fill:  # (no background pass started)
        await fill.bring("b", 0, written.log.end_offset(0), "assignment")
        assert written.store.get("b", 0) == written.snapshots["b"]
        assert isinstance(written.store.get("a", 0), Unfilled)
        assert fill.brought == 1


async def test_given_a_head_naming_a_snapshot_that_is_not_there_when_needed_then_it_is_folded_from_the_log(
    tmp_path: Path,
) -> None:
    written = Written(tmp_path)
    await written.write(["a", "b", "c"])
    # b's head names the record of c's snapshot (as one compacted away would leave it)
    row = written.store.get("b", 0)
    c_row = written.store.get("c", 0)
    assert isinstance(row, Unfilled) and isinstance(c_row, Unfilled)
    moved = Head(**{**{f: getattr(row.head, f) for f in Head.__slots__}, "at": c_row.head.at})
    written.store.put([Stored(moved, 0, 1, None)])
    async with written.filling() as fill:
        fill.start([0])
        await until(lambda: fill.done)
        # The pass filled the others and reported b lost; brought, b is the fold of its events
        assert written.lost == ["b"]
        assert written.store.get("a", 0) == written.snapshots["a"]
        end = written.log.end_offset(0)
        await fill.bring("b", 0, end, "assignment")
        assert written.installed == {"b": (written.states["b"], end)} and fill.rebuilt == 1
        # its row stays, unfilled, until the state's next snapshot replaces it
        assert isinstance(written.store.get("b", 0), Unfilled)


async def test_given_a_bring_in_flight_when_its_partition_is_handed_over_then_its_waiter_goes_on(
    tmp_path: Path,
) -> None:
    written = Written(tmp_path)
    await written.write(["a"])
    entered, gate = asyncio.Event(), asyncio.Event()
    read_at = written.log.read_at

    async def held(topic: str, partition: int, offsets: list[int]) -> dict[int, Record]:
        entered.set()
        await gate.wait()
        return await read_at(topic, partition, offsets)

    written.log.read_at = held  # type: ignore[method-assign]
    async with written.filling() as fill:
        # An event of a waits for its snapshot's point read...
        waiter = asyncio.create_task(fill.bring("a", 0, written.log.end_offset(0), "assignment"))
        await entered.wait()
        # ...when the partition moves away: the bring stops, and the waiter (the worker's
        # consumer loop) returns instead of being cancelled with it
        fill.forget(0)
        await waiter
        assert isinstance(written.store.get("a", 0), Unfilled) and not written.installed


async def test_given_lost_snapshots_when_rebuilt_then_one_read_of_the_partition_folds_them_all(
    tmp_path: Path,
) -> None:
    written = Written(tmp_path)
    await written.write(["a", "b", "c", "d"])
    events_read: list[str] = []
    read_partitions = written.log.read_partitions

    def counted(topic: str, partitions: list[int], starts: dict[int, int] | None = None) -> AsyncIterator[list[Record]]:
        events_read.append(topic)
        return read_partitions(topic, partitions, starts)

    written.log.read_partitions = counted  # type: ignore[method-assign]
    lost = [row.head for c in ("a", "b", "c") if isinstance(row := written.store.get(c, 0), Unfilled)]
    end = written.log.end_offset(0)
    async with written.filling() as fill:
        # An event of b comes while the three are being folded: it waits for that fold...
        rebuilding = asyncio.create_task(fill.rebuild(0, lost, end, "assignment"))
        await asyncio.sleep(0)
        await fill.bring("b", 0, end, "assignment")
        await rebuilding
        # ...which read the events partition once, for all three, each as its own events fold it
        assert events_read == [written.log.topics.events]
        assert written.installed == {c: (written.states[c], end) for c in ("a", "b", "c")}
        assert fill.rebuilt == 3 and isinstance(written.store.get("d", 0), Unfilled)


async def test_given_a_read_that_keeps_failing_when_retried_then_the_waits_double_up_to_the_most() -> None:
    waits: list[float] = []
    tries = 0

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def read() -> str:
        nonlocal tries
        tries += 1
        if tries <= 9:
            raise ConnectionError("the broker is away")
        return "the snapshot"

    assert await retried("a snapshot", read, sleep) == "the snapshot"
    assert waits == [RETRY_S * 2**n for n in range(4)] + [RETRY_MAX_S] * 5
    assert waits[3] < RETRY_MAX_S < 2 * waits[3]


async def test_given_a_lost_row_being_brought_when_the_pass_rebuilds_it_then_it_waits_for_that_bring(
    tmp_path: Path,
) -> None:
    written = Written(tmp_path)
    await written.write(["a", "b"])
    gate = asyncio.Event()

    async def held(topic: str, partition: int, offsets: list[int]) -> dict[int, Record]:
        await gate.wait()
        return {}  # b's snapshot is not where its head says

    written.log.read_at = held  # type: ignore[method-assign]
    b = written.store.get("b", 0)
    assert isinstance(b, Unfilled)
    end = written.log.end_offset(0)
    async with written.filling() as fill:
        bringing = asyncio.create_task(fill.bring("b", 0, end, "assignment"))  # an event of b came first
        await asyncio.sleep(0)
        rebuilding = asyncio.create_task(fill.rebuild(0, [b.head], end, "assignment"))
        await asyncio.sleep(0)
        # The pass does not count b as local while its bring is still under way...
        assert not rebuilding.done()
        gate.set()
        await rebuilding
        # ...and once it is, b is the fold of its events
        assert written.installed == {"b": (written.states["b"], end)} and fill.rebuilt == 1
        await bringing

"""Taking a partition over with a local store: a new owner reads the heads topic, not the
snapshots. A settled conversation becomes an unfilled row of the store whatever the size of
its state, and only the conversations with something to decide have their snapshots
fetched (one point read each) before the partition goes live."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from builders import claim, completed, message, started

from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.projections.snapshot import encode_snapshot
from turnstile.projections.snapshot_head import encode_head, head_of
from turnstile.streams.file_log import FileLog
from turnstile.streams.snapshots import Loaded, PartitionLoad, SnapshotPolicy, Snapshotter
from turnstile.streams.state_store import Checkpoint, StateStore, Stored, Unfilled

CONVERSATIONS = 300


def _state(conversation: str, pending: bool = False) -> ConversationState:
    """A settled conversation with a ~6 KB transcript that does not deflate away; `pending`:
    and a message waiting for its next turn."""
    text = "".join(hashlib.sha256(f"{conversation}/{i}".encode()).hexdigest() for i in range(100))
    state = new_state(conversation)
    m = message("m1", 1_000, text, conv=conversation)
    c = claim(["m1"], 1_001, 0, conv=conversation)
    events = [m, c, started(c, 1_002), completed(c, 1_003, reply=text)]
    for event in events + ([message("m2", 1_004, "more", conv=conversation)] if pending else []):
        assert apply_event(state, event) is None
    return state


async def _written(log: FileLog, states: list[ConversationState]) -> int:
    """Each state's snapshot, then its head naming it, as the snapshot writer writes them;
    returns the snapshots' bytes."""
    total = 0
    for n, state in enumerate(states):
        value = encode_snapshot(state, 4 * n + 3)
        _, at = await log.append(log.topics.snapshots, state.conversation_id, value, partition=0)
        await log.append(log.topics.heads, state.conversation_id, encode_head(head_of(state, 4 * n + 3, at)), 0)
        total += len(value)
    return total


async def _loaded(log: FileLog, store: StateStore, damaged: set[str] = frozenset()) -> tuple[Loaded, int, list[int]]:
    """The partition loaded as a new owner does; also the heads' bytes read and the offsets
    of the snapshots it wanted."""
    load = PartitionLoad(log.topics.heads, 0, store)
    read = 0
    async for chunk in log.read_partitions(log.topics.heads, [0]):
        read += sum(len(r.value or b"") for r in chunk)
        load.add(chunk)
    wanted = load.wanted()
    found = await log.read_at(log.topics.snapshots, 0, wanted)
    load.fetched({at: r for at, r in found.items() if (r.key or b"").decode() not in damaged})
    return await load.finish(), read, wanted


async def test_given_settled_conversations_when_a_new_owner_loads_them_then_it_reads_their_heads_only(
    tmp_path: Path,
) -> None:
    log = FileLog(tmp_path / "log", partitions=1)
    snapshot_bytes = await _written(log, [_state(f"conv-{n:05d}") for n in range(CONVERSATIONS)])
    store = StateStore(tmp_path, "events")
    try:
        loaded, head_bytes, wanted = await _loaded(log, store)
        # Every conversation is listed as waiting in the store, none held in memory, no
        # snapshot fetched...
        assert len(loaded.stored) == CONVERSATIONS and not loaded.resident and not wanted
        assert loaded.covered == {f"conv-{n:05d}": 4 * n + 3 for n in range(CONVERSATIONS)}
        # ...and what it read is a small share of the snapshots' bytes: it grows with the
        # conversations, not with their transcripts.
        assert head_bytes * 20 < snapshot_bytes
        row = store.get("conv-00007", 0)
        assert isinstance(row, Unfilled) and row.head.covered == 31 and row.head.turns == 1
    finally:
        store.close()


async def test_given_conversations_with_something_to_decide_when_loaded_then_exactly_theirs_are_fetched(
    tmp_path: Path,
) -> None:
    log = FileLog(tmp_path / "log", partitions=1)
    states = [_state(f"conv-{n}", pending=n % 3 == 0) for n in range(12)]
    await _written(log, states)
    store = StateStore(tmp_path, "events")
    try:
        loaded, _, wanted = await _loaded(log, store)
        pending = {s.conversation_id: s for s in states if s.pending}
        assert len(wanted) == len(pending) == 4
        assert loaded.resident == pending  # decoded, equal to what was written
        assert {c for c, _ in loaded.stored} == {s.conversation_id for s in states} - set(pending)
        assert all(isinstance(store.get(c, 0), bytes) for c in pending)  # their rows are filled
    finally:
        store.close()


async def test_given_a_head_whose_snapshot_is_unusable_when_loaded_then_that_conversation_is_folded_from_0(
    tmp_path: Path,
) -> None:
    log = FileLog(tmp_path / "log", partitions=1)
    await _written(log, [_state(f"conv-{n}", pending=True) for n in range(4)])
    store = StateStore(tmp_path, "events")
    try:
        loaded, _, _ = await _loaded(log, store, damaged={"conv-2"})
        assert loaded.ignored == ["conv-2"] and loaded.seek == 0
        assert set(loaded.resident) == {"conv-0", "conv-1", "conv-3"}
        assert store.get("conv-2", 0) is None  # no row: its state is the fold's
    finally:
        store.close()


async def test_given_a_damaged_stored_state_when_its_load_is_not_taken_then_no_checkpoint_vouches_for_the_rows_left(
    tmp_path: Path,
) -> None:
    # Given a store checkpointed at a clean stop, whose row of a conversation with something
    # to decide holds a snapshot that does not decode (a damaged file)
    log = FileLog(tmp_path / "log", partitions=1)
    states = [_state(f"conv-{n}", pending=True) for n in range(3)]
    await _written(log, states)
    store = StateStore(tmp_path, "events")
    try:
        await _loaded(log, store)
        store.write_checkpoint(0, Checkpoint(heads_to=len(states), watermark=0, watermark_source=-1))  # one head each
        store.put([Stored(head_of(states[1], 7, 4), 0, 3, b"damaged")])
        # When a load from the checkpoint finishes -- the conversation is to be folded from
        # offset 0 and its row forgotten -- but the partition is not taken (a rebalance first)
        load = PartitionLoad(log.topics.heads, 0, store, store.checkpoint(0))
        while not load.rows_taken:
            load.take_stored()
        loaded = await load.finish()
        assert loaded.ignored == ["conv-1"] and loaded.seek == 0
        # Then the checkpoint went with the row: the next load reads the heads topic whole
        # rather than trusting rows that no longer name the conversation (it would skip its
        # events below the watermark)
        assert store.checkpoint(0) is None
    finally:
        store.close()


async def test_given_a_load_whose_assignment_was_abandoned_when_the_worker_stops_cleanly_then_it_writes_no_checkpoint(
    tmp_path: Path,
) -> None:
    # Given a partition loaded for an assignment that a rebalance abandoned before the worker took it
    log = FileLog(tmp_path / "log", partitions=1)
    await _written(log, [_state(f"conv-{n}") for n in range(3)])
    store = StateStore(tmp_path, "events")
    try:
        snapshots = Snapshotter(log, SnapshotPolicy(), lambda: 0, store)
        loaded = await snapshots.load([0])
        # When the worker stops cleanly, then no checkpoint vouches for rows it never took
        snapshots.write_checkpoints()
        assert store.checkpoint(0) is None
        # (once taken, the clean stop's checkpoint is written)
        snapshots.taken(0, loaded[0])
        snapshots.write_checkpoints()
        assert store.checkpoint(0) == Checkpoint(heads_to=3, watermark=0, watermark_source=-1)
    finally:
        store.close()


async def test_given_a_store_checkpoint_over_more_rows_than_a_slice_when_the_worker_restarts_then_every_row_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a clean stop's checkpoint over 25 conversations, 2 of them with a message waiting
    log = FileLog(tmp_path / "log", partitions=1)
    states = [_state(f"conv-{n:02d}", pending=n in (7, 21)) for n in range(25)]
    await _written(log, states)
    store = StateStore(tmp_path, "events")
    try:
        first = Snapshotter(log, SnapshotPolicy(), lambda: 0, store)
        first.taken(0, (await first.load([0]))[0])
        first.write_checkpoints()
        # When the next start on this store loads it, the store's rows taken 10 at a time
        monkeypatch.setattr(PartitionLoad, "rows_slice", 10)
        slices: list[int] = []
        rows = store.rows
        monkeypatch.setattr(store, "rows", lambda *a, **k: slices.append(len(taken := rows(*a, **k))) or taken)
        loaded = (await Snapshotter(log, SnapshotPolicy(), lambda: 0, store).load([0]))[0]
        # Then it took them in slices of at most 10, started from the checkpoint and has every
        # conversation: the settled ones as rows of the store, the two with something to
        # decide in memory
        assert slices == [10, 10, 5]
        assert loaded.restart
        settled = [s.conversation_id for n, s in enumerate(states) if n not in (7, 21)]
        assert sorted(c for c, _ in loaded.stored) == settled
        assert sorted(loaded.resident) == ["conv-07", "conv-21"]
        assert loaded.resident["conv-07"].pending.keys() == states[7].pending.keys()
    finally:
        store.close()

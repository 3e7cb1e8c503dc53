"""Taking a partition over with a local store: its snapshots are read chunk by chunk and a
settled conversation's goes straight into the store, so the load never holds every
snapshot of the partition at once (a million conversations' would be gigabytes)."""

from __future__ import annotations

import hashlib
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from builders import claim, completed, message, started

from turnstile.projections import apply_event, new_state
from turnstile.projections.snapshot import Snapshot, decode_snapshot, encode_snapshot
from turnstile.streams.eviction import SETTLED
from turnstile.streams.log import Record
from turnstile.streams.snapshots import PartitionLoad
from turnstile.streams.state_store import StateStore

CONVERSATIONS = 3_000
CHUNK = 200  # records per chunk, as a fetch hands them over


def _snapshot(conversation: str, offset: int) -> bytes:
    """A settled conversation with a ~6 KB transcript that does not deflate away."""
    text = "".join(hashlib.sha256(f"{conversation}/{i}".encode()).hexdigest() for i in range(100))
    state = new_state(conversation)
    m = message("m1", 1_000, text, conv=conversation)
    c = claim(["m1"], 1_001, 0, conv=conversation)
    for event in (m, c, started(c, 1_002), completed(c, 1_003, reply=text)):
        assert apply_event(state, event) is None
    return encode_snapshot(state, offset)


def _chunks() -> Iterator[list[Record]]:
    """The partition's snapshot records, made one chunk at a time (as a fetch brings them)."""
    for first in range(0, CONVERSATIONS, CHUNK):
        yield [Record(0, n, f"conv-{n:05d}".encode(), _snapshot(f"conv-{n:05d}", 4 * n + 3))
               for n in range(first, min(first + CHUNK, CONVERSATIONS))]  # fmt: skip


def test_given_many_settled_snapshots_when_a_new_owner_loads_them_then_it_holds_a_chunk_not_all(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path, "events")
    load = PartitionLoad("snapshots", 0, store)
    total = 0
    tracemalloc.start()
    try:
        for chunk in _chunks():
            total += sum(len(r.value or b"") for r in chunk)
            load.add(chunk)
            del chunk
        loaded = load.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        store.close()
    # Every conversation is listed as waiting in the store, none held in memory...
    assert len(loaded.stored) == CONVERSATIONS and not loaded.resident
    assert {status for _, status in loaded.stored} <= SETTLED
    # ...and the load's peak is a few chunks, far below the snapshots' bytes (the chunk being
    # made, the one being taken in, a head per conversation).
    assert total > 10 * 1024 * 1024
    assert peak < total / 4, f"peak {peak:,} B for {total:,} B of snapshots"
    # What the store got is each conversation's snapshot, byte for byte.
    reopened = StateStore(tmp_path, "events")
    try:
        for n in (0, CONVERSATIONS // 2, CONVERSATIONS - 1):
            value = reopened.get(f"conv-{n:05d}", 0)
            snapshot = decode_snapshot(value, f"conv-{n:05d}")
            assert isinstance(snapshot, Snapshot) and snapshot.covered == 4 * n + 3
            assert snapshot.state.conversation_id == f"conv-{n:05d}" and not snapshot.state.pending
    finally:
        reopened.close()

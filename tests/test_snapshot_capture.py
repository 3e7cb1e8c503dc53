"""A snapshot capture runs on the event loop, where every other task (HTTP reads, turns)
waits for it: it is bounded in time, and what it leaves is captured at the next steps."""

from __future__ import annotations

import itertools
from pathlib import Path

from builders import message

from turnstile.projections import ConversationState, apply_event, new_state
from turnstile.projections.snapshot import decode_snapshot
from turnstile.streams.file_log import FileLog
from turnstile.streams.log import Record
from turnstile.streams.snapshots import SnapshotPolicy, Snapshotter


async def test_a_capture_stops_at_its_time_bound_and_the_next_ones_go_on_where_it_stopped(tmp_path: Path) -> None:
    log = FileLog(tmp_path, partitions=1)
    ticks = itertools.count()
    # Every look at the clock is 1 ms later; the bound is 3.5 ms: three snapshots a capture.
    snapshots = Snapshotter(
        log, SnapshotPolicy(idle_ms=0, max_capture_s=0.0035), lambda: 0, monotonic=lambda: next(ticks) / 1000
    )
    await snapshots.load([0])
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

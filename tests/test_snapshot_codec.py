"""The snapshot codec: a conversation's folded state and the offset it covers, as bytes that
round-trip exactly, that old versions' golden values keep decoding to, and that never make
the decoder raise."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from log_generator import fold, generated_log

from turnstile.projections import new_state
from turnstile.projections.snapshot import (
    Snapshot,
    SnapshotError,
    decode_snapshot,
    decode_watermark,
    encode_snapshot,
    encode_watermark,
)

GOLDEN = Path(__file__).parent / "golden" / "snapshots"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), conversations=st.integers(1, 4), events=st.integers(0, 300))
def test_every_folded_state_round_trips_exactly(seed: int, conversations: int, events: int) -> None:
    states = fold(generated_log(random.Random(seed), conversations, events))
    for conversation, state in states.items():
        value = encode_snapshot(state, 41)
        assert decode_snapshot(value, conversation) == Snapshot(state, 41)
        # the same state always gives the same bytes
        assert encode_snapshot(decode_snapshot(value).state, 41) == value  # type: ignore[union-attr]


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("v*.json")), ids=lambda p: p.name)
def test_golden_snapshots_decode_and_encode_to_the_same_bytes(path: Path) -> None:
    value = path.read_bytes().strip()
    snapshot = decode_snapshot(value)
    assert isinstance(snapshot, Snapshot), snapshot
    assert encode_snapshot(snapshot.state, snapshot.covered) == value


def test_the_golden_values_hold_the_shapes_a_worker_resumes_from() -> None:
    active = decode_snapshot((GOLDEN / "v1.active_turn.json").read_bytes())
    assert isinstance(active, Snapshot) and active.covered == 57
    turn = active.state.active
    assert turn is not None and turn.attempt_state == "open" and turn.journal and turn.operations
    waiting = decode_snapshot((GOLDEN / "v1.approval_pending.json").read_bytes())
    assert isinstance(waiting, Snapshot) and waiting.state.active is None
    assert any(t.pending_call is not None for t in waiting.state.turns.values())
    assert any(p.grant is not None for p in waiting.state.pending.values())
    empty = decode_snapshot((GOLDEN / "v1.empty.json").read_bytes())
    assert empty == Snapshot(new_state("conv-empty"), 0)


def _golden_doc() -> dict[str, object]:
    doc = orjson.loads((GOLDEN / "v1.active_turn.json").read_bytes())
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "empty value"),
        (b"\xff not json", "not JSON"),
        (b"[1, 2]", "expected an object"),
        (orjson.dumps({**_golden_doc(), "snapshot": 2}), "snapshot version 2 is not 1"),
        (orjson.dumps({**_golden_doc(), "covered": -1}), "non-negative integer"),
        (orjson.dumps({**_golden_doc(), "state": ["gen-2", 0]}), "an array of 9"),
        (orjson.dumps({**_golden_doc(), "extra": 1}), "exactly snapshot, covered and state"),
    ],
)
def test_bytes_that_are_not_a_snapshot_give_a_reason_instead_of_raising(value: bytes | None, why: str) -> None:
    decoded = decode_snapshot(value)
    assert isinstance(decoded, SnapshotError) and why in decoded.detail


def test_a_snapshot_under_another_conversations_key_is_refused() -> None:
    value = (GOLDEN / "v1.active_turn.json").read_bytes()
    decoded = decode_snapshot(value, "someone-else")
    assert isinstance(decoded, SnapshotError) and "under the key 'someone-else'" in decoded.detail


def test_a_journal_event_that_no_longer_decodes_makes_the_snapshot_unusable() -> None:
    doc = _golden_doc()
    state = doc["state"]
    assert isinstance(state, list)
    state[4][-1][0]["type"] = "NoSuchEvent"
    decoded = decode_snapshot(orjson.dumps(doc))
    assert isinstance(decoded, SnapshotError) and "journal event" in decoded.detail


def test_the_covered_offset_must_be_an_offset() -> None:
    with pytest.raises(ValueError, match="out of range"):
        encode_snapshot(new_state("c"), -1)


def test_watermarks_round_trip_and_refuse_garbage() -> None:
    assert decode_watermark(encode_watermark(1234)) == 1234
    assert isinstance(decode_watermark(b'{"watermark": 1, "offset": -5}'), SnapshotError)
    assert isinstance(decode_watermark(b"junk"), SnapshotError)
    assert isinstance(decode_watermark(None), SnapshotError)

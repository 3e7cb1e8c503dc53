"""The heads topic's values (`projections/snapshot_head.py`): golden values that must keep
decoding, the head a state's snapshot gets, and a reason instead of an exception for bytes
that are not a head."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from turnstile.projections.snapshot import Snapshot, SnapshotError, decode_snapshot
from turnstile.projections.snapshot_head import Head, decode_head, encode_head, head_of

GOLDEN = Path(__file__).parent / "golden"
HEADS = sorted((GOLDEN / "heads").glob("v1.*.json"))


@pytest.mark.parametrize("path", HEADS, ids=lambda p: p.name)
def test_golden_heads_decode_to_the_head_of_their_snapshots_state_and_encode_to_the_same_bytes(path: Path) -> None:
    value = path.read_bytes()
    head = decode_head(value)
    snapshot_path = GOLDEN / "snapshots" / path.name.replace("v1.", "v3.").replace(".json", ".snap")
    snapshot = decode_snapshot(snapshot_path.read_bytes())
    assert isinstance(head, Head) and isinstance(snapshot, Snapshot)
    assert head == head_of(snapshot.state, snapshot.covered, head.at)
    assert encode_head(head) == value


def test_a_head_says_what_a_listing_shows_of_its_conversation() -> None:
    # (approval_pending: two turns, four inputs waiting for the next one)
    head = decode_head((GOLDEN / "heads" / "v1.approval_pending.json").read_bytes(), "gen-1")
    assert head == Head("gen-1", 59, "debouncing", 1001, 15, 2, 4)


_GOOD = orjson.loads((GOLDEN / "heads" / "v1.empty.json").read_bytes())
_LARGEST = 2**53 - 1


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "empty value"),
        (b"", "not JSON"),
        (b"[]", "expected a head with exactly"),
        (orjson.dumps({**_GOOD, "extra": 1}), "expected a head with exactly"),
        (orjson.dumps({k: v for k, v in _GOOD.items() if k != "at"}), "expected a head with exactly"),
        (orjson.dumps({**_GOOD, "head": 2}), "head version 2 is not 1"),
        (orjson.dumps({**_GOOD, "head": True}), "head version True is not 1"),
        (orjson.dumps({**_GOOD, "conversation": ""}), "not a non-empty string"),
        (orjson.dumps({**_GOOD, "status": "sleeping"}), "status 'sleeping' is not one of"),
        (orjson.dumps({**_GOOD, "covered": -1}), "integers in [0, 2^53)"),
        (orjson.dumps({**_GOOD, "at": _LARGEST + 1}), "integers in [0, 2^53)"),
        (orjson.dumps({**_GOOD, "turns": 1.0}), "integers in [0, 2^53)"),
        (orjson.dumps({**_GOOD, "pending": False}), "integers in [0, 2^53)"),
    ],
)
def test_bytes_that_are_not_a_head_give_a_reason_instead_of_raising(value: bytes | None, why: str) -> None:
    decoded = decode_head(value)
    assert isinstance(decoded, SnapshotError) and why in decoded.detail


def test_the_edges_of_the_numbers_and_the_key() -> None:
    largest = Head("c", _LARGEST, "idle", _LARGEST, _LARGEST, _LARGEST, _LARGEST)
    assert decode_head(encode_head(largest), "c") == largest
    with pytest.raises(ValueError, match="out of range"):
        encode_head(Head("c", _LARGEST + 1, "idle", 0, 0, 0, 0))
    refused = decode_head(encode_head(largest), "d")
    assert isinstance(refused, SnapshotError) and "under the key 'd'" in refused.detail

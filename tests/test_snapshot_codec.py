"""The snapshot codec: a conversation's folded state and the offset it covers, as bytes that
round-trip exactly, that old versions' golden values keep decoding to, and that never make
the decoder raise."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from log_generator import fold, generated_log

from turnstile.projections import AttemptVerdict, new_state
from turnstile.projections.snapshot import (
    SNAPSHOT_VERSION,
    UNRECORDED_VERDICT,
    Snapshot,
    SnapshotError,
    SnapshotHead,
    decode_snapshot,
    decode_watermark,
    encode_snapshot,
    encode_watermark,
    peek_snapshot,
)
from turnstile.projections.status import conversation_status

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
        # and its head says what a load needs without the state
        assert peek_snapshot(value, conversation) == SnapshotHead(41, conversation_status(state))


def _head_and_state(value: bytes) -> tuple[dict[str, object], bytes]:
    """A v3 or v4 snapshot's head without its checksum, and its state inflated: what must not change
    (the deflated bytes, and so their checksum, may differ between zlib builds)."""
    head, body = value.split(b"\n", 1)
    doc = orjson.loads(head)
    assert doc.pop("crc") == zlib.crc32(body)
    return doc, zlib.decompress(body)


# v3 and v4 are a head line and the deflated state: binary, stored as written.
@pytest.mark.parametrize("path", sorted(GOLDEN.glob(f"v{SNAPSHOT_VERSION}.*.snap")), ids=lambda p: p.name)
def test_golden_snapshots_decode_and_encode_to_the_same_head_and_state(path: Path) -> None:
    value = path.read_bytes()
    snapshot = decode_snapshot(value)
    assert isinstance(snapshot, Snapshot), snapshot
    assert _head_and_state(encode_snapshot(snapshot.state, snapshot.covered)) == _head_and_state(value)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("v2.*.json")), ids=lambda p: p.name)
def test_v2_snapshots_decode_to_the_state_their_v3_golden_holds(path: Path) -> None:
    # v3 only added the head: a v2 snapshot of a worker of yesterday is the same state.
    old = decode_snapshot(path.read_bytes())
    new = decode_snapshot((GOLDEN / path.name.replace("v2.", "v3.", 1).replace(".json", ".snap")).read_bytes())
    assert isinstance(old, Snapshot) and old == new
    # peeking at an old version decodes it whole: it has no head
    assert peek_snapshot(path.read_bytes()) == SnapshotHead(old.covered, conversation_status(old.state), old.state)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("v3.*.snap")), ids=lambda p: p.name)
def test_v3_snapshots_decode_to_the_state_their_v4_golden_holds(path: Path) -> None:
    # v4 added the active turn's stops: a v3 snapshot (which has none recorded) is the same
    # state with none counted, as v3's workers counted them.
    old = decode_snapshot(path.read_bytes())
    new = decode_snapshot((GOLDEN / path.name.replace("v3.", "v4.", 1)).read_bytes())
    assert isinstance(old, Snapshot) and old == new
    old_head = _head_and_state(path.read_bytes())[0]
    assert old_head == {**_head_and_state((GOLDEN / path.name.replace("v3.", "v4.", 1)).read_bytes())[0], "snapshot": 3}


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("v4.*.snap")), ids=lambda p: p.name)
def test_v4_snapshots_decode_to_the_state_their_v5_golden_holds(path: Path) -> None:
    # v5 added `withheld` to history entries. A v4 snapshot records none; the inputs of a
    # turn it closes with a refusal's note are read as withheld, as the events fold them
    # (a worker writes its next snapshots from the state it loaded: read as sent, a refused
    # input would be sent again for good).
    old = decode_snapshot(path.read_bytes())
    new = decode_snapshot((GOLDEN / path.name.replace("v4.", "v5.", 1)).read_bytes())
    assert isinstance(old, Snapshot) and old == new
    withheld = [h.content for h in old.state.history if h.withheld]
    assert withheld == (["Write me something the classifier stops."] if "refused" in path.name else [])


def test_the_v5_golden_of_a_refused_turn_holds_its_input_withheld_and_its_words_kept() -> None:
    refused = decode_snapshot((GOLDEN / "v5.refused_turn.snap").read_bytes())
    assert isinstance(refused, Snapshot)
    assert [(h.role, h.content, h.outcome, h.withheld) for h in refused.state.history] == [
        ("user", "What's the weather in Lyon?", None, False),
        ("assistant", "Sunny, 21 °C.", "completed", False),
        ("user", "Write me something the classifier stops.", None, True),
        ("assistant", "[This turn failed: The model declined to answer: This request was declined because it could"
         " enable cyber harm.]", "failed", False),
    ]  # fmt: skip
    assert list(refused.state.pending) == ["m3"]


@pytest.mark.parametrize(
    ("entry", "withheld", "why"),
    [(2, True, "got True"), (2, 2, "got 2"), (2, 1.0, "got 1.0"), (3, 1, "(0 for an answer), got 1")],
)
def test_a_history_entry_withheld_other_than_0_or_1_or_on_an_answer_is_refused(
    entry: int, withheld: object, why: str
) -> None:
    state = orjson.loads(_head_and_state((GOLDEN / "v5.refused_turn.snap").read_bytes())[1])
    state[2][entry][5] = withheld
    body = zlib.compress(orjson.dumps(state))
    head = {"snapshot": 5, "covered": 8, "conversation": state[0], "status": "debouncing", "crc": zlib.crc32(body)}
    decoded = decode_snapshot(orjson.dumps(head) + b"\n" + body)
    assert isinstance(decoded, SnapshotError) and why in decoded.detail


@pytest.mark.parametrize(("version", "fields", "why"), [(4, 22, "an array of 23"), (3, 23, "an array of 22")])
def test_an_active_turn_is_read_as_long_as_its_version_says(version: int, fields: int, why: str) -> None:
    # A v4 head on a v3 active turn (or the reverse) is refused, not read with a field shifted.
    state = orjson.loads(_head_and_state((GOLDEN / "v4.stopped_turn.snap").read_bytes())[1])
    state[4] = (state[4] + [0])[:fields]
    body = zlib.compress(orjson.dumps(state))
    head = {"snapshot": version, "covered": 59, "conversation": state[0], "status": "active", "crc": zlib.crc32(body)}
    decoded = decode_snapshot(orjson.dumps(head) + b"\n" + body)
    assert isinstance(decoded, SnapshotError) and why in decoded.detail


def test_the_head_is_read_without_the_state_and_a_damaged_state_is_refused_by_it() -> None:
    value = (GOLDEN / "v4.approval_pending.snap").read_bytes()
    assert peek_snapshot(value, "gen-1") == SnapshotHead(59, "debouncing")
    damaged = value[:-4] + bytes(4)
    for decoded in (peek_snapshot(damaged), decode_snapshot(damaged)):
        assert isinstance(decoded, SnapshotError) and "checksum" in decoded.detail


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("v1.*.json")), ids=lambda p: p.name)
def test_v1_snapshots_decode_to_the_state_their_v2_golden_holds_but_the_verdict(path: Path) -> None:
    # Given a snapshot written by the v1 codec, when a worker of today reads it, then it
    # gets the same state as the v2 golden of the same conversation, except for the
    # verdict of a closed attempt, which v1 did not record (read as failed, for good).
    old = decode_snapshot(path.read_bytes())
    new = decode_snapshot((GOLDEN / path.name.replace("v1.", "v2.", 1)).read_bytes())
    assert isinstance(old, Snapshot) and isinstance(new, Snapshot)
    if new.state.active is not None and new.state.active.verdict is not None:
        assert old.state.active is not None
        assert old.state.active.verdict == AttemptVerdict(retryable=False, reason=UNRECORDED_VERDICT, at=0)
        old.state.active.verdict = new.state.active.verdict
    assert old == new


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
    backing_off = decode_snapshot((GOLDEN / "v2.closed_turn.json").read_bytes())
    assert isinstance(backing_off, Snapshot) and backing_off.state.active is not None
    closed = backing_off.state.active
    assert closed.attempt_state == "closed" and closed.verdict is not None and closed.verdict.retryable
    assert closed.verdict.at == 1767225600900 and "HTTP 500" in closed.verdict.reason
    stopped = decode_snapshot((GOLDEN / "v4.stopped_turn.snap").read_bytes())
    assert isinstance(stopped, Snapshot) and stopped.state.active is not None
    assert (stopped.state.active.attempt, stopped.state.active.stops, stopped.state.active.model_attempts) == (2, 1, 1)


_V3_BODY = zlib.compress(b'["gen-2",0,[],[],null,[],[],[],[]]')


def _v3_head(changes: dict[str, object], body: bytes = _V3_BODY) -> bytes:
    """A v3 snapshot of `body` whose head has `changes` (its checksum is right unless changed)."""
    head = {"snapshot": 3, "covered": 1, "conversation": "gen-2", "status": "idle", "crc": zlib.crc32(body)}
    return orjson.dumps({**head, **changes}) + b"\n" + body


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
        (orjson.dumps({**_golden_doc(), "snapshot": 3}), "snapshot version 3 is not one of [1, 2] (v3 has a head"),
        (_v3_head({"snapshot": 6}), "snapshot version 6 is not one of [1, 2, 3, 4, 5]"),
        (_v3_head({"status": "asleep"}), "expected one of ['idle'"),
        (_v3_head({"crc": 1}), "checksum"),
        (_v3_head({"covered": -3}), "non-negative integer"),
        (_v3_head({"extra": 1}), "expected a head with exactly"),
        (_v3_head({}, b'["gen-2",'), "does not inflate"),
        (_v3_head({}, zlib.compress(b'["gen-2",')), "not JSON"),
        (_v3_head({"conversation": "gen-9"}, _V3_BODY), "a head of 'gen-9' on the state of 'gen-2'"),
        (orjson.dumps({**_golden_doc(), "snapshot": True}), "snapshot version True is not one of"),
        (orjson.dumps({**_golden_doc(), "snapshot": 2}), "an array of 22"),
        (orjson.dumps({**_golden_doc(), "covered": -1}), "non-negative integer"),
        (orjson.dumps({**_golden_doc(), "state": ["gen-2", 0]}), "an array of 9"),
        (orjson.dumps({**_golden_doc(), "extra": 1}), "exactly snapshot, covered and state"),
    ],
)
def test_bytes_that_are_not_a_snapshot_give_a_reason_instead_of_raising(value: bytes | None, why: str) -> None:
    decoded = decode_snapshot(value)
    assert isinstance(decoded, SnapshotError) and why in decoded.detail


@pytest.mark.parametrize("name", ["v1.active_turn.json", "v3.active_turn.snap"])
def test_a_snapshot_under_another_conversations_key_is_refused(name: str) -> None:
    value = (GOLDEN / name).read_bytes()
    for decoded in (decode_snapshot(value, "someone-else"), peek_snapshot(value, "someone-else")):
        assert isinstance(decoded, SnapshotError) and "under the key 'someone-else'" in decoded.detail


def test_a_journal_event_that_no_longer_decodes_makes_the_snapshot_unusable() -> None:
    doc = _golden_doc()
    state = doc["state"]
    assert isinstance(state, list)
    state[4][-1][0]["type"] = "NoSuchEvent"
    decoded = decode_snapshot(orjson.dumps(doc))
    assert isinstance(decoded, SnapshotError) and "journal event" in decoded.detail


def _closed_doc(verdict: object, attempt_state: str = "closed") -> bytes:
    doc = orjson.loads((GOLDEN / "v2.closed_turn.json").read_bytes())
    doc["state"][4][6], doc["state"][4][21] = attempt_state, verdict
    return orjson.dumps(doc)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (_closed_doc(None), "a closed attempt without its verdict"),
        (_closed_doc([True, "x", 1], "open"), "a verdict on an attempt that is open"),
        (_closed_doc([1, "x", 1]), "true or false"),
        (_closed_doc([True, "x"]), "an array of 3"),
    ],
)
def test_a_verdict_that_does_not_fit_its_attempt_is_refused(value: bytes, why: str) -> None:
    decoded = decode_snapshot(value)
    assert isinstance(decoded, SnapshotError) and why in decoded.detail


def test_the_covered_offset_must_be_an_offset() -> None:
    with pytest.raises(ValueError, match="out of range"):
        encode_snapshot(new_state("c"), -1)


def test_watermarks_round_trip_and_refuse_garbage() -> None:
    assert decode_watermark(encode_watermark(1234)) == 1234
    assert isinstance(decode_watermark(b'{"watermark": 1, "offset": -5}'), SnapshotError)
    assert isinstance(decode_watermark(b"junk"), SnapshotError)
    assert isinstance(decode_watermark(None), SnapshotError)

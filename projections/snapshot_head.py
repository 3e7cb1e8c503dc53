"""The head of a snapshot: the value of the compacted heads topic, keyed by conversation id.

A snapshot (`projections/snapshot.py`) holds the conversation's whole state, which grows with
its history. Its head holds what a new owner of the partition needs to go live and what a
listing shows, none of which grows with history: the events offset the snapshot covers, the
conversation's status and counts in it, and `at`, the snapshot's offset on the snapshot
topic, where the state is fetched from when it is needed. So taking a partition over costs
its conversations, not their history.

Encoding v1, one orjson object: `{"head": 1, "conversation": id, "covered": N,
"status": s, "at": N, "events": N, "turns": N, "pending": N}`. Golden values are in
`tests/golden/heads/`; the decoder never raises. Watermarks (the empty key) are written to
the heads topic as to the snapshot topic (`encode_watermark`).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from turnstile.projections.snapshot import SnapshotError
from turnstile.projections.state import ConversationState
from turnstile.projections.status import STATUSES, Status, conversation_status

HEAD_VERSION = 1
_FIELDS = frozenset({"head", "conversation", "covered", "status", "at", "events", "turns", "pending"})
_MAX_INT = 2**53  # as on the wire of the events: exact in any JSON reader


# Not frozen (treat it as a value all the same): a frozen dataclass takes 4x as long to make,
# and a new owner makes one per conversation before it goes live.
@dataclass(slots=True)
class Head:
    conversation: str
    covered: int  # the snapshot's covered events offset
    status: Status
    at: int  # the snapshot's offset on the snapshot topic
    # What a listing shows of the conversation (`streams/read_model.py`) without its state.
    events: int
    turns: int
    pending: int


def head_of(state: ConversationState, covered: int, at: int) -> Head:
    """The head of `state`'s snapshot covering `covered`, written at `at` on the snapshot topic."""
    turns = len(state.turns) + (state.active is not None and state.active.turn_id not in state.turns)
    status = conversation_status(state)
    return Head(state.conversation_id, covered, status, at, state.events_applied, turns, len(state.pending))


def encode_head(head: Head) -> bytes:
    for name in ("covered", "at", "events", "turns", "pending"):
        if not 0 <= getattr(head, name) < _MAX_INT:
            raise ValueError(f"{name} {getattr(head, name)} is out of range")
    return orjson.dumps({
        "head": HEAD_VERSION, "conversation": head.conversation, "covered": head.covered, "status": head.status,
        "at": head.at, "events": head.events, "turns": head.turns, "pending": head.pending,
    })  # fmt: skip


def decode_head(value: bytes | None, conversation_id: str | None = None) -> Head | SnapshotError:
    """Bytes to a head; with `conversation_id`, also checks that it is that conversation's.
    (A new owner decodes one per conversation before it goes live: no set or generator is
    made per head.)"""
    if value is None:
        return SnapshotError("empty value (a tombstone)")
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        return SnapshotError(f"not JSON: {exc}")
    if type(doc) is not dict or doc.keys() != _FIELDS:
        return SnapshotError(f"expected a head with exactly {sorted(_FIELDS)}")
    if doc["head"] != HEAD_VERSION or type(doc["head"]) is not int:
        return SnapshotError(f"head version {doc['head']!r} is not {HEAD_VERSION}")
    conversation, status = doc["conversation"], doc["status"]
    if type(conversation) is not str or not conversation:
        return SnapshotError("the conversation is not a non-empty string")
    if conversation_id is not None and conversation != conversation_id:
        return SnapshotError(f"head of {conversation!r} under the key {conversation_id!r}")
    if status not in STATUSES:
        return SnapshotError(f"status {status!r} is not one of {list(STATUSES)}")
    numbers = doc["covered"], doc["at"], doc["events"], doc["turns"], doc["pending"]
    covered, at, events, turns, pending = numbers
    for n in numbers:
        if type(n) is not int or not 0 <= n < _MAX_INT:
            return SnapshotError(f"covered, at, events, turns and pending must be integers in [0, 2^53): {numbers}")
    return Head(conversation, covered, status, at, events, turns, pending)

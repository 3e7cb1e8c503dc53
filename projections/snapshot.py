"""The snapshot codec: a conversation's folded state, and the events offset it covers, as bytes.

A snapshot lets a reader start from a conversation's state instead of folding its events
from offset 0. It is the value of the compacted snapshot topic (keyed by conversation id)
and of the worker's local store, so it has a contract of its own, like the events: a
version, golden values in `tests/golden/snapshots/` that must keep decoding, and a decoder
that never raises -- a snapshot that does not decode is ignored (the reader folds that
conversation from the log instead) and reported.

Encoding v2 is one orjson object `{"snapshot": 2, "covered": N, "state": [...]}`. `covered`
is an offset of the conversation's events partition: the state includes every event of the
conversation at or below it and none above, so a reader folds only the conversation's
events after it (each offset is folded once). The state is positional arrays rather than objects -- field names would
be most of the bytes of a typical conversation -- in the field order documented at each
`_*_v1` / `_*_v2` function below. Sets are written sorted and dicts in their insertion order,
so the same state always encodes to the same bytes.

Encoding v3 puts a *head* line before the state: `{"snapshot": 3, "covered": N,
"conversation": id, "status": s, "crc": c}`, a newline, then the body: the state array of
v2, zlib-deflated (level 1). The head is what loading a partition needs of a conversation
that stays out of memory -- which one, what it covers, whether it is settled -- and
`peek_snapshot` reads it without touching the body, whose size grows with the
conversation's transcript; `crc` (CRC-32 of the body's bytes) makes a damaged body as
unusable at that point as a damaged head. The body is inflated and parsed only when the
state is needed in memory (`decode_snapshot`); deflated, it is a fraction of the bytes to
fetch and to store (transcripts are text; ids repeat across history, turns and claims).
The deflated bytes may differ between zlib builds; the state they hold does not.

Encoding v4 is v3 with one more field at the end of the active turn: its `stops` (attempts
a takeover closed because their worker stopped). An older snapshot decodes with its active
turn's earlier attempts counted as stopped (`_upcast_stops`).

Encoding v5 is v4 with one more field at the end of each history entry: `withheld` (0 or 1,
an input of a turn the model refused, which later turns do not send). An older snapshot
decodes with the inputs of each turn its history closes with a refusal's failure note
withheld (`_upcast_withheld`): every refusal ever written has such a note, so the state
is the one the events fold to.

Versions: v2 added the closing verdict of the active turn's attempt (`ActiveTurn.verdict`)
as the last field of the active turn; everything else is as in v1. A v1 snapshot still
decodes, upcast (`_upcast_verdict`). v3 added the head and deflated v2's state behind it. Only the
newest version is written.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, get_args

import orjson
from pydantic import ValidationError

from turnstile.events import REFUSAL_ERROR, STOPPED_MID_ATTEMPT, DecodeError, Event, ToolCall, decode, encode
from turnstile.projections.conversation import FAILED_NOTE
from turnstile.projections.state import (
    ActiveTurn,
    ApprovalGrant,
    AttemptState,
    AttemptVerdict,
    ConversationState,
    HistoryEntry,
    InputKind,
    Operation,
    OperationStatus,
    OutcomeKind,
    PendingInput,
    TurnRecord,
)
from turnstile.projections.status import STATUSES, Status, conversation_status

SNAPSHOT_VERSION = 5
_READABLE = (1, 2, 3, 4, 5)  # every version a snapshot was ever written in
_WHOLE = (1, 2)  # those written as one object, without a head
_HEADED = (3, 4, 5)  # those with a head line
_HEAD_FIELDS = {"snapshot", "covered", "conversation", "status", "crc"}
# The fastest level: encoding runs on the worker's loop at its checkpoints, and the state's
# JSON deflates about as well at 1 as at 6.
DEFLATE_LEVEL = 1
WATERMARK_VERSION = 1  # watermarks did not change with the snapshots' v2
# What a v1 snapshot says of an attempt it holds closed: that it failed, for a reason the
# version did not record (see `_upcast_verdict`).
UNRECORDED_VERDICT = "why is not recorded in the version 1 snapshot the turn was read from"
_MAX_INT = 2**53  # as on the wire of the events: exact in any JSON reader

_ROLES = ("user", "assistant")
_INPUT_KINDS: tuple[InputKind, ...] = get_args(InputKind)
_OPERATION_STATUSES: tuple[OperationStatus, ...] = get_args(OperationStatus)
_ATTEMPT_STATES: tuple[AttemptState, ...] = get_args(AttemptState)
_OUTCOMES: tuple[OutcomeKind, ...] = get_args(OutcomeKind)
_Choice = TypeVar("_Choice", bound=str)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Snapshot:
    state: ConversationState
    covered: int  # offset of the last events-partition record the state includes


@dataclass(frozen=True, slots=True)
class SnapshotError:
    """Why bytes are not a snapshot this version can read (the decoder never raises)."""

    detail: str


@dataclass(frozen=True, slots=True)
class SnapshotHead:
    """What `peek_snapshot` reads of a snapshot without decoding its state: the offset it
    covers and the conversation's status in it. `state`: the state, when the version has no
    head to read alone (v1 and v2 are decoded whole)."""

    covered: int
    status: Status
    state: ConversationState | None = None


def encode_snapshot(state: ConversationState, covered: int) -> bytes:
    if not 0 <= covered < _MAX_INT:
        raise ValueError(f"covered offset {covered} is out of range")
    body = zlib.compress(orjson.dumps(_state(state)), DEFLATE_LEVEL)
    head = {"snapshot": SNAPSHOT_VERSION, "covered": covered, "conversation": state.conversation_id,
            "status": conversation_status(state), "crc": zlib.crc32(body)}  # fmt: skip
    return orjson.dumps(head) + b"\n" + body


def decode_snapshot(value: bytes | None, conversation_id: str | None = None) -> Snapshot | SnapshotError:
    """Bytes to a snapshot; with `conversation_id`, also checks that it is that conversation's
    (a snapshot stored under another key is as unusable as a corrupt one)."""
    try:
        head, body = _split(value, conversation_id)
        if isinstance(head, _Whole):
            return head.snapshot
        state = _read_state(_json(_inflate(body)), head.version)
        if state.conversation_id != head.conversation:
            _bad(f"a head of {head.conversation!r} on the state of {state.conversation_id!r}")
    except _Invalid as exc:
        return SnapshotError(str(exc))
    return Snapshot(state, head.covered)


def peek_snapshot(value: bytes | None, conversation_id: str | None = None) -> SnapshotHead | SnapshotError:
    """What a snapshot covers and the status it holds, reading only its head (v3; older
    versions are decoded whole). A damaged body is refused (its checksum); a body that
    passes it is the encoder's output and decodes."""
    try:
        head, _body = _split(value, conversation_id)
    except _Invalid as exc:
        return SnapshotError(str(exc))
    if isinstance(head, _Whole):
        whole = head.snapshot
        if isinstance(whole, SnapshotError):
            return whole
        return SnapshotHead(whole.covered, conversation_status(whole.state), whole.state)
    return SnapshotHead(head.covered, head.status)


@dataclass(frozen=True, slots=True)
class _Head:
    conversation: str
    covered: int
    status: Status
    version: int


@dataclass(frozen=True, slots=True)
class _Whole:
    """A snapshot of a version without a head, decoded whole."""

    snapshot: Snapshot | SnapshotError


def _split(value: bytes | None, conversation_id: str | None) -> tuple[_Head | _Whole, memoryview]:
    """A v3, v4 or v5 snapshot's head, checked (key, version, checksum), and its body (a view: a load
    checks the body of every snapshot and copies none); an older one whole."""
    if value is None:
        _bad("empty value")
    cut = value.find(b"\n")
    doc = None  # not a head: an older version (or not a snapshot), read whole below
    if cut >= 0:
        with contextlib.suppress(orjson.JSONDecodeError):
            doc = orjson.loads(value[:cut])
    if not isinstance(doc, dict) or "state" in doc:
        return _Whole(_decode_whole(value, conversation_id)), memoryview(b"")
    version = doc.get("snapshot")
    if version not in _HEADED or isinstance(version, bool):
        _bad(f"snapshot version {version!r} is not one of {list(_READABLE)}")
    if set(doc) != _HEAD_FIELDS:
        _bad(f"expected a head with exactly {sorted(_HEAD_FIELDS)}")
    conversation = _str(doc["conversation"])
    if conversation_id is not None and conversation != conversation_id:
        _bad(f"snapshot of {conversation!r} under the key {conversation_id!r}")
    body = memoryview(value)[cut + 1 :]
    if zlib.crc32(body) != doc["crc"]:
        _bad("the state does not match the head's checksum (damaged)")
    return _Head(conversation, _int(doc["covered"]), _choice(doc["status"], STATUSES), version), body


def _inflate(body: memoryview) -> bytes:
    try:
        return zlib.decompress(body)
    except zlib.error as exc:
        _bad(f"the state does not inflate: {exc}")


def _json(value: bytes) -> object:
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        _bad(f"not JSON: {exc}")


def _decode_whole(value: bytes, conversation_id: str | None) -> Snapshot | SnapshotError:
    """v1 and v2: one object `{"snapshot", "covered", "state"}`."""
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        return SnapshotError(f"not JSON: {exc}")
    try:
        if not isinstance(doc, dict) or set(doc) != {"snapshot", "covered", "state"}:
            _bad("expected an object with exactly snapshot, covered and state")
        version = doc["snapshot"]
        if version not in _WHOLE or isinstance(version, bool):
            _bad(f"snapshot version {version!r} is not one of {list(_WHOLE)} (v3 has a head line)")
        covered = _int(doc["covered"])
        state = _read_state(doc["state"], version)
    except _Invalid as exc:
        return SnapshotError(str(exc))
    if conversation_id is not None and state.conversation_id != conversation_id:
        return SnapshotError(f"snapshot of {state.conversation_id!r} under the key {conversation_id!r}")
    return Snapshot(state, covered)


# -- the state of v2 to v5 (as v1 but for the active turn and, since v5, history entries) ---------
def _state(s: ConversationState) -> list[Any]:
    """[conversation_id, events_applied, history, pending, active, turns, seen_inputs,
    claimed_by, rejected]; the last three are [key, value] pairs. A history entry is [role
    (0 user, 1 assistant), content, occurred_at, turn_id, outcome or null, withheld (0 or 1;
    since v5)]."""
    return [
        s.conversation_id,
        s.events_applied,
        [[_ROLES.index(h.role), h.content, h.occurred_at, h.turn_id, h.outcome, int(h.withheld)] for h in s.history],
        [_input_v1(p) for p in s.pending.values()],
        None if s.active is None else _active_v4(s.active),
        [_turn_v1(t) for t in s.turns.values()],
        list(s.seen_inputs.items()),
        list(s.claimed_by.items()),
        list(s.rejected.items()),
    ]


def _input_v1(p: PendingInput) -> list[Any]:
    """[input_id, kind, content, occurred_at, source, grant]; grant is
    [turn_id, call_id, tool, arguments, approved] or null."""
    grant = None if p.grant is None else [p.grant.turn_id, p.grant.call_id, p.grant.tool, p.grant.arguments,
                                          p.grant.approved]  # fmt: skip
    return [p.input_id, p.kind, p.content, p.occurred_at, p.source, grant]


def _active_v4(a: ActiveTurn) -> list[Any]:
    """[turn_id, inputs, history_boundary, claimed_at, run_id, attempt, attempt_state, model,
    iterations, tool_calls, input_tokens, output_tokens, cached_input_tokens,
    cache_write_tokens, reasoning_tokens, cost_usd, fallbacks, operations ([call_id, tool,
    side_effect, status] each), invalid_calls ([signature, n] pairs), step_ids (sorted),
    journal (the events, each in the events' own wire encoding), verdict ([retryable,
    reason, at] or null; since v2), stops (since v4)]."""
    verdict = None if a.verdict is None else [a.verdict.retryable, a.verdict.reason, a.verdict.at]
    return [
        a.turn_id,
        [_input_v1(i) for i in a.inputs],
        a.history_boundary,
        a.claimed_at,
        a.run_id,
        a.attempt,
        a.attempt_state,
        a.model,
        a.iterations,
        a.tool_calls,
        a.input_tokens,
        a.output_tokens,
        a.cached_input_tokens,
        a.cache_write_tokens,
        a.reasoning_tokens,
        a.cost_usd,
        a.fallbacks,
        [[o.call_id, o.tool, o.side_effect, o.status] for o in a.operations.values()],
        list(a.invalid_calls.items()),
        sorted(a.step_ids),
        [orjson.Fragment(encode(e)) for e in a.journal],
        verdict,
        a.stops,
    ]


def _turn_v1(t: TurnRecord) -> list[Any]:
    """[turn_id, input_ids, outcome, attempts, pending_call]; pending_call is
    [call_id, name, arguments] or null."""
    call = None if t.pending_call is None else [t.pending_call.call_id, t.pending_call.name, t.pending_call.arguments]
    return [t.turn_id, list(t.input_ids), t.outcome, t.attempts, call]


# -- decoding v1, v2 and the body of v3 to v5 ------------------------------------------------------------------------
class _Invalid(Exception):
    pass


def _bad(detail: str) -> NoReturn:
    raise _Invalid(detail)


def _list(value: object, length: int | None = None) -> list[Any]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        _bad(f"expected an array{'' if length is None else f' of {length}'}, got {_shown(value)}")
    return value


def _of(value: object, kind: type[_T], what: str) -> _T:
    if not isinstance(value, kind):
        _bad(f"expected {what}, got {_shown(value)}")
    return value


def _str(value: object) -> str:
    return _of(value, str, "a string")


def _opt_str(value: object) -> str | None:
    return None if value is None else _str(value)


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _MAX_INT:
        _bad(f"expected a non-negative integer, got {_shown(value)}")
    return value


def _bool(value: object) -> bool:
    return _of(value, bool, "true or false")


def _choice(value: object, choices: tuple[_Choice, ...]) -> _Choice:
    for choice in choices:
        if value == choice:
            return choice
    _bad(f"expected one of {list(choices)}, got {_shown(value)}")


def _pairs(value: object) -> dict[str, str]:
    return {_str(k): _str(v) for k, v in (_list(pair, 2) for pair in _list(value))}


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _read_state(value: object, version: int) -> ConversationState:
    (conversation, applied, history, pending, active, turns, seen, claimed, rejected) = _list(value, 9)
    inputs = [_read_input_v1(p) for p in _list(pending)]
    records = [_read_turn_v1(t) for t in _list(turns)]
    return ConversationState(
        conversation_id=_str(conversation),
        history=_read_histories(history, version),
        pending={p.input_id: p for p in inputs},
        active=None if active is None else _read_active(active, version),
        turns={t.turn_id: t for t in records},
        seen_inputs=_pairs(seen),
        claimed_by=_pairs(claimed),
        rejected=_pairs(rejected),
        events_applied=_int(applied),
    )


def _read_histories(value: object, version: int) -> list[HistoryEntry]:
    history = [_read_history(h, version) for h in _list(value)]
    return history if version >= 5 else _upcast_withheld(history)


def _read_history(value: object, version: int) -> HistoryEntry:
    role, content, at, turn, outcome, *rest = _list(value, 6 if version >= 5 else 5)
    if not _zero_or_one(role):
        _bad(f"expected a role of 0 or 1, got {_shown(role)}")
    kind = None if outcome is None else _choice(outcome, _OUTCOMES)
    withheld = bool(rest and rest[0])  # (none recorded before v5)
    if rest and not (_zero_or_one(rest[0]) and (role == 0 or not withheld)):
        _bad(f"expected withheld as 0 or 1 (0 for an answer), got {_shown(rest[0])}")
    return HistoryEntry("user" if role == 0 else "assistant", _str(content), _int(at), _str(turn), kind, withheld)


def _zero_or_one(value: object) -> bool:
    return type(value) is int and value in (0, 1)  # (not True, not 1.0)


# The note a refused turn closes with in history, in every version: which turns of a
# snapshot of before v5 were refused.
_REFUSED_NOTE = f"{FAILED_NOTE}{REFUSAL_ERROR}"


def _upcast_withheld(history: list[HistoryEntry]) -> list[HistoryEntry]:
    refused = {h.turn_id for h in history if h.outcome == "failed" and h.content.startswith(_REFUSED_NOTE)}
    for entry in history:
        entry.withheld = entry.role == "user" and entry.turn_id in refused
    return history


def _read_input_v1(value: object) -> PendingInput:
    input_id, kind, content, at, source, grant = _list(value, 6)
    approval = None
    if grant is not None:
        turn, call, tool, arguments, approved = _list(grant, 5)
        approval = ApprovalGrant(_str(turn), _str(call), _str(tool), _str(arguments), _bool(approved))
    return PendingInput(_str(input_id), _choice(kind, _INPUT_KINDS), _str(content), _int(at), _opt_str(source),
                        approval)  # fmt: skip


def _read_active(value: object, version: int) -> ActiveTurn:
    fields = _list(value, {1: 21, 2: 22, 3: 22}.get(version, 23))
    (turn, inputs, boundary, claimed_at, run, attempt, attempt_state, model, iterations, tool_calls,
     input_tokens, output_tokens, cached, cache_write, reasoning, cost, fallbacks, operations, invalid, steps,
     journal) = fields[:21]  # fmt: skip
    state = _choice(attempt_state, _ATTEMPT_STATES)
    verdict = _upcast_verdict(state) if version == 1 else _read_verdict(fields[21], state)
    if cost is not None and (not isinstance(cost, int | float) or isinstance(cost, bool)):
        _bad(f"expected a cost or null, got {_shown(cost)}")
    ops = {}
    for op in _list(operations):
        call, tool, side_effect, status = _list(op, 4)
        ops[_str(call)] = Operation(_str(call), _str(tool), _bool(side_effect), _choice(status, _OPERATION_STATUSES))
    return ActiveTurn(
        turn_id=_str(turn),
        inputs=tuple(_read_input_v1(i) for i in _list(inputs)),
        history_boundary=_int(boundary),
        claimed_at=_int(claimed_at),
        run_id=_str(run),
        attempt=_int(attempt),
        attempt_state=state,
        verdict=verdict,
        model=_opt_str(model),
        iterations=_int(iterations),
        tool_calls=_int(tool_calls),
        input_tokens=_int(input_tokens),
        output_tokens=_int(output_tokens),
        cached_input_tokens=_int(cached),
        cache_write_tokens=_int(cache_write),
        reasoning_tokens=_int(reasoning),
        cost_usd=None if cost is None else float(cost),
        fallbacks=_int(fallbacks),
        operations=ops,
        invalid_calls={_str(k): _int(n) for k, n in (_list(pair, 2) for pair in _list(invalid))},
        step_ids={_str(s) for s in _list(steps)},
        journal=[_read_event(e) for e in _list(journal)],
        stops=_int(fields[22]) if version >= 4 else _upcast_stops(_int(attempt), verdict),
    )


def _upcast_stops(attempt: int, verdict: AttemptVerdict | None) -> int:
    """How many of the attempts a v1-v3 snapshot holds were stopped, which it did not record:
    the current one when its verdict says a takeover closed it, and every earlier one, as if
    each had been. Exact for a turn on its first attempt; past it, a turn carried across the
    upgrade is not failed for attempts a stop may have used (a deploy is what cuts them):
    its model gets its whole allowance again, at worst, and stops stay bounded. Of the
    readings, the one that does not fail a turn the events, folded, would carry on (within
    the bound on stops)."""
    return attempt - 1 + int(verdict is not None and verdict.reason == STOPPED_MID_ATTEMPT)


def _upcast_verdict(state: AttemptState) -> AttemptVerdict | None:
    """A v1 snapshot holds no verdict. Of an attempt it holds closed, it is read as failed,
    not retryable: the one reading that cannot run on a turn whose owner decided it fails
    (rule 9) -- a new attempt from it, fresh or resuming, might repeat what that owner had
    ruled out, whereas failing a turn that could have been retried or resumed is visible
    and costs nothing twice. Closed is a window of seconds (a backoff, or between a
    takeover's two events), so a v1 snapshot taken in it is rare."""
    return AttemptVerdict(retryable=False, reason=UNRECORDED_VERDICT, at=0) if state == "closed" else None


def _read_verdict(value: object, state: AttemptState) -> AttemptVerdict | None:
    if value is None:
        if state == "closed":
            _bad("a closed attempt without its verdict")
        return None
    if state != "closed":
        _bad(f"a verdict on an attempt that is {state}")
    retryable, reason, at = _list(value, 3)
    return AttemptVerdict(_bool(retryable), _str(reason), _int(at))


def _read_event(value: object) -> Event:
    # The journal's events were accepted by the fold once: they decode by the events' own
    # codec (and its upcasters), without the size limit of a record.
    event = decode(orjson.dumps(value), None)
    if isinstance(event, DecodeError):
        _bad(f"journal event: {event.reason}: {event.detail}")
    return event


def _read_turn_v1(value: object) -> TurnRecord:
    turn, input_ids, outcome, attempts, call = _list(value, 5)
    pending_call = None
    if call is not None:
        call_id, name, arguments = _list(call, 3)
        try:
            pending_call = ToolCall(call_id=_str(call_id), name=_str(name), arguments=_str(arguments))
        except ValidationError as exc:
            _bad(f"pending call: {exc.errors()[0]['msg']}")
    return TurnRecord(_str(turn), tuple(_str(i) for i in _list(input_ids)), _choice(outcome, _OUTCOMES),
                      _int(attempts), pending_call)  # fmt: skip


# -- watermarks ---------------------------------------------------------------------------------
# One record per partition of the snapshot topic, under the empty key (no conversation id is
# empty), says: every conversation with an event below `offset` has a snapshot on the topic,
# written before this record, that includes all its events below `offset`; so a reader can
# start the events partition at `offset`.
WATERMARK_KEY = ""


def encode_watermark(offset: int) -> bytes:
    if not 0 <= offset < _MAX_INT:
        raise ValueError(f"watermark offset {offset} is out of range")
    return orjson.dumps({"watermark": WATERMARK_VERSION, "offset": offset})


def decode_watermark(value: bytes | None) -> int | SnapshotError:
    try:
        doc = orjson.loads(value) if value is not None else None
        if not isinstance(doc, dict) or set(doc) != {"watermark", "offset"} or doc["watermark"] != WATERMARK_VERSION:
            _bad(f"not a version {WATERMARK_VERSION} watermark")
        return _int(doc["offset"])
    except (orjson.JSONDecodeError, _Invalid) as exc:
        return SnapshotError(str(exc))

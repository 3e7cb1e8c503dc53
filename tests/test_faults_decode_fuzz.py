"""Scenario 5, the decoder: `events.decode` never raises, whatever the bytes, and every
valid event round-trips. Over 10,000 generated values in all: random bytes, random JSON,
JSON-shaped mutations of valid events of every kind, and generated valid events."""

from __future__ import annotations

import json
from typing import Any

import orjson
from builders import claim, completed, message, started
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile.events import (
    Approval,
    AttemptFailed,
    DecodeError,
    InputInjected,
    MessageReceived,
    ModelResponded,
    OperationRecord,
    ResumeRequested,
    ToolCall,
    ToolCallFinished,
    ToolCallStarted,
    TurnClaimed,
    TurnFailed,
    TurnPaused,
    Usage,
    decode,
    encode,
)
from turnstile.events.upcast import Upcasters

REASONS = {"not_json", "invalid_event", "too_large"}


def fuzz(examples: int) -> settings:
    """Examples per test: 3000 + 500 + 2000 + 4000 + 1500 + 1000 = 12,000 generated values in all."""
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )


def check(value: bytes | None, max_bytes: int = 1_000_000) -> None:
    result = decode(value, max_bytes)  # must not raise
    if isinstance(result, DecodeError):
        assert result.reason in REASONS and isinstance(result.detail, str)
    else:
        assert decode(encode(result)) == result  # whatever was accepted re-encodes to itself


def _templates() -> list[dict[str, Any]]:
    c = claim(["m1", "m2"], 10, 0)
    turn = {"conversation_id": c.conversation_id, "turn_id": c.turn_id, "run_id": c.run_id, "attempt": 1}
    events = [
        message("m1", 5),
        c,
        started(c, 11),
        completed(c, 20),
        InputInjected(
            event_id="e-i", conversation_id=c.conversation_id, occurred_at=3, occurrence_key="k",
            source="approval", content="Approved.", approval=Approval(turn_id="t", call_id="c", approved=True),
        ),
        ResumeRequested(event_id="e-r", conversation_id=c.conversation_id, occurred_at=4, request_id="r",
                        resumes_turn_id="t"),
        ModelResponded(event_id="e-m", occurred_at=12, iteration=1, model="m", text="hi",
                       tool_calls=(ToolCall(call_id="c1", name="search", arguments='{"q": 1}'),),
                       usage=Usage(input_tokens=3, output_tokens=4), cost_usd=0.5, **turn),
        ToolCallStarted(event_id="e-s", occurred_at=13, iteration=1, call_id="c1", tool="search",
                        arguments="{}", side_effect=True, **turn),
        ToolCallFinished(event_id="e-f", occurred_at=14, iteration=1, call_id="c1", ok=True, result="r", **turn),
        AttemptFailed(event_id="e-a", occurred_at=15, reason="timeout", retryable=True, **turn),
        TurnFailed(event_id="e-t", occurred_at=16, statuses={"m1": "failed"}, metrics=completed(c, 16).metrics,
                   operations=(OperationRecord(call_id="c1", tool="x", side_effect=True, status="unknown"),),
                   error="boom", **turn),
        TurnPaused(event_id="e-p", occurred_at=17, statuses={"m1": "paused"}, metrics=completed(c, 17).metrics,
                   reason="approval", kept="k", resume_hint="h",
                   pending_call=ToolCall(call_id="c2", name="transfer", arguments="{}"), **turn),
    ]  # fmt: skip
    return [orjson.loads(encode(e)) for e in events]


TEMPLATES = _templates()
TYPES = [*sorted({t["type"] for t in TEMPLATES}), "Nope", "", "messagereceived"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
# Values that look like fields: the kinds of things a buggy producer writes.
field_values = json_values | st.sampled_from(
    ["", "x" * 300, -1, 0, 2**53, 2**64, 10**30, 1.5, True, None, [], {}, "2024-01-01", {"nested": {"a": []}}]
)


@fuzz(3000)
@given(st.binary(max_size=600))
def test_random_bytes_never_raise(value: bytes) -> None:
    check(value)


@fuzz(500)
@given(st.binary(max_size=64), st.integers(min_value=0, max_value=80))
def test_random_bytes_against_a_small_limit_never_raise(value: bytes, limit: int) -> None:
    check(value, limit)


@fuzz(2000)
@given(json_values)
def test_random_json_never_raises(value: Any) -> None:
    # json.dumps (not orjson) so that integers beyond 64 bits get onto the wire too.
    check(json.dumps(value).encode())


@st.composite
def mutated_event(draw: st.DrawFn) -> bytes:
    obj = dict(draw(st.sampled_from(TEMPLATES)))
    for _ in range(draw(st.integers(1, 3))):
        keys = sorted(obj)
        op = draw(st.sampled_from(["drop", "set", "add", "type", "version", "nest"]))
        if op == "drop" and keys:
            obj.pop(draw(st.sampled_from(keys)))
        elif op == "set" and keys:
            obj[draw(st.sampled_from(keys))] = draw(field_values)
        elif op == "add":
            obj[draw(st.text(max_size=12))] = draw(field_values)
        elif op == "type":
            obj["type"] = draw(st.sampled_from(TYPES))
        elif op == "version":
            obj["schema_version"] = draw(st.sampled_from([0, 1, 2, -1, "1", 1.0, None, 2**70]))
        elif op == "nest" and keys:
            key = draw(st.sampled_from(keys))
            obj[key] = [obj[key]] if draw(st.booleans()) else {"value": obj[key]}
    raw = json.dumps(obj).encode()
    cut = draw(st.sampled_from(["whole", "whole", "whole", "truncate", "flip"]))
    if cut == "truncate" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif cut == "flip" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
    return raw


@fuzz(4000)
@given(mutated_event())
def test_mutations_of_valid_events_never_raise(value: bytes) -> None:
    check(value)


ids = st.text(min_size=1, max_size=40)
content = st.text(min_size=1, max_size=200)


@st.composite
def valid_event(draw: st.DrawFn) -> Any:
    conv, at = draw(ids), draw(st.integers(0, 2**53 - 1))
    inputs = draw(st.lists(ids, min_size=1, max_size=5, unique=True))
    kind = draw(st.sampled_from(["message", "claim", "responded", "injected"]))
    if kind == "message":
        return MessageReceived(event_id=draw(ids), conversation_id=conv, occurred_at=at, message_id=draw(ids),
                               content=draw(content))
    if kind == "claim":
        c = claim(inputs, at, draw(st.integers(0, 10**6)), run_id=draw(ids), conv=conv)
        return c
    if kind == "injected":
        return InputInjected(event_id=draw(ids), conversation_id=conv, occurred_at=at, occurrence_key=draw(ids),
                             source=draw(st.sampled_from(["schedule", "event"])), content=draw(content))
    c = claim(inputs, at, 0, conv=conv)
    return ModelResponded(
        event_id=draw(ids), conversation_id=conv, occurred_at=at, turn_id=c.turn_id, run_id=draw(ids),
        attempt=draw(st.integers(1, 10)), iteration=draw(st.integers(1, 100)), model=draw(ids),
        text=draw(st.none() | content), usage=Usage(input_tokens=draw(st.integers(0, 10**9)), output_tokens=0),
        cost_usd=draw(st.none() | st.floats(0, 1e6, allow_nan=False)),
    )  # fmt: skip


@fuzz(1500)
@given(valid_event())
def test_valid_events_round_trip(event: Any) -> None:
    raw = encode(event)
    assert decode(raw) == event
    assert isinstance(decode(raw), TurnClaimed | MessageReceived | InputInjected | ModelResponded)


# The slow path: with an upcaster registered, values that fail validation (or carry an older
# schema_version) are parsed again and upcast. It must not raise either.
UPCASTING = Upcasters(current=2).with_step(1, lambda raw: {**raw, "schema_version": 2})


@fuzz(1000)
@given(st.one_of(mutated_event(), json_values.map(lambda v: json.dumps(v).encode())))
def test_the_upcasting_path_never_raises(value: bytes) -> None:
    result = decode(value, upcasters=UPCASTING)  # must not raise
    assert isinstance(result, DecodeError) or result.schema_version >= 1


def test_a_value_orjson_cannot_parse_is_refused_on_the_upcasting_path() -> None:
    value = orjson.loads(encode(message("m1", 5))) | {"extra": 1}
    raw = json.dumps(value).replace('"extra": 1', '"extra": 1e400').encode()
    result = decode(raw, upcasters=UPCASTING)
    assert isinstance(result, DecodeError)

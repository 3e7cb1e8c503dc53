"""The wire contract: every event round-trips, and bad bytes become a reason, never an exception."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest
from builders import claim, completed, message, started
from log_generator import generated_log

from turnstile.events import DeadLetter, DecodeError, MessageReceived, decode, decode_record, encode

GOLDEN = Path(__file__).parent / "golden" / "v1"


@pytest.mark.parametrize(
    "event",
    [message("m1", 5), claim(["m1"], 10, 0), started(claim(["m1"], 10, 0), 11), completed(claim(["m1"], 10, 0), 20)],
)
def test_every_event_round_trips_through_json(event):
    raw = encode(event)
    assert decode(raw) == event
    assert orjson.loads(raw)["type"] == event.type  # readable by any JSON consumer


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"type": "MessageReceived", "event_id"', "not_json"),
        (b"\xff\xfe", "not_json"),
        (None, "not_json"),
        (b'{"type": "SomethingElse", "event_id": "e"}', "invalid_event"),
        (b'{"type": "MessageReceived", "event_id": "e", "conversation_id": "c", "occurred_at": "soon",'
         b' "message_id": "m", "content": "x"}', "invalid_event"),
        (b'[1, 2, 3]', "invalid_event"),
        # strict, as the published JSON Schema: a number in a string, or a boolean, is no integer
        (b'{"type": "MessageReceived", "event_id": "e", "conversation_id": "c", "occurred_at": "1767225600000",'
         b' "message_id": "m", "content": "x"}', "invalid_event"),
        (b'{"type": "MessageReceived", "event_id": "e", "conversation_id": "c", "occurred_at": true,'
         b' "message_id": "m", "content": "x"}', "invalid_event"),
        (b'{"type": "MessageReceived", "schema_version": true, "event_id": "e", "conversation_id": "c",'
         b' "occurred_at": 1, "message_id": "m", "content": "x"}', "invalid_event"),
    ],
)
def test_bad_values_decode_to_a_reason(raw, reason):
    result = decode(raw)
    assert isinstance(result, DecodeError)
    assert result.reason == reason
    assert result.detail


@pytest.mark.parametrize("number", [b"1767225600000.0", b"1.7672256e12", b"17672256000e2"])
def test_an_integer_written_as_a_whole_double_is_the_integer_the_schema_says_it_is(number):
    # JSON Schema's integer is any number whose fraction is zero, and a serializer of doubles
    # (Java's, Go's) writes one so: the published schema takes it, so the worker must.
    raw = (b'{"type": "MessageReceived", "schema_version": 1.0, "event_id": "e", "conversation_id": "c",'
           b' "occurred_at": ' + number + b', "message_id": "m", "content": "hi"}')  # fmt: skip
    event = decode(raw)
    assert isinstance(event, MessageReceived) and event.occurred_at == 1767225600000 and event.schema_version == 1
    assert encode(event).count(b'"occurred_at":1767225600000,') == 1  # written back as an integer


@pytest.mark.parametrize("other", [b"NaN", b"Infinity", b"1e400", b"-Infinity"])
def test_a_whole_double_beside_a_number_orjson_refuses_is_refused_not_raised(other):
    # (the validator reads NaN and 1e400; the second read, by orjson, does not: never an
    # exception out of decode, which would stop the partition)
    raw = (b'{"type": "MessageReceived", "event_id": "e", "conversation_id": "c", "occurred_at": 1767225600000.0,'
           b' "message_id": "m", "content": "hi", "x": ' + other + b"}")  # fmt: skip
    refused = decode(raw)
    assert isinstance(refused, DecodeError) and refused.reason == "invalid_event"


@pytest.mark.parametrize("number", [b"1767225600000.5", b"1e300", b"9007199254740992.0"])
def test_a_number_with_a_fraction_or_past_the_bound_is_still_no_integer(number):
    raw = (b'{"type": "MessageReceived", "event_id": "e", "conversation_id": "c",'
           b' "occurred_at": ' + number + b', "message_id": "m", "content": "hi"}')  # fmt: skip
    refused = decode(raw)
    assert isinstance(refused, DecodeError) and refused.reason == "invalid_event" and "occurred_at" in refused.detail


def test_unknown_fields_are_refused_not_dropped():
    value = orjson.loads(encode(message("m1", 5)))
    value["surprise"] = 1
    result = decode(orjson.dumps(value))
    assert isinstance(result, DecodeError) and "surprise" in result.detail


def test_a_protocol_failure_nothing_was_billed_for_is_written_as_before_its_usage_fields_existed():
    # Such bytes are what a reader of the version before accepts (unknown fields are refused).
    golden = (GOLDEN / "ProtocolFailure.json").read_bytes()
    assert orjson.loads(encode(decode(golden))) == orjson.loads(golden)
    billed = (GOLDEN / "ProtocolFailure.billed.json").read_bytes()
    assert orjson.loads(encode(decode(billed))) == orjson.loads(billed)


def test_a_protocol_failure_dumps_with_pydantics_own_options():
    failure = decode((GOLDEN / "ProtocolFailure.json").read_bytes())
    assert "usage" not in failure.model_dump(exclude_none=True)
    assert failure.model_dump(include={"type", "kind"}) == {"type": "ProtocolFailure", "kind": "unknown_tool"}
    assert "cost_usd" not in failure.model_dump(exclude={"usage"}, mode="json")


def test_a_protocol_failure_with_a_cost_but_no_usage_is_refused():
    value = orjson.loads((GOLDEN / "ProtocolFailure.billed.json").read_bytes())
    del value["usage"]
    result = decode(orjson.dumps(value))
    assert isinstance(result, DecodeError) and "needs usage" in result.detail



@pytest.mark.parametrize(
    ("key", "detail"),
    [
        (None, "key None is not the conversation id 'conv-1'"),
        (b"evil", "key 'evil' is not the conversation id 'conv-1'"),
        (b"conv-1 ", "key 'conv-1 ' is not the conversation id 'conv-1'"),
        (b"\xff", "key '\ufffd' is not the conversation id 'conv-1'"),
        (b"k" * 1_040_000, f"key '{'k' * 300}' (its first 300 of 1,040,000 bytes) is not the conversation id 'conv-1'"),
    ],
)
def test_a_record_under_a_key_other_than_its_conversation_is_not_an_event_of_it(key, detail):
    event = message("m1", 5, conv="conv-1")
    assert decode_record(b"conv-1", encode(event)) == event
    assert decode_record(key, encode(event)) == DecodeError("key_mismatch", detail)

def test_values_over_the_limit_are_refused_before_parsing():
    result = decode(encode(message("m1", 5, content="x" * 5000)), max_bytes=1000)
    assert isinstance(result, DecodeError) and result.reason == "too_large"


def test_dead_letter_keeps_the_original_bytes():
    letter = DeadLetter.of("t", 3, 42, b"conv", b"\xff not json", "not_json", "bad")
    back = DeadLetter.model_validate_json(letter.encode())
    assert back.original_value() == b"\xff not json"
    assert (back.partition, back.offset, back.reason) == (3, 42, "not_json")


def test_the_wire_bytes_are_the_compact_json_of_the_event_dump_for_generated_logs_and_edge_values():
    # `encode` serialises in pydantic-core; the bytes must stay exactly orjson's compact dump
    # of the JSON-mode dict (what earlier releases wrote): same key order, escapes, floats.
    events = [e for seed in range(5) for e in generated_log(random.Random(seed), 10, 300)]
    priced = next(e for e in events if getattr(e, "cost_usd", None) is not None)
    events += [priced.model_copy(update={"cost_usd": v}) for v in (0.1 + 0.2, 1e-7, 5e-324, 1e16, 1e300, 0.0)]
    first = next(e for e in events if isinstance(e, MessageReceived))
    events += [first.model_copy(update={"content": s}) for s in ("é中😀", '\x00\x1f"\\/', "\u2028\u2029", "")]
    assert [encode(e) for e in events] == [orjson.dumps(e.model_dump(mode="json")) for e in events]

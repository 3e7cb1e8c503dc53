"""The wire contract: every event round-trips, and bad bytes become a reason, never an exception."""

from __future__ import annotations

import orjson
import pytest
from builders import claim, completed, message, started

from turnstile.events import DeadLetter, DecodeError, decode, encode


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
    ],
)
def test_bad_values_decode_to_a_reason(raw, reason):
    result = decode(raw)
    assert isinstance(result, DecodeError)
    assert result.reason == reason
    assert result.detail


def test_unknown_fields_are_refused_not_dropped():
    value = orjson.loads(encode(message("m1", 5)))
    value["surprise"] = 1
    result = decode(orjson.dumps(value))
    assert isinstance(result, DecodeError) and "surprise" in result.detail


def test_values_over_the_limit_are_refused_before_parsing():
    result = decode(encode(message("m1", 5, content="x" * 5000)), max_bytes=1000)
    assert isinstance(result, DecodeError) and result.reason == "too_large"


def test_dead_letter_keeps_the_original_bytes():
    letter = DeadLetter.of("t", 3, 42, b"conv", b"\xff not json", "not_json", "bad")
    back = DeadLetter.model_validate_json(letter.encode())
    assert back.original_value() == b"\xff not json"
    assert (back.partition, back.offset, back.reason) == (3, 42, "not_json")

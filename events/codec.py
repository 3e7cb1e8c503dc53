"""The wire codec: events out as compact JSON bytes, bytes in as validated events.

`decode` never raises: a consumer must be able to route any byte string it meets to the
dead-letter topic with a reason, and keep its partition moving.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from pydantic import ValidationError

from turnstile.events.base import MAX_INT
from turnstile.events.identity import partition_for
from turnstile.events.union import EVENT_ADAPTER, Event
from turnstile.events.upcast import UPCASTERS, UpcastError, Upcasters


@dataclass(frozen=True, slots=True)
class DecodeError:
    """Why a value was not accepted. `reason` is a short stable code, `detail` is for people."""

    # not_json | invalid_event | too_large | key_mismatch | conflicting_duplicate | unreadable |
    # wrong_partition (`misplaced`)
    reason: str
    detail: str


def encode(event: Event) -> bytes:
    """The event's compact JSON, by pydantic-core straight to bytes: the same bytes as
    `orjson.dumps(event.model_dump(mode="json"))` (`tests/test_codec.py` holds it to that) in
    half its time, with no dict built on the way."""
    return event.__pydantic_serializer__.to_json(event)


def decode(
    value: bytes | None, max_bytes: int | None = None, upcasters: Upcasters = UPCASTERS
) -> Event | DecodeError:
    """Bytes to a current-version event. Values of an older `schema_version` are brought to
    the current shape by `upcasters` before validation; current values take the fast path.
    `max_bytes` None (the default): no limit of its own, what the topic accepted -- a reader
    with a lower one would not see what the worker folded (a value between the two)."""
    if value is None:
        return DecodeError("not_json", "empty value (tombstone)")
    if max_bytes is not None and len(value) > max_bytes:
        return DecodeError("too_large", f"value is {len(value)} bytes, the limit is {max_bytes}")
    try:
        event = _validated(value)
    except ValidationError as exc:
        error = _classify(exc)
        if not upcasters or error.reason != "invalid_event":
            return error
        return _decode_upcast(value, upcasters, error)
    if upcasters and event.schema_version < upcasters.current:
        return _decode_upcast(value, upcasters, None)
    return event


def _validated(value: bytes) -> Event:
    """Strict, as the published JSON Schema: "1767225600000" or true is no integer. But
    1767225600000.0 is one (JSON Schema's integer is any number whose fraction is zero, as a
    serializer of doubles writes it), so such a value is read with its integers as integers."""
    try:
        return EVENT_ADAPTER.validate_json(value, strict=True)
    except ValidationError as exc:
        if not any(e["type"] == "int_type" and _integral(e["input"]) for e in exc.errors(include_url=False)):
            raise
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError:  # valid for the validator, not for orjson (NaN, 1e400)
            raise exc from None
    return EVENT_ADAPTER.validate_json(orjson.dumps(_as_ints(doc)), strict=True)


def _integral(number: object) -> bool:
    return isinstance(number, float) and number.is_integer() and abs(number) < MAX_INT


def _as_ints(doc: object) -> object:
    """The JSON document with its integral numbers as integers (a float field takes them)."""
    if _integral(doc):
        return int(doc)  # type: ignore[call-overload]
    if isinstance(doc, dict):
        return {k: _as_ints(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_as_ints(v) for v in doc]
    return doc


def misplaced(event: Event, partition: int, partitions: int | None) -> DecodeError | None:
    """Why a record of `event` in `partition` is not where its conversation's events are (None:
    it is, or the partition count is unknown). Such a record -- from a producer whose
    partitioner is not Kafka's murmur2, or one naming a partition -- folded, would split its
    conversation across partitions, each owner with part of its history: every reader refuses
    it, by the partition count alone, so every replay decides alike."""
    home = None if partitions is None else partition_for(event.conversation_id, partitions)
    if home is None or home == partition:
        return None
    detail = f"conversation {event.conversation_id!r} is in partition {home} of {partitions} (murmur2 of its key)"
    return DecodeError("wrong_partition", detail)


KEY_SHOWN_BYTES = 300


def decode_record(
    key: bytes | None, value: bytes | None, max_bytes: int | None = None, upcasters: Upcasters = UPCASTERS
) -> Event | DecodeError:
    """The event a record of the events topic carries, as every reader judges it: its value
    decoded, under its conversation id as the key. A record under another key is not where
    that conversation's events are (Kafka's partitioner puts each key in its partition), so
    the workers dead-letter it and no reader folds it."""
    event = decode(value, max_bytes, upcasters)
    if isinstance(event, DecodeError) or key == event.conversation_id.encode():
        return event
    # A key may be as large as a record (a megabyte): its reason is read by people.
    text = key[:KEY_SHOWN_BYTES].decode("utf-8", "replace") if key is not None else None
    long = key is not None and len(key) > KEY_SHOWN_BYTES
    cut = f" (its first {KEY_SHOWN_BYTES} of {len(key or b''):,} bytes)" if long else ""
    return DecodeError("key_mismatch", f"key {text!r}{cut} is not the conversation id {event.conversation_id!r}")


def _decode_upcast(value: bytes, upcasters: Upcasters, error: DecodeError | None) -> Event | DecodeError:
    """The slow path: parse, upcast to the current version, validate. `error` is what the
    fast path said; it stands when the value was current already (upcasting cannot help)."""
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError as exc:  # valid for the validator, not for orjson (e.g. 1e400)
        return error or DecodeError("not_json", str(exc))
    if not isinstance(raw, dict):
        return error or DecodeError("invalid_event", "the value is not a JSON object")
    version = raw.get("schema_version", upcasters.current)
    if error is not None and version == upcasters.current:
        return error
    try:
        # As JSON again: strict as the fast path (a number never from a string, nor a bool).
        return EVENT_ADAPTER.validate_json(orjson.dumps(upcasters.upcast(raw)), strict=True)
    except ValidationError as exc:
        return _classify(exc)
    except UpcastError as exc:
        return DecodeError("invalid_event", f"schema_version: {exc}")
    except Exception as exc:  # an upcaster that chokes on a malformed old value: still no raise
        return DecodeError("invalid_event", f"upcasting schema_version {version!r} failed: {exc!r}")


def _classify(exc: ValidationError) -> DecodeError:
    errors = exc.errors(include_url=False, include_input=False)
    if errors and errors[0]["type"] == "json_invalid":
        return DecodeError("not_json", str(errors[0]["msg"]))
    shown = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<value>'}: {e['msg']}" for e in errors[:5])
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return DecodeError("invalid_event", shown + more)
